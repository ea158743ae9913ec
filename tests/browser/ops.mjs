// The ops page in a real browser: asks for the admin token once, shows both replicas
// healthy, then follows replica-1 as the test pauses its replay (and then replica-2's).
//
// What the page draws comes from the service: the thresholds in force (the test runs the
// service with a non-default eviction threshold, STOCKGATE_EVICT_MS), and the rates, units
// held and store state of /v1/admin/overview.
//
// env: STOCKGATE_URL, STOCKGATE_ADMIN_TOKEN, STOCKGATE_EVICT_MS, SCREENSHOT_DIR
// protocol: prints READY; waits for PAUSED; prints STALE once replica-1 shows > 1 s;
//           waits for PAUSED_BOTH; prints DONE once fallbacks and `lagging` show.
import { check, done, env, expectLine, launch, say, screenshot, waitFor } from './lib.mjs';

const base = env('STOCKGATE_URL');
const token = env('STOCKGATE_ADMIN_TOKEN');
const evictMs = env('STOCKGATE_EVICT_MS');
const { browser, page, problems } = await launch();

const replica = (name) => `[data-replica="${name}"]`;

await page.goto(`${base}/ops`);
// No token yet: the page asks for one.
await waitFor(page, 'the token form', () => !document.getElementById('login').classList.contains('hidden'));
// A wrong token is refused, and the page asks again and says why.
await page.fill('#token-input', 'not-a-token');
await page.click('#token-submit');
await waitFor(page, 'the 401 for a wrong token', () => !document.getElementById('login').classList.contains('hidden')
  && document.getElementById('login-error').textContent.includes('401'));
await page.fill('#token-input', token);
await page.click('#token-submit');

const bothHealthy = () => ['replica-1', 'replica-2'].every((n) => {
  const card = document.querySelector(`[data-replica="${n}"]`);
  return card && card.dataset.state === 'healthy' && card.dataset.stalenessMs !== '';
});
await waitFor(page, 'both replicas healthy', bothHealthy);

// The token is kept for the tab: a reload does not ask again.
await page.reload();
await waitFor(page, 'both replicas healthy after a reload', bothHealthy);
check(await page.locator('#login').isHidden(), 'the page asked for the token again after a reload');

await waitFor(page, 'the policy table', () => {
  const td = document.querySelector('#policy tr[data-class="stock_gate"] td[data-budget-ms]');
  return td && td.dataset.budgetMs === '250' && document.querySelectorAll('#policy tbody tr').length >= 8;
});
await waitFor(page, 'the 7 units the test holds', () => {
  const row = document.querySelector('#holds tr[data-product="ops-demo"]');
  return row && row.children[1].textContent === '7';
});
await waitFor(page, 'the read-your-writes store', () => {
  const ryw = document.getElementById('ryw');
  return ryw.dataset.kind !== '' && ryw.dataset.healthy === 'true'
    && document.getElementById('ryw-failures').dataset.rate === '0.000';
});
await waitFor(page, 'the thresholds in force', (evict) => {
  const gate = document.getElementById('gate-budget');
  const ev = document.getElementById('evict-threshold');
  return gate.dataset.ms === '250' && gate.textContent === '250 ms'
    && ev.dataset.ms === evict && ev.textContent === `${Number(evict) / 1000} s`;
}, evictMs);
await waitFor(page, 'the 7 units held in all, and holds taken per second', () => {
  const total = document.getElementById('units-held-total');
  const taken = document.querySelector('#activity tr[data-kind="holds"][data-label="taken"] td[data-rate]');
  return total.dataset.units === '7' && taken && taken.dataset.rate !== '';
});
await waitFor(page, 'the span the rates cover', () => {
  const note = document.getElementById('rates-note');
  return Number(note.dataset.seconds) > 0 && note.textContent.startsWith('per second over the last');
});
// The test reads the stock gate in the background: those reads show up per second.
await waitFor(page, 'stock-gate reads per second from replicas', () => {
  const td = document.querySelector('#routing-rates tr[data-class="stock_gate"] td[data-target="replica"]');
  return td && Number(td.dataset.rate) > 0;
});
await waitFor(page, 'a staleness chart with its thresholds', (evict) => {
  const chart = document.querySelector('[data-replica="replica-1"] svg');
  return chart && Number(chart.dataset.points) >= 3
    && chart.querySelector('[data-threshold-ms="250"]') && chart.querySelector(`[data-threshold-ms="${evict}"]`);
}, evictMs);
await screenshot(page, 'ops-healthy.png');
say('READY');

await expectLine('PAUSED');
await waitFor(page, 'replica-1 shown over 1000 ms stale', () => {
  const card = document.querySelector('[data-replica="replica-1"]');
  return Number(card.dataset.stalenessMs) > 1000;
});
const shown = await page.locator(`${replica('replica-1')} [data-field="staleness"]`).textContent();
check(/^\d+\.\d s$/.test(shown), `replica-1's staleness reads "${shown}"`);
// Not asserted: on a loaded machine replica-2 may blip, and that is not this page's doing.
const other = await page.locator(replica('replica-2')).getAttribute('data-state');
say(`replica-1 shows ${shown} stale; replica-2 is ${other}`);
say('STALE');

await expectLine('PAUSED_BOTH');
// With both replicas behind, the stock gate falls back to the primary, and it shows.
await waitFor(page, 'stock-gate fallbacks to the primary', () => {
  const td = document.querySelector('#routing-rates tr[data-class="stock_gate"] td[data-target="fallbacks"]');
  return td && Number(td.dataset.rate) > 0
    && Number(document.getElementById('fallbacks-total').dataset.rate) > 0
    && document.querySelector('#fallback-reasons tr[data-class="stock_gate"][data-reason="no_fresh_replica"]');
});
await waitFor(page, 'replica-1 lagging (over the eviction threshold)', (evict) => {
  const card = document.querySelector('[data-replica="replica-1"]');
  return card.dataset.state === 'lagging'
    && card.querySelector('.badge.state').textContent === 'lagging'
    && Number(card.dataset.stalenessMs) > Number(evict);
}, evictMs);
await screenshot(page, 'ops.png');
await done(browser, problems);

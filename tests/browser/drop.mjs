// The shop page on a flash drop: "limit 1 per customer", a live countdown with buy disabled,
// the refusals as sentences, then "sale ended". Driven by tests/api/pages.rs, which moves the
// sale's start and end (PATCH) when this script says SALE_NOT_STARTED and LIMIT_EXCEEDED.
// env: STOCKGATE_URL, STOCKGATE_PRODUCT, STOCKGATE_USER_TOKEN, SCREENSHOT_DIR
import { check, done, env, launch, say, screenshot, waitFor } from './lib.mjs';

const base = env('STOCKGATE_URL');
const product = env('STOCKGATE_PRODUCT');
const token = env('STOCKGATE_USER_TOKEN');
const { browser, page, problems } = await launch();
const text = (sel) => page.textContent(sel);
const result = () => page.evaluate(() => {
  const r = document.getElementById('order-result');
  return { status: r.dataset.status, code: r.dataset.code,
    headline: document.getElementById('order-headline').textContent,
    message: (document.getElementById('order-error-message') || {}).textContent };
});
// What a stale page would do: press buy although the window says no.
const forceBuy = () => page.evaluate(() => { const b = document.getElementById('buy'); b.disabled = false; b.click(); });

await page.goto(`${base}/shop/${encodeURIComponent(product)}?token=${encodeURIComponent(token)}`);
await waitFor(page, 'limit and countdown', () => document.getElementById('limit').textContent === 'limit 1 per customer'
  && /^sale starts in [\d:]+$/.test(document.getElementById('sale-window').textContent));
const line1 = await text('#drop');
check(await page.isDisabled('#buy'), 'buy is disabled before the start');
say(`BEFORE ${line1} | availability: ${(await text('#availability-line')).trim()} | buy disabled`);
await screenshot(page, 'drop-upcoming.png');
await waitFor(page, 'the countdown to move', (before) => document.getElementById('drop').textContent !== before, line1);
say(`TICK ${await text('#drop')}`);

await forceBuy();
await waitFor(page, '409 SALE_NOT_STARTED', () => document.getElementById('order-result').dataset.code === 'SALE_NOT_STARTED');
say(`SALE_NOT_STARTED ${JSON.stringify(await result())}`);

await waitFor(page, 'sale on and buy enabled', () => document.getElementById('product').dataset.sale === 'on'
  && !document.getElementById('buy').disabled);
say(`ON ${await text('#drop')}`);
await page.click('#buy');
await waitFor(page, '201', () => document.getElementById('order-result').dataset.status === '201');
say(`BOUGHT ${await text('#order-id')}`);
await waitFor(page, 'buy enabled again', () => !document.getElementById('buy').disabled);
await page.click('#buy');
await waitFor(page, '409 LIMIT_EXCEEDED', () => document.getElementById('order-result').dataset.code === 'LIMIT_EXCEEDED');
say(`LIMIT_EXCEEDED ${JSON.stringify(await result())}`);
await screenshot(page, 'drop-limit.png');

await waitFor(page, 'sale ended', () => document.getElementById('sale-window').textContent === 'sale ended'
  && document.getElementById('buy').disabled);
say(`ENDED ${await text('#drop')} | buy disabled`);
await forceBuy();
await waitFor(page, '409 SALE_ENDED', () => document.getElementById('order-result').dataset.code === 'SALE_ENDED');
say(`SALE_ENDED ${JSON.stringify(await result())}`);
await screenshot(page, 'drop-ended.png');
await done(browser, problems);

// Shared by the browser scripts that tests/api/pages.rs runs: a headless Debian Chromium
// driven by playwright-core, a line protocol with the Rust test (stdout: what happened,
// stdin: what the test did), and bounded waits that poll the DOM.
import { chromium } from 'playwright-core';
import { createInterface } from 'node:readline';
import { mkdirSync } from 'node:fs';
import path from 'node:path';

export const STEP_MS = Number(process.env.BROWSER_STEP_MS || 20000);
const OVERALL_MS = Number(process.env.BROWSER_OVERALL_MS || 150000);
const SCREENSHOT_DIR = process.env.SCREENSHOT_DIR || path.resolve('../../target/browser-screenshots');

/** One line to the Rust test. */
export function say(line) {
  process.stdout.write(`${line}\n`);
}

/** Fails the script (and so the test) with a reason. */
export function fail(message) {
  say(`FAIL ${message}`);
  process.exit(1);
}

export function env(name) {
  const v = process.env[name];
  if (!v) fail(`${name} is not set`);
  return v;
}

// Nothing hangs: the whole script is bounded too.
setTimeout(() => fail(`the script ran for over ${OVERALL_MS} ms`), OVERALL_MS).unref();

// ---- lines from the Rust test ----
const pending = [];
const waiters = [];
let stdinClosed = false;
const rl = createInterface({ input: process.stdin });
rl.on('line', (line) => {
  const w = waiters.shift();
  if (w) w(line.trim());
  else pending.push(line.trim());
});
rl.on('close', () => {
  stdinClosed = true;
  for (const w of waiters.splice(0)) w(null);
});

/** Waits for the test to send `want` on stdin. */
export async function expectLine(want, timeoutMs = STEP_MS) {
  const next = () => {
    if (pending.length) return Promise.resolve(pending.shift());
    if (stdinClosed) return Promise.resolve(null);
    return new Promise((resolve) => waiters.push(resolve));
  };
  let timer;
  const timeout = new Promise((resolve) => {
    timer = setTimeout(() => resolve(undefined), timeoutMs);
  });
  const line = await Promise.race([next(), timeout]);
  clearTimeout(timer);
  if (line === undefined) fail(`no ${want} from the test within ${timeoutMs} ms`);
  if (line === null) fail(`the test closed stdin before ${want}`);
  if (line !== want) fail(`expected ${want} from the test, got ${line}`);
}

// ---- the browser ----
export async function launch() {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    headless: true,
    timeout: 30000,
    args: [
      '--headless',
      '--no-sandbox',
      '--disable-gpu',
      '--disable-background-networking',
      '--disable-component-update',
      '--no-first-run',
      '--disable-quic',
      '--disable-sync',
    ],
  });
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await context.newPage();
  page.setDefaultTimeout(STEP_MS);
  const problems = [];
  page.on('pageerror', (e) => {
    problems.push(`uncaught: ${e.message}`);
    say(`page error: ${e.message}`);
  });
  page.on('console', (m) => {
    if (m.type() !== 'error') return;
    say(`console error: ${m.text()}`);
    // A blocked inline script or style, or a request off this origin, is a bug in the page.
    if (/Content Security Policy|Refused to/i.test(m.text())) problems.push(m.text());
  });
  // The pages must never reach outside the service.
  const origin = new URL(env('STOCKGATE_URL')).origin;
  page.on('request', (r) => {
    const url = r.url();
    if (!url.startsWith(origin) && !url.startsWith('data:') && !url.startsWith('about:')) {
      problems.push(`request off the service: ${url}`);
    }
  });
  return { browser, page, problems };
}

/** Polls `fn` in the page (every 100 ms) until it is truthy, and returns that value;
 * fails after STEP_MS. */
export async function waitFor(page, what, fn, arg) {
  try {
    const value = await page.waitForFunction(fn, arg, { timeout: STEP_MS, polling: 100 });
    return await value.jsonValue();
  } catch (e) {
    const slug = what.replace(/[^A-Za-z0-9]+/g, '-').slice(0, 60);
    try {
      await screenshot(page, `FAILED-${slug}.png`);
    } catch (_) { /* best effort */ }
    fail(`timed out after ${STEP_MS} ms waiting for: ${what} (${e.message.split('\n')[0]})`);
  }
}

export async function screenshot(page, name) {
  mkdirSync(SCREENSHOT_DIR, { recursive: true });
  const file = path.join(SCREENSHOT_DIR, name);
  await page.screenshot({ path: file, fullPage: true });
  say(`SCREENSHOT ${file}`);
  return file;
}

export function check(cond, message) {
  if (!cond) fail(message);
}

/** Ends the script: no page problems, then DONE and exit 0. */
export async function done(browser, problems) {
  if (problems.length) fail(`the page had problems: ${problems.join(' | ')}`);
  await browser.close();
  say('DONE');
  process.exit(0);
}

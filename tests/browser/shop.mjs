// The shop page in a real browser: availability with its freshness, a purchase that
// succeeds (201), then — the product had one unit — a second one refused with 409, and a
// product that does not exist.
//
// env: STOCKGATE_URL, STOCKGATE_PRODUCT (stock 1), STOCKGATE_PRICE (e.g. £89.99),
//      STOCKGATE_USER_TOKEN, SCREENSHOT_DIR
// protocol: prints FRESHNESS <text>, BOUGHT <order id>, SOLD_OUT, then DONE.
import { check, done, env, launch, say, screenshot, waitFor } from './lib.mjs';

const base = env('STOCKGATE_URL');
const product = env('STOCKGATE_PRODUCT');
const price = env('STOCKGATE_PRICE');
const token = env('STOCKGATE_USER_TOKEN');
const { browser, page, problems } = await launch();

await page.goto(`${base}/shop/${encodeURIComponent(product)}?token=${encodeURIComponent(token)}`);
const line = () => page.evaluate(() => document.getElementById('availability-line').textContent.trim());
await waitFor(page, 'in stock, with its freshness', () => {
  const a = document.getElementById('availability');
  const text = document.getElementById('availability-line').textContent.trim();
  return a.dataset.available === 'true'
    && /^In stock — as of \d+\.\d s ago, from (replica-\d+|primary)$/.test(text);
});
check(!page.url().includes('token='), `the token stayed in the address bar: ${page.url()}`);
check(await page.inputValue('#token') === token, 'the token from ?token= is in the field');
const name = await page.textContent('#product-name');
check(name === `Product ${product}`, `the name reads "${name}"`);
const shownPrice = await page.textContent('#price');
check(shownPrice === price, `the price reads "${shownPrice}", not ${price}`);
say(`FRESHNESS ${await line()}`);
await screenshot(page, 'shop.png');

await page.click('#buy');
await waitFor(page, 'the order confirmed (201)', () => {
  const r = document.getElementById('order-result');
  return r.dataset.status === '201' && !r.classList.contains('hidden') && document.getElementById('order-id');
});
const orderId = await page.textContent('#order-id');
const total = await page.textContent('#order-total');
check(/^[0-9a-f-]{36}$/.test(orderId), `order id "${orderId}"`);
check(total === price, `the total reads "${total}", not ${price}`);
say(`BOUGHT ${orderId}`);
await screenshot(page, 'shop-bought.png');

// The page keeps refreshing: the last unit is gone.
await waitFor(page, 'out of stock shown', () => {
  const a = document.getElementById('availability');
  const text = document.getElementById('availability-line').textContent.trim();
  return a.dataset.available === 'false'
    && /^Out of stock — as of \d+\.\d s ago, from (replica-\d+|primary)$/.test(text);
});
say(`OUT_OF_STOCK_SHOWN ${await line()}`);
await page.click('#buy');
await waitFor(page, 'the second order refused (409 OUT_OF_STOCK)', () => {
  const r = document.getElementById('order-result');
  return r.dataset.status === '409' && r.dataset.code === 'OUT_OF_STOCK';
});
const headline = await page.textContent('#order-headline');
check(/sold out/i.test(headline), `the 409 headline reads "${headline}"`);
check(await page.isVisible('#order-error-message'), 'the error message is visible');
say('SOLD_OUT');
await screenshot(page, 'shop-sold-out.png');

// A product that does not exist: the API's 404, shown plainly.
await page.goto(`${base}/shop/no-such-product`);
await waitFor(page, 'the not-found notice', () => {
  const n = document.getElementById('not-found');
  return !n.classList.contains('hidden') && n.dataset.status === '404' && n.dataset.code === 'PRODUCT_NOT_FOUND';
});
check(await page.isHidden('#product'), 'the product card is hidden for an unknown product');
await screenshot(page, 'shop-not-found.png');
await done(browser, problems);

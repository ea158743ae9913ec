// The shop page in a real browser: availability with its freshness, a purchase that
// succeeds (201) and says where it ships from, then — the product had one unit — a second
// one refused with 409, and a product that does not exist. Then a product kept in several
// locations: the active ones that hold it are listed, a purchase of several units names
// every location the order's allocations took them from, and the list follows the sale.
//
// env: STOCKGATE_URL, STOCKGATE_PRODUCT (stock 1, at default only), STOCKGATE_PRICE (e.g.
//      £89.99), STOCKGATE_USER_TOKEN, SCREENSHOT_DIR; STOCKGATE_SPLIT_PRODUCT (kept in several
//      locations, one of them inactive), STOCKGATE_SPLIT_QTY (more than any one active
//      location holds), STOCKGATE_SPLIT_AT and STOCKGATE_SPLIT_LEFT (its "in stock at …"
//      line before and after that purchase)
// protocol: prints FRESHNESS <text>, BOUGHT <order id>, SHIPS <text>, SOLD_OUT,
//           SPLIT_BOUGHT <order id>, SPLIT_SHIPS <text>, SPLIT_LEFT <text>, then DONE.
import { check, done, env, launch, say, screenshot, waitFor } from './lib.mjs';

const base = env('STOCKGATE_URL');
const product = env('STOCKGATE_PRODUCT');
const price = env('STOCKGATE_PRICE');
const token = env('STOCKGATE_USER_TOKEN');
const split = env('STOCKGATE_SPLIT_PRODUCT');
const splitQty = env('STOCKGATE_SPLIT_QTY');
const splitAt = env('STOCKGATE_SPLIT_AT');
const splitLeft = env('STOCKGATE_SPLIT_LEFT');
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
// Kept at one place only, with a unit there, there is no list of places (fails if the page
// lists a lone location).
check(await page.isHidden('#stock-at'), 'a product kept only at default lists its locations');
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
// Where it ships from is the order's answer; the test holds it to the order's allocations
// (fails if the page drops the line, or names a location the order did not take from).
say(`SHIPS ${await page.textContent('#order-ships')}`);
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

// A product in several locations. The line lists the active ones with units, in the service's
// order (fails if the page counts the inactive location, or drops the line).
await page.goto(`${base}/shop/${encodeURIComponent(split)}`);
const stockAt = () => {
  const at = document.getElementById('stock-at');
  return at.classList.contains('hidden') ? '(hidden)' : at.textContent;
};
await waitFor(page, `"${splitAt}"`, (want) => document.getElementById('stock-at').textContent === want
  && !document.getElementById('stock-at').classList.contains('hidden'), splitAt);
await screenshot(page, 'shop-locations.png');
// More units than any one location holds: the order splits, and the page names every
// location and its units from the allocations (the test compares SPLIT_SHIPS with them;
// fails if the page names only the first allocation, or ignores the quantity field).
await page.fill('#qty', splitQty);
await waitFor(page, `the button reads Buy ${splitQty}`, (q) => document.getElementById('buy').textContent === `Buy ${q}`, splitQty);
await page.click('#buy');
await waitFor(page, 'the split order confirmed (201)', () => {
  const r = document.getElementById('order-result');
  return r.dataset.status === '201' && document.getElementById('order-ships');
});
say(`SPLIT_BOUGHT ${await page.textContent('#order-id')}`);
say(`SPLIT_SHIPS ${await page.textContent('#order-ships')}`);
// The list follows the sale on the next refreshes (fails if it is drawn only once).
await waitFor(page, `"${splitLeft}" after the sale`, (want) => document.getElementById('stock-at').textContent === want, splitLeft);
say(`SPLIT_LEFT ${await page.evaluate(stockAt)}`);
await screenshot(page, 'shop-locations-bought.png');
await done(browser, problems);

// stockgate shop page: one product, its availability and how fresh that answer is,
// refreshed every second, and a buy button that places a real order.
'use strict';

(() => {
  const REFRESH_MS = 1000;
  const REQUEST_TIMEOUT_MS = 5000;
  const TOKEN_KEY = 'stockgate.userToken';
  const { $, setText, takeTokenFromUrl, describeError } = window.stockgate;
  const getJson = (path, init) => window.stockgate.getJson(path, init, REQUEST_TIMEOUT_MS);
  const money = new Intl.NumberFormat('en-GB', { style: 'currency', currency: 'GBP' });

  // The last segment of /shop/{product_id}; the server has already checked its shape.
  const productId = decodeURIComponent(location.pathname.replace(/\/+$/, '').split('/').pop() || '');
  const productPath = `/v1/products/${encodeURIComponent(productId)}`;

  let availability = null; // {body, receivedAt}
  let product = null; // {body, receivedAt}
  let buying = false;

  function fmtAge(ms) {
    if (ms < 60000) return `${(Math.max(0, ms) / 1000).toFixed(1)} s`;
    return `${Math.floor(ms / 60000)} min ${Math.floor((ms % 60000) / 1000)} s`;
  }
  // How old the answer is now: how stale it was when served, plus how long we have held it.
  function age(held) {
    return held.body.stale_by_ms + (performance.now() - held.receivedAt);
  }
  function uuid() {
    if (crypto.randomUUID) return crypto.randomUUID();
    // Plain-http pages on a non-local host get no randomUUID; build a v4 one.
    const b = crypto.getRandomValues(new Uint8Array(16));
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    const h = [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
    return `${h.slice(0, 8)}-${h.slice(8, 12)}-${h.slice(12, 16)}-${h.slice(16, 20)}-${h.slice(20)}`;
  }

  function showNotFound(r) {
    const box = $('not-found');
    box.dataset.status = String(r.status);
    box.dataset.code = (r.body && r.body.error && r.body.error.code) || '';
    setText(box, `There is no product “${productId}”. The service answered ${describeError(r)}.`);
    box.classList.remove('hidden');
    $('product').classList.add('hidden');
    $('product').dataset.state = 'not-found';
    document.title = 'stockgate · no such product';
  }
  function hideNotFound() {
    $('not-found').classList.add('hidden');
    $('product').classList.remove('hidden');
  }

  async function refresh() {
    const [p, a] = await Promise.all([
      getJson(productPath),
      getJson(`${productPath}/availability?qty=1`),
    ]);
    const status = $('poll-status');
    if (p.status === 404 || a.status === 404) {
      showNotFound(p.status === 404 ? p : a);
      status.dataset.status = 'not-found';
      setText(status, `checked ${new Date().toLocaleTimeString()}`);
      return;
    }
    hideNotFound();
    const errors = [];
    if (p.status === 200) {
      product = { body: p.body, receivedAt: performance.now() };
    } else {
      errors.push(`product: ${describeError(p)}`);
    }
    if (a.status === 200) {
      availability = { body: a.body, receivedAt: performance.now() };
    } else {
      errors.push(`availability: ${describeError(a)}`);
    }
    setText($('availability-error'), errors.length ? `${errors.join(' · ')} — showing the last answer` : '');
    status.dataset.status = errors.length ? 'error' : 'ok';
    setText(status, errors.length ? 'some requests are failing' : 'live · refreshing every second');
    render();
  }

  function render() {
    const card = $('product');
    if (product) {
      const b = product.body;
      setText($('product-id'), b.product_id);
      setText($('product-name'), b.name);
      setText($('price'), money.format(b.price_cents / 100));
      document.title = `${b.name} · stockgate`;
      setText($('product-freshness'),
        `name and price as of ${fmtAge(age(product))} ago, from ${b.served_by}`);
    }
    if (availability) {
      const b = availability.body;
      const el = $('availability');
      el.dataset.available = String(b.available);
      el.dataset.quantity = String(b.available_quantity);
      el.className = `availability ${b.available ? 'in-stock' : 'out-of-stock'}`;
      setText(el, b.available ? 'In stock' : 'Out of stock');
      const f = $('freshness');
      f.dataset.servedBy = b.served_by;
      f.dataset.staleByMs = String(b.stale_by_ms);
      f.dataset.asOf = b.as_of;
      setText(f, ` — as of ${fmtAge(age(availability))} ago, from ${b.served_by}`);
      f.title = `the stock gate answered with data as of ${b.as_of} (${b.stale_by_ms} ms behind when served)`;
      setText($('stock-count'), b.available_quantity === 1 ? 'the last one' : `${b.available_quantity} available`);
    }
    card.dataset.state = availability ? (availability.body.available ? 'in-stock' : 'out-of-stock') : 'loading';
  }

  function showResult(kind, status, code, headline, detail) {
    const box = $('order-result');
    box.className = `result ${kind}`;
    box.dataset.status = String(status);
    box.dataset.code = code;
    setText($('order-headline'), headline);
    $('order-detail').replaceChildren(...detail);
  }
  function span(id, text, cls) {
    const s = document.createElement('span');
    if (id) s.id = id;
    if (cls) s.className = cls;
    s.textContent = text;
    return s;
  }

  async function buy(ev) {
    ev.preventDefault();
    if (buying) return;
    const token = $('token').value.trim();
    if (!token) {
      showResult('bad', 0, 'NO_TOKEN', 'A bearer token is needed to buy',
        [span(null, 'Paste a user token into the field (./dev token --user ID), or open this page with ?token=…')]);
      $('token').focus();
      return;
    }
    sessionStorage.setItem(TOKEN_KEY, token);
    buying = true;
    $('buy').disabled = true;
    const key = uuid();
    showResult('pending', 0, '', 'Placing your order…', [span(null, `Idempotency-Key ${key}`, 'mono')]);
    const r = await getJson('/v1/orders', {
      method: 'POST',
      headers: {
        'Content-Type': 'application/json',
        Authorization: `Bearer ${token}`,
        'Idempotency-Key': key,
      },
      body: JSON.stringify({ product_id: productId, quantity: 1 }),
    });
    if (r.status === 201) {
      const o = r.body;
      showResult('ok', 201, '', 'Order confirmed', [
        span(null, 'order '),
        span('order-id', o.order_id, 'mono'),
        span(null, ' · total '),
        span('order-total', money.format(o.total_cents / 100)),
        span(null, ` · ${o.quantity} × ${o.product_id} · ${o.status}`),
      ]);
    } else if (r.status === 409 && r.body && r.body.error && r.body.error.code === 'OUT_OF_STOCK') {
      showResult('bad', 409, 'OUT_OF_STOCK', 'Sold out — your order was not placed', [
        span('order-error-code', 'OUT_OF_STOCK', 'mono'),
        span(null, ': '),
        span('order-error-message', r.body.error.message),
      ]);
    } else {
      const e = (r.body && r.body.error) || {};
      showResult('bad', r.status, e.code || '', `The order failed (${r.status === 0 ? 'no answer' : `HTTP ${r.status}`})`, [
        span('order-error-code', e.code || '', 'mono'),
        span(null, e.code ? ': ' : ''),
        span('order-error-message', e.message || describeError(r)),
      ]);
    }
    buying = false;
    $('buy').disabled = false;
    refresh();
  }

  async function loop() {
    for (;;) {
      const started = performance.now();
      try {
        await refresh();
      } catch (e) {
        setText($('availability-error'), `page error: ${e.message}`);
      }
      await new Promise((r) => setTimeout(r, Math.max(100, REFRESH_MS - (performance.now() - started))));
    }
  }

  document.addEventListener('DOMContentLoaded', () => {
    takeTokenFromUrl(TOKEN_KEY);
    $('token').value = sessionStorage.getItem(TOKEN_KEY) || '';
    setText($('product-id'), productId);
    $('buy-form').addEventListener('submit', buy);
    // The age of what is shown ticks between refreshes.
    setInterval(render, 200);
    loop();
  });
})();

// stockgate shop page: one product, its availability and how fresh that answer is,
// refreshed every second, and a buy button that places a real order. A flash drop shows its
// limit per customer and its sale window: a live countdown to the start (the button stays
// disabled until then), and "sale ended" from the end. A product kept in several locations
// lists the active ones that hold it (the product page's `stock`), and a confirmed order says
// where its units ship from (the order's own `allocations`, never a guess from the stock).
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
  // The service's clock minus this computer's, from the last availability answer: sale
  // windows are judged on the service's clock, and a wrong clock here must not open the
  // button early or keep it shut.
  let clockOffsetMs = 0;

  function fmtAge(ms) {
    if (ms < 60000) return `${(Math.max(0, ms) / 1000).toFixed(1)} s`;
    return `${Math.floor(ms / 60000)} min ${Math.floor((ms % 60000) / 1000)} s`;
  }
  // How old the answer is now: how stale it was when served, plus how long we have held it.
  function age(held) {
    return held.body.stale_by_ms + (performance.now() - held.receivedAt);
  }
  // "0:07", "1:23", "1:02:03", "2 d 3:04:05": whole seconds left, rounded up, so the
  // countdown reads 0:00 when the sale starts.
  function fmtCountdown(ms) {
    const s = Math.ceil(Math.max(0, ms) / 1000);
    const pad = (n) => String(n).padStart(2, '0');
    const [d, h, m] = [Math.floor(s / 86400), Math.floor((s % 86400) / 3600), Math.floor((s % 3600) / 60)];
    if (d > 0) return `${d} d ${h}:${pad(m)}:${pad(s % 60)}`;
    if (h > 0) return `${h}:${pad(m)}:${pad(s % 60)}`;
    return `${m}:${pad(s % 60)}`;
  }
  // "eu-1 (2), default (1)" from [[location_id, units], …], in the service's order.
  function places(list) {
    return list.map(([at, units]) => `${at} (${units})`).join(', ');
  }
  function serviceNow() {
    return Date.now() + clockOffsetMs;
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
      // as_of + stale_by_ms is the service's clock when it answered.
      const answeredAt = Date.parse(a.body.as_of) + a.body.stale_by_ms;
      if (Number.isFinite(answeredAt)) clockOffsetMs = answeredAt - Date.now();
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
        `name, price and locations as of ${fmtAge(age(product))} ago, from ${b.served_by}`);
      renderStockAt(b.stock || []);
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
    renderDrop();
  }

  // Where the product is kept, once that is more than one place: the active locations that
  // hold units (an inactive one sells nothing, so it is not listed).
  function renderStockAt(stock) {
    const selling = stock.filter((s) => s.active && s.available_quantity > 0);
    const at = $('stock-at');
    at.classList.toggle('hidden', stock.length < 2 || selling.length === 0);
    setText(at, `in stock at ${places(selling.map((s) => [s.location_id, s.available_quantity]))}`);
  }

  // Where the sale window stands at `now` (the service's clock): 'upcoming' before
  // sale_starts_at (msLeft to go), 'ended' from sale_ends_at, else 'on' (msLeft to the end,
  // if there is one). When the stock gate says on_sale: false although our copy of the
  // product page says the sale is on (that copy may be older), it is 'starting' just after
  // the start and 'closed' otherwise.
  function saleWindow(now) {
    const p = product ? product.body : {};
    const starts = p.sale_starts_at ? Date.parse(p.sale_starts_at) : null;
    const ends = p.sale_ends_at ? Date.parse(p.sale_ends_at) : null;
    if (ends !== null && now >= ends) return { phase: 'ended' };
    if (starts !== null && now < starts) return { phase: 'upcoming', msLeft: starts - now };
    if (availability && availability.body.on_sale === false) {
      return { phase: starts !== null && now - starts < 5000 ? 'starting' : 'closed' };
    }
    return { phase: 'on', msLeft: ends === null ? null : ends - now };
  }
  const WINDOW_TEXT = {
    upcoming: (w) => `sale starts in ${fmtCountdown(w.msLeft)}`,
    ended: () => 'sale ended',
    starting: () => 'sale starting…',
    closed: () => 'not on sale',
    on: (w) => (w.msLeft === null ? '' : `sale ends in ${fmtCountdown(w.msLeft)}`),
  };

  // The limit per customer and the sale window under the stock line; the buy button is
  // enabled only while the sale is on.
  function renderDrop() {
    const w = saleWindow(serviceNow());
    const p = product ? product.body : {};
    const win = $('sale-window');
    win.dataset.phase = w.phase;
    win.className = `sale-window ${w.phase}`;
    setText(win, WINDOW_TEXT[w.phase](w));
    const when = [p.sale_starts_at && `starts ${new Date(p.sale_starts_at).toLocaleString()}`,
      p.sale_ends_at && `ends ${new Date(p.sale_ends_at).toLocaleString()}`].filter(Boolean);
    win.title = when.length ? `the sale ${when.join(', ')}` : '';
    const limit = p.max_per_customer == null ? '' : String(p.max_per_customer);
    const l = $('limit');
    l.dataset.limit = limit;
    setText(l, limit ? `limit ${limit} per customer` : '');
    $('drop').classList.toggle('hidden', !win.textContent && !limit);
    $('product').dataset.sale = w.phase;
    const buyButton = $('buy');
    buyButton.disabled = buying || w.phase !== 'on';
    setText(buyButton, `Buy ${$('qty').value}`);
    buyButton.title = w.phase === 'on' ? '' : `you can buy once the sale is on (${win.textContent})`;
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

  // The contract's 409s that refuse an order without anything going wrong: a headline and a
  // readable sentence for each (the service's own message when it has nothing better).
  const REFUSALS = {
    OUT_OF_STOCK: {
      headline: 'Sold out — your order was not placed',
      message: (e) => e.message,
    },
    LIMIT_EXCEEDED: {
      headline: 'Limit reached — your order was not placed',
      message: (e) => (e.limit == null ? e.message
        : `This product is limited to ${e.limit} per customer and you already have ${e.already}; nothing was taken.`),
    },
    SALE_NOT_STARTED: {
      headline: 'The sale has not started yet — your order was not placed',
      message: (e, r) => {
        const wait = Number(r.headers && r.headers.get('Retry-After'));
        return wait > 0 ? `It starts in ${fmtCountdown(wait * 1000)}; nothing was taken — try again then.` : e.message;
      },
    },
    SALE_ENDED: {
      headline: 'The sale has ended — your order was not placed',
      message: (e) => e.message,
    },
  };

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
      body: JSON.stringify({ product_id: productId, quantity: Number($('qty').value) }),
    });
    if (r.status === 201) {
      const o = r.body;
      const shipped = (o.allocations || []).map((a) => [a.location_id, a.quantity]);
      showResult('ok', 201, '', 'Order confirmed', [
        span(null, 'order '),
        span('order-id', o.order_id, 'mono'),
        span(null, ' · total '),
        span('order-total', money.format(o.total_cents / 100)),
        span(null, ` · ${o.quantity} × ${o.product_id} · ${o.status}`),
        span('order-ships', shipped.length ? `ships from ${places(shipped)}` : '', 'ships'),
      ]);
    } else if (r.status === 409 && r.body && r.body.error && Object.hasOwn(REFUSALS, r.body.error.code)) {
      const e = r.body.error;
      const refusal = REFUSALS[e.code];
      showResult('bad', 409, e.code, refusal.headline, [
        span('order-error-code', e.code, 'mono'),
        span(null, ': '),
        span('order-error-message', refusal.message(e, r)),
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
    render();
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
    $('qty').addEventListener('input', renderDrop);
    // The age of what is shown ticks between refreshes.
    setInterval(render, 200);
    loop();
  });
})();

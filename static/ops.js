// stockgate ops page: polls /v1/admin/replicas (freshness), /v1/admin/overview (rates over
// the last minute, the thresholds in force, the read-your-writes store), /v1/admin/routing
// (the policy table) and /v1/admin/holds, and draws what they say: the service works out the
// numbers, the page only keeps a few minutes of each replica's staleness to chart it as
// inline SVG. For one product chosen on the page, its stock at each location (its product
// page's `stock`, named and ranked by /v1/locations). No libraries and no requests to
// anywhere but this service.
'use strict';

(() => {
  const TOKEN_KEY = 'stockgate.adminToken';
  const REPLICAS_EVERY_MS = 500;
  const ROUTING_EVERY_MS = 1000;
  const OVERVIEW_EVERY_MS = 1000;
  const REQUEST_TIMEOUT_MS = 3000;
  const HISTORY_MS = 3 * 60 * 1000;
  const SVG_NS = 'http://www.w3.org/2000/svg';

  const { $, setText, getJson, describeError } = window.stockgate;
  // The thresholds in force, from /v1/admin/overview; none are drawn before it answers.
  let thresholds = null;
  const staleHistory = new Map(); // replica name -> [{t, ms, state}]
  const errors = new Map(); // poller name -> message
  let running = false;
  let generation = 0; // bumped on each start, so pollers of an earlier start stop

  // ---------- formatting ----------
  function fmtMs(ms) {
    if (ms === null || ms === undefined) return '—';
    if (ms < 1000) return `${Math.round(ms)} ms`;
    if (ms < 60000) return `${(ms / 1000).toFixed(1)} s`;
    const m = Math.floor(ms / 60000);
    const s = Math.floor((ms % 60000) / 1000);
    return `${m} min ${s} s`;
  }
  // A configured duration: whole units without decimals (250 ms, 5 s, 5 min).
  function fmtBudget(ms) {
    if (ms === null || ms === undefined) return '—';
    if (ms < 1000) return `${ms} ms`;
    if (ms < 60000 || ms % 60000 !== 0) return `${+(ms / 1000).toFixed(1)} s`;
    return `${ms / 60000} min`;
  }
  function fmtBytes(b) {
    if (b === null || b === undefined) return '—';
    if (b < 1024) return `${b} B`;
    if (b < 1024 * 1024) return `${(b / 1024).toFixed(1)} KiB`;
    if (b < 1024 * 1024 * 1024) return `${(b / 1024 / 1024).toFixed(1)} MiB`;
    return `${(b / 1024 / 1024 / 1024).toFixed(2)} GiB`;
  }
  function fmtRate(r) {
    if (r === null || r === undefined) return '—';
    if (r === 0) return '0';
    return r >= 100 ? r.toFixed(0) : r.toFixed(1);
  }
  function fmtTime(iso) {
    if (!iso) return '—';
    const d = new Date(iso);
    if (Number.isNaN(d.getTime())) return iso;
    const pad = (n, w = 2) => String(n).padStart(w, '0');
    return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
  }
  // ---------- token ----------
  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }
  function showLogin(message) {
    running = false;
    $('dashboard').classList.add('hidden');
    $('forget-token').classList.add('hidden');
    $('login').classList.remove('hidden');
    setText($('login-error'), message || '');
    setStatus('needs-token', 'waiting for an admin token');
    $('token-input').focus();
  }
  function showDashboard() {
    $('login').classList.add('hidden');
    $('dashboard').classList.remove('hidden');
    $('forget-token').classList.remove('hidden');
  }

  // ---------- fetching ----------
  class Refused extends Error {}

  // The JSON body of an admin route; a refused token is `Refused`, anything else an Error
  // with the answer's `status` (0 for none).
  async function fetchJson(path) {
    const headers = { Accept: 'application/json', Authorization: `Bearer ${token()}` };
    const r = await getJson(path, { headers }, REQUEST_TIMEOUT_MS);
    if (r.status === 401 || r.status === 403) throw new Refused(`the token was refused (${describeError(r)})`);
    if (r.status !== 200 || !r.body) throw Object.assign(new Error(`${path}: ${describeError(r)}`), { status: r.status });
    return r.body;
  }

  function every(name, periodMs, fn) {
    const gen = generation;
    (async () => {
      while (running && gen === generation) {
        const started = performance.now();
        try {
          await fn();
          errors.delete(name);
        } catch (e) {
          if (gen !== generation) return;
          if (e instanceof Refused) {
            sessionStorage.removeItem(TOKEN_KEY);
            showLogin(e.message);
            return;
          }
          errors.set(name, e.message || String(e));
        }
        renderErrors();
        const wait = Math.max(50, periodMs - (performance.now() - started));
        await new Promise((r) => setTimeout(r, wait));
      }
    })();
  }

  function setStatus(status, text) {
    const el = $('poll-status');
    el.dataset.status = status;
    setText(el, text);
  }

  function renderErrors() {
    const banner = $('error-banner');
    if (errors.size === 0) {
      banner.classList.add('hidden');
      setStatus('ok', `live · polling every ${REPLICAS_EVERY_MS} ms`);
    } else {
      banner.classList.remove('hidden');
      setText(banner, [...errors.values()].join(' · '));
      setStatus('error', 'some requests are failing');
    }
  }

  // ---------- replicas ----------
  function replicaCard(name) {
    const container = $('replicas');
    let card = container.querySelector(`[data-replica="${CSS.escape(name)}"]`);
    if (!card) {
      card = $('replica-template').content.firstElementChild.cloneNode(true);
      card.dataset.replica = name;
      card.id = `replica-${name}`.replace(/[^A-Za-z0-9_-]/g, '_');
      card.querySelector('.name').textContent = name;
      container.appendChild(card);
    }
    return card;
  }

  async function pollReplicas() {
    const body = await fetchJson('/v1/admin/replicas');
    const now = Date.now();
    setText($('primary-lsn'), (body.primary && body.primary.lsn) || '—');
    setText($('updated-at'), fmtTime(new Date(now).toISOString()));
    const replicas = body.replicas || [];
    $('no-replicas').classList.toggle('hidden', replicas.length > 0);
    for (const r of replicas) {
      const samples = staleHistory.get(r.name) || [];
      samples.push({ t: now, ms: r.staleness_ms, state: r.state });
      while (samples.length && samples[0].t < now - HISTORY_MS - 5000) samples.shift();
      staleHistory.set(r.name, samples);

      const card = replicaCard(r.name);
      card.dataset.state = r.state;
      card.dataset.stalenessMs = r.staleness_ms === null ? '' : String(r.staleness_ms);
      const badge = card.querySelector('.badge.state');
      badge.className = `badge state ${r.state}`;
      setText(badge, r.state);
      setText(card.querySelector('[data-field="staleness"]'), fmtMs(r.staleness_ms));
      setText(card.querySelector('[data-field="lag-bytes"]'), fmtBytes(r.lag_bytes));
      setText(card.querySelector('[data-field="replay-lsn"]'), r.replay_lsn || '—');
      setText(card.querySelector('[data-field="as-of"]'), fmtTime(r.as_of));
      setText(card.querySelector('[data-field="in-flight"]'), String(r.in_flight));
      setText(card.querySelector('[data-field="last-error"]'), r.last_error ? `last error: ${r.last_error}` : '');
      drawChart(card.querySelector('[data-field="chart"]'), samples, now);
    }
    renderCluster(body.cluster, replicas);
  }

  // ---------- Patroni cluster (null in the static mode) ----------
  function renderCluster(cluster, replicas) {
    $('cluster').classList.toggle('hidden', !cluster);
    if (!cluster) return;
    setText($('cluster-leader'), cluster.leader || 'none');
    setText($('cluster-timeline'), cluster.timeline === null ? '—' : String(cluster.timeline));
    setText($('cluster-writes-to'), cluster.writes_to || 'nobody (503)');
    setText($('cluster-changes'), String(cluster.leader_changes));
    $('cluster-card').dataset.leader = cluster.leader || '';
    $('cluster-no-leader').classList.toggle('hidden', !!cluster.leader);
    setText($('cluster-error'), cluster.patroni_error ? `Patroni: ${cluster.patroni_error}` : '');
    const byName = new Map(replicas.map((r) => [r.name, r]));
    const tbody = $('cluster-members').querySelector('tbody');
    tbody.replaceChildren();
    for (const m of cluster.members) {
      const r = byName.get(m.name);
      const tr = document.createElement('tr');
      tr.dataset.member = m.name;
      tr.dataset.role = m.role;
      const cells = [
        m.name, m.role, m.state, `${m.host}:${m.port}`,
        m.timeline === null ? '—' : String(m.timeline),
        fmtBytes(m.patroni_lag_bytes),
        r && m.role !== 'leader' ? fmtMs(r.staleness_ms) : '—',
        m.role === 'leader' ? 'writes' : (r ? r.state : '—'),
      ];
      cells.forEach((text, i) => {
        const td = document.createElement('td');
        if (i >= 4 && i <= 6) td.className = 'num';
        td.textContent = text;
        tr.appendChild(td);
      });
      tbody.appendChild(tr);
    }
  }

  function svg(tag, attrs, text) {
    const el = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (text !== undefined) el.textContent = text;
    return el;
  }

  // Staleness on a log scale (10 ms .. at least 10 s), time on x over HISTORY_MS.
  function drawChart(chart, samples, now) {
    const width = Math.max(200, Math.round(chart.getBoundingClientRect().width) || 560);
    const height = 180;
    const left = 46;
    const right = 8;
    const top = 8;
    const bottom = 20;
    const plotW = width - left - right;
    const plotH = height - top - bottom;
    const floor = 10;
    const visible = samples.filter((s) => s.t >= now - HISTORY_MS);
    const maxSeen = visible.reduce((m, s) => (s.ms !== null && s.ms > m ? s.ms : m), 0);
    let ceil = 10000;
    while (ceil < maxSeen * 1.2) ceil *= 10;
    const lf = Math.log10(floor);
    const lc = Math.log10(ceil);
    const y = (ms) => top + plotH - ((Math.log10(Math.max(floor, ms)) - lf) / (lc - lf)) * plotH;
    const x = (t) => left + ((t - (now - HISTORY_MS)) / HISTORY_MS) * plotW;

    const frag = document.createDocumentFragment();
    // State bands behind everything: amber while lagging, red while down.
    for (let i = 0; i < visible.length; i++) {
      const s = visible[i];
      if (s.state !== 'lagging' && s.state !== 'down') continue;
      const x0 = x(s.t);
      const x1 = i + 1 < visible.length ? x(visible[i + 1].t) : x(now);
      frag.appendChild(svg('rect', {
        class: `${s.state}-band`, x: x0.toFixed(1), y: top, width: Math.max(1, x1 - x0).toFixed(1), height: plotH,
      }));
    }
    // Decade grid lines with labels.
    for (let v = floor; v <= ceil; v *= 10) {
      const yy = y(v).toFixed(1);
      frag.appendChild(svg('line', { class: 'grid-line', x1: left, x2: width - right, y1: yy, y2: yy }));
      frag.appendChild(svg('text', { class: 'axis-label', x: left - 4, y: Number(yy) + 3, 'text-anchor': 'end' }, v < 1000 ? `${v} ms` : `${v / 1000} s`));
    }
    // Time ticks each minute.
    for (let m = 0; m * 60000 <= HISTORY_MS; m++) {
      const xx = x(now - m * 60000);
      frag.appendChild(svg('text', { class: 'axis-label', x: xx.toFixed(1), y: height - 6, 'text-anchor': m === 0 ? 'end' : 'middle' }, m === 0 ? 'now' : `−${m} min`));
    }
    // The thresholds in force, once the overview has said what they are.
    const lines = thresholds ? [
      [thresholds.stock_gate_budget_ms, 'gate', `${fmtBudget(thresholds.stock_gate_budget_ms)} stock-gate budget`],
      [thresholds.eviction_threshold_ms, 'evict', `${fmtBudget(thresholds.eviction_threshold_ms)} eviction (lagging)`],
    ] : [];
    for (const [ms, kind, label] of lines) {
      const yy = y(ms).toFixed(1);
      frag.appendChild(svg('line', {
        class: `threshold-${kind}`, 'data-threshold-ms': ms, x1: left, x2: width - right, y1: yy, y2: yy,
      }));
      frag.appendChild(svg('text', { class: `threshold-label-${kind}`, x: left + 4, y: Number(yy) - 3 }, label));
    }
    // The series, broken where staleness is unknown.
    let points = [];
    let drawn = 0;
    const flush = () => {
      if (points.length > 0) {
        frag.appendChild(svg('polyline', { class: 'series', points: points.join(' ') }));
        drawn += points.length;
      }
      points = [];
    };
    for (const s of visible) {
      if (s.ms === null || s.ms === undefined) {
        flush();
        continue;
      }
      points.push(`${x(s.t).toFixed(1)},${y(s.ms).toFixed(1)}`);
    }
    flush();
    const last = visible[visible.length - 1];
    if (last && last.ms !== null && last.ms !== undefined) {
      frag.appendChild(svg('circle', { class: 'series', cx: x(last.t).toFixed(1), cy: y(last.ms).toFixed(1), r: 2.5 }));
    }
    chart.setAttribute('viewBox', `0 0 ${width} ${height}`);
    chart.dataset.points = String(drawn);
    chart.dataset.maxMs = String(maxSeen);
    chart.replaceChildren(frag);
  }

  // ---------- routing policy ----------
  async function pollRouting() {
    const body = await fetchJson('/v1/admin/routing');
    const tbody = $('policy').tBodies[0];
    const rows = (body.classes || []).map((c) => {
      const tr = document.createElement('tr');
      tr.dataset.class = c.name;
      const budget = c.target === 'primary'
        ? '—'
        : c.staleness_budget_ms === null ? 'any replica not down' : fmtBudget(c.staleness_budget_ms);
      const cells = [
        [c.name, 'mono'],
        [c.target, ''],
        [budget, 'num'],
        [c.read_your_writes ? 'yes' : 'no', ''],
        [c.target === 'primary' ? '—' : c.when_no_fresh_replica.replace(/_/g, ' '), ''],
      ];
      for (const [text, cls] of cells) {
        const td = document.createElement('td');
        if (cls) td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      tr.children[2].dataset.budgetMs = c.staleness_budget_ms === null ? '' : String(c.staleness_budget_ms);
      return tr;
    });
    const signature = JSON.stringify(body.classes);
    if (tbody.dataset.signature !== signature) {
      tbody.replaceChildren(...rows);
      tbody.dataset.signature = signature;
    }
  }

  // ---------- holds ----------
  async function pollHolds() {
    const body = await fetchJson('/v1/admin/holds');
    const held = body.units_held || [];
    const rows = held.map((h) => {
      const tr = document.createElement('tr');
      tr.dataset.product = h.product_id;
      for (const [text, cls] of [[h.product_id, 'mono'], [String(h.units), 'num']]) {
        const td = document.createElement('td');
        td.className = cls;
        td.textContent = text;
        tr.appendChild(td);
      }
      return tr;
    });
    $('holds').tBodies[0].replaceChildren(...rows);
    $('holds-none').classList.toggle('hidden', held.length > 0);
  }

  // ---------- overview: rates, thresholds and the read-your-writes store ----------
  function cell(text, cls, data) {
    const td = document.createElement('td');
    if (cls) td.className = cls;
    td.textContent = text;
    Object.assign(td.dataset, data || {});
    return td;
  }
  function rateCell(r, extra) {
    const v = r === null || r === undefined ? null : r;
    const cls = `num${v === 0 ? ' zero' : ''}${extra && v > 0 ? ` ${extra}` : ''}`;
    return cell(fmtRate(v), cls, { rate: v === null ? '' : v.toFixed(3) });
  }

  function renderThresholds(t) {
    thresholds = t;
    const gate = $('gate-budget');
    gate.dataset.ms = String(t.stock_gate_budget_ms);
    setText(gate, fmtBudget(t.stock_gate_budget_ms));
    const evict = $('evict-threshold');
    evict.dataset.ms = String(t.eviction_threshold_ms);
    setText(evict, fmtBudget(t.eviction_threshold_ms));
  }

  function renderRouting(body) {
    const rows = body.routing.map((c) => {
      const tr = document.createElement('tr');
      tr.dataset.class = c.class;
      tr.appendChild(cell(c.class, 'mono'));
      for (const [target, r] of [['replica', c.replica_per_s], ['primary', c.primary_per_s],
        ['refused', c.refused_per_s], ['fallbacks', c.fallbacks_per_s]]) {
        const td = rateCell(r, target === 'fallbacks' ? 'fallback-hot' : '');
        td.dataset.target = target;
        tr.appendChild(td);
      }
      return tr;
    });
    $('routing-rates').tBodies[0].replaceChildren(...rows);
    const note = $('rates-note');
    note.dataset.seconds = body.rates_over_s === null ? '' : String(body.rates_over_s);
    setText(note, body.rates_over_s === null
      ? 'rates appear from the second look'
      : `per second over the last ${fmtMs(body.rates_over_s * 1000)}`);
  }

  function renderFallbacks(f) {
    const total = $('fallbacks-total');
    total.dataset.rate = f.per_s === null ? '' : f.per_s.toFixed(3);
    total.className = `mono${f.per_s > 0 ? ' fallback-hot' : ''}`;
    setText(total, fmtRate(f.per_s));
    const rows = f.by_reason.map((r) => {
      const tr = document.createElement('tr');
      Object.assign(tr.dataset, { class: r.class, reason: r.reason, rate: r.per_s === null ? '' : r.per_s.toFixed(3) });
      tr.append(cell(r.class, 'mono'), cell(r.reason.replace(/_/g, ' ')), rateCell(r.per_s), cell(String(r.since_start), 'num'));
      return tr;
    });
    if (rows.length === 0) {
      const tr = document.createElement('tr');
      const td = cell('no read has fallen back to the primary since the service started', 'muted');
      td.colSpan = 4;
      tr.appendChild(td);
      rows.push(tr);
    }
    $('fallback-reasons').tBodies[0].replaceChildren(...rows);
  }

  function renderActivity(body) {
    const rows = [];
    for (const [kind, list] of [['orders', body.orders_per_s], ['holds', body.holds_per_s]]) {
      for (const e of list) {
        const tr = document.createElement('tr');
        Object.assign(tr.dataset, { kind, label: e.label });
        tr.append(cell(kind), cell(e.label.replace(/_/g, ' ')), rateCell(e.per_s));
        rows.push(tr);
      }
    }
    $('activity').tBodies[0].replaceChildren(...rows);
    const held = $('units-held-total');
    held.dataset.units = String(body.units_held);
    setText(held, String(body.units_held));
  }

  function renderRyw(s) {
    const ryw = $('ryw');
    ryw.dataset.kind = s.store;
    ryw.dataset.healthy = String(s.healthy);
    setText($('ryw-kind'), s.store === 'in_process' ? 'in-process (one instance)' : s.store);
    const health = $('ryw-health');
    health.className = `badge ${s.healthy ? 'ok' : 'bad'}`;
    setText(health, s.healthy ? 'healthy' : 'unreachable: reads fail closed to the primary');
    setText($('ryw-ttl'), fmtBudget(s.ttl_ms));
    const failures = $('ryw-failures');
    failures.dataset.rate = s.failures_per_s === null ? '' : s.failures_per_s.toFixed(3);
    setText(failures, fmtRate(s.failures_per_s));
  }

  async function pollOverview() {
    const body = await fetchJson('/v1/admin/overview');
    renderThresholds(body.thresholds);
    renderRouting(body);
    renderFallbacks(body.fallbacks);
    renderActivity(body);
    renderRyw(body.read_your_writes);
  }

  // ---------- one product: stock by location ----------
  // The product that the panels under "One product" follow ('' until one is chosen). Each
  // panel polls on its own and draws only an answer about the product still chosen, so
  // another panel (the product's movements) joins with a card and a poller of its own.
  let watched = '';

  function watch(product) {
    watched = product;
    $('product-panels').classList.toggle('hidden', !product);
    const card = $('stock-card');
    card.dataset.product = product;
    card.dataset.state = 'loading';
    $('stock-locations').tBodies[0].replaceChildren();
    $('stock-total').dataset.units = '';
    setText($('stock-total'), '—');
    setText($('stock-inactive'), '');
    setText($('stock-freshness'), 'loading…');
  }

  async function pollStock() {
    const product = watched;
    if (!product) return;
    let page;
    let locations;
    try {
      [page, { locations }] = await Promise.all([
        fetchJson(`/v1/products/${encodeURIComponent(product)}`),
        fetchJson('/v1/locations'),
      ]);
    } catch (e) {
      // An id that names no product is the reader's mistake, said in the card, not a failure.
      if (product !== watched || (e.status !== 404 && e.status !== 422)) throw e;
      renderStockMissing(e.message);
      return;
    }
    if (product === watched) renderStock(page, locations);
  }

  function renderStockMissing(message) {
    $('stock-card').dataset.state = 'not-found';
    $('stock-locations').classList.add('hidden');
    const notice = $('stock-not-found');
    notice.classList.remove('hidden');
    setText(notice, message);
    setText($('stock-inactive'), '');
    setText($('stock-freshness'), '');
  }

  // One row per location that ever held the product, in rank order (then location_id, as the
  // service orders them), with the service's total: the units at active locations.
  function renderStock(page, locations) {
    const known = new Map(locations.map((l) => [l.location_id, l]));
    const rank = (s) => (known.has(s.location_id) ? known.get(s.location_id).rank : Infinity);
    const levels = [...page.stock].sort((a, b) => rank(a) - rank(b)
      || (a.location_id < b.location_id ? -1 : Number(a.location_id > b.location_id)));
    const rows = levels.map((s) => {
      const l = known.get(s.location_id);
      const tr = document.createElement('tr');
      Object.assign(tr.dataset, { location: s.location_id, active: String(s.active), units: String(s.available_quantity) });
      const state = cell('');
      const badge = document.createElement('span');
      badge.className = `badge ${s.active ? 'ok' : 'bad'}`;
      badge.textContent = s.active ? 'active' : 'inactive';
      badge.title = s.active ? '' : 'its units are not sold, held or counted as available';
      state.appendChild(badge);
      tr.append(cell(s.location_id, 'mono'), cell(l ? l.name : '—'), cell(l ? String(l.rank) : '—', 'num'),
        state, cell(String(s.available_quantity), `num${s.active ? '' : ' zero'}`));
      return tr;
    });
    $('stock-locations').tBodies[0].replaceChildren(...rows);
    $('stock-locations').classList.remove('hidden');
    $('stock-not-found').classList.add('hidden');
    $('stock-card').dataset.state = 'shown';
    const total = $('stock-total');
    total.dataset.units = String(page.available_quantity);
    setText(total, String(page.available_quantity));
    const inactive = levels.filter((s) => !s.active).reduce((n, s) => n + s.available_quantity, 0);
    const note = $('stock-inactive');
    note.dataset.units = String(inactive);
    setText(note, inactive ? `and ${inactive} at inactive locations, not sold` : '');
    setText($('stock-freshness'),
      `from ${page.served_by}, ${fmtMs(page.stale_by_ms)} behind when read at ${fmtTime(new Date().toISOString())}`);
  }

  // ---------- one product: its recent movements ----------
  // The ledger pages oldest first with a cursor; the card keeps the newest RECENT movements
  // and the cursor, so after the first walk each poll reads only what is new.
  const RECENT = 20;
  const PAGE = 1000;
  let ledger = { product: '', next: '', recent: [] };

  async function pollMovements() {
    const product = watched;
    if (!product) return;
    if (ledger.product !== product) {
      ledger = { product, next: '', recent: [] };
      const card = $('movements-card');
      card.dataset.product = product;
      card.dataset.state = 'loading';
      $('movements').tBodies[0].replaceChildren();
    }
    for (;;) {
      const after = ledger.next ? `&after=${encodeURIComponent(ledger.next)}` : '';
      let page;
      try {
        page = await fetchJson(`/v1/products/${encodeURIComponent(product)}/movements?limit=${PAGE}${after}`);
      } catch (e) {
        if (product !== watched || (e.status !== 404 && e.status !== 422)) throw e;
        renderMovementsMissing(e.message);
        return;
      }
      if (product !== watched || ledger.product !== product) return;
      ledger.next = page.next;
      ledger.recent = ledger.recent.concat(page.movements).slice(-RECENT);
      if (page.movements.length < PAGE) break;
    }
    renderMovements(ledger.recent);
  }

  function renderMovementsMissing(message) {
    $('movements-card').dataset.state = 'not-found';
    $('movements').classList.add('hidden');
    const notice = $('movements-missing');
    notice.classList.remove('hidden');
    setText(notice, message);
  }

  function renderMovements(recent) {
    const rows = recent.map((m) => {
      const tr = document.createElement('tr');
      Object.assign(tr.dataset, { movement: m.movement_id, location: m.location_id, reason: m.reason, delta: String(m.delta) });
      const signed = m.delta > 0 ? `+${m.delta}` : String(m.delta);
      tr.append(cell(fmtTime(m.at)), cell(m.location_id, 'mono'), cell(m.reason),
        cell(signed, `num${m.delta < 0 ? ' zero' : ''}`), cell([m.ref, m.note].filter(Boolean).join(' · '), 'mono'));
      return tr;
    });
    $('movements').tBodies[0].replaceChildren(...rows);
    $('movements').classList.remove('hidden');
    $('movements-missing').classList.add('hidden');
    $('movements-card').dataset.state = 'shown';
  }

  // ---------- start ----------
  function start() {
    if (running) return;
    running = true;
    generation += 1;
    errors.clear();
    showDashboard();
    setStatus('starting', 'loading…');
    every('routing', ROUTING_EVERY_MS, pollRouting);
    every('replicas', REPLICAS_EVERY_MS, pollReplicas);
    every('overview', OVERVIEW_EVERY_MS, pollOverview);
    every('holds', ROUTING_EVERY_MS, pollHolds);
    every('stock', ROUTING_EVERY_MS, pollStock);
    every('movements', ROUTING_EVERY_MS, pollMovements);
  }

  document.addEventListener('DOMContentLoaded', () => {
    $('login-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const t = $('token-input').value.trim();
      if (!t) return;
      sessionStorage.setItem(TOKEN_KEY, t);
      $('token-input').value = '';
      start();
    });
    $('stock-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      watch($('stock-product').value.trim());
    });
    $('forget-token').addEventListener('click', () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showLogin('');
    });
    window.stockgate.takeTokenFromUrl(TOKEN_KEY);
    if (token()) start();
    else showLogin('');
  });
})();

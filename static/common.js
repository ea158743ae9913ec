// Helpers that the ops page and the shop page share, loaded before either (as
// window.stockgate): element lookup, text updates that leave an unchanged node alone, a token
// taken from the address bar into this tab's session storage, and JSON fetches with a
// timeout that never throw.
'use strict';

window.stockgate = (() => {
  const $ = (id) => document.getElementById(id);

  function setText(el, text) {
    if (el && el.textContent !== text) el.textContent = text;
  }

  // Moves `?token=…` into sessionStorage under `key`, and out of the address bar and the
  // history. An empty `?token=` is dropped without replacing a kept token.
  function takeTokenFromUrl(key) {
    const params = new URLSearchParams(location.search);
    const t = params.get('token');
    if (t === null) return;
    if (t.trim()) sessionStorage.setItem(key, t.trim());
    params.delete('token');
    const rest = params.toString();
    window.history.replaceState(null, '', location.pathname + (rest ? `?${rest}` : '') + location.hash);
  }

  // {status, body, headers, network}: status 0 with `network` saying why (and no headers)
  // when there was no answer; body null when the answer was not JSON.
  async function getJson(path, init = {}, timeoutMs = 5000) {
    let resp;
    try {
      resp = await fetch(path, { cache: 'no-store', signal: AbortSignal.timeout(timeoutMs), ...init });
    } catch (e) {
      const network = e.name === 'TimeoutError' ? `no answer within ${timeoutMs / 1000} s` : e.message;
      return { status: 0, body: null, network };
    }
    let body = null;
    try {
      body = await resp.json();
    } catch (_) { /* not JSON */ }
    return { status: resp.status, body, headers: resp.headers };
  }

  // One line for a failed getJson: the contract's error code and message when there is one.
  function describeError(r) {
    if (r.status === 0) return `could not reach the service (${r.network})`;
    const e = r.body && r.body.error;
    return e ? `${r.status} ${e.code}: ${e.message}` : `HTTP ${r.status}`;
  }

  return { $, setText, takeTokenFromUrl, getJson, describeError };
})();

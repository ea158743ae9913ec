"""schemathesis hooks for tests/api/schemathesis.rs (loaded through SCHEMATHESIS_HOOKS).

A real client sends a new Idempotency-Key with each new order. schemathesis draws header
values from the schema and shrinks them towards the same few strings, so without this two
different generated bodies would share a key and be answered 422 IDEMPOTENCY_KEY_REUSED —
correct, but it reads as "the schema admits data the API rejects". A key that is already
valid is made unique; an invalid one (a negative case) is left exactly as generated.
"""

import re
import uuid
from datetime import datetime

import schemathesis


def _valid_key(value):
    return isinstance(value, str) and 1 <= len(value) <= 255 and all(" " <= c <= "~" for c in value)


_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_PLACES = ["default", "sch-elsewhere"]


def _valid_id(value):
    return isinstance(value, str) and _ID.match(value) is not None


def _places(body, query):
    """Locations are data, like products: a well-formed name the fuzzer draws names none
    (422 UNKNOWN_LOCATION, correct, but it reads as "the schema admits data the API
    rejects"). A well-formed name becomes one of the two the test made; a malformed one (a
    negative case) is left exactly as generated."""
    if isinstance(query, dict) and isinstance(query.get("locations"), str):
        names = query["locations"].split(",")
        if all(_valid_id(n) for n in names) and 1 <= len(names) <= 50 and len(set(names)) == len(names):
            query["locations"] = ",".join(_PLACES[: min(len(names), 2)])
    if not isinstance(body, dict):
        return
    locs = body.get("locations")
    if isinstance(locs, list) and locs and all(_valid_id(n) for n in locs) and len(set(locs)) == len(locs):
        body["locations"] = _PLACES[: min(len(locs), 2)]
    stock = body.get("stock")
    if isinstance(stock, list) and stock and all(isinstance(e, dict) and _valid_id(e.get("location_id")) for e in stock):
        ids = [e["location_id"] for e in stock]
        if len(set(ids)) == len(ids):
            for e, place in zip(stock, _PLACES):
                e["location_id"] = place
            del stock[2:]
    # An adjustment's location (it carries a `reason`), like a restock's.
    if "reason" in body and _valid_id(body.get("location_id")):
        body["location_id"] = "default"
    # A restock's location.
    if "quantity" in body and _valid_id(body.get("location_id")) and "from" not in body:
        body["location_id"] = "default"
    # A new location's id is new (409 ALREADY_EXISTS otherwise: the fuzzer repeats few ids).
    if "rank" in body or ("name" in body and "location_id" in body and "price_cents" not in body):
        if _valid_id(body.get("location_id")):
            body["location_id"] = f"{body['location_id'][:40]}-{uuid.uuid4().hex[:16]}"
    if _valid_id(body.get("from")) and _valid_id(body.get("to")):
        body["from"], body["to"] = _PLACES


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    headers = case.headers or {}
    for name in list(headers):
        if name.lower() == "idempotency-key" and _valid_key(headers[name]):
            headers[name] = f"{headers[name][:200]}-{uuid.uuid4().hex[:16]}"
    _places(case.body, case.query)


def _window_in_order(body):
    """A product's sale ends after it starts (422 INVALID_SALE_WINDOW otherwise), a rule
    between two fields that JSON Schema cannot state. Bodies whose dates do not parse are
    left to the API (negative cases)."""
    start, end = body.get("sale_starts_at"), body.get("sale_ends_at")
    if not (isinstance(start, str) and isinstance(end, str)):
        return True
    try:
        s = datetime.fromisoformat(start.replace("z", "Z").replace("t", "T"))
        e = datetime.fromisoformat(end.replace("z", "Z").replace("t", "T"))
        return e > s
    except ValueError:
        return True


@schemathesis.hook
def filter_body(ctx, body):
    """A product's window is in order (see `_window_in_order`).

    A cart or hold names each product once (422 DUPLICATE_PRODUCT otherwise). JSON Schema
    cannot say "unique by `product_id`" (`uniqueItems` compares whole lines), so the rule is
    stated here, where schemathesis asks for constraints a schema cannot express."""
    if isinstance(body, dict) and not _window_in_order(body):
        return False
    if isinstance(body, dict) and "price_cents" in body and "name" in body:
        # A product's stock is no more than 2^31 - 1 units in all (422 STOCK_LIMIT), a sum a schema cannot bound.
        stock = body.get("stock")
        if isinstance(stock, list):
            counts = [e.get("quantity") for e in stock if isinstance(e, dict)]
            if sum(c for c in counts if isinstance(c, int)) > 2147483647:
                return False
    lines = body.get("lines") if isinstance(body, dict) else None
    if not isinstance(lines, list):
        return True
    ids = [line.get("product_id") for line in lines if isinstance(line, dict)]
    named = [i for i in ids if isinstance(i, str)]
    return len(named) == len(set(named))

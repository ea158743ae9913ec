"""schemathesis hooks for tests/api/schemathesis.rs (loaded through SCHEMATHESIS_HOOKS).

A real client sends a new Idempotency-Key with each new order. schemathesis draws header
values from the schema and shrinks them towards the same few strings, so without this two
different generated bodies would share a key and be answered 422 IDEMPOTENCY_KEY_REUSED —
correct, but it reads as "the schema admits data the API rejects". A key that is already
valid is made unique; an invalid one (a negative case) is left exactly as generated.
"""

import uuid
from datetime import datetime

import schemathesis


def _valid_key(value):
    return isinstance(value, str) and 1 <= len(value) <= 255 and all(" " <= c <= "~" for c in value)


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    headers = case.headers or {}
    for name in list(headers):
        if name.lower() == "idempotency-key" and _valid_key(headers[name]):
            headers[name] = f"{headers[name][:200]}-{uuid.uuid4().hex[:16]}"


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
    lines = body.get("lines") if isinstance(body, dict) else None
    if not isinstance(lines, list):
        return True
    ids = [line.get("product_id") for line in lines if isinstance(line, dict)]
    named = [i for i in ids if isinstance(i, str)]
    return len(named) == len(set(named))

"""schemathesis hooks for tests/api/schemathesis.rs (loaded through SCHEMATHESIS_HOOKS).

A real client sends a new Idempotency-Key with each new order. schemathesis draws header
values from the schema and shrinks them towards the same few strings, so without this two
different generated bodies would share a key and be answered 422 IDEMPOTENCY_KEY_REUSED —
correct, but it reads as "the schema admits data the API rejects". A key that is already
valid is made unique; an invalid one (a negative case) is left exactly as generated.
"""

import uuid

import schemathesis


def _valid_key(value):
    return isinstance(value, str) and 1 <= len(value) <= 255 and all(" " <= c <= "~" for c in value)


@schemathesis.hook
def before_call(ctx, case, **kwargs):
    headers = case.headers or {}
    for name in list(headers):
        if name.lower() == "idempotency-key" and _valid_key(headers[name]):
            headers[name] = f"{headers[name][:200]}-{uuid.uuid4().hex[:16]}"


@schemathesis.hook
def filter_body(ctx, body):
    """A cart or hold names each product once (422 DUPLICATE_PRODUCT otherwise). JSON Schema
    cannot say "unique by `product_id`" (`uniqueItems` compares whole lines), so the rule is
    stated here, where schemathesis asks for constraints a schema cannot express."""
    lines = body.get("lines") if isinstance(body, dict) else None
    if not isinstance(lines, list):
        return True
    ids = [line.get("product_id") for line in lines if isinstance(line, dict)]
    named = [i for i in ids if isinstance(i, str)]
    return len(named) == len(set(named))

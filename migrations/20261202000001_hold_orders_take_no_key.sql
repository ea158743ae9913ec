-- The order a confirmed hold becomes claims no Idempotency-Key. The hold's own row already
-- makes a confirm happen once (its guarded `held -> confirmed` change), so the order needs no
-- key, and it must not take one a client may send: until now it took `hold:<hold_id>` in its
-- user's key space, so an order that user had placed with that key (a legal one) made every
-- confirm of the hold fail. A key-less row is outside every client's key space: the
-- UNIQUE (user_id, idempotency_key) never compares NULLs, and no lookup by key finds one.
ALTER TABLE orders
    ALTER COLUMN idempotency_key DROP NOT NULL,
    ALTER COLUMN request_fingerprint DROP NOT NULL;
ALTER TABLE orders ADD CONSTRAINT orders_key_and_fingerprint_together
    CHECK ((idempotency_key IS NULL) = (request_fingerprint IS NULL)) NOT VALID;

-- Confirmed holds' orders written before this release give their keys back.
UPDATE orders o
   SET idempotency_key = NULL, request_fingerprint = NULL
  FROM holds h
 WHERE h.order_id = o.order_id
   AND o.idempotency_key = 'hold:' || h.hold_id::text;

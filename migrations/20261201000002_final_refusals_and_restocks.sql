-- A refusal is final for its key. When stockgate answers 409 OUT_OF_STOCK it first claims
-- the (user, key) with a `refused` row, under the same UNIQUE (user_id, idempotency_key) that
-- an order takes. Whichever commits first wins the key: an order queued elsewhere for the
-- same key can then no longer commit (its insert conflicts and it answers the refusal), and
-- a retry after a confirmed order finds the order instead of refusing. Refused rows are not
-- orders: they hold no stock, no money, and are never shown as orders.
ALTER TABLE orders DROP CONSTRAINT orders_status_check;
ALTER TABLE orders ADD CONSTRAINT orders_status_check
    CHECK (status IN ('confirmed', 'cancelled', 'refused'));
ALTER TABLE orders ADD CONSTRAINT orders_refused_hold_nothing
    CHECK (status <> 'refused' OR total_cents = 0);

-- Every restock, keyed or not: the audit trail of stock given, and the claim of an
-- Idempotency-Key, so a retried restock adds once and answers what the first one did.
CREATE TABLE restocks (
    restock_id          uuid        PRIMARY KEY,
    product_id          text        NOT NULL REFERENCES products (product_id),
    quantity            integer     NOT NULL CHECK (quantity >= 1),
    idempotency_key     text        UNIQUE,
    request_fingerprint text        NOT NULL,
    available_after     integer     NOT NULL CHECK (available_after >= 0),
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX restocks_product_id ON restocks (product_id);

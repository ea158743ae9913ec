-- Carts: an order of several products. Its lines live in order_lines; the order row keeps
-- the key, the status and the total. A single-line order keeps product_id and quantity on
-- the order row (and no order_lines), exactly as before.
ALTER TABLE orders ALTER COLUMN product_id DROP NOT NULL;
ALTER TABLE orders ALTER COLUMN quantity DROP NOT NULL;
ALTER TABLE orders ADD CONSTRAINT orders_single_or_cart
    CHECK ((product_id IS NULL) = (quantity IS NULL));

CREATE TABLE order_lines (
    order_id         uuid    NOT NULL REFERENCES orders (order_id),
    product_id       text    NOT NULL REFERENCES products (product_id),
    quantity         integer NOT NULL CHECK (quantity BETWEEN 1 AND 10000),
    unit_price_cents integer NOT NULL CHECK (unit_price_cents >= 0),
    PRIMARY KEY (order_id, product_id)
);
CREATE INDEX order_lines_product_id ON order_lines (product_id);

-- Holds: units taken out of availability (by a guarded UPDATE, like an order) until the
-- hold is confirmed (they become the order), released, or expires (they return). Each
-- ending is one guarded status change from 'held', so it happens exactly once whatever
-- instance or restart races it. A refused hold claims its key like a refused order.
CREATE TABLE holds (
    hold_id             uuid        PRIMARY KEY,
    user_id             text        NOT NULL,
    idempotency_key     text        NOT NULL,
    request_fingerprint text        NOT NULL,
    status              text        NOT NULL
        CHECK (status IN ('held', 'confirmed', 'released', 'expired', 'refused')),
    expires_at          timestamptz NOT NULL,
    order_id            uuid        REFERENCES orders (order_id),
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at            timestamptz,
    CONSTRAINT holds_user_idempotency_key UNIQUE (user_id, idempotency_key),
    CONSTRAINT holds_confirmed_have_an_order CHECK ((status = 'confirmed') = (order_id IS NOT NULL))
);
CREATE INDEX holds_due ON holds (expires_at) WHERE status = 'held';

CREATE TABLE hold_lines (
    hold_id    uuid    NOT NULL REFERENCES holds (hold_id),
    product_id text    NOT NULL REFERENCES products (product_id),
    quantity   integer NOT NULL CHECK (quantity BETWEEN 1 AND 10000),
    PRIMARY KEY (hold_id, product_id)
);
CREATE INDEX hold_lines_product_id ON hold_lines (product_id);

-- Products and their stock. The CHECK on available_quantity is the last line of defence
-- against oversell: even a buggy guarded UPDATE cannot drive stock below zero.
CREATE TABLE products (
    product_id          text        PRIMARY KEY CHECK (product_id ~ '^[A-Za-z0-9_.-]{1,64}$'),
    name                text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    price_cents         integer     NOT NULL CHECK (price_cents >= 0),
    available_quantity  integer     NOT NULL CHECK (available_quantity >= 0),
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at          timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Orders carry product_id so every statement of the order transaction is keyed by it
-- (the schema can later be distributed by product). The idempotency key is unique per
-- user and is claimed by the order row itself, in the same transaction as the stock.
CREATE TABLE orders (
    order_id            uuid        PRIMARY KEY,
    product_id          text        NOT NULL REFERENCES products (product_id),
    user_id             text        NOT NULL,
    quantity            integer     NOT NULL CHECK (quantity BETWEEN 1 AND 10000),
    unit_price_cents    integer     NOT NULL CHECK (unit_price_cents >= 0),
    total_cents         bigint      NOT NULL CHECK (total_cents >= 0),
    status              text        NOT NULL CHECK (status IN ('confirmed', 'cancelled')),
    idempotency_key     text        NOT NULL,
    request_fingerprint text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    cancelled_at        timestamptz,
    CONSTRAINT orders_user_idempotency_key UNIQUE (user_id, idempotency_key)
);
CREATE INDEX orders_product_id ON orders (product_id);
CREATE INDEX orders_created_at ON orders (created_at);

CREATE TABLE user_settings (
    user_id     text        PRIMARY KEY,
    settings    jsonb       NOT NULL CHECK (jsonb_typeof(settings) = 'object'),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

CREATE TABLE user_profiles (
    user_id       text        PRIMARY KEY,
    display_name  text        NOT NULL,
    email         text        NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Flash drops: a per-customer limit and a sale window per product, decided in the same primary
-- transaction as the guarded UPDATE that takes the stock (the contract's "Flash drops").
--
-- A user's units of a product are counted where they already live, not in a second copy that
-- every cancel, release, expiry and confirm would have to keep in step: its confirmed orders
-- (single-line rows, and cart lines), plus the lines of its live holds. `customer_units` is
-- that one count. It is exact for a caller that holds the product's row lock: every take and
-- every return of the product's units (batches, carts, holds, cancels, releases, expiries)
-- locks that row first, so nothing that changes the count can commit between the count and
-- the caller's commit. A confirmed hold's units are counted once: the hold leaves `held` in the
-- transaction that writes its order.
ALTER TABLE products
    ADD COLUMN max_per_customer integer CHECK (max_per_customer BETWEEN 1 AND 10000),
    ADD COLUMN sale_starts_at   timestamptz,
    ADD COLUMN sale_ends_at     timestamptz,
    ADD CONSTRAINT products_sale_ends_after_it_starts CHECK (sale_ends_at > sale_starts_at);

-- Why a key was refused, when it was not for stock (NULL: OUT_OF_STOCK, as every refusal
-- before this migration): `{"code": "LIMIT_EXCEEDED", "limit": 2, "already": 2}` or
-- `{"code": "SALE_ENDED"}`, so a retry of the key is told the same thing. NOT VALID: every
-- existing row has no refusal yet, and a large `orders` must not be scanned under this
-- migration's exclusive lock; new rows are checked.
ALTER TABLE orders ADD COLUMN refusal jsonb;
ALTER TABLE orders ADD CONSTRAINT orders_refusal_only_on_refused
    CHECK (refusal IS NULL OR status = 'refused') NOT VALID;
ALTER TABLE holds ADD COLUMN refusal jsonb;
ALTER TABLE holds ADD CONSTRAINT holds_refusal_only_on_refused
    CHECK (refusal IS NULL OR status = 'refused') NOT VALID;

-- Units each (product, user) pair holds now. The only way in is the user's own rows, by
-- `user_id`, the leading column of the (user_id, idempotency_key) keys of `orders` and
-- `holds`: each is read in an `OFFSET 0` subquery (a fence the planner does not push other
-- conditions through) on `user_id` alone, so neither the `product_id` index (every order of a
-- hot product) nor the partial index of live holds (every held hold) can be chosen instead,
-- with or without statistics; a cart's or hold's line is then one primary-key probe. The cost
-- is the user's own rows, whatever the product's or the table's size. The settings keep
-- these plans without statistics (see migration 20261202000002); tests/api/plans.rs holds
-- the index entries read per request. PL/pgSQL, not SQL: a SQL function that cannot be
-- inlined (these settings prevent it) is planned again at every call, and the order batch
-- calls it while it holds the product's row lock; PL/pgSQL keeps the plan per connection.
CREATE FUNCTION customer_units(p_products text[], p_users text[])
RETURNS TABLE (product_id text, user_id text, units bigint)
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT k.product_id, k.user_id,
           coalesce((SELECT sum(CASE WHEN x.product_id IS NULL
                                     THEN (SELECT l.quantity FROM order_lines l
                                            WHERE l.order_id = x.order_id
                                              AND l.product_id = k.product_id)
                                     ELSE x.quantity END)
                       FROM (SELECT o.order_id, o.product_id, o.quantity, o.status
                               FROM orders o WHERE o.user_id = k.user_id OFFSET 0) AS x
                      WHERE x.status = 'confirmed'
                        AND (x.product_id IS NULL OR x.product_id = k.product_id)), 0)
         + coalesce((SELECT sum((SELECT l.quantity FROM hold_lines l
                                  WHERE l.hold_id = y.hold_id AND l.product_id = k.product_id))
                       FROM (SELECT h.hold_id, h.status
                               FROM holds h WHERE h.user_id = k.user_id OFFSET 0) AS y
                      WHERE y.status = 'held'), 0)
      FROM (SELECT DISTINCT u.product_id, u.user_id
              FROM unnest(p_products, p_users) AS u(product_id, user_id)) AS k;
END
$$;

-- The order batch, version 2: take_order_batch (migration 20261201000004) with the product's
-- window and limit. A change to this function is a new version in a new migration; the old
-- version stays until no running binary calls it (a rolling deploy never mixes bodies), and
-- is dropped by a later migration.
--
-- What is new, in the order the function decides:
--  * the window, on this primary's clock after the row lock: before `sale_starts_at` nothing
--    is written and every row says `starts_in_ms` (the caller answers SALE_NOT_STARTED for a
--    key that holds nothing); every row also states the window, for the stock gate's cache; from `sale_ends_at` every new key is claimed by a refusal
--    `{"code": "SALE_ENDED"}`;
--  * seating stays first fit in arrival order, stock first: a request that the stock left
--    cannot serve is OUT_OF_STOCK (as the stock gate's early "no" would say), one that the
--    stock can serve but its user's allowance cannot is LIMIT_EXCEEDED, with the limit and
--    the units the user already had (its earlier seats in this batch included);
--  * when a seat's key was claimed concurrently (the rare branch), its units go to this
--    batch's stock refusals in arrival order, each re-judged against its user's count, which
--    then includes this batch's own confirmed rows.
CREATE FUNCTION take_order_batch_v2(
    p_product text,
    p_ids     uuid[],
    p_users   text[],
    p_keys    text[],
    p_qty     integer[],
    p_fps     text[]
) RETURNS TABLE (
    n                   bigint,
    found               integer,
    left_after          integer,
    lock_wait_us        bigint,
    starts_in_ms        bigint,
    sale_starts_at      timestamptz,
    sale_ends_at        timestamptz,
    idempotency_key     text,
    request_fingerprint text,
    refusal             jsonb,
    order_id            uuid,
    product_id          text,
    quantity            integer,
    user_id             text,
    status              text,
    total_cents         bigint,
    created_at          timestamptz,
    cancelled_at        timestamptz,
    unit_price_cents    integer
)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    t0        timestamptz := clock_timestamp();
    v_now     timestamptz;
    v_stock   integer;
    v_price   integer;
    v_limit   integer;
    v_starts  timestamptz;
    v_ends    timestamptz;
    v_wait    bigint;
    v_left    integer;
    v_total   bigint;
    v_starts_in bigint;
    v_already jsonb := '{}';
    v_units   bigint;
    v_state   text[] := array_fill(NULL::text, ARRAY[cardinality(p_ids)]);
    v_why     jsonb[] := array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)]);
    r         record;
BEGIN
    SELECT p.available_quantity, p.price_cents, p.max_per_customer, p.sale_starts_at, p.sale_ends_at
      INTO v_stock, v_price, v_limit, v_starts, v_ends
      FROM products p WHERE p.product_id = p_product FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_wait := (extract(epoch FROM v_now - t0) * 1e6)::bigint;
    v_left := v_stock;

    IF v_starts IS NOT NULL AND v_now < v_starts THEN
        -- Not on sale yet: nothing is written; every key keeps what it held.
        v_starts_in := ceil(extract(epoch FROM v_starts - v_now) * 1000)::bigint;
    ELSE
        IF v_limit IS NOT NULL THEN
            SELECT coalesce(jsonb_object_agg(c.user_id, c.units), '{}') INTO v_already
              FROM customer_units(array_fill(p_product, ARRAY[cardinality(p_users)]), p_users) c;
        END IF;
        FOR r IN
            SELECT u.n::integer AS n, u.usr, u.qty,
                   o.order_id IS NOT NULL
                   OR row_number() OVER (PARTITION BY u.usr, u.key ORDER BY u.n) > 1 AS taken
              FROM unnest(p_users, p_keys, p_qty) WITH ORDINALITY AS u(usr, key, qty, n)
              LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
             ORDER BY u.n
        LOOP
            CONTINUE WHEN r.taken;
            v_state[r.n] := 'refused';
            IF v_ends IS NOT NULL AND v_now >= v_ends THEN
                v_why[r.n] := '{"code": "SALE_ENDED"}';
            ELSIF r.qty > v_left THEN
                NULL; -- OUT_OF_STOCK
            ELSIF v_limit IS NOT NULL
                  AND (v_already->>r.usr)::integer + r.qty > v_limit THEN
                v_why[r.n] := jsonb_build_object('code', 'LIMIT_EXCEEDED', 'product_id', p_product,
                                                 'limit', v_limit,
                                                 'already', (v_already->>r.usr)::integer);
            ELSE
                v_state[r.n] := 'confirmed';
                v_left := v_left - r.qty;
                IF v_limit IS NOT NULL THEN
                    v_already := jsonb_set(v_already, ARRAY[r.usr],
                                           to_jsonb((v_already->>r.usr)::integer + r.qty));
                END IF;
            END IF;
        END LOOP;
    END IF;

    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint, refusal)
        SELECT u.id, p_product, u.usr, u.qty,
               CASE WHEN u.state = 'confirmed' THEN v_price ELSE 0 END,
               CASE WHEN u.state = 'confirmed' THEN v_price::bigint * u.qty ELSE 0 END,
               u.state, u.key, u.fp, u.why
          FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps, v_state, v_why)
               AS u(id, usr, key, qty, fp, state, why)
         WHERE u.state IS NOT NULL
         ORDER BY u.usr COLLATE "C", u.key COLLATE "C"
        ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
        RETURNING orders.quantity AS q, orders.status AS s
    )
    SELECT coalesce(sum(ins.q) FILTER (WHERE ins.s = 'confirmed'), 0) INTO v_total FROM ins;

    IF v_total < v_stock - v_left THEN
        -- A seat's key was claimed concurrently: its units go to our stock refusals, each
        -- re-judged against its user's count (which now includes this batch's rows).
        v_left := v_stock - v_total;
        FOR i IN 1 .. cardinality(p_ids) LOOP
            CONTINUE WHEN v_state[i] IS DISTINCT FROM 'refused' OR v_why[i] IS NOT NULL
                       OR p_qty[i] > v_left;
            IF v_limit IS NOT NULL THEN
                SELECT c.units INTO v_units FROM customer_units(ARRAY[p_product], ARRAY[p_users[i]]) c;
                CONTINUE WHEN v_units + p_qty[i] > v_limit;
            END IF;
            UPDATE orders o
               SET status = 'confirmed', unit_price_cents = v_price,
                   total_cents = v_price::bigint * o.quantity
             WHERE o.order_id = p_ids[i] AND o.status = 'refused';
            -- No row: this refusal's key was claimed concurrently too.
            CONTINUE WHEN NOT FOUND;
            v_left := v_left - p_qty[i];
            v_total := v_total + p_qty[i];
        END LOOP;
    END IF;

    v_left := v_stock;
    IF v_total > 0 THEN
        UPDATE products p
           SET available_quantity = p.available_quantity - v_total,
               updated_at = clock_timestamp()
         WHERE p.product_id = p_product AND p.available_quantity >= v_total
        RETURNING p.available_quantity INTO v_left;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'the guarded stock update changed no row; the batch was rolled back'
                USING ERRCODE = 'XX000';
        END IF;
    END IF;

    RETURN QUERY
        SELECT u.n, v_stock, v_left, v_wait, v_starts_in, v_starts, v_ends, o.idempotency_key,
               o.request_fingerprint, o.refusal, o.order_id, o.product_id, o.quantity,
               o.user_id, o.status, o.total_cents, o.created_at, o.cancelled_at,
               o.unit_price_cents
          FROM unnest(p_users, p_keys) WITH ORDINALITY AS u(usr, key, n)
          LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
         ORDER BY u.n;
END
$$;

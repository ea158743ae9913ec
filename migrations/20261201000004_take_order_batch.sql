-- One order batch in one statement: one round trip, its own transaction. Until now a batch
-- was four round trips (BEGIN, lock + key lookup, insert + guarded UPDATE, COMMIT), and the
-- product's row lock was held, and every other writer of the product waited, across three of
-- them. Here the lock is held only while this function runs and its commit is flushed.
--
-- The batch's requests come as parallel arrays in arrival order: the order id to use for each
-- (p_ids), its user, Idempotency-Key, quantity and body fingerprint. The function:
--  1. locks the product row (FOR NO KEY UPDATE: batches take turns, while inserts that merely
--     reference the product, such as refusals, are not held up). No product: no rows returned.
--  2. seats the requests in arrival order, first fit: a request whose (user, key) already
--     holds something, or that repeats an earlier request's key in this batch, takes nothing;
--     the rest take a seat while stock lasts, or are refused. This statement starts after the
--     lock is held, so it sees every key committed before then.
--  3. claims every new key in one INSERT … ON CONFLICT DO NOTHING, seats as `confirmed`
--     orders and refusals as `refused` rows, in (user, key) byte order: the one lock order
--     every batch and refusal shares, so two batches never deadlock on keys. A key that a
--     concurrent transaction claimed in between conflicts and takes nothing; the units its
--     seat held go to this batch's refused rows, in arrival order.
--  4. takes the confirmed rows' total with ONE guarded UPDATE … WHERE available_quantity >=
--     total, the only thing that confirms an order. If it changed no row (it cannot, while
--     the row is locked), the function raises and the whole batch rolls back.
--  5. returns, for every request in arrival order, what its key holds now (the order this
--     batch wrote, a refusal, or what was there before: the caller judges by order id), with
--     the stock found and left and how long the lock took.
CREATE FUNCTION take_order_batch(
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
    idempotency_key     text,
    request_fingerprint text,
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
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t0      timestamptz := clock_timestamp();
    v_stock integer;
    v_price integer;
    v_wait  bigint;
    v_left  integer;
    v_total bigint;
    v_state text[] := array_fill(NULL::text, ARRAY[cardinality(p_ids)]);
    r       record;
BEGIN
    SELECT p.available_quantity, p.price_cents INTO v_stock, v_price
      FROM products p WHERE p.product_id = p_product FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_wait := (extract(epoch FROM clock_timestamp() - t0) * 1e6)::bigint;

    v_left := v_stock;
    FOR r IN
        SELECT u.n::integer AS n, u.qty,
               o.order_id IS NOT NULL
               OR row_number() OVER (PARTITION BY u.usr, u.key ORDER BY u.n) > 1 AS taken
          FROM unnest(p_users, p_keys, p_qty) WITH ORDINALITY AS u(usr, key, qty, n)
          LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
         ORDER BY u.n
    LOOP
        CONTINUE WHEN r.taken;
        IF r.qty <= v_left THEN
            v_state[r.n] := 'confirmed';
            v_left := v_left - r.qty;
        ELSE
            v_state[r.n] := 'refused';
        END IF;
    END LOOP;

    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint)
        SELECT u.id, p_product, u.usr, u.qty,
               CASE WHEN u.state = 'confirmed' THEN v_price ELSE 0 END,
               CASE WHEN u.state = 'confirmed' THEN v_price::bigint * u.qty ELSE 0 END,
               u.state, u.key, u.fp
          FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps, v_state)
               AS u(id, usr, key, qty, fp, state)
         WHERE u.state IS NOT NULL
         ORDER BY u.usr COLLATE "C", u.key COLLATE "C"
        ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
        RETURNING orders.quantity AS q, orders.status AS s
    )
    SELECT coalesce(sum(ins.q) FILTER (WHERE ins.s = 'confirmed'), 0) INTO v_total FROM ins;

    IF v_total < v_stock - v_left THEN
        -- A seat's key was claimed concurrently: its units go to our refused rows.
        v_left := v_stock - v_total;
        FOR i IN 1 .. cardinality(p_ids) LOOP
            CONTINUE WHEN v_state[i] IS DISTINCT FROM 'refused' OR p_qty[i] > v_left;
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
        SELECT u.n, v_stock, v_left, v_wait, o.idempotency_key, o.request_fingerprint,
               o.order_id, o.product_id, o.quantity, o.user_id, o.status, o.total_cents,
               o.created_at, o.cancelled_at, o.unit_price_cents
          FROM unnest(p_users, p_keys) WITH ORDINALITY AS u(usr, key, n)
          LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
         ORDER BY u.n;
END
$$;

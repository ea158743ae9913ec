-- Order batches, version 3: `take_order_batch_v3` (one product) and `take_order_batches_v3`
-- (several), the statements every order batch now runs (src/checkout/batch.rs). Both run
-- while their product rows are locked, so every microsecond saved is one that every other
-- writer of a hot row stops waiting for. Two costs go, for a product that needs no judgment
-- (no limit, on sale, stock for the whole batch: a flash sale's hot product until its last
-- units, and most products on a normal day):
--
--  * The look-up of every key before the INSERT claims it. take_order_batch_v2 seats each
--    request in a PL/pgSQL loop over the keys it looked up first (one index probe each), so
--    that a held or repeated key takes no seat. With stock for the whole batch nothing needs
--    seating: every request is written as a confirmed order, the INSERT's `ON CONFLICT DO
--    NOTHING` skips a key that holds a row already or is claimed concurrently (a repeat of a
--    key in the batch is dropped before, the first in arrival order kept), and the guarded
--    UPDATE takes the units of the rows it inserted. This is what take_order_batches_v2
--    (migration 20261202000009) already did for several products; a product alone now does
--    it too, in fewer statements.
--  * The read-back of every key after it. When every request wrote its own row — no key
--    twice, none held already, the common case by far — what each key holds is the row it
--    offered, and the INSERT's RETURNING gives the one value the function did not choose
--    (`created_at`). Any other case reads every key back, as version 2 did.
--
-- A product with a limit or a window to judge, or too little stock for its whole batch,
-- still runs take_order_batch_v2, called from here once its row is locked. Nothing about
-- correctness changes: the rows locked and their order, the key claims in (user, key) order
-- and the guarded UPDATE are version 2's; the answers are the same rows. Version 2 of both
-- stays for binaries that still call it (a rolling deploy never mixes bodies) and is dropped
-- by a later migration; take_order_batch_v2 stays as the judged path.
--
-- Measured in the primary with pgbench (one hot product, batches of 37, a never-analyzed
-- table): bench/results/ab-2026-12-03.md.

CREATE FUNCTION take_order_batch_v3(
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
-- As take_order_batch_v2: plans that cannot scan `orders` or `products`, statistics or none.
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
    -- The rows the INSERT wrote, and their `created_at` in order-id order.
    v_wrote   bigint;
    v_at      timestamptz[];
BEGIN
    SELECT p.available_quantity, p.price_cents, p.max_per_customer, p.sale_starts_at, p.sale_ends_at
      INTO v_stock, v_price, v_limit, v_starts, v_ends
      FROM products p WHERE p.product_id = p_product FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_wait := (extract(epoch FROM v_now - t0) * 1e6)::bigint;
    IF v_limit IS NOT NULL
       OR (v_starts IS NOT NULL AND v_now < v_starts)
       OR (v_ends IS NOT NULL AND v_now >= v_ends)
       OR v_stock < (SELECT sum(q) FROM unnest(p_qty) AS q) THEN
        -- Judgment needed: version 2, on the row this transaction holds already (its own
        -- lock wait is then nothing, so this batch's is stated: from before the lock).
        RETURN QUERY
            SELECT t.n, t.found, t.left_after, v_wait,
                   t.starts_in_ms, t.sale_starts_at, t.sale_ends_at, t.idempotency_key,
                   t.request_fingerprint, t.refusal, t.order_id, t.product_id, t.quantity,
                   t.user_id, t.status, t.total_cents, t.created_at, t.cancelled_at,
                   t.unit_price_cents
              FROM take_order_batch_v2(p_product, p_ids, p_users, p_keys, p_qty, p_fps) AS t;
        RETURN;
    END IF;

    -- Every request a confirmed order; a key repeated in the batch once (its first request).
    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint)
        SELECT r.id, p_product, r.usr, r.qty, v_price, v_price::bigint * r.qty, 'confirmed',
               r.key, r.fp
          FROM (SELECT DISTINCT ON (u.usr, u.key) u.*
                  FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps) WITH ORDINALITY
                       AS u(id, usr, key, qty, fp, n)
                 ORDER BY u.usr, u.key, u.n) AS r
         ORDER BY r.usr COLLATE "C", r.key COLLATE "C"
        ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
        RETURNING orders.order_id AS id, orders.quantity AS q, orders.created_at AS at
    )
    SELECT coalesce(sum(ins.q), 0), count(*), array_agg(ins.at ORDER BY ins.id)
      INTO v_total, v_wrote, v_at
      FROM ins;

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

    IF v_wrote = cardinality(p_ids) THEN
        -- Every request wrote its own row: its answer is that row, as inserted. Its
        -- `created_at` is found by rank: the requests' ids and the rows' ids are the same
        -- set, so the k-th request in id order wrote the k-th row in id order.
        RETURN QUERY
            SELECT x.n, v_stock, v_left, v_wait, NULL::bigint, v_starts, v_ends, x.key, x.fp,
                   NULL::jsonb, x.id, p_product, x.qty, x.usr, 'confirmed'::text,
                   v_price::bigint * x.qty, v_at[x.k], NULL::timestamptz, v_price
              FROM (SELECT u.*, row_number() OVER (ORDER BY u.id) AS k
                      FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps) WITH ORDINALITY
                           AS u(id, usr, key, qty, fp, n)) AS x
             ORDER BY x.n;
    ELSE
        RETURN QUERY
            SELECT u.n, v_stock, v_left, v_wait, NULL::bigint, v_starts, v_ends,
                   o.idempotency_key, o.request_fingerprint, o.refusal, o.order_id,
                   o.product_id, o.quantity, o.user_id, o.status, o.total_cents, o.created_at,
                   o.cancelled_at, o.unit_price_cents
              FROM unnest(p_users, p_keys) WITH ORDINALITY AS u(usr, key, n)
              LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
             ORDER BY u.n;
    END IF;
END
$$;

-- take_order_batches_v2 (migration 20261202000009, whose comments hold here) with the two
-- changes above, and each locked product's requests taken by its place among p_products
-- rather than by joining the arrays: the join grew with the square of the products in a
-- statement (up to 1,024).
CREATE FUNCTION take_order_batches_v3(
    p_products text[],
    p_ends     integer[],
    p_ids      uuid[],
    p_users    text[],
    p_keys     text[],
    p_qty      integer[],
    p_fps      text[]
) RETURNS TABLE (
    batch_product       text,
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
-- As take_order_batch_v2: plans that cannot scan `orders` or `products`, statistics or none.
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    t0        timestamptz := clock_timestamp();
    v_now     timestamptz;
    v_wait    bigint;
    -- Each product's first request (its last is p_ends[i]).
    v_lo      integer[];
    -- The rows found, in byte order, as locked.
    v_locked  text[];
    v_stock   integer[];
    v_price   integer[];
    v_starts  timestamptz[];
    v_ends    timestamptz[];
    -- Products seated here together, and products run through take_order_batch_v2.
    v_whole   text[];
    v_one     text[];
    -- What the guarded UPDATE left, per product it changed.
    v_took    integer;
    v_changed integer;
    v_left_of text[];
    v_left    integer[];
    -- The rows the INSERT wrote, and their `created_at` in order-id order.
    v_wrote   bigint;
    v_at      timestamptz[];
    -- The units each locked product's requests ask for, and its place among p_products, in
    -- the order of v_locked.
    v_wanted  bigint[];
    v_pos     bigint[];
BEGIN
    FOR i IN 2 .. cardinality(p_products) LOOP
        IF (p_products[i - 1] COLLATE "C") >= (p_products[i] COLLATE "C") THEN
            RAISE EXCEPTION 'products must come once each, in byte order'
                USING ERRCODE = 'XX000';
        END IF;
    END LOOP;
    v_lo := array_prepend(1, (SELECT array_agg(e + 1 ORDER BY i)
                                FROM unnest(p_ends[1:cardinality(p_ends) - 1]) WITH ORDINALITY AS x(e, i)));

    SELECT array_agg(l.product_id ORDER BY l.product_id COLLATE "C"),
           array_agg(l.available_quantity ORDER BY l.product_id COLLATE "C"),
           array_agg(l.price_cents ORDER BY l.product_id COLLATE "C"),
           array_agg(l.sale_starts_at ORDER BY l.product_id COLLATE "C"),
           array_agg(l.sale_ends_at ORDER BY l.product_id COLLATE "C"),
           array_agg(l.wanted ORDER BY l.product_id COLLATE "C"),
           array_agg(l.j ORDER BY l.product_id COLLATE "C"),
           array_agg(l.product_id) FILTER (WHERE l.max_per_customer IS NULL
                                             AND l.available_quantity >= l.wanted)
      INTO v_locked, v_stock, v_price, v_starts, v_ends, v_wanted, v_pos, v_whole
      FROM (SELECT p.product_id, p.available_quantity, p.price_cents, p.sale_starts_at,
                   p.sale_ends_at, p.max_per_customer,
                   (SELECT sum(q) FROM unnest(p_qty[b.lo:b.hi]) AS q) AS wanted, b.j
              FROM unnest(p_products, v_lo, p_ends) WITH ORDINALITY AS b(product, lo, hi, j)
              JOIN products p ON p.product_id = b.product
             ORDER BY p.product_id COLLATE "C"
               FOR NO KEY UPDATE OF p) AS l;
    IF v_locked IS NULL THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_wait := (extract(epoch FROM v_now - t0) * 1e6)::bigint;
    -- The window is judged after the lock, on this primary's clock: a product that fits and is
    -- on sale is seated here, every other one by its own batch.
    SELECT array_agg(w.product_id) FILTER (WHERE w.whole),
           array_agg(w.product_id) FILTER (WHERE NOT w.whole)
      INTO v_whole, v_one
      FROM (SELECT u.product_id,
                   coalesce(u.product_id = ANY (v_whole), false)
                   AND (u.starts IS NULL OR v_now >= u.starts)
                   AND (u.ends IS NULL OR v_now < u.ends) AS whole
              FROM unnest(v_locked, v_starts, v_ends) AS u(product_id, starts, ends)) AS w;

    IF v_whole IS NOT NULL THEN
        -- Each locked product's requests by its place among p_products (no join).
        WITH r AS (
            SELECT DISTINCT ON (u.usr, u.key) u.id, l.product_id AS product, l.price, u.usr,
                   u.key, u.qty, u.fp
              FROM unnest(v_locked, v_pos, v_price) AS l(product_id, j, price)
             CROSS JOIN LATERAL (SELECT v_lo[l.j] AS lo, p_ends[l.j] AS hi) AS b
             CROSS JOIN LATERAL unnest(p_ids[b.lo:b.hi], p_users[b.lo:b.hi], p_keys[b.lo:b.hi],
                                       p_qty[b.lo:b.hi], p_fps[b.lo:b.hi])
                   WITH ORDINALITY AS u(id, usr, key, qty, fp, n)
             WHERE l.product_id = ANY (v_whole)
             ORDER BY u.usr, u.key, l.j, u.n
        ), ins AS (
            INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                                total_cents, status, idempotency_key, request_fingerprint)
            SELECT r.id, r.product, r.usr, r.qty, r.price, r.price::bigint * r.qty, 'confirmed',
                   r.key, r.fp
              FROM r
             ORDER BY r.usr COLLATE "C", r.key COLLATE "C"
            ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
            RETURNING orders.order_id AS id, orders.product_id AS product, orders.quantity AS q,
                      orders.created_at AS at
        ), t AS (
            SELECT ins.product, sum(ins.q)::integer AS total FROM ins GROUP BY ins.product
        ), upd AS (
            UPDATE products p
               SET available_quantity = p.available_quantity - t.total,
                   updated_at = clock_timestamp()
              FROM t
             WHERE p.product_id = t.product AND p.available_quantity >= t.total
            RETURNING p.product_id, p.available_quantity
        )
        SELECT (SELECT count(*) FROM t), count(*), array_agg(upd.product_id),
               array_agg(upd.available_quantity),
               (SELECT count(*) FROM ins), (SELECT array_agg(ins.at ORDER BY ins.id) FROM ins)
          INTO v_took, v_changed, v_left_of, v_left, v_wrote, v_at
          FROM upd;
        IF v_changed <> v_took THEN
            RAISE EXCEPTION 'the guarded stock update changed no row; the batch was rolled back'
                USING ERRCODE = 'XX000';
        END IF;

        IF v_one IS NULL AND cardinality(v_locked) = cardinality(p_products)
           AND v_wrote = cardinality(p_ids) THEN
            -- Every product was found and seated here, and every request wrote its own row
            -- (no key came twice, none was held already): each request's answer is the row
            -- it offered, as inserted, so nothing is read back, and nothing is joined either.
            -- The locked rows are the products, in the same byte order, so the j-th product's
            -- figures are the j-th of each array, and the guarded UPDATE took exactly what its
            -- requests asked for. A row's `created_at` is found by rank: the requests' ids and
            -- the rows' ids are the same set, so the k-th request in id order wrote the k-th
            -- row in id order. Any other case reads the keys back, below.
            RETURN QUERY
                SELECT x.product, x.n, v_stock[x.j], (v_stock[x.j] - v_wanted[x.j])::integer,
                       v_wait, NULL::bigint, v_starts[x.j], v_ends[x.j], x.key, x.fp,
                       NULL::jsonb, x.id, x.product, x.qty, x.usr, 'confirmed'::text,
                       v_price[x.j]::bigint * x.qty, v_at[x.k], NULL::timestamptz, v_price[x.j]
                  FROM (SELECT b.j, b.product, u.n, u.id, u.usr, u.key, u.qty, u.fp,
                               row_number() OVER (ORDER BY u.id) AS k
                          FROM unnest(p_products, v_lo, p_ends) WITH ORDINALITY AS b(product, lo, hi, j)
                         CROSS JOIN LATERAL unnest(p_ids[b.lo:b.hi], p_users[b.lo:b.hi],
                                                   p_keys[b.lo:b.hi], p_qty[b.lo:b.hi],
                                                   p_fps[b.lo:b.hi])
                               WITH ORDINALITY AS u(id, usr, key, qty, fp, n)) AS x
                 ORDER BY x.j, x.n;
        ELSE
            RETURN QUERY
                SELECT b.product, u.n, l.stock, coalesce(f.left_after, l.stock), v_wait,
                       NULL::bigint, l.starts, l.ends, o.idempotency_key, o.request_fingerprint,
                       o.refusal, o.order_id, o.product_id, o.quantity, o.user_id, o.status,
                       o.total_cents, o.created_at, o.cancelled_at, o.unit_price_cents
                  FROM unnest(p_products, v_lo, p_ends) WITH ORDINALITY AS b(product, lo, hi, j)
                  JOIN unnest(v_locked, v_stock, v_starts, v_ends) AS l(product_id, stock, starts, ends)
                    ON l.product_id = b.product
                  LEFT JOIN unnest(v_left_of, v_left) AS f(product_id, left_after)
                    ON f.product_id = b.product
                 CROSS JOIN LATERAL unnest(p_users[b.lo:b.hi], p_keys[b.lo:b.hi])
                       WITH ORDINALITY AS u(usr, key, n)
                  LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
                 WHERE b.product = ANY (v_whole)
                 ORDER BY b.j, u.n;
        END IF;
    END IF;

    IF v_one IS NOT NULL THEN
        FOR i IN 1 .. cardinality(p_products) LOOP
            CONTINUE WHEN NOT (p_products[i] = ANY (v_one));
            RETURN QUERY
                SELECT p_products[i], t.*
                  FROM take_order_batch_v2(p_products[i], p_ids[v_lo[i]:p_ends[i]],
                                           p_users[v_lo[i]:p_ends[i]], p_keys[v_lo[i]:p_ends[i]],
                                           p_qty[v_lo[i]:p_ends[i]], p_fps[v_lo[i]:p_ends[i]]) AS t;
        END LOOP;
    END IF;
END
$$;

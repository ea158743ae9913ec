-- Order batches, version 3 (`take_order_batches_v3`): take_order_batches_v2 (migration
-- 20261202000009) with two changes, and now the one statement every order batch runs, a single
-- product's included (src/checkout/coalescer.rs).
--
--  * The answers are not read back when they need not be. Version 2 ended by looking up every
--    request's key in `orders` (one index probe and heap fetch per request) to return what
--    the key holds. When every request of the products seated together wrote its own row —
--    no key twice in the batch, none held already, the common case by far — what each key
--    holds is the row it offered, and the INSERT's own RETURNING gives the one value the
--    function did not choose (`created_at`). Any other case reads back as version 2 did.
--  * A single product's batch took `take_order_batch_v2` directly; its seating loop looks up
--    every key before the INSERT claims it, a second probe per request. A product that needs
--    no judgment (no limit, on sale, stock for the whole batch) is now seated by the set-based
--    path whether it comes alone or with others; one that does still runs
--    `take_order_batch_v2`, called from here.
--
-- Both run while the product rows are locked, so every microsecond saved is one every other
-- writer of a hot row stops waiting for. Nothing about correctness changes: the rows locked,
-- the lock order, the key claims and the guarded UPDATE are version 2's, statement for
-- statement; the answers are the same rows. Version 2 stays for binaries that still call it
-- (a rolling deploy never mixes bodies) and is dropped by a later migration.
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
    -- The requests of the products seated together, the rows their INSERT wrote, and those
    -- rows' `created_at` in order-id order.
    v_asked   bigint;
    v_wrote   bigint;
    v_at      timestamptz[];
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
           array_agg(l.product_id) FILTER (WHERE l.max_per_customer IS NULL
                                             AND l.available_quantity >= l.wanted)
      INTO v_locked, v_stock, v_price, v_starts, v_ends, v_whole
      FROM (SELECT p.product_id, p.available_quantity, p.price_cents, p.sale_starts_at,
                   p.sale_ends_at, p.max_per_customer,
                   (SELECT sum(q) FROM unnest(p_qty[b.lo:b.hi]) AS q) AS wanted
              FROM unnest(p_products, v_lo, p_ends) AS b(product, lo, hi)
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
        WITH r AS (
            SELECT DISTINCT ON (u.usr, u.key) u.id, b.product, u.usr, u.key, u.qty, u.fp
              FROM unnest(p_products, v_lo, p_ends) AS b(product, lo, hi)
             CROSS JOIN LATERAL unnest(p_ids[b.lo:b.hi], p_users[b.lo:b.hi], p_keys[b.lo:b.hi],
                                       p_qty[b.lo:b.hi], p_fps[b.lo:b.hi])
                   WITH ORDINALITY AS u(id, usr, key, qty, fp, n)
             WHERE b.product = ANY (v_whole)
             ORDER BY u.usr, u.key, b.lo, u.n
        ), ins AS (
            INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                                total_cents, status, idempotency_key, request_fingerprint)
            SELECT r.id, r.product, r.usr, r.qty, l.price, l.price::bigint * r.qty, 'confirmed',
                   r.key, r.fp
              FROM r JOIN unnest(v_locked, v_price) AS l(product_id, price)
                     ON l.product_id = r.product
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

        SELECT sum(b.hi - b.lo + 1) INTO v_asked
          FROM unnest(p_products, v_lo, p_ends) AS b(product, lo, hi)
         WHERE b.product = ANY (v_whole);
        IF v_wrote = v_asked THEN
            -- Every request wrote its own row (no key came twice, none was held already), so
            -- each request's answer is the row it offered, as inserted: nothing to read back.
            -- Its `created_at` is found by rank: the requests' ids and the rows' ids are the
            -- same set, so the k-th request in id order wrote the k-th row in id order.
            RETURN QUERY
                SELECT x.product, x.n, x.stock, coalesce(f.left_after, x.stock), v_wait,
                       NULL::bigint, x.starts, x.ends, x.key, x.fp, NULL::jsonb, x.id,
                       x.product, x.qty, x.usr, 'confirmed'::text, x.price::bigint * x.qty,
                       v_at[x.k], NULL::timestamptz, x.price
                  FROM (SELECT b.j, b.product, u.n, u.id, u.usr, u.key, u.qty, u.fp, l.stock,
                               l.price, l.starts, l.ends, row_number() OVER (ORDER BY u.id) AS k
                          FROM unnest(p_products, v_lo, p_ends) WITH ORDINALITY AS b(product, lo, hi, j)
                          JOIN unnest(v_locked, v_stock, v_price, v_starts, v_ends)
                               AS l(product_id, stock, price, starts, ends)
                            ON l.product_id = b.product
                         CROSS JOIN LATERAL unnest(p_ids[b.lo:b.hi], p_users[b.lo:b.hi],
                                                   p_keys[b.lo:b.hi], p_qty[b.lo:b.hi],
                                                   p_fps[b.lo:b.hi])
                               WITH ORDINALITY AS u(id, usr, key, qty, fp, n)
                         WHERE b.product = ANY (v_whole)) AS x
                  LEFT JOIN unnest(v_left_of, v_left) AS f(product_id, left_after)
                    ON f.product_id = x.product
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

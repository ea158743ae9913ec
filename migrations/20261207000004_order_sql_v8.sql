-- Order SQL version 8: version 7's answers, at less cost a statement where every product is
-- sold whole (bench/results/README.md, "The 1,000-product gap").
--
--  * The drop rules are asked once for every product's whole batch, not once a product: a
--    verdict on several lines is NULL exactly when each line's is (`drop_verdict_v1` judges
--    every rule line by line; `order_batch::a_verdict_on_several_lines_clears_them_exactly_when_each_
--    line_would` holds it to that). Only when that verdict is not NULL is each product asked
--    on its own, as version 7 asked every one.
--  * An allocation at one place, the answer of nearly every order, is written as text and read
--    as jsonb (`one_allocation_v1`), not built by `jsonb_build_object`, which looks up in the
--    catalogue how to write each of its arguments, every call. A product id and a location id
--    need no escaping in JSON: their tables' checks hold them to `[A-Za-z0-9_.-]`.
--  * The levels' and the products' guarded updates are plain UPDATEs whose changed rows are
--    counted by `GET DIAGNOSTICS … ROW_COUNT` against the rows they were given, not
--    data-modifying CTEs counted by two sub-selects each: the same guard (a row short of its
--    take changes nothing, the counts differ, and the batch rolls back), at less cost: no
--    rows returned, stored and counted again.
--
-- Live after this migration (docs/design/orders.md): take_order_batches_v8 and what it calls;
-- take_order_batches_v7 stays, superseded, for a binary that still calls it; version 6 is
-- dropped.

-- `[{"product_id": …, "location_id": …, "quantity": …}]`: `quantity` units of `product` from
-- `location`. An SQL function of one expression, so the planner writes it into its caller.
CREATE FUNCTION one_allocation_v1(product text, location text, quantity integer)
RETURNS jsonb
LANGUAGE sql STABLE
RETURN ('[{"product_id": "' || product || '", "location_id": "' || location
        || '", "quantity": ' || quantity || '}]')::jsonb;

CREATE FUNCTION take_order_batches_v8(
    p_products text[],
    p_ends     integer[],
    p_ids      uuid[],
    p_users    text[],
    p_keys     text[],
    p_qty      integer[],
    p_fps      text[],
    p_locs     text[],
    p_loc_ends integer[]
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
    unit_price_cents    integer,
    allocations         jsonb
)
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
-- Its statements' plans are pinned by the settings above; a custom plan per call (which
-- `generate_series(1, n)`'s estimate would otherwise bring) is only planning under the row lock.
SET plan_cache_mode = force_generic_plan
-- It moves the levels itself: the triggers for writers that know no location stay out.
SET stockgate.levels = 'on'
-- It locks every product it inserts orders for (see migration 20261206000004).
SET stockgate.products_locked = 'on'
AS $$
#variable_conflict use_column
DECLARE
    t0        timestamptz := clock_timestamp();
    v_now     timestamptz;
    v_wait    bigint;
    v_count   integer := cardinality(p_ids);
    -- Each product's first request (its last is p_ends[j]), and the product each request is for.
    v_lo      integer[];
    v_of      integer[];
    -- Per product j (by its place in p_products; NULL where the product does not exist).
    v_found   boolean[];
    v_stock   integer[];
    v_price   integer[];
    v_limit   integer[];
    v_starts  timestamptz[];
    v_ends    timestamptz[];
    v_wanted  bigint[];
    v_whole   boolean[];
    v_starts_in bigint[];
    v_left    integer[];
    v_seated  bigint[];
    v_took    bigint[];
    v_took_of text[];
    v_took_q  bigint[];
    v_k       integer;
    -- Per request: what it offers ('confirmed', 'refused', NULL: nothing) and why refused.
    v_state   text[];
    v_why     jsonb[];
    v_first   boolean[];
    v_verdict jsonb;
    v_already jsonb;
    v_units   bigint;
    v_wrote   bigint;
    v_at      timestamptz[];
    v_reseated boolean := false;
    v_changed integer;
    v_need    integer;
    -- Requests of the products found, and those that offer a row.
    v_asked   integer := 0;
    -- The active levels of the locked products, in the order a request that names no
    -- location takes from (active_levels_v2), and those locations once each.
    v_lv_j    integer[];
    v_lv_p    text[];
    v_lv_l    text[];
    v_lv_q    integer[];
    v_lv_q0   integer[];
    v_ranked  text[];
    -- Per product: the location of its only level (products.sole_location), and whether
    -- every such location is active (read once, after the locks); whether the levels were read.
    v_sole    text[];
    v_sole_ok boolean;
    -- Whether the drop rules let every product's whole batch through (no limit judged).
    v_all_clear boolean;
    v_read    boolean := false;
    v_named   boolean[];
    v_locs    text[];
    v_left_i  integer;
    v_alloc   jsonb[];
    v_fast    text[];
    -- Per product: its first level (in rank order) with units left, and, when its first
    -- location serves its whole batch, the allocation of its first request's quantity (built
    -- once: most requests of a batch ask for the same quantity).
    v_first_k integer[];
    v_fast_q  integer[];
    v_fast_a  jsonb[];
    -- Whether a product found is not served whole by its first location, and which: only
    -- those rows' allocations are read back for their levels' takes.
    v_slow    boolean := false;
    v_slow_of jsonb := '{}';
    v_at_alloc jsonb[];
    v_a       record;
    v_tk_p    text[];
    v_tk_l    text[];
    v_tk_q    bigint[];
    v_offered integer := 0;
    r         record;
BEGIN
    FOR j IN 2 .. cardinality(p_products) LOOP
        IF (p_products[j - 1] COLLATE "C") >= (p_products[j] COLLATE "C") THEN
            RAISE EXCEPTION 'products must come once each, in byte order' USING ERRCODE = 'XX000';
        END IF;
    END LOOP;
    v_lo := array_fill(1, ARRAY[cardinality(p_products)]);
    FOR j IN 2 .. cardinality(p_products) LOOP
        v_lo[j] := p_ends[j - 1] + 1;
    END LOOP;
    IF cardinality(p_products) = 1 THEN
        v_of := array_fill(1, ARRAY[v_count]);
    ELSE
        v_of := ARRAY(SELECT j FROM unnest(v_lo, p_ends) WITH ORDINALITY AS b(lo, hi, j),
                             generate_series(b.lo, b.hi) ORDER BY j);
    END IF;

    -- 1. The rows, locked in byte order, read into arrays by the product's place (NULL where
    -- the product does not exist).
    SELECT array_agg(l.product_id IS NOT NULL ORDER BY b.j),
           array_agg(l.available_quantity ORDER BY b.j), array_agg(l.price_cents ORDER BY b.j),
           array_agg(l.max_per_customer ORDER BY b.j), array_agg(l.sale_starts_at ORDER BY b.j),
           array_agg(l.sale_ends_at ORDER BY b.j),
           array_agg((SELECT sum(q) FROM unnest(p_qty[v_lo[b.j]:p_ends[b.j]]) AS q) ORDER BY b.j),
           array_agg(l.sole_location ORDER BY b.j)
      INTO v_found, v_stock, v_price, v_limit, v_starts, v_ends, v_wanted, v_sole
      FROM generate_series(1, cardinality(p_products)) AS b(j)
      LEFT JOIN (SELECT x.j, p.product_id, p.available_quantity, p.price_cents,
                        p.max_per_customer, p.sale_starts_at, p.sale_ends_at, p.sole_location
                   FROM unnest(p_products) WITH ORDINALITY AS x(product, j)
                   JOIN products p ON p.product_id = x.product
                  ORDER BY p.product_id COLLATE "C"
                    FOR NO KEY UPDATE OF p) AS l ON l.j = b.j;
    IF NOT (true = ANY (v_found)) THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_wait := (extract(epoch FROM v_now - t0) * 1e6)::bigint;
    -- A product kept at one place, that place active, is sold there without its levels
    -- read: its level holds its whole count (a product's count is the sum of its active
    -- levels; were it not, the guarded level update below would change no row and the batch
    -- would roll back). The flag is read after the locks, in a statement of its own, like the
    -- levels. Any other product, on its first need, has every level read (`v_read`).
    v_first_k := array_fill(NULL::integer, ARRAY[cardinality(p_products)]);
    SELECT coalesce(bool_and(l.active), true) INTO v_sole_ok
      FROM locations l
     WHERE l.location_id IN (SELECT DISTINCT s FROM unnest(v_sole) AS s WHERE s IS NOT NULL);
    -- Which products have a request that names its locations.
    v_named := array_fill(false, ARRAY[cardinality(p_products)]);
    IF cardinality(p_locs) > 0 THEN
        FOR j IN 1 .. cardinality(p_products) LOOP
            v_named[j] := p_loc_ends[p_ends[j]]
                          > CASE WHEN v_lo[j] = 1 THEN 0 ELSE p_loc_ends[v_lo[j] - 1] END;
        END LOOP;
    END IF;
    v_alloc := array_fill(NULL::jsonb, ARRAY[v_count]);
    v_fast := array_fill(NULL::text, ARRAY[cardinality(p_products)]);

    -- The drop rules' verdict on every product's whole batch at once, no limit judged (as the
    -- seating below asks each product's): a verdict on several lines is NULL exactly when
    -- each line's is (drop_verdict_v1 judges every rule line by line), so a NULL here answers
    -- every product's question without a call of its own.
    v_all_clear := drop_verdict_v1(v_now, p_products, v_wanted::integer[], v_stock,
                                   array_fill(NULL::integer, ARRAY[cardinality(p_products)]),
                                   v_starts, v_ends,
                                   array_fill(NULL::bigint, ARRAY[cardinality(p_products)]))
                   IS NULL;

    -- 2. Seating. A product seated whole offers every request a confirmed order (its state
    -- is read from `v_whole`); a repeated key takes one row at the insert below.
    v_state := array_fill(NULL::text, ARRAY[v_count]);
    v_why := array_fill(NULL::jsonb, ARRAY[v_count]);
    v_whole := array_fill(false, ARRAY[cardinality(p_products)]);
    v_starts_in := array_fill(NULL::bigint, ARRAY[cardinality(p_products)]);
    v_left := v_stock;
    v_seated := array_fill(0::bigint, ARRAY[cardinality(p_products)]);
    FOR j IN 1 .. cardinality(p_products) LOOP
        CONTINUE WHEN NOT v_found[j];
        v_asked := v_asked + p_ends[j] - v_lo[j] + 1;
        v_verdict := NULL;
        IF NOT v_all_clear THEN
            v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]],
                                         ARRAY[v_wanted[j]::integer], ARRAY[v_stock[j]],
                                         ARRAY[NULL::integer], ARRAY[v_starts[j]],
                                         ARRAY[v_ends[j]], ARRAY[NULL::bigint]);
        END IF;
        IF v_verdict->>'code' = 'SALE_NOT_STARTED' THEN
            -- Nothing of this product is written: every key keeps what it held.
            v_starts_in[j] := (v_verdict->>'retry_after_ms')::bigint;
            CONTINUE;
        END IF;
        v_whole[j] := v_limit[j] IS NULL AND v_verdict IS NULL AND NOT v_named[j];
        -- Every product but one seated whole at its one active location needs the levels.
        IF NOT v_read AND NOT (v_whole[j] AND v_sole[j] IS NOT NULL AND v_sole_ok) THEN
            v_read := true;
            SELECT * INTO v_lv_j, v_lv_p, v_lv_l, v_lv_q, v_ranked, v_first_k
              FROM order_levels_v1(p_products);
            v_lv_q0 := v_lv_q;
        END IF;
        IF v_whole[j] THEN
            v_seated[j] := v_wanted[j];
            v_left[j] := v_stock[j] - v_wanted[j];
            v_offered := v_offered + p_ends[j] - v_lo[j] + 1;
            -- Where each request's units come from. The product's first location with units
            -- left serves the whole batch when it can (`v_fast`; every request there, nothing
            -- looked up: the locations before it serve nothing, the rule picks it for each);
            -- otherwise each request in arrival order (a repeated key's allocation is never
            -- written: its units stay where they are, and only later requests of this batch
            -- may be sent further down the order for them).
            -- A product kept at one active place is served there whole (its levels unread).
            IF v_sole[j] IS NOT NULL AND v_sole_ok THEN
                v_fast[j] := v_sole[j];
            ELSE
                v_k := v_first_k[j];
                IF v_k IS NOT NULL AND v_lv_q[v_k] >= v_wanted[j] THEN
                    v_fast[j] := v_lv_l[v_k];
                    v_lv_q[v_k] := v_lv_q[v_k] - v_wanted[j];
                END IF;
            END IF;
            IF v_fast[j] IS NOT NULL THEN
                v_fast_q[j] := p_qty[v_lo[j]];
                v_fast_a[j] := one_allocation_v1(p_products[j], v_fast[j], p_qty[v_lo[j]]);
                CONTINUE;
            END IF;
            FOR i IN v_lo[j] .. p_ends[j] LOOP
                SELECT * INTO v_a FROM allocate_v1(ARRAY[p_products[j]], ARRAY[p_qty[i]],
                                                   v_ranked, v_lv_p, v_lv_l, v_lv_q);
                IF v_a.allocations IS NULL THEN
                    RAISE EXCEPTION 'the levels of % do not add up to its count', p_products[j]
                        USING ERRCODE = 'XX000';
                END IF;
                v_alloc[i] := v_a.allocations;
                v_lv_q := v_a.left_after;
            END LOOP;
            CONTINUE;
        END IF;
        -- Judged request by request: a key's first request in the statement (by product, then
        -- arrival) is the only one that may take a seat.
        IF v_first IS NULL THEN
            v_first := ARRAY(SELECT row_number() OVER (PARTITION BY u.usr, u.key ORDER BY u.n) = 1
                               FROM unnest(p_users, p_keys) WITH ORDINALITY AS u(usr, key, n)
                              ORDER BY u.n);
        END IF;
        IF v_limit[j] IS NOT NULL THEN
            SELECT coalesce(jsonb_object_agg(c.user_id, c.units), '{}') INTO v_already
              FROM customer_units_v2(array_fill(p_products[j], ARRAY[p_ends[j] - v_lo[j] + 1]),
                                     p_users[v_lo[j]:p_ends[j]]) c;
        END IF;
        FOR r IN
            SELECT u.i::integer AS i, u.usr, u.qty, o.order_id IS NOT NULL AS held
              FROM unnest(p_users[v_lo[j]:p_ends[j]], p_keys[v_lo[j]:p_ends[j]],
                          p_qty[v_lo[j]:p_ends[j]]) WITH ORDINALITY AS u(usr, key, qty, i)
              LEFT JOIN orders o ON o.user_id = u.usr AND o.idempotency_key = u.key
             ORDER BY u.i
        LOOP
            CONTINUE WHEN r.held OR NOT v_first[v_lo[j] + r.i - 1];
            -- What this request may take: its own locations' levels, or the product's count.
            v_locs := request_locations_v1(p_locs, p_loc_ends, v_lo[j] + r.i - 1, v_ranked);
            v_left_i := v_left[j];
            IF v_named[j] THEN
                v_left_i := locations_left_v1(p_products[j], v_locs, v_lv_p, v_lv_l, v_lv_q);
            END IF;
            v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]], ARRAY[r.qty],
                                         ARRAY[v_left_i], ARRAY[v_limit[j]], ARRAY[v_starts[j]],
                                         ARRAY[v_ends[j]],
                                         ARRAY[(v_already->>r.usr)::bigint]);
            v_offered := v_offered + 1;
            IF v_verdict IS NULL THEN
                SELECT * INTO v_a FROM allocate_v1(ARRAY[p_products[j]], ARRAY[r.qty],
                                                   v_locs, v_lv_p, v_lv_l, v_lv_q);
                IF v_a.allocations IS NULL THEN
                    RAISE EXCEPTION 'the levels of % do not add up to its count', p_products[j]
                        USING ERRCODE = 'XX000';
                END IF;
                v_alloc[v_lo[j] + r.i - 1] := v_a.allocations;
                v_lv_q := v_a.left_after;
                v_state[v_lo[j] + r.i - 1] := 'confirmed';
                v_left[j] := v_left[j] - r.qty;
                v_seated[j] := v_seated[j] + r.qty;
                IF v_limit[j] IS NOT NULL THEN
                    v_already := jsonb_set(v_already, ARRAY[r.usr],
                                           to_jsonb((v_already->>r.usr)::bigint + r.qty));
                END IF;
            ELSE
                v_state[v_lo[j] + r.i - 1] := 'refused';
                -- A stock refusal stores NULL (every refusal before flash drops did).
                v_why[v_lo[j] + r.i - 1] := CASE WHEN v_verdict->>'code' <> 'OUT_OF_STOCK'
                                                 THEN v_verdict END;
            END IF;
        END LOOP;
    END LOOP;

    FOR j IN 1 .. cardinality(p_products) LOOP
        v_slow := v_slow OR (v_found[j] AND v_fast[j] IS NULL);
    END LOOP;
    IF v_slow THEN
        v_slow_of := (SELECT jsonb_object_agg(f.p, true)
                        FROM unnest(p_products, v_fast, v_found) AS f(p, l, found)
                       WHERE f.found AND f.l IS NULL);
    END IF;

    -- 3. Every key of the statement claimed in one (user, key) byte order.
    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint, refusal,
                            allocations)
        SELECT u.id, p_products[u.j], u.usr, u.qty,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j] ELSE 0 END,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j]::bigint * u.qty ELSE 0 END,
               u.st, u.key, u.fp, u.why,
               CASE WHEN v_fast[u.j] IS NULL THEN coalesce(u.alloc, '[]')
                    WHEN u.qty = v_fast_q[u.j] THEN v_fast_a[u.j]
                    ELSE one_allocation_v1(p_products[u.j], v_fast[u.j], u.qty) END
          -- The requests' arrays read once each (unnest), not by subscript per row: an
          -- element of a text array is found by walking the elements before it.
          FROM (SELECT x.*, CASE WHEN v_whole[x.j] THEN 'confirmed' ELSE x.state END AS st
                  FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps, v_of, v_state, v_why, v_alloc)
                       WITH ORDINALITY AS x(id, usr, key, qty, fp, j, state, why, alloc, i)) AS u
         WHERE u.st IS NOT NULL
         -- A key repeated in the statement: its first request (by product, then arrival) is
         -- the row; the others' conflict with it.
         ORDER BY u.usr COLLATE "C", u.key COLLATE "C", u.i
        ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
        RETURNING orders.order_id AS id, orders.product_id AS product, orders.quantity AS q,
                  orders.status AS s, orders.created_at AS at, orders.allocations AS alloc
    ), t AS (
        SELECT ins.product, coalesce(sum(ins.q) FILTER (WHERE ins.s = 'confirmed'), 0) AS q
          FROM ins GROUP BY ins.product
    ), lv AS (
        -- The levels' takes of the products not served whole by their first location: what
        -- their rows' allocations say (the others' are added below, from their rows' sums).
        SELECT a.product_id, a.location_id, sum(a.quantity) AS q
          FROM ins CROSS JOIN LATERAL jsonb_to_recordset(ins.alloc)
                                AS a(product_id text, location_id text, quantity integer)
         WHERE v_slow AND v_slow_of ? ins.product
         GROUP BY a.product_id, a.location_id
    )
    SELECT (SELECT count(*) FROM ins), (SELECT array_agg(ins.at ORDER BY ins.id) FROM ins),
           (SELECT array_agg(ins.alloc ORDER BY ins.id) FROM ins),
           array_agg(t.product ORDER BY t.product COLLATE "C"),
           array_agg(t.q ORDER BY t.product COLLATE "C"),
           (SELECT array_agg(lv.product_id) FROM lv), (SELECT array_agg(lv.location_id) FROM lv),
           (SELECT array_agg(lv.q) FROM lv)
      INTO v_wrote, v_at, v_at_alloc, v_took_of, v_took_q, v_tk_p, v_tk_l, v_tk_q
      FROM t;
    -- Each product's units written, by its place: both lists are in byte order.
    v_took := array_fill(0::bigint, ARRAY[cardinality(p_products)]);
    v_k := 1;
    FOR j IN 1 .. cardinality(p_products) LOOP
        EXIT WHEN v_k > coalesce(cardinality(v_took_of), 0);
        IF v_took_of[v_k] = p_products[j] THEN
            v_took[j] := v_took_q[v_k];
            v_k := v_k + 1;
        END IF;
    END LOOP;
    -- A product served whole by its first location took what its rows took, there.
    FOR j IN 1 .. cardinality(p_products) LOOP
        IF v_fast[j] IS NOT NULL AND v_took[j] > 0 THEN
            v_tk_p := v_tk_p || p_products[j];
            v_tk_l := v_tk_l || v_fast[j];
            v_tk_q := v_tk_q || v_took[j];
        END IF;
    END LOOP;

    -- 4. A judged product whose seat's key was claimed concurrently: its units go to this
    -- batch's refused requests, each judged again.
    FOR j IN 1 .. cardinality(p_products) LOOP
        CONTINUE WHEN NOT v_found[j] OR v_whole[j] OR v_took[j] >= v_seated[j];
        IF NOT v_reseated THEN
            -- What is left at each level: what the rows written took, nothing else.
            v_lv_q := v_lv_q0;
            FOR k IN 1 .. coalesce(cardinality(v_lv_q), 0) LOOP
                FOR m IN 1 .. coalesce(cardinality(v_tk_p), 0) LOOP
                    IF v_tk_p[m] = v_lv_p[k] AND v_tk_l[m] = v_lv_l[k] THEN
                        v_lv_q[k] := v_lv_q[k] - v_tk_q[m];
                    END IF;
                END LOOP;
            END LOOP;
        END IF;
        v_reseated := true;
        v_left[j] := v_stock[j] - v_took[j];
        FOR i IN v_lo[j] .. p_ends[j] LOOP
            CONTINUE WHEN v_state[i] IS DISTINCT FROM 'refused';
            IF v_limit[j] IS NOT NULL THEN
                SELECT c.units INTO v_units
                  FROM customer_units_v2(ARRAY[p_products[j]], ARRAY[p_users[i]]) c;
            END IF;
            v_locs := request_locations_v1(p_locs, p_loc_ends, i, v_ranked);
            v_left_i := v_left[j];
            IF v_named[j] THEN
                v_left_i := locations_left_v1(p_products[j], v_locs, v_lv_p, v_lv_l, v_lv_q);
            END IF;
            v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]], ARRAY[p_qty[i]],
                                         ARRAY[v_left_i], ARRAY[v_limit[j]], ARRAY[v_starts[j]],
                                         ARRAY[v_ends[j]], ARRAY[v_units]);
            IF v_verdict IS NULL THEN
                SELECT * INTO v_a FROM allocate_v1(ARRAY[p_products[j]], ARRAY[p_qty[i]],
                                                   v_locs, v_lv_p, v_lv_l, v_lv_q);
                IF v_a.allocations IS NULL THEN
                    RAISE EXCEPTION 'the levels of % do not add up to its count', p_products[j]
                        USING ERRCODE = 'XX000';
                END IF;
                UPDATE orders o
                   SET status = 'confirmed', unit_price_cents = v_price[j],
                       total_cents = v_price[j]::bigint * o.quantity, refusal = NULL,
                       allocations = v_a.allocations
                 WHERE o.order_id = p_ids[i] AND o.status = 'refused';
                -- No row: this refusal's key was claimed concurrently too.
                CONTINUE WHEN NOT FOUND;
                v_lv_q := v_a.left_after;
                v_left[j] := v_left[j] - p_qty[i];
                v_took[j] := v_took[j] + p_qty[i];
            ELSE
                -- Still refused: for the reason that holds now (a limit's `already` no longer
                -- counts the seat that was not taken).
                UPDATE orders o
                   SET refusal = CASE WHEN v_verdict->>'code' <> 'OUT_OF_STOCK' THEN v_verdict END
                 WHERE o.order_id = p_ids[i] AND o.status = 'refused';
            END IF;
        END LOOP;
    END LOOP;

    -- 5. Each product's units, with one guarded UPDATE, and each level's, with another.
    IF v_reseated THEN
        -- The levels' takes, as written: this statement's rows (their ids are its own).
        SELECT array_agg(a.product_id), array_agg(a.location_id), array_agg(a.q)
          INTO v_tk_p, v_tk_l, v_tk_q
          -- By id alone (the status tested on the row): a join condition on the status
          -- lets a plan without statistics walk the whole confirmed-orders index per id.
          FROM (SELECT a.product_id, a.location_id, sum(a.quantity) AS q
                  FROM unnest(p_ids) AS x(id)
                  JOIN orders o ON o.order_id = x.id
                 CROSS JOIN LATERAL jsonb_to_recordset(CASE WHEN o.status = 'confirmed'
                                                            THEN o.allocations ELSE '[]' END)
                                AS a(product_id text, location_id text, quantity integer)
                 GROUP BY a.product_id, a.location_id) a;
    END IF;
    v_need := 0;
    FOR k IN 1 .. coalesce(cardinality(v_tk_q), 0) LOOP
        IF v_tk_q[k] > 0 THEN v_need := v_need + 1; END IF;
    END LOOP;
    UPDATE stock_levels s
       SET available_quantity = s.available_quantity - t.q, updated_at = clock_timestamp()
      FROM unnest(v_tk_p, v_tk_l, v_tk_q) AS t(p, l, q)
     WHERE t.q > 0 AND s.product_id = t.p AND s.location_id = t.l AND s.available_quantity >= t.q;
    GET DIAGNOSTICS v_changed = ROW_COUNT;
    IF v_changed <> v_need THEN
        RAISE EXCEPTION 'a guarded level update changed no row; the batch was rolled back'
            USING ERRCODE = 'XX000';
    END IF;
    v_need := 0;
    FOR j IN 1 .. cardinality(p_products) LOOP
        IF v_took[j] > 0 THEN v_need := v_need + 1; END IF;
    END LOOP;
    UPDATE products p
       SET available_quantity = p.available_quantity - t.total, updated_at = clock_timestamp()
      FROM unnest(p_products, v_took) AS t(product, total)
     WHERE t.total > 0 AND p.product_id = t.product AND p.available_quantity >= t.total;
    GET DIAGNOSTICS v_changed = ROW_COUNT;
    IF v_changed <> v_need THEN
        RAISE EXCEPTION 'the guarded stock update changed no row; the batch was rolled back'
            USING ERRCODE = 'XX000';
    END IF;
    FOR j IN 1 .. cardinality(p_products) LOOP
        v_left[j] := v_stock[j] - v_took[j];
    END LOOP;

    -- 6. The answers.
    IF NOT v_reseated AND v_wrote = v_offered AND v_offered = v_asked THEN
        -- Every request of a product found wrote the row it offered (so none is before its
        -- sale, where a key that holds nothing must be told apart from one that holds
        -- something): its answer is that row, as inserted. Its `created_at` is found by rank: the rows' ids are the
        -- offered ids, so the k-th offered id in id order wrote the k-th row in id order.
        RETURN QUERY
            SELECT p_products[x.j], (x.i - v_lo[x.j] + 1)::bigint, v_stock[x.j], v_left[x.j],
                   v_wait, v_starts_in[x.j], v_starts[x.j], v_ends[x.j], x.key, x.fp, x.why, x.id,
                   p_products[x.j], x.qty, x.usr, x.st,
                   CASE WHEN x.st = 'confirmed' THEN v_price[x.j]::bigint * x.qty ELSE 0 END,
                   v_at[x.k], NULL::timestamptz,
                   CASE WHEN x.st = 'confirmed' THEN v_price[x.j] ELSE 0 END,
                   v_at_alloc[x.k]
              FROM (SELECT u.*, CASE WHEN v_whole[u.j] THEN 'confirmed' ELSE u.state END AS st,
                           row_number() OVER (ORDER BY u.id) AS k
                      FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps, v_of, v_state, v_why)
                           WITH ORDINALITY AS u(id, usr, key, qty, fp, j, state, why, i)
                     WHERE v_found[u.j]) AS x
             ORDER BY x.i;
    ELSE
        RETURN QUERY
            SELECT p_products[x.j], (x.i - v_lo[x.j] + 1)::bigint, v_stock[x.j], v_left[x.j],
                   v_wait, v_starts_in[x.j], v_starts[x.j], v_ends[x.j],
                   o.idempotency_key, o.request_fingerprint, o.refusal, o.order_id,
                   o.product_id, o.quantity, o.user_id, o.status, o.total_cents, o.created_at,
                   o.cancelled_at, o.unit_price_cents, o.allocations
              FROM unnest(p_users, p_keys, v_of) WITH ORDINALITY AS x(usr, key, j, i)
              LEFT JOIN orders o ON o.user_id = x.usr AND o.idempotency_key = x.key
             WHERE v_found[x.j]
             ORDER BY x.i;
    END IF;
END
$$;

COMMENT ON FUNCTION take_order_batches_v7(text[], integer[], uuid[], text[], text[], integer[], text[], text[], integer[])
    IS 'superseded by take_order_batches_v8';
DROP FUNCTION take_order_batches_v6(text[], integer[], uuid[], text[], text[], integer[], text[], text[], integer[]);

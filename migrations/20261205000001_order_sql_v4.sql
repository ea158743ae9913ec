-- The order SQL, version 4: one home for the drop rules and one statement for every order batch.
--
-- Live after this migration (docs/design/orders.md draws the call graph):
--
--   take_order_batches_v4   every order batch, of one product or of several (src/checkout/batch.rs)
--   lines_verdicts_v1       the drop rules for carts and holds (src/checkout/drops.rs)
--   drop_verdict_v1         THE drop rules: called by both of the above and by the refusal claim
--   customer_units_v2       a user's units of a product, for the limit
--
-- Kept for binaries that still call version 3 (a rolling deploy never mixes bodies), each
-- marked "superseded by" its successor and dropped once no binary calls it:
-- take_order_batch_v3, take_order_batches_v3, and what they call (take_order_batch_v2,
-- customer_units). tests/api/order_batch.rs (`only_live_sql_is_installed`) reads pg_proc and
-- refuses any other function: dead SQL fails the build.
--
-- Dropped here: versions 1 and 2 of the batches, which no binary has called since version 3.
DROP FUNCTION take_order_batch(text, uuid[], text[], text[], integer[], text[]);
DROP FUNCTION take_order_batches_v1(text[], integer[], uuid[], text[], text[], integer[], text[]);
DROP FUNCTION take_order_batches_v2(text[], integer[], uuid[], text[], text[], integer[], text[]);

COMMENT ON FUNCTION take_order_batch_v3(text, uuid[], text[], text[], integer[], text[])
    IS 'superseded by take_order_batches_v4';
COMMENT ON FUNCTION take_order_batches_v3(text[], integer[], uuid[], text[], text[], integer[], text[])
    IS 'superseded by take_order_batches_v4';

-- customer_units (migration 20261203000004), versioned with its callers: a user's units of
-- each (product, user) pair, its confirmed orders and the lines of its live holds. Exact for
-- a caller that holds the product's row lock (every take and return of a product's units
-- locks that row first). The plan notes of migrations 20261202000005 and 20261203000004 hold.
CREATE FUNCTION customer_units_v2(p_products text[], p_users text[])
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
                       FROM (SELECT o.order_id, o.product_id, o.quantity
                               FROM orders o
                              WHERE o.user_id = k.user_id AND o.status = 'confirmed'
                             OFFSET 0) AS x
                      WHERE x.product_id IS NULL OR x.product_id = k.product_id), 0)
         + coalesce((SELECT sum((SELECT l.quantity FROM hold_lines l
                                  WHERE l.hold_id = y.hold_id AND l.product_id = k.product_id))
                       FROM (SELECT h.hold_id, h.status
                               FROM holds h WHERE h.user_id = k.user_id OFFSET 0) AS y
                      WHERE y.status = 'held'), 0)
      FROM (SELECT DISTINCT u.product_id, u.user_id
              FROM unnest(p_products, p_users) AS u(product_id, user_id)) AS k;
END
$$;

-- The drop rules (the contract's "Flash drops"), judged for one request: an order's line, or
-- a cart's or hold's lines (each product once), in the order the contract gives:
--
--  1. the window: before a line's `sale_starts_at` nothing may be written and the key stays
--     free (`SALE_NOT_STARTED`, retry once the latest start has passed); from a line's
--     `sale_ends_at` the key is refused for good (`SALE_ENDED`);
--  2. stock: every line whose units exceed what is left for it (`OUT_OF_STOCK`, naming them);
--  3. each limited line's allowance: the user's units before this request plus its own
--     (`LIMIT_EXCEEDED`, the first line over, with the limit and the units already held).
--
-- NULL: the request may be taken. The answer is what a refused key stores (`refusal`; a
-- stock refusal stores NULL there) and what the caller maps to its error, nothing more: no
-- caller restates a rule. Pure: `p_left` is what the caller's locked rows leave for this
-- request, `p_already` the user's units of each limited line (NULL where no limit).
CREATE FUNCTION drop_verdict_v1(
    p_now      timestamptz,
    p_products text[],
    p_qty      integer[],
    p_left     integer[],
    p_limit    integer[],
    p_starts   timestamptz[],
    p_ends     timestamptz[],
    p_already  bigint[]
) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_starts timestamptz;
    v_short  jsonb := '[]';
BEGIN
    FOR i IN 1 .. cardinality(p_products) LOOP
        IF p_starts[i] > p_now AND (v_starts IS NULL OR p_starts[i] > v_starts) THEN
            v_starts := p_starts[i];
        END IF;
    END LOOP;
    IF v_starts IS NOT NULL THEN
        RETURN jsonb_build_object('code', 'SALE_NOT_STARTED',
                                  'retry_after_ms', ceil(extract(epoch FROM v_starts - p_now) * 1000)::bigint);
    END IF;
    FOR i IN 1 .. cardinality(p_products) LOOP
        IF p_ends[i] <= p_now THEN
            RETURN '{"code": "SALE_ENDED"}';
        END IF;
    END LOOP;
    FOR i IN 1 .. cardinality(p_products) LOOP
        IF p_qty[i] > p_left[i] THEN
            v_short := v_short || jsonb_build_object('product_id', p_products[i],
                                                     'requested', p_qty[i],
                                                     'available', p_left[i]);
        END IF;
    END LOOP;
    IF jsonb_array_length(v_short) > 0 THEN
        RETURN jsonb_build_object('code', 'OUT_OF_STOCK', 'lines', v_short);
    END IF;
    FOR i IN 1 .. cardinality(p_products) LOOP
        IF p_limit[i] IS NOT NULL AND p_already[i] + p_qty[i] > p_limit[i] THEN
            RETURN jsonb_build_object('code', 'LIMIT_EXCEEDED', 'product_id', p_products[i],
                                      'limit', p_limit[i], 'already', greatest(p_already[i], 0));
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

-- The verdicts of carts (or a hold) whose product rows the caller has locked, in arrival
-- order: cart c's lines are p_products[p_ends[c-1]+1 .. p_ends[c]] (each product once), for
-- p_users[c]. Each is judged (drop_verdict_v1) against what the carts before it that may be
-- taken left of the locked stock. `p_counted`: the user's count already includes these lines
-- (a hold's own lines, written before the lock), so they are taken off its `already`. A cart
-- naming an unknown product, or in a batch (`p_batch`) a limited one, is not judged (NULL)
-- and leaves the stock to the carts after it. It locks the rows itself, so a cart batch, a
-- cart or a hold locks and is judged in one round trip (src/checkout/drops.rs,
-- `lock_and_judge`); the rows come first in its answer (`cart` NULL).
CREATE FUNCTION lines_verdicts_v1(
    p_users    text[],
    p_ends     integer[],
    p_products text[],
    p_qty      integer[],
    p_counted  boolean,
    p_batch    boolean
) RETURNS TABLE (cart integer, verdict jsonb, product_id text, price_cents integer,
                 max_per_customer integer)
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_now     timestamptz := clock_timestamp();
    v_known   text[];
    v_stock   integer[];
    v_limit   integer[];
    v_starts  timestamptz[];
    v_ends    timestamptz[];
    v_lo      integer := 1;
    v_n       integer;
    v_at      integer;
    v_limited boolean;
    v_missing boolean;
    -- One cart's lines' figures, in its lines' order.
    c_left    integer[];
    c_limit   integer[];
    c_starts  timestamptz[];
    c_ends    timestamptz[];
    c_already bigint[];
    v_verdict jsonb;
BEGIN
    -- The rows, locked in the lock order every writer shares; each is a row of the answer
    -- (`cart` NULL), for the caller's prices and limits.
    SELECT array_agg(p.product_id), array_agg(p.available_quantity), array_agg(p.max_per_customer),
           array_agg(p.sale_starts_at), array_agg(p.sale_ends_at)
      INTO v_known, v_stock, v_limit, v_starts, v_ends
      FROM (SELECT x.* FROM products x WHERE x.product_id = ANY (p_products)
             ORDER BY x.product_id COLLATE "C" FOR NO KEY UPDATE) p;
    RETURN QUERY
        SELECT NULL::integer, NULL::jsonb, p.product_id, p.price_cents, p.max_per_customer
          FROM products p WHERE p.product_id = ANY (v_known);
    FOR c IN 1 .. cardinality(p_ends) LOOP
        v_n := p_ends[c] - v_lo + 1;
        c_left := '{}'; c_limit := '{}'; c_starts := '{}'; c_ends := '{}';
        v_limited := false;
        v_missing := false;
        FOR i IN v_lo .. p_ends[c] LOOP
            v_at := array_position(v_known, p_products[i]);
            v_missing := v_missing OR v_at IS NULL;
            c_left := c_left || v_stock[v_at];
            c_limit := c_limit || v_limit[v_at];
            c_starts := c_starts || v_starts[v_at];
            c_ends := c_ends || v_ends[v_at];
            v_limited := v_limited OR v_limit[v_at] IS NOT NULL;
        END LOOP;
        IF v_missing OR (p_batch AND v_limited) THEN
            -- Not judged, and takes nothing from the carts after it: the caller answers it
            -- (an unknown product) or places it alone (a limit, in a batch).
            RETURN QUERY SELECT c, NULL::jsonb, NULL::text, NULL::integer, NULL::integer;
            v_lo := p_ends[c] + 1;
            CONTINUE;
        END IF;
        c_already := NULL;
        IF v_limited THEN
            c_already := ARRAY(
                SELECT coalesce(cu.units, 0) - CASE WHEN p_counted THEN l.q ELSE 0 END
                  FROM unnest(p_products[v_lo:p_ends[c]], p_qty[v_lo:p_ends[c]])
                       WITH ORDINALITY AS l(p, q, i)
                  LEFT JOIN customer_units_v2(p_products[v_lo:p_ends[c]],
                                              array_fill(p_users[c], ARRAY[v_n])) cu
                    ON cu.product_id = l.p
                 ORDER BY l.i);
        END IF;
        v_verdict := drop_verdict_v1(v_now, p_products[v_lo:p_ends[c]], p_qty[v_lo:p_ends[c]],
                                     c_left, c_limit, c_starts, c_ends, c_already);
        IF v_verdict IS NULL THEN
            FOR i IN v_lo .. p_ends[c] LOOP
                v_at := array_position(v_known, p_products[i]);
                v_stock[v_at] := v_stock[v_at] - p_qty[i];
            END LOOP;
        END IF;
        RETURN QUERY SELECT c, v_verdict, NULL::text, NULL::integer, NULL::integer;
        v_lo := p_ends[c] + 1;
    END LOOP;
END
$$;

-- Every order batch, of one product or several (each once, in byte order; product j's
-- requests are p_*[p_ends[j-1]+1 .. p_ends[j]], in arrival order). One statement, one
-- transaction, one commit:
--
--  1. Lock every product row in byte order (the lock order every writer shares).
--  2. Seat each product's requests. A product without a limit whose whole batch the rules let
--     through (drop_verdict_v1 on the batch's units together) is seated whole: every request a
--     confirmed order, nothing looked up (a key held already or claimed concurrently is
--     skipped by the INSERT below, and takes no units). Any other product is seated request
--     by request in arrival order, each judged by drop_verdict_v1 against the stock left and
--     its user's units (this batch's earlier seats included); a key held already, or repeated
--     earlier in the statement, takes no seat. Before the sale starts nothing of the product
--     is written and its rows say `starts_in_ms`.
--  3. Claim every key of the statement in ONE `INSERT … ON CONFLICT DO NOTHING`, in one global
--     (user, key) byte order: the order every batch, cart and refusal claim shares, so two
--     claimers never wait on each other's keys in a circle.
--  4. A judged product whose seated key was claimed concurrently (its row was not inserted)
--     has units its seats did not take: every refused request of this batch for it is judged
--     again, in arrival order, against the stock then left and its user's count now; one that
--     fits is confirmed, any other keeps a refusal that states the count it was judged on.
--  5. Take each product's units with ONE guarded `UPDATE … WHERE available_quantity >= total`
--     (a guard that changes no row raises, and nothing commits).
--  6. Answer, per request, what its key holds now: when every request wrote the row it offered
--     (the common case), from what the INSERT returned; otherwise by reading every key back.
--
-- A missing product returns no rows. The plans cannot scan `orders` or `products`, with
-- statistics or none (migration 20261202000002).
CREATE FUNCTION take_order_batches_v4(
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
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
-- Its statements' plans are pinned by the settings above; a custom plan per call (which
-- `generate_series(1, n)`'s estimate would otherwise bring) is only planning under the row lock.
SET plan_cache_mode = force_generic_plan
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
           array_agg((SELECT sum(q) FROM unnest(p_qty[v_lo[b.j]:p_ends[b.j]]) AS q) ORDER BY b.j)
      INTO v_found, v_stock, v_price, v_limit, v_starts, v_ends, v_wanted
      FROM generate_series(1, cardinality(p_products)) AS b(j)
      LEFT JOIN (SELECT x.j, p.product_id, p.available_quantity, p.price_cents,
                        p.max_per_customer, p.sale_starts_at, p.sale_ends_at
                   FROM unnest(p_products) WITH ORDINALITY AS x(product, j)
                   JOIN products p ON p.product_id = x.product
                  ORDER BY p.product_id COLLATE "C"
                    FOR NO KEY UPDATE OF p) AS l ON l.j = b.j;
    IF NOT (true = ANY (v_found)) THEN
        RETURN;
    END IF;
    v_now := clock_timestamp();
    v_wait := (extract(epoch FROM v_now - t0) * 1e6)::bigint;

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
        v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]], ARRAY[v_wanted[j]::integer],
                                     ARRAY[v_stock[j]], ARRAY[NULL::integer], ARRAY[v_starts[j]],
                                     ARRAY[v_ends[j]], ARRAY[NULL::bigint]);
        IF v_verdict->>'code' = 'SALE_NOT_STARTED' THEN
            -- Nothing of this product is written: every key keeps what it held.
            v_starts_in[j] := (v_verdict->>'retry_after_ms')::bigint;
            CONTINUE;
        END IF;
        IF v_limit[j] IS NULL AND v_verdict IS NULL THEN
            v_whole[j] := true;
            v_seated[j] := v_wanted[j];
            v_left[j] := v_stock[j] - v_wanted[j];
            v_offered := v_offered + p_ends[j] - v_lo[j] + 1;
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
            v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]], ARRAY[r.qty],
                                         ARRAY[v_left[j]], ARRAY[v_limit[j]], ARRAY[v_starts[j]],
                                         ARRAY[v_ends[j]],
                                         ARRAY[(v_already->>r.usr)::bigint]);
            v_offered := v_offered + 1;
            IF v_verdict IS NULL THEN
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

    -- 3. Every key of the statement claimed in one (user, key) byte order.
    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint, refusal)
        SELECT u.id, p_products[u.j], u.usr, u.qty,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j] ELSE 0 END,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j]::bigint * u.qty ELSE 0 END,
               u.st, u.key, u.fp, u.why
          -- The requests' arrays read once each (unnest), not by subscript per row: an
          -- element of a text array is found by walking the elements before it.
          FROM (SELECT x.*, CASE WHEN v_whole[x.j] THEN 'confirmed' ELSE x.state END AS st
                  FROM unnest(p_ids, p_users, p_keys, p_qty, p_fps, v_of, v_state, v_why)
                       WITH ORDINALITY AS x(id, usr, key, qty, fp, j, state, why, i)) AS u
         WHERE u.st IS NOT NULL
         -- A key repeated in the statement: its first request (by product, then arrival) is
         -- the row; the others' conflict with it.
         ORDER BY u.usr COLLATE "C", u.key COLLATE "C", u.i
        ON CONFLICT ON CONSTRAINT orders_user_idempotency_key DO NOTHING
        RETURNING orders.order_id AS id, orders.product_id AS product, orders.quantity AS q,
                  orders.status AS s, orders.created_at AS at
    )
    , t AS (
        SELECT ins.product, coalesce(sum(ins.q) FILTER (WHERE ins.s = 'confirmed'), 0) AS q
          FROM ins GROUP BY ins.product
    )
    SELECT (SELECT count(*) FROM ins), (SELECT array_agg(ins.at ORDER BY ins.id) FROM ins),
           array_agg(t.product ORDER BY t.product COLLATE "C"),
           array_agg(t.q ORDER BY t.product COLLATE "C")
      INTO v_wrote, v_at, v_took_of, v_took_q
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

    -- 4. A judged product whose seat's key was claimed concurrently: its units go to this
    -- batch's refused requests, each judged again.
    FOR j IN 1 .. cardinality(p_products) LOOP
        CONTINUE WHEN NOT v_found[j] OR v_whole[j] OR v_took[j] >= v_seated[j];
        v_reseated := true;
        v_left[j] := v_stock[j] - v_took[j];
        FOR i IN v_lo[j] .. p_ends[j] LOOP
            CONTINUE WHEN v_state[i] IS DISTINCT FROM 'refused';
            IF v_limit[j] IS NOT NULL THEN
                SELECT c.units INTO v_units
                  FROM customer_units_v2(ARRAY[p_products[j]], ARRAY[p_users[i]]) c;
            END IF;
            v_verdict := drop_verdict_v1(v_now, ARRAY[p_products[j]], ARRAY[p_qty[i]],
                                         ARRAY[v_left[j]], ARRAY[v_limit[j]], ARRAY[v_starts[j]],
                                         ARRAY[v_ends[j]], ARRAY[v_units]);
            IF v_verdict IS NULL THEN
                UPDATE orders o
                   SET status = 'confirmed', unit_price_cents = v_price[j],
                       total_cents = v_price[j]::bigint * o.quantity, refusal = NULL
                 WHERE o.order_id = p_ids[i] AND o.status = 'refused';
                -- No row: this refusal's key was claimed concurrently too.
                CONTINUE WHEN NOT FOUND;
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

    -- 5. Each product's units, with one guarded UPDATE.
    WITH t AS (
        SELECT p_products[b.j] AS product, v_took[b.j]::integer AS total
          FROM generate_series(1, cardinality(p_products)) AS b(j)
         WHERE v_took[b.j] > 0
    ), upd AS (
        UPDATE products p
           SET available_quantity = p.available_quantity - t.total,
               updated_at = clock_timestamp()
          FROM t
         WHERE p.product_id = t.product AND p.available_quantity >= t.total
        RETURNING p.product_id
    )
    SELECT (SELECT count(*) FROM t), (SELECT count(*) FROM upd) INTO v_need, v_changed;
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
                   CASE WHEN x.st = 'confirmed' THEN v_price[x.j] ELSE 0 END
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
                   o.cancelled_at, o.unit_price_cents
              FROM unnest(p_users, p_keys, v_of) WITH ORDINALITY AS x(usr, key, j, i)
              LEFT JOIN orders o ON o.user_id = x.usr AND o.idempotency_key = x.key
             WHERE v_found[x.j]
             ORDER BY x.i;
    END IF;
END
$$;

-- Stock in several places (the contract's "Locations, transfers and the stock ledger").
--
-- A location holds a count of each product: `stock_levels`, one row per (product, location),
-- each with its own CHECK (… >= 0). `products.available_quantity` stays, as the sum of the
-- product's levels at ACTIVE locations: the figure every reader (the stock gate, availability,
-- the product page) already reads, and the guard every take already passes. Both move
-- together, in the transaction that takes or gives back, under the product's row lock:
--
--  * every write of a level locks its product's row first (byte order, the one lock order);
--  * a writer reads a location's `active` flag only AFTER it holds the product's row lock, in
--    a later statement (a new snapshot), so it sees any (de)activation that committed while
--    it waited; a level row is created (with 0) in a statement of its own before its count
--    changes, so its foreign-key check waits for a (de)activation in flight;
--  * a (de)activation locks the location `FOR UPDATE` (which waits for those foreign-key
--    checks and blocks new ones), then every product with a level there, then moves each
--    product's sum by that level (src/checkout/stock.rs, `set_active`).
--
-- Where every unit of an order, a cart or a hold came from is stated on its own row
-- (`allocations`, the answer's shape), so a give-back returns each unit to its own location
-- and the order path writes no extra row.
--
-- Live after this migration (docs/design/orders.md): take_order_batches_v5, lines_verdicts_v2 and their helpers,
-- allocate_v1, drop_verdict_v1, customer_units_v2. take_order_batches_v4 and lines_verdicts_v1
-- stay for binaries that still call them (they know no location: a product kept at more than
-- one location must not be sold by them, and they refuse to: see their guard below).

CREATE TABLE locations (
    location_id text        PRIMARY KEY CHECK (location_id ~ '^[A-Za-z0-9_.-]{1,64}$'),
    name        text        NOT NULL CHECK (length(name) BETWEEN 1 AND 200),
    rank        integer     NOT NULL DEFAULT 100 CHECK (rank BETWEEN 0 AND 10000),
    active      boolean     NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO locations (location_id, name) VALUES ('default', 'Default');

CREATE TABLE stock_levels (
    product_id         text        NOT NULL REFERENCES products (product_id),
    location_id        text        NOT NULL REFERENCES locations (location_id),
    available_quantity integer     NOT NULL CHECK (available_quantity >= 0),
    updated_at         timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (product_id, location_id)
);
CREATE INDEX stock_levels_location ON stock_levels (location_id);

-- Existing stock moves to `default`: the product's count unchanged, nothing sold or held lost.
INSERT INTO stock_levels (product_id, location_id, available_quantity)
SELECT product_id, 'default', available_quantity FROM products;

-- Allocations: `[{"product_id","location_id","quantity"}]`, every unit of a confirmed or
-- cancelled order and of every hold that took units; `[]` for a refusal.
ALTER TABLE orders ADD COLUMN allocations jsonb NOT NULL DEFAULT '[]';
ALTER TABLE holds ADD COLUMN allocations jsonb NOT NULL DEFAULT '[]';
UPDATE orders o
   SET allocations = jsonb_build_array(jsonb_build_object(
           'product_id', o.product_id, 'location_id', 'default', 'quantity', o.quantity))
 WHERE o.product_id IS NOT NULL AND o.status <> 'refused';
UPDATE orders o
   SET allocations = (SELECT jsonb_agg(jsonb_build_object('product_id', l.product_id,
                                                          'location_id', 'default',
                                                          'quantity', l.quantity)
                                       ORDER BY l.product_id COLLATE "C")
                        FROM order_lines l WHERE l.order_id = o.order_id)
 WHERE o.product_id IS NULL AND o.status <> 'refused';
UPDATE holds h
   SET allocations = (SELECT jsonb_agg(jsonb_build_object('product_id', l.product_id,
                                                          'location_id', 'default',
                                                          'quantity', l.quantity)
                                       ORDER BY l.product_id COLLATE "C")
                        FROM hold_lines l WHERE l.hold_id = h.hold_id)
 WHERE h.status <> 'refused';
UPDATE orders SET allocations = '[]' WHERE allocations IS NULL;
UPDATE holds SET allocations = '[]' WHERE allocations IS NULL;

-- Transfers: units leave `from_location` at creation, and join `to_location` once, when
-- received (at once, or by `POST /v1/transfers/{id}/receive`). In transit they are in no
-- location.
CREATE TABLE transfers (
    transfer_id         uuid        PRIMARY KEY,
    product_id          text        NOT NULL REFERENCES products (product_id),
    from_location       text        NOT NULL REFERENCES locations (location_id),
    to_location         text        NOT NULL REFERENCES locations (location_id),
    quantity            integer     NOT NULL CHECK (quantity BETWEEN 1 AND 1000000000),
    status              text        NOT NULL CHECK (status IN ('in_transit', 'received')),
    idempotency_key     text        NOT NULL UNIQUE,
    request_fingerprint text        NOT NULL,
    created_at          timestamptz NOT NULL DEFAULT clock_timestamp(),
    received_at         timestamptz,
    CHECK (from_location <> to_location),
    CHECK ((status = 'received') = (received_at IS NOT NULL))
);
CREATE INDEX transfers_product ON transfers (product_id);

-- Writers that know no location (a binary before this migration, still serving during a
-- rolling deploy; psql) keep working for a product kept only at `default`: its level moves
-- with the product's count, and a new product gets its `default` level. A product kept
-- anywhere else is refused to them (raised, nothing written): they cannot say where units
-- went. This binary's connections set `stockgate.levels` (src/routing/pools.rs), write the
-- levels themselves, and never fire these triggers.
CREATE FUNCTION stock_levels_follow_product() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO stock_levels (product_id, location_id, available_quantity)
        VALUES (NEW.product_id, 'default', NEW.available_quantity);
        RETURN NULL;
    END IF;
    IF NEW.available_quantity <> OLD.available_quantity THEN
        IF EXISTS (SELECT FROM stock_levels s
                    WHERE s.product_id = NEW.product_id AND s.location_id <> 'default') THEN
            RAISE EXCEPTION 'product % is kept at several locations: this writer cannot say where its units go',
                NEW.product_id USING ERRCODE = 'XX000';
        END IF;
        UPDATE stock_levels s
           SET available_quantity = s.available_quantity
                                    + (NEW.available_quantity - OLD.available_quantity),
               updated_at = clock_timestamp()
         WHERE s.product_id = NEW.product_id AND s.location_id = 'default';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER stock_levels_follow_product_update BEFORE UPDATE OF available_quantity ON products
    FOR EACH ROW WHEN (current_setting('stockgate.levels', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION stock_levels_follow_product();
CREATE TRIGGER stock_levels_follow_product_insert AFTER INSERT ON products
    FOR EACH ROW WHEN (current_setting('stockgate.levels', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION stock_levels_follow_product();

-- Allocation (the contract's rule), for one request whose lines (each product once) may be
-- taken: (1) the first of `p_locs` that can serve every line serves all of it; (2) otherwise
-- each line takes what it can from each of `p_locs` in turn until it is served. `p_locs` are
-- the locations the request may take from, in its order of choice; the levels are what is
-- left at each active (product, location) (`p_lv_*`, one entry each; a location without an
-- entry serves nothing). Returns the allocations (the answer's shape) and the levels after
-- them, or NULL allocations (levels unchanged) when the locations together cannot serve
-- some line. Pure: every take path calls it under its product rows' locks.
CREATE FUNCTION allocate_v1(
    p_products text[],
    p_qty      integer[],
    p_locs     text[],
    p_lv_product  text[],
    p_lv_location text[],
    p_left     integer[],
    OUT allocations jsonb,
    OUT left_after  integer[]
)
LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE
    v_at   integer[];
    v_loc  text;
    v_all  boolean;
    v_need integer;
    v_take integer;
    v_k    integer;
BEGIN
    left_after := p_left;
    allocations := '[]';
    -- 1. One location for the whole request.
    FOREACH v_loc IN ARRAY p_locs LOOP
        v_all := true;
        v_at := '{}';
        FOR i IN 1 .. cardinality(p_products) LOOP
            v_k := NULL;
            FOR k IN 1 .. coalesce(cardinality(p_lv_product), 0) LOOP
                IF p_lv_location[k] = v_loc AND p_lv_product[k] = p_products[i] THEN
                    v_k := k;
                    EXIT;
                END IF;
            END LOOP;
            IF v_k IS NULL OR left_after[v_k] < p_qty[i] THEN
                v_all := false;
                EXIT;
            END IF;
            v_at := v_at || v_k;
        END LOOP;
        IF v_all THEN
            FOR i IN 1 .. cardinality(p_products) LOOP
                left_after[v_at[i]] := left_after[v_at[i]] - p_qty[i];
                allocations := allocations || jsonb_build_object(
                    'product_id', p_products[i], 'location_id', v_loc, 'quantity', p_qty[i]);
            END LOOP;
            RETURN;
        END IF;
    END LOOP;
    -- 2. Each line from each location in turn.
    FOR i IN 1 .. cardinality(p_products) LOOP
        v_need := p_qty[i];
        FOREACH v_loc IN ARRAY p_locs LOOP
            EXIT WHEN v_need = 0;
            FOR k IN 1 .. coalesce(cardinality(p_lv_product), 0) LOOP
                CONTINUE WHEN p_lv_location[k] <> v_loc OR p_lv_product[k] <> p_products[i]
                              OR left_after[k] = 0;
                v_take := least(v_need, left_after[k]);
                left_after[k] := left_after[k] - v_take;
                v_need := v_need - v_take;
                allocations := allocations || jsonb_build_object(
                    'product_id', p_products[i], 'location_id', v_loc, 'quantity', v_take);
                EXIT;
            END LOOP;
        END LOOP;
        IF v_need > 0 THEN
            allocations := NULL;
            left_after := p_left;
            RETURN;
        END IF;
    END LOOP;
END
$$;

-- The active levels of the products of a locked batch, cart or hold, read AFTER their rows'
-- locks (a new snapshot: a (de)activation that committed while the caller waited is seen), in
-- the order a request that names no location takes from: (rank, location_id), then product.
CREATE FUNCTION active_levels_v1(p_products text[])
RETURNS TABLE (product_id text, location_id text, available_quantity integer)
LANGUAGE sql STABLE
SET enable_seqscan = off
AS $$
    SELECT s.product_id, s.location_id, s.available_quantity
      FROM stock_levels s JOIN locations l ON l.location_id = s.location_id
     WHERE s.product_id = ANY (p_products) AND l.active
     ORDER BY l.rank, s.location_id COLLATE "C", s.product_id COLLATE "C"
$$;

-- The locations a request may take from, in its order of choice: request p_i's own list
-- (p_locs[p_loc_ends[p_i-1]+1 .. p_loc_ends[p_i]]), or, when it names none, `p_ranked`
-- (every active location, in rank order).
CREATE FUNCTION request_locations_v1(p_locs text[], p_loc_ends integer[], p_i integer,
                                     p_ranked text[])
RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN coalesce(cardinality(p_locs), 0) = 0
                  OR p_loc_ends[p_i] = coalesce(p_loc_ends[p_i - 1], 0) THEN p_ranked
                ELSE p_locs[coalesce(p_loc_ends[p_i - 1], 0) + 1 : p_loc_ends[p_i]] END
$$;

-- What `p_product` has left at `p_locs` (the active levels `p_lv_*`): what a request that
-- names its locations may take.
CREATE FUNCTION locations_left_v1(p_product text, p_locs text[], p_lv_product text[],
                                  p_lv_location text[], p_left integer[])
RETURNS integer
LANGUAGE sql IMMUTABLE
AS $$
    SELECT coalesce(sum(p_left[k]), 0)::integer
      FROM generate_subscripts(p_left, 1) AS k
     WHERE p_lv_product[k] = p_product AND p_lv_location[k] = ANY (p_locs)
$$;

-- The locations of the levels `p_lv_location` (in active_levels_v1's order), each once, in
-- that order: where a request that names no location takes from.
CREATE FUNCTION ranked_locations_v1(p_lv_location text[])
RETURNS text[]
LANGUAGE sql IMMUTABLE
AS $$
    SELECT coalesce(array_agg(x.l ORDER BY x.first), '{}')
      FROM (SELECT u.l, min(u.k) AS first FROM unnest(p_lv_location) WITH ORDINALITY AS u(l, k)
             GROUP BY u.l) x
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
CREATE FUNCTION lines_verdicts_v2(
    p_users    text[],
    p_ends     integer[],
    p_products text[],
    p_qty      integer[],
    p_counted  boolean,
    p_batch    boolean,
    p_locs     text[],
    p_loc_ends integer[]
) RETURNS TABLE (cart integer, verdict jsonb, product_id text, price_cents integer,
                 max_per_customer integer, allocations jsonb)
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
    v_lv_p    text[];
    v_lv_l    text[];
    v_lv_q    integer[];
    v_ranked  text[];
    v_locs    text[];
    v_named   boolean;
    v_a       record;
    v_alloc   jsonb;
BEGIN
    -- The rows, locked in the lock order every writer shares; each is a row of the answer
    -- (`cart` NULL), for the caller's prices and limits.
    SELECT array_agg(p.product_id), array_agg(p.available_quantity), array_agg(p.max_per_customer),
           array_agg(p.sale_starts_at), array_agg(p.sale_ends_at)
      INTO v_known, v_stock, v_limit, v_starts, v_ends
      FROM (SELECT x.* FROM products x WHERE x.product_id = ANY (p_products)
             ORDER BY x.product_id COLLATE "C" FOR NO KEY UPDATE) p;
    RETURN QUERY
        SELECT NULL::integer, NULL::jsonb, p.product_id, p.price_cents, p.max_per_customer,
               NULL::jsonb
          FROM products p WHERE p.product_id = ANY (v_known);
    SELECT array_agg(a.product_id), array_agg(a.location_id), array_agg(a.available_quantity)
      INTO v_lv_p, v_lv_l, v_lv_q
      FROM active_levels_v1(v_known) a;
    v_ranked := ranked_locations_v1(v_lv_l);
    FOR c IN 1 .. cardinality(p_ends) LOOP
        v_n := p_ends[c] - v_lo + 1;
        c_left := '{}'; c_limit := '{}'; c_starts := '{}'; c_ends := '{}';
        v_limited := false;
        v_missing := false;
        v_locs := request_locations_v1(p_locs, p_loc_ends, c, v_ranked);
        v_named := v_locs IS DISTINCT FROM v_ranked;
        FOR i IN v_lo .. p_ends[c] LOOP
            v_at := array_position(v_known, p_products[i]);
            v_missing := v_missing OR v_at IS NULL;
            -- What the line may take: its cart's own locations' levels, or the product's count.
            c_left := c_left || CASE WHEN NOT v_named THEN v_stock[v_at]
                                     ELSE locations_left_v1(p_products[i], v_locs, v_lv_p,
                                                            v_lv_l, v_lv_q) END;
            c_limit := c_limit || v_limit[v_at];
            c_starts := c_starts || v_starts[v_at];
            c_ends := c_ends || v_ends[v_at];
            v_limited := v_limited OR v_limit[v_at] IS NOT NULL;
        END LOOP;
        IF v_missing OR (p_batch AND v_limited) THEN
            -- Not judged, and takes nothing from the carts after it: the caller answers it
            -- (an unknown product) or places it alone (a limit, in a batch).
            RETURN QUERY SELECT c, NULL::jsonb, NULL::text, NULL::integer, NULL::integer,
                                NULL::jsonb;
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
        v_alloc := NULL;
        IF v_verdict IS NULL THEN
            SELECT * INTO v_a FROM allocate_v1(p_products[v_lo:p_ends[c]], p_qty[v_lo:p_ends[c]],
                                               v_locs, v_lv_p, v_lv_l, v_lv_q);
            IF v_a.allocations IS NULL THEN
                RAISE EXCEPTION 'the levels of a cart''s products do not add up to their counts'
                    USING ERRCODE = 'XX000';
            END IF;
            v_lv_q := v_a.left_after;
            v_alloc := v_a.allocations;
            FOR i IN v_lo .. p_ends[c] LOOP
                v_at := array_position(v_known, p_products[i]);
                v_stock[v_at] := v_stock[v_at] - p_qty[i];
            END LOOP;
        END IF;
        RETURN QUERY SELECT c, v_verdict, NULL::text, NULL::integer, NULL::integer,
                            v_alloc;
        v_lo := p_ends[c] + 1;
    END LOOP;
END
$$;

-- Every order batch, of one product or several (each once, in byte order; product j's
-- requests are p_*[p_ends[j-1]+1 .. p_ends[j]], in arrival order; request i's locations, when
-- it names any, p_locs[p_loc_ends[i-1]+1 .. p_loc_ends[i]]). Version 4 with allocation. One
-- statement, one transaction, one commit:
--
--  1. Lock every product row in byte order (the lock order every writer shares); then, in a
--     statement of its own, read their active levels (active_levels_v1).
--  2. Seat each product's requests. A product without a limit, none of whose requests names
--     locations, whose whole batch the rules let through (drop_verdict_v1 on the batch's units
--     together) is seated whole: every request a confirmed order, nothing looked up. Its
--     first location serves the whole batch when it can (every request allocated there, set
--     based); otherwise each request is allocated in arrival order (allocate_v1). Any other
--     product is seated request by request in arrival order, each judged by drop_verdict_v1
--     against what its locations (or the product's count) have left and its user's units,
--     and allocated when it fits. A key held already, or repeated earlier in the statement,
--     takes no seat. Before the sale starts nothing of the product is written.
--  3. Claim every key of the statement in ONE `INSERT … ON CONFLICT DO NOTHING`, in one global
--     (user, key) byte order, each row with its allocations.
--  4. A judged product whose seated key was claimed concurrently: every refused request of
--     this batch for it is judged again and allocated against what the rows written left.
--  5. Take each level's units with ONE guarded `UPDATE stock_levels … WHERE available_quantity
--     >= q` and each product's with ONE guarded `UPDATE products …` (a guard that changes no
--     row raises, and nothing commits). The levels' takes are summed from the allocations
--     the rows were written with, so what a row states is what was taken.
--  6. Answer, per request, what its key holds now, allocations included.
--
-- A missing product returns no rows. The plans cannot scan `orders`, `products` or
-- `stock_levels`, with statistics or none (migration 20261202000002).
CREATE FUNCTION take_order_batches_v5(
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
    -- location takes from (active_levels_v1), and those locations once each.
    v_lv_p    text[];
    v_lv_l    text[];
    v_lv_q    integer[];
    v_lv_q0   integer[];
    v_ranked  text[];
    v_named   boolean[];
    v_locs    text[];
    v_left_i  integer;
    v_alloc   jsonb[];
    v_fast    text[];
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
    SELECT array_agg(a.product_id), array_agg(a.location_id), array_agg(a.available_quantity)
      INTO v_lv_p, v_lv_l, v_lv_q
      FROM active_levels_v1(p_products) a;
    v_lv_q0 := v_lv_q;
    v_ranked := ranked_locations_v1(v_lv_l);
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
        IF v_limit[j] IS NULL AND v_verdict IS NULL AND NOT v_named[j] THEN
            v_whole[j] := true;
            v_seated[j] := v_wanted[j];
            v_left[j] := v_stock[j] - v_wanted[j];
            v_offered := v_offered + p_ends[j] - v_lo[j] + 1;
            -- Where each request's units come from. The product's first location with units
            -- left serves the whole batch when it can (`v_fast`; every request there, nothing
            -- looked up: the locations before it serve nothing, the rule picks it for each);
            -- otherwise each request in arrival order (a repeated key's allocation is never
            -- written: its units stay where they are, and only later requests of this batch
            -- may be sent further down the order for them).
            v_k := NULL;
            FOR k IN 1 .. coalesce(cardinality(v_lv_p), 0) LOOP
                IF v_lv_p[k] = p_products[j] AND v_lv_q[k] > 0 THEN
                    v_k := k;
                    EXIT;
                END IF;
            END LOOP;
            IF v_k IS NOT NULL AND v_lv_q[v_k] >= v_wanted[j] THEN
                v_fast[j] := v_lv_l[v_k];
                v_lv_q[v_k] := v_lv_q[v_k] - v_wanted[j];
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

    -- 3. Every key of the statement claimed in one (user, key) byte order.
    WITH ins AS (
        INSERT INTO orders (order_id, product_id, user_id, quantity, unit_price_cents,
                            total_cents, status, idempotency_key, request_fingerprint, refusal,
                            allocations)
        SELECT u.id, p_products[u.j], u.usr, u.qty,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j] ELSE 0 END,
               CASE WHEN u.st = 'confirmed' THEN v_price[u.j]::bigint * u.qty ELSE 0 END,
               u.st, u.key, u.fp, u.why,
               CASE WHEN v_fast[u.j] IS NOT NULL
                    THEN jsonb_build_array(jsonb_build_object('product_id', p_products[u.j],
                                                              'location_id', v_fast[u.j],
                                                              'quantity', u.qty))
                    ELSE coalesce(u.alloc, '[]') END
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
    ), lv AS (
        SELECT a.product_id, a.location_id, sum(a.quantity) AS q
          FROM ins CROSS JOIN LATERAL jsonb_to_recordset(ins.alloc)
                                AS a(product_id text, location_id text, quantity integer)
         GROUP BY a.product_id, a.location_id
    )
    , t AS (
        SELECT ins.product, coalesce(sum(ins.q) FILTER (WHERE ins.s = 'confirmed'), 0) AS q
          FROM ins GROUP BY ins.product
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
    WITH t AS (
        SELECT x.p, x.l, x.q::integer AS q
          FROM unnest(v_tk_p, v_tk_l, v_tk_q) AS x(p, l, q) WHERE x.q > 0
    ), upd AS (
        UPDATE stock_levels s
           SET available_quantity = s.available_quantity - t.q, updated_at = clock_timestamp()
          FROM t
         WHERE s.product_id = t.p AND s.location_id = t.l AND s.available_quantity >= t.q
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM t), (SELECT count(*) FROM upd) INTO v_need, v_changed;
    IF v_changed <> v_need THEN
        RAISE EXCEPTION 'a guarded level update changed no row; the batch was rolled back'
            USING ERRCODE = 'XX000';
    END IF;
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

COMMENT ON FUNCTION take_order_batches_v4(text[], integer[], uuid[], text[], text[], integer[], text[])
    IS 'superseded by take_order_batches_v5';
COMMENT ON FUNCTION lines_verdicts_v1(text[], integer[], text[], integer[], boolean, boolean)
    IS 'superseded by lines_verdicts_v2';

-- Version 3, which no binary has called since version 4, and what only it called.
DROP FUNCTION take_order_batch_v3(text, uuid[], text[], text[], integer[], text[]);
DROP FUNCTION take_order_batches_v3(text[], integer[], uuid[], text[], text[], integer[], text[]);
DROP FUNCTION take_order_batch_v2(text, uuid[], text[], text[], integer[], text[]);
DROP FUNCTION customer_units(text[], text[]);

-- Events carry allocations: order.confirmed, order.cancelled and every hold.* event.
CREATE OR REPLACE FUNCTION order_event_data(o orders) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT jsonb_strip_nulls(jsonb_build_object(
               'order_id', o.order_id, 'product_id', o.product_id, 'quantity', o.quantity,
               'user_id', o.user_id, 'status', o.status, 'total_cents', o.total_cents,
               'created_at', o.created_at, 'cancelled_at', o.cancelled_at))
           || jsonb_build_object('lines', CASE
               WHEN o.product_id IS NOT NULL THEN jsonb_build_array(jsonb_build_object(
                   'product_id', o.product_id, 'quantity', o.quantity,
                   'unit_price_cents', o.unit_price_cents))
               ELSE (SELECT coalesce(jsonb_agg(jsonb_build_object(
                                'product_id', l.product_id, 'quantity', l.quantity,
                                'unit_price_cents', l.unit_price_cents)
                            ORDER BY l.product_id COLLATE "C"), '[]'::jsonb)
                       FROM order_lines l WHERE l.order_id = o.order_id)
               END, 'allocations', o.allocations)
$$;

CREATE OR REPLACE FUNCTION events_orders_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- The JSON is written as text (json_build_object's per-argument type lookups cost three
    -- times as much); every text value goes through to_json, which escapes it.
    INSERT INTO events (types, items, k)
    SELECT ARRAY['order.confirmed'],
           ('[' || string_agg(
               '{"type":"order.confirmed","data":{"order_id":"' || o.order_id
               || '","product_id":' || to_json(o.product_id) || ',"quantity":' || o.quantity
               || ',"user_id":' || to_json(o.user_id) || ',"status":' || to_json(o.status)
               || ',"total_cents":' || o.total_cents || ',"created_at":' || to_json(o.created_at)
               || ',"lines":[{"product_id":' || to_json(o.product_id) || ',"quantity":' || o.quantity
               || ',"unit_price_cents":' || o.unit_price_cents || '}],"allocations":'
               || o.allocations::text || '}}',
               ',' ORDER BY o.k) || ']')::json,
           count(*)
      FROM (SELECT r.*, row_number() OVER (ORDER BY r.order_id) AS k
              FROM new_rows r WHERE r.status = 'confirmed' AND r.product_id IS NOT NULL) o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION events_orders_updated() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT array_agg(DISTINCT e.type), json_agg(json_build_object('type', e.type, 'data', e.data)
                                                ORDER BY e.k), count(*)
      FROM (SELECT row_number() OVER (ORDER BY n.order_id) AS k,
                   CASE WHEN n.status = 'confirmed' THEN 'order.confirmed' ELSE 'order.cancelled' END AS type,
                   CASE WHEN n.status = 'confirmed' THEN order_event_data(n)
                        ELSE jsonb_build_object('order_id', n.order_id,
                                                'lines', order_event_data(n)->'lines',
                                                'allocations', n.allocations) END AS data
              FROM new_rows n JOIN old_rows o USING (order_id)
             WHERE (o.status = 'refused' AND n.status = 'confirmed')
                OR (o.status = 'confirmed' AND n.status = 'cancelled')) e
     GROUP BY (e.k - 1) / 1000 ORDER BY (e.k - 1) / 1000;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION events_hold_created() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT ARRAY['hold.created'],
           json_build_array(json_build_object('type', 'hold.created', 'data', json_build_object(
               'hold_id', h.hold_id, 'user_id', h.user_id, 'expires_at', h.expires_at,
               'lines', hold_event_lines(h.hold_id), 'allocations', h.allocations))), 1
      FROM holds h
     WHERE h.hold_id = NEW.hold_id AND h.status = 'held';
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION events_holds_updated() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT array_agg(DISTINCT e.type), json_agg(json_build_object('type', e.type, 'data', e.data)
                                                ORDER BY e.k), count(*)
      FROM (SELECT row_number() OVER (ORDER BY n.hold_id) AS k, 'hold.' || n.status AS type,
                   CASE WHEN n.status = 'confirmed'
                        THEN jsonb_build_object('hold_id', n.hold_id, 'order_id', n.order_id,
                                                'allocations', n.allocations)
                        ELSE jsonb_build_object('hold_id', n.hold_id,
                                                'lines', hold_event_lines(n.hold_id),
                                                'allocations', n.allocations) END AS data
              FROM new_rows n JOIN old_rows o USING (hold_id)
             WHERE o.status = 'held' AND n.status IN ('confirmed', 'released', 'expired')) e
     GROUP BY (e.k - 1) / 1000 ORDER BY (e.k - 1) / 1000;
    RETURN NULL;
END $$;

-- A cart's lines announce it: its row by id alone, the status tested on the row (`LIMIT 1`
-- keeps the test out of the scan). With the status in the scan, a plan without statistics
-- walked the whole confirmed-orders index per cart once `orders` grew its allocations
-- (tests/api/plans.rs).
CREATE OR REPLACE FUNCTION events_order_lines_inserted() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT ARRAY['order.confirmed'],
           json_agg(json_build_object('type', 'order.confirmed', 'data', o.data) ORDER BY o.k),
           count(*)
      FROM (SELECT order_event_data(r) AS data, row_number() OVER (ORDER BY r.order_id) AS k
              FROM (SELECT DISTINCT l.order_id FROM new_rows l) ids
              CROSS JOIN LATERAL (SELECT * FROM orders r WHERE r.order_id = ids.order_id
                                   LIMIT 1) r
             WHERE r.status = 'confirmed') o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;

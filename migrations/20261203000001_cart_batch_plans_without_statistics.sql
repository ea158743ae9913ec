-- Carts are placed in batches (src/checkout/cart.rs): one transaction looks up the keys of
-- many carts at once, and one statement inserts their orders and lines. On a new deployment
-- two plans made while `orders` looked empty then scanned all of it for every later batch
-- (bench/carts.sh on a never-analyzed database: 615 sequential scans of `orders`, 2.0 M rows
-- read, in 5 s):
--   * the `order.confirmed` trigger on `order_lines`, whose PL/pgSQL plan is cached per
--     connection: with a cart batch's ~90 lines in its transition table it chose a hash join
--     over the whole of `orders`;
--   * the key lookup, a prepared statement whose generic plan is cached per connection.
-- The remedy is the batch functions' (migration 20261202000002): every lookup here is a key
-- to a unique index, so with the alternatives to index probes off for these statements alone,
-- those probes are the only plans left, whatever the statistics say or do not say yet. The
-- other statement-level event triggers that read a table by key get the same settings.
--
-- With the scan off, the trigger's join could still walk the whole primary-key index and
-- filter (a nested loop with `orders` outside), so it now probes `orders` once per order of
-- the transition table: a LATERAL subquery with LIMIT is never flattened into a join, and its
-- one plan is an index probe on the order's id.
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
              CROSS JOIN LATERAL (SELECT * FROM orders r
                                   WHERE r.order_id = ids.order_id AND r.status = 'confirmed'
                                   LIMIT 1) r) o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;
ALTER FUNCTION events_orders_updated()
    SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off;
ALTER FUNCTION events_holds_updated()
    SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off;

-- What each (user, key) pair holds: the one key lookup of orders, carts, holds and refusals
-- (src/checkout/idempotency.rs). A function so that the settings above apply to it; a SQL
-- function with settings is planned at each call, never cached.
CREATE FUNCTION keys_held(p_users text[], p_keys text[]) RETURNS SETOF orders
LANGUAGE sql STABLE
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
    SELECT o.* FROM orders o
     WHERE (o.user_id, o.idempotency_key) IN (SELECT * FROM unnest(p_users, p_keys))
$$;

-- A statement's order.confirmed events are stored as its orders' ids, and written out as JSON
-- when the feed is read (bench/results/sql-cost-2026-12-06.md: building the text of every
-- order's event, `allocations` included, parsing it back as `json` and compressing it was 18 %
-- of a hot product's batch statement and 11 % of a 1,000-product one).
--
-- What such an event says can be read from its order at any later time: the row an order is
-- inserted with, and a cart's lines, keep every field the event states (`order_id`,
-- `product_id`, `quantity`, `user_id`, `total_cents`, `created_at`, the lines' products,
-- quantities and prices, `allocations`). Nothing updates them afterwards: a cancel sets
-- `status` and `cancelled_at`, which the event does not take from the row (it says
-- "confirmed", with no `cancelled_at`); a refusal's re-seat updates only refused rows, which
-- announced nothing; only refused orders are ever deleted. A migration that changes a
-- confirmed order's stated fields must first write its events out
-- (`UPDATE event_rows SET items = event_items(event_rows), orders = NULL`).
--
-- The table becomes `event_rows`, which this binary reads through `event_items`; `events` is
-- a view of it with every row's `items` as JSON, so a binary from before this migration
-- (during a rolling deploy) reads the same feed through it, and its writes of `events` reach
-- `event_rows` through the view's INSTEAD OF trigger.

ALTER TABLE events RENAME TO event_rows;
ALTER TABLE event_rows
    ALTER COLUMN items DROP NOT NULL,
    -- The confirmed orders of one inserting statement, in `order_id` order (the order their
    -- events had in `items`).
    ADD COLUMN orders uuid[],
    ADD CONSTRAINT event_rows_items_or_orders
        CHECK ((items IS NULL) <> (orders IS NULL) AND cardinality(orders) = k);

-- The order.confirmed events of `p_orders`, as the triggers wrote them before this migration
-- (migration 20261205000002): a single-product order's by events_orders_inserted's text, a
-- cart's (or a confirmed hold's order's) by events_order_lines_inserted's order_event_data,
-- with the status it was confirmed with and no `cancelled_at`. An order that is not there is
-- an error, never a shorter array: a page's positions count the row's `k` events.
CREATE FUNCTION order_confirmed_items(p_orders uuid[]) RETURNS json
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    v_items text;
    v_found integer;
BEGIN
    SELECT '[' || string_agg(CASE
               WHEN o.product_id IS NOT NULL THEN
               '{"type":"order.confirmed","data":{"order_id":"' || o.order_id
               || '","product_id":' || to_json(o.product_id) || ',"quantity":' || o.quantity
               || ',"user_id":' || to_json(o.user_id) || ',"status":"confirmed"'
               || ',"total_cents":' || o.total_cents || ',"created_at":' || to_json(o.created_at)
               || ',"lines":[{"product_id":' || to_json(o.product_id) || ',"quantity":' || o.quantity
               || ',"unit_price_cents":' || o.unit_price_cents || '}],"allocations":'
               || o.allocations::text || '}}'
               ELSE json_build_object('type', 'order.confirmed', 'data',
                                      (order_event_data(o) || '{"status": "confirmed"}')
                                      - 'cancelled_at')::text END,
               ',' ORDER BY x.i) || ']',
           count(o.order_id)
      INTO v_items, v_found
      FROM unnest(p_orders) WITH ORDINALITY AS x(id, i)
      LEFT JOIN orders o ON o.order_id = x.id;
    IF v_found <> cardinality(p_orders) THEN
        RAISE EXCEPTION 'an order an event announced is gone (% of % found)', v_found,
                        cardinality(p_orders) USING ERRCODE = 'XX000';
    END IF;
    RETURN v_items::json;
END
$$;

-- A row's events as JSON, whichever way it was stored.
CREATE FUNCTION event_items(r event_rows) RETURNS json
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN r.orders IS NULL THEN r.items ELSE order_confirmed_items(r.orders) END
$$;

CREATE VIEW events AS
    SELECT r.xid, r.n, r.at, r.types, event_items(r) AS items, r.k FROM event_rows r;

CREATE FUNCTION events_insert_into_rows() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO event_rows (types, items, k, at)
    VALUES (NEW.types, NEW.items, NEW.k, coalesce(NEW.at, clock_timestamp()))
    RETURNING xid, n, at INTO NEW.xid, NEW.n, NEW.at;
    RETURN NEW;
END $$;
CREATE TRIGGER events_insert_into_rows INSTEAD OF INSERT ON events
    FOR EACH ROW EXECUTE FUNCTION events_insert_into_rows();

-- Inserted single-product orders, and carts (and confirmed holds' orders) by their lines:
-- the confirmed orders' ids, a thousand a row.
CREATE OR REPLACE FUNCTION events_orders_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO event_rows (types, orders, k)
    SELECT ARRAY['order.confirmed'], array_agg(o.order_id ORDER BY o.k), count(*)
      FROM (SELECT r.order_id, row_number() OVER (ORDER BY r.order_id) AS k
              FROM new_rows r WHERE r.status = 'confirmed' AND r.product_id IS NOT NULL) o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION events_order_lines_inserted() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off SET enable_hashjoin = off SET enable_mergejoin = off
AS $$
BEGIN
    INSERT INTO event_rows (types, orders, k)
    SELECT ARRAY['order.confirmed'], array_agg(o.order_id ORDER BY o.k), count(*)
      FROM (SELECT r.order_id, row_number() OVER (ORDER BY r.order_id) AS k
              FROM (SELECT DISTINCT l.order_id FROM new_rows l) ids
              CROSS JOIN LATERAL (SELECT * FROM orders r WHERE r.order_id = ids.order_id
                                   LIMIT 1) r
             WHERE r.status = 'confirmed') o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;

-- The other event triggers write the table, not the view (the same bodies otherwise).
DO $$
DECLARE
    f   text;
    def text;
BEGIN
    FOREACH f IN ARRAY ARRAY['events_orders_updated', 'events_hold_created',
                             'events_holds_updated'] LOOP
        def := pg_get_functiondef(f::regproc);
        IF position('INSERT INTO events (' IN def) = 0 THEN
            RAISE EXCEPTION '% does not insert into events', f;
        END IF;
        EXECUTE replace(def, 'INSERT INTO events (', 'INSERT INTO event_rows (');
    END LOOP;
END $$;

-- Purged events a webhook had not been sent (migration 20261204000010): a row of order ids
-- holds `k` events of its one type, counted by position, not written out.
CREATE OR REPLACE FUNCTION webhooks_note_purged_events() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_purged (webhook_id, xid, positions)
    SELECT w.webhook_id, g.xid, array_agg(g.n * 65536 + x.i ORDER BY x.i)
      FROM webhooks w
      JOIN gone g ON g.types && w.types
                 AND (g.xid, g.n * 65536 + g.k) > (w.delivered_xid, w.delivered_n)
     CROSS JOIN LATERAL (SELECT e.i, e.item->>'type' AS type
                           FROM json_array_elements(g.items) WITH ORDINALITY AS e(item, i)
                         UNION ALL
                         SELECT p.i, g.types[1] FROM generate_series(1, g.k) AS p(i)
                          WHERE g.orders IS NOT NULL) x
     WHERE w.deleted_at IS NULL
       AND (g.xid, g.n * 65536 + x.i) > (w.delivered_xid, w.delivered_n)
       AND x.type = ANY(w.types)
       AND NOT coalesce(pg_visible_in_snapshot(g.xid, w.created_snapshot), false)
     GROUP BY w.webhook_id, g.xid, g.n;
    RETURN NULL;
END $$;

-- The batch functions lock every product they insert orders for (FOR NO KEY UPDATE, which a
-- delete or a key change waits for) before inserting them: the per-statement existence check
-- is left to other writers.
DROP TRIGGER orders_products_exist ON orders;
CREATE TRIGGER orders_products_exist AFTER INSERT ON orders
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    WHEN (current_setting('stockgate.products_locked', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION order_products_exist();
ALTER FUNCTION take_order_batches_v6(text[], integer[], uuid[], text[], text[], integer[], text[], text[], integer[])
    SET stockgate.products_locked = 'on';
ALTER FUNCTION take_order_batches_v5(text[], integer[], uuid[], text[], text[], integer[], text[], text[], integer[])
    SET stockgate.products_locked = 'on';

-- The event feed (contract, "Events"): every committed change of an order, a hold or a
-- product's stock, written in the transaction of the change — by triggers, so every writer
-- (the batch functions, carts, holds, cancels, the sweeper) writes its events without an extra
-- round trip — and a rolled-back change leaves none.
--
-- A row holds the events of one writing statement (`items`, in order: [{"type", "data"}, …]),
-- a thousand at most (a statement that writes more writes several rows, in order), so a batch
-- of 200 orders writes one row, not 200: the feed costs the hot path one heap tuple and one
-- index entry per statement.
--
-- Order: (xid, n, i). `xid` is the writing transaction's id, `n` a sequence over rows, `i` the
-- event's place in its row; a cursor's position is n * 65536 + i. The feed serves only rows
-- whose xid is below the reading snapshot's xmin: every transaction with a smaller id has
-- ended, so no event can later appear before one already served. A transaction that commits
-- late is placed after what was served when it committed; a long transaction delays the feed
-- (it holds xmin back) and never reorders it.
CREATE TABLE events (
    xid    xid8        NOT NULL DEFAULT pg_current_xact_id(),
    n      bigint      GENERATED ALWAYS AS IDENTITY,
    at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- The kinds of event in `items` (a webhook's filter reads this, not the items).
    types  text[]      NOT NULL CHECK (types <@ ARRAY['order.confirmed', 'order.cancelled',
                                                      'hold.created', 'hold.confirmed',
                                                      'hold.released', 'hold.expired',
                                                      'stock.changed']),
    -- `json`, not `jsonb`: the text the writer built, stored as it is (building and converting
    -- jsonb per order cost more than the order's own insert); lz4: a batch's items compress to
    -- a fifth, and lz4 costs a fraction of pglz.
    items  json        COMPRESSION lz4 NOT NULL CHECK (json_typeof(items) = 'array'),
    -- How many events the row holds (its writer counts them): a page counts rows' events
    -- without opening them.
    k      integer     NOT NULL CHECK (k BETWEEN 1 AND 65535),
    PRIMARY KEY (xid, n)
) WITH (toast_tuple_target = 8160);
-- The retention purge finds the oldest rows; a BRIN index costs appends next to nothing.
CREATE INDEX events_at ON events USING brin (at);

-- The newest position the retention purge removed: a cursor before it may have missed
-- events (410 CURSOR_EXPIRED); one at or after it has not.
CREATE TABLE events_purged (
    one  boolean PRIMARY KEY DEFAULT true CHECK (one),
    xid  xid8    NOT NULL,
    pos  bigint  NOT NULL
);

-- An order as the API states it, with its lines (a single-line order's one line from its row).
CREATE FUNCTION order_event_data(o orders) RETURNS jsonb
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
               END)
$$;

-- A hold's lines.
CREATE FUNCTION hold_event_lines(p_hold uuid) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT coalesce(jsonb_agg(jsonb_build_object('product_id', l.product_id, 'quantity', l.quantity)
                              ORDER BY l.product_id COLLATE "C"), '[]'::jsonb)
      FROM hold_lines l WHERE l.hold_id = p_hold
$$;

-- Orders inserted confirmed: single-line ones here (a cart's lines come after its row, so a
-- cart is announced by the insert of its lines). order_event_data's single-line case is
-- written out: a function with a sub-select is never inlined, and calling it per row cost
-- more than the orders' own insert.
CREATE FUNCTION events_orders_inserted() RETURNS trigger
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
               || ',"unit_price_cents":' || o.unit_price_cents || '}]}}',
               ',' ORDER BY o.k) || ']')::json,
           count(*)
      FROM (SELECT r.*, row_number() OVER (ORDER BY r.order_id) AS k
              FROM new_rows r WHERE r.status = 'confirmed' AND r.product_id IS NOT NULL) o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;
CREATE TRIGGER events_orders_inserted AFTER INSERT ON orders
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_orders_inserted();

-- A cart's (or a confirmed hold's) lines: the order is announced with all of them.
CREATE FUNCTION events_order_lines_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT ARRAY['order.confirmed'],
           json_agg(json_build_object('type', 'order.confirmed', 'data', o.data) ORDER BY o.k),
           count(*)
      FROM (SELECT order_event_data(r) AS data, row_number() OVER (ORDER BY r.order_id) AS k
              FROM orders r
             WHERE r.order_id IN (SELECT DISTINCT l.order_id FROM new_rows l)
               AND r.status = 'confirmed') o
     GROUP BY (o.k - 1) / 1000 ORDER BY (o.k - 1) / 1000;
    RETURN NULL;
END $$;
CREATE TRIGGER events_order_lines_inserted AFTER INSERT ON order_lines
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_order_lines_inserted();

-- A refusal that became an order (the batch's second seating), and cancels.
CREATE FUNCTION events_orders_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT array_agg(DISTINCT e.type), json_agg(json_build_object('type', e.type, 'data', e.data)
                                                ORDER BY e.k), count(*)
      FROM (SELECT row_number() OVER (ORDER BY n.order_id) AS k,
                   CASE WHEN n.status = 'confirmed' THEN 'order.confirmed' ELSE 'order.cancelled' END AS type,
                   CASE WHEN n.status = 'confirmed' THEN order_event_data(n)
                        ELSE jsonb_build_object('order_id', n.order_id,
                                                'lines', order_event_data(n)->'lines') END AS data
              FROM new_rows n JOIN old_rows o USING (order_id)
             WHERE (o.status = 'refused' AND n.status = 'confirmed')
                OR (o.status = 'confirmed' AND n.status = 'cancelled')) e
     GROUP BY (e.k - 1) / 1000 ORDER BY (e.k - 1) / 1000;
    RETURN NULL;
END $$;
CREATE TRIGGER events_orders_updated AFTER UPDATE ON orders
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_orders_updated();

-- A hold is announced at commit, as it stands then: a hold claimed and then refused in the
-- same transaction was never a hold.
CREATE FUNCTION events_hold_created() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT ARRAY['hold.created'],
           json_build_array(json_build_object('type', 'hold.created', 'data', json_build_object(
               'hold_id', h.hold_id, 'user_id', h.user_id, 'expires_at', h.expires_at,
               'lines', hold_event_lines(h.hold_id)))), 1
      FROM holds h
     WHERE h.hold_id = NEW.hold_id AND h.status = 'held';
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER events_hold_created AFTER INSERT ON holds
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
    EXECUTE FUNCTION events_hold_created();

-- A hold's ending: confirmed (with its order), released or expired (with the lines that went
-- back).
CREATE FUNCTION events_holds_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (types, items, k)
    SELECT array_agg(DISTINCT e.type), json_agg(json_build_object('type', e.type, 'data', e.data)
                                                ORDER BY e.k), count(*)
      FROM (SELECT row_number() OVER (ORDER BY n.hold_id) AS k, 'hold.' || n.status AS type,
                   CASE WHEN n.status = 'confirmed'
                        THEN jsonb_build_object('hold_id', n.hold_id, 'order_id', n.order_id)
                        ELSE jsonb_build_object('hold_id', n.hold_id,
                                                'lines', hold_event_lines(n.hold_id)) END AS data
              FROM new_rows n JOIN old_rows o USING (hold_id)
             WHERE o.status = 'held' AND n.status IN ('confirmed', 'released', 'expired')) e
     GROUP BY (e.k - 1) / 1000 ORDER BY (e.k - 1) / 1000;
    RETURN NULL;
END $$;
CREATE TRIGGER events_holds_updated AFTER UPDATE ON holds
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_holds_updated();

-- `stock.changed` (create, restock, import) is written by the statements that change the
-- stock for those reasons (src/checkout/stock.rs), in the same statement.

-- The event feed (contract, "Events"): one row per committed change, written in the
-- transaction of the change by triggers, so every writer (the batch functions, carts, holds,
-- cancels, the sweeper) writes its events without an extra round trip, and a rolled-back
-- change leaves none.
--
-- Order: (xid, n). `xid` is the writing transaction's id, `n` a sequence within it. The feed
-- serves only events whose xid is below the reading snapshot's xmin: every transaction with
-- a smaller id has ended, so no event can later appear before one already served. A
-- transaction that commits late is placed after what was served when it committed; a long
-- transaction delays the feed (it holds xmin back) and never reorders it.
CREATE TABLE events (
    xid   xid8        NOT NULL DEFAULT pg_current_xact_id(),
    n     bigint      GENERATED ALWAYS AS IDENTITY,
    at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    type  text        NOT NULL CHECK (type IN ('order.confirmed', 'order.cancelled',
                                               'hold.created', 'hold.confirmed',
                                               'hold.released', 'hold.expired',
                                               'stock.changed')),
    data  jsonb       NOT NULL,
    PRIMARY KEY (xid, n)
);
-- The retention purge walks the oldest events.
CREATE INDEX events_at ON events (at);

-- The newest event the retention purge removed: a cursor before it may have missed events
-- (410 CURSOR_EXPIRED); one at or after it has not.
CREATE TABLE events_purged (
    one  boolean PRIMARY KEY DEFAULT true CHECK (one),
    xid  xid8    NOT NULL,
    n    bigint  NOT NULL
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
-- cart is announced by the insert of its lines).
CREATE FUNCTION events_orders_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (type, data)
    SELECT 'order.confirmed', order_event_data(o)
      FROM new_rows o
     WHERE o.status = 'confirmed' AND o.product_id IS NOT NULL
     ORDER BY o.order_id;
    RETURN NULL;
END $$;
CREATE TRIGGER events_orders_inserted AFTER INSERT ON orders
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_orders_inserted();

-- A cart's (or a confirmed hold's) lines: the order is announced with all of them.
CREATE FUNCTION events_order_lines_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (type, data)
    SELECT 'order.confirmed', order_event_data(o)
      FROM orders o
     WHERE o.order_id IN (SELECT DISTINCT l.order_id FROM new_rows l)
       AND o.status = 'confirmed'
     ORDER BY o.order_id;
    RETURN NULL;
END $$;
CREATE TRIGGER events_order_lines_inserted AFTER INSERT ON order_lines
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_order_lines_inserted();

-- A refusal that became an order (the batch's second seating), and cancels.
CREATE FUNCTION events_orders_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO events (type, data)
    SELECT CASE WHEN n.status = 'confirmed' THEN 'order.confirmed' ELSE 'order.cancelled' END,
           CASE WHEN n.status = 'confirmed' THEN order_event_data(n)
                ELSE jsonb_build_object('order_id', n.order_id,
                                        'lines', order_event_data(n)->'lines') END
      FROM new_rows n JOIN old_rows o USING (order_id)
     WHERE (o.status = 'refused' AND n.status = 'confirmed')
        OR (o.status = 'confirmed' AND n.status = 'cancelled')
     ORDER BY n.order_id;
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
    INSERT INTO events (type, data)
    SELECT 'hold.created', jsonb_build_object('hold_id', h.hold_id, 'user_id', h.user_id,
                                              'expires_at', h.expires_at,
                                              'lines', hold_event_lines(h.hold_id))
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
    INSERT INTO events (type, data)
    SELECT 'hold.' || n.status,
           CASE WHEN n.status = 'confirmed'
                THEN jsonb_build_object('hold_id', n.hold_id, 'order_id', n.order_id)
                ELSE jsonb_build_object('hold_id', n.hold_id, 'lines', hold_event_lines(n.hold_id)) END
      FROM new_rows n JOIN old_rows o USING (hold_id)
     WHERE o.status = 'held' AND n.status IN ('confirmed', 'released', 'expired')
     ORDER BY n.hold_id;
    RETURN NULL;
END $$;
CREATE TRIGGER events_holds_updated AFTER UPDATE ON holds
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION events_holds_updated();

-- `stock.changed` (create, restock, import) is written by the statements that change the
-- stock for those reasons (src/checkout/stock.rs), in the same statement.

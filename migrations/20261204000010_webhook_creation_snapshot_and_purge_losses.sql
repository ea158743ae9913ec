-- Webhooks (src/events/webhooks.rs, docs/design/webhooks.md): what a webhook's creation saw,
-- and the events purged before they were delivered.

-- The creating transaction's snapshot (pg_current_snapshot()): delivery skips an event whose
-- transaction it saw as ended, i.e. committed before the webhook existed, although its id is
-- above the snapshot's xmin and so after the starting cursor. NULL for webhooks created
-- before this column: they keep the old start (a few events from before their creation).
ALTER TABLE webhooks ADD COLUMN created_snapshot pg_snapshot;

-- Events of its types that were purged past retention before the webhook was sent them
-- (never delivered, now gone), counted when its deliverer finds them missing.
ALTER TABLE webhooks ADD COLUMN lost_events bigint NOT NULL DEFAULT 0;

-- The purged events a live webhook had not been sent when the purge took them: per purged
-- row of `events`, the positions of the events of the webhook's types after its delivered
-- cursor then (and not seen by its creation). Only the purge can know their types, so it
-- notes them here; the deliverer reconciles them with what it delivered from memory and
-- deletes them (a superset: an event the deliverer had already read ahead is still
-- delivered, and not counted lost).
CREATE TABLE webhook_purged (
    webhook_id uuid     NOT NULL REFERENCES webhooks,
    xid        xid8     NOT NULL,
    positions  bigint[] NOT NULL CHECK (cardinality(positions) > 0)
);
CREATE INDEX webhook_purged_webhook ON webhook_purged (webhook_id);

-- One call per purge statement (once a minute); it opens only the purged rows holding a
-- lagging webhook's types after its cursor, so a purge behind every webhook costs a join of
-- the purged rows' positions with the webhooks and nothing more.
CREATE FUNCTION webhooks_note_purged_events() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO webhook_purged (webhook_id, xid, positions)
    SELECT w.webhook_id, g.xid, array_agg(g.n * 65536 + x.i ORDER BY x.i)
      FROM webhooks w
      JOIN gone g ON g.types && w.types
                 AND (g.xid, g.n * 65536 + g.k) > (w.delivered_xid, w.delivered_n)
     CROSS JOIN LATERAL json_array_elements(g.items) WITH ORDINALITY AS x(item, i)
     WHERE w.deleted_at IS NULL
       AND (g.xid, g.n * 65536 + x.i) > (w.delivered_xid, w.delivered_n)
       AND x.item->>'type' = ANY(w.types)
       AND NOT coalesce(pg_visible_in_snapshot(g.xid, w.created_snapshot), false)
     GROUP BY w.webhook_id, g.xid, g.n;
    RETURN NULL;
END $$;
CREATE TRIGGER webhooks_note_purged_events AFTER DELETE ON events
    REFERENCING OLD TABLE AS gone FOR EACH STATEMENT
    EXECUTE FUNCTION webhooks_note_purged_events();

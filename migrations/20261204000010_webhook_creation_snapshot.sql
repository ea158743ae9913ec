-- Webhooks (src/events/webhooks.rs, docs/design/webhooks.md): what a webhook's creation saw.

-- The creating transaction's snapshot (pg_current_snapshot()): delivery skips an event whose
-- transaction it saw as ended, i.e. committed before the webhook existed, although its id is
-- above the snapshot's xmin and so after the starting cursor. NULL for webhooks created
-- before this column: they keep the old start (a few events from before their creation).
ALTER TABLE webhooks ADD COLUMN created_snapshot pg_snapshot;

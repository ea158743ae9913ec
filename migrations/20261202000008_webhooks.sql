-- Webhooks (contract, "Webhooks"): each gets every event of its `types` after its delivered
-- cursor, in feed order, from one instance at a time (src/events/webhooks.rs).
CREATE TABLE webhooks (
    webhook_id      uuid        PRIMARY KEY,
    url             text        NOT NULL,
    secret          text        NOT NULL,
    types           text[]      NOT NULL CHECK (cardinality(types) > 0),
    -- The last event delivered (a 2xx), or the newest servable event at creation:
    -- delivery continues after it. (0, 0) is before every event.
    delivered_xid   xid8        NOT NULL,
    delivered_n     bigint      NOT NULL,
    -- Failed attempts at the event after the delivered cursor since the last success; the
    -- retry backoff grows with it, so it survives a restart or a move to another instance.
    failures        integer     NOT NULL DEFAULT 0,
    -- The most recent failure's reason (kept after a later success).
    last_error      text,
    -- No attempt before this moment (the backoff after a failure).
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- The delivering instance holds the session advisory lock (LOCK_SPACE, lock_key) on the
    -- primary while it delivers: one instance at a time, released if its connection dies.
    lock_key        integer     GENERATED ALWAYS AS IDENTITY UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- Set by DELETE: delivery stops, the row stays for the record.
    deleted_at      timestamptz
);

-- The stock ledger (the contract's "Locations, transfers and the stock ledger", second half).
--
-- Every change of a location's count that is not an order's, a cart's or a hold's take or
-- give-back is ONE row here, written by the statement that changes the count
-- (src/checkout/stock: create, restock, import, adjustment, transfer out, transfer in).
-- Orders, carts and holds are their own records, with their `allocations`, so the order path
-- writes no row here. The rule `stockgate verify` checks, for every (product, location):
--
--   count = sum(movements.delta)
--         - units allocated there by orders with status 'confirmed'
--         - units allocated there by holds with status 'held' (not yet released, confirmed
--           or expired by the service; a confirmed hold's units are its order's)
--
-- `movement_id` is an identity: every writer of a product's level holds the product's row
-- lock when it inserts, so within a product ids grow in commit order, and a page's cursor
-- (the last id) never skips a movement that commits later.
--
-- Writers that know no ledger (a binary from before this migration, during a rolling
-- deploy) still sell, cancel and expire correctly; a restock or transfer they make writes
-- no movement, and `stockgate verify` names it. Finish the rollout before relying on it.

CREATE TABLE movements (
    movement_id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    product_id          text        NOT NULL,
    location_id         text        NOT NULL,
    delta               integer     NOT NULL,
    reason              text        NOT NULL CHECK (reason IN (
                            'create', 'restock', 'import', 'transfer_out', 'transfer_in',
                            'received', 'damaged', 'lost', 'found', 'count', 'returned', 'correction')),
    ref                 text,
    note                text        CHECK (length(note) <= 500),
    at                  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- An adjustment's key and the body it was made with; its answer is the row itself.
    idempotency_key     text        UNIQUE,
    request_fingerprint text,
    available_after     integer     NOT NULL,
    FOREIGN KEY (product_id, location_id) REFERENCES stock_levels (product_id, location_id),
    CHECK ((idempotency_key IS NULL) = (request_fingerprint IS NULL))
);
CREATE INDEX movements_product ON movements (product_id, movement_id);
CREATE INDEX movements_level ON movements (product_id, location_id, movement_id);

-- The opening movement of every existing level: what the rule needs for the count to hold
-- from the first moment, i.e. the count plus the units its confirmed orders and live holds
-- took. Writers of levels wait here (and the statement's snapshot comes after them), so
-- nothing commits between the figures this reads.
LOCK TABLE stock_levels IN SHARE ROW EXCLUSIVE MODE;
WITH taken AS (
    SELECT a.product_id, a.location_id, sum(a.quantity)::bigint AS q
      FROM (SELECT allocations FROM orders WHERE status = 'confirmed'
            UNION ALL
            SELECT allocations FROM holds WHERE status = 'held') x,
           jsonb_to_recordset(x.allocations) AS a(product_id text, location_id text, quantity integer)
     GROUP BY a.product_id, a.location_id
)
INSERT INTO movements (product_id, location_id, delta, reason, note, available_after)
SELECT s.product_id, s.location_id, (s.available_quantity + coalesce(t.q, 0))::integer, 'count',
       'opening stock: the count when the ledger began, plus the units confirmed orders and live holds had taken',
       s.available_quantity
  FROM stock_levels s
  LEFT JOIN taken t ON t.product_id = s.product_id AND t.location_id = s.location_id
 ORDER BY s.product_id COLLATE "C", s.location_id COLLATE "C";

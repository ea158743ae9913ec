-- Imports state counts per (product, location) (the contract's "Imports" under "Locations,
-- transfers and the stock ledger"): each level keeps the count it was last *given* — at
-- creation, or by an import naming its location — as `products.stated_quantity` does for a
-- product kept at `default` only. An import moves a level by the change between the file's
-- count and this one, so units sold at that location since stay sold there.
--
-- NULL: the level was never given a count (opened by a restock, a transfer or an adjustment);
-- an import then takes its count as the one it was last given (`coalesce(stated_quantity,
-- available_quantity)`), i.e. the file's count becomes the level's.
ALTER TABLE stock_levels
    ADD COLUMN stated_quantity integer CHECK (stated_quantity >= 0);

-- Until now only `default` was ever stated, in `products.stated_quantity`; a binary from before
-- this migration keeps writing only that column, and this one keeps writing it for `default`
-- rows, so it stays the older binary's figure during a rolling deploy.
UPDATE stock_levels s
   SET stated_quantity = p.stated_quantity
  FROM products p
 WHERE p.product_id = s.product_id AND s.location_id = 'default';

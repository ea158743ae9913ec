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
 WHERE p.product_id = s.product_id AND s.location_id = 'default'
   -- Kept at several places, the product's stated count is their sum at creation, not what
   -- `default` was given: such a level stays NULL (an import takes its count as given).
   AND NOT EXISTS (SELECT FROM stock_levels o
                    WHERE o.product_id = s.product_id AND o.location_id <> 'default');

-- A binary from before this migration, still serving during a rolling deploy, states counts
-- in `products.stated_quantity` only. Its writes of a product kept at `default` only reach
-- the level through the trigger of 20261205000002; the trigger now carries the stated count
-- too, so an import by this binary afterwards moves the level by what that binary stated,
-- and the units it sold since stay sold.
CREATE OR REPLACE FUNCTION stock_levels_follow_product() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO stock_levels (product_id, location_id, available_quantity, stated_quantity)
        VALUES (NEW.product_id, 'default', NEW.available_quantity, NEW.stated_quantity);
        RETURN NULL;
    END IF;
    IF EXISTS (SELECT FROM stock_levels s
                WHERE s.product_id = NEW.product_id AND s.location_id <> 'default') THEN
        IF NEW.available_quantity <> OLD.available_quantity THEN
            RAISE EXCEPTION 'product % is kept at several locations: this writer cannot say where its units go',
                NEW.product_id USING ERRCODE = 'XX000';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.available_quantity <> OLD.available_quantity
       OR NEW.stated_quantity IS DISTINCT FROM OLD.stated_quantity THEN
        UPDATE stock_levels s
           SET available_quantity = s.available_quantity
                                    + (NEW.available_quantity - OLD.available_quantity),
               stated_quantity = NEW.stated_quantity,
               updated_at = clock_timestamp()
         WHERE s.product_id = NEW.product_id AND s.location_id = 'default';
    END IF;
    RETURN NEW;
END $$;
DROP TRIGGER stock_levels_follow_product_update ON products;
CREATE TRIGGER stock_levels_follow_product_update
    BEFORE UPDATE OF available_quantity, stated_quantity ON products
    FOR EACH ROW WHEN (current_setting('stockgate.levels', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION stock_levels_follow_product();

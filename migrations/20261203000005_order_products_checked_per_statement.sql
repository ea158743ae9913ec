-- An order's product is checked once per statement and product, not once per row (issue #31).
--
-- The foreign keys `orders.product_id` and `order_lines.product_id` → `products` ran one
-- `SELECT … FOR KEY SHARE` per inserted row: 37 per batch of 37 orders, all on the one hot row,
-- inside the batch that holds that row's lock. Side by side on fresh databases (one hot
-- product, `wrk -c64`), the per-statement check below sold more in 8 of 9 pairs, by 2–18 %,
-- with p99 lower (bench/results/ab-2026-12-03.md).
--
-- The same guarantee, per statement:
--  * inserting: a statement-level trigger locks every distinct product its new rows name
--    (`FOR KEY SHARE`, the lock the foreign key took, held to the end of the transaction) and
--    raises `foreign_key_violation` (23503, a row-level error, as before) if one is missing.
--    KEY SHARE conflicts only with deleting the row or changing its key, never with the order
--    paths' `FOR NO KEY UPDATE` or their stock updates, so no wait and no lock order is added.
--  * changing an order's (or line's) product: a row trigger checks and locks the new one;
--  * deleting a product, or changing its `product_id`: a row trigger raises 23503 while an
--    order or order line names it. It runs after the row's lock is granted, so it sees every
--    order whose statement locked the product before it and has committed since.
-- Nothing in the service deletes a product or changes its key; these stay as the schema's
-- guarantee. `hold_lines` and `restocks` keep their foreign keys: they are not on the hot
-- path.
-- Dropping a foreign key locks both its tables for a moment. Under load, a lock request
-- queued behind a long transaction would hold up every order behind it: wait at most 5 s,
-- else fail (nothing changed) and run `stockgate migrate` again.
SET LOCAL lock_timeout = '5s';
ALTER TABLE orders DROP CONSTRAINT orders_product_id_fkey;
ALTER TABLE order_lines DROP CONSTRAINT order_lines_product_id_fkey;

-- One check for both triggers below: a statement's new rows (inserts), or one row whose
-- product an UPDATE changed. Plans that cannot scan `products`, statistics or none (the batch
-- functions' settings).
CREATE FUNCTION order_products_exist() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    v_missing text;
BEGIN
    IF TG_LEVEL = 'STATEMENT' THEN
        SELECT n.product_id INTO v_missing
          FROM (SELECT DISTINCT r.product_id FROM new_rows r WHERE r.product_id IS NOT NULL) n
          LEFT JOIN LATERAL (SELECT true AS found FROM products p
                              WHERE p.product_id = n.product_id FOR KEY SHARE OF p) l ON true
         WHERE l.found IS NULL
         LIMIT 1;
    ELSE
        PERFORM 1 FROM products p WHERE p.product_id = NEW.product_id FOR KEY SHARE OF p;
        IF NOT FOUND THEN
            v_missing := NEW.product_id;
        END IF;
    END IF;
    IF v_missing IS NOT NULL THEN
        RAISE EXCEPTION 'insert or update on table "%" violates its product reference', TG_TABLE_NAME
            USING ERRCODE = 'foreign_key_violation',
                  DETAIL = format('Key (product_id)=(%s) is not present in table "products".', v_missing);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER orders_products_exist AFTER INSERT ON orders
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION order_products_exist();
CREATE TRIGGER order_lines_products_exist AFTER INSERT ON order_lines
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
    EXECUTE FUNCTION order_products_exist();
-- Nothing in the service changes an order's product; a column trigger, so no other update
-- fires these.
CREATE TRIGGER orders_product_exists_on_change AFTER UPDATE OF product_id ON orders
    FOR EACH ROW WHEN (NEW.product_id IS NOT NULL AND NEW.product_id IS DISTINCT FROM OLD.product_id)
    EXECUTE FUNCTION order_products_exist();
CREATE TRIGGER order_lines_product_exists_on_change AFTER UPDATE OF product_id ON order_lines
    FOR EACH ROW WHEN (NEW.product_id IS DISTINCT FROM OLD.product_id)
    EXECUTE FUNCTION order_products_exist();

-- Only an UPDATE that sets product_id reaches the update trigger (stock updates never do).
CREATE FUNCTION products_keep_their_orders() RETURNS trigger
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM orders o WHERE o.product_id = OLD.product_id)
       OR EXISTS (SELECT 1 FROM order_lines l WHERE l.product_id = OLD.product_id) THEN
        RAISE EXCEPTION 'update or delete on table "products" violates the product reference of its orders'
            USING ERRCODE = 'foreign_key_violation',
                  DETAIL = format('Key (product_id)=(%s) is still referenced by orders.', OLD.product_id);
    END IF;
    IF TG_OP = 'DELETE' THEN
        RETURN OLD;
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER products_keep_their_orders_on_delete BEFORE DELETE ON products
    FOR EACH ROW EXECUTE FUNCTION products_keep_their_orders();
CREATE TRIGGER products_keep_their_orders_on_key_change BEFORE UPDATE OF product_id ON products
    FOR EACH ROW WHEN (OLD.product_id IS DISTINCT FROM NEW.product_id)
    EXECUTE FUNCTION products_keep_their_orders();

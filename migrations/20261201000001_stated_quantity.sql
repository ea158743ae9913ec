-- The count each product was last *given* — at creation, or by an import — as opposed to
-- available_quantity, which sales, cancels and restocks move. An import applies only the
-- change between the file's count and this one, so units sold or restocked since are kept
-- and re-running the same file changes nothing (see "Imports keep what was sold" in the
-- contract). Restocks, orders and cancels never touch it.
ALTER TABLE products ADD COLUMN stated_quantity integer;

-- Until now the only count a product was given is the one it still holds, as far as we can
-- know: nothing recorded the original. Taking today's stock is the choice that keeps every
-- sale already made (an import of the old file would otherwise put sold units back).
UPDATE products SET stated_quantity = available_quantity;

-- Every way a product is created states its count, even paths that predate the column
-- (`./dev up`'s demo rows, the bench scripts, any operator's psql): a new row that names no
-- stated_quantity was given its available_quantity.
CREATE FUNCTION products_stated_quantity_default() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.stated_quantity := COALESCE(NEW.stated_quantity, NEW.available_quantity);
    RETURN NEW;
END
$$;

CREATE TRIGGER products_stated_quantity_default
    BEFORE INSERT ON products
    FOR EACH ROW EXECUTE FUNCTION products_stated_quantity_default();

ALTER TABLE products
    ALTER COLUMN stated_quantity SET NOT NULL,
    ADD CONSTRAINT products_stated_quantity_check CHECK (stated_quantity >= 0);

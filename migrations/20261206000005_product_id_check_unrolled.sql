-- The product id's check, the same rule at a fraction of the cost. `{1,64}` makes PostgreSQL's
-- regular expression engine track 64 counted repetitions, and a CHECK runs on every update of
-- the row, so every order batch paid it for every product it sold (25,000 instructions a
-- product, 4 % of a 1,000-product batch statement; bench/results/sql-cost-2026-12-06.md). One
-- or more of the same ASCII characters, and at most 64 bytes, is the same set of ids.
ALTER TABLE products
    DROP CONSTRAINT products_product_id_check,
    ADD CONSTRAINT products_product_id_check
        CHECK (product_id ~ '^[A-Za-z0-9_.-]+$' AND octet_length(product_id) <= 64);

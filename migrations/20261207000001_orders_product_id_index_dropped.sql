-- no-transaction
-- The B-tree on `orders.product_id` served one reader: the check that refuses to delete (or
-- re-key) a product some order names (`products_keep_their_orders`, migration
-- 20261203000005). Nothing in the service reads orders by product. Every order paid for it:
-- an index entry per insert, 2.2 % of a hot batch statement's instructions and 1.1 % of a
-- 1,000-product one (bench/results/sql-cost-2026-12-07.md). Without it the check reads the
-- orders table through, as PostgreSQL's own foreign keys do on a referencing column without
-- an index: a product is deleted by an operator, rarely, and never by the service.
DROP INDEX CONCURRENTLY IF EXISTS orders_product_id;

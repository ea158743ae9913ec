-- no-transaction
-- The B-tree on `created_at`, replaced by the BRIN index of migration 20261206000006.
DROP INDEX CONCURRENTLY IF EXISTS orders_created_at;

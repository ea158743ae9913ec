-- no-transaction
-- The reports' time ranges (the revenue of a day, the CSV export) through a BRIN index on
-- `created_at`. Orders are appended in time order (`created_at` is the insert's
-- clock_timestamp()), so a block range's minimum and maximum bound a report's scan as well as
-- a B-tree did, while every order's insert no longer descends a B-tree of timestamps: about
-- 2 % of a hot product's batch statement (bench/results/sql-cost-2026-12-06.md). Built
-- concurrently, so sales go on while it builds; migration 20261206000007 drops the B-tree.
CREATE INDEX CONCURRENTLY IF NOT EXISTS orders_created_at_brin ON orders USING brin (created_at);

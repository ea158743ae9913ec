-- no-transaction
-- The idempotency window's purge finds refusals older than the window by age, oldest
-- first, without reading confirmed orders: a partial index of refusals only. Built
-- CONCURRENTLY (its own migration, outside a transaction) so a large orders table keeps
-- taking orders meanwhile.
CREATE INDEX CONCURRENTLY IF NOT EXISTS orders_refused_by_age ON orders (created_at) WHERE status = 'refused';

-- no-transaction
-- The same for refused holds (see 20261202000003).
CREATE INDEX CONCURRENTLY IF NOT EXISTS holds_refused_by_age ON holds (created_at) WHERE status = 'refused';

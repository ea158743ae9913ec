-- take_order_batch plans each statement once per connection (PL/pgSQL's plan cache) and
-- keeps the plan. On a new deployment `orders` has no statistics, and looks tiny when the
-- first batches run: the planner then finds a full scan of `orders` (its heap, or its whole
-- key index under a hash join) as cheap as one index probe per key, caches that plan, and
-- every later batch scans the whole table, a little longer with each order (a 37-order batch
-- took 9.2 ms instead of 2.8 ms at 87k rows; autovacuum had not analyzed the table after
-- three minutes). Every lookup in the function is a key to a unique index, so the plans we
-- want are nested loops of index probes, whose cost does not grow with the table: with the
-- alternatives off for the function's own statements, those are the only plans left,
-- whatever the statistics say or do not say yet. (A setting off is a cost penalty, not a
-- ban: a statement that had no index path would still run, and the seq-scan test in
-- tests/api/plans.rs would show it.) Nothing outside the function is affected.
ALTER FUNCTION take_order_batch(text, uuid[], text[], text[], integer[], text[])
    SET enable_seqscan = off
    SET enable_hashjoin = off
    SET enable_mergejoin = off;

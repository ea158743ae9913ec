-- no-transaction
-- A user's confirmed orders, for their per-customer allowance (`customer_units`, rewritten in
-- migration 20261203000004). That function read a user's rows through the (user_id,
-- idempotency_key) index, which no longer leads with the user (migration 20261203000002); this
-- partial index holds confirmed orders only, so the cost is the user's purchases, no longer
-- every refusal the user collected in the idempotency window as well.
CREATE INDEX CONCURRENTLY orders_user_confirmed ON orders (user_id) WHERE status = 'confirmed';

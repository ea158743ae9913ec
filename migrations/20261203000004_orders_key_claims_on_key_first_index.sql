-- The key claim's constraint moves to the key-first index built by migration 20261203000002;
-- it keeps its name, which the batch functions' `ON CONFLICT ON CONSTRAINT` use. Both steps
-- take the table's lock only for a moment: the old index is dropped, the built one adopted.
ALTER TABLE orders
    DROP CONSTRAINT orders_user_idempotency_key,
    ADD CONSTRAINT orders_user_idempotency_key UNIQUE USING INDEX orders_key_user;

-- customer_units (migration 20261202000005) with the user's orders read through the partial
-- index of confirmed orders (migration 20261203000003): the status condition is inside the
-- `OFFSET 0` fence, so the index's predicate is implied and it is the only index on `user_id`.
CREATE OR REPLACE FUNCTION customer_units(p_products text[], p_users text[])
RETURNS TABLE (product_id text, user_id text, units bigint)
LANGUAGE plpgsql STABLE
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT k.product_id, k.user_id,
           coalesce((SELECT sum(CASE WHEN x.product_id IS NULL
                                     THEN (SELECT l.quantity FROM order_lines l
                                            WHERE l.order_id = x.order_id
                                              AND l.product_id = k.product_id)
                                     ELSE x.quantity END)
                       FROM (SELECT o.order_id, o.product_id, o.quantity
                               FROM orders o
                              WHERE o.user_id = k.user_id AND o.status = 'confirmed'
                             OFFSET 0) AS x
                      WHERE x.product_id IS NULL OR x.product_id = k.product_id), 0)
         + coalesce((SELECT sum((SELECT l.quantity FROM hold_lines l
                                  WHERE l.hold_id = y.hold_id AND l.product_id = k.product_id))
                       FROM (SELECT h.hold_id, h.status
                               FROM holds h WHERE h.user_id = k.user_id OFFSET 0) AS y
                      WHERE y.status = 'held'), 0)
      FROM (SELECT DISTINCT u.product_id, u.user_id
              FROM unnest(p_products, p_users) AS u(product_id, user_id)) AS k;
END
$$;

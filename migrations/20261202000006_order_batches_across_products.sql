-- Order batches of several products in one transaction, one commit (issue #31, a normal day's
-- shape). Orders spread over many products made one-order batches, each its own transaction
-- and WAL flush; here the batches that are ready at the same moment, one per product, run in
-- one statement: `take_order_batch_v2` for each product in turn, so every rule it keeps (the
-- row lock, first-fit seats, the key claims, the window and the limit, ONE guarded UPDATE per
-- product) holds unchanged, and all of them commit together.
--
-- Products come in byte order (`COLLATE "C"`, the one lock order every transaction here
-- shares: carts, holds, imports and other batches), so two such statements never wait for
-- each other in a circle. The requests come flattened, each product's contiguous and in
-- arrival order; `p_ends[i]` is the position of product i's last request.
--
-- A product's rows are returned after its name (`batch_product`), with `n` counting within
-- its own batch. An error anywhere rolls back every batch of the statement: the caller then
-- runs them one by one.
CREATE FUNCTION take_order_batches_v1(
    p_products text[],
    p_ends     integer[],
    p_ids      uuid[],
    p_users    text[],
    p_keys     text[],
    p_qty      integer[],
    p_fps      text[]
) RETURNS TABLE (
    batch_product       text,
    n                   bigint,
    found               integer,
    left_after          integer,
    lock_wait_us        bigint,
    starts_in_ms        bigint,
    sale_starts_at      timestamptz,
    sale_ends_at        timestamptz,
    idempotency_key     text,
    request_fingerprint text,
    refusal             jsonb,
    order_id            uuid,
    product_id          text,
    quantity            integer,
    user_id             text,
    status              text,
    total_cents         bigint,
    created_at          timestamptz,
    cancelled_at        timestamptz,
    unit_price_cents    integer
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    lo integer := 1;
BEGIN
    FOR i IN 1 .. cardinality(p_products) LOOP
        IF i > 1 AND (p_products[i - 1] COLLATE "C") >= (p_products[i] COLLATE "C") THEN
            RAISE EXCEPTION 'products must come once each, in byte order'
                USING ERRCODE = 'XX000';
        END IF;
        RETURN QUERY
            SELECT p_products[i], t.*
              FROM take_order_batch_v2(p_products[i], p_ids[lo:p_ends[i]], p_users[lo:p_ends[i]],
                                       p_keys[lo:p_ends[i]], p_qty[lo:p_ends[i]],
                                       p_fps[lo:p_ends[i]]) AS t;
        lo := p_ends[i] + 1;
    END LOOP;
END
$$;

-- no-transaction
-- As 20261207000001 for a cart's lines: `order_lines.product_id`'s B-tree served only the
-- product delete check, and every line of every cart paid an index entry for it.
DROP INDEX CONCURRENTLY IF EXISTS order_lines_product_id;

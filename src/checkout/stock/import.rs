//! An import batch's statements (`crate::import`'s `write_batch` calls them in this order,
//! in one transaction): [`create_products`], [`lock_differing`], [`open_levels`],
//! [`read_levels`], [`restate`]. The rule that turns a level's figures and the file's count
//! into a change is `crate::import::restate`, in Rust, between the read and the write.
//!
//! Each statement follows the levels' protocol (`levels.rs`): the products are locked first
//! (a new product's row is its inserter's alone until commit), in byte order; a missing level
//! is created with 0 in a statement of its own; a location's `active` flag is read only in
//! the last statement, after the locks. Every level an import changes is one `movements` row
//! (reason `import`, `ref` the import's id) and one `stock.changed` event, written by the
//! statement that changes it.

use super::Tx;

/// The file's levels as columns, sorted by (product, location) in byte order.
pub(crate) struct FileLevels<'a> {
    pub ids: Vec<&'a str>,
    pub locations: Vec<&'a str>,
    pub names: Vec<&'a str>,
    pub prices: Vec<i32>,
    /// The count the file states at each level.
    pub counts: Vec<i32>,
}

/// Inserts the products that do not exist yet (each once, in lock order) with no stock: their
/// levels get the file's counts in [`restate`]. `default_counts[i]`: the file's count at
/// `default`, kept as `products.stated_quantity` (what a binary from before per-location
/// imports restates from), 0 without one. Returns the ids it created.
pub(crate) async fn create_products(
    tx: &mut Tx,
    ids: &[&str],
    names: &[&str],
    prices: &[i32],
    default_counts: &[Option<i32>],
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "INSERT INTO products (product_id, name, price_cents, available_quantity, stated_quantity) \
         SELECT id, name, price, 0, coalesce(stated, 0) \
           FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[]) AS f(id, name, price, stated) \
          ORDER BY id COLLATE \"C\" \
         ON CONFLICT (product_id) DO NOTHING RETURNING product_id",
    )
    .bind(ids)
    .bind(names)
    .bind(prices)
    .bind(default_counts)
    .fetch_all(&mut **tx)
    .await
}

/// Locks, in the one product order, the existing products of `file` whose name or price
/// differ from the file's, or with a level whose last given count (`stated_quantity`, else
/// its count) differs from the file's or that has no level there yet. Returns their ids.
/// `FOR NO KEY UPDATE`, the lock the UPDATE that follows takes anyway: a refusal's or an
/// order line's foreign-key check (`FOR KEY SHARE`) never waits on it, so an import and the
/// buyers of sold-out products never wait on each other in a circle. Which products differ
/// is judged on the statement's snapshot; their levels are read again under the lock
/// ([`read_levels`]).
pub(crate) async fn lock_differing(
    tx: &mut Tx,
    file: &FileLevels<'_>,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "SELECT p.product_id FROM products p \
          WHERE p.product_id IN ( \
                SELECT f.id \
                  FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int4[], $5::int4[]) \
                       AS f(id, loc, name, price, n) \
                  JOIN products q ON q.product_id = f.id \
                  LEFT JOIN stock_levels s ON s.product_id = f.id AND s.location_id = f.loc \
                 WHERE (q.name, q.price_cents) IS DISTINCT FROM (f.name, f.price) \
                    OR coalesce(s.stated_quantity, s.available_quantity) IS DISTINCT FROM f.n) \
          ORDER BY p.product_id COLLATE \"C\" \
          FOR NO KEY UPDATE OF p",
    )
    .bind(&file.ids)
    .bind(&file.locations)
    .bind(&file.names)
    .bind(&file.prices)
    .bind(&file.counts)
    .fetch_all(&mut **tx)
    .await
}

/// Creates the missing levels of (`ids[i]`, `locations[i]`) with 0, in a statement of its
/// own (the protocol). Their products must be locked (or new).
pub(crate) async fn open_levels(tx: &mut Tx, ids: &[&str], locations: &[&str]) -> sqlx::Result<()> {
    sqlx::query(
        "INSERT INTO stock_levels (product_id, location_id, available_quantity) \
         SELECT id, loc, 0 FROM UNNEST($1::text[], $2::text[]) AS f(id, loc) \
          ORDER BY id COLLATE \"C\", loc COLLATE \"C\" \
         ON CONFLICT DO NOTHING",
    )
    .bind(ids)
    .bind(locations)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// A level as an import finds it under its product's lock.
#[derive(Debug, Clone, Copy, sqlx::FromRow)]
pub(crate) struct FoundLevel {
    pub available: i32,
    /// The count it was last given; `None`: never (see the migration).
    pub stated: Option<i32>,
    /// The product's name or price differ from the file's.
    pub product_differs: bool,
}

/// The levels of `file` (which must exist: [`open_levels`]), in `file`'s order, read in a
/// statement after the locks.
pub(crate) async fn read_levels(
    tx: &mut Tx,
    file: &FileLevels<'_>,
) -> sqlx::Result<Vec<FoundLevel>> {
    sqlx::query_as(
        "SELECT s.available_quantity AS available, s.stated_quantity AS stated, \
                (p.name, p.price_cents) IS DISTINCT FROM (f.name, f.price) AS product_differs \
           FROM UNNEST($1::text[], $2::text[], $3::text[], $4::int4[]) WITH ORDINALITY \
                AS f(id, loc, name, price, i) \
           JOIN products p ON p.product_id = f.id \
           JOIN stock_levels s ON s.product_id = f.id AND s.location_id = f.loc \
          ORDER BY f.i",
    )
    .bind(&file.ids)
    .bind(&file.locations)
    .bind(&file.names)
    .bind(&file.prices)
    .fetch_all(&mut **tx)
    .await
}

/// The levels [`restate`] writes, a column each, in lock order.
#[derive(Default)]
pub(crate) struct LevelChanges<'a> {
    pub ids: Vec<&'a str>,
    pub locations: Vec<&'a str>,
    /// How far the level moves (it stops at 0 all the same).
    pub deltas: Vec<i32>,
    /// The file's count: the level's `stated_quantity` from now on.
    pub stated: Vec<i32>,
    /// A new product's level: its movement and event are written even for 0 (it opens).
    pub opening: Vec<bool>,
}

/// The products [`restate`] writes, a column each, in lock order.
#[derive(Default)]
pub(crate) struct ProductChanges<'a> {
    pub ids: Vec<&'a str>,
    pub names: Vec<&'a str>,
    pub prices: Vec<i32>,
    /// The file's count at `default`, if it states one: `products.stated_quantity`.
    pub default_counts: Vec<Option<i32>>,
}

/// Writes an import's restated levels and products in ONE statement: each level moves by
/// its delta and stops at zero, takes the file's count as its stated one, and records the
/// change actually made (a movement, reason `import`, `ref` = `reference`, and a
/// `stock.changed` event with its `location_id`); each product takes the file's name and
/// price, and its count moves by its levels' actual changes at the locations that are active.
/// Returns the products whose count rose.
pub(crate) async fn restate(
    tx: &mut Tx,
    levels: &LevelChanges<'_>,
    products: &ProductChanges<'_>,
    reference: &str,
) -> sqlx::Result<Vec<String>> {
    sqlx::query_scalar(
        "WITH u AS (SELECT * FROM UNNEST($1::text[], $2::text[], $3::int4[], $4::int4[], $5::bool[]) \
                      AS u(id, loc, delta, stated, opening)), \
              old AS (SELECT s.product_id, s.location_id, s.available_quantity FROM stock_levels s \
                        JOIN u ON s.product_id = u.id AND s.location_id = u.loc), \
              lv AS (UPDATE stock_levels s SET available_quantity = greatest(s.available_quantity + u.delta, 0), \
                            stated_quantity = u.stated, updated_at = clock_timestamp() \
                       FROM u WHERE s.product_id = u.id AND s.location_id = u.loc \
                     RETURNING s.product_id, s.location_id, s.available_quantity), \
              moved AS (SELECT lv.product_id, lv.location_id, lv.available_quantity, \
                               lv.available_quantity - old.available_quantity AS delta, u.opening \
                          FROM lv JOIN old USING (product_id, location_id) \
                          JOIN u ON u.id = lv.product_id AND u.loc = lv.location_id), \
              mv AS (INSERT INTO movements (product_id, location_id, delta, reason, ref, available_after) \
                     SELECT product_id, location_id, delta, 'import', $10, available_quantity FROM moved \
                      WHERE delta <> 0 OR opening \
                      ORDER BY product_id COLLATE \"C\", location_id COLLATE \"C\"), \
              gained AS (SELECT m.product_id, sum(m.delta)::int4 AS delta FROM moved m \
                           JOIN locations l ON l.location_id = m.location_id AND l.active \
                          GROUP BY m.product_id), \
              pu AS (SELECT * FROM UNNEST($6::text[], $7::text[], $8::int4[], $9::int4[]) \
                       AS pu(id, name, price, stated)), \
              r AS (UPDATE products p SET name = pu.name, price_cents = pu.price, \
                           stated_quantity = coalesce(pu.stated, p.stated_quantity), \
                           available_quantity = p.available_quantity + coalesce(g.delta, 0), \
                           updated_at = clock_timestamp() \
                      FROM pu LEFT JOIN gained g ON g.product_id = pu.id \
                     WHERE p.product_id = pu.id \
                    RETURNING p.product_id, coalesce(g.delta, 0) AS delta), \
              e AS (INSERT INTO event_rows (types, items, k) \
                    SELECT '{stock.changed}', json_agg(json_build_object('type', 'stock.changed', \
                           'data', json_build_object('product_id', product_id, 'location_id', location_id, \
                           'delta', delta, 'available_quantity', available_quantity, 'reason', 'import')) \
                           ORDER BY k), count(*) \
                      FROM (SELECT m.*, row_number() OVER (ORDER BY product_id COLLATE \"C\", \
                                                                    location_id COLLATE \"C\") AS k \
                              FROM moved m WHERE delta <> 0 OR opening) m \
                     GROUP BY (k - 1) / 1000 ORDER BY (k - 1) / 1000) \
         SELECT product_id FROM r WHERE delta > 0",
    )
    .bind(&levels.ids)
    .bind(&levels.locations)
    .bind(&levels.deltas)
    .bind(&levels.stated)
    .bind(&levels.opening)
    .bind(&products.ids)
    .bind(&products.names)
    .bind(&products.prices)
    .bind(&products.default_counts)
    .bind(reference)
    .fetch_all(&mut **tx)
    .await
}

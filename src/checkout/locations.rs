//! Locations: where a product's units are kept (the contract's "Locations, transfers and the
//! stock ledger"). Their rows are here; what moves stock between them (a (de)activation's
//! sums, transfers, a level's restock) is the stock module's (`stock/levels.rs`).
//!
//! A location is never deleted, so a name once seen on the primary exists for good: the set
//! of known names is a cache that can only be incomplete, never wrong. A request naming a
//! location this instance has not seen reads the primary once; so does every new name.

use super::error::CheckoutError;
use super::tx::Tx;
use crate::domain::LocationId;
use crate::routing::Db;
use serde::Serialize;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

/// A location as the API states it.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow, utoipa::ToSchema)]
pub struct Location {
    #[schema(pattern = "^[A-Za-z0-9_.-]{1,64}$", example = "eu-1")]
    pub location_id: String,
    #[schema(example = "Leeds")]
    pub name: String,
    /// Lower first, when a request names no locations (0–10,000).
    #[schema(minimum = 0, maximum = 10000, example = 10)]
    pub rank: i32,
    /// An inactive location's stock is not sold, held or counted as available.
    pub active: bool,
}

const COLUMNS: &str = "location_id, name, rank, active";

/// The locations this instance knows exist.
#[derive(Clone, Default)]
pub(crate) struct Known(Arc<Mutex<HashSet<String>>>);

impl Known {
    fn has(&self, id: &str) -> bool {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(id)
    }

    fn learn<'a>(&self, ids: impl IntoIterator<Item = &'a str>) {
        let mut set = self.0.lock().unwrap_or_else(|e| e.into_inner());
        set.extend(ids.into_iter().map(String::from));
    }

    /// `Err(UnknownLocation)` for the first of `ids` that does not exist (read from the
    /// primary when this instance has not seen it yet).
    pub(crate) async fn check(&self, db: &Db, ids: &[LocationId]) -> Result<(), CheckoutError> {
        let unseen: Vec<&str> = ids
            .iter()
            .map(LocationId::as_str)
            .filter(|id| !self.has(id))
            .collect();
        if unseen.is_empty() {
            return Ok(());
        }
        let found: Vec<String> =
            sqlx::query_scalar("SELECT location_id FROM locations WHERE location_id = ANY($1)")
                .bind(&unseen)
                .fetch_all(db.primary().pool()?)
                .await?;
        self.learn(found.iter().map(String::as_str));
        match unseen.iter().find(|id| !found.iter().any(|f| f == *id)) {
            Some(missing) => Err(CheckoutError::UnknownLocation(missing.to_string())),
            None => Ok(()),
        }
    }
}

/// A new location. `None`: the id exists already.
pub(crate) async fn create(
    db: &Db,
    id: &LocationId,
    name: &str,
    rank: i32,
) -> Result<Option<Location>, CheckoutError> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO locations (location_id, name, rank) VALUES ($1, $2, $3) \
         ON CONFLICT (location_id) DO NOTHING RETURNING {COLUMNS}"
    )))
    .bind(id.as_str())
    .bind(name)
    .bind(rank)
    .fetch_optional(db.primary().pool()?)
    .await?)
}

/// Every location, in rank order, then `location_id` (byte order).
pub(crate) async fn list(db: &Db) -> Result<Vec<Location>, CheckoutError> {
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {COLUMNS} FROM locations ORDER BY rank, location_id COLLATE \"C\""
    )))
    .fetch_all(db.primary().pool()?)
    .await?)
}

/// Changes a location's name or rank (its `active` flag is `stock::set_active`'s, in the same
/// transaction). `None`: no such location.
pub(crate) async fn rename(
    tx: &mut Tx,
    id: &LocationId,
    name: Option<&str>,
    rank: Option<i32>,
) -> Result<Option<Location>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "UPDATE locations SET name = coalesce($2, name), rank = coalesce($3, rank), \
                updated_at = clock_timestamp() \
          WHERE location_id = $1 RETURNING {COLUMNS}"
    )))
    .bind(id.as_str())
    .bind(name)
    .bind(rank)
    .fetch_optional(&mut **tx)
    .await
}

impl super::Checkout {
    /// `Err(UnknownLocation)` unless every one of `ids` exists.
    pub async fn known_locations(&self, ids: &[LocationId]) -> Result<(), CheckoutError> {
        self.known.check(&self.db, ids).await
    }

    /// A new location (`None`: the id is taken).
    pub async fn create_location(
        &self,
        id: &LocationId,
        name: &str,
        rank: i32,
    ) -> Result<Option<Location>, CheckoutError> {
        let made = create(&self.db, id, name, rank).await?;
        if made.is_some() {
            self.known.learn([id.as_str()]);
        }
        Ok(made)
    }

    /// Every location, in rank order.
    pub async fn locations(&self) -> Result<Vec<Location>, CheckoutError> {
        list(&self.db).await
    }

    /// Renames, re-ranks or (de)activates a location in one transaction; a change of
    /// `active` moves its products' counts (`stock::levels::set_active`) and reopens their
    /// gates. `None`: no such location.
    pub async fn patch_location(
        &self,
        id: &LocationId,
        name: Option<String>,
        rank: Option<i32>,
        active: Option<bool>,
    ) -> Result<Option<Location>, CheckoutError> {
        let this = self.clone();
        let id = id.clone();
        super::whole_or_none(async move {
            let mut tx = this.db.primary().begin().await?;
            let mut moved = vec![];
            if let Some(active) = active {
                match super::stock::levels::set_active(&mut tx, &id, active).await? {
                    Some((_, products)) => moved = products,
                    None => return Ok(None),
                }
            }
            let Some(location) = rename(&mut tx, &id, name.as_deref(), rank).await? else {
                return Ok(None);
            };
            super::commit(tx).await?;
            this.reopened(&moved).await;
            Ok(Some(location))
        })
        .await
    }

    /// A transfer under its key (`true`: made now).
    pub async fn transfer(
        &self,
        req: super::TransferRequest,
    ) -> Result<(super::Transfer, bool), CheckoutError> {
        self.known
            .check(&self.db, &[req.from.clone(), req.to.clone()])
            .await?;
        let this = self.clone();
        super::whole_or_none(async move {
            let mut tx = this.db.primary().begin().await?;
            let made = super::stock::levels::transfer(&mut tx, &req).await;
            match made {
                Ok((t, true)) => {
                    super::commit(tx).await?;
                    this.reopened(std::slice::from_ref(&req.product)).await;
                    Ok((t, true))
                }
                other => {
                    tx.rollback().await?;
                    other
                }
            }
        })
        .await
    }

    /// Receives an in-transit transfer, exactly once (`true`: received now).
    pub async fn receive_transfer(
        &self,
        id: uuid::Uuid,
    ) -> Result<Option<(super::Transfer, bool)>, CheckoutError> {
        let this = self.clone();
        super::whole_or_none(async move {
            let mut tx = this.db.primary().begin().await?;
            let got = super::stock::levels::receive(&mut tx, id).await?;
            super::commit(tx).await?;
            if let Some((t, true)) = &got
                && let Ok(p) = crate::domain::ProductId::parse(&t.product_id)
            {
                this.reopened(&[p]).await;
            }
            Ok(got)
        })
        .await
    }

    /// A transfer by id, from the primary.
    pub async fn transfer_by_id(
        &self,
        id: uuid::Uuid,
    ) -> Result<Option<super::Transfer>, CheckoutError> {
        Ok(super::stock::levels::get(self.db.primary().pool()?, id).await?)
    }

    /// An adjustment under its key (`true`: made now): the location must exist (422
    /// otherwise, before anything is written).
    pub async fn adjust(
        &self,
        req: super::AdjustmentRequest,
    ) -> Result<(super::Adjusted, bool), CheckoutError> {
        self.known
            .check(&self.db, std::slice::from_ref(&req.location))
            .await?;
        let this = self.clone();
        super::whole_or_none(async move {
            let mut tx = this.db.primary().begin().await?;
            match super::stock::levels::adjust(&mut tx, &req).await {
                Ok((a, true)) => {
                    super::commit(tx).await?;
                    this.reopened(std::slice::from_ref(&req.product)).await;
                    Ok((a, true))
                }
                other => {
                    tx.rollback().await?;
                    // The same key, claimed at the same moment for another product.
                    match other {
                        Err(e) if is_key_claimed(&e) => Err(CheckoutError::KeyReused),
                        other => other,
                    }
                }
            }
        })
        .await
    }

    /// A product's movements after `after`, oldest first, from the primary (`None`: no
    /// such product).
    pub async fn movements(
        &self,
        product: &crate::domain::ProductId,
        location: Option<&LocationId>,
        after: i64,
        limit: i64,
    ) -> Result<Option<Vec<super::Movement>>, CheckoutError> {
        if let Some(l) = location {
            self.known.check(&self.db, std::slice::from_ref(l)).await?;
        }
        // A movement's level references its product, and products are never deleted: a
        // page with rows names a product that exists; only an empty one needs asking.
        let pool = self.db.primary().pool()?;
        let page = super::stock::levels::movements(pool, product, location, after, limit).await?;
        if page.is_empty() {
            let exists: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT FROM products WHERE product_id = $1)")
                    .bind(product.as_str())
                    .fetch_one(pool)
                    .await?;
            if !exists {
                return Ok(None);
            }
        }
        Ok(Some(page))
    }
}

/// A unique violation of the adjustments' key: another adjustment claimed it first.
fn is_key_claimed(e: &CheckoutError) -> bool {
    match e {
        CheckoutError::Db(db) => db.sqlstate().as_deref() == Some("23505"),
        _ => false,
    }
}

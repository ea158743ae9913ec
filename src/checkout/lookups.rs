//! Batched idempotency lookups for the stock gate's "no" path. After a sell-out every
//! rejected request must first prove it is not a retry of an order that exists; one at a
//! time that is a store round trip and a replica query per request. Here the lookups that
//! queue up while one batch runs go together: one read-your-writes lookup for all their
//! users (Redis `MGET`) and one indexed query, on a replica that holds every one of those
//! users' last writes (or the primary).

use super::{CheckoutError, Existing, OrderRequest, Placed, existing_for, judge, key_of};
use crate::metrics::Metrics;
use crate::routing::policy::QueryClass;
use crate::routing::{Db, ReadCtx};
use std::collections::HashMap;
use tokio::sync::{mpsc, oneshot};

type Reply = oneshot::Sender<Result<Option<Placed>, CheckoutError>>;

/// The most lookups one query takes.
const MAX_BATCH: usize = 512;

/// Batches in flight at once. While they run, new lookups queue up and form the next
/// batch: fewer, fuller queries instead of one per request.
const IN_FLIGHT: usize = 4;

#[derive(Clone)]
pub struct Lookups {
    tx: mpsc::UnboundedSender<(OrderRequest, Reply)>,
}

impl Lookups {
    pub fn start(db: Db, metrics: Metrics) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(worker(db, metrics, rx));
        Lookups { tx }
    }

    /// The order already placed under this request's user and key, if any.
    pub async fn existing(&self, req: OrderRequest) -> Result<Option<Placed>, CheckoutError> {
        let (reply, rx) = oneshot::channel();
        let closed = || {
            CheckoutError::Db(crate::routing::DbError::Unavailable(
                "idempotency lookups stopped".into(),
            ))
        };
        self.tx.send((req, reply)).map_err(|_| closed())?;
        rx.await.map_err(|_| closed())?
    }
}

async fn worker(db: Db, metrics: Metrics, mut rx: mpsc::UnboundedReceiver<(OrderRequest, Reply)>) {
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    while let Some(first) = rx.recv().await {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        // Run the batch beside the worker so the next one can form meanwhile.
        let (db, metrics) = (db.clone(), metrics.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let reqs: Vec<&OrderRequest> = batch.iter().map(|(r, _)| r).collect();
            match lookup(&db, &metrics, &reqs).await {
                Ok(mut found) => {
                    for (req, reply) in batch {
                        let hit = found.remove(&key_of(&req));
                        let _ = reply.send(judge(&req, hit));
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for (_, reply) in batch {
                        let _ = reply.send(Err(CheckoutError::Db(
                            crate::routing::DbError::Unavailable(msg.clone()),
                        )));
                    }
                }
            }
        });
    }
}

async fn lookup(
    db: &Db,
    metrics: &Metrics,
    reqs: &[&OrderRequest],
) -> Result<HashMap<(String, String), Existing>, CheckoutError> {
    let users: Vec<&crate::domain::UserId> = reqs.iter().map(|r| &r.user).collect();
    // A replica may answer only if it holds every one of these users' last writes; if the
    // store cannot say, no replica can be trusted with it.
    let min_lsn = match db.ryw().get_max(&users).await {
        Ok(lsn) => lsn,
        Err(_) => {
            metrics.ryw_store_failures.with_label_values(&["get"]).inc();
            Some(u64::MAX)
        }
    };
    let read = db
        .read(
            QueryClass::OwnData,
            &ReadCtx {
                user: None,
                min_lsn,
            },
            |pool| async move { existing_for(pool.exec(), reqs, None).await },
        )
        .await?;
    Ok(read.value)
}

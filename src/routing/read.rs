//! A routed read: decide where it goes, run it there, and route it again when a replica
//! fails, is busy here, or answers over its class's budget.

use super::choose::{Choice, choose_among};
use super::error::{DbError, is_connection_error};
use super::freshness::Lsn;
use super::policy::{QueryClass, Target};
use super::pools::{InFlight, ReadPool};
use super::route::{Reason, Route};
use super::{Db, ReadCtx, Routed};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

impl Db {
    /// Decides where a read of `class` goes, without running it.
    pub async fn route(&self, class: QueryClass, ctx: &ReadCtx) -> Result<Route, DbError> {
        Ok(self.place(class, ctx).await?.1)
    }

    /// A read of `class` that streams (an export): where it goes, and a pool there. The
    /// stream runs outside the router's retries: a failure mid-stream ends it.
    pub async fn stream(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
    ) -> Result<(ReadPool, Route), DbError> {
        let (replica, route) = self.place(class, ctx).await?;
        Ok((self.pool_for(replica), route))
    }

    /// The replica (or `None`: the primary) a read of `class` goes to, and its route.
    async fn place(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
    ) -> Result<(Option<usize>, Route), DbError> {
        match self.min_lsn_for(class, ctx).await {
            Ok(min_lsn) => self.decide(class, min_lsn, &[]),
            Err(route) => Ok((None, route)),
        }
    }

    /// The position a read must be served at (read-your-writes and a carried token), or a
    /// primary route when the store cannot say (fail closed).
    async fn min_lsn_for(&self, class: QueryClass, ctx: &ReadCtx) -> Result<Option<Lsn>, Route> {
        let policy = class.policy();
        let mut min_lsn = ctx.min_lsn;
        if policy.target == Target::Replica
            && policy.read_your_writes
            && !self.inner.replicas.is_empty()
            && let Some(user) = &ctx.user
        {
            match self.inner.ryw.get(user).await {
                Ok(lsn) => min_lsn = min_lsn.max(lsn),
                Err(e) => {
                    self.ryw_failed("get", user, &e, "reading the primary");
                    return Err(
                        self.decided(self.primary_route(class, Reason::RywStoreUnavailable))
                    );
                }
            }
        }
        Ok(min_lsn)
    }

    /// A primary route whose `as_of` is now (before the query is sent).
    fn primary_route(&self, class: QueryClass, reason: Reason) -> Route {
        let now = Instant::now();
        Route::primary(class, reason, now, self.inner.time.wall(now))
    }

    /// Where a read of `class` at `min_lsn` goes, skipping the replicas in `excluded`.
    fn decide(
        &self,
        class: QueryClass,
        min_lsn: Option<Lsn>,
        excluded: &[usize],
    ) -> Result<(Option<usize>, Route), DbError> {
        let policy = class.policy();
        let now = Instant::now();
        let choice = {
            let f = self.freshness_read();
            let loads: Vec<usize> = self
                .inner
                .replicas
                .iter()
                .map(|r| r.in_flight.load(Ordering::Relaxed))
                .collect();
            let start = self.inner.round_robin.fetch_add(1, Ordering::Relaxed);
            choose_among(policy, &f, now, min_lsn, &loads, start, |i| {
                excluded.contains(&i)
            })
        };
        match choice {
            Choice::Replica(i, as_of) => {
                let route = Route {
                    class,
                    served_by: self.inner.replicas[i].name.clone(),
                    reason: Reason::FreshReplica,
                    as_of: self.inner.time.wall(as_of),
                    stale_by: now.saturating_duration_since(as_of),
                    as_of_instant: as_of,
                };
                Ok((Some(i), self.decided(route)))
            }
            Choice::Refuse => {
                self.inner
                    .metrics
                    .routing_decisions
                    .with_label_values(&[class.name(), "refused", Reason::NoFreshReplica.as_str()])
                    .inc();
                Err(DbError::NoFreshReplica(class))
            }
            Choice::Primary(reason) => Ok((None, self.decided(self.primary_route(class, reason)))),
        }
    }

    fn decided(&self, route: Route) -> Route {
        let target = if route.is_primary() {
            "primary"
        } else {
            "replica"
        };
        let m = &self.inner.metrics;
        m.routing_decisions
            .with_label_values(&[route.class.name(), target, route.reason.as_str()])
            .inc();
        if route.is_primary() && route.class.policy().target == Target::Replica {
            m.routing_fallbacks
                .with_label_values(&[route.class.name(), route.reason.as_str()])
                .inc();
        }
        tracing::debug!(route = %route, "routed");
        route
    }

    /// The route of what a primary transaction read while it held its row lock (the stock
    /// an order batch left behind): as of `locked_at`, when the lock was taken.
    pub fn committed_route(&self, class: QueryClass, locked_at: Instant) -> Route {
        Route::primary(
            class,
            Reason::InTransaction,
            locked_at,
            self.wall(locked_at),
        )
        .restated(Instant::now())
    }

    /// `route`, its answer vouched for only up to `at`: its `as_of` becomes the earlier of
    /// the two, its staleness measured afresh (a feed page held back by a transaction that is
    /// still open, [`crate::events::horizon`]).
    pub fn no_later_than(&self, route: Route, at: Instant) -> Route {
        if at >= route.as_of_instant {
            return route;
        }
        Route {
            as_of: self.inner.time.wall(at),
            as_of_instant: at,
            ..route
        }
        .restated(Instant::now())
    }

    /// The route of a write's answer: read back on the primary in the write's own
    /// transaction or right after its commit (restock, settings, profile).
    pub fn written_route(&self) -> Route {
        self.decided(self.primary_route(QueryClass::Primary, Reason::PrimaryOnly))
    }

    /// A route for reads that run inside a primary transaction the caller already holds.
    pub fn in_transaction(&self, class: QueryClass) -> Route {
        self.decided(self.primary_route(class, Reason::InTransaction))
    }

    /// The timeout of a class's replica reads (exports use it for the whole stream).
    pub fn class_timeout(&self, class: QueryClass) -> Duration {
        self.inner.timeouts.for_class(class).0
    }

    /// Runs a read of `class` where the policy sends it. A replica that fails, misses its
    /// class's timeout, has no free connection here, or answers older than the class's
    /// budget is skipped and the read routed again (another fresh replica, else the
    /// primary). Only connect errors and point-read timeouts mark a replica `down`.
    pub async fn read<T, F, Fut>(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
        f: F,
    ) -> Result<Routed<T>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let min_lsn = match self.min_lsn_for(class, ctx).await {
            Ok(m) => m,
            Err(route) => return self.on_primary(route, &f).await,
        };
        let mut excluded: Vec<usize> = Vec::new();
        let mut failed: Option<Reason> = None;
        loop {
            let decided = match self.decide(class, min_lsn, &excluded) {
                // A class that refuses the primary still gets it after a replica failed
                // mid-read, as before: the request was already admitted to a replica.
                Err(DbError::NoFreshReplica(_)) if failed.is_some() => None,
                Err(e) => return Err(e),
                Ok(d) => Some(d),
            };
            let (replica, route) = match (decided, failed) {
                (Some((Some(i), route)), _) => (i, route),
                (Some((None, route)), None) => return self.on_primary(route, &f).await,
                // The primary after a replica attempt: say why (the attempt, not freshness).
                (Some((None, route)), Some(reason)) => {
                    return self.on_primary(Route { reason, ..route }, &f).await;
                }
                (None, reason) => {
                    let reason = reason.unwrap_or(Reason::ReplicaFailed);
                    let route = self.decided(self.primary_route(class, reason));
                    return self.on_primary(route, &f).await;
                }
            };
            excluded.push(replica);
            match self.on_replica(replica, route, &f).await {
                Ok(routed) => return Ok(routed),
                Err(reason) => failed = Some(reason),
            }
        }
    }

    async fn on_primary<T, F, Fut>(&self, route: Route, f: &F) -> Result<Routed<T>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let value = f(ReadPool(self.inner.primary.current().clone())).await?;
        Ok(Routed {
            value,
            route: route.restated(Instant::now()),
        })
    }

    /// One attempt on replica `i`; `Err` says why the read must be routed again.
    async fn on_replica<T, F, Fut>(
        &self,
        i: usize,
        route: Route,
        f: &F,
    ) -> Result<Routed<T>, Reason>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<T, sqlx::Error>>,
    {
        let r = &self.inner.replicas[i];
        let class = route.class;
        let (timeout, counts) = self.inner.timeouts.for_class(class);
        let budget = class.policy().budget;
        // A free connection of our own pool: waiting for one says nothing about the replica.
        let Ok(Ok(_slot)) = tokio::time::timeout(timeout, r.slots.acquire()).await else {
            tracing::debug!(replica = %r.name, %class, "no free connection to the replica here; routing again");
            return Err(Reason::ReplicaBusy);
        };
        let _counted = InFlight::enter(&r.in_flight);
        // The replica's state as the monitor knows it now, when the query is sent: the
        // answer holds at least that (the replica only moves forward while it runs).
        let Some(as_of) = self.freshness_read().as_of(i) else {
            return Err(Reason::ReplicaFailed);
        };
        let mut route = Route {
            as_of: self.inner.time.wall(as_of),
            as_of_instant: as_of,
            ..route
        };
        let outcome = tokio::time::timeout(timeout, f(ReadPool(r.pool.clone()))).await;
        let error = match outcome {
            Ok(Ok(value)) => {
                route = route.restated(Instant::now());
                if budget.is_some_and(|b| route.stale_by_ms() > b.as_millis() as u64) {
                    tracing::debug!(replica = %r.name, %class, stale_by_ms = route.stale_by_ms(), "answer came back over budget; routing again");
                    return Err(Reason::OverBudget);
                }
                return Ok(Routed { value, route });
            }
            // Our own pool had no connection in time (e.g. held by exports): local.
            Ok(Err(sqlx::Error::PoolTimedOut)) => return Err(Reason::ReplicaBusy),
            Ok(Err(e)) if is_connection_error(&e) => {
                self.mark_down(i, e.to_string());
                e.to_string()
            }
            // Any other error on a replica (e.g. a query cancelled by a recovery conflict)
            // is retried without judging the replica.
            Ok(Err(e)) => e.to_string(),
            Err(_) if counts => {
                self.mark_down(i, format!("no answer within {timeout:?}"));
                "timed out".into()
            }
            // A long class's timeout: the query was slow, not the server.
            Err(_) => format!("{class} read took over {timeout:?}"),
        };
        tracing::warn!(replica = %r.name, class = %class, %error, "replica read failed; routing again");
        Err(Reason::ReplicaFailed)
    }

    /// Like [`Db::read`], for a lookup that may find nothing: "not found" on a replica is
    /// not authoritative (the row may be newer than the replica), so it is asked again on
    /// the primary.
    pub async fn read_existing<T, F, Fut>(
        &self,
        class: QueryClass,
        ctx: &ReadCtx,
        f: F,
    ) -> Result<Routed<Option<T>>, DbError>
    where
        F: Fn(ReadPool) -> Fut,
        Fut: Future<Output = Result<Option<T>, sqlx::Error>>,
    {
        let read = self.read(class, ctx, &f).await?;
        if read.value.is_some() || read.route.is_primary() {
            return Ok(read);
        }
        let route = self.decided(self.primary_route(class, Reason::NotOnReplica));
        self.on_primary(route, &f).await
    }

    /// The pool of a placed read.
    fn pool_for(&self, replica: Option<usize>) -> ReadPool {
        match replica {
            Some(i) => ReadPool(self.inner.replicas[i].pool.clone()),
            None => ReadPool(self.inner.primary.current().clone()),
        }
    }
}

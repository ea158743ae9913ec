//! Black-box tests of stockgate against real PostgreSQL clusters (primary + 2 streaming
//! replicas) and a real Redis, all started by the project's own tooling.

// A test states its setup, its action and its checks in one place; it may run long.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::too_many_lines)]

mod adjustments;
mod carts;
mod contract;
mod drops;
mod edges;
mod edges_two;
mod events;
mod failover;
mod foundation;
mod freshness;
mod helpers;
mod history;
mod idempotency_window;
mod import;
mod ledger;
mod loadtest;
mod locations;
mod metrics;
mod migration;
mod order_batch;
mod oversell;
mod overview;
mod pages;
mod peers;
mod plans;
mod read_your_writes;
mod reports;
mod retention;
mod retries;
mod robustness;
mod schemathesis;
mod spread;
mod verify;
mod webhooks;

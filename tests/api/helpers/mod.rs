//! The test harness: real PostgreSQL clusters (primary + 2 streaming replicas) started by
//! the project's own tooling, a real Redis, and the service on port 0.
//!
//! Tests that need replicas fresh share one cluster per test binary (each test gets its own
//! database); tests that inject lag get a private cluster, so a paused replica never leaks
//! into another test. Set `TEST_LOG=1` to see the service's logs.
//!
//! One file a job, all re-exported here, so a test needs only `use crate::helpers::*;`:
//! - [`app`]: clusters, databases and instances of the service, and typed requests to one;
//! - [`answers`]: an answer read back into the contract's shapes, and the error assertion;
//! - [`probes`]: what the database, the replicas, `/metrics` and the feed say now, and
//!   polling until they say something else;
//! - [`chaos_proxy`]: a link to a database the test can cut or sever;
//! - [`patroni`]: a stand-in for Patroni's REST API.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod answers;
mod app;
mod chaos_proxy;
mod patroni;
mod probes;

pub use answers::*;
pub use app::*;
pub use chaos_proxy::*;
pub use patroni::*;
pub use probes::*;

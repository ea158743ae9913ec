//! stockgate: inventory and checkout that never sells what it does not have and never lets
//! a lagging read replica decide anything that matters.
//!
//! # Layout
//! - [`routing`]: the one place that decides where a read goes — pools, the freshness
//!   monitor (WAL positions on one clock), the policy table, and the `Route` every answer
//!   carries.
//! - [`checkout`]: orders, carts, holds, cancels and restocks; the guarded UPDATE on the
//!   primary is the only thing that takes stock, and every answer is final for its key.
//! - [`events`]: the event feed (one order with no gaps: read below the snapshot's xmin) and
//!   webhooks (leased, signed, retried in feed order).
//! - [`ryw`]: the read-your-writes store (in-process or Redis), failing closed.
//! - [`http`]: the REST API, its extractors, errors and middleware; and [`http::peer`],
//!   where a contended product's order is placed (a `Placement`) and the peer client and
//!   listener that carry it to its owner.
//! - [`domain`]: input types parsed at the boundary.
//! - [`auth`]: bearer tokens and who may act for whom.
//! - [`import`]: bulk import throttled against live replica staleness.
//! - [`rates`]: the service's own counters as per-second rates over the last minute (the
//!   ops page's overview).
//! - [`config`], [`cli`], [`startup`], [`telemetry`], [`metrics`], [`clock`], [`lsn`].
//!
//! # Where SQL lives
//! A statement that writes a table lives with the module that owns the table:
//! `products.available_quantity` in `checkout::stock` (and nowhere else, a test holds),
//! orders, carts and holds in [`checkout`], settings and profiles in `http/users.rs`. A read
//! lives next to its only caller, as a string literal (column lists are macros, such as
//! `order_columns!`, so queries stay literals). Server-side functions are versioned: a
//! change is a new function (`take_order_batches_v4`, `drop_verdict_v1`) in a new
//! migration, the old one dropped only once no binary calls it, so a change is a
//! reviewable diff and a rolling deploy never mixes bodies; a test reads `pg_proc` and
//! fails on dead SQL, another holds each version's returned columns to the Rust that reads
//! them (`docs/design/orders.md`, "The order SQL").

pub mod auth;
pub(crate) mod batching;
pub mod checkout;
pub mod cli;
pub mod clock;
pub mod config;
pub mod domain;
pub mod events;
pub mod http;
pub mod import;
pub mod lsn;
pub mod metrics;
pub mod rates;
pub mod routing;
pub mod ryw;
pub mod startup;
pub mod telemetry;

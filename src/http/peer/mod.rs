//! One owner per contended product across instances (`STOCKGATE_PEERS`, issue #31 part 2):
//! both ends of the peer protocol, the client that forwards orders ([`Peers`]) and the
//! listener that places them ([`router`]), and the [`Placement`] that says which end an
//! order takes.
//!
//! Several instances selling one product each take its row for their own batches, and each
//! batch is smaller (an instance gathers only the orders it holds), so together they sell
//! less than one instance alone (figures: bench/results/scale-2026-12-03.md). Here a product
//! whose row another writer keeps taking between this instance's batches ("contended",
//! [`crate::checkout::Checkout::contended`]) has its single-product orders sent to one owner,
//! the same for every instance ([`Placement`]). Orders travel in batches, one lane per owner
//! and product: each request carries everything queued for that product when it leaves (up
//! to a few out at once per lane), and joins the owner's own batches for the product: one
//! row, one writer, larger batches. A product whose batch waits at the owner (its row held
//! locked) fills its own lane only, so the owner's other products keep selling.
//!
//! Nothing about correctness rests on this: the owner places each order exactly as if its
//! client had sent it there (the same guarded UPDATE, key claim and answer), and two instances
//! that disagree about the owner only contend as before. The answers come back as the owner's
//! HTTP answers (status, `Retry-After`, body), so a forwarded order is told what the owner
//! would have told it. An owner that cannot be reached (nothing sent), or that takes a
//! request and then neither answers nor shows a sign of life ([`suspect_after`],
//! [`ALIVE_PATH`]), is passed over for [`DOWN_FOR`] and the orders are placed here under
//! their own keys: each key is claimed once in the database, so if that owner places them
//! after all, it is answered what was written here. One whose link fails after the batch
//! was sent leaves the outcome unknown: 503 `OUTCOME_UNKNOWN`, and the same key tells the
//! truth later.
//!
//! It lives in `http` because both ends speak HTTP answers: the client hands back the owner's
//! response untouched, or the contract's `OUTCOME_UNKNOWN` error, which only `http` maps.

mod client;
mod placement;
mod server;

pub use client::{DOWN_FOR, Peers, suspect_after};
pub use placement::Placement;
pub use server::router;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

/// The peer listener's order route.
pub const PATH: &str = "/peer/v1/orders";

/// The peer listener's sign of life: answered at once, with no database behind it, so an
/// answer says the owner's process runs, and silence says it does not (frozen, or its host
/// is gone while its kernel still completes TCP handshakes).
pub const ALIVE_PATH: &str = "/peer/v1/alive";

/// The most orders one forwarded request carries.
pub const MAX_FORWARD: usize = 1024;

/// One order on its way to its owner (the caller was authenticated here; `user` is the one
/// it acts for).
#[derive(Debug, Serialize, Deserialize)]
pub struct WireOrder {
    pub user: String,
    pub product: String,
    pub quantity: i32,
    pub key: String,
    /// The locations the client named, in its order (none: every active one).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub locations: Vec<String>,
}

/// The owner's HTTP answer to one order.
#[derive(Debug, Serialize, Deserialize)]
pub struct WireAnswer {
    pub status: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
    /// The JSON body as the owner wrote it, passed on untouched.
    pub body: Box<serde_json::value::RawValue>,
}

impl WireAnswer {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_GATEWAY);
        let mut response = (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            String::from(Box::<str>::from(self.body)),
        )
            .into_response();
        if let Some(v) = self
            .retry_after
            .and_then(|v| HeaderValue::from_str(&v).ok())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        response
    }
}

//! `GET /v1/events`: the event feed, a routed read (5 s budget) that may long-poll.

use super::responses::{ErrorBody, Forbidden, Unauthorized, Unavailable};
use super::{Admin, ApiError, AppState, Query, Stated, stated};
use crate::events::{Cursor, Event, feed};
use crate::routing::ReadCtx;
use crate::routing::policy::QueryClass;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::time::Instant;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::default().routes(routes!(events))
}

const MAX_LIMIT: u64 = 1000;
const MAX_WAIT_MS: u64 = 30_000;

/// Unknown query parameters are refused with 400.
#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
struct FeedQuery {
    /// The `next` of an earlier answer (or an event's `cursor`); omitted: from the oldest
    /// retained event.
    after: Option<String>,
    /// 1–1000; default 100.
    limit: Option<u64>,
    /// 0–30000: how long to wait for an event when there is none yet; default 0.
    wait_ms: Option<u64>,
}

impl FeedQuery {
    /// `after`, `limit` and `wait_ms`, each checked.
    fn parse(&self) -> Result<(Option<Cursor>, u64, u64), ApiError> {
        let after = self
            .after
            .as_deref()
            .map(|a| {
                a.parse::<Cursor>().map_err(|e| {
                    ApiError::bad_request("INVALID_CURSOR", format!("after={a:?}: {e}"))
                })
            })
            .transpose()?;
        let limit = self.limit.unwrap_or(100);
        if !(1..=MAX_LIMIT).contains(&limit) {
            return Err(ApiError::bad_request(
                "INVALID_LIMIT",
                format!("limit must be 1 to {MAX_LIMIT}"),
            ));
        }
        let wait = self.wait_ms.unwrap_or(0);
        if wait > MAX_WAIT_MS {
            return Err(ApiError::bad_request(
                "INVALID_WAIT_MS",
                format!("wait_ms must be 0 to {MAX_WAIT_MS}"),
            ));
        }
        Ok((after, limit, wait))
    }
}

#[derive(Serialize, ToSchema)]
struct Page {
    events: Vec<Event>,
    /// The `after` of the following call.
    #[schema(value_type = String, example = "2f8-1a")]
    next: Cursor,
}

/// The event feed: every committed order, hold and stock change after `after`, in one total
/// order (routed read, 5 s budget; admin)
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "events",
    params(FeedQuery),
    responses(
        (status = 200, description = "Events after `after`, and the cursor to continue from", body = Stated<Page>),
        (status = 400, description = "INVALID_CURSOR, INVALID_LIMIT, INVALID_WAIT_MS, INVALID_QUERY", body = ErrorBody),
        (status = 401, response = Unauthorized),
        (status = 403, response = Forbidden),
        (status = 410, description = "CURSOR_EXPIRED: `after` is older than the retained events", body = ErrorBody),
        (status = 503, response = Unavailable),
    )
)]
async fn events(
    State(state): State<AppState>,
    _: Admin,
    Query(q): Query<FeedQuery>,
) -> Result<Response, ApiError> {
    let (after, limit, wait) = q.parse()?;
    let deadline = Instant::now() + Duration::from_millis(wait);
    // Subscribed before the first read, so a change between the read and the wait wakes it.
    let mut newest = state.feed.subscribe();
    let mut ctx = ReadCtx::none();
    loop {
        let read = state
            .db
            .read(QueryClass::Events, &ctx, |pool| async move {
                // An `after` the purge has passed may have missed events: 410. Omitted, the
                // feed starts at the oldest retained event.
                if let Some(after) = after
                    && after < feed::purged_through(pool.exec()).await?
                {
                    return Ok(None);
                }
                // Omitted, an empty page's `next` is where the purge has reached: a cursor
                // before it would be 410, and nothing retained precedes it.
                let from = match after {
                    Some(after) => after,
                    None => feed::purged_through(pool.exec()).await?,
                };
                let page = feed::read_page(pool.exec(), from, limit as i64, None).await?;
                Ok(Some((from, page)))
            })
            .await?;
        let Some((from, page)) = read.value else {
            return Err(ApiError::CursorExpired);
        };
        if !page.events.is_empty() || Instant::now() >= deadline {
            // The page is complete only up to when the oldest transaction its snapshot held
            // back got its id: `as_of` says no more than that.
            let route = match state.feed.bound(page.xmin, page.xmax) {
                Some(at) => state.db.no_later_than(read.route, at),
                None => read.route,
            };
            let events = page.events;
            let next = events.last().map_or(from, |e| e.cursor);
            return Ok(stated(StatusCode::OK, Page { events, next }, &route));
        }
        // Nothing yet: wait for this instance's watcher to see the horizon move (one query
        // of the primary per tick, however many clients wait), then read where the new
        // events are replayed (a replica at the watcher's position, or the primary).
        match tokio::time::timeout_at(deadline, newest.changed()).await {
            Ok(Ok(())) => ctx.min_lsn = newest.borrow_and_update().1,
            // The watcher stopped (shutdown): no more wake-ups, only the deadline's read.
            Ok(Err(_)) => tokio::time::sleep_until(deadline).await,
            Err(_) => {}
        }
    }
}

//! The HTTP API: the shared state, the extractors that parse at the boundary, the
//! middleware stack, and the root router that merges each route module's `router()`.

mod adjustments;
mod admin;
pub mod error;
mod events;
mod health;
mod holds;
mod imports;
mod locations;
mod openapi;
mod orders;
mod overview;
pub mod peer;
pub use peer::router as peer_router;
mod pages;
mod product_body;
mod products;
mod reports;
mod responses;
mod users;
mod webhooks;

use crate::auth::{Caller, Tokens};
use crate::checkout::Checkout;
use crate::metrics::Metrics;
use crate::routing::{Db, Route};
use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, MatchedPath, Request};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{BoxError, Router};
pub use error::ApiError;
pub use imports::Jobs;
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tower::ServiceBuilder;
use utoipa_axum::router::OpenApiRouter;

/// Everything a handler may use, behind one `Arc`: axum clones the state for every request,
/// and cloning the parts (two dozen metric handles, the pools, the token keys) one by one
/// was a large share of an availability answer's CPU in the profile (`bench/results/flame-*`).
#[derive(Clone)]
pub struct AppState(Arc<Shared>);

impl From<Shared> for AppState {
    fn from(shared: Shared) -> Self {
        AppState(Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The parts of [`AppState`].
pub struct Shared {
    pub db: Db,
    pub tokens: Tokens,
    pub metrics: Metrics,
    pub checkout: Checkout,
    pub imports: imports::Jobs,
    /// The event feed's watcher (long-polls wait on it).
    pub feed: crate::events::feed::Feed,
    /// Other instances that own contended products' orders (`STOCKGATE_PEERS`), if any.
    pub peers: Option<peer::Peers>,
    /// The counter samples behind the overview's rates (`GET /v1/admin/overview`).
    pub rates: std::sync::Mutex<crate::rates::RateWindow>,
}

/// JSON bodies whose rejections become the contract's errors (400/413).
#[derive(FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

/// Query strings whose rejections become 400 `INVALID_QUERY`.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Query), rejection(ApiError))]
pub struct Query<T>(pub T);

/// Path parameters whose rejections become 400.
#[derive(FromRequestParts)]
#[from_request(via(axum::extract::Path), rejection(ApiError))]
pub struct Path<T>(pub T);

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let value = parts
            .headers
            .get(header::AUTHORIZATION)
            .ok_or(ApiError::Unauthorized)?;
        let text = value.to_str().map_err(|_| ApiError::Unauthorized)?;
        let token = text
            .strip_prefix("Bearer ")
            .or_else(|| text.strip_prefix("bearer "))
            .ok_or(ApiError::Unauthorized)?;
        state
            .tokens
            .verify(token.trim())
            .map_err(|_| ApiError::Unauthorized)
    }
}

/// An admin caller; a user token gets 403.
pub struct Admin;

impl FromRequestParts<AppState> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        match Caller::from_request_parts(parts, state).await? {
            Caller::Admin => Ok(Admin),
            Caller::User(_) => Err(ApiError::Forbidden("this route needs an admin token")),
        }
    }
}

/// A routed read's answer: the body's own fields plus the moment the answer describes
/// (`as_of`, `stale_by_ms`, `served_by`; also in the `X-Served-By` and `X-Stale-By-Ms` headers).
#[derive(Serialize, utoipa::ToSchema)]
pub struct Stated<T> {
    #[serde(flatten)]
    pub body: T,
    /// Every commit acknowledged before this moment is included (RFC 3339, UTC).
    #[schema(format = DateTime, example = "2026-11-29T17:00:03.123Z")]
    pub as_of: String,
    /// `now - as_of` when the answer was produced (0 or near it on the primary).
    pub stale_by_ms: u64,
    /// `primary` or the replica's name (`replica-1`, …).
    #[schema(example = "replica-1")]
    pub served_by: String,
}

/// The user a request acts for: a user token's own id, or the `user_id` an admin (or that
/// same user) names. `what` completes "an admin must name user_id to …".
pub fn acting_user(
    caller: &crate::auth::Caller,
    named: Option<&str>,
    what: &'static str,
) -> Result<crate::domain::UserId, ApiError> {
    use crate::auth::Caller;
    match (caller, named) {
        (Caller::User(me), None) => Ok(me.clone()),
        (_, Some(named)) => {
            let named = crate::domain::UserId::parse(named)?;
            if !caller.may_act_for(named.as_str()) {
                return Err(ApiError::Forbidden("a user may act only for themselves"));
            }
            Ok(named)
        }
        (Caller::Admin, None) => Err(ApiError::invalid(
            "USER_ID_REQUIRED",
            format!("an admin must name user_id to {what}"),
        )),
    }
}

/// The required `Idempotency-Key` header.
pub fn required_key(
    headers: &axum::http::HeaderMap,
) -> Result<crate::domain::IdempotencyKey, ApiError> {
    idempotency_key(headers)?.ok_or_else(|| {
        ApiError::bad_request(
            "IDEMPOTENCY_KEY_MISSING",
            "the Idempotency-Key header is required",
        )
    })
}

/// The `Idempotency-Key` header, parsed; `None` when absent.
pub fn idempotency_key(
    headers: &axum::http::HeaderMap,
) -> Result<Option<crate::domain::IdempotencyKey>, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let text = v.to_str().map_err(|_| {
        ApiError::invalid(
            "INVALID_IDEMPOTENCY_KEY",
            "Idempotency-Key must be printable ASCII",
        )
    })?;
    Ok(Some(crate::domain::IdempotencyKey::parse(text)?))
}

pub fn stated<T: Serialize>(status: StatusCode, body: T, route: &Route) -> Response {
    let response = (
        status,
        axum::Json(Stated {
            body,
            as_of: route.as_of_rfc3339(),
            stale_by_ms: route.stale_by_ms(),
            served_by: route.served_by().to_owned(),
        }),
    )
        .into_response();
    with_route_headers(response, route)
}

/// The headers of a routed answer: `X-Served-By`, `X-Stale-By-Ms`, `X-Route-Reason`.
pub fn with_route_headers(mut response: Response, route: &Route) -> Response {
    let h = response.headers_mut();
    if let Ok(v) = HeaderValue::from_str(route.served_by()) {
        h.insert(HeaderName::from_static("x-served-by"), v);
    }
    h.insert(
        HeaderName::from_static("x-stale-by-ms"),
        HeaderValue::from(route.stale_by_ms()),
    );
    h.insert(
        HeaderName::from_static("x-route-reason"),
        HeaderValue::from_static(route.reason().as_str()),
    );
    response
}

/// Request ids for the answers that need one: the client's own `X-Request-Id` is echoed
/// back, and a failure on our side (5xx) without one gets a new id, in the answer and in the
/// log line, so the two can be matched. Other answers carry none: generating and copying an
/// id for every request showed in an availability answer's profile (`bench/results/`). New ids are in UUID form
/// without a `getrandom` call each: a random prefix drawn once per process, then a counter
/// (unique within the process, and across processes but for a 2^-60 chance; an id is for
/// finding a request in the logs, not a secret).
fn next_request_id() -> HeaderValue {
    static IDS: std::sync::LazyLock<(u64, AtomicU64)> = std::sync::LazyLock::new(|| {
        let (prefix, start) = uuid::Uuid::new_v4().as_u64_pair();
        (prefix, AtomicU64::new(start >> 8))
    });
    let n = IDS.1.fetch_add(1, Ordering::Relaxed);
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&IDS.0.to_be_bytes());
    bytes[8..].copy_from_slice(&n.to_be_bytes());
    let id = uuid::Builder::from_random_bytes(bytes).into_uuid();
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    HeaderValue::from_str(id.hyphenated().encode_lower(&mut text))
        .unwrap_or_else(|_| HeaderValue::from_static("unknown"))
}

/// Largest request body accepted (the contract's 413).
pub const BODY_LIMIT: usize = 64 * 1024;

/// Every route with its OpenAPI operation: each module's `routes!()` gives both, so the
/// router and the document cannot differ. The base document (info, tags, shared components)
/// is `openapi`'s.
fn routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(openapi::base())
        .merge(products::router())
        .merge(locations::router())
        .merge(adjustments::router())
        .merge(orders::router())
        .merge(holds::router())
        .merge(users::router())
        .merge(reports::router())
        .merge(events::router())
        .merge(admin::router())
        .merge(webhooks::router())
        .merge(overview::router())
        .merge(imports::router())
        .merge(health::router())
        .merge(pages::router())
        .merge(openapi::router())
}

pub fn router(state: AppState, max_in_flight: usize, request_timeout: Duration) -> Router {
    let (api, _) = routes().split_for_parts();
    let api = api
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed);
    let metrics = state.metrics.clone();
    served(
        api,
        state,
        &metrics,
        Limits {
            max_in_flight,
            request_timeout,
            body: BODY_LIMIT,
        },
    )
}

/// What a listener's routes may take: requests at once (more are shed with 503), the time
/// one may run (then 503 `TIMEOUT`), and the largest body (413).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_in_flight: usize,
    pub request_timeout: Duration,
    pub body: usize,
}

/// `routes` with the layers every listener of this service serves behind (the public port
/// and the peer port alike): a panic is a 500 rather than a lost connection, every request
/// is counted and timed by route, and `limits` hold.
fn served<S: Clone + Send + Sync + 'static>(
    routes: Router<S>,
    state: S,
    metrics: &Metrics,
    limits: Limits,
) -> Router {
    // One `Arc` for the layers below: the stack is cloned per request, and a bare `Metrics`
    // is two dozen reference counts.
    let metrics = Arc::new(metrics.clone());
    let shed = metrics.clone();
    routes
        .layer(
            ServiceBuilder::new()
                .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
                    ApiError::Internal(anyhow::anyhow!("handler panicked")).into_response()
                }))
                .layer(RecordMetricsLayer(metrics))
                .layer(axum::error_handling::HandleErrorLayer::new(
                    move |e: BoxError| {
                        let metrics = shed.clone();
                        async move { overload_error(&metrics, e) }
                    },
                ))
                .layer(tower::load_shed::LoadShedLayer::new())
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    limits.max_in_flight,
                ))
                .layer(tower::timeout::TimeoutLayer::new(limits.request_timeout))
                .layer(DefaultBodyLimit::max(limits.body)),
        )
        .with_state(state)
}

fn overload_error(metrics: &Metrics, e: BoxError) -> Response {
    if e.is::<tower::load_shed::error::Overloaded>() {
        metrics.load_shed.inc();
        ApiError::unavailable("OVERLOADED", "the service is at capacity; retry shortly")
            .into_response()
    } else if e.is::<tower::timeout::error::Elapsed>() {
        ApiError::unavailable(
            "TIMEOUT",
            "the request took too long and its outcome may be unknown; retry with the same Idempotency-Key to learn it",
        )
        .into_response()
    } else {
        ApiError::Internal(anyhow::anyhow!("middleware error: {e}")).into_response()
    }
}

/// Counts and times every request by its route pattern; logs the ones that failed on our
/// side (5xx) with their fields and a request id; echoes a client's `X-Request-Id`; and, only
/// while `debug` is enabled for this module, logs every request (method, route, status,
/// latency). A hand-written layer rather than `from_fn` (which boxes every request's future)
/// or tower-http's trace and request-id layers (a span, a classifier and an id per request
/// cost a large share of an availability answer's CPU even with the span disabled; see
/// `bench/results/`).
#[derive(Clone)]
struct RecordMetricsLayer(Arc<Metrics>);

impl<S> tower::Layer<S> for RecordMetricsLayer {
    type Service = RecordMetrics<S>;
    fn layer(&self, inner: S) -> RecordMetrics<S> {
        RecordMetrics {
            metrics: self.0.clone(),
            inner,
        }
    }
}

#[derive(Clone)]
struct RecordMetrics<S> {
    metrics: Arc<Metrics>,
    inner: S,
}

impl<S> tower::Service<Request> for RecordMetrics<S>
where
    S: tower::Service<Request, Response = Response, Error = std::convert::Infallible>,
    S::Future: Unpin,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = Recorded<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let route = req.extensions().get::<MatchedPath>().cloned();
        Recorded {
            method: req.method().clone(),
            request_id: req.headers().get(REQUEST_ID).cloned(),
            inner: self.inner.call(req),
            metrics: self.metrics.clone(),
            route,
            start: Instant::now(),
        }
    }
}

/// The request id header, as clients and proxies name it.
const REQUEST_ID: &str = "x-request-id";

/// [`RecordMetrics`]' response future (the stack below it answers with a boxed, so
/// `Unpin`, future).
struct Recorded<F> {
    inner: F,
    metrics: Arc<Metrics>,
    route: Option<MatchedPath>,
    start: Instant,
    /// For the log line and the answer's id.
    method: axum::http::Method,
    request_id: Option<HeaderValue>,
}

impl<F> std::future::Future for Recorded<F>
where
    F: std::future::Future<Output = Result<Response, std::convert::Infallible>> + Unpin,
{
    type Output = F::Output;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.get_mut();
        let Ok(mut response) = std::task::ready!(std::pin::Pin::new(&mut this.inner).poll(cx));
        let elapsed = this.start.elapsed();
        let route = this.route.as_ref().map_or("unmatched", |p| p.as_str());
        let status = response.status();
        this.metrics
            .http_duration
            .with_label_values(&[route])
            .observe(elapsed.as_secs_f64());
        this.metrics
            .http_requests
            .with_label_values(&[route, status.as_str()])
            .inc();
        let id = match this.request_id.take() {
            None if status.is_server_error() => Some(next_request_id()),
            id => id,
        };
        let id_text = id.as_ref().and_then(|v| v.to_str().ok()).unwrap_or("");
        let latency_ms = elapsed.as_millis() as u64;
        let (method, status_code) = (&this.method, status.as_u16());
        if status.is_server_error() {
            tracing::warn!(%method, route, request_id = id_text, status = status_code, latency_ms, "request failed");
        } else {
            tracing::debug!(%method, route, request_id = id_text, status = status_code, latency_ms, "request");
        }
        if let Some(id) = id {
            response.headers_mut().insert(REQUEST_ID, id);
        }
        std::task::Poll::Ready(Ok(response))
    }
}

async fn not_found() -> ApiError {
    ApiError::not_found("NOT_FOUND", "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tower::ServiceExt;

    fn app() -> Router {
        Router::new()
            .route("/ok", get(|| async { "ok" }))
            .route("/boom", get(|| async { StatusCode::SERVICE_UNAVAILABLE }))
            .layer(RecordMetricsLayer(Arc::new(Metrics::new())))
    }

    async fn id_of(path: &str, sent: Option<&'static str>) -> Option<String> {
        let mut req = Request::builder().uri(path);
        if let Some(id) = sent {
            req = req.header(REQUEST_ID, id);
        }
        let res = app()
            .oneshot(req.body(axum::body::Body::empty()).expect("request"))
            .await
            .expect("answer");
        res.headers()
            .get(REQUEST_ID)
            .map(|v| v.to_str().expect("text").to_string())
    }

    /// Mutation seen failing: the stack without `CatchPanicLayer` (the panic reaches the
    /// caller; a server would drop the connection).
    #[tokio::test]
    async fn a_panicking_handler_behind_the_served_layers_is_a_500_not_a_lost_connection() {
        let routes: Router<()> = Router::new().route(
            "/boom",
            get(|| async {
                panic!("a handler's bug");
                #[allow(unreachable_code)]
                ""
            }),
        );
        let limits = Limits {
            max_in_flight: 4,
            request_timeout: Duration::from_secs(5),
            body: BODY_LIMIT,
        };
        let res = served(routes, (), &Metrics::new(), limits)
            .oneshot(
                Request::builder()
                    .uri("/boom")
                    .body(axum::body::Body::empty())
                    .expect("request"),
            )
            .await
            .expect("an answer");
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[tokio::test]
    async fn a_clients_request_id_comes_back_and_only_our_failures_get_a_new_one() {
        assert_eq!(id_of("/ok", Some("abc-1")).await.as_deref(), Some("abc-1"));
        assert_eq!(
            id_of("/boom", Some("abc-2")).await.as_deref(),
            Some("abc-2")
        );
        assert_eq!(id_of("/ok", None).await, None);
        let new = id_of("/boom", None).await.expect("a 5xx gets an id");
        assert!(uuid::Uuid::parse_str(&new).is_ok(), "{new}");
        assert_ne!(
            Some(new),
            id_of("/boom", None).await,
            "each failure its own id"
        );
    }
}

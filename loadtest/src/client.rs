//! HTTP client for the stockgate JSON API: one pooled connection set to one base URL,
//! typed calls, and how every answer is classified (confirmed / out of stock / error).

use crate::locations::Stock;
use crate::samples::{Allocation, AvailAnswer, Clock, FinalRead, Level, OrderOutcome};
use anyhow::{Context, Result, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use reqwest::{Client, RequestBuilder, Response, StatusCode};
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// How long to wait for the service's copies to settle (a just-created product to be
/// visible, the final stock read to cover every order). The product page may be served
/// up to 5 s stale, so this is comfortably longer.
pub const SETTLE: Duration = Duration::from_secs(10);

/// The API of one deployment. Cheap to share behind an `Arc`.
pub struct Api {
    http: Client,
    base: String,
    token: Option<String>,
    timeout: Duration,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    code: String,
    /// With 409 LIMIT_EXCEEDED: the product's `max_per_customer` and the units the user had.
    limit: Option<u32>,
    already: Option<u32>,
}

#[derive(Deserialize)]
struct OrderBody {
    quantity: u32,
    status: String,
    /// Absent from a service before locations: the order says nothing of where.
    #[serde(default)]
    allocations: Vec<Allocation>,
}

#[derive(Deserialize)]
struct AvailabilityBody {
    available: bool,
    available_quantity: i64,
    as_of: DateTime<Utc>,
    stale_by_ms: u64,
    served_by: String,
}

/// A product page, as far as the tool reads it.
#[derive(Deserialize)]
pub struct ProductBody {
    pub available_quantity: i64,
    pub as_of: DateTime<Utc>,
    pub served_by: String,
    /// Each location's count (absent from a service before locations).
    #[serde(default)]
    pub stock: Vec<Level>,
}

impl Api {
    /// A client for `base_url` keeping up to `connections` idle connections (so a run at
    /// that concurrency reuses them instead of reconnecting).
    pub fn new(
        base_url: &str,
        token: Option<String>,
        connections: usize,
        timeout: Duration,
    ) -> Result<Self> {
        let base = base_url.trim_end_matches('/').to_string();
        let url = reqwest::Url::parse(&base)
            .with_context(|| format!("--base-url {base_url:?} is not a URL"))?;
        if url.scheme() != "http" {
            bail!("--base-url must be http:// (this tool speaks plain HTTP only)");
        }
        if url.host_str().is_none() {
            bail!("--base-url {base_url:?} has no host");
        }
        let http = Client::builder()
            .pool_max_idle_per_host(connections.max(1))
            .tcp_nodelay(true)
            .connect_timeout(Duration::from_secs(5))
            .timeout(timeout)
            // Only ever the given base URL: no proxies from the environment, no redirects.
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .context("building the HTTP client")?;
        Ok(Self {
            http,
            base,
            token,
            timeout,
        })
    }

    pub fn base_url(&self) -> &str {
        &self.base
    }

    fn token(&self) -> Result<&str> {
        self.token
            .as_deref()
            .context("an admin token is required: pass --admin-token or set STOCKGATE_ADMIN_TOKEN")
    }

    /// Fails early (before any load) when the token is missing.
    pub fn require_token(&self) -> Result<()> {
        self.token().map(|_| ())
    }

    /// The timeout for a request started now that must not outlive `deadline`.
    fn bounded(&self, rb: RequestBuilder, deadline: Instant) -> RequestBuilder {
        let left = deadline.saturating_duration_since(Instant::now());
        rb.timeout(self.timeout.min(left).max(Duration::from_millis(1)))
    }

    /// GET /healthz, only to open a pooled connection; the answer is ignored.
    pub async fn touch(&self) {
        if let Ok(r) = self.http.get(format!("{}/healthz", self.base)).send().await {
            let _ = r.bytes().await;
        }
    }

    /// POST /v1/products (admin). An existing id is an error: runs need a fresh product.
    pub async fn create_product(&self, id: &str, stock: &Stock, price_cents: u32) -> Result<()> {
        self.create_limited_product(id, stock, price_cents, None)
            .await
    }

    /// POST /v1/locations (admin): a location of this run's own. An existing id is an
    /// error (ids are unique per run, so someone else's location is never reused).
    pub async fn create_location(&self, id: &str, rank: u32) -> Result<()> {
        let body = json!({"location_id": id, "name": format!("loadtest {id}"), "rank": rank});
        let r = self
            .http
            .post(format!("{}/v1/locations", self.base))
            .bearer_auth(self.token()?)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("creating location {id} at {}", self.base))?;
        let status = r.status();
        if status == StatusCode::CREATED {
            return Ok(());
        }
        let text = r.text().await.unwrap_or_default();
        bail!("creating location {id}: HTTP {status}: {text}")
    }

    /// POST /v1/products (admin), with `max_per_customer` when given; fails unless the
    /// service's answer carries that limit (a service without flash drops would ignore it,
    /// and the run would measure nothing).
    pub async fn create_limited_product(
        &self,
        id: &str,
        stock: &Stock,
        price_cents: u32,
        max_per_customer: Option<u32>,
    ) -> Result<()> {
        let mut body = json!({
            "product_id": id,
            "name": format!("loadtest {id}"),
            "price_cents": price_cents,
        });
        match stock {
            Stock::Default(n) => body["available_quantity"] = json!(n),
            Stock::At(at) => body["stock"] = json!(at),
        }
        if let Some(limit) = max_per_customer {
            body["max_per_customer"] = json!(limit);
        }
        let r = self
            .http
            .post(format!("{}/v1/products", self.base))
            .bearer_auth(self.token()?)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("creating product {id} at {}", self.base))?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if status == StatusCode::CREATED {
            let Some(limit) = max_per_customer else {
                return Ok(());
            };
            let created: Value = serde_json::from_str(&text).unwrap_or_default();
            if created.get("max_per_customer") != Some(&json!(limit)) {
                bail!(
                    "created product {id}, but the answer does not say max_per_customer {limit} \
                     (does the service support flash drops?): {text}"
                );
            }
            return Ok(());
        }
        if status == StatusCode::CONFLICT {
            bail!(
                "product {id} already exists; pick another --product-id (runs need a fresh product)"
            );
        }
        bail!("creating product {id}: HTTP {status}: {text}")
    }

    /// GET /v1/products/{id}: its stock (in all and per location), who answered, and as
    /// of when.
    pub async fn product(&self, id: &str) -> Result<ProductBody> {
        let r = self
            .http
            .get(format!("{}/v1/products/{id}", self.base))
            .send()
            .await
            .with_context(|| format!("reading product {id}"))?;
        let status = r.status();
        if status != StatusCode::OK {
            let text = r.text().await.unwrap_or_default();
            bail!("reading product {id}: HTTP {status}: {text}");
        }
        r.json()
            .await
            .with_context(|| format!("reading product {id}: unexpected body"))
    }

    /// Reads the product back after a run, retrying for up to [`SETTLE`] until the
    /// answer's `as_of` covers `covers` (the wall time of the last order answer): the
    /// product page may come from a replica that is seconds behind (or does not have the
    /// product yet), which must not be mistaken for lost or extra stock.
    pub async fn final_read(&self, id: &str, covers: DateTime<Utc>) -> Result<FinalRead> {
        let start = Instant::now();
        let mut last: Option<Result<FinalRead>> = None;
        while start.elapsed() < SETTLE {
            match self.product(id).await {
                Ok(p) => {
                    let read = FinalRead {
                        available_quantity: p.available_quantity,
                        served_by: p.served_by,
                        as_of: p.as_of.to_rfc3339_opts(SecondsFormat::Millis, true),
                        covers_all_orders: p.as_of >= covers,
                        waited_ms: start.elapsed().as_millis() as u64,
                        levels: p.stock,
                    };
                    if read.covers_all_orders {
                        return Ok(read);
                    }
                    last = Some(Ok(read));
                }
                // A non-covering read beats an error; keep the error only if it is all we have.
                Err(e) if !matches!(last, Some(Ok(_))) => last = Some(Err(e)),
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        last.unwrap_or_else(|| Err(anyhow::anyhow!("no answer")))
    }

    /// Waits (up to [`SETTLE`]) until availability answers 200 for a just-created product,
    /// so the run measures the sale and not the product's way to the replicas. Returns
    /// how long that took.
    pub async fn wait_visible(&self, id: &str, clock: &Clock) -> Result<Duration> {
        let start = Instant::now();
        let deadline = start + SETTLE;
        loop {
            match self.availability(id, 1, clock, deadline).await {
                Ok(_) => return Ok(start.elapsed()),
                Err(label) if Instant::now() >= deadline => {
                    bail!("product {id} not visible to availability after {SETTLE:?}: {label}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// GET /v1/admin/replicas (admin), as raw JSON.
    pub async fn replicas(&self) -> Result<Value> {
        let r = self
            .http
            .get(format!("{}/v1/admin/replicas", self.base))
            .bearer_auth(self.token()?)
            .send()
            .await?;
        let status = r.status();
        if status != StatusCode::OK {
            bail!("GET /v1/admin/replicas: HTTP {status}");
        }
        Ok(r.json().await?)
    }

    /// POST /v1/orders as admin on behalf of `user_id`: how it ended, and, when confirmed,
    /// where its units came from.
    pub async fn place_order(
        &self,
        product_id: &str,
        user_id: &str,
        qty: u32,
        idempotency_key: &str,
        deadline: Instant,
    ) -> (OrderOutcome, Vec<Allocation>) {
        let failed = |label: String| (OrderOutcome::Failed(label), Vec::new());
        let token = match self.token() {
            Ok(t) => t,
            Err(_) => return failed("no admin token".into()),
        };
        let rb = self
            .http
            .post(format!("{}/v1/orders", self.base))
            .bearer_auth(token)
            .header("Idempotency-Key", idempotency_key)
            .json(&json!({ "product_id": product_id, "quantity": qty, "user_id": user_id }));
        let r = match self.bounded(rb, deadline).send().await {
            Ok(r) => r,
            Err(e) => return failed(transport_label(&e)),
        };
        let status = r.status();
        let bytes = match r.bytes().await {
            Ok(b) => b,
            Err(e) => return failed(transport_label(&e)),
        };
        classify_order(status, &bytes)
    }

    /// GET /v1/products/{id}/availability?qty=N (no auth).
    pub async fn availability(
        &self,
        product_id: &str,
        qty: u32,
        clock: &Clock,
        deadline: Instant,
    ) -> Result<AvailAnswer, String> {
        let rb = self.http.get(format!(
            "{}/v1/products/{product_id}/availability?qty={qty}",
            self.base
        ));
        let r: Response = self
            .bounded(rb, deadline)
            .send()
            .await
            .map_err(|e| transport_label(&e))?;
        let status = r.status();
        let bytes = r.bytes().await.map_err(|e| transport_label(&e))?;
        if status != StatusCode::OK {
            return Err(error_label(status, &bytes));
        }
        let b: AvailabilityBody = serde_json::from_slice(&bytes)
            .map_err(|_| format!("{} unreadable body", status.as_u16()))?;
        Ok(AvailAnswer {
            available: b.available,
            available_quantity: b.available_quantity,
            as_of_us: clock.wall_us(b.as_of),
            stale_by_ms: b.stale_by_ms,
            served_by: b.served_by,
        })
    }
}

/// One answer kept raw, for modes that classify answers themselves.
pub struct Answer {
    pub status: StatusCode,
    /// The `Retry-After` header, when present (an unreadable value counts as 1 s).
    pub retry_after: Option<Duration>,
    pub body: Vec<u8>,
}

impl Api {
    /// An admin request to `path` (e.g. `/v1/holds`) with an optional Idempotency-Key and
    /// JSON body, bounded by `deadline`; `Err` is a transport label ("timeout", ...).
    pub async fn admin_call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: Option<&str>,
        body: Option<&Value>,
        deadline: Instant,
    ) -> Result<Answer, String> {
        let token = self.token().map_err(|_| "no admin token".to_string())?;
        let mut rb = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(token);
        if let Some(key) = key {
            rb = rb.header("Idempotency-Key", key);
        }
        if let Some(body) = body {
            rb = rb.json(body);
        }
        let r = self
            .bounded(rb, deadline)
            .send()
            .await
            .map_err(|e| transport_label(&e))?;
        let status = r.status();
        let retry_after = r.headers().get(reqwest::header::RETRY_AFTER).map(|v| {
            let secs = v.to_str().ok().and_then(|s| s.trim().parse::<u64>().ok());
            Duration::from_secs(secs.unwrap_or(1))
        });
        let body = r.bytes().await.map_err(|e| transport_label(&e))?.to_vec();
        Ok(Answer {
            status,
            retry_after,
            body,
        })
    }
}

/// 201 confirmed → Confirmed, with the order's `allocations`; 409 OUT_OF_STOCK →
/// OutOfStock; 409 LIMIT_EXCEEDED with its `limit` and `already` → LimitExceeded; anything
/// else → Failed. Only a confirmed order has allocations.
pub fn classify_order(status: StatusCode, body: &[u8]) -> (OrderOutcome, Vec<Allocation>) {
    if status != StatusCode::CREATED {
        return (refusal(status, body), Vec::new());
    }
    let failed = |label: String| (OrderOutcome::Failed(label), Vec::new());
    match serde_json::from_slice::<OrderBody>(body) {
        Ok(o) if o.status == "confirmed" => (
            OrderOutcome::Confirmed {
                quantity: o.quantity,
            },
            o.allocations,
        ),
        Ok(o) => failed(format!("201 status {}", o.status)),
        Err(_) => failed("201 unreadable body".into()),
    }
}

/// A non-201 answer to an order.
fn refusal(status: StatusCode, body: &[u8]) -> OrderOutcome {
    match status {
        StatusCode::CONFLICT => {
            let error = serde_json::from_slice::<ErrorBody>(body).map(|b| b.error);
            match error {
                Ok(e) if e.code == "OUT_OF_STOCK" => OrderOutcome::OutOfStock,
                Ok(e) if e.code == "LIMIT_EXCEEDED" => match (e.limit, e.already) {
                    (Some(limit), Some(already)) => OrderOutcome::LimitExceeded { limit, already },
                    _ => {
                        OrderOutcome::Failed("409 LIMIT_EXCEEDED without limit and already".into())
                    }
                },
                _ => OrderOutcome::Failed(error_label(status, body)),
            }
        }
        _ => OrderOutcome::Failed(error_label(status, body)),
    }
}

/// The `error.code` of a contract error body, if it is one.
pub fn error_code(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<ErrorBody>(body)
        .ok()
        .map(|b| b.error.code)
}

/// "503 OVERLOADED", or just "502" when the body carries no error code.
pub fn error_label(status: StatusCode, body: &[u8]) -> String {
    match error_code(body) {
        Some(code) => format!("{} {code}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

fn transport_label(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connection error".into()
    } else if e.is_body() || e.is_decode() {
        "body read error".into()
    } else {
        "transport error".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_are_classified_by_status_and_code() {
        let classify_order = |status, body: &[u8]| classify_order(status, body).0;
        let ok = br#"{"order_id":"x","product_id":"p","quantity":2,"user_id":"u","status":"confirmed","total_cents":2}"#;
        assert_eq!(
            classify_order(StatusCode::CREATED, ok),
            OrderOutcome::Confirmed { quantity: 2 }
        );
        let oos = br#"{"error":{"code":"OUT_OF_STOCK","message":"no"}}"#;
        assert_eq!(
            classify_order(StatusCode::CONFLICT, oos),
            OrderOutcome::OutOfStock
        );
        let limit = br#"{"error":{"code":"LIMIT_EXCEEDED","message":"no","product_id":"p","limit":2,"already":2}}"#;
        assert_eq!(
            classify_order(StatusCode::CONFLICT, limit),
            OrderOutcome::LimitExceeded {
                limit: 2,
                already: 2
            }
        );
        let bare = br#"{"error":{"code":"LIMIT_EXCEEDED","message":"no"}}"#;
        assert_eq!(
            classify_order(StatusCode::CONFLICT, bare),
            OrderOutcome::Failed("409 LIMIT_EXCEEDED without limit and already".into())
        );
        let early = br#"{"error":{"code":"SALE_NOT_STARTED","message":"wait"}}"#;
        assert_eq!(
            classify_order(StatusCode::CONFLICT, early),
            OrderOutcome::Failed("409 SALE_NOT_STARTED".into())
        );
        let other = br#"{"error":{"code":"IDEMPOTENCY_KEY_REUSED","message":"no"}}"#;
        assert_eq!(
            classify_order(StatusCode::CONFLICT, other),
            OrderOutcome::Failed("409 IDEMPOTENCY_KEY_REUSED".into())
        );
        let shed = br#"{"error":{"code":"OVERLOADED","message":"busy"}}"#;
        assert_eq!(
            classify_order(StatusCode::SERVICE_UNAVAILABLE, shed),
            OrderOutcome::Failed("503 OVERLOADED".into())
        );
        assert_eq!(
            classify_order(StatusCode::BAD_GATEWAY, b"<html>"),
            OrderOutcome::Failed("502".into())
        );
        assert_eq!(
            classify_order(StatusCode::CREATED, b"{}"),
            OrderOutcome::Failed("201 unreadable body".into())
        );
    }

    #[test]
    fn a_confirmed_order_says_where_its_units_came_from() {
        let split = br#"{"order_id":"x","product_id":"p","quantity":3,"status":"confirmed","allocations":[{"product_id":"p","location_id":"a","quantity":2},{"product_id":"p","location_id":"b","quantity":1}]}"#;
        let (outcome, at) = classify_order(StatusCode::CREATED, split);
        assert_eq!(outcome, OrderOutcome::Confirmed { quantity: 3 });
        let at: Vec<_> = at
            .iter()
            .map(|a| (a.location_id.as_str(), a.quantity))
            .collect();
        assert_eq!(at, [("a", 2), ("b", 1)]);
        // A refusal takes nothing from anywhere.
        let oos = br#"{"error":{"code":"OUT_OF_STOCK","message":"no"}}"#;
        assert!(classify_order(StatusCode::CONFLICT, oos).1.is_empty());
    }

    #[test]
    fn only_plain_http_base_urls() {
        let t = Duration::from_secs(1);
        assert!(Api::new("http://127.0.0.1:8080/", None, 4, t).is_ok());
        assert!(Api::new("https://127.0.0.1:8080", None, 4, t).is_err());
        assert!(Api::new("not a url", None, 4, t).is_err());
    }
}

//! Webhooks: each gets every event of its types, in feed order, signed, at least once
//! (contract, "Webhooks"). This file owns the `webhooks` table: what a webhook is (its input
//! parsed at the boundary), how a delivery is signed, and the statements of the admin routes.
//! [`delivery`] is the worker that sends the events; `docs/design/webhooks.md` tells the whole
//! story.

mod delivery;
mod lost;
mod snapshot;

pub use delivery::{DeliveryGuard, LEASE_IDLE_TIMEOUT, backoff, start};
pub use snapshot::CreationSnapshot;

use super::{Cursor, TYPES};
use crate::domain::Invalid;
use crate::routing::{Db, DbError};
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;
use uuid::Uuid;

/// Where events are sent: an absolute `http` or `https` URL with a host, at most 2048 bytes,
/// without control characters. The URL parser would quietly drop a tab or a newline and
/// percent-encode a NUL, but the text kept is the one given, and PostgreSQL's `text` cannot
/// hold a NUL: every control character is refused here, before anything is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl(String);

impl WebhookUrl {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let refuse = |why: &str| Invalid {
            code: "INVALID_URL",
            message: format!("url must be an absolute http:// or https:// URL ({why})"),
        };
        if s.len() > 2048 {
            return Err(refuse("at most 2048 bytes"));
        }
        if s.chars().any(char::is_control) {
            return Err(refuse("it holds a control character"));
        }
        let url = url::Url::parse(s).map_err(|e| refuse(&e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(refuse("the scheme is neither http nor https"));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(refuse("it has no host"));
        }
        Ok(WebhookUrl(s.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The key of a webhook's signatures: 16–256 bytes (of its UTF-8), without NUL (PostgreSQL's
/// `text` cannot hold one). Any other byte is the receiver's business: the HMAC takes them all.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        let refuse = |message: &str| Invalid {
            code: "INVALID_SECRET",
            message: message.into(),
        };
        if !(16..=256).contains(&s.len()) {
            return Err(refuse("secret must be 16 to 256 bytes long"));
        }
        if s.contains('\0') {
            return Err(refuse("secret must not contain a NUL character"));
        }
        Ok(Secret(s.to_string()))
    }
}

/// Never printed: a secret in a log line is a leaked secret.
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(…)")
    }
}

/// The event types a webhook receives: at least one, each one of [`TYPES`], each once (in the
/// order first given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTypes(Vec<String>);

impl EventTypes {
    pub fn parse(types: &[String]) -> Result<Self, Invalid> {
        let refuse = |message: String| Invalid {
            code: "INVALID_TYPES",
            message,
        };
        if types.is_empty() {
            return Err(refuse(format!(
                "types must name at least one of {}",
                TYPES.join(", ")
            )));
        }
        let mut kept: Vec<String> = Vec::new();
        for t in types {
            if !TYPES.contains(&t.as_str()) {
                return Err(refuse(format!(
                    "unknown event type {t:?}; the types are {}",
                    TYPES.join(", ")
                )));
            }
            if !kept.contains(t) {
                kept.push(t.clone());
            }
        }
        Ok(EventTypes(kept))
    }
}

/// A webhook to register, its input checked.
#[derive(Debug)]
pub struct NewWebhook {
    pub url: WebhookUrl,
    pub secret: Secret,
    pub types: EventTypes,
}

/// The `Stockgate-Signature` header of a delivery of `body` at unix second `t`:
/// `t=<t>,v1=<hex HMAC-SHA256 of "<t>.<body>" with the secret>`. Signing the time with the
/// body lets a receiver refuse a replayed delivery by its age.
pub fn signature(secret: &[u8], t: i64, body: &[u8]) -> String {
    // HMAC takes a key of any length; `new_from_slice` cannot fail for it.
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else {
        unreachable!("HMAC accepts keys of every length")
    };
    mac.update(t.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    let digest = mac.finalize().into_bytes();
    format!("t={t},v1={}", hex::encode(digest))
}

/// A webhook as registered (`POST`'s answer).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct Webhook {
    pub webhook_id: Uuid,
    #[schema(example = "https://fulfilment.example/hooks/stockgate")]
    pub url: String,
    #[schema(example = json!(["order.confirmed", "order.cancelled"]))]
    pub types: Vec<String>,
    /// The last event delivered; at creation, the newest event then: delivery continues
    /// after it.
    #[schema(value_type = String, example = "2f8-1a")]
    pub delivered_cursor: Cursor,
}

/// A webhook and how its delivery goes (`GET`'s answer).
#[derive(Debug, Clone, Serialize, utoipa::ToSchema)]
pub struct WebhookStatus {
    #[serde(flatten)]
    pub webhook: Webhook,
    /// Failed attempts at the next event since the last delivery (0 when all is well); the
    /// retry backoff grows with it. Every failure ever is counted by the
    /// `stockgate_webhook_delivery_failures_total` metric.
    pub failures: i32,
    /// The most recent failure's reason (kept after a later success); null if none. Also says
    /// when events were purged before they could be delivered (see `lost_events`).
    pub last_error: Option<String>,
    /// Events of its types that were purged past `STOCKGATE_EVENT_RETENTION` before they were
    /// delivered (a receiver failing for that long): never sent, counted when delivery reaches
    /// them. 0 when none was.
    pub lost_events: i64,
}

/// The columns of a [`WebhookStatus`], for [`status_of`].
macro_rules! status_columns {
    () => {
        "webhook_id, url, types, delivered_xid::text::int8 AS delivered_xid, delivered_n, \
         failures, last_error, lost_events"
    };
}

fn status_of(row: &sqlx::postgres::PgRow) -> Result<WebhookStatus, sqlx::Error> {
    use sqlx::Row;
    Ok(WebhookStatus {
        webhook: Webhook {
            webhook_id: row.try_get("webhook_id")?,
            url: row.try_get("url")?,
            types: row.try_get("types")?,
            delivered_cursor: Cursor {
                xid: u64::try_from(row.try_get::<i64, _>("delivered_xid")?).unwrap_or(0),
                n: row.try_get("delivered_n")?,
            },
        },
        failures: row.try_get("failures")?,
        last_error: row.try_get("last_error")?,
        lost_events: row.try_get("lost_events")?,
    })
}

/// Registers a webhook that gets exactly the events committed after its creation.
///
/// It starts after the newest event a feed read could serve ([`super::feed::newest`]: the
/// newest whose transaction is below the snapshot's `xmin`, or before every event when there
/// is none): every transaction below that horizon has ended, so an event committed later comes
/// after the cursor, and none is skipped. Events above the horizon that were already committed
/// (an older transaction held it back) come after the cursor too, so the same snapshot is
/// stored with the webhook, and delivery skips the events whose transaction it saw end
/// ([`CreationSnapshot`]). One REPEATABLE READ transaction makes the cursor and the stored
/// snapshot the same snapshot.
pub async fn create(db: &Db, new: &NewWebhook) -> Result<Webhook, DbError> {
    let mut tx = db.primary().begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await?;
    let start = super::feed::newest(&mut *tx).await?;
    let row = sqlx::query(concat!(
        "INSERT INTO webhooks (webhook_id, url, secret, types, delivered_xid, delivered_n, \
                               created_snapshot) \
         VALUES ($1, $2, $3, $4, $5::text::xid8, $6, pg_current_snapshot()) RETURNING ",
        status_columns!()
    ))
    .bind(Uuid::now_v7())
    .bind(new.url.as_str())
    .bind(&new.secret.0)
    .bind(&new.types.0)
    .bind(start.xid.to_string())
    .bind(start.n)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(status_of(&row)?.webhook)
}

/// A webhook not deleted, on the primary (its cursor as of its last delivery).
pub async fn get(db: &Db, id: Uuid) -> Result<Option<WebhookStatus>, DbError> {
    let row = sqlx::query(concat!(
        "SELECT ",
        status_columns!(),
        " FROM webhooks WHERE webhook_id = $1 AND deleted_at IS NULL"
    ))
    .bind(id)
    .fetch_optional(db.primary().pool()?)
    .await?;
    Ok(row.as_ref().map(status_of).transpose()?)
}

/// Every webhook not deleted, oldest first.
pub async fn list(db: &Db) -> Result<Vec<WebhookStatus>, DbError> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        status_columns!(),
        " FROM webhooks WHERE deleted_at IS NULL ORDER BY created_at, webhook_id"
    ))
    .fetch_all(db.primary().pool()?)
    .await?;
    Ok(rows.iter().map(status_of).collect::<Result<_, _>>()?)
}

/// Deletes a webhook (`None`: there was none): its deliverer lets it go within a tick, and an
/// attempt in flight is abandoned.
pub async fn delete(db: &Db, id: Uuid) -> Result<Option<WebhookStatus>, DbError> {
    let row = sqlx::query(concat!(
        "UPDATE webhooks SET deleted_at = now() WHERE webhook_id = $1 AND deleted_at IS NULL \
         RETURNING ",
        status_columns!()
    ))
    .bind(id)
    .fetch_optional(db.primary().pool()?)
    .await?;
    Ok(row.as_ref().map(status_of).transpose()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_absolute_http_urls_with_a_host_are_webhook_urls() {
        for good in [
            "http://127.0.0.1:8080/hook",
            "https://fulfilment.example/hooks?x=1",
            "HTTP://example.com",
        ] {
            assert!(WebhookUrl::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "example.com/hook",
            "ftp://example.com/hook",
            "file:///etc/passwd",
            "mailto:ops@example.com",
            "http://",
            "javascript:alert(1)",
            &format!("http://example.com/{}", "a".repeat(2048)),
            // Control characters anywhere: the parser would encode or drop them, the text
            // kept would still hold them.
            "http://example.com/ho\0ok",
            "http://example.com/hook?x=\0",
            "http://example.com/hook\n",
            "\thttp://example.com/hook",
            "http://example.com/\u{7f}",
            "http://example.com/\u{85}",
        ] {
            let e = WebhookUrl::parse(bad).expect_err(bad);
            assert_eq!(e.code, "INVALID_URL", "{bad}");
        }
    }

    #[test]
    fn a_secret_is_16_to_256_bytes_counted_in_bytes() {
        assert!(Secret::parse(&"s".repeat(16)).is_ok());
        assert!(Secret::parse(&"s".repeat(256)).is_ok());
        // Eight two-byte characters: 16 bytes.
        assert!(Secret::parse(&"é".repeat(8)).is_ok());
        // Other control characters are bytes like any other; a NUL is not storable.
        assert!(Secret::parse(&format!("\t{}\n", "s".repeat(14))).is_ok());
        for bad in [
            "".to_string(),
            "s".repeat(15),
            "s".repeat(257),
            format!("\0{}", "s".repeat(20)),
            format!("{}\0{}", "s".repeat(10), "s".repeat(10)),
            format!("{}\0", "s".repeat(20)),
        ] {
            assert_eq!(
                Secret::parse(&bad).expect_err("refused").code,
                "INVALID_SECRET",
                "{bad:?}"
            );
        }
        assert_eq!(
            format!("{:?}", Secret::parse(&"x".repeat(20))),
            "Ok(Secret(…))"
        );
    }

    #[test]
    fn types_are_known_nonempty_and_kept_once_in_order() {
        let t = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            EventTypes::parse(&t(&["hold.created", "order.confirmed", "hold.created"])),
            Ok(EventTypes(t(&["hold.created", "order.confirmed"])))
        );
        for bad in [t(&[]), t(&["order.shipped"]), t(&["order.confirmed", ""])] {
            assert_eq!(
                EventTypes::parse(&bad).expect_err("bad").code,
                "INVALID_TYPES"
            );
        }
    }

    #[test]
    fn the_signature_is_hmac_sha256_of_time_dot_body() {
        // The header against the MAC of "<t>.<body>" computed in one piece.
        let sig = signature(b"Jefe", 1_700_000_000, b"{\"a\":1}");
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").expect("key");
        mac.update(b"1700000000.{\"a\":1}");
        let want = hex::encode(mac.finalize().into_bytes());
        assert_eq!(sig, format!("t=1700000000,v1={want}"));
        // And the primitive itself against RFC 4231 (test case 2).
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").expect("key");
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        assert_ne!(
            signature(b"Jefe", 1_700_000_001, b"{\"a\":1}"),
            sig,
            "the time is signed"
        );
    }
}

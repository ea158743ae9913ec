//! Events purged past retention before their webhook was sent them: counted and said on the
//! webhook (`lost_events`, `last_error`), never skipped in silence.
//!
//! Only the purge knows the types of what it deletes, so a trigger on `events` notes, for each
//! live webhook, the purged positions of its types after its delivered cursor then
//! (`webhook_purged`, migration `20261204000010`). That is a superset of what is lost: the
//! deliverer reads events ahead, and still sends from memory what it read before the purge.
//! So the deliverer settles it whenever it reads a page with nothing left in memory:
//! everything up to where it read has been sent (or skipped as older than the webhook), and the
//! page holds what is still there, so a noted position beyond that point and not in the page
//! was purged before it was read and will never be sent.

use crate::events::{Cursor, Event};
use sqlx::PgConnection;
use uuid::Uuid;

/// Takes `id`'s noted purges; counts as lost those after `read_to` that `page` (just read
/// after `read_to`) does not hold, and records them on the webhook.
pub(super) async fn reconcile(
    conn: &mut PgConnection,
    id: Uuid,
    read_to: Cursor,
    page: &[Event],
) -> Result<(), sqlx::Error> {
    let (xids, ns): (Vec<i64>, Vec<i64>) = page
        .iter()
        .map(|e| (i64::try_from(e.cursor.xid).unwrap_or(i64::MAX), e.cursor.n))
        .unzip();
    let lost: Option<(i64, i64, i64, i64, i64)> = sqlx::query_as(
        "WITH noted AS (DELETE FROM webhook_purged WHERE webhook_id = $1 RETURNING xid, positions), \
              lost AS (SELECT nd.xid::text::int8 AS xid, p.pos \
                       FROM noted nd CROSS JOIN LATERAL unnest(nd.positions) AS p(pos) \
                       WHERE (nd.xid, p.pos) > ($2::text::xid8, $3) \
                         AND (nd.xid::text::int8, p.pos) NOT IN \
                             (SELECT x, n FROM unnest($4::int8[], $5::int8[]) AS page(x, n))) \
         SELECT (SELECT count(*) FROM lost)::int8, f.xid, f.pos, l.xid, l.pos \
         FROM (SELECT xid, pos FROM lost ORDER BY xid, pos LIMIT 1) f, \
              (SELECT xid, pos FROM lost ORDER BY xid DESC, pos DESC LIMIT 1) l",
    )
    .bind(id)
    .bind(read_to.xid.to_string())
    .bind(read_to.n)
    .bind(&xids)
    .bind(&ns)
    .fetch_optional(&mut *conn)
    .await?;
    let Some((count, first_xid, first_n, last_xid, last_n)) = lost else {
        return Ok(());
    };
    let cursor = |xid: i64, n| Cursor {
        xid: u64::try_from(xid).unwrap_or(0),
        n,
    };
    let (first, last) = (cursor(first_xid, first_n), cursor(last_xid, last_n));
    let why = format!(
        "{count} event(s) of its types, {first} to {last}, were purged past the event retention \
         before they were delivered; they will not be sent"
    );
    tracing::warn!(webhook = %id, lost = count, %first, %last, "webhook events purged before delivery");
    sqlx::query(
        "UPDATE webhooks SET lost_events = lost_events + $2, last_error = $3 \
         WHERE webhook_id = $1 AND deleted_at IS NULL",
    )
    .bind(id)
    .bind(count)
    .bind(why)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

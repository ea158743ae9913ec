//! What a database failure was, classified once from the driver's error; answered once, in
//! `http::error`.

use super::policy::QueryClass;
use std::sync::Arc;

/// A database failure, said as what happened. Classified once, here, from the driver's
/// error; answered once, in `http::error`. Cheap to clone: a batch that shared a failure
/// gives each of its requests the same one.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DbError {
    /// No place can answer. Nothing was done.
    #[error("database unavailable: {0}")]
    Unavailable(Unavailable),
    /// The database answered, but not in time. Nothing was done.
    #[error("database busy: {0}")]
    Busy(Busy),
    /// A concurrent transaction won (deadlock or serialization failure): nothing was done,
    /// and running the same transaction again is safe.
    #[error("a concurrent change won: {0}")]
    Conflict(Arc<sqlx::Error>),
    /// The class refuses to read the primary and no replica is fresh enough.
    #[error("no replica is fresh enough for {0}")]
    NoFreshReplica(QueryClass),
    /// Something that should not happen did.
    #[error("internal: {0}")]
    Internal(Internal),
    /// The database refused the statement for a reason of its own (a row-level rule, or a
    /// bug in the query): the caller may know what it means ([`DbError::sqlstate`]).
    #[error(transparent)]
    Query(Arc<sqlx::Error>),
}

/// Why no place can answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unavailable {
    /// Patroni mode, between a leader's loss and its successor.
    #[error("the cluster has no leader")]
    NoLeader,
    /// The monitor saw the primary refuse connections, or not answer for longer than a
    /// request would wait: requests fail fast instead of queueing.
    #[error("the primary is not answering")]
    PrimaryDown,
    /// 25006 read_only_sql_transaction: a write met a node in recovery (a leader demoted
    /// under an open connection). Nothing was written; the next leader will.
    #[error("a write met a node in recovery: {0}")]
    ReadOnlyNode(Arc<sqlx::Error>),
    /// The server is not answering: refused, reset, shut down, or a pool that timed out
    /// without every connection open (it could not reach the server).
    #[error("{0}")]
    Connection(Arc<sqlx::Error>),
}

/// Why the database did not answer in time.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Busy {
    /// Every connection of our pool to the primary was open and in use.
    #[error("every connection to the primary is in use")]
    PoolFull,
    /// 55P03 lock_not_available (our `lock_timeout`).
    #[error("{0}")]
    LockTimeout(Arc<sqlx::Error>),
    /// 57014 query_canceled (our `statement_timeout`).
    #[error("{0}")]
    StatementTimeout(Arc<sqlx::Error>),
    /// 53300 too_many_connections.
    #[error("{0}")]
    TooManyConnections(Arc<sqlx::Error>),
}

/// What should not happen.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Internal {
    /// A background worker this request needed could not be started or has stopped.
    #[error("the {0} stopped")]
    WorkerGone(&'static str),
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> Self {
        let code = match &e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        };
        let e = Arc::new(e);
        match code.as_deref() {
            Some("40001" | "40P01") => DbError::Conflict(e),
            Some("55P03") => DbError::Busy(Busy::LockTimeout(e)),
            Some("57014") => DbError::Busy(Busy::StatementTimeout(e)),
            Some("53300") => DbError::Busy(Busy::TooManyConnections(e)),
            Some("25006") => DbError::Unavailable(Unavailable::ReadOnlyNode(e)),
            _ if is_connection_error(&e) => DbError::Unavailable(Unavailable::Connection(e)),
            _ => DbError::Query(e),
        }
    }
}

impl DbError {
    /// The SQLSTATE the database answered with, if it refused the statement.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            DbError::Query(e) => match e.as_ref() {
                sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Errors that say "this server is not answering", as opposed to "this query is wrong".
pub fn is_connection_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_) => true,
        sqlx::Error::Database(db) => {
            // 57P01 admin shutdown, 57P03 cannot connect now, 53300 too many connections,
            // 08xxx connection exceptions.
            db.code().is_some_and(|c| {
                c.starts_with("08") || c == "57P01" || c == "57P02" || c == "57P03" || c == "53300"
            })
        }
        _ => false,
    }
}

/// A pool's error as a [`DbError`]: a pool timeout with every connection open and in use is
/// saturation (`Busy`), not an unreachable primary.
pub(super) fn saturated_or(pool: &sqlx::PgPool, e: sqlx::Error) -> DbError {
    match e {
        sqlx::Error::PoolTimedOut if pool.size() >= pool.options().get_max_connections() => {
            DbError::Busy(Busy::PoolFull)
        }
        e => e.into(),
    }
}

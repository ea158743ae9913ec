//! Logging: `tracing` with fields, filtered by `RUST_LOG`.

use tracing_subscriber::EnvFilter;

/// Installs the subscriber once. The service logs at `info`; one-shot commands only warn,
/// and not of their own slow statements: `verify`'s one scan of every stock table is slow by
/// design, and a warning mid-report (on a terminal, over its progress line) says nothing.
pub fn init(service: bool) {
    let default = if service {
        "info,sqlx=warn,tower_http=info"
    } else {
        "warn,sqlx::query=error"
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

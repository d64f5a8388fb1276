//! The process's shutdown signal: SIGTERM (systemd, Kubernetes) or SIGINT (Ctrl-C).

use tokio::signal::unix::{SignalKind, signal};

/// Resolves on the first SIGTERM or SIGINT.
pub async fn signal_received() {
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}

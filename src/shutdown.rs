//! The process's shutdown signal: SIGTERM (systemd, Kubernetes) or SIGINT (Ctrl-C).

use std::future::Future;

use tokio::signal::unix::{SignalKind, signal};

/// Installs the SIGTERM and SIGINT handlers at once, and returns a future that resolves on the
/// first of them. A signal that arrives before the future is first polled is kept, not lost, and
/// never kills the process with the default action (a Ctrl-C in the demo's first second is a
/// clean stop like any other). Call it inside the runtime, at the start of a command.
pub(crate) fn signal_received() -> impl Future<Output = ()> {
    let mut term = signal(SignalKind::terminate()).expect("installing a SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing a SIGINT handler");
    async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
    }
}

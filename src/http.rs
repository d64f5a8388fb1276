//! The node's HTTP endpoints on `http_listen`: `/healthz` (the process and its lease loop run:
//! 503 once the loop has finished no cycle for a lease),
//! `/readyz` (the node holds a confirmed lease cycle; 503 at once while its gate is closed) and
//! `/metrics` (Prometheus text). No endpoint touches the database; all are read-only.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::metrics::Metrics;
use crate::node_state::{NodeState, Phase};

#[derive(Clone)]
struct Ctx {
    state: watch::Receiver<NodeState>,
    metrics: Arc<Metrics>,
}

/// Serves until `cancel` fires.
pub(crate) async fn serve(
    listener: TcpListener,
    state: watch::Receiver<NodeState>,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let app = Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(Ctx { state, metrics });
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move { cancel.cancelled().await })
        .await;
}

async fn healthz(State(ctx): State<Ctx>) -> impl IntoResponse {
    let unhealthy = ctx.state.borrow().unhealthy(tokio::time::Instant::now());
    match unhealthy {
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("unhealthy: {why}\n"),
        ),
        None => (StatusCode::OK, "ok\n".to_string()),
    }
}

async fn readyz(State(ctx): State<Ctx>) -> impl IntoResponse {
    let state = ctx.state.borrow().clone();
    if state.trusted() && state.phase == Phase::Running {
        (StatusCode::OK, "ready\n".to_string())
    } else {
        let why = match state.phase {
            Phase::Running => "gate closed: no confirmed lease cycle".to_string(),
            other => format!("{other:?}"),
        };
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {why}\n"),
        )
    }
}

async fn metrics_text(State(ctx): State<Ctx>) -> impl IntoResponse {
    let body = ctx.metrics.render(&ctx.state.borrow());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
}

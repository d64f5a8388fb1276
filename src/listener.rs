//! The node's LISTEN connection for release announcements (instant handoff, SPEC L2).
//!
//! Peers announce released accounts on [`db::RELEASED_CHANNEL`]; an announcement from another
//! node of this node's platform wakes the lease loop to claim at once. After any
//! reconnect the loop is woken too, since announcements may have been missed meanwhile (the
//! next regular cycle would catch them anyway: announcements only make handoff faster).

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::db;

/// Runs until `cancel` fires. Uses `listen_database_url`'s options: a pooler in transaction
/// mode breaks LISTEN, so this connection must be direct.
pub async fn run(
    options: PgConnectOptions,
    platform: String,
    node_id: String,
    wake: Arc<Notify>,
    cancel: CancellationToken,
) {
    let mut delay = Duration::from_millis(200);
    while !cancel.is_cancelled() {
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options.clone());
        let mut listener = match connect(&pool).await {
            Ok(l) => l,
            Err(e) => {
                warn!(error = %db::describe(&e), retry_in_ms = delay.as_millis() as u64, "LISTEN connection failed; handoffs wait for the next cycle until it is back");
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = cancel.cancelled() => return,
                }
                delay = (delay * 2).min(Duration::from_secs(10));
                continue;
            }
        };
        delay = Duration::from_millis(200);
        info!(
            channel = db::RELEASED_CHANNEL,
            "listening for release announcements"
        );
        wake.notify_one();
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                received = listener.try_recv() => match received {
                    Ok(Some(n)) => {
                        let (from_platform, from_node) = db::parse_announcement(n.payload());
                        if from_platform == platform && from_node != node_id {
                            debug!(from_node, "release announced");
                            wake.notify_one();
                        }
                    }
                    Ok(None) => {
                        warn!("LISTEN connection lost; reconnecting");
                        wake.notify_one();
                    }
                    Err(e) => {
                        warn!(error = %db::describe(&e), "LISTEN connection failed; reconnecting");
                        break;
                    }
                }
            }
        }
    }
}

async fn connect(pool: &sqlx::PgPool) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(db::RELEASED_CHANNEL).await?;
    Ok(listener)
}

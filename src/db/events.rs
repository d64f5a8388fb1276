//! The statements of the node's event hub ([`crate::hub`]): the NOTIFY queue's fill (a metric),
//! and without LISTEN the polls that stand in for notifications.

use std::collections::HashMap;

use sqlx::{PgConnection, PgExecutor, Row};

/// How full the server's NOTIFY queue is (0 to 1): read on the hub's LISTEN connection.
pub async fn notify_queue_usage(conn: impl PgExecutor<'_>) -> Result<f64, sqlx::Error> {
    sqlx::query_scalar("SELECT pg_notification_queue_usage()")
        .fetch_one(conn)
        .await
}

/// How many enabled accounts of `platform` no node owns: a rise stands in for a release
/// announcement when events are polled.
pub async fn free_accounts(conn: &mut PgConnection, platform: &str) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT count(*) FROM trading_accounts WHERE platform = $1 AND enabled AND node_id IS NULL",
    )
    .bind(platform)
    .fetch_one(conn)
    .await
}

/// The published (epoch, seq) of `masters` (absent: never published): a change stands in for a
/// master's event notice when events are polled.
pub async fn published_seqs(
    conn: &mut PgConnection,
    masters: &[i64],
) -> Result<HashMap<i64, (i64, i64)>, sqlx::Error> {
    if masters.is_empty() {
        return Ok(HashMap::new());
    }
    let rows =
        sqlx::query("SELECT master_id, epoch, seq FROM master_state WHERE master_id = ANY($1)")
            .bind(masters)
            .fetch_all(conn)
            .await?;
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("master_id")?,
                (r.try_get("epoch")?, r.try_get("seq")?),
            ))
        })
        .collect()
}

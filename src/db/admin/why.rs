//! What `copier-node why` reads about one follower and one master ticket: the follower's links,
//! the decisions recorded for the ticket, the master's published state, the copy ledger and
//! (FIX followers) the order ledger.

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// A recorded decision not to copy (yet, or for good), as `why` shows it. Keys are the
/// `copy_skips` columns'.
#[derive(Debug, Serialize)]
pub struct Decision {
    pub code: Option<String>,
    pub reason: String,
    #[serde(rename = "final")]
    pub is_final: bool,
    pub decided_at: String,
    pub node_id: Option<String>,
}

/// An order of the FIX ledger carrying the ticket's marker.
#[derive(Debug, Serialize)]
pub struct LedgerOrder {
    pub cl_ord_id: String,
    pub kind: String,
    pub state: String,
    pub position_id: Option<i64>,
}

/// Account `id`'s role, if it exists.
pub async fn role(conn: &mut PgConnection, id: i64) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT role FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// The follower's links: (id, master, enabled), by id.
pub async fn links(
    conn: &mut PgConnection,
    follower: i64,
) -> Result<Vec<(i64, i64, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, master_id, enabled FROM copy_links WHERE follower_id = $1 ORDER BY id",
    )
    .bind(follower)
    .fetch_all(conn)
    .await
}

/// The follower's FIX orders carrying `marker`, oldest first.
pub async fn fix_orders(
    conn: &mut PgConnection,
    follower: i64,
    marker: &str,
) -> Result<Vec<LedgerOrder>, sqlx::Error> {
    let rows: Vec<(String, String, String, Option<i64>)> = sqlx::query_as(
        "SELECT cl_ord_id, kind, state, position_id FROM fix_orders
          WHERE account_id = $1 AND comment = $2 ORDER BY sent_at",
    )
    .bind(follower)
    .bind(marker)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(cl_ord_id, kind, state, position_id)| LedgerOrder {
            cl_ord_id,
            kind,
            state,
            position_id,
        })
        .collect())
}

/// The ticket the master publishes the position under that its broker now calls `broker`: MT4
/// renumbers a position at every partial close, and the master session keeps publishing it
/// under the ticket it opened under, with the broker's ticket beside it.
pub async fn published_as(
    conn: &mut PgConnection,
    master: i64,
    broker: i64,
) -> Result<Option<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT (p ->> 'ticket')::bigint FROM master_state m, jsonb_array_elements(m.positions) p
          WHERE m.master_id = $1 AND (p ->> 'broker_ticket')::bigint = $2",
    )
    .bind(master)
    .bind(broker)
    .fetch_optional(conn)
    .await
}

/// Whether the master's last published state holds the position `ticket`.
pub async fn published(
    conn: &mut PgConnection,
    master: i64,
    ticket: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM master_state m, jsonb_array_elements(m.positions) p
                         WHERE m.master_id = $1 AND (p ->> 'ticket')::bigint = $2)",
    )
    .bind(master)
    .bind(ticket)
    .fetch_one(conn)
    .await
}

/// The decisions recorded for (link, master ticket), oldest first.
pub async fn decisions(
    conn: &mut PgConnection,
    link: i64,
    ticket: i64,
) -> Result<Vec<Decision>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT code, reason, final, decided_at::text AS decided_at, node_id FROM copy_skips
          WHERE link_id = $1 AND master_ticket = $2 ORDER BY decided_at",
    )
    .bind(link)
    .bind(ticket)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Decision {
                code: r.try_get("code")?,
                reason: r.try_get("reason")?,
                is_final: r.try_get("final")?,
                decided_at: r.try_get("decided_at")?,
                node_id: r.try_get("node_id")?,
            })
        })
        .collect()
}

/// The copies the copy ledger holds of (link, master ticket) on the follower: their tickets,
/// oldest first.
pub async fn copied(
    conn: &mut PgConnection,
    follower: i64,
    link: i64,
    ticket: i64,
) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT follower_ticket FROM copy_ledger
          WHERE follower_id = $1 AND link_id = $2 AND master_ticket = $3 ORDER BY recorded_at",
    )
    .bind(follower)
    .bind(link)
    .bind(ticket)
    .fetch_all(conn)
    .await
}

//! The statements of `copier-node status`: one consistent snapshot of the membership and the
//! account rows.

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// A node's membership row and what it owns.
#[derive(Debug, Clone, Serialize)]
pub struct NodeRow {
    pub node_id: String,
    pub instance_id: String,
    pub platform: String,
    pub capacity: i32,
    pub live: bool,
    /// Live and renewing within its trust window (not gated): counts for fair shares.
    pub trusted: bool,
    pub started_at_ms: i64,
    pub renewed_at_ms: i64,
    pub lease_until_ms: i64,
    /// Negative once expired.
    pub expires_in_ms: i64,
    /// Accounts it owns under a live lease.
    pub accounts: i64,
    /// The nearest expiry among those accounts' leases.
    pub nearest_lease_expiry_ms: Option<i64>,
}

/// One account's ownership and status.
#[derive(Debug, Clone, Serialize)]
pub struct AccountRow {
    pub id: i64,
    pub platform: String,
    pub role: String,
    pub enabled: bool,
    /// The owner while its lease is live; `null` otherwise.
    pub owner: Option<String>,
    pub owner_epoch: i64,
    pub lease_until_ms: Option<i64>,
    pub status: Option<String>,
    pub status_at_ms: Option<i64>,
    pub balance: Option<f64>,
    pub equity: Option<f64>,
}

/// The database's clock (Unix ms), every membership row and every account row, read in one
/// repeatable-read transaction.
pub async fn snapshot(
    conn: &mut PgConnection,
) -> Result<(i64, Vec<NodeRow>, Vec<AccountRow>), sqlx::Error> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
        .execute(&mut *tx)
        .await?;
    let now_ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM now()) * 1000)::bigint")
        .fetch_one(&mut *tx)
        .await?;
    let node_rows = sqlx::query(
        "SELECT n.node_id, n.instance_id, n.platform, n.capacity, n.lease_until >= now() AS live,
                n.lease_until >= now() AND coalesce(n.trust_until >= now(), false) AS trusted,
                (extract(epoch FROM n.started_at) * 1000)::bigint AS started_at_ms,
                (extract(epoch FROM n.renewed_at) * 1000)::bigint AS renewed_at_ms,
                (extract(epoch FROM n.lease_until) * 1000)::bigint AS lease_until_ms,
                (extract(epoch FROM n.lease_until - now()) * 1000)::bigint AS expires_in_ms,
                (SELECT count(*) FROM trading_accounts a WHERE a.node_id = n.node_id AND a.lease_until >= now()) AS accounts,
                (SELECT (extract(epoch FROM min(a.lease_until)) * 1000)::bigint FROM trading_accounts a
                  WHERE a.node_id = n.node_id AND a.lease_until >= now()) AS nearest
           FROM nodes n ORDER BY n.platform, n.node_id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let nodes = node_rows
        .iter()
        .map(|r| {
            Ok(NodeRow {
                node_id: r.try_get("node_id")?,
                instance_id: r.try_get("instance_id")?,
                platform: r.try_get("platform")?,
                capacity: r.try_get("capacity")?,
                live: r.try_get("live")?,
                trusted: r.try_get("trusted")?,
                started_at_ms: r.try_get("started_at_ms")?,
                renewed_at_ms: r.try_get("renewed_at_ms")?,
                lease_until_ms: r.try_get("lease_until_ms")?,
                expires_in_ms: r.try_get("expires_in_ms")?,
                accounts: r.try_get("accounts")?,
                nearest_lease_expiry_ms: r.try_get("nearest")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    let account_rows = sqlx::query(
        "SELECT id, platform, role, enabled, CASE WHEN lease_until >= now() THEN node_id END AS owner, owner_epoch,
                (extract(epoch FROM lease_until) * 1000)::bigint AS lease_until_ms, status,
                (extract(epoch FROM status_at) * 1000)::bigint AS status_at_ms, balance, equity
           FROM trading_accounts ORDER BY id",
    )
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let accounts = account_rows
        .iter()
        .map(|r| {
            Ok(AccountRow {
                id: r.try_get("id")?,
                platform: r.try_get("platform")?,
                role: r.try_get("role")?,
                enabled: r.try_get("enabled")?,
                owner: r.try_get("owner")?,
                owner_epoch: r.try_get("owner_epoch")?,
                lease_until_ms: r.try_get("lease_until_ms")?,
                status: r.try_get("status")?,
                status_at_ms: r.try_get("status_at_ms")?,
                balance: r.try_get("balance")?,
                equity: r.try_get("equity")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?;
    Ok((now_ms, nodes, accounts))
}

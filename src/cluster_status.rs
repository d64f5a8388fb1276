//! `copier-node status`: the cluster as the database sees it. Needs only the database URL.

use std::fmt::Write as _;

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// A node's membership row and what it owns.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct NodeRow {
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
pub(crate) struct AccountRow {
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

/// The whole picture.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct ClusterStatus {
    /// The database's clock when this was read (Unix ms).
    pub now_ms: i64,
    pub nodes: Vec<NodeRow>,
    pub accounts: Vec<AccountRow>,
    /// Enabled accounts without a live owner.
    pub unowned: Vec<i64>,
    pub disabled: Vec<i64>,
    /// Owned accounts whose session reports an error (status `error: ...`): bad credentials, a
    /// refused login, a malformed row. Their status says why.
    pub errors: Vec<i64>,
}

/// Reads the cluster's state in one snapshot (one transaction, repeatable read).
pub(crate) async fn read(conn: &mut PgConnection) -> Result<ClusterStatus, sqlx::Error> {
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
    let unowned = accounts
        .iter()
        .filter(|a| a.enabled && a.owner.is_none())
        .map(|a| a.id)
        .collect();
    let disabled = accounts
        .iter()
        .filter(|a| !a.enabled)
        .map(|a| a.id)
        .collect();
    let errors = accounts
        .iter()
        .filter(|a| {
            a.owner.is_some() && a.status.as_deref().is_some_and(|s| s.starts_with("error:"))
        })
        .map(|a| a.id)
        .collect();
    Ok(ClusterStatus {
        now_ms,
        nodes,
        accounts,
        unowned,
        disabled,
        errors,
    })
}

/// Most account rows the text form lists (`--json` has them all).
const TEXT_ACCOUNTS: usize = 500;

/// The text form for people.
pub(crate) fn render_text(s: &ClusterStatus) -> String {
    let mut out = String::new();
    let live = s.nodes.iter().filter(|n| n.live).count();
    let _ = writeln!(out, "nodes: {live} live, {} expired", s.nodes.len() - live);
    if !s.nodes.is_empty() {
        let _ = writeln!(
            out,
            "  {:<24} {:<8} {:<5} {:>8} {:>8} {:>14} {:>16}  instance",
            "node", "platform", "live", "accounts", "capacity", "membership", "nearest lease"
        );
        for n in &s.nodes {
            let nearest = n
                .nearest_lease_expiry_ms
                .map(|t| secs(t - s.now_ms))
                .unwrap_or_else(|| "-".into());
            let _ = writeln!(
                out,
                "  {:<24} {:<8} {:<5} {:>8} {:>8} {:>14} {:>16}  {}",
                n.node_id,
                n.platform,
                match (n.live, n.trusted) {
                    (true, true) => "yes",
                    (true, false) => "gated",
                    _ => "no",
                },
                n.accounts,
                n.capacity,
                secs(n.expires_in_ms),
                nearest,
                n.instance_id
            );
        }
    }
    let owned = s.accounts.iter().filter(|a| a.owner.is_some()).count();
    let _ = writeln!(
        out,
        "accounts: {} ({owned} owned, {} unowned, {} disabled)",
        s.accounts.len(),
        s.unowned.len(),
        s.disabled.len()
    );
    if !s.unowned.is_empty() {
        let _ = writeln!(out, "  unowned: {}", ids(&s.unowned));
    }
    if !s.disabled.is_empty() {
        let _ = writeln!(out, "  disabled: {}", ids(&s.disabled));
    }
    if !s.errors.is_empty() {
        let _ = writeln!(out, "  in error (see their status): {}", ids(&s.errors));
    }
    let _ = writeln!(
        out,
        "  {:>10} {:<8} {:<8} {:<24} {:>12} {:>10}  status",
        "id", "role", "platform", "owner", "epoch", "lease"
    );
    for a in s.accounts.iter().take(TEXT_ACCOUNTS) {
        let lease = match (a.lease_until_ms, &a.owner) {
            (Some(t), Some(_)) => secs(t - s.now_ms),
            _ => "-".into(),
        };
        let _ = writeln!(
            out,
            "  {:>10} {:<8} {:<8} {:<24} {:>12} {:>10}  {}",
            a.id,
            a.role,
            a.platform,
            a.owner
                .as_deref()
                .unwrap_or(if a.enabled { "(unowned)" } else { "(disabled)" }),
            a.owner_epoch,
            lease,
            a.status.as_deref().unwrap_or("")
        );
    }
    if s.accounts.len() > TEXT_ACCOUNTS {
        let _ = writeln!(
            out,
            "  ... {} more (use --json for all)",
            s.accounts.len() - TEXT_ACCOUNTS
        );
    }
    out
}

fn secs(ms: i64) -> String {
    format!("{:.1}s", ms as f64 / 1000.0)
}

fn ids(list: &[i64]) -> String {
    let shown: Vec<String> = list.iter().take(50).map(i64::to_string).collect();
    let mut s = shown.join(", ");
    if list.len() > 50 {
        s.push_str(&format!(", ... ({} in all)", list.len()));
    }
    s
}

//! `copier-node status`: the cluster as the database sees it. Needs only the database URL.

use std::fmt::Write as _;

use serde::Serialize;
use sqlx::PgConnection;

pub(crate) use crate::db::cluster::{AccountRow, NodeRow};

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
    /// The database's WAL timeline (`null` where a client cannot read it).
    pub database_timeline: Option<i64>,
    /// Whether commits wait for a synchronous standby (the server's defaults).
    pub database_synchronous: bool,
    /// When a lease cycle last saw the database fail over (Unix ms; `null`: never).
    pub database_failed_over_ms: Option<i64>,
    /// How long claims still wait after that failover (the grace), in ms; 0 outside it.
    pub database_grace_ms: i64,
}

/// Reads the cluster's state in one snapshot (one transaction, repeatable read).
pub(crate) async fn read(conn: &mut PgConnection) -> Result<ClusterStatus, sqlx::Error> {
    let (now_ms, nodes, accounts) = crate::db::cluster::snapshot(conn).await?;
    let replication = crate::db::replication::read(conn).await?;
    let failover = crate::db::replication::failover(conn).await?;
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
        database_timeline: replication.timeline,
        database_synchronous: replication.synchronous,
        database_failed_over_ms: failover.seen_ms,
        database_grace_ms: failover.grace_ms,
    })
}

/// Most account rows the text form lists (`--json` has them all).
const TEXT_ACCOUNTS: usize = 500;

/// The text form for people.
pub(crate) fn render_text(s: &ClusterStatus) -> String {
    let mut out = String::new();
    let failover = match (s.database_failed_over_ms, s.database_grace_ms) {
        (Some(at), g) if g > 0 => format!(
            "; failed over {} ago: no claims for {} more (grace)",
            secs(s.now_ms - at),
            secs(g)
        ),
        (Some(at), _) => format!("; last failover seen {} ago", secs(s.now_ms - at)),
        (None, _) => String::new(),
    };
    let _ = writeln!(
        out,
        "database: timeline {}; {}{failover}",
        s.database_timeline
            .map(|t| t.to_string())
            .unwrap_or_else(|| "unknown".into()),
        if s.database_synchronous {
            "commits wait for a synchronous standby"
        } else {
            "commits do not wait for a standby (a failover may lose the last ones)"
        }
    );
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

//! What the database promises about a committed write: its WAL timeline (a promoted standby
//! starts a new one, so a node that sees the timeline change knows a failover happened and that
//! writes the old primary acknowledged may be gone) and whether commits wait for a standby.

use sqlx::PgConnection;

/// The server's replication promise, as a client can read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replication {
    /// The current WAL timeline; `None` where the server does not let a client read it (some
    /// managed services), or on a standby.
    pub timeline: Option<i64>,
    /// True when this connection's commits wait for a synchronous standby
    /// (`synchronous_standby_names` set and `synchronous_commit` at least `on`).
    pub synchronous: bool,
}

/// Reads the promise on `conn` (the node's own settings apply: its connections commit with
/// `synchronous_commit = on`).
pub async fn read(conn: &mut PgConnection) -> Result<Replication, sqlx::Error> {
    let (names, commit): (String, String) = sqlx::query_as(
        "SELECT current_setting('synchronous_standby_names'), current_setting('synchronous_commit')",
    )
    .fetch_one(&mut *conn)
    .await?;
    let walfile: Option<String> =
        sqlx::query_scalar("SELECT pg_walfile_name(pg_current_wal_lsn())")
            .fetch_one(&mut *conn)
            .await
            .ok();
    Ok(Replication {
        timeline: walfile.as_deref().and_then(timeline_of),
        synchronous: commits_wait(&names, &commit),
    })
}

/// The last database failover the cycles saw, as `copier_database` records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Failover {
    /// When a cycle first saw it (database clock, Unix ms); `None` if none was ever seen.
    pub seen_ms: Option<i64>,
    /// How long claims still wait (the grace), in ms; 0 outside a grace.
    pub grace_ms: i64,
}

/// Reads the last failover the cycles saw.
pub async fn failover(conn: &mut PgConnection) -> Result<Failover, sqlx::Error> {
    let row: Option<(Option<i64>, i64)> = sqlx::query_as(
        "SELECT (extract(epoch FROM failed_over_at) * 1000)::bigint,
                greatest(coalesce(ceil(extract(epoch FROM claims_after - now()) * 1000), 0), 0)::bigint
           FROM copier_database",
    )
    .fetch_optional(conn)
    .await?;
    Ok(row
        .map(|(seen_ms, grace_ms)| Failover { seen_ms, grace_ms })
        .unwrap_or_default())
}

/// The timeline a WAL file name starts with (eight hex digits).
pub fn timeline_of(walfile: &str) -> Option<i64> {
    i64::from_str_radix(walfile.get(..8)?, 16).ok()
}

/// Whether a commit waits for a standby under these two settings.
pub fn commits_wait(synchronous_standby_names: &str, synchronous_commit: &str) -> bool {
    !synchronous_standby_names.trim().is_empty()
        && matches!(synchronous_commit, "on" | "remote_write" | "remote_apply")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timelines_and_commit_waits_are_read_as_postgresql_defines_them() {
        assert_eq!(timeline_of("000000010000000000000003"), Some(1));
        assert_eq!(timeline_of("0000000A0000000000000003"), Some(10));
        assert_eq!(timeline_of("xyz"), None);
        assert!(
            !commits_wait("", "on"),
            "no standby named: nothing to wait for"
        );
        assert!(commits_wait("FIRST 1 (pg2)", "on"));
        assert!(commits_wait("*", "remote_apply"));
        assert!(!commits_wait("*", "local"));
        assert!(!commits_wait("*", "off"));
    }
}

//! Embedded migrations (`migrations/*.sql`, compiled into the binary) and the check `run` makes
//! before it starts: refuse pending migrations, tolerate newer ones a later binary applied.
//!
//! sqlx's migrator takes a PostgreSQL advisory lock while it applies, so `copier-node migrate`
//! is safe to run from many replicas at once.

use std::borrow::Cow;
use std::collections::HashMap;

use sqlx::migrate::{Migration, MigrationType, Migrator};
use sqlx::{PgConnection, Row};

/// Every migration, in order: (version, description, SQL). A test checks this list against the
/// files in `migrations/`, so a new file cannot be forgotten here.
pub const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "lease core",
        include_str!("../../migrations/0001_lease_core.sql"),
    ),
    (
        2,
        "copy engine",
        include_str!("../../migrations/0002_copy_engine.sql"),
    ),
    (
        3,
        "fair share",
        include_str!("../../migrations/0003_fair_share.sql"),
    ),
    (
        4,
        "copy protections",
        include_str!("../../migrations/0004_copy_protections.sql"),
    ),
    (
        5,
        "link change notices",
        include_str!("../../migrations/0005_link_change_notices.sql"),
    ),
    (
        6,
        "copy decisions",
        include_str!("../../migrations/0006_copy_decisions.sql"),
    ),
    (
        7,
        "failover grace",
        include_str!("../../migrations/0007_failover_grace.sql"),
    ),
    (
        8,
        "fix ledger",
        include_str!("../../migrations/0008_fix_ledger.sql"),
    ),
    (
        9,
        "copy ledger",
        include_str!("../../migrations/0009_copy_ledger.sql"),
    ),
    (
        10,
        "copy sizes and stops",
        include_str!("../../migrations/0010_copy_sizes_and_stops.sql"),
    ),
    (
        11,
        "currencies, points and limits",
        include_str!("../../migrations/0011_currencies_points_limits.sql"),
    ),
    (
        12,
        "link removal",
        include_str!("../../migrations/0012_link_removal.sql"),
    ),
    (
        13,
        "risk limits",
        include_str!("../../migrations/0013_risk_limits.sql"),
    ),
    (
        14,
        "pending orders",
        include_str!("../../migrations/0014_pending_orders.sql"),
    ),
    (
        15,
        "fix entry orders",
        include_str!("../../migrations/0015_fix_entry_orders.sql"),
    ),
    (
        16,
        "fix opened volume",
        include_str!("../../migrations/0016_fix_opened_volume.sql"),
    ),
    (
        17,
        "node starting",
        include_str!("../../migrations/0017_node_starting.sql"),
    ),
    (
        18,
        "skip codes",
        include_str!("../../migrations/0018_skip_codes.sql"),
    ),
    (
        19,
        "copy opened volume",
        include_str!("../../migrations/0019_copy_opened_volume.sql"),
    ),
    (
        20,
        "copy legs us",
        include_str!("../../migrations/0020_copy_legs_us.sql"),
    ),
];

/// The migrator over the embedded migrations. Applied versions this binary does not know
/// (a newer binary's additive migrations during a rolling upgrade) are tolerated.
pub fn migrator() -> Migrator {
    let migrations = MIGRATIONS
        .iter()
        .map(|(version, description, sql)| {
            Migration::new(
                *version,
                Cow::Borrowed(*description),
                MigrationType::Simple,
                Cow::Borrowed(*sql),
                false,
            )
        })
        .collect::<Vec<_>>();
    let mut migrator = Migrator {
        migrations: Cow::Owned(migrations),
        ..Migrator::DEFAULT
    };
    migrator.set_ignore_missing(true);
    migrator
}

/// How the database's schema compares with this binary's migrations.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SchemaState {
    /// Known migrations not applied yet: `run` refuses to start.
    pub pending: Vec<(i64, String)>,
    /// Applied migrations this binary does not know (a newer binary ran): a warning.
    pub unknown: Vec<i64>,
    /// Applied migrations whose SQL differs from this binary's: refused (someone edited one).
    pub modified: Vec<i64>,
    /// A migration that failed half-way: refused until an operator repairs it.
    pub dirty: Option<i64>,
}

impl SchemaState {
    /// A one-line explanation of why `run` must not start, if it must not.
    pub fn refusal(&self) -> Option<String> {
        if let Some(v) = self.dirty {
            return Some(format!(
                "migration {v} failed part-way (marked unsuccessful in _sqlx_migrations); repair the schema by hand, then rerun `copier-node migrate`"
            ));
        }
        if !self.modified.is_empty() {
            return Some(format!(
                "applied migrations {:?} differ from this binary's (an applied migration was edited); refusing to run against a schema it does not know",
                self.modified
            ));
        }
        if !self.pending.is_empty() {
            let list = self
                .pending
                .iter()
                .map(|(v, d)| format!("{v} ({d})"))
                .collect::<Vec<_>>()
                .join(", ");
            return Some(format!(
                "the database has pending migrations: {list}; run `copier-node migrate` first, or start with `copier-node run --migrate`"
            ));
        }
        None
    }
}

/// Reads `_sqlx_migrations` and compares it with [`MIGRATIONS`].
pub async fn schema_state(conn: &mut PgConnection) -> Result<SchemaState, sqlx::Error> {
    let exists: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    let mut applied = HashMap::new();
    let mut state = SchemaState::default();
    if exists {
        let rows =
            sqlx::query("SELECT version, checksum, success FROM _sqlx_migrations ORDER BY version")
                .fetch_all(&mut *conn)
                .await?;
        for row in rows {
            let version: i64 = row.get("version");
            let checksum: Vec<u8> = row.get("checksum");
            let success: bool = row.get("success");
            if !success {
                state.dirty = Some(version);
            }
            applied.insert(version, checksum);
        }
    }
    let migrator = migrator();
    for m in migrator.iter() {
        match applied.remove(&m.version) {
            None => state.pending.push((m.version, m.description.to_string())),
            Some(sum) if sum != *m.checksum => state.modified.push(m.version),
            Some(_) => {}
        }
    }
    state.unknown = applied.into_keys().collect();
    state.unknown.sort_unstable();
    Ok(state)
}

/// Advisory lock key serialising `copier-node migrate` runs, so each reports exactly what it
/// applied (sqlx's own migration lock is taken inside, per database).
const MIGRATE_LOCK: i64 = 0x636f_7069_6572; // "copier"

/// Applies pending migrations; returns the versions this call applied. Concurrent callers wait
/// for each other; the later ones find nothing pending.
pub async fn apply(conn: &mut PgConnection) -> Result<Vec<i64>, sqlx::migrate::MigrateError> {
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATE_LOCK)
        .execute(&mut *conn)
        .await?;
    let result = async {
        let before = schema_state(conn).await?;
        migrator().run_direct(&mut *conn).await?;
        Ok(before.pending.into_iter().map(|(v, _)| v).collect())
    }
    .await;
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATE_LOCK)
        .execute(&mut *conn)
        .await?;
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_embedded_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(
            files.len(),
            MIGRATIONS.len(),
            "migrations/ and MIGRATIONS disagree: {files:?}"
        );
        for (file, (version, _, sql)) in files.iter().zip(MIGRATIONS) {
            let number: i64 = file.split('_').next().unwrap().parse().unwrap();
            assert_eq!(number, *version, "{file}");
            let on_disk = std::fs::read_to_string(format!("{dir}/{file}")).unwrap();
            assert_eq!(&on_disk, sql, "{file} is not the embedded text");
        }
    }
}

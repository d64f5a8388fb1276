//! Every statement of the lease core: the cycle, releases, and leaving the cluster.
//!
//! The cycle is one autocommit statement, so one round trip: it renews the node's membership,
//! renews (or re-claims with a new epoch) the rows the node owns, claims free rows and rows of
//! dead nodes up to its free capacity, and reads back what it now owns. Data-modifying CTEs all
//! see one snapshot and run to completion, so every step is gated on the membership upsert having
//! matched (`EXISTS (SELECT FROM member)`): a process whose node id another live instance holds
//! changes nothing at all (guarantee S4, docs/guarantees.md).

use std::time::Duration;

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use crate::channels::RELEASED as RELEASED_CHANNEL;

/// What the cycle needs to know about the node.
#[derive(Debug, Clone)]
pub struct CycleParams<'a> {
    pub node_id: &'a str,
    pub instance_id: &'a str,
    pub platform: &'a str,
    /// The node's capacity (published in its membership).
    pub capacity: u32,
    /// The most accounts the node may own after this cycle: its capacity, or its fair share
    /// when that is lower.
    pub claim_limit: u32,
    /// `lease - fence`: how long the node trusts a renewal; `trust_until` tells the others.
    pub trust: Duration,
    /// Accounts the node runs sessions for (published for the others' shares).
    pub owned: u32,
    /// Sessions still starting (published: peers hand nothing to a node still starting).
    pub starting: u32,
    pub lease: Duration,
    /// Epochs the node holds and may renew as they are. Any other row with `node_id = me`
    /// (left by an earlier instance, or expired) is re-claimed with a new epoch instead (R1).
    pub held: &'a [i64],
    /// False while shutting down: renew, claim nothing.
    pub claim: bool,
    /// Epochs whose gates have been open without a break up to this cycle: during a grace after
    /// a database failover these, and only these, are kept (renewed as they are).
    pub kept: &'a [i64],
}

/// One row the node owns after the cycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnedRow {
    pub id: i64,
    pub epoch: i64,
    /// Enabled and on this node's platform; false means: stop its task and release it.
    pub wanted: bool,
    /// When this owner claimed it (database clock, Unix ms): rebalancing moves the oldest first.
    pub claimed_ms: i64,
}

/// Another node of the platform, as its membership row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    pub node_id: String,
    /// Until its membership (and every lease it holds) expires; zero once expired.
    pub expires_in: Duration,
    /// Its membership lease is live.
    pub live: bool,
    /// Live and not gated (it renewed within its trust window): counts for fair shares.
    pub trusted: bool,
    pub capacity: u32,
    pub owned: u32,
    /// Its sessions still starting, as of its last cycle.
    pub starting: u32,
}

/// The live membership of another instance holding this node's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conflict {
    pub instance_id: String,
    pub expires_in: Duration,
}

/// What one cycle did.
#[derive(Debug, Clone, Default)]
pub struct CycleOutcome {
    /// The membership upsert matched: this instance holds the node id.
    pub member: bool,
    pub owned: Vec<OwnedRow>,
    pub conflict: Option<Conflict>,
    pub peers: Vec<Peer>,
    /// What the cycle saw of the database itself.
    pub database: DatabaseView,
    /// Claimable rows of the platform: free ones and those still naming a node whose membership
    /// expired. The latter count here because nobody else counts them: a node that died right
    /// after a claim published its `owned` from before it, and the fair shares must still add
    /// up to every account, or the last of its rows sits unclaimed under shares that are all met.
    pub free: u64,
}

/// The database as one cycle saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DatabaseView {
    /// The server's WAL timeline (`None` where a client cannot read it).
    pub timeline: Option<i64>,
    /// This cycle was the first to see a new timeline or a new system identifier: the database
    /// failed over (or is another cluster, a dump restored), and the grace starts now.
    pub failed_over: bool,
    /// How long claims still wait (zero outside a grace).
    pub grace: Duration,
    /// The epoch sequence's new start, when this cycle moved it into a new era.
    pub era_start: Option<i64>,
}

/// The cycle statement. Indexes it relies on (see `migrations/0001_lease_core.sql`):
/// `nodes_pkey` for the membership upsert; `trading_accounts_node_idx` for renewal and for the
/// rows of dead nodes (a lateral lookup per expired `nodes` row, so the plan is driven by the
/// handful of dead nodes and never by an ordered walk of the table: `lease_until` is in no
/// index); `trading_accounts_free_idx` (on the generated `free_platform`) for free rows; the
/// primary key for the claim's update. The test `at_a_million_rows_the_cycle_is_index_driven...`
/// checks the custom and the generic plan. The held epochs are matched through
/// `IN (SELECT unnest($6))`, a hashed subplan: `= ANY ($6)` is a linear search per row in the
/// generic plan a prepared statement settles on, which made a node holding 10,000 accounts
/// spend 0.8 s per cycle (BENCHMARKS.md measures it).
/// Claims take the lowest ids first, free rows and dead nodes' rows alike (a dead node's rows are
/// sorted by id inside its lateral lookup: deterministic, so the simulator's model and the
/// differential test can hold it to exactly one answer).
/// The renewal updates the rows `mine` locked, matched by id alone: the lock keeps them this
/// node's at this epoch until the statement ends, so repeating `node_id = $1` there added no
/// check, only an access path. With statistics taken while every row was free (autovacuum
/// analysing a table just filled, before any node claimed), the planner counts one row for
/// `node_id = $1` and took that path, re-reading `mine` for every renewed row: quadratic until
/// the next analyse (the test `with_statistics_taken_while_every_row_was_free...`).
/// `FOR UPDATE SKIP LOCKED` sits inside the claim subqueries, and the claim's outer `UPDATE`
/// repeats the predicate, so a row changed since the snapshot is re-checked on its latest
/// version before it is taken.
///
/// Parameters: $1 node id, $2 instance id, $3 platform, $4 capacity (int4), $5 lease in
/// milliseconds (int8), $6 held epochs (int8[]), $7 whether to claim (bool), $8 claim limit
/// (int4: capacity, or the fair share when lower), $9 `lease - fence` in milliseconds (int8),
/// $10 accounts owned (int4), $11 epochs kept through a grace (int8[]), $12 sessions still
/// starting (int4).
///
/// The first CTEs watch the database itself (see `migrations/0007_failover_grace.sql`): a new
/// timeline or system identifier starts a grace of the longest lease plus a second (the longest of
/// this node's, the members' the database knows, and the longest any node ever recorded in
/// `copier_database.max_lease_ms`: a member whose longer lease was on the lost tail is not
/// among the members), during which
/// the cycle renews only the rows of $11 (keeping their epochs, even where the new primary shows
/// them expired: nobody else can be granted them meanwhile) and claims nothing. The same cycle
/// moves the epoch sequence into a new era, so no epoch of a lost tail is handed out again.
pub const CYCLE_SQL: &str = r#"
WITH db AS (
    SELECT copier_timeline() AS timeline, copier_system_id() AS system_id
),
known AS (
    SELECT c.timeline, c.system_id, c.era_offset, c.claims_after, c.max_lease_ms,
           coalesce(db.timeline <> c.timeline OR db.system_id <> c.system_id, false) AS changed
      FROM db LEFT JOIN LATERAL (SELECT * FROM copier_database LIMIT 1) c ON true
),
span AS (
    SELECT greatest($5, coalesce(k.max_lease_ms, 0),
                    coalesce((SELECT max(extract(epoch FROM n.lease_until - n.renewed_at) * 1000)
                                FROM nodes n), 0))::bigint + 1000 AS ms
      FROM known k
),
grace AS (
    SELECT CASE WHEN k.changed THEN span.ms
                WHEN k.claims_after > now()
                THEN ceil(extract(epoch FROM k.claims_after - now()) * 1000)::bigint
                ELSE 0 END AS ms
      FROM known k, span
),
next_era AS (
    SELECT greatest(coalesce(db.timeline, k.timeline, 0) + k.era_offset,
                    coalesce(k.timeline, 0) + k.era_offset + 1,
                    (coalesce(pg_sequence_last_value('owner_epoch_seq'), 0) >> 40) + 1)::bigint AS era
      FROM db, known k
),
noted AS (
    UPDATE copier_database c
       SET timeline       = coalesce(db.timeline, c.timeline),
           system_id      = coalesce(db.system_id, c.system_id),
           era_offset     = CASE WHEN k.changed THEN e.era - coalesce(db.timeline, c.timeline, 0)
                                 ELSE c.era_offset END,
           claims_after   = CASE WHEN k.changed THEN now() + make_interval(secs => span.ms / 1000.0)
                                 ELSE c.claims_after END,
           failed_over_at = CASE WHEN k.changed THEN now() ELSE c.failed_over_at END,
           max_lease_ms   = greatest(c.max_lease_ms, $5)
      FROM db, known k, span, next_era e
     WHERE (db.timeline IS NOT NULL AND db.timeline IS DISTINCT FROM c.timeline)
        OR (db.system_id IS NOT NULL AND db.system_id IS DISTINCT FROM c.system_id)
        OR c.max_lease_ms IS NULL OR c.max_lease_ms < $5
    RETURNING k.changed, e.era
),
era AS (
    SELECT setval('owner_epoch_seq', noted.era << 40) AS next
      FROM noted
     WHERE noted.changed
),
member AS (
    INSERT INTO nodes AS n (node_id, instance_id, platform, capacity, lease_until, started_at, renewed_at, trust_until, owned, starting)
    VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5 / 1000.0), now(), now(),
            now() + make_interval(secs => $9 / 1000.0), $10, $12)
    ON CONFLICT (node_id) DO UPDATE
       SET instance_id = excluded.instance_id,
           platform    = excluded.platform,
           capacity    = excluded.capacity,
           lease_until = excluded.lease_until,
           renewed_at  = excluded.renewed_at,
           trust_until = excluded.trust_until,
           owned       = excluded.owned,
           starting    = excluded.starting,
           started_at  = CASE WHEN n.instance_id = excluded.instance_id
                              THEN n.started_at ELSE excluded.started_at END
     WHERE n.instance_id = excluded.instance_id OR n.lease_until < now()
    RETURNING n.node_id
),
mine AS (
    SELECT a.id FROM trading_accounts a, grace g
     WHERE a.node_id = $1
       AND EXISTS (SELECT FROM member)
       AND (g.ms = 0 OR a.owner_epoch IN (SELECT unnest($11::bigint[])))
     ORDER BY a.id
       FOR NO KEY UPDATE OF a
),
renewed AS (
    UPDATE trading_accounts a
       SET lease_until = now() + make_interval(secs => $5 / 1000.0),
           owner_epoch = CASE WHEN g.ms > 0
                                OR (a.owner_epoch IN (SELECT unnest($6::bigint[])) AND a.lease_until >= now())
                              THEN a.owner_epoch ELSE nextval('owner_epoch_seq') END,
           claimed_at  = CASE WHEN g.ms > 0
                                OR (a.owner_epoch IN (SELECT unnest($6::bigint[])) AND a.lease_until >= now())
                              THEN a.claimed_at ELSE now() END
      FROM grace g, mine m
     WHERE a.id = m.id
    RETURNING a.id, a.owner_epoch, a.enabled AND a.platform = $3 AS wanted,
              (extract(epoch FROM a.claimed_at) * 1000)::bigint AS claimed_ms
),
room AS (
    SELECT CASE WHEN (SELECT ms FROM grace) > 0 THEN 0
                ELSE greatest($8 - count(*) FILTER (WHERE wanted), 0) END AS n
      FROM renewed
),
free AS (
    SELECT f.id FROM trading_accounts f
     WHERE f.free_platform = $3
       AND $7 AND EXISTS (SELECT FROM member)
     ORDER BY f.id
     LIMIT (SELECT n FROM room)
       FOR UPDATE SKIP LOCKED
),
dead AS (
    SELECT x.id FROM nodes d
     CROSS JOIN LATERAL (
        SELECT a.id FROM trading_accounts a
         WHERE a.node_id = d.node_id AND a.platform = $3 AND a.enabled AND a.lease_until < now()
         ORDER BY a.id
         LIMIT (SELECT n FROM room)
           FOR UPDATE OF a SKIP LOCKED) x
     WHERE d.lease_until < now() AND d.node_id <> $1
       AND $7 AND EXISTS (SELECT FROM member)
     ORDER BY x.id
     LIMIT (SELECT n FROM room)
),
claimed AS (
    UPDATE trading_accounts a
       SET node_id     = $1,
           lease_until = now() + make_interval(secs => $5 / 1000.0),
           owner_epoch = nextval('owner_epoch_seq'),
           claimed_at  = now()
      FROM (SELECT id FROM free UNION SELECT id FROM dead
             ORDER BY id LIMIT (SELECT n FROM room)) c
     WHERE a.id = c.id AND a.platform = $3 AND a.enabled
       AND (a.node_id IS NULL OR (a.node_id <> $1 AND a.lease_until < now()))
    RETURNING a.id, a.owner_epoch, (extract(epoch FROM a.claimed_at) * 1000)::bigint AS claimed_ms
)
SELECT 'own' AS kind, id, owner_epoch, wanted, NULL::text AS name, claimed_ms AS ms,
       NULL::int AS capacity, NULL::int AS owned, NULL::boolean AS trusted FROM renewed
UNION ALL
SELECT 'own', id, owner_epoch, true, NULL, claimed_ms, NULL, NULL, NULL FROM claimed
UNION ALL
SELECT 'member', NULL, NULL, NULL, node_id, NULL, NULL, NULL, NULL FROM member
UNION ALL
SELECT 'conflict', NULL, NULL, NULL, c.instance_id,
       greatest((extract(epoch FROM c.lease_until - now()) * 1000)::bigint, 0), NULL, NULL, NULL
  FROM nodes c WHERE c.node_id = $1 AND NOT EXISTS (SELECT FROM member)
UNION ALL
SELECT 'peer', p.starting::bigint, NULL, p.lease_until >= now(), p.node_id,
       greatest((extract(epoch FROM p.lease_until - now()) * 1000)::bigint, 0),
       p.capacity, p.owned, p.lease_until >= now() AND coalesce(p.trust_until >= now(), false)
  FROM nodes p WHERE p.platform = $3 AND p.node_id <> $1
UNION ALL
SELECT 'free', NULL, NULL, NULL, NULL,
       (SELECT count(*) FROM trading_accounts f WHERE f.free_platform = $3)
     + (SELECT count(*) FROM nodes d JOIN trading_accounts a ON a.node_id = d.node_id
         WHERE d.lease_until < now() AND d.node_id <> $1 AND a.platform = $3 AND a.enabled),
       NULL, NULL, NULL
UNION ALL
SELECT 'database', db.timeline, (SELECT next FROM era), k.changed, NULL, g.ms, NULL, NULL, NULL
  FROM db, known k, grace g
"#;

/// Runs one lease cycle. The caller reads its monotonic `t0` before calling and trusts what
/// this returns only until `t0 + lease - fence`, and only once this has returned (COMMIT
/// acknowledged: the statement runs in autocommit).
pub async fn cycle(
    conn: &mut PgConnection,
    p: &CycleParams<'_>,
) -> Result<CycleOutcome, sqlx::Error> {
    let rows = sqlx::query(CYCLE_SQL)
        .bind(p.node_id)
        .bind(p.instance_id)
        .bind(p.platform)
        .bind(i32::try_from(p.capacity).unwrap_or(i32::MAX))
        .bind(i64::try_from(p.lease.as_millis()).unwrap_or(i64::MAX))
        .bind(p.held)
        .bind(p.claim)
        .bind(i32::try_from(p.claim_limit).unwrap_or(i32::MAX))
        .bind(i64::try_from(p.trust.as_millis()).unwrap_or(i64::MAX))
        .bind(i32::try_from(p.owned).unwrap_or(i32::MAX))
        .bind(p.kept)
        .bind(i32::try_from(p.starting).unwrap_or(i32::MAX))
        .fetch_all(conn)
        .await?;
    outcome(rows)
}

/// Runs one lease cycle as [`cycle`] does, behind a transaction pooler (`session.pooler` is
/// [`super::Pooler::Transaction`]): one simple-protocol message holding the bounds as
/// `SET LOCAL` and the cycle statement with its parameters written in as literals
/// ([`cycle_sql_with_literals`]). A message of several statements is one implicit transaction on
/// whichever server the pooler chose, so this is one round trip, as the cycle is straight to
/// PostgreSQL, where the extended protocol of a unit of work ([`super::run_on`]) takes four
/// (`BEGIN`, parse, execute, `COMMIT`); nor does it leave a named statement behind. Anywhere else
/// it is [`cycle`], a cached prepared statement, unchanged.
pub async fn cycle_on(
    conn: &mut PgConnection,
    session: &super::Session,
    p: &CycleParams<'_>,
) -> Result<CycleOutcome, sqlx::Error> {
    let Some(bounds) = session.set_local() else {
        return cycle(conn, p).await;
    };
    let sql = format!("{bounds}; {}", cycle_sql_with_literals(p));
    let rows = sqlx::Executor::fetch_all(conn, sql.as_str()).await?;
    outcome(rows)
}

/// [`CYCLE_SQL`] with each parameter `$n` replaced by a typed literal of [`cycle`]'s binding
/// (text as an escaped string, numbers as digits, epochs as an array literal), in one pass so
/// that nothing written in is read again as a parameter.
pub fn cycle_sql_with_literals(p: &CycleParams<'_>) -> String {
    use super::together::{bigints, text, with_literals};
    let int4 = |v: u32| format!("({}::int4)", i32::try_from(v).unwrap_or(i32::MAX));
    let int8 = |d: Duration| {
        format!(
            "({}::int8)",
            i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
        )
    };
    with_literals(CYCLE_SQL, |n| match n {
        1 => text(p.node_id),
        2 => text(p.instance_id),
        3 => text(p.platform),
        4 => int4(p.capacity),
        5 => int8(p.lease),
        6 => bigints(p.held),
        7 => format!("({})", p.claim),
        8 => int4(p.claim_limit),
        9 => int8(p.trust),
        10 => int4(p.owned),
        11 => bigints(p.kept),
        12 => int4(p.starting),
        other => unreachable!("CYCLE_SQL has no parameter ${other}"),
    })
}

/// What the cycle's rows say.
fn outcome(rows: Vec<sqlx::postgres::PgRow>) -> Result<CycleOutcome, sqlx::Error> {
    let mut out = CycleOutcome::default();
    for row in rows {
        let kind: &str = row.try_get("kind")?;
        let ms = || -> Result<Duration, sqlx::Error> {
            Ok(Duration::from_millis(
                row.try_get::<i64, _>("ms")?.max(0) as u64
            ))
        };
        match kind {
            "own" => out.owned.push(OwnedRow {
                id: row.try_get("id")?,
                epoch: row.try_get("owner_epoch")?,
                wanted: row.try_get("wanted")?,
                claimed_ms: row.try_get::<Option<i64>, _>("ms")?.unwrap_or(0),
            }),
            "member" => out.member = true,
            "conflict" => {
                out.conflict = Some(Conflict {
                    instance_id: row.try_get("name")?,
                    expires_in: ms()?,
                })
            }
            "peer" => out.peers.push(Peer {
                node_id: row.try_get("name")?,
                expires_in: ms()?,
                live: row.try_get("wanted")?,
                trusted: row.try_get("trusted")?,
                capacity: row.try_get::<i32, _>("capacity")?.max(0) as u32,
                owned: row.try_get::<i32, _>("owned")?.max(0) as u32,
                starting: row.try_get::<i64, _>("id")?.max(0) as u32,
            }),
            "free" => out.free = row.try_get::<i64, _>("ms")?.max(0) as u64,
            "database" => {
                out.database = DatabaseView {
                    timeline: row.try_get("id")?,
                    failed_over: row.try_get("wanted")?,
                    grace: ms()?,
                    era_start: row.try_get("owner_epoch")?,
                }
            }
            other => {
                return Err(sqlx::Error::Protocol(format!(
                    "unexpected cycle row kind {other:?}"
                )));
            }
        }
    }
    Ok(out)
}

/// Releases the given rows (account id, epoch) where this node still owns them at that epoch
/// (`node_id = NULL, lease_until = NULL`), recording `status`, and announces the release on
/// [`RELEASED_CHANNEL`] in the same transaction, naming `to` (a hand-off's receiver, which claims
/// at once; `None`: about as many peers with room as accounts released do) and how many accounts
/// it released. Rows released disabled are not announced (nobody can claim them). Fenced by node
/// and epoch: a row that was lost, or lost and re-claimed, is not touched. Returns the ids
/// released.
///
/// Callers release only after the account's gate is closed and its in-flight work has finished.
pub async fn release(
    conn: &mut PgConnection,
    node_id: &str,
    held: &[(i64, i64)],
    status: &str,
    to: Option<&str>,
) -> Result<Vec<i64>, sqlx::Error> {
    let releases: Vec<Release> = held
        .iter()
        .map(|&(account_id, epoch)| Release {
            account_id,
            epoch,
            status: status.to_string(),
            to: to.map(str::to_string),
        })
        .collect();
    release_each(conn, node_id, &releases).await
}

/// One row to release ([`release_each`]): the account, the epoch the node holds it at, the
/// status recorded, and the receiver its announcement names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub account_id: i64,
    pub epoch: i64,
    pub status: String,
    pub to: Option<String>,
}

/// The release of [`release_each`]. Parameters: $1 the node, $2 the accounts, $3 their epochs,
/// $4 their statuses, $5 the channel announced on, $6 their receivers.
///
/// Driven by the rows named, each found by its primary key in a subquery the planner cannot merge
/// (`OFFSET 0`), as the status write is ([`crate::db::status::WRITE_SQL`]). Locked in id order,
/// as every statement of the node that waits for several account rows' locks.
///
/// The subquery tests the node and the epoch before it locks: a row named that is no longer the
/// node's at that epoch (handed off already, its release retried, or a shutdown's leave naming
/// its last cycle's rows) is not locked, so a peer's claim, which skips locked rows, takes it
/// at once instead of at its next cycle. A row that changes while the lock is awaited is tested
/// again on its newest version (PostgreSQL's read-committed recheck), so a release never frees
/// a row that stopped being the node's. The node is tested with `IS NOT DISTINCT FROM`, which no
/// index serves: with `node_id = $1`, a plan entering through the node's index, chosen under
/// statistics taken while every row was free (`node_id = $1` counted as one row), re-read the
/// node's rows for every row named, in the generic plan a prepared statement settles on. The
/// UPDATE takes the locked rows by id alone, as the cycle's renewal does (see [`CYCLE_SQL`]).
/// [`LEAVE_SQL`] is built the same way.
pub const RELEASE_SQL: &str = r#"
WITH wanted AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::text[], $6::text[]) AS w(id, epoch, status, receiver)
     ORDER BY id
),
locked AS (
    SELECT w.* FROM wanted w CROSS JOIN LATERAL (
        SELECT FROM trading_accounts a
         WHERE a.id = w.id AND a.node_id IS NOT DISTINCT FROM $1 AND a.owner_epoch = w.epoch
        OFFSET 0 FOR NO KEY UPDATE) x
),
released AS (
    UPDATE trading_accounts a
       SET node_id = NULL, lease_until = NULL, status = l.status, status_at = now()
      FROM locked l
     WHERE a.id = l.id
    RETURNING a.id, a.platform, a.enabled, l.receiver
)
SELECT id FROM released
UNION ALL
SELECT NULL FROM (SELECT pg_notify($5, platform || ' ' || json_build_object('from', $1::text, 'to', receiver, 'accounts', n)::text)
                    FROM (SELECT platform, receiver, count(*) AS n FROM released WHERE enabled
                           GROUP BY platform, receiver) p) n
"#;

/// `sql` ([`RELEASE_SQL`], or a statement around it such as an `EXPLAIN`) with `releases` bound
/// as its parameters.
pub fn bind_release<'q>(
    sql: &'q str,
    node_id: &'q str,
    releases: &[Release],
) -> Query<'q, Postgres, PgArguments> {
    let ids: Vec<i64> = releases.iter().map(|r| r.account_id).collect();
    let epochs: Vec<i64> = releases.iter().map(|r| r.epoch).collect();
    let statuses: Vec<String> = releases.iter().map(|r| r.status.clone()).collect();
    let receivers: Vec<Option<String>> = releases.iter().map(|r| r.to.clone()).collect();
    sqlx::query(sql)
        .bind(node_id)
        .bind(ids)
        .bind(epochs)
        .bind(statuses)
        .bind(RELEASED_CHANNEL)
        .bind(receivers)
}

/// As [`release`], each row with its own status and receiver, in one statement: one
/// announcement per platform and receiver named. Returns the ids released.
pub async fn release_each(
    conn: &mut PgConnection,
    node_id: &str,
    releases: &[Release],
) -> Result<Vec<i64>, sqlx::Error> {
    let rows = bind_release(RELEASE_SQL, node_id, releases)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .filter_map(|r| r.try_get::<Option<i64>, _>("id").transpose())
        .collect()
}

/// A release waiting for the node's [`Releaser`]: the account and what [`release_each`] takes.
#[derive(Debug, Clone)]
pub struct Releasing {
    /// The releasing node (fences the release with the epoch).
    pub node_id: std::sync::Arc<str>,
    pub release: Release,
}

/// The node's releases in batches: the accounts a node hands off at about the same time (a
/// shutdown of thousands, fair share's moves) go as one statement on one pooled connection at a
/// time, instead of one statement, one commit and one announcement each that would take every
/// connection of the pool from the sessions still working.
pub type Releaser = crate::db::batch::BatchWriter<Releasing>;

impl crate::db::batch::Batched for Releasing {
    /// Whether the row was still this node's at that epoch (and so released).
    type Outcome = bool;
    const WHAT: &'static str = "releaser";
    const MAX: usize = 1000;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        jobs: &'a [Self],
    ) -> crate::future::BoxFuture<'a, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            // One node's releases in practice; a statement per node named otherwise.
            let mut released = Vec::new();
            let mut nodes: Vec<&str> = jobs.iter().map(|j| &*j.node_id).collect();
            nodes.sort_unstable();
            nodes.dedup();
            for node_id in nodes {
                let releases: Vec<Release> = jobs
                    .iter()
                    .filter(|j| &*j.node_id == node_id)
                    .map(|j| j.release.clone())
                    .collect();
                released.extend(release_each(&mut *conn, node_id, &releases).await?);
            }
            Ok(crate::db::batch::among(
                jobs,
                |j| j.release.account_id,
                released,
            ))
        })
    }
}

/// Announces a prepared hand-off's offer or answer on [`crate::channels::HANDOFF`] (its payload
/// from [`crate::channels::Handoff::payload`]). Grants nothing: the release and the claim are
/// unchanged.
pub async fn announce_handoff(conn: &mut PgConnection, payload: &str) -> Result<(), sqlx::Error> {
    announce_handoffs(conn, &[payload.to_string()]).await
}

/// [`announce_handoff`] of many offers or answers in one statement (one notification each, in
/// order).
pub async fn announce_handoffs(
    conn: &mut PgConnection,
    payloads: &[String],
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "SELECT pg_notify($1, p) FROM unnest($2::text[]) WITH ORDINALITY AS t(p, n) ORDER BY n",
    )
    .bind(crate::channels::HANDOFF)
    .bind(payloads)
    .execute(conn)
    .await?;
    Ok(())
}

/// A prepared hand-off's offer or answer waiting for the node's [`HandoffAnnouncer`].
#[derive(Debug, Clone)]
pub struct HandoffNotice(pub String);

/// The node's hand-off offers and answers in batches: a shutdown offering thousands of accounts
/// at once, or a receiver answering them, sends them in a few statements on one pooled
/// connection at a time (live work, as the releases they precede) instead of one statement and
/// one pooled connection each, which left the offers unanswered within their wait at scale.
pub type HandoffAnnouncer = crate::db::batch::BatchWriter<HandoffNotice>;

impl crate::db::batch::Batched for HandoffNotice {
    type Outcome = ();
    const WHAT: &'static str = "hand-off announcer";
    const MAX: usize = 1000;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        notices: &'a [Self],
    ) -> crate::future::BoxFuture<'a, Result<Vec<()>, sqlx::Error>> {
        Box::pin(async move {
            let payloads: Vec<String> = notices.iter().map(|n| n.0.clone()).collect();
            announce_handoffs(conn, &payloads).await?;
            Ok(vec![(); notices.len()])
        })
    }
}

/// Announces again, naming nobody, those of `accounts` that are still free (unowned, enabled):
/// released a while ago and claimed by nobody (a named receiver stopped, paused or filled up
/// since it answered; the few nodes a release naming no one woke had filled up, or their
/// notices were late), they are any node's with room ([`crate::channels::Release::wakes`]).
/// One announcement per platform, with how many accounts are still free; announces nothing
/// when none is. Returns the ids still free.
pub async fn announce_unclaimed(
    conn: &mut PgConnection,
    node_id: &str,
    accounts: &[i64],
) -> Result<Vec<i64>, sqlx::Error> {
    const SQL: &str = r#"
WITH still AS MATERIALIZED (
    SELECT id, platform FROM trading_accounts
     WHERE id IN (SELECT unnest($2::bigint[])) AND node_id IS NULL AND enabled
)
SELECT id FROM still
UNION ALL
SELECT NULL FROM (SELECT pg_notify($3, platform || ' ' || json_build_object('from', $1::text, 'to', NULL::text, 'accounts', count(*))::text)
                    FROM still GROUP BY platform) n
"#;
    let rows = sqlx::query(SQL)
        .bind(node_id)
        .bind(accounts)
        .bind(RELEASED_CHANNEL)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .filter_map(|r| r.try_get::<Option<i64>, _>("id").transpose())
        .collect()
}

/// An account released a while ago, to announce again if still free
/// ([`announce_unclaimed`]), waiting for the node's [`UnclaimedAnnouncer`].
#[derive(Debug, Clone)]
pub struct Unclaimed {
    pub node_id: std::sync::Arc<str>,
    pub account_id: i64,
}

/// The node's [`announce_unclaimed`] checks in batches (a shutdown hands thousands off at once).
pub type UnclaimedAnnouncer = crate::db::batch::BatchWriter<Unclaimed>;

impl crate::db::batch::Batched for Unclaimed {
    /// Whether the account was still free (and so announced again).
    type Outcome = bool;
    const WHAT: &'static str = "unclaimed announcer";
    const MAX: usize = 1000;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        checks: &'a [Self],
    ) -> crate::future::BoxFuture<'a, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(async move {
            let Some(first) = checks.first() else {
                return Ok(Vec::new());
            };
            // One node's writer: every check names the same node.
            let ids: Vec<i64> = checks.iter().map(|c| c.account_id).collect();
            let free = announce_unclaimed(conn, &first.node_id, &ids).await?;
            Ok(crate::db::batch::among(checks, |c| c.account_id, free))
        })
    }
}

/// What leaving the cluster did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaveOutcome {
    pub released: Vec<i64>,
    /// The membership row was deleted (it is kept while any row still names this node, e.g. an
    /// account whose task did not stop in time: that row then moves when its lease expires).
    pub left: bool,
}

/// The statement of [`leave`]. Parameters: $1 the node, $2 its instance, $3 the accounts, $4 its
/// platform, $5 the channel announced on, $6 whether its departure was announced before, $7 the
/// accounts' epochs. Driven by the rows named, each locked by its primary key, as
/// [`RELEASE_SQL`] is (which says why).
pub const LEAVE_SQL: &str = r#"
WITH held AS (
    SELECT * FROM unnest($3::bigint[], $7::bigint[]) AS h(id, epoch)
     ORDER BY id
),
locked AS (
    SELECT h.id FROM held h CROSS JOIN LATERAL (
        SELECT FROM trading_accounts a
         WHERE a.id = h.id AND a.node_id IS NOT DISTINCT FROM $1 AND a.owner_epoch = h.epoch
        OFFSET 0 FOR NO KEY UPDATE) x
),
released AS (
    UPDATE trading_accounts a
       SET node_id = NULL, lease_until = NULL, status = 'released: node shut down', status_at = now()
      FROM locked l
     WHERE a.id = l.id
    RETURNING a.id
),
gone AS (
    DELETE FROM nodes n
     WHERE n.node_id = $1 AND n.instance_id = $2
       AND NOT EXISTS (SELECT FROM trading_accounts a
                        WHERE a.node_id = $1 AND a.id NOT IN (SELECT id FROM released))
    RETURNING n.node_id
)
SELECT 'released' AS kind, id FROM released
UNION ALL
SELECT 'left', NULL FROM gone
UNION ALL
SELECT 'notified', NULL FROM (SELECT pg_notify($5, $4 || ' ' || json_build_object('from', $1::text, 'to', NULL::text, 'leaving', true,
                                                            'announced', $6::bool, 'accounts', (SELECT count(*) FROM released))::text)) n
"#;

/// `sql` ([`LEAVE_SQL`], or a statement around it such as an `EXPLAIN`) with [`leave`]'s
/// arguments bound as its parameters.
pub fn bind_leave<'q>(
    sql: &'q str,
    node_id: &'q str,
    instance_id: &'q str,
    platform: &'q str,
    held: &[(i64, i64)],
    announced: bool,
) -> Query<'q, Postgres, PgArguments> {
    let (ids, epochs): (Vec<i64>, Vec<i64>) = held.iter().copied().unzip();
    sqlx::query(sql)
        .bind(node_id)
        .bind(instance_id)
        .bind(ids)
        .bind(platform)
        .bind(RELEASED_CHANNEL)
        .bind(announced)
        .bind(epochs)
}

/// Clean shutdown in one statement: release the given rows (account id, epoch) where the node
/// still owns them at that epoch, delete this instance's membership if no other row names the
/// node, and announce it on [`RELEASED_CHANNEL`]: to every peer (the node left their fair
/// shares), or, when the node `announced` its departure before ([`announce_departure`]), to every
/// peer with room ([`crate::channels::Release::announced`]).
pub async fn leave(
    conn: &mut PgConnection,
    node_id: &str,
    instance_id: &str,
    platform: &str,
    held: &[(i64, i64)],
    announced: bool,
) -> Result<LeaveOutcome, sqlx::Error> {
    let rows = bind_leave(LEAVE_SQL, node_id, instance_id, platform, held, announced)
        .fetch_all(conn)
        .await?;
    let mut out = LeaveOutcome::default();
    for row in rows {
        match row.try_get::<&str, _>("kind")? {
            "released" => out.released.push(row.try_get("id")?),
            "left" => out.left = true,
            _ => {}
        }
    }
    Ok(out)
}

/// Publishes what `node_id` owns after a cycle that claimed: the cycle itself publishes what
/// the node owned when it began (its membership is written before its claims), so without this
/// its peers would count the claimed rows neither free nor owned until its next cycle, and their
/// shares would fall short by every peer's last claims. Only this instance's membership.
pub async fn publish_owned(
    conn: &mut PgConnection,
    node_id: &str,
    instance_id: &str,
    owned: u32,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE nodes SET owned = $3 WHERE node_id = $1 AND instance_id = $2")
        .bind(node_id)
        .bind(instance_id)
        .bind(i32::try_from(owned).unwrap_or(i32::MAX))
        .execute(conn)
        .await?;
    Ok(())
}

/// Announces on [`RELEASED_CHANNEL`] that `node_id` leaves the fair shares of `platform` (its
/// shutdown began, and its last cycle published no trust): every peer runs a cycle, and so
/// learns its larger share before the node's hand-offs ask it to take their accounts.
pub async fn announce_departure(
    conn: &mut PgConnection,
    node_id: &str,
    platform: &str,
) -> Result<(), sqlx::Error> {
    let payload = crate::channels::released_payload(
        platform,
        &crate::channels::Release {
            from: node_id.to_string(),
            to: None,
            leaving: true,
            announced: false,
            accounts: 0,
        },
    );
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(RELEASED_CHANNEL)
        .bind(payload)
        .execute(conn)
        .await?;
    Ok(())
}

/// Deletes memberships that expired over an hour ago and name no account: nodes that crashed
/// and whose accounts all moved (pod names change on every restart under Kubernetes). Kept an
/// hour so `copier-node status` shows recently dead nodes. Returns how many went.
pub async fn forget_dead_nodes(
    conn: &mut PgConnection,
    platform: &str,
) -> Result<u64, sqlx::Error> {
    const SQL: &str = r#"
DELETE FROM nodes g
 WHERE g.platform = $1 AND g.lease_until < now() - interval '1 hour'
   AND NOT EXISTS (SELECT FROM trading_accounts a WHERE a.node_id = g.node_id)
"#;
    Ok(sqlx::query(SQL)
        .bind(platform)
        .execute(conn)
        .await?
        .rows_affected())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How often `$n` (and not `$n0`..) appears in [`CYCLE_SQL`].
    fn placeholders(n: usize) -> usize {
        let tag = format!("${n}");
        CYCLE_SQL
            .match_indices(&tag)
            .filter(|(at, _)| {
                !CYCLE_SQL[at + tag.len()..].starts_with(|c: char| c.is_ascii_digit())
            })
            .count()
    }

    #[test]
    fn every_parameter_is_written_in_as_a_literal_and_nothing_written_in_is_read_again() {
        let p = CycleParams {
            node_id: "n'$1\\",
            instance_id: "$12",
            platform: "mt5",
            capacity: 7,
            claim_limit: 5,
            trust: Duration::from_millis(4_500),
            owned: 2,
            starting: 1,
            lease: Duration::from_millis(6_000),
            held: &[11, 12],
            claim: false,
            kept: &[12],
        };
        let sql = cycle_sql_with_literals(&p);
        let node = r"(E'n''$1\\'::text)";
        let instance = "(E'$12'::text)";
        assert_eq!(sql.matches(node).count(), placeholders(1));
        assert_eq!(sql.matches(instance).count(), placeholders(2));
        assert_eq!(sql.matches("('{11,12}'::int8[])").count(), placeholders(6));
        assert_eq!(sql.matches("('{12}'::int8[])").count(), placeholders(11));
        assert_eq!(sql.matches("(6000::int8)").count(), placeholders(5));
        assert_eq!(sql.matches("(4500::int8)").count(), placeholders(9));
        assert_eq!(sql.matches("(false)").count(), placeholders(7));
        let bare = sql.replace(node, "").replace(instance, "");
        assert!(
            !bare
                .match_indices('$')
                .any(|(at, _)| bare[at + 1..].starts_with(|c: char| c.is_ascii_digit())),
            "a parameter left in: {bare}"
        );
        for n in 1..=12 {
            assert!(placeholders(n) > 0, "${n} is a parameter of the cycle");
        }
    }
}

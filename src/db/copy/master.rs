//! A master's published state: the fenced publish (snapshot, (epoch, seq) and NOTIFY in one
//! statement) and its read.

use std::collections::HashMap;

use sqlx::{PgConnection, Row};

use crate::channels;
use crate::model::events::{MasterEvent, MasterNotice};
use crate::model::{MasterOrder, MasterPosition};

/// A master's published state.
#[derive(Debug, Clone, PartialEq)]
pub struct MasterState {
    pub epoch: i64,
    pub seq: i64,
    pub positions: Vec<MasterPosition>,
    /// Its pending orders.
    pub orders: Vec<MasterOrder>,
    /// The database's clock when this was read (Unix ms): a reconcile's decisions are timed by it.
    pub now_ms: i64,
    /// Written before the database last failed over (on an older timeline, or before a cycle
    /// saw the failover): it may lack the last changes, which the lost tail took with it. A
    /// follower decides nothing from it until the master's owner publishes again.
    pub before_failover: bool,
}

/// Reads a master's published state, if it ever published. After a database failover a missing
/// row is not "the master holds nothing": its first publish may have been on the lost tail, so it
/// reads as an empty snapshot from before the failover (followers wait for the owner's publish).
pub async fn master_state(
    conn: &mut PgConnection,
    master_id: i64,
) -> Result<Option<MasterState>, sqlx::Error> {
    master_states(conn, &[master_id])
        .await?
        .remove(&master_id)
        .unwrap_or(Ok(None))
}

/// [`master_state`] of many masters in one statement: each master asked, with its own outcome
/// (a snapshot that does not parse fails its master alone).
pub async fn master_states(
    conn: &mut PgConnection,
    master_ids: &[i64],
) -> Result<HashMap<i64, Result<Option<MasterState>, sqlx::Error>>, sqlx::Error> {
    let rows = sqlx::query(MASTER_STATES_SQL)
        .bind(master_ids)
        .fetch_all(conn)
        .await?;
    master_states_from(&rows)
}

/// [`master_states`]' statement: $1 the masters' ids (`bigint[]`).
pub(super) const MASTER_STATES_SQL: &str =
    "SELECT q.id, s.master_id IS NULL AS missing, d.failed_over_at IS NOT NULL AS failed_over,
            s.epoch, s.seq, s.positions::text AS positions, s.orders::text AS orders,
            (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
            coalesce(s.timeline <> copier_timeline(), false)
              OR coalesce(s.updated_at < d.failed_over_at, false) AS before_failover
       FROM unnest($1::bigint[]) q(id)
       LEFT JOIN LATERAL (SELECT * FROM copier_database LIMIT 1) d ON true
       LEFT JOIN master_state s ON s.master_id = q.id";

/// What [`MASTER_STATES_SQL`]'s rows say.
pub(super) fn master_states_from(
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<i64, Result<Option<MasterState>, sqlx::Error>>, sqlx::Error> {
    rows.iter()
        .map(|row| Ok((row.try_get("id")?, state_from_row(row))))
        .collect()
}

/// A master's published state, read for one of the node's followers with the others' reads
/// of it ([`MasterStateReader`]).
#[derive(Debug, Clone, Copy)]
pub struct MasterStateRead(pub i64);

/// The node's reader of masters' published states for its followers: a master's new snapshot
/// (its hand-off to a new owner, a re-publish after a doubt) is read by every follower of it at
/// once, and a thousand followers then make a statement or two, each master read once in each,
/// instead of a thousand reads of the same row (taking the background turns, as each
/// follower's own read did). A job is sent in a statement that starts after it was submitted,
/// so a follower that heard (epoch, seq) reads that state or a newer one.
pub type MasterStateReader = crate::db::batch::BatchWriter<MasterStateRead>;

impl crate::db::batch::Batched for MasterStateRead {
    /// The state (`None`: the master never published), or why it could not be read.
    type Outcome = Result<Option<MasterState>, String>;
    const WHAT: &'static str = "master state reader";
    const MAX: usize = 1000;
    const ALONE_WHEN_REFUSED: bool = false;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        reads: &'a [Self],
    ) -> crate::future::BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>> {
        Box::pin(async move {
            let mut masters: Vec<i64> = reads.iter().map(|r| r.0).collect();
            masters.sort_unstable();
            masters.dedup();
            let states = master_states(conn, &masters).await?;
            Ok(reads
                .iter()
                .map(|r| match states.get(&r.0) {
                    Some(Ok(state)) => Ok(state.clone()),
                    Some(Err(e)) => Err(format!(
                        "master {}'s published state: {}",
                        r.0,
                        crate::db::describe(e)
                    )),
                    None => Ok(None),
                })
                .collect())
        })
    }
}

/// One row of [`master_states`].
fn state_from_row(row: &sqlx::postgres::PgRow) -> Result<Option<MasterState>, sqlx::Error> {
    let now_ms = row.try_get("now_ms")?;
    if row.try_get::<bool, _>("missing")? {
        return Ok(row
            .try_get::<bool, _>("failed_over")?
            .then_some(MasterState {
                epoch: 0,
                seq: 0,
                positions: Vec::new(),
                orders: Vec::new(),
                now_ms,
                before_failover: true,
            }));
    }
    let text: String = row.try_get("positions")?;
    let positions = serde_json::from_str(&text).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let text: String = row.try_get("orders")?;
    let orders = serde_json::from_str(&text).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    Ok(Some(MasterState {
        epoch: row.try_get("epoch")?,
        seq: row.try_get("seq")?,
        positions,
        orders,
        now_ms,
        before_failover: row.try_get("before_failover")?,
    }))
}

/// What a publish attempt did.
#[derive(Debug, Clone, PartialEq)]
pub enum Published {
    /// Stored and announced. The positions and orders published without a `first_seen_ms` were
    /// stored (and announced) with this one, the database's clock ([`stamp_first_seen`] gives the
    /// caller the stored snapshot).
    Stored { first_seen: FirstSeen },
    /// Nothing stored: this (node, epoch) no longer owns the master, or (epoch, seq) does not
    /// follow what is stored. The caller re-reads the state to tell which.
    Refused,
}

/// The instant a publish stamped on what it first recorded (the database's clock): Unix ms, as
/// `first_seen_ms` has always been, and the same instant in µs (`first_seen_us`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FirstSeen {
    pub ms: i64,
    pub us: i64,
}

/// Stamps what a publish stored with `first_seen` (from [`Published::Stored`]): every position
/// and order that went out without a first-seen time, as the database did.
pub fn stamp_first_seen(
    first_seen: FirstSeen,
    positions: &mut [MasterPosition],
    orders: &mut [MasterOrder],
) {
    for p in positions.iter_mut().filter(|p| p.first_seen_ms.is_none()) {
        p.first_seen_ms = Some(first_seen.ms);
        p.first_seen_us = Some(first_seen.us);
    }
    for o in orders.iter_mut().filter(|o| o.first_seen_ms.is_none()) {
        o.first_seen_ms = Some(first_seen.ms);
        o.first_seen_us = Some(first_seen.us);
    }
}

/// The notice a stored publish announced (its NOTIFY payload, as the hub decodes it): master
/// `master_id`'s `event` as (epoch, seq), its new position or order stamped with the publish's
/// `first_seen` as the statement stamped the payload's text ([`stamp_first_seen`]).
pub fn announced(
    master_id: i64,
    (epoch, seq): (i64, i64),
    mut event: MasterEvent,
    first_seen: FirstSeen,
) -> MasterNotice {
    match &mut event {
        MasterEvent::Open { position } => {
            stamp_first_seen(first_seen, std::slice::from_mut(position), &mut [])
        }
        MasterEvent::OrderSet { order } => {
            stamp_first_seen(first_seen, &mut [], std::slice::from_mut(order))
        }
        MasterEvent::Snapshot
        | MasterEvent::Close { .. }
        | MasterEvent::Partial { .. }
        | MasterEvent::Modify { .. }
        | MasterEvent::OrderGone { .. } => {}
    }
    MasterNotice {
        master: master_id,
        epoch,
        seq,
        event,
    }
}

/// Publishes one event of master `master_id` as (epoch, seq) with the snapshot after it: lock and
/// match the master's row (node, epoch), stamp positions first recorded now with the database's
/// clock, store the snapshot if (epoch, seq) follows what is stored (a higher epoch, or the next
/// seq of the same epoch), and NOTIFY from that result ([`publish_many`] of one).
pub async fn publish(
    conn: &mut PgConnection,
    node_id: &str,
    master_id: i64,
    epoch: i64,
    seq: i64,
    (positions, orders): (&[MasterPosition], &[MasterOrder]),
    event: &MasterEvent,
) -> Result<Published, sqlx::Error> {
    let write = PublishWrite::new(node_id, master_id, (epoch, seq), (positions, orders), event);
    let mut done = publish_many(conn, std::slice::from_ref(&write)).await?;
    Ok(done.pop().unwrap_or(Published::Refused))
}

/// One master event to publish, serialised: see [`publish_many`].
#[derive(Debug, Clone)]
pub struct PublishWrite {
    pub node_id: String,
    pub master_id: i64,
    pub epoch: i64,
    pub seq: i64,
    positions: String,
    orders: String,
    notice: String,
}

impl PublishWrite {
    /// Master `master_id`'s `event` as (epoch, seq), with its positions and orders after it.
    pub fn new(
        node_id: &str,
        master_id: i64,
        (epoch, seq): (i64, i64),
        (positions, orders): (&[MasterPosition], &[MasterOrder]),
        event: &MasterEvent,
    ) -> PublishWrite {
        let notice = MasterNotice {
            master: master_id,
            epoch,
            seq,
            event: event.clone(),
        };
        PublishWrite {
            node_id: node_id.to_string(),
            master_id,
            epoch,
            seq,
            positions: by_ticket(positions, |p| p.ticket),
            orders: by_ticket(orders, |o| o.ticket),
            notice: serde_json::to_string(&notice).expect("notices serialise"),
        }
    }
}

/// A snapshot's positions or orders as stored: in ticket order (a master session's view is kept so
/// already; others are sorted here).
fn by_ticket<T: serde::Serialize + Clone>(items: &[T], ticket: impl Fn(&T) -> i64) -> String {
    let text = if items.is_sorted_by_key(&ticket) {
        serde_json::to_string(items)
    } else {
        let mut sorted = items.to_vec();
        sorted.sort_by_key(ticket);
        serde_json::to_string(&sorted)
    };
    text.expect("snapshots serialise")
}

/// Publishes many masters' events in one statement and one commit, each as [`publish`] does
/// alone: fenced by its own master's (node, epoch), stored only if its (epoch, seq) follows what
/// is stored, announced on its master's channel only if stored. PostgreSQL serialises commits
/// that carry a NOTIFY on one lock, so the events a database can announce a second are bounded by
/// such commits a second: one commit for many events raises that ceiling (the node's
/// [`MasterPublisher`] gathers them). The account rows are locked `FOR KEY SHARE` (as the copy
/// ledger's batch: a claim, `FOR UPDATE SKIP LOCKED`, cannot take a master while its event is
/// being published, and a changed row is checked again on its latest version; renewals never
/// wait, so rows locked in any order cannot deadlock with a lease cycle). A master twice in one
/// batch (a master task stopped and started again while its last event was queued) is published
/// in turn: the writes go in rounds, a master's n-th write in the n-th, one statement each, all in
/// one transaction. One outcome per write, in order.
pub async fn publish_many(
    conn: &mut PgConnection,
    writes: &[PublishWrite],
) -> Result<Vec<Published>, sqlx::Error> {
    let mut seen = std::collections::HashMap::new();
    let round_of: Vec<usize> = writes
        .iter()
        .map(|w| {
            let n = seen.entry(w.master_id).or_insert(0);
            *n += 1;
            *n - 1
        })
        .collect();
    let rounds = round_of.iter().max().map_or(0, |m| m + 1);
    let outcomes = if rounds > 1 {
        // Several rounds commit together (all or none), as one statement does.
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        let outcomes = publish_rounds(&mut tx, writes, &round_of, rounds).await?;
        tx.commit().await?;
        outcomes
    } else {
        publish_rounds(conn, writes, &round_of, rounds).await?
    };
    Ok(outcomes
        .into_iter()
        .map(|o| o.unwrap_or(Published::Refused))
        .collect())
}

/// The rounds of [`publish_many`], in order: an outcome per write.
async fn publish_rounds(
    conn: &mut PgConnection,
    writes: &[PublishWrite],
    round_of: &[usize],
    rounds: usize,
) -> Result<Vec<Option<Published>>, sqlx::Error> {
    let mut outcomes: Vec<Option<Published>> = vec![None; writes.len()];
    for round in 0..rounds {
        let at: Vec<usize> = (0..writes.len())
            .filter(|i| round_of[*i] == round)
            .collect();
        let these: Vec<&PublishWrite> = at.iter().map(|i| &writes[*i]).collect();
        for (i, outcome) in at.into_iter().zip(publish_round(&mut *conn, &these).await?) {
            outcomes[i] = Some(outcome);
        }
    }
    Ok(outcomes)
}

/// One statement of [`publish_many`]: writes of distinct masters.
async fn publish_round(
    conn: &mut PgConnection,
    writes: &[&PublishWrite],
) -> Result<Vec<Published>, sqlx::Error> {
    const SQL: &str = r#"
WITH r AS (
    SELECT * FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::text[],
                         $6::text[], $7::text[], $8::text[])
           AS r(master_id, node_id, epoch, seq, positions, orders, channel, notice)
),
owner AS (
    SELECT r.* FROM r JOIN trading_accounts a
        ON a.id = r.master_id AND a.node_id = r.node_id AND a.owner_epoch = r.epoch
       FOR KEY SHARE OF a
),
clock AS (
    SELECT now_ms, now_us,
           '"first_seen_ms":' || now_ms || ',"first_seen_us":' || now_us AS stamp
      FROM (SELECT (extract(epoch FROM now()) * 1000)::bigint AS now_ms,
                   (extract(epoch FROM now()) * 1000000)::bigint AS now_us) t
),
stamped AS (
    -- A position or order first recorded now goes out with `"first_seen_ms":null` (and no
    -- `first_seen_us`): the text is stamped, once, with the database's clock, in ms and in µs.
    -- Only a key can match (a quote inside a JSON string is escaped), and a text replace costs
    -- far less than rebuilding the arrays as jsonb.
    SELECT o.master_id, o.epoch, o.seq, o.channel,
           replace(o.notice, '"first_seen_ms":null', clock.stamp) AS notice,
           replace(o.positions, '"first_seen_ms":null', clock.stamp)::jsonb AS positions,
           replace(o.orders, '"first_seen_ms":null', clock.stamp)::jsonb AS orders,
           clock.now_ms, clock.now_us
      FROM owner o, clock
),
stored AS (
    INSERT INTO master_state AS s (master_id, epoch, seq, positions, orders, updated_at, timeline)
    SELECT master_id, epoch, seq, positions, orders, now(), copier_timeline() FROM stamped
    ON CONFLICT (master_id) DO UPDATE
       SET epoch = excluded.epoch, seq = excluded.seq,
           positions = excluded.positions, orders = excluded.orders,
           updated_at = excluded.updated_at, timeline = excluded.timeline
     WHERE s.epoch < excluded.epoch OR (s.epoch = excluded.epoch AND s.seq = excluded.seq - 1)
    RETURNING s.master_id, s.epoch, s.seq
)
SELECT stored.master_id, stored.epoch, stored.seq, t.now_ms, t.now_us, pg_notify(t.channel, t.notice) AS notified
  FROM stored
  JOIN stamped t ON (t.master_id, t.epoch, t.seq) = (stored.master_id, stored.epoch, stored.seq)
"#;
    let text =
        |f: fn(&PublishWrite) -> &str| writes.iter().map(|w| f(w).to_string()).collect::<Vec<_>>();
    let rows = sqlx::query(SQL)
        .bind(writes.iter().map(|w| w.master_id).collect::<Vec<_>>())
        .bind(text(|w| &w.node_id))
        .bind(writes.iter().map(|w| w.epoch).collect::<Vec<_>>())
        .bind(writes.iter().map(|w| w.seq).collect::<Vec<_>>())
        .bind(text(|w| &w.positions))
        .bind(text(|w| &w.orders))
        .bind(
            writes
                .iter()
                .map(|w| channels::master(w.master_id))
                .collect::<Vec<_>>(),
        )
        .bind(text(|w| &w.notice))
        .fetch_all(conn)
        .await?;
    let mut stored = std::collections::HashMap::new();
    for r in rows {
        let key: (i64, i64, i64) = (
            r.try_get("master_id")?,
            r.try_get("epoch")?,
            r.try_get("seq")?,
        );
        stored.insert(
            key,
            Published::Stored {
                first_seen: FirstSeen {
                    ms: r.try_get("now_ms")?,
                    us: r.try_get("now_us")?,
                },
            },
        );
    }
    Ok(writes
        .iter()
        .map(|w| {
            stored
                .remove(&(w.master_id, w.epoch, w.seq))
                .unwrap_or(Published::Refused)
        })
        .collect())
}

/// The node's publisher of master events: the events its masters publish at about the same time
/// go out in one statement and one commit per batch ([`publish_many`]); each master still waits
/// for its own outcome (an error when the database's reply was lost: whether it committed is then
/// unknown), and publishes its next event only after it.
pub type MasterPublisher = crate::db::batch::BatchWriter<PublishWrite>;

impl crate::db::batch::Batched for PublishWrite {
    type Outcome = Published;
    const WHAT: &'static str = "master event";
    const MAX: usize = 200;
    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        writes: &'a [PublishWrite],
    ) -> crate::future::BoxFuture<'a, Result<Vec<Published>, sqlx::Error>> {
        Box::pin(publish_many(conn, writes))
    }
}

//! A master's published state: the fenced publish (snapshot, (epoch, seq) and NOTIFY in one
//! statement) and its read.

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
    let row = sqlx::query(
        "SELECT s.master_id IS NULL AS missing, d.failed_over_at IS NOT NULL AS failed_over,
                s.epoch, s.seq, s.positions::text AS positions, s.orders::text AS orders,
                (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms,
                coalesce(s.timeline <> copier_timeline(), false)
                  OR coalesce(s.updated_at < d.failed_over_at, false) AS before_failover
           FROM (SELECT $1::bigint AS id) q
           LEFT JOIN LATERAL (SELECT * FROM copier_database LIMIT 1) d ON true
           LEFT JOIN master_state s ON s.master_id = q.id",
    )
    .bind(master_id)
    .fetch_one(conn)
    .await?;
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
    /// Stored and announced; the stored snapshot (with `first_seen_ms` stamped).
    Stored(Vec<MasterPosition>, Vec<MasterOrder>),
    /// Nothing stored: this (node, epoch) no longer owns the master, or (epoch, seq) does not
    /// follow what is stored. The caller re-reads the state to tell which.
    Refused,
}

/// Publishes one event of master `master_id` as (epoch, seq) with the snapshot after it, in one
/// statement: lock and match the master's row (node, epoch), stamp positions first recorded now
/// with the database's clock, store the snapshot if (epoch, seq) follows what is stored (a higher
/// epoch, or the next seq of the same epoch), and NOTIFY from that result.
pub async fn publish(
    conn: &mut PgConnection,
    node_id: &str,
    master_id: i64,
    epoch: i64,
    seq: i64,
    (positions, orders): (&[MasterPosition], &[MasterOrder]),
    event: &MasterEvent,
) -> Result<Published, sqlx::Error> {
    const SQL: &str = r#"
WITH owner AS (
    SELECT id FROM trading_accounts
     WHERE id = $1 AND node_id = $2 AND owner_epoch = $3
       FOR SHARE
),
clock AS (
    SELECT (extract(epoch FROM now()) * 1000)::bigint AS now_ms
),
stamped AS (
    SELECT coalesce(jsonb_agg(
               CASE WHEN coalesce(p -> 'first_seen_ms', 'null'::jsonb) = 'null'::jsonb
                    THEN p || jsonb_build_object('first_seen_ms', clock.now_ms)
                    ELSE p END
               ORDER BY (p ->> 'ticket')::bigint), '[]'::jsonb) AS positions
      FROM jsonb_array_elements($5::jsonb) p, clock
),
stamped_orders AS (
    SELECT coalesce(jsonb_agg(
               CASE WHEN coalesce(o -> 'first_seen_ms', 'null'::jsonb) = 'null'::jsonb
                    THEN o || jsonb_build_object('first_seen_ms', clock.now_ms)
                    ELSE o END
               ORDER BY (o ->> 'ticket')::bigint), '[]'::jsonb) AS orders
      FROM jsonb_array_elements($8::jsonb) o, clock
),
stored AS (
    INSERT INTO master_state AS s (master_id, epoch, seq, positions, orders, updated_at, timeline)
    SELECT $1, $3, $4, stamped.positions, stamped_orders.orders, now(), copier_timeline()
      FROM owner, stamped, stamped_orders
    ON CONFLICT (master_id) DO UPDATE
       SET epoch = excluded.epoch, seq = excluded.seq,
           positions = excluded.positions, orders = excluded.orders,
           updated_at = excluded.updated_at, timeline = excluded.timeline
     WHERE s.epoch < excluded.epoch OR (s.epoch = excluded.epoch AND s.seq = excluded.seq - 1)
    RETURNING s.positions, s.orders
)
SELECT stored.positions::text AS positions, stored.orders::text AS orders,
       pg_notify($6, CASE WHEN $7::jsonb ->> 'kind' = 'open'
                          THEN jsonb_set($7::jsonb, '{position,first_seen_ms}', to_jsonb(clock.now_ms))
                          WHEN $7::jsonb ->> 'kind' = 'order_set'
                               AND coalesce($7::jsonb #> '{order,first_seen_ms}', 'null'::jsonb) = 'null'::jsonb
                          THEN jsonb_set($7::jsonb, '{order,first_seen_ms}', to_jsonb(clock.now_ms))
                          ELSE $7::jsonb END::text) AS notified
  FROM stored, clock
"#;
    let notice = MasterNotice {
        master: master_id,
        epoch,
        seq,
        event: event.clone(),
    };
    let row = sqlx::query(SQL)
        .bind(master_id)
        .bind(node_id)
        .bind(epoch)
        .bind(seq)
        .bind(serde_json::to_string(positions).expect("positions serialise"))
        .bind(channels::master(master_id))
        .bind(serde_json::to_string(&notice).expect("notices serialise"))
        .bind(serde_json::to_string(orders).expect("orders serialise"))
        .fetch_optional(conn)
        .await?;
    match row {
        None => Ok(Published::Refused),
        Some(r) => {
            let decode = |column: &str| -> Result<String, sqlx::Error> { r.try_get(column) };
            let positions = serde_json::from_str(&decode("positions")?)
                .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            let orders = serde_json::from_str(&decode("orders")?)
                .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            Ok(Published::Stored(positions, orders))
        }
    }
}

//! Every statement of the copy engine: accounts and links as sessions read them, the master's
//! fenced publication (snapshot, (epoch, seq) and NOTIFY in one statement), and the follower's
//! fenced records (skips, late-copy bases).
//!
//! Fenced writes to tables other than `trading_accounts` lock the account row `FOR SHARE` and
//! match `node_id = $me AND owner_epoch = $epoch` in the same statement: under READ COMMITTED a
//! concurrent claim either waits for this statement or is seen by it, so a node that lost the
//! account writes nothing.

use std::collections::{HashMap, HashSet};

use sqlx::{PgConnection, Row};

use crate::channels;
use crate::model::MasterPosition;
use crate::model::events::{MasterEvent, MasterNotice};
use crate::model::link::{Link, LotMode, Protections, Sides};
use crate::secret::Secret;

/// What an account does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Master,
    Follower,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Master => "master",
            Role::Follower => "follower",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An account row as its session needs it. `credentials` never reaches a log line.
#[derive(Debug, Clone)]
pub struct AccountRow {
    pub id: i64,
    pub role: Role,
    pub server: String,
    pub login: String,
    pub credentials: Option<Secret>,
}

/// Reads an account row. A role other than `master` or `follower` (the schema's CHECK forbids
/// one) is an error naming the account.
pub async fn load_account(
    conn: &mut PgConnection,
    id: i64,
) -> Result<Option<AccountRow>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT id, role, server, login, credentials FROM trading_accounts WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(conn)
    .await?;
    row.map(|r| {
        let id: i64 = r.try_get("id")?;
        let role: String = r.try_get("role")?;
        let role = match role.as_str() {
            "master" => Role::Master,
            "follower" => Role::Follower,
            other => {
                return Err(sqlx::Error::Decode(
                    format!("account {id} has role {other:?}; expected master or follower").into(),
                ));
            }
        };
        Ok(AccountRow {
            id,
            role,
            server: r.try_get("server")?,
            login: r.try_get("login")?,
            credentials: r
                .try_get::<Option<String>, _>("credentials")?
                .map(Secret::new),
        })
    })
    .transpose()
}

/// A follower's links (enabled or not: a disabled link is close-only). A row whose settings do
/// not parse is reported with its id, not skipped silently.
pub async fn load_links(
    conn: &mut PgConnection,
    follower_id: i64,
) -> Result<Vec<Result<Link, String>>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, master_id, enabled, magic, lot_mode, lot_value, reverse, copy_sl_tp, symbol_map::text AS symbol_map,
                copy_existing, (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
                symbols, magics, sides, close_only, max_lot, max_delay_ms, max_slippage, equity_stop
           FROM copy_links WHERE follower_id = $1 ORDER BY id",
    )
    .bind(follower_id)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            let id: i64 = r.try_get("id")?;
            let lot_mode: String = r.try_get("lot_mode")?;
            let map_text: String = r.try_get("symbol_map")?;
            let sides: String = r.try_get("sides")?;
            let parsed = lot_mode
                .parse::<LotMode>()
                .and_then(|mode| {
                    let symbol_map: HashMap<String, String> = serde_json::from_str(&map_text)
                        .map_err(|e| {
                            format!("symbol_map must map symbol names to symbol names: {e}")
                        })?;
                    Ok((mode, symbol_map, sides.parse::<Sides>()?))
                })
                .map_err(|e| format!("copy link {id}: {e}"));
            Ok(match parsed {
                Ok((lot_mode, symbol_map, sides)) => Ok(Link {
                    id,
                    master_id: r.try_get("master_id")?,
                    enabled: r.try_get("enabled")?,
                    magic: r.try_get("magic")?,
                    lot_mode,
                    lot_value: r.try_get("lot_value")?,
                    reverse: r.try_get("reverse")?,
                    copy_sl_tp: r.try_get("copy_sl_tp")?,
                    symbol_map,
                    copy_existing: r.try_get("copy_existing")?,
                    created_at_ms: r.try_get("created_at_ms")?,
                    protections: Protections {
                        symbols: r.try_get("symbols")?,
                        magics: r.try_get("magics")?,
                        sides,
                        close_only: r.try_get("close_only")?,
                        max_lot: r.try_get("max_lot")?,
                        max_delay_ms: r.try_get("max_delay_ms")?,
                        max_slippage: r.try_get("max_slippage")?,
                        equity_stop: r.try_get("equity_stop")?,
                    },
                }),
                Err(e) => Err(e),
            })
        })
        .collect()
}

/// A master's published state.
#[derive(Debug, Clone, PartialEq)]
pub struct MasterState {
    pub epoch: i64,
    pub seq: i64,
    pub positions: Vec<MasterPosition>,
    /// The database's clock when this was read (Unix ms): a reconcile's decisions are timed by it.
    pub now_ms: i64,
}

/// Reads a master's published state, if it ever published.
pub async fn master_state(
    conn: &mut PgConnection,
    master_id: i64,
) -> Result<Option<MasterState>, sqlx::Error> {
    let row = sqlx::query(
        "SELECT epoch, seq, positions::text AS positions,
                (extract(epoch FROM clock_timestamp()) * 1000)::bigint AS now_ms
           FROM master_state WHERE master_id = $1",
    )
    .bind(master_id)
    .fetch_optional(conn)
    .await?;
    row.map(|r| {
        let text: String = r.try_get("positions")?;
        let positions =
            serde_json::from_str(&text).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
        Ok(MasterState {
            epoch: r.try_get("epoch")?,
            seq: r.try_get("seq")?,
            positions,
            now_ms: r.try_get("now_ms")?,
        })
    })
    .transpose()
}

/// The balance and equity a master's owner last wrote (the ratio lot modes need them).
pub async fn account_funds(
    conn: &mut PgConnection,
    id: i64,
) -> Result<(Option<f64>, Option<f64>), sqlx::Error> {
    let row = sqlx::query("SELECT balance, equity FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await?;
    Ok(match row {
        Some(r) => (r.try_get("balance")?, r.try_get("equity")?),
        None => (None, None),
    })
}

/// What a publish attempt did.
#[derive(Debug, Clone, PartialEq)]
pub enum Published {
    /// Stored and announced; the stored snapshot (with `first_seen_ms` stamped).
    Stored(Vec<MasterPosition>),
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
    positions: &[MasterPosition],
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
stored AS (
    INSERT INTO master_state AS s (master_id, epoch, seq, positions, updated_at)
    SELECT $1, $3, $4, stamped.positions, now() FROM owner, stamped
    ON CONFLICT (master_id) DO UPDATE
       SET epoch = excluded.epoch, seq = excluded.seq,
           positions = excluded.positions, updated_at = excluded.updated_at
     WHERE s.epoch < excluded.epoch OR (s.epoch = excluded.epoch AND s.seq = excluded.seq - 1)
    RETURNING s.positions
)
SELECT stored.positions::text AS positions,
       pg_notify($6, CASE WHEN $7::jsonb ->> 'kind' = 'open'
                          THEN jsonb_set($7::jsonb, '{position,first_seen_ms}', to_jsonb(clock.now_ms))
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
        .fetch_optional(conn)
        .await?;
    match row {
        None => Ok(Published::Refused),
        Some(r) => {
            let text: String = r.try_get("positions")?;
            Ok(Published::Stored(
                serde_json::from_str(&text).map_err(|e| sqlx::Error::Decode(Box::new(e)))?,
            ))
        }
    }
}

/// True while (node, epoch) owns account `id`.
pub async fn still_owned(
    conn: &mut PgConnection,
    node_id: &str,
    id: i64,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM trading_accounts WHERE id = $1 AND node_id = $2 AND owner_epoch = $3)")
        .bind(id)
        .bind(node_id)
        .bind(epoch)
        .fetch_one(conn)
        .await
}

/// Records one copy decision about master ticket `master_ticket` under `link_id` (a row of its
/// own: `copy_skips` is a history). `final`: the link never copies that position, and every
/// node's reconcile reads it ([`load_decided`]). Fenced by the follower's (node, epoch); returns
/// false if that no longer owns the follower (nothing is written).
#[allow(clippy::too_many_arguments)]
pub async fn record_decision(
    conn: &mut PgConnection,
    node_id: &str,
    follower_id: i64,
    epoch: i64,
    link_id: i64,
    master_ticket: i64,
    code: &str,
    reason: &str,
    is_final: bool,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO copy_skips (link_id, master_ticket, follower_id, reason, decided_at, code, final, node_id, owner_epoch)
SELECT $4, $5, a.id, $7, now(), $6, $8, $2, $3
  FROM trading_accounts a
 WHERE a.id = $1 AND a.node_id = $2 AND a.owner_epoch = $3
   FOR SHARE
"#;
    let done = sqlx::query(SQL)
        .bind(follower_id)
        .bind(node_id)
        .bind(epoch)
        .bind(link_id)
        .bind(master_ticket)
        .bind(code)
        .bind(reason)
        .bind(is_final)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The (link, master ticket) pairs of a follower that a final decision says never to copy.
pub async fn load_decided(
    conn: &mut PgConnection,
    follower_id: i64,
) -> Result<HashSet<(i64, i64)>, sqlx::Error> {
    let rows: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT DISTINCT link_id, master_ticket FROM copy_skips WHERE follower_id = $1 AND final",
    )
    .bind(follower_id)
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Records the master volume a late copy was sized for. Fenced like [`record_decision`].
#[allow(clippy::too_many_arguments)]
pub async fn record_base(
    conn: &mut PgConnection,
    node_id: &str,
    follower_id: i64,
    epoch: i64,
    copy_ticket: i64,
    link_id: i64,
    master_ticket: i64,
    master_volume: f64,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO copy_bases (follower_id, copy_ticket, link_id, master_ticket, master_volume)
SELECT a.id, $4, $5, $6, $7
  FROM trading_accounts a
 WHERE a.id = $1 AND a.node_id = $2 AND a.owner_epoch = $3
   FOR SHARE
ON CONFLICT (follower_id, copy_ticket) DO UPDATE SET master_volume = excluded.master_volume
"#;
    let done = sqlx::query(SQL)
        .bind(follower_id)
        .bind(node_id)
        .bind(epoch)
        .bind(copy_ticket)
        .bind(link_id)
        .bind(master_ticket)
        .bind(master_volume)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// Late-copy bases of a follower: copy ticket -> master volume.
pub async fn load_bases(
    conn: &mut PgConnection,
    follower_id: i64,
) -> Result<HashMap<i64, f64>, sqlx::Error> {
    let rows =
        sqlx::query("SELECT copy_ticket, master_volume FROM copy_bases WHERE follower_id = $1")
            .bind(follower_id)
            .fetch_all(conn)
            .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("copy_ticket")?, r.try_get("master_volume")?)))
        .collect()
}

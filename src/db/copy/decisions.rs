//! The follower's fenced records: copy decisions (`copy_skips`, a history) and late-copy bases.

use std::collections::{HashMap, HashSet};

use sqlx::postgres::PgRow;
use sqlx::{FromRow, PgConnection};

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
    Ok(load_decided_of(conn, &[follower_id])
        .await?
        .remove(&follower_id)
        .unwrap_or_default())
}

/// [`load_decided`] of many followers in one statement (a follower with none is absent).
pub async fn load_decided_of(
    conn: &mut PgConnection,
    followers: &[i64],
) -> Result<HashMap<i64, HashSet<(i64, i64)>>, sqlx::Error> {
    let rows = sqlx::query(DECIDED_SQL)
        .bind(followers)
        .fetch_all(conn)
        .await?;
    decided_from(&rows)
}

/// [`load_decided_of`]'s statement: $1 the followers' ids (`bigint[]`).
pub(super) const DECIDED_SQL: &str =
    "SELECT DISTINCT follower_id, link_id, master_ticket FROM copy_skips
      WHERE follower_id = ANY($1::bigint[]) AND final";

/// What [`DECIDED_SQL`]'s rows say.
pub(super) fn decided_from(
    rows: &[PgRow],
) -> Result<HashMap<i64, HashSet<(i64, i64)>>, sqlx::Error> {
    let rows: Vec<(i64, i64, i64)> = rows
        .iter()
        .map(FromRow::from_row)
        .collect::<Result<_, _>>()?;
    Ok(super::grouped(rows.into_iter().map(
        |(follower, link, ticket)| (follower, (link, ticket)),
    )))
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
    Ok(load_bases_of(conn, &[follower_id])
        .await?
        .remove(&follower_id)
        .unwrap_or_default())
}

/// [`load_bases`] of many followers in one statement (a follower with none is absent).
pub async fn load_bases_of(
    conn: &mut PgConnection,
    followers: &[i64],
) -> Result<HashMap<i64, HashMap<i64, f64>>, sqlx::Error> {
    let rows = sqlx::query(BASES_SQL)
        .bind(followers)
        .fetch_all(conn)
        .await?;
    bases_from(&rows)
}

/// [`load_bases_of`]' statement: $1 the followers' ids (`bigint[]`).
pub(super) const BASES_SQL: &str = "SELECT follower_id, copy_ticket, master_volume FROM copy_bases
  WHERE follower_id = ANY($1::bigint[])";

/// What [`BASES_SQL`]'s rows say.
pub(super) fn bases_from(rows: &[PgRow]) -> Result<HashMap<i64, HashMap<i64, f64>>, sqlx::Error> {
    let rows: Vec<(i64, i64, f64)> = rows
        .iter()
        .map(FromRow::from_row)
        .collect::<Result<_, _>>()?;
    Ok(super::grouped(rows.into_iter().map(
        |(follower, ticket, volume)| (follower, (ticket, volume)),
    )))
}

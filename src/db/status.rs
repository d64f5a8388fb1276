//! Fenced writes about accounts (guarantee S3, docs/guarantees.md): every statement carries `node_id = $me` and the
//! ownership epoch in its WHERE, so a node that lost an account, or lost and re-claimed it,
//! changes nothing; a row that did not match is reported back as lost.
//!
//! A status write never waits for a row lock: it passes over (`SKIP LOCKED`) the rows another
//! statement holds, which are the node's own lease cycle, a release, or a copy being recorded,
//! and reports them back as busy, to be written with a later batch. Waiting, it held the rows it
//! had locked while it waited, and the lease cycle renewing them waited behind it in turn; on a
//! loaded database the two queued on each other (docs/design/lease.md).

use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgConnection, Postgres, Row};

use crate::model::trade::Currency;

/// One account's latest status, written only if (node, epoch) still own the row.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusUpdate {
    pub account_id: i64,
    pub epoch: i64,
    pub status: Option<String>,
    pub balance: Option<f64>,
    pub equity: Option<f64>,
    /// The currency balance and equity count in, as the broker reports it.
    pub currency: Option<Currency>,
}

/// What a batch did with each (account, epoch) it carried. A pair in neither list no longer
/// owns its row: lost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Written.
    pub written: Vec<(i64, i64)>,
    /// Still (node, epoch)'s as the statement began, but locked by another statement: not
    /// written, to be tried again.
    pub busy: Vec<(i64, i64)>,
}

/// The status write. Parameters: $1 the node, then one array each of the batch's account ids,
/// epochs, statuses, balances, equities and currencies.
///
/// Driven by the batch, each row found by its primary key in a subquery of its own (`OFFSET 0`
/// keeps the planner from merging it, and from pushing the node and epoch test into it), so no
/// plan can reach the rows through `trading_accounts_node_idx` and read the batch again for each
/// of them. With statistics taken while every row was free the planner counts one row for
/// `node_id = $1`, and the join it chose that way re-read the batch for every row the node held:
/// quadratic, in the generic plan a prepared statement settles on (the test
/// `with_statistics_taken_while_every_row_was_free...`).
/// `ours` are the batch's rows still the node's at their epoch in the statement's snapshot;
/// `locked`, those of them no other statement holds (`SKIP LOCKED`), tested again on the version
/// locked (a row changed since the snapshot stays locked until the statement ends, unwritten).
/// The last SELECT reads the snapshot: rows of `ours` not written were locked, or changed (a
/// release, a take-over) since it was taken. Either way the next batch finds out which.
pub const WRITE_SQL: &str = r#"
WITH s AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::float8[], $6::float8[], $7::text[])
        AS s(id, epoch, status, balance, equity, currency)
),
ours AS (
    SELECT s.* FROM s CROSS JOIN LATERAL (
        SELECT a.node_id, a.owner_epoch FROM trading_accounts a WHERE a.id = s.id OFFSET 0) x
     WHERE x.node_id = $1 AND x.owner_epoch = s.epoch
),
locked AS (
    SELECT o.* FROM ours o CROSS JOIN LATERAL (
        SELECT a.node_id, a.owner_epoch FROM trading_accounts a WHERE a.id = o.id
        OFFSET 0 FOR NO KEY UPDATE SKIP LOCKED) x
     WHERE x.node_id = $1 AND x.owner_epoch = o.epoch
),
written AS (
    UPDATE trading_accounts a
       SET status    = coalesce(l.status, a.status),
           status_at = now(),
           balance   = coalesce(l.balance, a.balance),
           equity    = coalesce(l.equity, a.equity),
           currency  = coalesce(l.currency, a.currency)
      FROM locked l
     WHERE a.id = l.id
    RETURNING a.id, a.owner_epoch
)
SELECT id, owner_epoch, true AS written FROM written
UNION ALL
SELECT o.id, o.epoch, false FROM ours o
 WHERE o.id NOT IN (SELECT id FROM written)
"#;

/// `sql` (the status write, or a statement around it such as an `EXPLAIN`) with a batch bound
/// as [`WRITE_SQL`]'s parameters.
pub fn bind_batch<'q>(
    sql: &'q str,
    node_id: &'q str,
    batch: &[StatusUpdate],
) -> Query<'q, Postgres, PgArguments> {
    let ids: Vec<i64> = batch.iter().map(|u| u.account_id).collect();
    let epochs: Vec<i64> = batch.iter().map(|u| u.epoch).collect();
    let statuses: Vec<Option<String>> = batch.iter().map(|u| u.status.clone()).collect();
    let balances: Vec<Option<f64>> = batch.iter().map(|u| u.balance).collect();
    let equities: Vec<Option<f64>> = batch.iter().map(|u| u.equity).collect();
    let currencies: Vec<Option<String>> =
        batch.iter().map(|u| u.currency.map(String::from)).collect();
    sqlx::query(sql)
        .bind(node_id)
        .bind(ids)
        .bind(epochs)
        .bind(statuses)
        .bind(balances)
        .bind(equities)
        .bind(currencies)
}

/// Writes a batch in one statement, passing over the rows another statement holds.
/// Fields left `None` keep their stored value.
pub async fn write_batch(
    conn: &mut PgConnection,
    node_id: &str,
    batch: &[StatusUpdate],
) -> Result<Outcome, sqlx::Error> {
    let rows = bind_batch(WRITE_SQL, node_id, batch)
        .fetch_all(conn)
        .await?;
    let mut out = Outcome::default();
    for r in &rows {
        let pair = (r.try_get("id")?, r.try_get("owner_epoch")?);
        if r.try_get("written")? {
            out.written.push(pair);
        } else {
            out.busy.push(pair);
        }
    }
    Ok(out)
}

//! Fenced writes about accounts (guarantee S3, docs/guarantees.md): every statement carries `node_id = $me` and the
//! ownership epoch in its WHERE, so a node that lost an account, or lost and re-claimed it,
//! changes nothing; a row that did not match is reported back as lost.

use sqlx::{PgConnection, Row};

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

/// Writes a batch in one statement; returns the (account, epoch) pairs that matched.
/// Fields left `None` keep their stored value.
pub async fn write_batch(
    conn: &mut PgConnection,
    node_id: &str,
    batch: &[StatusUpdate],
) -> Result<Vec<(i64, i64)>, sqlx::Error> {
    const SQL: &str = r#"
WITH s AS (
    SELECT * FROM unnest($2::bigint[], $3::bigint[], $4::text[], $5::float8[], $6::float8[], $7::text[])
        AS s(id, epoch, status, balance, equity, currency)
),
locked AS (
    SELECT a.id FROM trading_accounts a JOIN s ON a.id = s.id
     WHERE a.node_id = $1 AND a.owner_epoch = s.epoch
     ORDER BY a.id
       FOR NO KEY UPDATE OF a
)
UPDATE trading_accounts a
   SET status    = coalesce(s.status, a.status),
       status_at = now(),
       balance   = coalesce(s.balance, a.balance),
       equity    = coalesce(s.equity, a.equity),
       currency  = coalesce(s.currency, a.currency)
  FROM s
 WHERE a.id = s.id AND a.id IN (SELECT id FROM locked)
   AND a.node_id = $1 AND a.owner_epoch = s.epoch
RETURNING a.id, a.owner_epoch
"#;
    let ids: Vec<i64> = batch.iter().map(|u| u.account_id).collect();
    let epochs: Vec<i64> = batch.iter().map(|u| u.epoch).collect();
    let statuses: Vec<Option<String>> = batch.iter().map(|u| u.status.clone()).collect();
    let balances: Vec<Option<f64>> = batch.iter().map(|u| u.balance).collect();
    let equities: Vec<Option<f64>> = batch.iter().map(|u| u.equity).collect();
    let currencies: Vec<Option<String>> =
        batch.iter().map(|u| u.currency.map(String::from)).collect();
    let rows = sqlx::query(SQL)
        .bind(node_id)
        .bind(ids)
        .bind(epochs)
        .bind(statuses)
        .bind(balances)
        .bind(equities)
        .bind(currencies)
        .fetch_all(conn)
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("owner_epoch")?)))
        .collect()
}

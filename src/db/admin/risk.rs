//! Followers' risk limits as operators see and change them (`copier-node risk ...`).

use serde::Serialize;
use sqlx::{PgConnection, Row};

use crate::model::risk::{Basis, Period, RiskAction};

/// A limit's row as `risk list` prints it (the JSON shape is this struct's).
#[derive(Debug, Serialize)]
pub struct LimitView {
    pub id: i64,
    pub account_id: i64,
    pub period: String,
    pub basis: String,
    pub relative: bool,
    pub amount: f64,
    pub action: String,
    pub period_key: Option<String>,
    pub start_value: Option<f64>,
    pub hit_reason: Option<String>,
    pub hit_at: Option<String>,
}

/// A new limit.
#[derive(Debug, Clone, Copy)]
pub struct NewLimit {
    pub account_id: i64,
    pub period: Period,
    pub basis: Basis,
    pub relative: bool,
    pub amount: f64,
    pub action: RiskAction,
}

/// Adds a limit: its id, or the id of the limit the account already has for that period and
/// basis (one each: `Err` carries it, nothing is added).
pub async fn add(conn: &mut PgConnection, l: &NewLimit) -> Result<Result<i64, i64>, sqlx::Error> {
    let added: Option<i64> = sqlx::query_scalar(
        "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
         VALUES ($1, $2, $3, $4, $5, $6)
         ON CONFLICT (account_id, period, basis) DO NOTHING RETURNING id",
    )
    .bind(l.account_id)
    .bind(l.period.as_str())
    .bind(l.basis.as_str())
    .bind(l.relative)
    .bind(l.amount)
    .bind(l.action.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    if let Some(id) = added {
        return Ok(Ok(id));
    }
    let existing: i64 = sqlx::query_scalar(
        "SELECT id FROM risk_limits WHERE account_id = $1 AND period = $2 AND basis = $3",
    )
    .bind(l.account_id)
    .bind(l.period.as_str())
    .bind(l.basis.as_str())
    .fetch_one(conn)
    .await?;
    Ok(Err(existing))
}

/// The limits (of `account`, and limit `id`, if given), by account and id.
pub async fn list(
    conn: &mut PgConnection,
    account: Option<i64>,
    id: Option<i64>,
) -> Result<Vec<LimitView>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, account_id, period, basis, relative, amount, action, period_key, start_value,
                hit_reason, to_char(hit_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS hit_at
           FROM risk_limits
          WHERE ($1::bigint IS NULL OR account_id = $1) AND ($2::bigint IS NULL OR id = $2)
          ORDER BY account_id, id",
    )
    .bind(account)
    .bind(id)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(LimitView {
                id: r.try_get("id")?,
                account_id: r.try_get("account_id")?,
                period: r.try_get("period")?,
                basis: r.try_get("basis")?,
                relative: r.try_get("relative")?,
                amount: r.try_get("amount")?,
                action: r.try_get("action")?,
                period_key: r.try_get("period_key")?,
                start_value: r.try_get("start_value")?,
                hit_reason: r.try_get("hit_reason")?,
                hit_at: r.try_get("hit_at")?,
            })
        })
        .collect()
}

/// Resets the limits of `account` (or only limit `id`): clearing the state is the reset, the
/// owner's next reading starts each period again. How many were reset.
pub async fn reset(
    conn: &mut PgConnection,
    account: i64,
    id: Option<i64>,
) -> Result<u64, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE risk_limits
            SET period_key = NULL, start_value = NULL, hit_at = NULL, hit_reason = NULL,
                updated_at = now()
          WHERE account_id = $1 AND ($2::bigint IS NULL OR id = $2)",
    )
    .bind(account)
    .bind(id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
}

/// Removes limit `id`; false when there is no such limit.
pub async fn remove(conn: &mut PgConnection, id: i64) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM risk_limits WHERE id = $1")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

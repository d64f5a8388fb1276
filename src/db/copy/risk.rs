//! A follower's risk limits (`risk_limits`, migration 13): read with its links, and their state
//! written by the account's owner, fenced.

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::model::risk::{Basis, Period, RiskAction, RiskLimit, RiskState};

/// The columns of a risk limit, as [`risk_from_row`] reads them.
pub(crate) const RISK_COLUMNS: &str =
    "id, period, basis, relative, amount, action, period_key, start_value, hit_reason";

/// One `risk_limits` row with its state. A row the node cannot read (a value another release
/// wrote) is an error naming it.
pub(crate) fn risk_from_row(r: &PgRow) -> Result<RiskLimit, sqlx::Error> {
    let id: i64 = r.try_get("id")?;
    let bad = |column: &str, value: String| {
        sqlx::Error::Decode(format!("risk_limits row {id}: unknown {column} {value:?}").into())
    };
    let period: String = r.try_get("period")?;
    let basis: String = r.try_get("basis")?;
    let action: String = r.try_get("action")?;
    Ok(RiskLimit {
        id,
        period: Period::parse(&period).ok_or_else(|| bad("period", period.clone()))?,
        basis: Basis::parse(&basis).ok_or_else(|| bad("basis", basis.clone()))?,
        relative: r.try_get("relative")?,
        amount: r.try_get("amount")?,
        action: RiskAction::parse(&action).ok_or_else(|| bad("action", action.clone()))?,
        state: RiskState {
            period_key: r.try_get("period_key")?,
            start_value: r.try_get("start_value")?,
            hit: r.try_get("hit_reason")?,
        },
    })
}

/// What became of a state write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    Saved,
    /// The account is no longer this node's at this epoch: nothing written.
    NotOwner,
    /// The limit is gone, or its row no longer holds the state this node last read (an
    /// operator reset it): nothing written; read the limits again.
    Changed,
}

/// Stores a limit's state, replacing `old` (what this node last read or wrote), fenced by the
/// account's owner. `hit_at` keeps the moment the limit was first reached in the period.
pub async fn save_risk_state(
    conn: &mut PgConnection,
    node_id: &str,
    account: i64,
    epoch: i64,
    limit: i64,
    old: &RiskState,
    state: &RiskState,
) -> Result<Saved, sqlx::Error> {
    let (owner, updated): (i64, i64) = sqlx::query_as(
        "WITH owner AS (
             SELECT id FROM trading_accounts
              WHERE id = $2 AND node_id = $1 AND owner_epoch = $3
                FOR SHARE),
         updated AS (
             UPDATE risk_limits r
                SET period_key = $5, start_value = $6, hit_reason = $7,
                    hit_at = CASE WHEN $7::text IS NULL THEN NULL ELSE coalesce(r.hit_at, now()) END,
                    updated_at = now()
               FROM owner
              WHERE r.id = $4 AND r.account_id = owner.id
                AND r.period_key IS NOT DISTINCT FROM $8
                AND r.start_value IS NOT DISTINCT FROM $9
                AND r.hit_reason IS NOT DISTINCT FROM $10
          RETURNING r.id)
         SELECT (SELECT count(*) FROM owner), (SELECT count(*) FROM updated)",
    )
    .bind(node_id)
    .bind(account)
    .bind(epoch)
    .bind(limit)
    .bind(&state.period_key)
    .bind(state.start_value)
    .bind(&state.hit)
    .bind(&old.period_key)
    .bind(old.start_value)
    .bind(&old.hit)
    .fetch_one(conn)
    .await?;
    Ok(match (owner, updated) {
        (0, _) => Saved::NotOwner,
        (_, 0) => Saved::Changed,
        _ => Saved::Saved,
    })
}

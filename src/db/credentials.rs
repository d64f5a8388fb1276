//! The operator's side of broker credentials: reading and replacing stored values (key rotation).
//! Nodes read an account's value only in its session, through [`super::copy::load_account`].

use sqlx::{PgConnection, Row};

/// Every account with a stored credentials value: (id, value).
pub async fn stored(conn: &mut PgConnection) -> Result<Vec<(i64, String)>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, credentials FROM trading_accounts WHERE credentials IS NOT NULL ORDER BY id",
    )
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("id")?, r.try_get("credentials")?)))
        .collect()
}

/// Replaces an account's value only if it is still `old` (an operator's concurrent change wins).
/// Returns whether it was replaced.
pub async fn replace(
    conn: &mut PgConnection,
    id: i64,
    old: &str,
    new: &str,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE trading_accounts SET credentials = $3 WHERE id = $1 AND credentials = $2",
    )
    .bind(id)
    .bind(old)
    .bind(new)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() == 1)
}

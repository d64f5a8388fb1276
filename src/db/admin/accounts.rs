//! Accounts as operators see and change them (`copier-node accounts ...`).

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// An account as `accounts list` and `show` print it (the JSON shape is this struct's).
#[derive(Debug, Serialize)]
pub struct AccountView {
    pub id: i64,
    pub platform: String,
    pub role: String,
    pub enabled: bool,
    pub server: String,
    pub login: String,
    pub has_password: bool,
    /// The node whose lease on it is live.
    pub owner: Option<String>,
    pub status: Option<String>,
    pub currency: Option<String>,
    pub max_open_copies: Option<i64>,
}

const SELECT: &str =
    "SELECT id, platform, role, enabled, server, login, credentials IS NOT NULL AS has_password,
        CASE WHEN lease_until > now() THEN node_id END AS owner, status, currency,
        max_open_copies::bigint AS max_open_copies
   FROM trading_accounts";

fn view_of(r: &sqlx::postgres::PgRow) -> Result<AccountView, sqlx::Error> {
    Ok(AccountView {
        id: r.try_get("id")?,
        platform: r.try_get("platform")?,
        role: r.try_get("role")?,
        enabled: r.try_get("enabled")?,
        server: r.try_get("server")?,
        login: r.try_get("login")?,
        has_password: r.try_get("has_password")?,
        owner: r.try_get("owner")?,
        status: r.try_get("status")?,
        currency: r.try_get("currency")?,
        max_open_copies: r.try_get("max_open_copies")?,
    })
}

/// Every account (of `platform`, if given), by id.
pub async fn list(
    conn: &mut PgConnection,
    platform: Option<&str>,
) -> Result<Vec<AccountView>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "{SELECT} WHERE $1::text IS NULL OR platform = $1 ORDER BY id"
    ))
    .bind(platform)
    .fetch_all(conn)
    .await?;
    rows.iter().map(view_of).collect()
}

/// Account `id`, if it exists.
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<AccountView>, sqlx::Error> {
    let row = sqlx::query(&format!("{SELECT} WHERE id = $1"))
        .bind(id)
        .fetch_optional(conn)
        .await?;
    row.as_ref().map(view_of).transpose()
}

/// A new account's row (its `credentials` already encrypted).
#[derive(Debug)]
pub struct NewAccount<'a> {
    pub id: i64,
    pub platform: &'a str,
    pub role: &'a str,
    pub server: &'a str,
    pub login: &'a str,
    pub credentials: Option<String>,
    pub enabled: bool,
}

/// Adds an account (the schema refuses a taken id or a role it does not know).
pub async fn add(conn: &mut PgConnection, a: &NewAccount<'_>) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO trading_accounts (id, platform, role, server, login, credentials, enabled)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(a.id)
    .bind(a.platform)
    .bind(a.role)
    .bind(a.server)
    .bind(a.login)
    .bind(&a.credentials)
    .bind(a.enabled)
    .execute(conn)
    .await?;
    Ok(())
}

/// Locks account `id`'s row for a change (a concurrent `links add` waits for it, and sees it).
pub async fn lock(conn: &mut PgConnection, id: i64) -> Result<(), sqlx::Error> {
    sqlx::query("SELECT FROM trading_accounts WHERE id = $1 FOR UPDATE")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(())
}

/// The copy links that hold account `id` in the role other than `role` (a role change would
/// leave them pointing the wrong way).
pub async fn links_in_other_role(
    conn: &mut PgConnection,
    id: i64,
    role: &str,
) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM copy_links WHERE (master_id = $1 AND $2 <> 'master') OR (follower_id = $1 AND $2 <> 'follower') ORDER BY id",
    )
    .bind(id)
    .bind(role)
    .fetch_all(conn)
    .await
}

/// Every copy link of account `id`, as master or follower.
pub async fn links_of(conn: &mut PgConnection, id: i64) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT id FROM copy_links WHERE master_id = $1 OR follower_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(conn)
    .await
}

/// A change of an account's fields: `None` keeps a field as it is.
#[derive(Debug, Default)]
pub struct AccountChange<'a> {
    pub platform: Option<&'a str>,
    pub role: Option<&'a str>,
    pub server: Option<&'a str>,
    pub login: Option<&'a str>,
    pub credentials: Option<String>,
    pub clear_password: bool,
    pub enabled: Option<bool>,
    /// `Some(None)` lifts the limit.
    pub max_open_copies: Option<Option<i64>>,
}

/// Changes account `id`; false when there is no such account.
pub async fn set(
    conn: &mut PgConnection,
    id: i64,
    c: &AccountChange<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE trading_accounts SET
            platform = coalesce($2, platform), role = coalesce($3, role),
            server = coalesce($4, server), login = coalesce($5, login),
            credentials = CASE WHEN $7 THEN NULL ELSE coalesce($6, credentials) END,
            enabled = coalesce($8, enabled),
            max_open_copies = CASE WHEN $9 THEN $10::integer ELSE max_open_copies END
          WHERE id = $1",
    )
    .bind(id)
    .bind(c.platform)
    .bind(c.role)
    .bind(c.server)
    .bind(c.login)
    .bind(&c.credentials)
    .bind(c.clear_password)
    .bind(c.enabled)
    .bind(c.max_open_copies.is_some())
    .bind(c.max_open_copies.flatten())
    .execute(conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Disables account `id` (its owner releases it at its next cycle); false when there is no
/// such account.
pub async fn disable(conn: &mut PgConnection, id: i64) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = $1")
        .bind(id)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// Deletes account `id` if no node may still trade it: no owner, or an owner whose membership
/// expired outside a database failover grace (during a grace the new primary may lack the
/// owner's last renewals, and the owner may still trust its gate). True when deleted.
pub async fn delete_if_untraded(conn: &mut PgConnection, id: i64) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM trading_accounts a WHERE a.id = $1
           AND (a.node_id IS NULL
                OR (NOT EXISTS (SELECT FROM nodes n WHERE n.node_id = a.node_id AND n.lease_until > now())
                    AND NOT EXISTS (SELECT FROM copier_database d WHERE d.claims_after > now())))",
    )
    .bind(id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Account `id`'s owner column: `None` when there is no such account, `Some(None)` when no
/// node holds it.
pub async fn owner(
    conn: &mut PgConnection,
    id: i64,
) -> Result<Option<Option<String>>, sqlx::Error> {
    sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// Account `id`'s role and server, if it exists.
pub async fn role_and_server(
    conn: &mut PgConnection,
    id: i64,
) -> Result<Option<(String, String)>, sqlx::Error> {
    sqlx::query_as("SELECT role, server FROM trading_accounts WHERE id = $1")
        .bind(id)
        .fetch_optional(conn)
        .await
}

/// The role and platform of the accounts among `ids` that exist, their rows locked `FOR SHARE`
/// (a link made meanwhile sees them as they are).
pub async fn roles_for_share(
    conn: &mut PgConnection,
    ids: &[i64],
) -> Result<Vec<(i64, String, String)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, role, platform FROM trading_accounts WHERE id = ANY($1) ORDER BY id FOR SHARE",
    )
    .bind(ids)
    .fetch_all(conn)
    .await
}

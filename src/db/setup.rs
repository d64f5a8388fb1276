//! What an operator or a control plane writes: databases, accounts and links (the demo seeds
//! with these; a command line for operators would too).

use std::collections::HashMap;

use sqlx::{Executor, PgConnection};

/// `CREATE DATABASE name` (`name` is made by the caller from digits, letters and underscores).
pub async fn create_database(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    conn.execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .map(|_| ())
}

/// `DROP DATABASE IF EXISTS name WITH (FORCE)`: ends its sessions too.
pub async fn drop_database(conn: &mut PgConnection, name: &str) -> Result<(), sqlx::Error> {
    conn.execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
        .await
        .map(|_| ())
}

/// Adds an account of `platform`.
pub async fn add_account(
    conn: &mut PgConnection,
    id: i64,
    platform: &str,
    role: &str,
    server: &str,
    login: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO trading_accounts (id, platform, role, server, login) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(id)
    .bind(platform)
    .bind(role)
    .bind(server)
    .bind(login)
    .execute(conn)
    .await
    .map(|_| ())
}

/// Adds a copy link with its lot mode, lot value, reverse and symbol map (JSON text); every
/// other setting keeps the schema's default.
pub async fn add_link(
    conn: &mut PgConnection,
    master: i64,
    follower: i64,
    lot_mode: &str,
    lot_value: f64,
    reverse: bool,
    symbol_map: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO copy_links (master_id, follower_id, lot_mode, lot_value, reverse, symbol_map) VALUES ($1, $2, $3, $4, $5, $6::jsonb)",
    )
    .bind(master)
    .bind(follower)
    .bind(lot_mode)
    .bind(lot_value)
    .bind(reverse)
    .bind(symbol_map)
    .execute(conn)
    .await
    .map(|_| ())
}

/// Every account id.
pub async fn account_ids(conn: &mut PgConnection) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM trading_accounts ORDER BY id")
        .fetch_all(conn)
        .await
}

/// Stores an account's credentials value (already encrypted: `enc:v1:...`).
pub async fn set_credentials(
    conn: &mut PgConnection,
    id: i64,
    value: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE trading_accounts SET credentials = $2 WHERE id = $1")
        .bind(id)
        .bind(value)
        .execute(conn)
        .await
        .map(|_| ())
}

/// Account id -> owner, for every account with a live lease.
pub async fn live_owners(conn: &mut PgConnection) -> Result<HashMap<i64, String>, sqlx::Error> {
    let rows: Vec<(i64, String)> = sqlx::query_as(
        "SELECT id, node_id FROM trading_accounts WHERE node_id IS NOT NULL AND lease_until >= now()",
    )
    .fetch_all(conn)
    .await?;
    Ok(rows.into_iter().collect())
}

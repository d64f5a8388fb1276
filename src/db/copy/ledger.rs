//! The copy ledger (`migrations/0009_copy_ledger.sql`): a row per copy, fenced like every write
//! of the follower's session.

use sqlx::{PgConnection, Row};

/// One copy as the ledger records it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct CopyRecord {
    /// The follower's broker account (server and login) the copy is on.
    pub server: String,
    pub login: String,
    pub follower_ticket: i64,
    pub link_id: i64,
    pub master_id: i64,
    pub master_ticket: i64,
    pub symbol: String,
    pub side: String,
    pub volume: f64,
    pub requested_price: Option<f64>,
    pub filled_price: f64,
    pub slippage: Option<f64>,
    pub slippage_bps: Option<f64>,
    /// Slippage in points of the follower's symbol (when its broker gives the point size).
    pub slippage_points: Option<f64>,
    pub master_fill_ms: Option<i64>,
    pub event_committed_ms: Option<i64>,
    pub decided_ms: Option<i64>,
    pub accepted_ms: Option<i64>,
    pub found_by_reconcile: bool,
}

/// Records a copy (once per follower ticket). Fenced by the follower's (node, epoch); false if
/// that no longer owns the follower (nothing is written).
pub async fn record_copy(
    conn: &mut PgConnection,
    node_id: &str,
    follower_id: i64,
    epoch: i64,
    c: &CopyRecord,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO copy_ledger (follower_id, follower_ticket, link_id, master_id, master_ticket, symbol, side, volume,
                         requested_price, filled_price, slippage, slippage_bps, master_fill_ms,
                         event_committed_ms, decided_ms, accepted_ms, found_by_reconcile, node_id, owner_epoch,
                         server, login, master_server, master_login, slippage_points)
SELECT a.id, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $2, $3, $20, $21,
       coalesce(m.server, ''), coalesce(m.login, ''), $22
  FROM trading_accounts a
  LEFT JOIN trading_accounts m ON m.id = $6
 WHERE a.id = $1 AND a.node_id = $2 AND a.owner_epoch = $3
   FOR SHARE OF a
ON CONFLICT (follower_id, server, login, follower_ticket) DO NOTHING
"#;
    let done = sqlx::query(SQL)
        .bind(follower_id)
        .bind(node_id)
        .bind(epoch)
        .bind(c.follower_ticket)
        .bind(c.link_id)
        .bind(c.master_id)
        .bind(c.master_ticket)
        .bind(&c.symbol)
        .bind(&c.side)
        .bind(c.volume)
        .bind(c.requested_price)
        .bind(c.filled_price)
        .bind(c.slippage)
        .bind(c.slippage_bps)
        .bind(c.master_fill_ms)
        .bind(c.event_committed_ms)
        .bind(c.decided_ms)
        .bind(c.accepted_ms)
        .bind(c.found_by_reconcile)
        .bind(&c.server)
        .bind(&c.login)
        .bind(c.slippage_points)
        .execute(conn)
        .await?;
    Ok(done.rows_affected() > 0)
}

/// Every (link, master ticket, follower ticket) the follower ever held a copy of.
pub async fn copied(
    conn: &mut PgConnection,
    follower_id: i64,
    server: &str,
    login: &str,
) -> Result<Vec<(i64, i64, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT l.link_id, l.master_ticket, l.follower_ticket
           FROM copy_ledger l JOIN trading_accounts m ON m.id = l.master_id
          WHERE l.follower_id = $1 AND l.server = $2 AND l.login = $3
            AND l.master_server = m.server AND l.master_login = m.login",
    )
    .bind(follower_id)
    .bind(server)
    .bind(login)
    .fetch_all(conn)
    .await
}

/// The follower's most recent copies, newest first.
pub async fn recent(
    conn: &mut PgConnection,
    follower_id: i64,
    limit: i64,
) -> Result<Vec<CopyRecord>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT server, login, follower_ticket, link_id, master_id, master_ticket, symbol, side, volume, requested_price,
                filled_price, slippage, slippage_bps, slippage_points, master_fill_ms, event_committed_ms,
                decided_ms, accepted_ms, found_by_reconcile
           FROM copy_ledger WHERE follower_id = $1 ORDER BY recorded_at DESC, follower_ticket DESC LIMIT $2",
    )
    .bind(follower_id)
    .bind(limit)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(CopyRecord {
                server: r.try_get("server")?,
                login: r.try_get("login")?,
                follower_ticket: r.try_get("follower_ticket")?,
                link_id: r.try_get("link_id")?,
                master_id: r.try_get("master_id")?,
                master_ticket: r.try_get("master_ticket")?,
                symbol: r.try_get("symbol")?,
                side: r.try_get("side")?,
                volume: r.try_get("volume")?,
                requested_price: r.try_get("requested_price")?,
                filled_price: r.try_get("filled_price")?,
                slippage: r.try_get("slippage")?,
                slippage_bps: r.try_get("slippage_bps")?,
                slippage_points: r.try_get("slippage_points")?,
                master_fill_ms: r.try_get("master_fill_ms")?,
                event_committed_ms: r.try_get("event_committed_ms")?,
                decided_ms: r.try_get("decided_ms")?,
                accepted_ms: r.try_get("accepted_ms")?,
                found_by_reconcile: r.try_get("found_by_reconcile")?,
            })
        })
        .collect()
}

/// Which pending copy: (link, master, master ticket) on the follower's broker account.
#[derive(Debug, Clone, Copy)]
pub struct OrderCopy<'a> {
    pub follower_id: i64,
    pub server: &'a str,
    pub login: &'a str,
    pub link_id: i64,
    pub master_id: i64,
    pub master_ticket: i64,
}

/// Records that a pending copy is being placed (before the place is sent), or was found by its
/// marker (`ticket` known): `order_copies` (`migrations/0014_pending_orders.sql`). Placing again
/// after a refusal for now clears `ended`. Fenced by the follower's (node, epoch): false if that
/// no longer owns the follower (nothing is written, nothing may be sent).
pub async fn record_order_copy(
    conn: &mut PgConnection,
    (node_id, epoch): (&str, i64),
    c: OrderCopy<'_>,
    ticket: Option<i64>,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
WITH owner AS (
    SELECT id FROM trading_accounts WHERE id = $1 AND node_id = $2 AND owner_epoch = $3 FOR SHARE
),
stored AS (
    INSERT INTO order_copies AS o (follower_id, server, login, link_id, master_id, master_server,
                                   master_login, master_ticket, follower_ticket, node_id, owner_epoch)
    SELECT owner.id, $4, $5, $6, $7, coalesce(m.server, ''), coalesce(m.login, ''), $8, $9, $2, $3
      FROM owner LEFT JOIN trading_accounts m ON m.id = $7
    ON CONFLICT (follower_id, server, login, link_id, master_server, master_login, master_ticket)
    DO UPDATE SET follower_ticket = coalesce(excluded.follower_ticket, o.follower_ticket),
                  ended = CASE WHEN excluded.follower_ticket IS NULL THEN NULL ELSE o.ended END,
                  ended_at = CASE WHEN excluded.follower_ticket IS NULL THEN NULL ELSE o.ended_at END
    RETURNING 1
)
SELECT count(*) FROM owner
"#;
    let owned: i64 = sqlx::query_scalar(SQL)
        .bind(c.follower_id)
        .bind(node_id)
        .bind(epoch)
        .bind(c.server)
        .bind(c.login)
        .bind(c.link_id)
        .bind(c.master_id)
        .bind(c.master_ticket)
        .bind(ticket)
        .fetch_one(conn)
        .await?;
    Ok(owned > 0)
}

/// Records how a pending copy left the book without a fill (`cancelled`, `expired`,
/// `refused`), fenced like [`record_order_copy`]. False if this no longer owns the follower.
pub async fn end_order_copy(
    conn: &mut PgConnection,
    (node_id, epoch): (&str, i64),
    c: OrderCopy<'_>,
    ended: &str,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
WITH owner AS (
    SELECT id FROM trading_accounts WHERE id = $1 AND node_id = $2 AND owner_epoch = $3 FOR SHARE
),
done AS (
    UPDATE order_copies o SET ended = $9, ended_at = now()
      FROM owner, trading_accounts m
     WHERE o.follower_id = owner.id AND o.server = $4 AND o.login = $5 AND o.link_id = $6
       AND m.id = $7 AND o.master_server = m.server AND o.master_login = m.login
       AND o.master_ticket = $8 AND o.ended IS NULL
    RETURNING 1
)
SELECT count(*) FROM owner
"#;
    fenced_on_order_copy(conn, SQL, (node_id, epoch), c, Some(ended)).await
}

/// Deletes the record of a pending copy that put nothing on the book (refused for now, never
/// sent), so it may be placed again; fenced like [`record_order_copy`]. Only a row without a
/// ticket goes. False if this no longer owns the follower.
pub async fn forget_order_copy(
    conn: &mut PgConnection,
    (node_id, epoch): (&str, i64),
    c: OrderCopy<'_>,
) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
WITH owner AS (
    SELECT id FROM trading_accounts WHERE id = $1 AND node_id = $2 AND owner_epoch = $3 FOR SHARE
),
done AS (
    DELETE FROM order_copies o
     USING owner, trading_accounts m
     WHERE o.follower_id = owner.id AND o.server = $4 AND o.login = $5 AND o.link_id = $6
       AND m.id = $7 AND o.master_server = m.server AND o.master_login = m.login
       AND o.master_ticket = $8 AND o.follower_ticket IS NULL
    RETURNING 1
)
SELECT count(*) FROM owner
"#;
    fenced_on_order_copy(conn, SQL, (node_id, epoch), c, None).await
}

/// Runs one statement on an `order_copies` row whose parameters are the follower and fence
/// ($1-$3), the row's key ($4-$8) and optionally `ended` ($9), and that answers how many rows
/// the owner check matched: true when this (node, epoch) owns the follower.
async fn fenced_on_order_copy(
    conn: &mut PgConnection,
    sql: &str,
    (node_id, epoch): (&str, i64),
    c: OrderCopy<'_>,
    ended: Option<&str>,
) -> Result<bool, sqlx::Error> {
    let mut query = sqlx::query_scalar::<_, i64>(sql)
        .bind(c.follower_id)
        .bind(node_id)
        .bind(epoch)
        .bind(c.server)
        .bind(c.login)
        .bind(c.link_id)
        .bind(c.master_id)
        .bind(c.master_ticket);
    if let Some(ended) = ended {
        query = query.bind(ended);
    }
    Ok(query.fetch_one(conn).await? > 0)
}

/// Every pending copy the follower's broker account ever placed for its masters' current
/// accounts: (link, master ticket, its ticket if known, ended without a fill).
pub async fn placed(
    conn: &mut PgConnection,
    follower_id: i64,
    server: &str,
    login: &str,
) -> Result<Vec<(i64, i64, Option<i64>, bool)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT o.link_id, o.master_ticket, o.follower_ticket, o.ended IS NOT NULL
           FROM order_copies o JOIN trading_accounts m ON m.id = o.master_id
          WHERE o.follower_id = $1 AND o.server = $2 AND o.login = $3
            AND o.master_server = m.server AND o.master_login = m.login",
    )
    .bind(follower_id)
    .bind(server)
    .bind(login)
    .fetch_all(conn)
    .await
}

//! Copy links as operators see and change them (`copier-node links ...`).

use serde::Serialize;
use sqlx::{PgConnection, Row};

/// A link as `links list` and `show` print it (the JSON shape is this struct's).
#[derive(Debug, Serialize)]
pub struct LinkView {
    pub id: i64,
    pub master_id: i64,
    pub follower_id: i64,
    pub enabled: bool,
    pub magic: i64,
    pub lot_mode: String,
    pub lot_value: f64,
    pub reverse: bool,
    pub copy_sl_tp: bool,
    pub symbol_map: serde_json::Value,
    pub copy_existing: bool,
    pub symbols: Option<Vec<String>>,
    pub magics: Option<Vec<i64>>,
    pub sides: String,
    pub close_only: bool,
    pub max_lot: Option<f64>,
    pub max_delay_ms: Option<i64>,
    pub max_slippage: Option<f64>,
    pub equity_stop: Option<f64>,
    pub copy_sl: bool,
    pub copy_tp: bool,
    pub max_sl_distance: Option<f64>,
    pub use_min_lot: bool,
    pub min_master_lot: Option<f64>,
    pub max_open_copies: Option<i64>,
    pub sl_points: Option<f64>,
    pub tp_points: Option<f64>,
    pub on_remove: String,
    pub pending_orders: String,
}

const SELECT: &str =
    "SELECT id, master_id, follower_id, enabled, magic, lot_mode, lot_value, reverse, copy_sl_tp,
        symbol_map::text AS symbol_map, copy_existing, symbols, magics, sides, close_only, max_lot,
        max_delay_ms, max_slippage, equity_stop, copy_sl, copy_tp, max_sl_distance, use_min_lot,
        min_master_lot, max_open_copies::bigint AS max_open_copies, sl_points, tp_points, on_remove,
        pending_orders
   FROM copy_links";

fn view_of(r: &sqlx::postgres::PgRow) -> Result<LinkView, sqlx::Error> {
    let map: String = r.try_get("symbol_map")?;
    Ok(LinkView {
        id: r.try_get("id")?,
        master_id: r.try_get("master_id")?,
        follower_id: r.try_get("follower_id")?,
        enabled: r.try_get("enabled")?,
        magic: r.try_get("magic")?,
        lot_mode: r.try_get("lot_mode")?,
        lot_value: r.try_get("lot_value")?,
        reverse: r.try_get("reverse")?,
        copy_sl_tp: r.try_get("copy_sl_tp")?,
        symbol_map: serde_json::from_str(&map).unwrap_or(serde_json::Value::Null),
        copy_existing: r.try_get("copy_existing")?,
        symbols: r.try_get("symbols")?,
        magics: r.try_get("magics")?,
        sides: r.try_get("sides")?,
        close_only: r.try_get("close_only")?,
        max_lot: r.try_get("max_lot")?,
        max_delay_ms: r.try_get("max_delay_ms")?,
        max_slippage: r.try_get("max_slippage")?,
        equity_stop: r.try_get("equity_stop")?,
        copy_sl: r.try_get("copy_sl")?,
        copy_tp: r.try_get("copy_tp")?,
        max_sl_distance: r.try_get("max_sl_distance")?,
        use_min_lot: r.try_get("use_min_lot")?,
        min_master_lot: r.try_get("min_master_lot")?,
        max_open_copies: r.try_get("max_open_copies")?,
        sl_points: r.try_get("sl_points")?,
        tp_points: r.try_get("tp_points")?,
        on_remove: r.try_get("on_remove")?,
        pending_orders: r.try_get("pending_orders")?,
    })
}

/// Every link (of `master` and `follower`, if given), by id.
pub async fn list(
    conn: &mut PgConnection,
    master: Option<i64>,
    follower: Option<i64>,
) -> Result<Vec<LinkView>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "{SELECT} WHERE ($1::bigint IS NULL OR master_id = $1) AND ($2::bigint IS NULL OR follower_id = $2) ORDER BY id"
    ))
    .bind(master)
    .bind(follower)
    .fetch_all(conn)
    .await?;
    rows.iter().map(view_of).collect()
}

/// Link `id`, if it exists.
pub async fn get(conn: &mut PgConnection, id: i64) -> Result<Option<LinkView>, sqlx::Error> {
    let row = sqlx::query(&format!("{SELECT} WHERE id = $1"))
        .bind(id)
        .fetch_optional(conn)
        .await?;
    row.as_ref().map(view_of).transpose()
}

/// Adds a link with the schema's defaults (its magic drawn from the schema's sequence); its id.
pub async fn add(conn: &mut PgConnection, master: i64, follower: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO copy_links (master_id, follower_id) VALUES ($1, $2) RETURNING id",
    )
    .bind(master)
    .bind(follower)
    .fetch_one(conn)
    .await
}

/// A change of a link's fields: `None` keeps a field as it is; for the limits and filters,
/// `Some(None)` lifts them.
#[derive(Debug, Default)]
pub struct LinkChange<'a> {
    pub lot_mode: Option<&'a str>,
    pub lot_value: Option<f64>,
    pub reverse: Option<bool>,
    pub copy_sl_tp: Option<bool>,
    /// JSON text of a symbol map.
    pub symbol_map: Option<&'a str>,
    pub copy_existing: Option<bool>,
    pub enabled: Option<bool>,
    pub sides: Option<&'a str>,
    pub close_only: Option<bool>,
    pub symbols: Option<Option<Vec<String>>>,
    pub magics: Option<Option<Vec<i64>>>,
    pub max_lot: Option<Option<f64>>,
    pub max_delay_ms: Option<Option<i64>>,
    pub max_slippage: Option<Option<f64>>,
    pub equity_stop: Option<Option<f64>>,
    pub copy_sl: Option<bool>,
    pub copy_tp: Option<bool>,
    pub use_min_lot: Option<bool>,
    pub max_sl_distance: Option<Option<f64>>,
    pub min_master_lot: Option<Option<f64>>,
    pub max_open_copies: Option<Option<i64>>,
    pub sl_points: Option<Option<f64>>,
    pub tp_points: Option<Option<f64>>,
    pub on_remove: Option<&'a str>,
    pub pending_orders: Option<&'a str>,
}

/// Changes link `id`; false when there is no such link.
pub async fn set(
    conn: &mut PgConnection,
    id: i64,
    c: &LinkChange<'_>,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "UPDATE copy_links SET
            lot_mode = coalesce($2, lot_mode), lot_value = coalesce($3, lot_value),
            reverse = coalesce($4, reverse), copy_sl_tp = coalesce($5, copy_sl_tp),
            symbol_map = coalesce($6::jsonb, symbol_map), copy_existing = coalesce($7, copy_existing),
            enabled = coalesce($8, enabled), sides = coalesce($9, sides), close_only = coalesce($10, close_only),
            symbols = CASE WHEN $11 THEN $12 ELSE symbols END,
            magics = CASE WHEN $13 THEN $14 ELSE magics END,
            max_lot = CASE WHEN $15 THEN $16 ELSE max_lot END,
            max_delay_ms = CASE WHEN $17 THEN $18 ELSE max_delay_ms END,
            max_slippage = CASE WHEN $19 THEN $20 ELSE max_slippage END,
            equity_stop = CASE WHEN $21 THEN $22 ELSE equity_stop END,
            copy_sl = coalesce($23, copy_sl), copy_tp = coalesce($24, copy_tp),
            use_min_lot = coalesce($25, use_min_lot),
            max_sl_distance = CASE WHEN $26 THEN $27 ELSE max_sl_distance END,
            min_master_lot = CASE WHEN $28 THEN $29 ELSE min_master_lot END,
            max_open_copies = CASE WHEN $30 THEN $31::integer ELSE max_open_copies END,
            sl_points = CASE WHEN $32 THEN $33 ELSE sl_points END,
            tp_points = CASE WHEN $34 THEN $35 ELSE tp_points END,
            on_remove = coalesce($36, on_remove),
            pending_orders = coalesce($37, pending_orders)
          WHERE id = $1",
    )
    .bind(id)
    .bind(c.lot_mode)
    .bind(c.lot_value)
    .bind(c.reverse)
    .bind(c.copy_sl_tp)
    .bind(c.symbol_map)
    .bind(c.copy_existing)
    .bind(c.enabled)
    .bind(c.sides)
    .bind(c.close_only)
    .bind(c.symbols.is_some())
    .bind(c.symbols.clone().flatten())
    .bind(c.magics.is_some())
    .bind(c.magics.clone().flatten())
    .bind(c.max_lot.is_some())
    .bind(c.max_lot.flatten())
    .bind(c.max_delay_ms.is_some())
    .bind(c.max_delay_ms.flatten())
    .bind(c.max_slippage.is_some())
    .bind(c.max_slippage.flatten())
    .bind(c.equity_stop.is_some())
    .bind(c.equity_stop.flatten())
    .bind(c.copy_sl)
    .bind(c.copy_tp)
    .bind(c.use_min_lot)
    .bind(c.max_sl_distance.is_some())
    .bind(c.max_sl_distance.flatten())
    .bind(c.min_master_lot.is_some())
    .bind(c.min_master_lot.flatten())
    .bind(c.max_open_copies.is_some())
    .bind(c.max_open_copies.flatten())
    .bind(c.sl_points.is_some())
    .bind(c.sl_points.flatten())
    .bind(c.tp_points.is_some())
    .bind(c.tp_points.flatten())
    .bind(c.on_remove)
    .bind(c.pending_orders)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

/// Link `id`'s follower.
pub async fn follower_of(conn: &mut PgConnection, id: i64) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT follower_id FROM copy_links WHERE id = $1")
        .bind(id)
        .fetch_one(conn)
        .await
}

/// Removes link `id`; its `on_remove` (what the follower's node does with the copies it
/// made), or `None` when there is no such link.
pub async fn remove(conn: &mut PgConnection, id: i64) -> Result<Option<String>, sqlx::Error> {
    sqlx::query_scalar("DELETE FROM copy_links WHERE id = $1 RETURNING on_remove")
        .bind(id)
        .fetch_optional(conn)
        .await
}

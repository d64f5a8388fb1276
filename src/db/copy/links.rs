//! A follower's copy links, parsed; a row that does not parse is reported with its id.

use std::collections::HashMap;

use sqlx::{PgConnection, Row};

use crate::model::link::{Link, LotMode, PendingOrders, Protections, Sides};

/// A follower's links (enabled or not: a disabled link is close-only). A row whose settings do
/// not parse is reported with its id, not skipped silently.
pub async fn load_links(
    conn: &mut PgConnection,
    follower_id: i64,
) -> Result<Vec<Result<Link, String>>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT id, master_id, enabled, magic, lot_mode, lot_value, reverse, copy_sl_tp, symbol_map::text AS symbol_map,
                copy_existing, (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
                symbols, magics, sides, close_only, max_lot, max_delay_ms, max_slippage, equity_stop,
                copy_sl, copy_tp, max_sl_distance, use_min_lot, min_master_lot, max_open_copies::bigint AS max_open_copies,
                sl_points, tp_points, pending_orders
           FROM copy_links WHERE follower_id = $1 ORDER BY id",
    )
    .bind(follower_id)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            let id: i64 = r.try_get("id")?;
            let lot_mode: String = r.try_get("lot_mode")?;
            let map_text: String = r.try_get("symbol_map")?;
            let sides: String = r.try_get("sides")?;
            let parsed = lot_mode
                .parse::<LotMode>()
                .and_then(|mode| {
                    let symbol_map: HashMap<String, String> = serde_json::from_str(&map_text)
                        .map_err(|e| {
                            format!("symbol_map must map symbol names to symbol names: {e}")
                        })?;
                    Ok((mode, symbol_map, sides.parse::<Sides>()?))
                })
                .map_err(|e| format!("copy link {id}: {e}"));
            Ok(match parsed {
                Ok((lot_mode, symbol_map, sides)) => Ok(Link {
                    id,
                    master_id: r.try_get("master_id")?,
                    enabled: r.try_get("enabled")?,
                    magic: r.try_get("magic")?,
                    lot_mode,
                    lot_value: r.try_get("lot_value")?,
                    reverse: r.try_get("reverse")?,
                    copy_sl_tp: r.try_get("copy_sl_tp")?,
                    symbol_map,
                    copy_existing: r.try_get("copy_existing")?,
                    created_at_ms: r.try_get("created_at_ms")?,
                    protections: Protections {
                        symbols: r.try_get("symbols")?,
                        magics: r.try_get("magics")?,
                        sides,
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
                        fill_only: r.try_get::<String, _>("pending_orders")?
                            == PendingOrders::FillOnly.as_str(),
                    },
                }),
                Err(e) => Err(e),
            })
        })
        .collect()
}

/// A follower's own limit on open copies (`trading_accounts.max_open_copies`; `None`: none).
pub async fn follower_max_open_copies(
    conn: &mut PgConnection,
    follower: i64,
) -> Result<Option<i64>, sqlx::Error> {
    let max: Option<Option<i64>> =
        sqlx::query_scalar("SELECT max_open_copies::bigint FROM trading_accounts WHERE id = $1")
            .bind(follower)
            .fetch_optional(conn)
            .await?;
    Ok(max.flatten())
}

/// A link removed with `on_remove = 'close'` whose copies the follower still has to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemovedLink {
    pub link_id: i64,
    pub master_id: i64,
    pub magic: i64,
}

/// The follower's removed links whose copies are to be closed.
pub async fn removed_links(
    conn: &mut PgConnection,
    follower: i64,
) -> Result<Vec<RemovedLink>, sqlx::Error> {
    let rows: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT link_id, master_id, magic FROM removed_links WHERE follower_id = $1 ORDER BY link_id",
    )
    .bind(follower)
    .fetch_all(conn)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(link_id, master_id, magic)| RemovedLink {
            link_id,
            master_id,
            magic,
        })
        .collect())
}

/// Forgets a removed link once none of its copies is open; fenced by the follower's owner.
pub async fn forget_removed_link(
    conn: &mut PgConnection,
    node_id: &str,
    follower: i64,
    epoch: i64,
    link_id: i64,
) -> Result<bool, sqlx::Error> {
    let done = sqlx::query(
        "DELETE FROM removed_links r USING trading_accounts a
          WHERE r.link_id = $4 AND r.follower_id = $2 AND a.id = r.follower_id
            AND a.node_id = $1 AND a.owner_epoch = $3",
    )
    .bind(node_id)
    .bind(follower)
    .bind(epoch)
    .bind(link_id)
    .execute(conn)
    .await?;
    Ok(done.rows_affected() > 0)
}

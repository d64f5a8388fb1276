//! A follower's copy links, parsed; a row that does not parse is reported with its id. A node's
//! followers read theirs together ([`LinksReader`]): four statements in one message for a batch
//! of followers, not four round trips for each.

use std::collections::HashMap;

use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::db::batch::{BatchWriter, Batched};
use crate::future::BoxFuture;
use crate::model::link::{Link, LotMode, PendingOrders, Protections, Sides};
use crate::model::risk::RiskLimit;

/// The columns of a link, as [`link_from_row`] reads them. The symbols come as a JSON array: read
/// in one message with other statements ([`crate::db::together`]) the rows are text, and a text
/// array's element `"NULL"` (a symbol so named) does not read back as that string.
const LINK_COLUMNS: &str = "follower_id, id, master_id, enabled, magic, lot_mode, lot_value, reverse, copy_sl_tp, symbol_map::text AS symbol_map,
                copy_existing, (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
                array_to_json(symbols)::text AS symbols, magics, sides, close_only, max_lot, max_delay_ms, max_slippage, equity_stop,
                copy_sl, copy_tp, max_sl_distance, use_min_lot, min_master_lot, max_open_copies::bigint AS max_open_copies,
                sl_points, tp_points, pending_orders";

/// A follower's links (enabled or not: a disabled link is close-only). A row whose settings do
/// not parse is reported with its id, not skipped silently.
pub async fn load_links(
    conn: &mut PgConnection,
    follower_id: i64,
) -> Result<Vec<Result<Link, String>>, sqlx::Error> {
    let rows = sqlx::query(&format!(
        "SELECT {LINK_COLUMNS} FROM copy_links WHERE follower_id = $1 ORDER BY id"
    ))
    .bind(follower_id)
    .fetch_all(conn)
    .await?;
    rows.iter().map(link_from_row).collect()
}

/// One `copy_links` row: the link, or what in its settings does not parse (naming the link).
fn link_from_row(r: &PgRow) -> Result<Result<Link, String>, sqlx::Error> {
    let id: i64 = r.try_get("id")?;
    let lot_mode: String = r.try_get("lot_mode")?;
    let map_text: String = r.try_get("symbol_map")?;
    let sides: String = r.try_get("sides")?;
    let symbols: Option<String> = r.try_get("symbols")?;
    let parsed = lot_mode
        .parse::<LotMode>()
        .and_then(|mode| {
            let symbol_map: HashMap<String, String> = serde_json::from_str(&map_text)
                .map_err(|e| format!("symbol_map must map symbol names to symbol names: {e}"))?;
            let symbols: Option<Vec<String>> = symbols
                .map(|list| serde_json::from_str(&list))
                .transpose()
                .map_err(|e| format!("symbols must be a list of symbol names: {e}"))?;
            Ok((mode, symbol_map, symbols, sides.parse::<Sides>()?))
        })
        .map_err(|e| format!("copy link {id}: {e}"));
    Ok(match parsed {
        Ok((lot_mode, symbol_map, symbols, sides)) => Ok(Link {
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
                symbols,
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
}

/// A link removed with `on_remove = 'close'` whose copies the follower still has to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RemovedLink {
    pub link_id: i64,
    pub master_id: i64,
    pub magic: i64,
}

/// What a follower reads of its links at the start of its session and again now and then: its
/// links, its own limit on open copies (`trading_accounts.max_open_copies`; `None`: none), its
/// removed links whose copies it still has to close, and its risk limits.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FollowerLinks {
    pub links: Vec<Result<Link, String>>,
    pub max_open_copies: Option<i64>,
    pub removed: Vec<RemovedLink>,
    pub risk: Vec<RiskLimit>,
}

/// The [`FollowerLinks`] of every follower in `followers`, in four statements sent as one
/// message ([`crate::db::together`]) however many they are, in the order asked. A follower whose
/// risk limits cannot be read (a value another release wrote) gets the error naming the row; the
/// others get theirs. A follower with no row gets nothing (no links, no limits).
pub async fn read_followers_links(
    conn: &mut PgConnection,
    followers: &[i64],
) -> Result<Vec<Result<FollowerLinks, String>>, sqlx::Error> {
    use crate::db::together::{bigints, fetch_each, with_literals};
    let ids = bigints(followers);
    let statements = [
        format!("SELECT {LINK_COLUMNS} FROM copy_links WHERE follower_id = ANY($1) ORDER BY follower_id, id"),
        "SELECT id, max_open_copies::bigint AS max_open_copies FROM trading_accounts WHERE id = ANY($1)".to_string(),
        "SELECT follower_id, link_id, master_id, magic FROM removed_links
          WHERE follower_id = ANY($1) ORDER BY follower_id, link_id"
            .to_string(),
        format!(
            "SELECT account_id, {} FROM risk_limits WHERE account_id = ANY($1) ORDER BY account_id, id",
            super::risk::RISK_COLUMNS
        ),
    ]
    .map(|sql| with_literals(&sql, |_| ids.clone()));
    let [links, max, removed, risk]: [Vec<PgRow>; 4] = fetch_each(conn, &statements)
        .await?
        .try_into()
        .expect("fetch_each answers each statement");
    let mut read: HashMap<i64, Result<FollowerLinks, String>> = followers
        .iter()
        .map(|f| (*f, Ok(FollowerLinks::default())))
        .collect();
    for r in &links {
        let follower: i64 = r.try_get("follower_id")?;
        let link = link_from_row(r)?;
        if let Some(Ok(f)) = read.get_mut(&follower) {
            f.links.push(link);
        }
    }
    for r in &max {
        if let Some(Ok(f)) = read.get_mut(&r.try_get::<i64, _>("id")?) {
            f.max_open_copies = r.try_get("max_open_copies")?;
        }
    }
    for r in &removed {
        if let Some(Ok(f)) = read.get_mut(&r.try_get::<i64, _>("follower_id")?) {
            f.removed.push(RemovedLink {
                link_id: r.try_get("link_id")?,
                master_id: r.try_get("master_id")?,
                magic: r.try_get("magic")?,
            });
        }
    }
    for r in &risk {
        let follower: i64 = r.try_get("account_id")?;
        let limit = super::risk::risk_from_row(r);
        match (read.get_mut(&follower), limit) {
            (Some(Ok(f)), Ok(limit)) => f.risk.push(limit),
            (Some(entry @ Ok(_)), Err(e)) => *entry = Err(crate::db::describe(&e)),
            _ => {}
        }
    }
    Ok(followers
        .iter()
        .map(|f| {
            read.get(f)
                .cloned()
                .expect("every follower asked has an entry")
        })
        .collect())
}

/// One follower's [`FollowerLinks`], read with other followers' ([`LinksReader`]).
#[derive(Debug, Clone, Copy)]
pub struct LinksRead(pub i64);

/// The node's reader of its followers' links: the reads its followers ask for at about the same
/// time (a thousand sessions starting, the periodic re-reads of every follower) go as one batch
/// of four statements in one message on one connection, taking the background turns as each follower's own
/// reads did ([`crate::db::Db::background`]).
pub type LinksReader = BatchWriter<LinksRead>;

impl Batched for LinksRead {
    type Outcome = Result<FollowerLinks, String>;
    const WHAT: &'static str = "follower links reader";
    const MAX: usize = 1000;
    const ALONE_WHEN_REFUSED: bool = false;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        reads: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>> {
        Box::pin(async move {
            let followers: Vec<i64> = reads.iter().map(|r| r.0).collect();
            read_followers_links(conn, &followers).await
        })
    }
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

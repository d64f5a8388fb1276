//! The copy ledger (`migrations/0009_copy_ledger.sql`): a row per copy, fenced like every write
//! of the follower's session.

use std::collections::HashMap;

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
    /// A live copy's path in microseconds (`migrations/0020_copy_legs_us.sql`): the event
    /// committed (the database's clock), and on the follower node's clock the master event's
    /// notice received, the decision, the order handed to the broker connection and the broker's
    /// reply. `None` where the copy did not go through it, or where it was not recorded.
    pub event_committed_us: Option<i64>,
    pub notice_us: Option<i64>,
    pub decided_us: Option<i64>,
    pub sent_us: Option<i64>,
    pub accepted_us: Option<i64>,
    pub found_by_reconcile: bool,
    /// What the copy opened with, when known (`migrations/0019_copy_opened_volume.sql`): a new
    /// owner's floor for its opening volume. Not shown by `copies`.
    #[serde(skip)]
    pub opened_volume: Option<f64>,
}

/// Every (link, master ticket, follower ticket, volume opened if recorded) the follower ever held
/// a copy of.
pub async fn copied(
    conn: &mut PgConnection,
    follower_id: i64,
    server: &str,
    login: &str,
) -> Result<Vec<Copied>, sqlx::Error> {
    let key = (follower_id, server.to_string(), login.to_string());
    Ok(copied_of(conn, std::slice::from_ref(&key))
        .await?
        .remove(&key)
        .unwrap_or_default())
}

/// A follower's trading account as the ledger keys its copies: (follower, server, login).
pub type LedgerKey = (i64, String, String);

/// One copy a follower ever held ([`copied`]): link, master ticket, follower ticket, and the
/// volume it opened with if recorded.
pub type Copied = (i64, i64, i64, Option<f64>);

/// The columns a batched statement binds for `keys`, each key once.
pub(super) fn key_columns(keys: &[LedgerKey]) -> (Vec<i64>, Vec<&str>, Vec<&str>) {
    let mut keys: Vec<&LedgerKey> = keys.iter().collect();
    keys.sort_unstable();
    keys.dedup();
    (
        keys.iter().map(|k| k.0).collect(),
        keys.iter().map(|k| k.1.as_str()).collect(),
        keys.iter().map(|k| k.2.as_str()).collect(),
    )
}

/// What a follower copied ([`copied`]), for many in one statement (one with none is absent).
pub async fn copied_of(
    conn: &mut PgConnection,
    keys: &[LedgerKey],
) -> Result<HashMap<LedgerKey, Vec<Copied>>, sqlx::Error> {
    copied_from(&rows_of_keys(conn, COPIED_SQL, keys).await?)
}

/// The rows of `sql` (a statement over the keys' columns, [`key_columns`]) for `keys`.
async fn rows_of_keys(
    conn: &mut PgConnection,
    sql: &'static str,
    keys: &[LedgerKey],
) -> Result<Vec<sqlx::postgres::PgRow>, sqlx::Error> {
    let (followers, servers, logins) = key_columns(keys);
    sqlx::query(sql)
        .bind(&followers)
        .bind(&servers)
        .bind(&logins)
        .fetch_all(conn)
        .await
}

/// Values grouped by the ledger key they were read for.
type Keyed<V> = HashMap<LedgerKey, Vec<V>>;

/// Rows of (follower, server, login, then four columns), the four grouped by their key.
fn by_key<A, B, C, D>(rows: &[sqlx::postgres::PgRow]) -> Result<Keyed<(A, B, C, D)>, sqlx::Error>
where
    (i64, String, String, A, B, C, D): for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    let rows: Vec<(i64, String, String, A, B, C, D)> = rows
        .iter()
        .map(sqlx::FromRow::from_row)
        .collect::<Result<_, _>>()?;
    Ok(super::grouped(rows.into_iter().map(
        |(follower, server, login, a, b, c, d)| ((follower, server, login), (a, b, c, d)),
    )))
}

/// [`copied_of`]'s statement: $1, $2, $3 the keys' followers, servers and logins ([`key_columns`]).
pub(super) const COPIED_SQL: &str = "SELECT q.follower_id, q.server, q.login,
        l.link_id, l.master_ticket, l.follower_ticket, l.opened_volume
   FROM unnest($1::bigint[], $2::text[], $3::text[]) q(follower_id, server, login)
   JOIN copy_ledger l
     ON l.follower_id = q.follower_id AND l.server = q.server AND l.login = q.login
   JOIN trading_accounts m ON m.id = l.master_id
  WHERE l.master_server = m.server AND l.master_login = m.login";

/// What [`COPIED_SQL`]'s rows say.
pub(super) fn copied_from(
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<LedgerKey, Vec<Copied>>, sqlx::Error> {
    by_key(rows)
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
                decided_ms, accepted_ms, event_committed_us, notice_us, decided_us, sent_us, accepted_us,
                found_by_reconcile
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
                event_committed_us: r.try_get("event_committed_us")?,
                notice_us: r.try_get("notice_us")?,
                decided_us: r.try_get("decided_us")?,
                sent_us: r.try_get("sent_us")?,
                accepted_us: r.try_get("accepted_us")?,
                found_by_reconcile: r.try_get("found_by_reconcile")?,
                opened_volume: None,
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

/// A pending copy the ledger of order copies holds: (link, master ticket, its ticket if known,
/// ended without a fill).
pub type Placed = (i64, i64, Option<i64>, bool);

/// Every pending copy each follower's broker account ever placed for its masters' current
/// accounts, for many in one statement (one with none is absent).
pub async fn placed_of(
    conn: &mut PgConnection,
    keys: &[LedgerKey],
) -> Result<HashMap<LedgerKey, Vec<Placed>>, sqlx::Error> {
    placed_from(&rows_of_keys(conn, PLACED_SQL, keys).await?)
}

/// [`placed_of`]'s statement: $1, $2, $3 as [`COPIED_SQL`]'s.
pub(super) const PLACED_SQL: &str = "SELECT q.follower_id, q.server, q.login,
        o.link_id, o.master_ticket, o.follower_ticket, o.ended IS NOT NULL AS ended
   FROM unnest($1::bigint[], $2::text[], $3::text[]) q(follower_id, server, login)
   JOIN order_copies o
     ON o.follower_id = q.follower_id AND o.server = q.server AND o.login = q.login
   JOIN trading_accounts m ON m.id = o.master_id
  WHERE o.master_server = m.server AND o.master_login = m.login";

/// What [`PLACED_SQL`]'s rows say.
pub(super) fn placed_from(
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<LedgerKey, Vec<Placed>>, sqlx::Error> {
    by_key(rows)
}

/// One copy to record, with the writer's ownership of the follower.
#[derive(Debug, Clone)]
pub struct CopyWrite {
    pub node_id: String,
    pub follower_id: i64,
    pub epoch: i64,
    pub record: CopyRecord,
}

/// Records many copies in one statement, each fenced by its follower's (node, epoch): the
/// statement locks the account rows `FOR KEY SHARE`, so a claim (which takes its rows `FOR
/// UPDATE SKIP LOCKED`) cannot take a follower while its copy is being recorded, and a changed
/// row is checked again on its latest version; the lease cycle's renewals (no key update) never
/// wait for it, so several rows locked in whatever order the join meets them cannot deadlock
/// with a cycle. Returns, per write, whether its row was written (false: not owned any more, or
/// the ledger had the copy).
pub async fn record_copies(
    conn: &mut PgConnection,
    writes: &[CopyWrite],
) -> Result<Vec<bool>, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO copy_ledger (follower_id, follower_ticket, link_id, master_id, master_ticket, symbol, side, volume,
                         requested_price, filled_price, slippage, slippage_bps, master_fill_ms,
                         event_committed_ms, decided_ms, accepted_ms, found_by_reconcile, node_id, owner_epoch,
                         server, login, master_server, master_login, slippage_points, opened_volume,
                         event_committed_us, notice_us, decided_us, sent_us, accepted_us)
SELECT a.id, r.follower_ticket, r.link_id, r.master_id, r.master_ticket, r.symbol, r.side, r.volume,
       r.requested_price, r.filled_price, r.slippage, r.slippage_bps, r.master_fill_ms,
       r.event_committed_ms, r.decided_ms, r.accepted_ms, r.found_by_reconcile, r.node_id, r.owner_epoch,
       r.server, r.login, coalesce(m.server, ''), coalesce(m.login, ''), r.slippage_points,
       r.opened_volume, r.event_committed_us, r.notice_us, r.decided_us, r.sent_us, r.accepted_us
  FROM unnest($1::bigint[], $2::text[], $3::bigint[], $4::bigint[], $5::bigint[], $6::bigint[],
              $7::bigint[], $8::text[], $9::text[], $10::float8[], $11::float8[], $12::float8[],
              $13::float8[], $14::float8[], $15::bigint[], $16::bigint[], $17::bigint[],
              $18::bigint[], $19::bool[], $20::text[], $21::text[], $22::float8[], $23::float8[],
              $24::bigint[], $25::bigint[], $26::bigint[], $27::bigint[], $28::bigint[])
       AS r(follower_id, node_id, owner_epoch, follower_ticket, link_id, master_id, master_ticket,
            symbol, side, volume, requested_price, filled_price, slippage, slippage_bps,
            master_fill_ms, event_committed_ms, decided_ms, accepted_ms, found_by_reconcile,
            server, login, slippage_points, opened_volume,
            event_committed_us, notice_us, decided_us, sent_us, accepted_us)
  JOIN trading_accounts a
    ON a.id = r.follower_id AND a.node_id = r.node_id AND a.owner_epoch = r.owner_epoch
  LEFT JOIN trading_accounts m ON m.id = r.master_id
   FOR KEY SHARE OF a
ON CONFLICT (follower_id, server, login, follower_ticket) DO NOTHING
RETURNING follower_id, server, login, follower_ticket, owner_epoch
"#;
    let col = |f: fn(&CopyWrite) -> i64| writes.iter().map(f).collect::<Vec<_>>();
    let opt =
        |f: fn(&CopyRecord) -> Option<f64>| writes.iter().map(|w| f(&w.record)).collect::<Vec<_>>();
    // An instant column (ms or µs).
    let ms =
        |f: fn(&CopyRecord) -> Option<i64>| writes.iter().map(|w| f(&w.record)).collect::<Vec<_>>();
    let text =
        |f: fn(&CopyWrite) -> &str| writes.iter().map(|w| f(w).to_string()).collect::<Vec<_>>();
    let rows: Vec<(i64, String, String, i64, i64)> = sqlx::query_as(SQL)
        .bind(col(|w| w.follower_id))
        .bind(text(|w| &w.node_id))
        .bind(col(|w| w.epoch))
        .bind(col(|w| w.record.follower_ticket))
        .bind(col(|w| w.record.link_id))
        .bind(col(|w| w.record.master_id))
        .bind(col(|w| w.record.master_ticket))
        .bind(text(|w| &w.record.symbol))
        .bind(text(|w| &w.record.side))
        .bind(writes.iter().map(|w| w.record.volume).collect::<Vec<_>>())
        .bind(opt(|r| r.requested_price))
        .bind(
            writes
                .iter()
                .map(|w| w.record.filled_price)
                .collect::<Vec<_>>(),
        )
        .bind(opt(|r| r.slippage))
        .bind(opt(|r| r.slippage_bps))
        .bind(ms(|r| r.master_fill_ms))
        .bind(ms(|r| r.event_committed_ms))
        .bind(ms(|r| r.decided_ms))
        .bind(ms(|r| r.accepted_ms))
        .bind(
            writes
                .iter()
                .map(|w| w.record.found_by_reconcile)
                .collect::<Vec<_>>(),
        )
        .bind(text(|w| &w.record.server))
        .bind(text(|w| &w.record.login))
        .bind(opt(|r| r.slippage_points))
        .bind(opt(|r| r.opened_volume))
        .bind(ms(|r| r.event_committed_us))
        .bind(ms(|r| r.notice_us))
        .bind(ms(|r| r.decided_us))
        .bind(ms(|r| r.sent_us))
        .bind(ms(|r| r.accepted_us))
        .fetch_all(conn)
        .await?;
    let written: std::collections::HashSet<(i64, String, String, i64, i64)> =
        rows.into_iter().collect();
    let mut seen = std::collections::HashSet::new();
    Ok(writes
        .iter()
        .map(|w| {
            let key = (
                w.follower_id,
                w.record.server.clone(),
                w.record.login.clone(),
                w.record.follower_ticket,
                w.epoch,
            );
            // The same copy twice in one batch: written once, for the first.
            written.contains(&key) && seen.insert(key)
        })
        .collect())
}

/// The node's writer of the copy ledger: the copies its followers record at about the same time
/// (a master's open copied by many followers at once) are written together, in one statement per
/// batch ([`crate::db::batch`]), instead of one statement and one pooled connection per copy
/// (which made a thousand followers' ledger writes compete with their own orders for the
/// database, the pool and the cores). Each caller still waits for its own row: true when it was
/// written (see [`record_copies`]).
pub type CopyLedgerWriter = crate::db::batch::BatchWriter<CopyWrite>;

impl crate::db::batch::Batched for CopyWrite {
    type Outcome = bool;
    const WHAT: &'static str = "copy ledger";
    const MAX: usize = 500;
    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        writes: &'a [CopyWrite],
    ) -> crate::future::BoxFuture<'a, Result<Vec<bool>, sqlx::Error>> {
        Box::pin(record_copies(conn, writes))
    }
}

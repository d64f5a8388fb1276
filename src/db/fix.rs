//! The FIX adapter's ledger (`migrations/0008_fix_ledger.sql`): orders written before they are
//! sent and completed when their outcome is known, and the positions seen with their copy
//! markers. Order rows are fenced like every write of an account session: the statement locks
//! the account row `FOR SHARE` and matches the writer's (node, epoch), so a node that lost the
//! account records (and therefore sends) nothing.

use sqlx::Row;

use crate::db::Db;
pub use crate::model::fix::{Entry, EntryFill, Fill, FixOrder, FixPosition, Working, Writer};

/// Records an order about to be sent. False when the writer no longer owns the account (the
/// order must not go out) or the ClOrdID was recorded before (the intent was sent already).
pub async fn record_order(db: &Db, w: &Writer, o: &FixOrder) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO fix_orders (account_id, cl_ord_id, kind, symbol, side, quantity, position_id, magic, comment, price, node_id, owner_epoch)
SELECT a.id, $4, $5, $6, $7, $8, $9, $10, $11, $12, $2, $3
  FROM trading_accounts a
 WHERE a.id = $1 AND a.node_id = $2 AND a.owner_epoch = $3
   FOR SHARE
ON CONFLICT (account_id, cl_ord_id) DO NOTHING
"#;
    let done = db
        .run(async |c| {
            sqlx::query(SQL)
                .bind(w.account_id)
                .bind(&w.node_id)
                .bind(w.epoch)
                .bind(&o.cl_ord_id)
                .bind(&o.kind)
                .bind(&o.symbol)
                .bind(&o.side)
                .bind(o.quantity)
                .bind(o.position_id)
                .bind(o.magic)
                .bind(&o.comment)
                .bind(o.price)
                .execute(c)
                .await
        })
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The order recorded under a ClOrdID, whatever its state.
pub async fn order(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
) -> Result<Option<(FixOrder, String)>, sqlx::Error> {
    let row = db
        .run(async |c| {
            sqlx::query(
        "SELECT cl_ord_id, kind, symbol, side, quantity, position_id, magic, comment, price, state \
           FROM fix_orders WHERE account_id = $1 AND cl_ord_id = $2",
    )
    .bind(account_id)
    .bind(cl_ord_id)
    .fetch_optional(c)
        .await
        })
        .await?;
    row.map(|r| Ok((order_of(&r)?, r.try_get("state")?)))
        .transpose()
}

fn order_of(r: &sqlx::postgres::PgRow) -> Result<FixOrder, sqlx::Error> {
    Ok(FixOrder {
        cl_ord_id: r.try_get("cl_ord_id")?,
        kind: r.try_get("kind")?,
        symbol: r.try_get("symbol")?,
        side: r.try_get("side")?,
        quantity: r.try_get("quantity")?,
        position_id: r.try_get("position_id")?,
        magic: r.try_get("magic")?,
        comment: r.try_get("comment")?,
        price: r.try_get("price")?,
    })
}

/// Orders whose outcome is not known yet (sent, no report), oldest first.
pub async fn unresolved(db: &Db, account_id: i64) -> Result<Vec<FixOrder>, sqlx::Error> {
    let rows = db
        .run(async |c| {
            sqlx::query(
        "SELECT cl_ord_id, kind, symbol, side, quantity, position_id, magic, comment, price \
           FROM fix_orders WHERE account_id = $1 AND state = 'sent' ORDER BY sent_at",
    )
    .bind(account_id)
    .fetch_all(c)
        .await
        })
        .await?;
    rows.iter().map(order_of).collect()
}

/// Completes an order: filled (with the position it opened or reduced) or rejected. A fill of
/// an opening order also records its position with the order's marker and, once, the lots it
/// opened with. Not fenced: it records what the venue reports, which is true whoever reads it.
pub async fn complete_order(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
    outcome: Result<Fill, &str>,
) -> Result<(), sqlx::Error> {
    match outcome {
        Ok(fill) => {
            db.run(async |c| {
                sqlx::query(
                r#"
WITH o AS (
    UPDATE fix_orders SET state = 'filled', position_id = $3, done_at = now(), reason = NULL
     WHERE account_id = $1 AND cl_ord_id = $2
 RETURNING kind, symbol, side, quantity, magic, comment)
INSERT INTO fix_positions (account_id, position_id, symbol, side, volume, open_price, magic, comment,
                           opened_volume)
SELECT $1, $3, o.symbol, o.side, 0, $4, o.magic, o.comment, $5 FROM o WHERE o.kind IN ('open', 'entry')
ON CONFLICT (account_id, position_id) DO UPDATE
   SET magic = EXCLUDED.magic, comment = EXCLUDED.comment,
       opened_volume = COALESCE(fix_positions.opened_volume, EXCLUDED.opened_volume)
"#,
            )
            .bind(account_id)
            .bind(cl_ord_id)
            .bind(fill.position_id)
            .bind(fill.price)
            .bind((fill.lots > 0.0).then_some(fill.lots))
            .execute(c)
                .await
            })
            .await?;
        }
        Err(reason) => {
            db.run(async |c| {
                sqlx::query(
                    "UPDATE fix_orders SET state = 'rejected', reason = $3, done_at = now() \
                  WHERE account_id = $1 AND cl_ord_id = $2 AND state = 'sent'",
                )
                .bind(account_id)
                .bind(cl_ord_id)
                .bind(reason)
                .execute(c)
                .await
            })
            .await?;
        }
    }
    Ok(())
}

/// Sets an order's state (a resting order accepted, cancelled or filled) from what the venue
/// reported; `from` lists the states it may leave.
pub async fn set_state(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
    from: &[&str],
    state: &str,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            "UPDATE fix_orders SET state = $3, done_at = now() \
          WHERE account_id = $1 AND cl_ord_id = $2 AND state = ANY($4)",
        )
        .bind(account_id)
        .bind(cl_ord_id)
        .bind(state)
        .bind(from)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// The account's resting orders in force.
pub async fn working(db: &Db, account_id: i64) -> Result<Vec<Working>, sqlx::Error> {
    let rows = db.run(async |c| {
        sqlx::query(
        "SELECT cl_ord_id, kind, position_id, price, side, symbol, quantity FROM fix_orders \
          WHERE account_id = $1 AND state = 'working' AND position_id IS NOT NULL AND price IS NOT NULL",
    )
    .bind(account_id)
    .fetch_all(c)
        .await
    })
    .await?;
    rows.iter()
        .map(|r| {
            Ok(Working {
                cl_ord_id: r.try_get("cl_ord_id")?,
                kind: r.try_get("kind")?,
                position_id: r.try_get("position_id")?,
                price: r.try_get("price")?,
                side: r.try_get("side")?,
                symbol: r.try_get("symbol")?,
                quantity: r.try_get("quantity")?,
            })
        })
        .collect()
}

/// Removes an order that was recorded but never left (the session was not logged on): the next
/// attempt may use its ClOrdID.
pub async fn forget_order(db: &Db, account_id: i64, cl_ord_id: &str) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            "DELETE FROM fix_orders WHERE account_id = $1 AND cl_ord_id = $2 AND state = 'sent'",
        )
        .bind(account_id)
        .bind(cl_ord_id)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// Every position of the account the ledger knows (open and closed).
pub async fn positions(db: &Db, account_id: i64) -> Result<Vec<FixPosition>, sqlx::Error> {
    let rows = db
        .run(async |c| {
            sqlx::query(
                r#"SELECT position_id, symbol, side, volume, open_price, magic, comment, ticket,
                  opened_volume, (extract(epoch FROM opened_at) * 1000)::bigint AS opened_ms,
                  (extract(epoch FROM closed_at) * 1000)::bigint AS closed_ms, close_price
             FROM fix_positions WHERE account_id = $1 ORDER BY position_id"#,
            )
            .bind(account_id)
            .fetch_all(c)
            .await
        })
        .await?;
    rows.iter()
        .map(|r| {
            Ok(FixPosition {
                position_id: r.try_get("position_id")?,
                symbol: r.try_get("symbol")?,
                side: r.try_get("side")?,
                volume: r.try_get("volume")?,
                open_price: r.try_get("open_price")?,
                magic: r.try_get("magic")?,
                comment: r.try_get("comment")?,
                opened_ms: r.try_get("opened_ms")?,
                closed_ms: r.try_get("closed_ms")?,
                close_price: r.try_get("close_price")?,
                ticket: r.try_get("ticket")?,
                opened_volume: r.try_get("opened_volume")?,
            })
        })
        .collect()
}

/// Records a position seen open (keeping its marker, first sighting and opening volume: a
/// position first seen here opened with the volume it shows, unless its fill recorded one). A
/// position the ledger has seen closed stays closed: venues never reuse a position id.
pub async fn seen_open(db: &Db, account_id: i64, p: &FixPosition) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            r#"
INSERT INTO fix_positions (account_id, position_id, symbol, side, volume, open_price, opened_volume)
VALUES ($1, $2, $3, $4, $5, $6, $5)
ON CONFLICT (account_id, position_id) DO UPDATE
   SET volume = EXCLUDED.volume, open_price = EXCLUDED.open_price,
       opened_volume = COALESCE(fix_positions.opened_volume, EXCLUDED.opened_volume)
"#,
        )
        .bind(account_id)
        .bind(p.position_id)
        .bind(&p.symbol)
        .bind(&p.side)
        .bind(p.volume)
        .bind(p.open_price)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// Records positions gone (closed), at `close_price` when known.
pub async fn seen_closed(
    db: &Db,
    account_id: i64,
    position_id: i64,
    close_price: Option<f64>,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            "UPDATE fix_positions SET closed_at = now(), close_price = $3 \
          WHERE account_id = $1 AND position_id = $2 AND closed_at IS NULL",
        )
        .bind(account_id)
        .bind(position_id)
        .bind(close_price)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

const ENTRY_COLUMNS: &str = "cl_ord_id, symbol, side, quantity, order_type, price, sl, tp, \
     expiry_ms, magic, comment, ticket, replaces, state, \
     (extract(epoch FROM sent_at) * 1000)::bigint AS sent_ms";

fn entry_of(r: &sqlx::postgres::PgRow) -> Result<Entry, sqlx::Error> {
    Ok(Entry {
        cl_ord_id: r.try_get("cl_ord_id")?,
        symbol: r.try_get("symbol")?,
        side: r.try_get("side")?,
        quantity: r.try_get("quantity")?,
        order_type: r.try_get("order_type")?,
        price: r.try_get("price")?,
        sl: r.try_get("sl")?,
        tp: r.try_get("tp")?,
        expiry_ms: r.try_get("expiry_ms")?,
        magic: r.try_get("magic")?,
        comment: r.try_get("comment")?,
        ticket: r.try_get("ticket")?,
        replaces: r.try_get("replaces")?,
        state: r.try_get("state")?,
        sent_ms: r.try_get("sent_ms")?,
    })
}

/// Records an entry order about to be sent (`state` sent), or one the venue showed that another
/// placed (`working`), fenced like [`record_order`]. False when the writer no longer owns the
/// account or the ClOrdID was recorded before.
pub async fn record_entry(db: &Db, w: &Writer, e: &Entry) -> Result<bool, sqlx::Error> {
    const SQL: &str = r#"
INSERT INTO fix_orders (account_id, cl_ord_id, kind, symbol, side, quantity, order_type, price, sl, tp,
                        expiry_ms, magic, comment, ticket, replaces, state, node_id, owner_epoch)
SELECT a.id, $4, 'entry', $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $2, $3
  FROM trading_accounts a
 WHERE a.id = $1 AND a.node_id = $2 AND a.owner_epoch = $3
   FOR SHARE
ON CONFLICT (account_id, cl_ord_id) DO NOTHING
"#;
    let done = db
        .run(async |c| {
            sqlx::query(SQL)
                .bind(w.account_id)
                .bind(&w.node_id)
                .bind(w.epoch)
                .bind(&e.cl_ord_id)
                .bind(&e.symbol)
                .bind(&e.side)
                .bind(e.quantity)
                .bind(&e.order_type)
                .bind(e.price)
                .bind(e.sl)
                .bind(e.tp)
                .bind(e.expiry_ms)
                .bind(e.magic)
                .bind(&e.comment)
                .bind(e.ticket)
                .bind(&e.replaces)
                .bind(&e.state)
                .execute(c)
                .await
        })
        .await?;
    Ok(done.rows_affected() > 0)
}

/// The entry order recorded under a ClOrdID, whatever its state.
pub async fn entry(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
) -> Result<Option<Entry>, sqlx::Error> {
    let sql = format!(
        "SELECT {ENTRY_COLUMNS} FROM fix_orders \
          WHERE account_id = $1 AND cl_ord_id = $2 AND kind = 'entry'"
    );
    let row = db
        .run(async |c| {
            sqlx::query(&sql)
                .bind(account_id)
                .bind(cl_ord_id)
                .fetch_optional(c)
                .await
        })
        .await?;
    row.as_ref().map(entry_of).transpose()
}

/// The account's entry orders in force (`working`) or without an outcome (`sent`), oldest first.
pub async fn entries(db: &Db, account_id: i64) -> Result<Vec<Entry>, sqlx::Error> {
    let sql = format!(
        "SELECT {ENTRY_COLUMNS} FROM fix_orders \
          WHERE account_id = $1 AND kind = 'entry' AND state IN ('sent', 'working') \
          ORDER BY sent_at, cl_ord_id"
    );
    let rows = db
        .run(async |c| sqlx::query(&sql).bind(account_id).fetch_all(c).await)
        .await?;
    rows.iter().map(entry_of).collect()
}

/// The venue accepted entry order `cl_ord_id` (its New) as `ticket`; or lists as resting one
/// taken for refused.
pub async fn entry_working(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
    ticket: i64,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            "UPDATE fix_orders SET state = 'working', ticket = $3, done_at = NULL, reason = NULL \
              WHERE account_id = $1 AND cl_ord_id = $2 AND state IN ('sent', 'rejected')",
        )
        .bind(account_id)
        .bind(cl_ord_id)
        .bind(ticket)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// The venue replaced entry order `old` by `new` (a cancel/replace it accepted): `old` is
/// `replaced`, `new` in force as `ticket`, in one statement.
pub async fn entry_replaced(
    db: &Db,
    account_id: i64,
    old: &str,
    new: &str,
    ticket: i64,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            r#"
WITH o AS (
    UPDATE fix_orders SET state = 'replaced', done_at = now()
     WHERE account_id = $1 AND cl_ord_id = $2 AND state IN ('sent', 'working'))
UPDATE fix_orders SET state = 'working', ticket = $4
 WHERE account_id = $1 AND cl_ord_id = $3 AND state = 'sent'
"#,
        )
        .bind(account_id)
        .bind(old)
        .bind(new)
        .bind(ticket)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// The stops an entry order's position gets once it fills (FIX entry orders carry none).
pub async fn entry_stops(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
    sl: Option<f64>,
    tp: Option<f64>,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            "UPDATE fix_orders SET sl = $3, tp = $4 \
              WHERE account_id = $1 AND cl_ord_id = $2 AND kind = 'entry'",
        )
        .bind(account_id)
        .bind(cl_ord_id)
        .bind(sl)
        .bind(tp)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

/// Entry order `cl_ord_id` filled, opening `position_id`, which the copy engine knows by the
/// order's `ticket`: the order row (if the ledger has it) is filled, and the position recorded
/// with that ticket and the order's marker, in one statement.
pub async fn entry_filled(
    db: &Db,
    account_id: i64,
    cl_ord_id: &str,
    fill: EntryFill<'_>,
) -> Result<(), sqlx::Error> {
    db.run(async |c| {
        sqlx::query(
            r#"
WITH o AS (
    UPDATE fix_orders
       SET state = 'filled', position_id = $3, ticket = COALESCE(ticket, $4), done_at = now(),
           reason = NULL
     WHERE account_id = $1 AND cl_ord_id = $2
 RETURNING magic, comment)
INSERT INTO fix_positions (account_id, position_id, symbol, side, volume, open_price, magic, comment, ticket)
VALUES ($1, $3, $5, $6, 0, $7, COALESCE((SELECT magic FROM o), 0), COALESCE((SELECT comment FROM o), ''), $4)
ON CONFLICT (account_id, position_id) DO UPDATE
   SET ticket = EXCLUDED.ticket,
       magic = CASE WHEN EXISTS (SELECT 1 FROM o) THEN EXCLUDED.magic ELSE fix_positions.magic END,
       comment = CASE WHEN EXISTS (SELECT 1 FROM o) THEN EXCLUDED.comment ELSE fix_positions.comment END
"#,
        )
        .bind(account_id)
        .bind(cl_ord_id)
        .bind(fill.position_id)
        .bind(fill.ticket)
        .bind(fill.symbol)
        .bind(fill.side)
        .bind(fill.price)
        .execute(c)
        .await
    })
    .await?;
    Ok(())
}

//! `copier-node copies <follower>`: a follower's recent copies from the copy ledger.

use super::{CommandError, connect, no_such, sql};
use crate::cli::CopiesArgs;
use crate::db;

pub(crate) async fn copies(args: CopiesArgs) -> Result<(), CommandError> {
    let (_, mut conn) = connect(&args.manage, vec![]).await?;
    let what = format!("copies of follower {}", args.follower);
    if crate::db::admin::why::role(&mut conn, args.follower)
        .await
        .map_err(sql(&what))?
        .is_none()
    {
        return Err(no_such("account", args.follower));
    }
    let rows = db::copy::ledger::recent(&mut conn, args.follower, args.limit.max(1))
        .await
        .map_err(sql(&what))?;
    if args.manage.json {
        println!("{}", serde_json::to_string(&rows).expect("serialises"));
        return Ok(());
    }
    let ms = |from: Option<i64>, to: Option<i64>| match (from, to) {
        (Some(a), Some(b)) => format!("{} ms", b - a),
        _ => "-".to_string(),
    };
    for c in &rows {
        println!(
            "copy {} of master {} ticket {} (link {}): {} {} {} at {}{}{}; legs: fill->event {}, event->decision {}, decision->accept {}{}",
            c.follower_ticket,
            c.master_id,
            c.master_ticket,
            c.link_id,
            c.side,
            c.volume,
            c.symbol,
            c.filled_price,
            c.requested_price
                .map(|r| format!(" (master {r})"))
                .unwrap_or_default(),
            match (c.slippage_bps, c.slippage_points) {
                (Some(b), Some(p)) => format!(", slippage {p} points, {b:.2} bps"),
                (Some(b), None) => format!(", slippage {b:.2} bps"),
                _ => String::new(),
            },
            ms(c.master_fill_ms, c.event_committed_ms),
            ms(c.event_committed_ms, c.decided_ms),
            ms(c.decided_ms, c.accepted_ms),
            if c.found_by_reconcile {
                " (found by reconcile: its reply was lost)"
            } else {
                ""
            },
        );
    }
    if rows.is_empty() {
        println!("no copies recorded for account {}", args.follower);
    }
    Ok(())
}

//! `copier-node why <follower> <master ticket>`: why a master position was or was not copied,
//! from each link's recorded decisions, the master's published state, the copy ledger and (FIX
//! followers) the order ledger.

use serde::Serialize;

use super::{CommandError, connect, no_such, sql};
use crate::cli::WhyArgs;
use crate::db::admin::why::{self as rows, Decision, LedgerOrder};

/// One link's part of the answer to `why`.
#[derive(Debug, Serialize)]
struct WhyLink {
    link_id: i64,
    master_id: i64,
    /// The ticket the master publishes the position under: the one asked about, or (MT4, which
    /// renumbers a position at each partial close) the one it opened under.
    master_ticket: i64,
    link_enabled: bool,
    /// The master's last published state names the position (open when published).
    master_position_published: bool,
    /// Decisions recorded for this (link, master ticket), oldest first.
    decisions: Vec<Decision>,
    /// FIX followers: the copy's orders in the order ledger (marker `mc<ticket>`).
    fix_orders: Vec<LedgerOrder>,
    verdict: String,
    /// The ticket asked about.
    #[serde(skip)]
    asked: i64,
}

impl std::fmt::Display for WhyLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "link {} (master {}): {}",
            self.link_id, self.master_id, self.verdict
        )?;
        if self.master_ticket != self.asked {
            writeln!(
                f,
                "  the master's broker now calls position {} ticket {} (MT4 renumbered it at a partial close)",
                self.master_ticket, self.asked
            )?;
        }
        for d in &self.decisions {
            writeln!(
                f,
                "  {} {}: {}{}{}",
                d.decided_at,
                d.code.as_deref().unwrap_or("-"),
                d.reason,
                if d.is_final { " (final)" } else { "" },
                d.node_id
                    .as_deref()
                    .map(|n| format!(" [node {n}]"))
                    .unwrap_or_default()
            )?;
        }
        for o in &self.fix_orders {
            writeln!(
                f,
                "  FIX order {} ({}): {}{}",
                o.cl_ord_id,
                o.kind,
                o.state,
                o.position_id
                    .map(|p| format!(", position {p}"))
                    .unwrap_or_default()
            )?;
        }
        Ok(())
    }
}

pub(crate) async fn why(args: WhyArgs) -> Result<(), CommandError> {
    let (_, mut conn) = connect(&args.manage, vec![]).await?;
    let what = format!(
        "follower {} and master ticket {}",
        args.follower, args.master_ticket
    );
    match rows::role(&mut conn, args.follower)
        .await
        .map_err(sql(&what))?
        .as_deref()
    {
        None => return Err(no_such("account", args.follower)),
        Some("follower") => {}
        Some(other) => {
            return Err(CommandError::usage(format!(
                "account {} is a {other}, not a follower",
                args.follower
            )));
        }
    }
    let links = rows::links(&mut conn, args.follower)
        .await
        .map_err(sql(&what))?;
    let mut out = Vec::new();
    for (link_id, master_id, enabled) in links {
        let ticket = rows::published_as(&mut conn, master_id, args.master_ticket)
            .await
            .map_err(sql(&what))?
            .unwrap_or(args.master_ticket);
        let orders = rows::fix_orders(&mut conn, args.follower, &crate::model::marker(ticket))
            .await
            .map_err(sql(&what))?;
        let published = rows::published(&mut conn, master_id, ticket)
            .await
            .map_err(sql(&what))?;
        let decisions = rows::decisions(&mut conn, link_id, ticket)
            .await
            .map_err(sql(&what))?;
        let fix_orders: Vec<LedgerOrder> = orders
            .iter()
            .filter(|o| o.cl_ord_id.starts_with(&format!("l{link_id}-")))
            .map(|o| LedgerOrder {
                cl_ord_id: o.cl_ord_id.clone(),
                kind: o.kind.clone(),
                state: o.state.clone(),
                position_id: o.position_id,
            })
            .collect();
        let copied = rows::copied(&mut conn, args.follower, link_id, ticket)
            .await
            .map_err(sql(&what))?;
        let verdict = verdict(&copied, &decisions, &fix_orders, enabled, published);
        out.push(WhyLink {
            link_id,
            master_id,
            master_ticket: ticket,
            asked: args.master_ticket,
            link_enabled: enabled,
            master_position_published: published,
            decisions,
            fix_orders,
            verdict,
        });
    }
    if out.is_empty() {
        return Err(CommandError::usage(format!(
            "account {} follows no master (no copy links)",
            args.follower
        )));
    }
    if args.manage.json {
        println!("{}", serde_json::to_string(&out).expect("serialises"));
    } else {
        for l in &out {
            print!("{l}");
        }
    }
    Ok(())
}

/// What a link's records say of the ticket, in one sentence.
fn verdict(
    copied: &[i64],
    decisions: &[Decision],
    fix_orders: &[LedgerOrder],
    enabled: bool,
    published: bool,
) -> String {
    if let Some(ticket) = copied.first() {
        format!(
            "copied as ticket {ticket} (copy ledger; `copier-node copies` has its prices and latency)"
        )
    } else if let Some(d) = decisions.iter().rev().find(|d| d.is_final) {
        format!(
            "not copied, for good: {} ({})",
            d.code.as_deref().unwrap_or("skipped"),
            d.reason
        )
    } else if let Some(o) = fix_orders
        .iter()
        .find(|o| o.kind == "open" && o.state == "filled")
    {
        format!(
            "copied (FIX position {})",
            o.position_id.map_or("?".to_string(), |p| p.to_string())
        )
    } else if let Some(d) = decisions.last() {
        format!(
            "last refused at {}: {} ({}); retried while it may succeed, so it may be copied since{}",
            d.decided_at,
            d.code.as_deref().unwrap_or("skipped"),
            d.reason,
            if published {
                ""
            } else {
                " (the master no longer publishes the position)"
            }
        )
    } else if !enabled {
        "the link is disabled".to_string()
    } else if published {
        "no decision recorded: copied, or being copied (the follower's broker shows the copy by its marker)".to_string()
    } else {
        "no decision recorded and the master does not publish this position (closed before it was copied, or never seen)".to_string()
    }
}

//! `copier-node links ...`: add, list, show, set and remove copy links.

use std::collections::HashMap;

use sqlx::{Connection, PgConnection};

use super::{CommandError, connect, limit, no_such, open_copies_limit, print, print_one, sql};
use crate::cli::{LinkFields, LinksCommand};
use crate::db;
use crate::db::admin::accounts;
use crate::db::admin::links::{self as rows, LinkChange, LinkView};
use crate::model::link::{LotMode, OnRemove, PendingOrders, Sides};

impl std::fmt::Display for LinkView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "link {}: master {} -> follower {} ({}), magic {}, {} {}{}{}, symbol map {}, sides {}",
            self.id,
            self.master_id,
            self.follower_id,
            if self.enabled { "enabled" } else { "disabled" },
            self.magic,
            self.lot_mode,
            self.lot_value,
            if self.reverse { ", reversed" } else { "" },
            if self.copy_sl_tp {
                ", stops copied"
            } else {
                ", no stops"
            },
            self.symbol_map,
            self.sides,
        )?;
        if let Some(s) = &self.symbols {
            write!(f, ", symbols {}", s.join(","))?;
        }
        if let Some(m) = &self.magics {
            write!(f, ", magics {m:?}")?;
        }
        for (name, v) in [
            ("max_lot", self.max_lot),
            ("max_slippage", self.max_slippage),
            ("equity_stop", self.equity_stop),
        ] {
            if let Some(v) = v {
                write!(f, ", {name} {v}")?;
            }
        }
        if let Some(ms) = self.max_delay_ms {
            write!(f, ", max_delay_ms {ms}")?;
        }
        if self.close_only {
            write!(f, ", close only")?;
        }
        if self.copy_sl_tp && !self.copy_sl {
            write!(f, ", no stop loss")?;
        }
        if self.copy_sl_tp && !self.copy_tp {
            write!(f, ", no take profit")?;
        }
        for (name, v) in [
            ("max_sl_distance", self.max_sl_distance),
            ("min_master_lot", self.min_master_lot),
            ("sl_points", self.sl_points),
            ("tp_points", self.tp_points),
        ] {
            if let Some(v) = v {
                write!(f, ", {name} {v}")?;
            }
        }
        if self.use_min_lot {
            write!(f, ", minimum lot used below it")?;
        }
        if let Some(n) = self.max_open_copies {
            write!(f, ", max_open_copies {n}")?;
        }
        if self.on_remove == OnRemove::Close.as_str() {
            write!(f, ", its copies closed when it is removed")?;
        }
        if self.pending_orders == PendingOrders::FillOnly.as_str() {
            write!(f, ", pending orders copied at their fill only")?;
        }
        Ok(())
    }
}

/// A link's fields, checked: what to write, or every problem naming its field.
struct LinkValues {
    max_sl_distance: Option<Option<f64>>,
    min_master_lot: Option<Option<f64>>,
    max_open_copies: Option<Option<i64>>,
    sl_points: Option<Option<f64>>,
    tp_points: Option<Option<f64>>,
    max_lot: Option<Option<f64>>,
    max_delay_ms: Option<Option<i64>>,
    max_slippage: Option<Option<f64>>,
    equity_stop: Option<Option<f64>>,
    symbols: Option<Option<Vec<String>>>,
    magics: Option<Option<Vec<i64>>>,
}

fn check_link(f: &LinkFields) -> Result<LinkValues, CommandError> {
    let mut problems = Vec::new();
    if let Some(mode) = &f.lot_mode
        && let Err(e) = mode.parse::<LotMode>()
    {
        problems.push(e);
    }
    if let Some(v) = f.lot_value
        && !(v.is_finite() && v > 0.0)
    {
        problems.push(format!("lot_value: {v} must be above 0"));
    }
    if let Some(map) = &f.symbol_map
        && let Err(e) = serde_json::from_str::<HashMap<String, String>>(map)
    {
        problems.push(format!(
            "symbol_map: must be a JSON object of symbol names to symbol names ({e})"
        ));
    }
    if let Some(sides) = &f.sides
        && let Err(e) = sides.parse::<Sides>()
    {
        problems.push(e);
    }
    if let Some(v) = &f.on_remove
        && let Err(e) = v.parse::<OnRemove>()
    {
        problems.push(e);
    }
    if let Some(v) = &f.pending_orders
        && let Err(e) = v.parse::<PendingOrders>()
    {
        problems.push(e);
    }
    let max_lot = limit::<f64>("max_lot", &f.max_lot, &mut problems);
    let max_delay_ms = limit::<i64>("max_delay_ms", &f.max_delay_ms, &mut problems);
    let max_slippage = limit::<f64>("max_slippage", &f.max_slippage, &mut problems);
    let equity_stop = limit::<f64>("equity_stop", &f.equity_stop, &mut problems);
    let max_sl_distance = limit::<f64>("max_sl_distance", &f.max_sl_distance, &mut problems);
    let min_master_lot = limit::<f64>("min_master_lot", &f.min_master_lot, &mut problems);
    let max_open_copies = open_copies_limit(&f.max_open_copies, &mut problems);
    let sl_points = limit::<f64>("sl_points", &f.sl_points, &mut problems);
    let tp_points = limit::<f64>("tp_points", &f.tp_points, &mut problems);
    for (name, v) in [
        ("max_sl_distance", max_sl_distance),
        ("min_master_lot", min_master_lot),
        ("sl_points", sl_points),
        ("tp_points", tp_points),
    ] {
        if let Some(Some(v)) = v
            && !(v.is_finite() && v > 0.0)
        {
            problems.push(format!("{name}: {v} must be above 0"));
        }
    }
    if let Some(Some(v)) = max_lot
        && !(v.is_finite() && v > 0.0)
    {
        problems.push(format!("max_lot: {v} must be above 0"));
    }
    for (name, v) in [("max_slippage", max_slippage), ("equity_stop", equity_stop)] {
        if let Some(Some(v)) = v
            && !(v.is_finite() && v >= 0.0)
        {
            problems.push(format!("{name}: {v} must be 0 or more"));
        }
    }
    if let Some(Some(v)) = max_delay_ms
        && v < 0
    {
        problems.push(format!("max_delay_ms: {v} must be 0 or more"));
    }
    let list = |v: &Option<String>| -> Option<Option<Vec<String>>> {
        let text = v.as_deref()?;
        if text == "all" {
            return Some(None);
        }
        Some(Some(
            text.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect(),
        ))
    };
    let symbols = list(&f.symbols);
    if let Some(Some(s)) = &symbols
        && s.is_empty()
    {
        problems.push("symbols: no symbol given (`all` lifts the filter)".into());
    }
    let magics = match list(&f.magics) {
        None => None,
        Some(None) => Some(None),
        Some(Some(items)) => {
            let parsed: Result<Vec<i64>, _> = items.iter().map(|m| m.parse::<i64>()).collect();
            match parsed {
                Ok(m) if !m.is_empty() => Some(Some(m)),
                _ => {
                    problems.push(format!(
                        "magics: {:?} is not a comma-separated list of whole numbers (or `all`)",
                        f.magics.as_deref().unwrap_or("")
                    ));
                    None
                }
            }
        }
    };
    if !problems.is_empty() {
        return Err(CommandError::usage(problems.join("\n")));
    }
    Ok(LinkValues {
        max_sl_distance,
        min_master_lot,
        max_open_copies,
        sl_points,
        tp_points,
        max_lot,
        max_delay_ms,
        max_slippage,
        equity_stop,
        symbols,
        magics,
    })
}

/// The change a link's checked fields make.
fn change(f: &LinkFields, v: LinkValues) -> LinkChange<'_> {
    LinkChange {
        lot_mode: f.lot_mode.as_deref(),
        lot_value: f.lot_value,
        reverse: f.reverse,
        copy_sl_tp: f.copy_sl_tp,
        symbol_map: f.symbol_map.as_deref(),
        copy_existing: f.copy_existing,
        enabled: f.enabled,
        sides: f.sides.as_deref(),
        close_only: f.close_only,
        symbols: v.symbols,
        magics: v.magics,
        max_lot: v.max_lot,
        max_delay_ms: v.max_delay_ms,
        max_slippage: v.max_slippage,
        equity_stop: v.equity_stop,
        copy_sl: f.copy_sl,
        copy_tp: f.copy_tp,
        use_min_lot: f.use_min_lot,
        max_sl_distance: v.max_sl_distance,
        min_master_lot: v.min_master_lot,
        max_open_copies: v.max_open_copies,
        sl_points: v.sl_points,
        tp_points: v.tp_points,
        on_remove: f.on_remove.as_deref(),
        pending_orders: f.pending_orders.as_deref(),
    }
}

/// The node's own reading of the follower's links: a link it would refuse fails the change.
async fn node_accepts(
    conn: &mut PgConnection,
    follower: i64,
    link: i64,
) -> Result<(), CommandError> {
    let links = db::copy::load_links(conn, follower)
        .await
        .map_err(sql(&format!("link {link}")))?;
    for l in links {
        if let Err(e) = l
            && e.starts_with(&format!("copy link {link}:"))
        {
            return Err(CommandError::usage(e));
        }
    }
    Ok(())
}

pub(crate) async fn links(command: LinksCommand) -> Result<(), CommandError> {
    match command {
        LinksCommand::Add(args) => {
            let values = check_link(&args.fields)?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("link {} -> {}", args.master, args.follower);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            let roles = accounts::roles_for_share(&mut tx, &[args.master, args.follower])
                .await
                .map_err(sql(&what))?;
            let role = |id: i64| roles.iter().find(|r| r.0 == id).map(|r| r.1.as_str());
            match (role(args.master), role(args.follower)) {
                (None, _) => {
                    return Err(CommandError::usage(format!(
                        "master: account {} does not exist",
                        args.master
                    )));
                }
                (_, None) => {
                    return Err(CommandError::usage(format!(
                        "follower: account {} does not exist",
                        args.follower
                    )));
                }
                (Some(m), _) if m != "master" => {
                    return Err(CommandError::usage(format!(
                        "master: account {} is a {m}",
                        args.master
                    )));
                }
                (_, Some(f)) if f != "follower" => {
                    return Err(CommandError::usage(format!(
                        "follower: account {} is a {f}",
                        args.follower
                    )));
                }
                _ => {}
            }
            let id = rows::add(&mut tx, args.master, args.follower)
                .await
                .map_err(sql(&what))?;
            rows::set(&mut tx, id, &change(&args.fields, values))
                .await
                .map_err(sql(&what))?;
            node_accepts(&mut tx, args.follower, id).await?;
            tx.commit().await.map_err(sql(&what))?;
            show(&mut conn, id, args.manage.json).await
        }
        LinksCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let views = rows::list(&mut conn, args.master, args.follower)
                .await
                .map_err(sql("listing links"))?;
            print(args.manage.json, &views);
            Ok(())
        }
        LinksCommand::Show(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            show(&mut conn, args.id, args.manage.json).await
        }
        LinksCommand::Set(args) => {
            let values = check_link(&args.fields)?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("link {}", args.id);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            if !rows::set(&mut tx, args.id, &change(&args.fields, values))
                .await
                .map_err(sql(&what))?
            {
                return Err(no_such("link", args.id));
            }
            let follower = rows::follower_of(&mut tx, args.id)
                .await
                .map_err(sql(&what))?;
            node_accepts(&mut tx, follower, args.id).await?;
            tx.commit().await.map_err(sql(&what))?;
            show(&mut conn, args.id, args.manage.json).await
        }
        LinksCommand::Remove(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let Some(on_remove) = rows::remove(&mut conn, args.id)
                .await
                .map_err(sql(&format!("link {}", args.id)))?
            else {
                return Err(no_such("link", args.id));
            };
            if args.manage.json {
                println!(
                    "{}",
                    serde_json::json!({ "removed": args.id, "on_remove": on_remove })
                );
            } else if on_remove == OnRemove::Close.as_str() {
                println!(
                    "link {} removed; the follower's node closes the copies it made",
                    args.id
                );
            } else {
                println!(
                    "link {} removed; the copies it made stay open, no longer managed",
                    args.id
                );
            }
            Ok(())
        }
    }
}

async fn show(conn: &mut PgConnection, id: i64, json: bool) -> Result<(), CommandError> {
    let view = rows::get(conn, id)
        .await
        .map_err(sql(&format!("link {id}")))?
        .ok_or_else(|| no_such("link", id))?;
    print_one(json, &view);
    Ok(())
}

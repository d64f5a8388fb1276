//! `copier-node accounts ...` and `copier-node links ...`: the rows operators manage, without
//! SQL. Every change is one transaction, checked as the node checks the row (a link is read back
//! through the node's own parser before the transaction commits), and a refusal names the field.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;
use sqlx::{Connection, PgConnection, Row};

use super::{CommandError, load};
use crate::broker::fix::FixEndpoint;
use crate::cli::{
    AccountFields, AccountsCommand, CopiesArgs, LinkFields, LinksCommand, ManageArgs, RiskCommand,
    WhyArgs,
};
use crate::config::Config;
use crate::db;

async fn connect(
    manage: &ManageArgs,
    extra: Vec<(&'static str, Option<String>)>,
) -> Result<(Config, PgConnection), CommandError> {
    let mut flags = manage.db.flags();
    flags.extend(extra);
    let (config, _) = load(manage.db.config.as_deref(), &flags, false)?;
    let conn = db::admin_connect(&config.database_url).await?;
    Ok((config, conn))
}

fn sql(what: &str) -> impl FnOnce(sqlx::Error) -> CommandError + '_ {
    move |e| {
        // A CHECK or foreign key the schema enforces is a usage error naming its constraint.
        if let sqlx::Error::Database(d) = &e
            && (d.is_check_violation() || d.is_foreign_key_violation() || d.is_unique_violation())
        {
            return CommandError::usage(format!("{what}: refused by the schema: {}", d.message()));
        }
        CommandError::failed(format!("{what}: {}", db::describe(&e)))
    }
}

/// An account as `list` and `show` print it.
#[derive(Debug, Serialize)]
struct AccountView {
    id: i64,
    platform: String,
    role: String,
    enabled: bool,
    server: String,
    login: String,
    has_password: bool,
    owner: Option<String>,
    status: Option<String>,
    currency: Option<String>,
    max_open_copies: Option<i64>,
}

impl std::fmt::Display for AccountView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "account {}: {} {} {} login {} on {}{}; owner {}; status {}",
            self.id,
            self.platform,
            self.role,
            if self.enabled { "enabled" } else { "disabled" },
            self.login,
            self.server,
            if self.has_password {
                " (password stored)"
            } else {
                ""
            },
            self.owner.as_deref().unwrap_or("none"),
            self.status.as_deref().unwrap_or("-"),
        )?;
        if let Some(c) = &self.currency {
            write!(f, "; currency {c}")?;
        }
        if let Some(n) = self.max_open_copies {
            write!(f, "; max_open_copies {n}")?;
        }
        Ok(())
    }
}

const ACCOUNT_SELECT: &str =
    "SELECT id, platform, role, enabled, server, login, credentials IS NOT NULL AS has_password,
        CASE WHEN lease_until > now() THEN node_id END AS owner, status, currency,
        max_open_copies::bigint AS max_open_copies
   FROM trading_accounts";

fn account_of(r: &sqlx::postgres::PgRow) -> Result<AccountView, sqlx::Error> {
    Ok(AccountView {
        id: r.try_get("id")?,
        platform: r.try_get("platform")?,
        role: r.try_get("role")?,
        enabled: r.try_get("enabled")?,
        server: r.try_get("server")?,
        login: r.try_get("login")?,
        has_password: r.try_get("has_password")?,
        owner: r.try_get("owner")?,
        status: r.try_get("status")?,
        currency: r.try_get("currency")?,
        max_open_copies: r.try_get("max_open_copies")?,
    })
}

fn print<T: Serialize + std::fmt::Display>(json: bool, items: &[T]) {
    if json {
        println!("{}", serde_json::to_string(items).expect("serialises"));
    } else {
        for i in items {
            println!("{i}");
        }
    }
}

fn print_one<T: Serialize + std::fmt::Display>(json: bool, item: &T) {
    if json {
        println!("{}", serde_json::to_string(item).expect("serialises"));
    } else {
        println!("{item}");
    }
}

/// Every problem of an account's fields, each naming its field.
fn check_account(fields: &AccountFields, adding: bool) -> Vec<String> {
    let mut problems = Vec::new();
    let need = |v: &Option<String>, name: &str, problems: &mut Vec<String>| {
        if adding && v.as_deref().is_none_or(str::is_empty) {
            problems.push(format!("--{name} is required"));
        }
    };
    need(&fields.platform, "platform", &mut problems);
    need(&fields.role, "role", &mut problems);
    need(&fields.server, "server", &mut problems);
    need(&fields.login, "login", &mut problems);
    if let Some(role) = &fields.role
        && role != "master"
        && role != "follower"
    {
        problems.push(format!("role: {role:?} is neither master nor follower"));
    }
    if fields.platform.as_deref() == Some("") {
        problems.push("platform: empty".into());
    }
    if fields.login.as_deref() == Some("") {
        problems.push("login: empty".into());
    }
    if let Some(server) = &fields.server {
        if FixEndpoint::is_fix(server) {
            if let Err(e) = FixEndpoint::parse(server) {
                problems.push(format!("server: {e}"));
            }
        } else {
            let ok = server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                problems.push(format!(
                    "server: {server:?} is neither host:port nor fix://host:port?target=..."
                ));
            }
        }
    }
    problems
}

fn refuse(problems: Vec<String>) -> Result<(), CommandError> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CommandError::usage(problems.join("\n")))
    }
}

/// The password from standard input, encrypted with the configured key.
fn read_password(config: &Config) -> Result<String, CommandError> {
    let key = config.credentials_key.clone().ok_or_else(|| {
        CommandError::usage(
            "--password-stdin needs a credentials key: set COPIER_CREDENTIALS_KEY or `credentials_key_file`",
        )
    })?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| {
        CommandError::failed(format!("cannot read the password from standard input: {e}"))
    })?;
    let password = line.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(CommandError::usage(
            "--password-stdin: no password on standard input",
        ));
    }
    Ok(key.encrypt(password))
}

pub(super) async fn accounts(command: AccountsCommand) -> Result<(), CommandError> {
    match command {
        AccountsCommand::Add(args) => {
            refuse(check_account(&args.fields, true))?;
            let (config, mut conn) = connect(
                &args.manage,
                vec![(
                    "credentials_key_file",
                    args.fields.credentials_key_file.clone(),
                )],
            )
            .await?;
            let credentials = if args.fields.password_stdin {
                Some(read_password(&config)?)
            } else {
                None
            };
            let f = &args.fields;
            sqlx::query(
                "INSERT INTO trading_accounts (id, platform, role, server, login, credentials, enabled)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)",
            )
            .bind(args.id)
            .bind(&f.platform)
            .bind(&f.role)
            .bind(&f.server)
            .bind(&f.login)
            .bind(credentials)
            .bind(!args.disabled)
            .execute(&mut conn)
            .await
            .map_err(sql(&format!("account {}", args.id)))?;
            show_account(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let rows = sqlx::query(&format!(
                "{ACCOUNT_SELECT} WHERE $1::text IS NULL OR platform = $1 ORDER BY id"
            ))
            .bind(&args.platform)
            .fetch_all(&mut conn)
            .await
            .map_err(sql("listing accounts"))?;
            let views = rows
                .iter()
                .map(account_of)
                .collect::<Result<Vec<_>, _>>()
                .map_err(sql("listing accounts"))?;
            print(args.manage.json, &views);
            Ok(())
        }
        AccountsCommand::Show(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            show_account(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Set(args) => {
            refuse(check_account(&args.fields, false))?;
            let mut problems = Vec::new();
            let max_open_copies = open_copies_limit(&args.max_open_copies, &mut problems);
            if !problems.is_empty() {
                return Err(CommandError::usage(problems.join("\n")));
            }
            let (config, mut conn) = connect(
                &args.manage,
                vec![(
                    "credentials_key_file",
                    args.fields.credentials_key_file.clone(),
                )],
            )
            .await?;
            let credentials = if args.fields.password_stdin {
                Some(read_password(&config)?)
            } else {
                None
            };
            let f = &args.fields;
            let what = format!("account {}", args.id);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            // Locks the row first: a concurrent `links add` waits for this change (and sees it).
            sqlx::query("SELECT FROM trading_accounts WHERE id = $1 FOR UPDATE")
                .bind(args.id)
                .execute(&mut *tx)
                .await
                .map_err(sql(&what))?;
            if let Some(role) = &f.role {
                // A role change would leave links pointing the wrong way.
                let links: Vec<i64> = sqlx::query_scalar(
                    "SELECT id FROM copy_links WHERE (master_id = $1 AND $2 <> 'master') OR (follower_id = $1 AND $2 <> 'follower') ORDER BY id",
                )
                .bind(args.id)
                .bind(role)
                .fetch_all(&mut *tx)
                .await
                .map_err(sql(&what))?;
                if !links.is_empty() {
                    return Err(CommandError::usage(format!(
                        "role: account {} is in copy links {links:?} as the other role; remove them first",
                        args.id
                    )));
                }
            }
            let done = sqlx::query(
                "UPDATE trading_accounts SET
                    platform = coalesce($2, platform), role = coalesce($3, role),
                    server = coalesce($4, server), login = coalesce($5, login),
                    credentials = CASE WHEN $7 THEN NULL ELSE coalesce($6, credentials) END,
                    enabled = coalesce($8, enabled),
                    max_open_copies = CASE WHEN $9 THEN $10::integer ELSE max_open_copies END
                  WHERE id = $1",
            )
            .bind(args.id)
            .bind(&f.platform)
            .bind(&f.role)
            .bind(&f.server)
            .bind(&f.login)
            .bind(credentials)
            .bind(args.clear_password)
            .bind(args.enabled)
            .bind(max_open_copies.is_some())
            .bind(max_open_copies.flatten())
            .execute(&mut *tx)
            .await
            .map_err(sql(&what))?;
            if done.rows_affected() == 0 {
                return Err(CommandError::usage(format!(
                    "account {}: no such account",
                    args.id
                )));
            }
            tx.commit().await.map_err(sql(&what))?;
            show_account(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Disable(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let done = sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = $1")
                .bind(args.id)
                .execute(&mut conn)
                .await
                .map_err(sql(&format!("account {}", args.id)))?;
            if done.rows_affected() == 0 {
                return Err(CommandError::usage(format!(
                    "account {}: no such account",
                    args.id
                )));
            }
            show_account(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Remove(args) => {
            let wait = crate::config::parse_duration(&args.wait)
                .map_err(|e| CommandError::usage(format!("--wait: {e}")))?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            remove_account(&mut conn, args.id, wait).await?;
            if args.manage.json {
                println!("{}", serde_json::json!({ "removed": args.id }));
            } else {
                println!("account {} removed", args.id);
            }
            Ok(())
        }
    }
}

async fn show_account(conn: &mut PgConnection, id: i64, json: bool) -> Result<(), CommandError> {
    show(conn, ACCOUNT_SELECT, "account", id, json, account_of).await
}

/// Prints the row `id` of `select` (`kind` names it in errors), read by `of`.
async fn show<T: Serialize + std::fmt::Display>(
    conn: &mut PgConnection,
    select: &str,
    kind: &str,
    id: i64,
    json: bool,
    of: fn(&sqlx::postgres::PgRow) -> Result<T, sqlx::Error>,
) -> Result<(), CommandError> {
    let what = format!("{kind} {id}");
    let row = sqlx::query(&format!("{select} WHERE id = $1"))
        .bind(id)
        .fetch_optional(conn)
        .await
        .map_err(sql(&what))?
        .ok_or_else(|| CommandError::usage(format!("{kind} {id}: no such {kind}")))?;
    print_one(json, &of(&row).map_err(sql(&what))?);
    Ok(())
}

/// Deletes an account no node trades: one a node owns is disabled and deleted once its owner
/// released it (the delete itself matches only a row without a live owner), or refused after
/// `wait`; one with copy links is refused.
async fn remove_account(
    conn: &mut PgConnection,
    id: i64,
    wait: Duration,
) -> Result<(), CommandError> {
    let what = format!("account {id}");
    let links: Vec<i64> = sqlx::query_scalar(
        "SELECT id FROM copy_links WHERE master_id = $1 OR follower_id = $1 ORDER BY id",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await
    .map_err(sql(&what))?;
    if !links.is_empty() {
        return Err(CommandError::usage(format!(
            "account {id} is in copy links {links:?}: remove them first (copier-node links remove <id>)"
        )));
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut disabled = false;
    loop {
        // Only a row no node may still trade: no owner, or an owner whose membership expired
        // outside a database failover grace (during a grace the new primary may lack the
        // owner's last renewals, and the owner may still trust its gate).
        let done = sqlx::query(
            "DELETE FROM trading_accounts a WHERE a.id = $1
               AND (a.node_id IS NULL
                    OR (NOT EXISTS (SELECT FROM nodes n WHERE n.node_id = a.node_id AND n.lease_until > now())
                        AND NOT EXISTS (SELECT FROM copier_database d WHERE d.claims_after > now())))",
        )
        .bind(id)
        .execute(&mut *conn)
        .await
        .map_err(sql(&what))?;
        if done.rows_affected() > 0 {
            return Ok(());
        }
        let owner: Option<Option<String>> =
            sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = $1")
                .bind(id)
                .fetch_optional(&mut *conn)
                .await
                .map_err(sql(&what))?;
        let Some(owner) = owner else {
            return Err(CommandError::usage(format!(
                "account {id}: no such account"
            )));
        };
        if !disabled {
            sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = $1")
                .bind(id)
                .execute(&mut *conn)
                .await
                .map_err(sql(&what))?;
            disabled = true;
            eprintln!(
                "account {id} is traded by node {}: disabled it; waiting up to {wait:?} for the release",
                owner.as_deref().unwrap_or("?")
            );
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(CommandError::failed(format!(
                "account {id} is still owned by node {} after {wait:?}: it is disabled and was not deleted; run remove again once it is released",
                owner.as_deref().unwrap_or("?")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A link as `list` and `show` print it.
#[derive(Debug, Serialize)]
struct LinkView {
    id: i64,
    master_id: i64,
    follower_id: i64,
    enabled: bool,
    magic: i64,
    lot_mode: String,
    lot_value: f64,
    reverse: bool,
    copy_sl_tp: bool,
    symbol_map: serde_json::Value,
    copy_existing: bool,
    symbols: Option<Vec<String>>,
    magics: Option<Vec<i64>>,
    sides: String,
    close_only: bool,
    max_lot: Option<f64>,
    max_delay_ms: Option<i64>,
    max_slippage: Option<f64>,
    equity_stop: Option<f64>,
    copy_sl: bool,
    copy_tp: bool,
    max_sl_distance: Option<f64>,
    use_min_lot: bool,
    min_master_lot: Option<f64>,
    max_open_copies: Option<i64>,
    sl_points: Option<f64>,
    tp_points: Option<f64>,
    on_remove: String,
    pending_orders: String,
}

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
        if self.on_remove == "close" {
            write!(f, ", its copies closed when it is removed")?;
        }
        if self.pending_orders == "fill_only" {
            write!(f, ", pending orders copied at their fill only")?;
        }
        Ok(())
    }
}

const LINK_SELECT: &str =
    "SELECT id, master_id, follower_id, enabled, magic, lot_mode, lot_value, reverse, copy_sl_tp,
        symbol_map::text AS symbol_map, copy_existing, symbols, magics, sides, close_only, max_lot,
        max_delay_ms, max_slippage, equity_stop, copy_sl, copy_tp, max_sl_distance, use_min_lot,
        min_master_lot, max_open_copies::bigint AS max_open_copies, sl_points, tp_points, on_remove,
        pending_orders
   FROM copy_links";

fn link_of(r: &sqlx::postgres::PgRow) -> Result<LinkView, sqlx::Error> {
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

/// A `max_open_copies` given on the command line (a link's or a follower's): 1 to the column's
/// largest integer, or `none`.
fn open_copies_limit(v: &Option<String>, problems: &mut Vec<String>) -> Option<Option<i64>> {
    let limit = limit::<i64>("max_open_copies", v, problems);
    if let Some(Some(n)) = limit
        && !(1..=i64::from(i32::MAX)).contains(&n)
    {
        problems.push(format!("max_open_copies: {n} must be 1 to {}", i32::MAX));
    }
    limit
}

/// A limit given on the command line: a number, or `none` (lifted).
fn limit<T: std::str::FromStr>(
    name: &str,
    v: &Option<String>,
    problems: &mut Vec<String>,
) -> Option<Option<T>> {
    let text = v.as_deref()?;
    if text == "none" {
        return Some(None);
    }
    match text.parse::<T>() {
        Ok(n) => Some(Some(n)),
        Err(_) => {
            problems.push(format!("{name}: {text:?} is not a number (or `none`)"));
            None
        }
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
        && let Err(e) = mode.parse::<crate::model::link::LotMode>()
    {
        problems.push(format!(
            "lot_mode: {e} (fixed, multiplier, balance_ratio, equity_ratio or risk_percent)"
        ));
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
        && let Err(e) = sides.parse::<crate::model::link::Sides>()
    {
        problems.push(format!("sides: {e}"));
    }
    if let Some(v) = &f.on_remove
        && !matches!(v.as_str(), "leave" | "close")
    {
        problems.push(format!("on_remove: {v:?} is not `leave` or `close`"));
    }
    if let Some(v) = &f.pending_orders
        && !matches!(v.as_str(), "copy" | "fill_only")
    {
        problems.push(format!(
            "pending_orders: {v:?} is not `copy` or `fill_only`"
        ));
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

/// Writes a link's given fields (NULL parameters keep the current value).
async fn write_link(
    conn: &mut PgConnection,
    id: i64,
    f: &LinkFields,
    v: &LinkValues,
) -> Result<u64, sqlx::Error> {
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
    .bind(&f.lot_mode)
    .bind(f.lot_value)
    .bind(f.reverse)
    .bind(f.copy_sl_tp)
    .bind(&f.symbol_map)
    .bind(f.copy_existing)
    .bind(f.enabled)
    .bind(&f.sides)
    .bind(f.close_only)
    .bind(v.symbols.is_some())
    .bind(v.symbols.clone().flatten())
    .bind(v.magics.is_some())
    .bind(v.magics.clone().flatten())
    .bind(v.max_lot.is_some())
    .bind(v.max_lot.flatten())
    .bind(v.max_delay_ms.is_some())
    .bind(v.max_delay_ms.flatten())
    .bind(v.max_slippage.is_some())
    .bind(v.max_slippage.flatten())
    .bind(v.equity_stop.is_some())
    .bind(v.equity_stop.flatten())
    .bind(f.copy_sl)
    .bind(f.copy_tp)
    .bind(f.use_min_lot)
    .bind(v.max_sl_distance.is_some())
    .bind(v.max_sl_distance.flatten())
    .bind(v.min_master_lot.is_some())
    .bind(v.min_master_lot.flatten())
    .bind(v.max_open_copies.is_some())
    .bind(v.max_open_copies.flatten())
    .bind(v.sl_points.is_some())
    .bind(v.sl_points.flatten())
    .bind(v.tp_points.is_some())
    .bind(v.tp_points.flatten())
    .bind(&f.on_remove)
    .bind(&f.pending_orders)
    .execute(conn)
    .await?;
    Ok(done.rows_affected())
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

pub(super) async fn links(command: LinksCommand) -> Result<(), CommandError> {
    match command {
        LinksCommand::Add(args) => {
            let values = check_link(&args.fields)?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("link {} -> {}", args.master, args.follower);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            let roles: Vec<(i64, String, String)> = sqlx::query_as(
                "SELECT id, role, platform FROM trading_accounts WHERE id = ANY($1) FOR SHARE",
            )
            .bind(vec![args.master, args.follower])
            .fetch_all(&mut *tx)
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
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO copy_links (master_id, follower_id) VALUES ($1, $2) RETURNING id",
            )
            .bind(args.master)
            .bind(args.follower)
            .fetch_one(&mut *tx)
            .await
            .map_err(sql(&what))?;
            write_link(&mut tx, id, &args.fields, &values)
                .await
                .map_err(sql(&what))?;
            node_accepts(&mut tx, args.follower, id).await?;
            tx.commit().await.map_err(sql(&what))?;
            show_link(&mut conn, id, args.manage.json).await
        }
        LinksCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let rows = sqlx::query(&format!(
                "{LINK_SELECT} WHERE ($1::bigint IS NULL OR master_id = $1) AND ($2::bigint IS NULL OR follower_id = $2) ORDER BY id"
            ))
            .bind(args.master)
            .bind(args.follower)
            .fetch_all(&mut conn)
            .await
            .map_err(sql("listing links"))?;
            let views = rows
                .iter()
                .map(link_of)
                .collect::<Result<Vec<_>, _>>()
                .map_err(sql("listing links"))?;
            print(args.manage.json, &views);
            Ok(())
        }
        LinksCommand::Show(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            show_link(&mut conn, args.id, args.manage.json).await
        }
        LinksCommand::Set(args) => {
            let values = check_link(&args.fields)?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("link {}", args.id);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            if write_link(&mut tx, args.id, &args.fields, &values)
                .await
                .map_err(sql(&what))?
                == 0
            {
                return Err(CommandError::usage(format!(
                    "link {}: no such link",
                    args.id
                )));
            }
            let follower: i64 =
                sqlx::query_scalar("SELECT follower_id FROM copy_links WHERE id = $1")
                    .bind(args.id)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(sql(&what))?;
            node_accepts(&mut tx, follower, args.id).await?;
            tx.commit().await.map_err(sql(&what))?;
            show_link(&mut conn, args.id, args.manage.json).await
        }
        LinksCommand::Remove(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let removed: Option<String> =
                sqlx::query_scalar("DELETE FROM copy_links WHERE id = $1 RETURNING on_remove")
                    .bind(args.id)
                    .fetch_optional(&mut conn)
                    .await
                    .map_err(sql(&format!("link {}", args.id)))?;
            let Some(on_remove) = removed else {
                return Err(CommandError::usage(format!(
                    "link {}: no such link",
                    args.id
                )));
            };
            if args.manage.json {
                println!(
                    "{}",
                    serde_json::json!({ "removed": args.id, "on_remove": on_remove })
                );
            } else if on_remove == "close" {
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

async fn show_link(conn: &mut PgConnection, id: i64, json: bool) -> Result<(), CommandError> {
    show(conn, LINK_SELECT, "link", id, json, link_of).await
}

/// One link's part of the answer to `why`.
#[derive(Debug, Serialize)]
struct WhyLink {
    link_id: i64,
    master_id: i64,
    link_enabled: bool,
    /// The master's last published state names the position (open when published).
    master_position_published: bool,
    /// Decisions recorded for this (link, master ticket), oldest first.
    decisions: Vec<WhyDecision>,
    /// FIX followers: the copy's orders in the order ledger (marker `mc<ticket>`).
    fix_orders: Vec<WhyOrder>,
    verdict: String,
}

#[derive(Debug, Serialize)]
struct WhyDecision {
    code: Option<String>,
    reason: String,
    is_final: bool,
    decided_at: String,
    node_id: Option<String>,
}

#[derive(Debug, Serialize)]
struct WhyOrder {
    cl_ord_id: String,
    kind: String,
    state: String,
    position_id: Option<i64>,
}

impl std::fmt::Display for WhyLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "link {} (master {}): {}",
            self.link_id, self.master_id, self.verdict
        )?;
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

pub(super) async fn why(args: WhyArgs) -> Result<(), CommandError> {
    let (_, mut conn) = connect(&args.manage, vec![]).await?;
    let what = format!(
        "follower {} and master ticket {}",
        args.follower, args.master_ticket
    );
    let role: Option<String> =
        sqlx::query_scalar("SELECT role FROM trading_accounts WHERE id = $1")
            .bind(args.follower)
            .fetch_optional(&mut conn)
            .await
            .map_err(sql(&what))?;
    match role.as_deref() {
        None => {
            return Err(CommandError::usage(format!(
                "account {}: no such account",
                args.follower
            )));
        }
        Some("follower") => {}
        Some(other) => {
            return Err(CommandError::usage(format!(
                "account {} is a {other}, not a follower",
                args.follower
            )));
        }
    }
    let links: Vec<(i64, i64, bool)> = sqlx::query_as(
        "SELECT id, master_id, enabled FROM copy_links WHERE follower_id = $1 ORDER BY id",
    )
    .bind(args.follower)
    .fetch_all(&mut conn)
    .await
    .map_err(sql(&what))?;
    let marker = crate::model::marker(args.master_ticket);
    let orders: Vec<(String, String, String, Option<i64>)> = sqlx::query_as(
        "SELECT cl_ord_id, kind, state, position_id FROM fix_orders
          WHERE account_id = $1 AND comment = $2 ORDER BY sent_at",
    )
    .bind(args.follower)
    .bind(&marker)
    .fetch_all(&mut conn)
    .await
    .map_err(sql(&what))?;
    let mut out = Vec::new();
    for (link_id, master_id, enabled) in links {
        let published: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT FROM master_state m, jsonb_array_elements(m.positions) p
                             WHERE m.master_id = $1 AND (p ->> 'ticket')::bigint = $2)",
        )
        .bind(master_id)
        .bind(args.master_ticket)
        .fetch_one(&mut conn)
        .await
        .map_err(sql(&what))?;
        let rows = sqlx::query(
            "SELECT code, reason, final, decided_at::text AS decided_at, node_id FROM copy_skips
              WHERE link_id = $1 AND master_ticket = $2 ORDER BY decided_at",
        )
        .bind(link_id)
        .bind(args.master_ticket)
        .fetch_all(&mut conn)
        .await
        .map_err(sql(&what))?;
        let decisions = rows
            .iter()
            .map(|r| {
                Ok(WhyDecision {
                    code: r.try_get("code")?,
                    reason: r.try_get("reason")?,
                    is_final: r.try_get("final")?,
                    decided_at: r.try_get("decided_at")?,
                    node_id: r.try_get("node_id")?,
                })
            })
            .collect::<Result<Vec<_>, sqlx::Error>>()
            .map_err(sql(&what))?;
        let fix_orders: Vec<WhyOrder> = orders
            .iter()
            .filter(|o| o.0.starts_with(&format!("l{link_id}-")))
            .map(|o| WhyOrder {
                cl_ord_id: o.0.clone(),
                kind: o.1.clone(),
                state: o.2.clone(),
                position_id: o.3,
            })
            .collect();
        let ledger: Vec<(i64, Option<i64>)> = sqlx::query_as(
            "SELECT follower_ticket, accepted_ms FROM copy_ledger
              WHERE follower_id = $1 AND link_id = $2 AND master_ticket = $3 ORDER BY recorded_at",
        )
        .bind(args.follower)
        .bind(link_id)
        .bind(args.master_ticket)
        .fetch_all(&mut conn)
        .await
        .map_err(sql(&what))?;
        let verdict = if let Some((ticket, _)) = ledger.first() {
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
        };
        out.push(WhyLink {
            link_id,
            master_id,
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

pub(super) async fn copies(args: CopiesArgs) -> Result<(), CommandError> {
    let (_, mut conn) = connect(&args.manage, vec![]).await?;
    let what = format!("copies of follower {}", args.follower);
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

/// The risk limits' rows as `risk list` shows them.
#[derive(Debug, serde::Serialize)]
struct RiskRow {
    id: i64,
    account_id: i64,
    period: String,
    basis: String,
    relative: bool,
    amount: f64,
    action: String,
    period_key: Option<String>,
    start_value: Option<f64>,
    hit_reason: Option<String>,
    hit_at: Option<String>,
}

pub(super) async fn risk(command: RiskCommand) -> Result<(), CommandError> {
    use crate::copier::risk::{Basis, Period, RiskAction};
    match command {
        RiskCommand::Add(args) => {
            if Period::parse(&args.period).is_none() {
                return Err(CommandError::usage(format!(
                    "--period {}: expected daily, weekly, monthly or lifetime",
                    args.period
                )));
            }
            if Basis::parse(&args.basis).is_none() {
                return Err(CommandError::usage(format!(
                    "--basis {}: expected balance or equity",
                    args.basis
                )));
            }
            if RiskAction::parse(&args.action).is_none() {
                return Err(CommandError::usage(format!(
                    "--action {}: expected close_only or close_all",
                    args.action
                )));
            }
            let (relative, amount) = match (args.percent, args.amount) {
                (Some(p), None) if p > 0.0 && p <= 100.0 => (true, p),
                (None, Some(a)) if a > 0.0 && a.is_finite() => (false, a),
                (Some(_), None) => {
                    return Err(CommandError::usage(
                        "--percent: expected more than 0, at most 100",
                    ));
                }
                (None, Some(_)) => {
                    return Err(CommandError::usage("--amount: expected a positive amount"));
                }
                _ => {
                    return Err(CommandError::usage("give one of --percent and --amount"));
                }
            };
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("risk limit of account {}", args.account);
            let row: Option<(String, String)> =
                sqlx::query_as("SELECT role, server FROM trading_accounts WHERE id = $1")
                    .bind(args.account)
                    .fetch_optional(&mut conn)
                    .await
                    .map_err(sql(&what))?;
            match row.as_ref().map(|(r, s)| (r.as_str(), s.as_str())) {
                None => {
                    return Err(CommandError::usage(format!(
                        "account {}: no such account",
                        args.account
                    )));
                }
                Some((_, server)) if server.starts_with("fix://") => {
                    return Err(CommandError::usage(format!(
                        "account {} trades over FIX, whose adapter reads no balance or equity: a risk limit could never be judged there",
                        args.account
                    )));
                }
                Some(("follower", _)) => {}
                Some((role, _)) => {
                    return Err(CommandError::usage(format!(
                        "account {} is a {role}: risk limits apply to followers",
                        args.account
                    )));
                }
            }
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO risk_limits (account_id, period, basis, relative, amount, action)
                 VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
            )
            .bind(args.account)
            .bind(&args.period)
            .bind(&args.basis)
            .bind(relative)
            .bind(amount)
            .bind(&args.action)
            .fetch_one(&mut conn)
            .await
            .map_err(sql(&what))?;
            show_risk(&mut conn, Some(args.account), Some(id), args.manage.json).await
        }
        RiskCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            show_risk(&mut conn, args.account, None, args.manage.json).await
        }
        RiskCommand::Reset(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("risk limits of account {}", args.account);
            // Clearing the state is the reset: the owner's next reading starts each period again.
            let done = sqlx::query(
                "UPDATE risk_limits
                    SET period_key = NULL, start_value = NULL, hit_at = NULL, hit_reason = NULL,
                        updated_at = now()
                  WHERE account_id = $1 AND ($2::bigint IS NULL OR id = $2)",
            )
            .bind(args.account)
            .bind(args.limit)
            .execute(&mut conn)
            .await
            .map_err(sql(&what))?;
            if done.rows_affected() == 0 {
                return Err(CommandError::usage(format!("{what}: no such limit")));
            }
            show_risk(&mut conn, Some(args.account), args.limit, args.manage.json).await
        }
        RiskCommand::Remove(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let done = sqlx::query("DELETE FROM risk_limits WHERE id = $1")
                .bind(args.id)
                .execute(&mut conn)
                .await
                .map_err(sql(&format!("risk limit {}", args.id)))?;
            if done.rows_affected() == 0 {
                return Err(CommandError::usage(format!(
                    "risk limit {}: no such limit",
                    args.id
                )));
            }
            if args.manage.json {
                println!("{}", serde_json::json!({ "removed": args.id }));
            } else {
                println!("risk limit {} removed", args.id);
            }
            Ok(())
        }
    }
}

async fn show_risk(
    conn: &mut PgConnection,
    account: Option<i64>,
    id: Option<i64>,
    json: bool,
) -> Result<(), CommandError> {
    use sqlx::Row;
    let rows = sqlx::query(
        "SELECT id, account_id, period, basis, relative, amount, action, period_key, start_value,
                hit_reason, to_char(hit_at, 'YYYY-MM-DD\"T\"HH24:MI:SS.MSOF') AS hit_at
           FROM risk_limits
          WHERE ($1::bigint IS NULL OR account_id = $1) AND ($2::bigint IS NULL OR id = $2)
          ORDER BY account_id, id",
    )
    .bind(account)
    .bind(id)
    .fetch_all(conn)
    .await
    .map_err(sql("risk limits"))?;
    let rows = rows
        .iter()
        .map(|r| {
            Ok(RiskRow {
                id: r.try_get("id")?,
                account_id: r.try_get("account_id")?,
                period: r.try_get("period")?,
                basis: r.try_get("basis")?,
                relative: r.try_get("relative")?,
                amount: r.try_get("amount")?,
                action: r.try_get("action")?,
                period_key: r.try_get("period_key")?,
                start_value: r.try_get("start_value")?,
                hit_reason: r.try_get("hit_reason")?,
                hit_at: r.try_get("hit_at")?,
            })
        })
        .collect::<Result<Vec<RiskRow>, sqlx::Error>>()
        .map_err(sql("risk limits"))?;
    if json {
        println!("{}", serde_json::to_string(&rows).expect("serialises"));
        return Ok(());
    }
    for r in &rows {
        println!(
            "limit {} of account {}: {} {} drawdown {}{}, {}; {}",
            r.id,
            r.account_id,
            r.period,
            r.basis,
            r.amount,
            if r.relative { " %" } else { "" },
            r.action,
            match (&r.hit_reason, &r.period_key, r.start_value) {
                (Some(reason), _, _) => format!(
                    "REACHED at {}: {reason}",
                    r.hit_at.as_deref().unwrap_or("?")
                ),
                (None, Some(key), Some(start)) => format!("clear in {key} (started at {start})"),
                _ => "not started (the owner's next reading starts it)".to_string(),
            }
        );
    }
    Ok(())
}

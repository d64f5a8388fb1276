//! `copier-node accounts ...` and `copier-node links ...` against a real database: every change,
//! every refusal (naming its field), the JSON output, the password read from standard input
//! and stored encrypted, and the removal of an account a node is trading.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use copier_node::config::Secret;
use copier_node::credentials::CredentialsKey;

use crate::support::process::{binary, run_to_end};
use crate::support::{FAST, TestDb, config, eventually, start_node};

fn cli(db: &TestDb, args: &[&str]) -> (i32, String, String) {
    run_to_end(args, &[("DATABASE_URL", db.url.as_str())])
}

fn ok(db: &TestDb, args: &[&str]) -> String {
    let (code, out, err) = cli(db, args);
    assert_eq!(code, 0, "{args:?}: {err}");
    out
}

fn refused(db: &TestDb, args: &[&str], names: &str) {
    let (code, out, err) = cli(db, args);
    assert_eq!(
        code, 2,
        "{args:?} should be refused as a usage error: {out}{err}"
    );
    assert!(
        err.contains(names),
        "{args:?}: the refusal names {names:?}: {err}"
    );
}

#[tokio::test]
async fn accounts_and_links_are_managed_and_bad_values_refused_naming_the_field() {
    let db = TestDb::new().await;
    let added = ok(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "1",
            "--platform",
            "mt5",
            "--role",
            "master",
            "--server",
            "10.0.0.5:443",
            "--login",
            "m1",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&added).unwrap();
    assert_eq!(
        (v["id"].as_i64(), v["role"].as_str()),
        (Some(1), Some("master"))
    );
    ok(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "2",
            "--platform",
            "mt5",
            "--role",
            "follower",
            "--server",
            "fix://venue:9876?target=CSERVER",
            "--login",
            "f2",
        ],
    );

    refused(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "3",
            "--platform",
            "mt5",
            "--role",
            "boss",
            "--server",
            "h:1",
            "--login",
            "x",
        ],
        "role",
    );
    refused(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "3",
            "--platform",
            "mt5",
            "--role",
            "follower",
            "--server",
            "nowhere",
            "--login",
            "x",
        ],
        "server",
    );
    refused(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "3",
            "--platform",
            "mt5",
            "--role",
            "follower",
            "--server",
            "fix://h:1",
            "--login",
            "x",
        ],
        "target",
    );
    refused(
        &db,
        &[
            "accounts", "add", "--id", "3", "--role", "follower", "--server", "h:1", "--login", "x",
        ],
        "platform: required",
    );
    refused(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "1",
            "--platform",
            "mt5",
            "--role",
            "master",
            "--server",
            "h:1",
            "--login",
            "dup",
        ],
        "account 1: id: an account with this id exists already",
    );

    // Links: every bad value is refused with its field; nothing is written.
    let bad = [
        (vec!["--lot-mode", "double"], "lot_mode"),
        (vec!["--lot-value", "0"], "lot_value"),
        (vec!["--symbol-map", "[1,2]"], "symbol_map"),
        (vec!["--sides", "up"], "sides"),
        (vec!["--max-lot", "-1"], "max_lot"),
        (vec!["--max-delay-ms", "soon"], "max_delay_ms"),
        (vec!["--magics", "1,x"], "magics"),
        (vec!["--max-open-copies", "0"], "max_open_copies"),
        (vec!["--min-master-lot", "-1"], "min_master_lot"),
        (vec!["--max-sl-distance", "far"], "max_sl_distance"),
        (vec!["--sl-points", "0"], "sl_points"),
        (vec!["--tp-points", "-3"], "tp_points"),
        (vec!["--on-remove", "burn"], "on_remove"),
        (vec!["--pending-orders", "maybe"], "pending_orders"),
    ];
    for (flags, field) in bad {
        let mut args = vec!["links", "add", "--master", "1", "--follower", "2"];
        args.extend(flags);
        refused(&db, &args, field);
    }
    refused(
        &db,
        &["links", "add", "--master", "2", "--follower", "1"],
        "master",
    );
    assert_eq!(
        ok(&db, &["links", "list", "--json"]).trim(),
        "[]",
        "refusals wrote nothing"
    );

    let link = ok(
        &db,
        &[
            "links",
            "add",
            "--master",
            "1",
            "--follower",
            "2",
            "--lot-mode",
            "fixed",
            "--lot-value",
            "0.1",
            "--symbol-map",
            r#"{"EURUSD.m":"EURUSD"}"#,
            "--symbols",
            "EURUSD.m,GBPUSD.m",
            "--max-slippage",
            "0.0005",
            "--copy-tp",
            "false",
            "--max-open-copies",
            "3",
            "--use-min-lot",
            "true",
            "--sl-points",
            "150",
            "--on-remove",
            "close",
            "--json",
        ],
    );
    refused(
        &db,
        &["links", "add", "--master", "1", "--follower", "2"],
        "link 1 -> 2: master and follower: a link between these accounts exists already",
    );
    let l: serde_json::Value = serde_json::from_str(&link).unwrap();
    assert_eq!(
        l["pending_orders"], "copy",
        "pending orders are copied by default"
    );
    assert_eq!(
        (l["sl_points"].as_f64(), l["tp_points"].as_f64()),
        (Some(150.0), None)
    );
    let id = l["id"].as_i64().unwrap().to_string();
    assert_eq!(l["lot_mode"], "fixed");
    assert_eq!(l["symbol_map"]["EURUSD.m"], "EURUSD");
    assert_eq!(l["symbols"], serde_json::json!(["EURUSD.m", "GBPUSD.m"]));
    assert_eq!(
        (l["copy_tp"].as_bool(), l["copy_sl"].as_bool()),
        (Some(false), Some(true))
    );
    assert_eq!(
        (l["max_open_copies"].as_i64(), l["use_min_lot"].as_bool()),
        (Some(3), Some(true))
    );
    let set = ok(
        &db,
        &[
            "links",
            "set",
            &id,
            "--reverse",
            "true",
            "--symbols",
            "all",
            "--max-slippage",
            "none",
            "--pending-orders",
            "fill_only",
            "--json",
        ],
    );
    let l: serde_json::Value = serde_json::from_str(&set).unwrap();
    assert_eq!(l["pending_orders"], "fill_only");
    assert_eq!(
        (
            l["reverse"].as_bool(),
            l["symbols"].is_null(),
            l["max_slippage"].is_null()
        ),
        (Some(true), true, true)
    );
    assert_eq!(
        l["lot_value"].as_f64(),
        Some(0.1),
        "set keeps what it was not given"
    );
    refused(
        &db,
        &["links", "set", &id, "--lot-mode", "half"],
        "lot_mode",
    );
    let text = ok(&db, &["links", "show", &id]);
    assert!(
        text.contains("master 1 -> follower 2") && text.contains("reversed"),
        "{text}"
    );

    // A follower's own limit on open copies: checked, stored, shown.
    refused(
        &db,
        &["accounts", "set", "2", "--max-open-copies", "0"],
        "max_open_copies",
    );
    let limited: serde_json::Value = serde_json::from_str(&ok(
        &db,
        &["accounts", "set", "2", "--max-open-copies", "5", "--json"],
    ))
    .unwrap();
    assert_eq!(
        limited[0]["max_open_copies"]
            .as_i64()
            .or(limited["max_open_copies"].as_i64()),
        Some(5),
        "{limited}"
    );

    // An account in a link keeps its role and is not removed.
    refused(&db, &["accounts", "set", "2", "--role", "master"], "role");
    refused(&db, &["accounts", "remove", "2"], "copy links");
    ok(&db, &["links", "remove", &id]);
    refused(&db, &["links", "remove", &id], "no such link");

    let list: serde_json::Value =
        serde_json::from_str(&ok(&db, &["accounts", "list", "--json"])).unwrap();
    assert_eq!(list.as_array().map(Vec::len), Some(2));
    let disabled: serde_json::Value =
        serde_json::from_str(&ok(&db, &["accounts", "disable", "2", "--json"])).unwrap();
    assert_eq!(disabled["enabled"], false);
    ok(&db, &["accounts", "remove", "2"]);
    refused(&db, &["accounts", "show", "2"], "no such account");
}

#[tokio::test]
async fn a_password_from_standard_input_is_stored_encrypted_and_never_printed() {
    let db = TestDb::new().await;
    let key = CredentialsKey::generate();
    let mut child = Command::new(binary())
        .args([
            "accounts",
            "add",
            "--id",
            "7",
            "--platform",
            "mt5",
            "--role",
            "follower",
            "--server",
            "h:1",
            "--login",
            "f7",
            "--password-stdin",
        ])
        .env_remove("DATABASE_URL")
        .env("DATABASE_URL", &db.url)
        .env("COPIER_CREDENTIALS_KEY", key.encode())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    writeln!(child.stdin.take().unwrap(), "s3cret-pw").unwrap();
    let out = child.wait_with_output().unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{printed}");
    assert!(
        printed.contains("password stored") && !printed.contains("s3cret-pw"),
        "{printed}"
    );
    let mut conn = db.conn().await;
    let stored: String =
        sqlx::query_scalar("SELECT credentials FROM trading_accounts WHERE id = 7")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert!(stored.starts_with("enc:v1:"), "{stored}");
    let plain =
        copier_node::credentials::decrypt(Some(&key), &Secret::new(stored.as_str())).unwrap();
    assert_eq!(plain.expose(), "s3cret-pw");
    // Without a key the password is refused, not stored in plaintext.
    let (code, _, err) = run_to_end(
        &["accounts", "set", "7", "--password-stdin"],
        &[("DATABASE_URL", db.url.as_str())],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("credentials key"), "{err}");
}

#[tokio::test]
async fn removing_an_account_a_node_trades_disables_it_and_deletes_it_once_released() {
    let db = TestDb::new().await;
    ok(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "5",
            "--platform",
            "mt5",
            "--role",
            "master",
            "--server",
            "127.0.0.1:1",
            "--login",
            "m5",
        ],
    );
    let node = start_node(&config(&db, "manage-owner", 10, FAST)).await;
    let mut conn = db.conn().await;
    eventually(
        "the node to own the account",
        Duration::from_secs(20),
        async || {
            let owner: Option<String> =
                sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE id = 5")
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            owner.is_some().then_some(())
        },
    )
    .await;
    // Too short a wait: refused, and the account is left disabled, not deleted.
    let (code, _, err) = cli(&db, &["accounts", "remove", "5", "--wait", "1ms"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("still owned by node manage-owner"), "{err}");
    let enabled: bool = sqlx::query_scalar("SELECT enabled FROM trading_accounts WHERE id = 5")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert!(!enabled, "disabled while it waits for the release");
    // Given time, the owner releases the disabled account and it is deleted.
    let (code, out, err) = cli(&db, &["accounts", "remove", "5", "--wait", "30s"]);
    assert_eq!(code, 0, "{out}{err}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE id = 5")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 0);
    node.shutdown();
}

/// `copier-node why` says why a master position was or was not copied, from the follower's
/// recorded decisions and the master's published state.
#[tokio::test]
async fn why_tells_a_filtered_position_from_a_copied_one() {
    use copier_node::broker::types::Side;

    use crate::support::fixture::CopySetup;
    use crate::support::{LinkSpec, add_account, add_link};

    let mut s = CopySetup::new("why").await;
    add_account(&mut s.conn, 1, "master", &s.addr, "m1").await;
    add_account(&mut s.conn, 2, "follower", &s.addr, "f2").await;
    let (link, magic) = add_link(&mut s.conn, 1, 2, LinkSpec::default()).await;
    ok(
        &s.db,
        &["links", "set", &link.to_string(), "--symbols", "EURUSD"],
    );
    let node = start_node(&config(&s.db, "why-node", 10, FAST)).await;
    eventually(
        "the follower to reconcile",
        Duration::from_secs(20),
        async || {
            let st: Option<String> =
                sqlx::query_scalar("SELECT status FROM trading_accounts WHERE id = 2")
                    .fetch_one(&mut s.conn)
                    .await
                    .unwrap();
            st.is_some_and(|t| t.starts_with("follower: master"))
                .then_some(())
        },
    )
    .await;
    let copied = s.t.open("m1", "EURUSD", Side::Buy, 0.1, None, None).await;
    let filtered = s.t.open("m1", "GBPUSD", Side::Buy, 0.1, None, None).await;
    s.t.copy_of("f2", magic, copied, Duration::from_secs(20))
        .await;
    let answer = eventually(
        "the filter decision to be recorded",
        Duration::from_secs(20),
        async || {
            let out = ok(&s.db, &["why", "2", &filtered.to_string(), "--json"]);
            let v: serde_json::Value = serde_json::from_str(&out).unwrap();
            (!v[0]["decisions"].as_array().unwrap().is_empty()).then_some(v)
        },
    )
    .await;
    assert_eq!(answer[0]["link_id"].as_i64(), Some(link));
    assert_eq!(answer[0]["decisions"][0]["code"], "filtered", "{answer}");
    // Keys as the copy_skips columns are named.
    assert_eq!(answer[0]["decisions"][0]["final"], true, "{answer}");
    assert!(answer[0]["decisions"][0].get("is_final").is_none());
    assert!(
        answer[0]["verdict"]
            .as_str()
            .unwrap()
            .starts_with("not copied, for good"),
        "{answer}"
    );
    let text = eventually(
        "the copy in the ledger",
        Duration::from_secs(20),
        async || {
            let t = ok(&s.db, &["why", "2", &copied.to_string()]);
            t.contains("copied as ticket").then_some(t)
        },
    )
    .await;
    assert!(text.contains("copy ledger"), "{text}");
    refused(&s.db, &["why", "1", &copied.to_string()], "not a follower");
    // Copies of an account that does not exist: refused, not an empty list.
    refused(&s.db, &["copies", "99"], "account 99: no such account");
    node.shutdown();
}

/// The delete matches only a row no node may still trade: a live owner's membership, or a
/// database failover grace (when the new primary may lack the owner's last renewals), keeps it.
#[tokio::test]
async fn remove_never_deletes_a_row_whose_owner_is_live_or_within_a_failover_grace() {
    let db = TestDb::new().await;
    ok(
        &db,
        &[
            "accounts",
            "add",
            "--id",
            "6",
            "--platform",
            "mt5",
            "--role",
            "master",
            "--server",
            "h:1",
            "--login",
            "m6",
        ],
    );
    let mut conn = db.conn().await;
    // A live owner whose row's lease looks expired (as on a new primary that lost renewals).
    sqlx::query(
        "INSERT INTO nodes (node_id, instance_id, platform, capacity, lease_until, started_at, renewed_at)
         VALUES ('ghost', 'i1', 'mt5', 10, now() + interval '1 hour', now(), now())",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("UPDATE trading_accounts SET node_id = 'ghost', lease_until = now() - interval '1 second' WHERE id = 6")
        .execute(&mut conn)
        .await
        .unwrap();
    let kept = async |conn: &mut sqlx::PgConnection| -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE id = 6")
            .fetch_one(conn)
            .await
            .unwrap()
    };
    let (code, _, err) = cli(&db, &["accounts", "remove", "6", "--wait", "300ms"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("still owned by node ghost"), "{err}");
    assert_eq!(kept(&mut conn).await, 1, "a live owner's row is kept");
    // The owner's membership expired, but the database is in a failover grace: still kept.
    sqlx::query("UPDATE nodes SET lease_until = now() - interval '1 second'")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("UPDATE copier_database SET claims_after = now() + interval '1 hour'")
        .execute(&mut conn)
        .await
        .unwrap();
    let (code, _, err) = cli(&db, &["accounts", "remove", "6", "--wait", "300ms"]);
    assert_eq!(code, 1, "{err}");
    assert_eq!(kept(&mut conn).await, 1, "kept through a failover grace");
    // The grace over and the owner dead: deleted.
    sqlx::query("UPDATE copier_database SET claims_after = NULL")
        .execute(&mut conn)
        .await
        .unwrap();
    ok(&db, &["accounts", "remove", "6", "--wait", "300ms"]);
    assert_eq!(kept(&mut conn).await, 0);
}

/// `copier-node risk ...`: a follower's drawdown limits added (bad values refused naming the
/// flag), listed with their state, reset by an operator (the state cleared, so the owner starts
/// each period again) and removed.
#[tokio::test]
async fn risk_limits_are_added_listed_reset_and_removed() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    crate::support::add_account(&mut conn, 1, "master", "127.0.0.1:1", "m1").await;
    crate::support::add_account(&mut conn, 2, "follower", "127.0.0.1:1", "f2").await;
    let add = |extra: &[&str]| {
        let mut args = vec!["risk", "add", "--account", "2"];
        args.extend_from_slice(extra);
        args.iter().map(|s| s.to_string()).collect::<Vec<_>>()
    };
    let args = add(&[
        "--period",
        "daily",
        "--basis",
        "equity",
        "--percent",
        "5",
        "--action",
        "close_all",
        "--json",
    ]);
    let out = ok(&db, &args.iter().map(String::as_str).collect::<Vec<_>>());
    // One limit added: one JSON object, as documented.
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let id = v["id"].as_i64().unwrap();
    assert_eq!(
        (
            v["period"].as_str(),
            v["relative"].as_bool(),
            v["amount"].as_f64(),
            v["action"].as_str()
        ),
        (Some("daily"), Some(true), Some(5.0), Some("close_all"))
    );
    for (extra, names) in [
        (
            &["--period", "hourly", "--basis", "equity", "--percent", "5"][..],
            "period: \"hourly\" is not one of daily, weekly, monthly or lifetime",
        ),
        (
            &["--period", "daily", "--basis", "margin", "--percent", "5"][..],
            "basis:",
        ),
        (
            &[
                "--period",
                "daily",
                "--basis",
                "balance",
                "--percent",
                "150",
            ][..],
            "percent:",
        ),
        (
            &["--period", "daily", "--basis", "balance", "--amount", "0"][..],
            "amount:",
        ),
        (
            &["--period", "daily", "--basis", "balance"][..],
            "percent or amount",
        ),
        (
            &[
                "--period", "daily", "--basis", "balance", "--amount", "5", "--action", "panic",
            ][..],
            "action:",
        ),
        // One limit per period and basis.
        (
            &["--period", "daily", "--basis", "equity", "--amount", "300"][..],
            "has a daily equity limit already",
        ),
    ] {
        let args = add(extra);
        refused(
            &db,
            &args.iter().map(String::as_str).collect::<Vec<_>>(),
            names,
        );
    }
    refused(
        &db,
        &[
            "risk",
            "add",
            "--account",
            "1",
            "--period",
            "daily",
            "--basis",
            "equity",
            "--percent",
            "5",
        ],
        "risk limits apply to followers",
    );
    ok(
        &db,
        &[
            "risk",
            "add",
            "--account",
            "2",
            "--period",
            "lifetime",
            "--basis",
            "balance",
            "--amount",
            "2500",
        ],
    );
    // A node's state, as the owner writes it; then the listing shows it.
    sqlx::query("UPDATE risk_limits SET period_key = '2026-11-30', start_value = 10000, hit_at = now(), hit_reason = 'daily equity drawdown 600.00 from 10000.00 (6.00 % of it) reached the limit of 5 %' WHERE id = $1")
        .bind(id)
        .execute(&mut conn)
        .await
        .unwrap();
    let listed = ok(&db, &["risk", "list", "--account", "2"]);
    assert!(
        listed.contains(&format!(
            "limit {id} of account 2: daily equity drawdown 5 %, close_all; REACHED at"
        )),
        "{listed}"
    );
    assert!(
        listed.contains("lifetime balance drawdown 2500, close_only; not started"),
        "{listed}"
    );
    let reset = ok(
        &db,
        &[
            "risk",
            "reset",
            "--account",
            "2",
            "--limit",
            &id.to_string(),
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&reset).unwrap();
    assert!(
        v["id"].as_i64() == Some(id)
            && v["hit_reason"].is_null()
            && v["period_key"].is_null()
            && v["start_value"].is_null(),
        "{reset}"
    );
    refused(&db, &["risk", "reset", "--account", "3"], "no such limit");
    ok(&db, &["risk", "remove", &id.to_string()]);
    refused(&db, &["risk", "remove", &id.to_string()], "no such limit");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM risk_limits")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(left, 1);
}

/// The names each values-limited column's CHECK constraint allows, from the migrated schema.
async fn check_list(conn: &mut sqlx::PgConnection, table: &str, column: &str) -> Vec<String> {
    let defs: Vec<String> = sqlx::query_scalar(
        "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
          WHERE c.conrelid = $1::regclass AND c.contype = 'c'",
    )
    .bind(table)
    .fetch_all(conn)
    .await
    .unwrap();
    let def = defs
        .iter()
        .find(|d| d.contains(&format!("({column} =")) || d.contains(&format!("({column})::text =")))
        .unwrap_or_else(|| panic!("no CHECK list on {table}.{column}: {defs:?}"));
    let mut names: Vec<String> = def
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

/// Every enumerated setting is defined once (`copier_node::model::named`): the database's CHECK
/// lists allow exactly the names the definitions give, so a value added to one and not the other
/// fails here.
#[tokio::test]
async fn every_enumerated_setting_matches_its_check_constraint() {
    use copier_node::copier::rules::SkipCode;
    use copier_node::db::copy::Role;
    use copier_node::model::link::{LotMode, OnRemove, PendingOrders, Sides};
    use copier_node::model::named::Named;
    use copier_node::model::risk::{Basis, Period, RiskAction};

    fn sorted<T: Named>() -> Vec<String> {
        let mut names: Vec<String> = T::names().into_iter().map(str::to_string).collect();
        names.sort();
        names
    }
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    // Decisions' codes, and two only older rows carry: `unknown` (before codes were recorded)
    // and `max_open_copies` (before that limit held copies back instead of refusing them).
    let mut skip_codes = sorted::<SkipCode>();
    skip_codes.extend(["unknown".to_string(), "max_open_copies".to_string()]);
    skip_codes.sort();
    let settings: [(&str, &str, Vec<String>); 9] = [
        ("trading_accounts", "role", sorted::<Role>()),
        ("copy_links", "lot_mode", sorted::<LotMode>()),
        ("copy_links", "sides", sorted::<Sides>()),
        ("copy_links", "on_remove", sorted::<OnRemove>()),
        ("copy_links", "pending_orders", sorted::<PendingOrders>()),
        ("risk_limits", "period", sorted::<Period>()),
        ("risk_limits", "basis", sorted::<Basis>()),
        ("risk_limits", "action", sorted::<RiskAction>()),
        ("copy_skips", "code", skip_codes),
    ];
    for (table, column, defined) in settings {
        assert_eq!(
            check_list(&mut conn, table, column).await,
            defined,
            "{table}.{column}: the CHECK constraint and the definition differ"
        );
    }
}

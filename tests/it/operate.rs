//! Operating it: the demo, `status`, the HTTP endpoints and metrics, and the packaging files.

use std::time::Duration;

use copier_node::broker::types::Side;

use crate::support::broker::{Scratch, start_sim};
use crate::support::chaos::{ChaosProxy, Mode};
use crate::support::http::{get, sample};
use crate::support::process::binary;
use crate::support::{
    FAST, LinkSpec, TestDb, Trader, add_account, add_link, config, config_listen, eventually,
    insert_accounts, start_node, wait_state,
};

const WAIT: Duration = Duration::from_secs(20);

/// True when CI asks for every packaging tool (yamllint, promtool, hadolint, systemd-analyze) to
/// be there.
fn tools_required() -> bool {
    std::env::var_os("COPIER_REQUIRE_TOOLS").is_some()
}

fn tool_available(name: &str) -> bool {
    let found = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !found {
        assert!(
            !tools_required(),
            "{name} is required (COPIER_REQUIRE_TOOLS is set) but not installed"
        );
        eprintln!("note: {name} is not installed; its check is skipped here (CI installs it)");
    }
    found
}

#[tokio::test]
async fn metrics_move_with_orders_and_the_gate_and_readiness_follows_trust() {
    let db = TestDb::new().await;
    let dir = Scratch::new("operate-metrics");
    let broker = start_sim(&dir).await;
    let addr = broker.addr.to_string();
    let t = Trader { addr: addr.clone() };
    let mut conn = db.conn().await;
    add_account(&mut conn, 1, "master", &addr, "m1").await;
    add_account(&mut conn, 2, "follower", &addr, "f2").await;
    let (_, magic) = add_link(&mut conn, 1, 2, LinkSpec::default()).await;
    let a = start_node(&config(&db, "a", 1, FAST)).await;
    wait_state(&a.state, "a owns the master", WAIT, |s| {
        s.owned.contains_key(&1)
    })
    .await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let b = start_node(&config_listen(
        &db.url_via(proxy.port),
        &db.url,
        "b",
        10,
        FAST,
    ))
    .await;
    wait_state(&b.state, "b owns the follower", WAIT, |s| {
        s.owned.contains_key(&2) && s.trusted()
    })
    .await;

    let (code, _) = get(b.http_addr, "/healthz").await;
    assert_eq!(code, 200);
    let (code, body) = get(b.http_addr, "/readyz").await;
    assert_eq!((code, body.trim()), (200, "ready"));
    let before = get(b.http_addr, "/metrics").await.1;
    assert_eq!(sample(&before, "copier_owned_accounts"), 1.0);
    assert_eq!(sample(&before, "copier_lease_valid"), 1.0);
    assert!(sample(&before, "copier_lease_cycle_duration_seconds_count") >= 1.0);
    // What the database promises: the test cluster is a lone primary on its first timeline.
    let db_metrics = eventually("the database's promise read", WAIT, async || {
        let m = get(b.http_addr, "/metrics").await.1;
        (sample(&m, "copier_db_timeline") >= 0.0).then_some(m)
    })
    .await;
    assert_eq!(sample(&db_metrics, "copier_db_timeline"), 1.0);
    assert_eq!(sample(&db_metrics, "copier_db_synchronous"), 0.0);

    // The first event may find the follower reconciled to an older epoch (it then reconciles);
    // the second is applied from the event stream.
    for symbol in ["EURUSD", "XAUUSD"] {
        let p = t.open("m1", symbol, Side::Buy, 0.1, None, None).await;
        t.copy_of("f2", magic, p, WAIT).await;
    }
    let after = eventually("the copies to be counted", WAIT, async || {
        let m = get(b.http_addr, "/metrics").await.1;
        (sample(
            &m,
            "copier_orders_total{action=\"open\",result=\"accepted\"}",
        ) >= 2.0)
            .then_some(m)
    })
    .await;
    assert!(sample(&after, "copier_copy_latency_seconds_count") >= 1.0);
    assert!(sample(&after, "copier_reconciles_total") >= 1.0);
    assert!(
        sample(&after, "copier_broker_sessions") >= 1.0,
        "the follower's broker session is counted"
    );
    let master_metrics = get(a.http_addr, "/metrics").await.1;
    assert!(sample(&master_metrics, "copier_master_events_published_total") >= 1.0);

    // The database hangs: readiness turns 503 at once once trust lapses, and orders are gated.
    proxy.set(Mode::Hang);
    wait_state(&b.state, "b's gate to close", WAIT, |s| !s.trusted()).await;
    let asked = tokio::time::Instant::now();
    let (code, body) = get(b.http_addr, "/readyz").await;
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "readiness never waits on the database"
    );
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        get(b.http_addr, "/healthz").await.0,
        200,
        "the process and its lease loop still run"
    );
    let p2 = t.open("m1", "GBPUSD", Side::Buy, 0.1, None, None).await;
    let gated = eventually("a gated order to be counted", WAIT, async || {
        let m = get(b.http_addr, "/metrics").await.1;
        (sample(&m, "copier_orders_gated_total") >= 1.0).then_some(m)
    })
    .await;
    assert_eq!(sample(&gated, "copier_lease_valid"), 0.0);
    proxy.set(Mode::Forward);
    t.copy_of("f2", magic, p2, WAIT).await;
    eventually("readiness to return", WAIT, async || {
        (get(b.http_addr, "/readyz").await.0 == 200).then_some(())
    })
    .await;

    if tool_available("promtool") {
        let text = get(b.http_addr, "/metrics").await.1;
        let mut child = std::process::Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
    broker.stop().await;
}

/// Runs `copier-node status` (without blocking the nodes running in this runtime).
async fn status_cmd(url: &str, args: &[&str]) -> String {
    let out = tokio::process::Command::new(binary())
        .arg("status")
        .args(args)
        .env("DATABASE_URL", url)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn status_reports_what_the_database_holds() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=6, "mt5").await;
    sqlx::query("UPDATE trading_accounts SET enabled = false WHERE id = 6")
        .execute(&mut conn)
        .await
        .unwrap();
    let a = start_node(&config(&db, "st-a", 3, FAST)).await;
    wait_state(&a.state, "a owns 3", WAIT, |s| s.owned.len() == 3).await;
    let b = start_node(&config(&db, "st-b", 1, FAST)).await;
    wait_state(&b.state, "b owns 1", WAIT, |s| s.owned.len() == 1).await;

    let json = status_cmd(&db.url, &["--json"]).await;
    let doc: serde_json::Value =
        serde_json::from_str(json.trim()).expect("exactly one JSON document");
    assert_eq!(json.trim().lines().count(), 1);
    let nodes = doc["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 2);
    let by_id = |id: &str| nodes.iter().find(|n| n["node_id"] == id).unwrap().clone();
    assert_eq!(
        (
            by_id("st-a")["accounts"].as_i64(),
            by_id("st-a")["live"].as_bool()
        ),
        (Some(3), Some(true))
    );
    assert_eq!(by_id("st-b")["accounts"].as_i64(), Some(1));
    assert!(by_id("st-a")["nearest_lease_expiry_ms"].is_i64());
    assert_eq!(doc["disabled"], serde_json::json!([6]));
    assert_eq!(
        doc["unowned"].as_array().unwrap().len(),
        1,
        "5 enabled accounts, 4 owned"
    );
    let accounts = doc["accounts"].as_array().unwrap();
    assert_eq!(accounts.len(), 6);
    assert_eq!(
        (&doc["database_timeline"], &doc["database_synchronous"]),
        (&serde_json::json!(1), &serde_json::json!(false))
    );
    for acc in accounts.iter().filter(|a| a["owner"].is_string()) {
        assert!(acc["owner_epoch"].as_i64().unwrap() > 0 && acc["lease_until_ms"].is_i64());
    }
    let text = status_cmd(&db.url, &[]).await;
    for needle in [
        "nodes: 2 live",
        "st-a",
        "st-b",
        "accounts: 6 (4 owned, 1 unowned, 1 disabled)",
        "disabled: 6",
        "database: timeline 1; commits do not wait for a standby",
    ] {
        assert!(text.contains(needle), "{needle:?} not in:\n{text}");
    }
    for n in [a, b] {
        n.shutdown();
        n.wait().await.unwrap();
    }
}

#[tokio::test]
async fn the_demo_runs_end_to_end_and_leaves_nothing_behind() {
    let out = tokio::process::Command::new(binary())
        .args(["demo", "--duration", "34s", "--json"])
        .env_remove("DATABASE_URL")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("demo progress:\n{stderr}"); // shown when an assertion below fails
    assert_eq!(
        stdout.lines().count(),
        1,
        "under --json stdout carries the summary alone: {stdout}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(stdout.trim()).expect("the line is the JSON summary");
    assert!(
        summary["copy_latency_ms"]["samples"].as_u64().unwrap() > 0,
        "live copies measured apart from those during moves: {summary}"
    );
    assert!(
        summary.get("workdir").is_none(),
        "no path that no longer exists"
    );
    assert!(summary["copies"].as_u64().unwrap() > 0, "copies were made");
    assert_eq!(summary["duplicates"], 0, "no duplicate in the journal");
    assert_eq!(
        summary["missed_copies"], 0,
        "every follower copied the last open"
    );
    assert_eq!(
        summary["missed_closes"], 0,
        "every copy closed with its master"
    );
    // Scale-out from one node to four: each join was followed by an even spread.
    let rebalances = summary["rebalance_ms"].as_array().unwrap();
    assert!(
        rebalances.len() >= 3,
        "three joins, each balanced: {rebalances:?}"
    );
    assert!(
        summary["failovers"].as_u64().unwrap() >= 1,
        "the scheduled kill was followed by a failover"
    );
    let workdir = stderr
        .lines()
        .find_map(|l| l.strip_prefix("copier-node demo: working in "))
        .expect("the demo says where it works")
        .trim()
        .to_string();
    let workdir = workdir.as_str();
    assert!(
        !std::path::Path::new(workdir).exists(),
        "{workdir} was removed"
    );
    // No process (PostgreSQL, nodes) refers to the demo's directory any more.
    let left = processes_referring_to(workdir);
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

/// Processes whose command line names `needle`, or that hold a file under it open (the demo's
/// nodes write their logs into its directory; PostgreSQL's data directory is in it).
fn processes_referring_to(needle: &str) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let holds_file = std::fs::read_dir(entry.path().join("fd"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|fd| {
                std::fs::read_link(fd.path())
                    .is_ok_and(|target| target.to_string_lossy().contains(needle))
            });
        if cmdline.contains(needle) || holds_file {
            out.push(cmdline);
        }
    }
    out
}

/// A node whose lease loop finishes no cycle for a lease is not healthy: `/healthz` answers 503
/// naming why, and 200 again once the loop runs (the loop is stalled through a fault-injection
/// point, with the database answering all along).
#[tokio::test]
async fn healthz_fails_while_the_lease_loop_is_stalled_for_a_lease() {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test stalls the lease loop through a fault-injection point: run with --features failpoints"
        );
    }
    let db = TestDb::new().await;
    let dir = Scratch::new("healthz-stall");
    let stall = dir.path("stall");
    let mut node =
        crate::support::process::NodeProcess::spawn_with(&crate::support::process::NodeSpec {
            node_id: "stall".into(),
            capacity: 1,
            timing: FAST,
            database_url: db.url.clone(),
            listen_url: None,
            env: vec![("COPIERTEST_STALL_CYCLE".into(), stall.display().to_string())],
            extra: Vec::new(),
        });
    node.wait_for_output("serving /healthz", WAIT).await;
    let addr: std::net::SocketAddr = node
        .output()
        .lines()
        .find_map(|l| l.split_once("http_addr="))
        .map(|(_, a)| a.split_whitespace().next().unwrap_or_default().to_string())
        .expect("the node logs its HTTP address")
        .parse()
        .unwrap();
    eventually("the node ready", WAIT, async || {
        (get(addr, "/readyz").await.0 == 200).then_some(())
    })
    .await;
    assert_eq!(get(addr, "/healthz").await.0, 200);
    std::fs::write(&stall, b"stall").unwrap();
    node.wait_for_output("lease loop stalled before a cycle", WAIT)
        .await;
    let body = eventually("/healthz to fail", WAIT, async || {
        let (code, body) = get(addr, "/healthz").await;
        (code == 503).then_some(body)
    })
    .await;
    assert!(
        body.contains("lease loop stuck: no cycle finished for"),
        "{body}"
    );
    std::fs::remove_file(&stall).unwrap();
    eventually("/healthz to recover", WAIT, async || {
        (get(addr, "/healthz").await.0 == 200).then_some(())
    })
    .await;
    node.signal("TERM");
    assert_eq!(node.wait_exit(WAIT).await.code(), Some(0));
}

/// The node's own work never starves its lease cycle: with the node's pooled connections kept
/// busy on the server (a fault-injection point makes each unit of session work sleep until its
/// statement timeout cuts it, and 200 masters on a simulated broker keep logging in, failing
/// to load their published state, restarting and queueing for a turn), the cycle, on a
/// connection of its own, still renews in time. The node's batch writers and readers (every
/// session's account row is read through one) hold a connection each however many sessions
/// wait on them, so the fault point spares them and loads the pool with the sessions' own units.
/// Judged from the database alone: the rows' `lease_until`, the membership's `renewed_at`, and
/// `pg_stat_activity` for the saturation.
#[tokio::test]
async fn a_node_with_its_pool_saturated_by_session_work_still_renews_every_cycle() {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test saturates the node's pool through a fault-injection point: run with --features failpoints"
        );
    }
    /// Session start-ups take turns on the pool (`db::BACKGROUND_UNITS`): all of them busy, with
    /// 200 sessions waiting for a turn, is the most session work can load it.
    const POOL: i64 = copier_node::db::BACKGROUND_UNITS as i64;
    const ACCOUNTS: i64 = 200;
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    let dir = Scratch::new("pool-hog");
    let sim = start_sim(&dir).await;
    insert_accounts(&mut conn, 1..=ACCOUNTS, "mt5").await;
    sqlx::query("UPDATE trading_accounts SET role = 'master', server = $1")
        .bind(sim.addr.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    let hog = dir.path("hog");
    std::fs::write(&hog, b"hog").unwrap();
    let mut node =
        crate::support::process::NodeProcess::spawn_with(&crate::support::process::NodeSpec {
            node_id: "hog".into(),
            capacity: ACCOUNTS as u32,
            timing: FAST,
            database_url: db.url.clone(),
            listen_url: None,
            env: vec![("COPIERTEST_POOL_HOG".into(), hog.display().to_string())],
            extra: Vec::new(),
        });
    let saturated = async |conn: &mut sqlx::PgConnection| -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'copier-node hog' AND wait_event = 'PgSleep'",
        )
        .fetch_one(conn)
        .await
        .unwrap()
    };
    eventually(
        "the node's pool saturated, every account claimed",
        WAIT,
        async || {
            let live: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM trading_accounts WHERE node_id = 'hog' AND lease_until > now()",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
            (live == ACCOUNTS && saturated(&mut conn).await >= POOL).then_some(())
        },
    )
    .await;
    // Three leases of samples: every lease stays live, and the membership's renewals (database
    // clock) never leave a gap the trust window (lease - fence = 2 s) would not cover.
    let window = Duration::from_secs(9);
    let started = tokio::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let (mut samples, mut full) = (0, 0);
    let mut renewals: Vec<f64> = Vec::new();
    while started.elapsed() < window {
        tick.tick().await;
        let (live, renewed): (i64, f64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM trading_accounts WHERE node_id = 'hog' AND lease_until > now()),
                    (SELECT extract(epoch FROM renewed_at)::float8 FROM nodes WHERE node_id = 'hog')",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            live, ACCOUNTS,
            "a lease of the node lapsed while its pool was saturated"
        );
        if renewals.last() != Some(&renewed) {
            renewals.push(renewed);
        }
        samples += 1;
        full += i32::from(saturated(&mut conn).await >= POOL);
    }
    assert!(
        full * 2 >= samples,
        "the pool was saturated in only {full} of {samples} samples: the test did not load the node"
    );
    let gaps: Vec<f64> = renewals.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(renewals.len() >= 5, "renewals seen: {renewals:?}");
    assert!(
        gaps.iter().all(|g| *g < 2.0),
        "a gap between renewals outlasted the trust window: {gaps:?}"
    );
    std::fs::remove_file(&hog).unwrap();
    node.signal("TERM");
    assert_eq!(node.wait_exit(WAIT).await.code(), Some(0));
}

/// A node claims no more than it can start (admission: `STARTING_AT_ONCE` sessions starting at
/// once), and while its claims wait for its own start-ups it does not poll for room with cycles,
/// each of which renews every row it holds: its renewals keep the cycle period, and once enough
/// start-ups are through it claims the rest without waiting for the period. 1,050 accounts;
/// every session is held before its login at a fault-injection point until the test lets go.
/// Judged from the database alone (who owns which row, and when a held row's lease is written
/// again), timed on the database's clock.
#[tokio::test]
async fn claims_waiting_for_start_ups_keep_the_period_and_resume_once_they_are_through() {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test holds sessions starting through a fault-injection point: run with --features failpoints"
        );
    }
    const AT_ONCE: i64 = copier_node::lease::STARTING_AT_ONCE as i64;
    const ACCOUNTS: i64 = AT_ONCE + 50;
    /// The cycle period (15 s) less its jitter (a fifth), less a second to spare. (The claims
    /// that resume wait ten of the last cycle's durations at least: the period leaves room for
    /// a cycle of a second on a loaded machine.)
    const PERIOD_AT_LEAST: Duration = Duration::from_secs(11);
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=ACCOUNTS, "mt5").await;
    let dir = Scratch::new("admission");
    // A trade server that knows none of the logins: once let go, each session's start ends at
    // once (its login refused, it waits to restart), so the start-ups are through together.
    let broker = start_sim(&dir).await;
    sqlx::query("UPDATE trading_accounts SET server = $1")
        .bind(broker.addr.to_string())
        .execute(&mut conn)
        .await
        .unwrap();
    let hold = dir.path("hold");
    std::fs::write(&hold, b"hold").unwrap();
    let mut node =
        crate::support::process::NodeProcess::spawn_with(&crate::support::process::NodeSpec {
            node_id: "adm".into(),
            capacity: 2 * ACCOUNTS as u32,
            timing: crate::support::Timing {
                lease: "60s",
                fence: "15s",
                cycle: "15s",
            },
            database_url: db.url.clone(),
            listen_url: None,
            env: vec![
                ("COPIERTEST_HOLD_START".into(), hold.display().to_string()),
                // The loop's wake-ups (debug), in the log shown if the test fails.
                ("RUST_LOG".into(), "info,copier_node::lease=debug".into()),
            ],
            extra: Vec::new(),
        });
    let wait = Duration::from_secs(30);
    // (accounts the node owns, account 1's lease as written, in seconds on the database's clock):
    // each cycle writes the lease of every row the node holds again, `now() + lease` at its
    // transaction's start (claims take the lowest ids first: account 1 is held). The gaps between
    // two such writes are the gaps between the cycles, however late the test polls.
    let read = async |conn: &mut sqlx::PgConnection| -> (i64, Option<f64>) {
        sqlx::query_as(
            "SELECT (SELECT count(*) FROM trading_accounts WHERE node_id = 'adm' AND lease_until > now()),
                    (SELECT extract(epoch FROM lease_until)::float8 FROM trading_accounts
                      WHERE id = 1 AND node_id = 'adm')",
        )
        .fetch_one(conn)
        .await
        .unwrap()
    };
    let first = eventually("the node's first claims", wait, async || {
        let (owned, lease) = read(&mut conn).await;
        (owned > 0).then(|| (owned, lease.expect("account 1 among the first claims")))
    })
    .await;
    assert_eq!(
        first.0, AT_ONCE,
        "the first cycle claims as many as may start at once, and no more"
    );
    // Every start-up slot is taken: renewals come at the period, claiming nothing. (The first
    // may come sooner: the node's LISTEN connection, once up, wakes the loop for a cycle.)
    let mut leases = vec![first.1];
    while leases.len() < 3 {
        let (owned, lease) = eventually("the node's next renewal", wait, async || {
            let (owned, lease) = read(&mut conn).await;
            (lease != leases.last().copied()).then(|| (owned, lease.expect("account 1 held")))
        })
        .await;
        assert_eq!(
            owned, AT_ONCE,
            "nothing more claimed while every start-up slot is taken"
        );
        leases.push(lease);
    }
    std::fs::remove_file(&hold).unwrap();
    let between = leases[2] - leases[1];
    assert!(
        between >= PERIOD_AT_LEAST.as_secs_f64(),
        "the node renewed {between:.3} s after its previous renewal, within its period (15 s less jitter), while its claims waited for its sessions to start"
    );
    // Let go: every held session's start ends, and the rest is claimed before the period.
    let claimed = eventually("every account claimed", wait, async || {
        let (owned, lease) = read(&mut conn).await;
        (owned == ACCOUNTS).then(|| lease.expect("account 1 held"))
    })
    .await;
    let after = claimed - leases[2];
    assert!(
        after < PERIOD_AT_LEAST.as_secs_f64(),
        "the rest was claimed {after:.3} s after the renewal before it: at the period, not once the start-ups were through"
    );
    node.signal("TERM");
    assert_eq!(node.wait_exit(WAIT).await.code(), Some(0));
}

/// Runs the demo in a pseudo-terminal (`script`), types Ctrl-C once a line containing `when`
/// appears, and returns (exit code, everything the terminal showed). The interrupt character goes
/// through the terminal's line discipline to its whole foreground process group, as a person's
/// Ctrl-C does.
async fn demo_interrupted_in_a_terminal(when: &str) -> (Option<i32>, String) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    let command = format!("exec {} demo --json", binary());
    let mut child = tokio::process::Command::new("script")
        .args(["-q", "-e", "-f", "-c", &command, "/dev/null"])
        .env_remove("DATABASE_URL")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("script (util-linux) runs the demo in a pseudo-terminal");
    let mut stdin = child.stdin.take().unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut shown = String::new();
    let mut interrupted = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(150);
    loop {
        let line = tokio::time::timeout_at(deadline, lines.next_line())
            .await
            .unwrap_or_else(|_| panic!("the demo did not end in time after Ctrl-C:\n{shown}"))
            .unwrap();
        let Some(line) = line else { break };
        shown.push_str(line.trim_end_matches('\r'));
        shown.push('\n');
        if !interrupted && line.contains(when) {
            stdin.write_all(b"\x03").await.unwrap();
            stdin.flush().await.unwrap();
            interrupted = true;
        }
    }
    assert!(interrupted, "never saw {when:?}:\n{shown}");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("script exits with the demo")
        .unwrap();
    (status.code(), shown)
}

async fn ctrl_c_ends_the_demo_cleanly(when: &str) {
    let (code, shown) = demo_interrupted_in_a_terminal(when).await;
    assert_eq!(code, Some(0), "Ctrl-C after {when:?}: exit code\n{shown}");
    assert!(
        shown.contains("final check: 0 missed copies, 0 missed closes"),
        "{shown}"
    );
    let summary = shown
        .lines()
        .rfind(|l| l.starts_with('{'))
        .expect("the JSON summary");
    let summary: serde_json::Value = serde_json::from_str(summary).unwrap();
    assert_eq!(summary["duplicates"], 0, "{shown}");
    let workdir = shown
        .lines()
        .find_map(|l| l.strip_prefix("copier-node demo: working in "))
        .expect("the demo says where it works");
    let left = processes_referring_to(workdir.trim());
    assert!(left.is_empty(), "processes left behind: {left:?}");
}

#[tokio::test]
async fn ctrl_c_early_in_a_terminal_ends_the_demo_with_its_final_check_passing() {
    // While the first node is still alone and the others have yet to join.
    ctrl_c_ends_the_demo_cleanly("started demo-n1").await;
}

#[tokio::test]
async fn ctrl_c_late_in_a_terminal_ends_the_demo_with_its_final_check_passing() {
    // After the scale-out, with a node just killed and its accounts failing over.
    ctrl_c_ends_the_demo_cleanly("kill -9 demo-n").await;
}

#[test]
fn the_systemd_unit_verifies() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/systemd/copier-node@.service"
    ))
    .unwrap();
    for needle in [
        "Restart=on-failure",
        "TimeoutStopSec=",
        "EnvironmentFile=",
        "NoNewPrivileges=yes",
        "RestartPreventExitStatus=2 3",
        "%i",
    ] {
        assert!(unit.contains(needle), "the unit lacks {needle}");
    }
    if !tool_available("systemd-analyze") {
        return;
    }
    let dir = Scratch::new("unit");
    let path = dir.path("copier-node@test.service");
    std::fs::write(&path, unit).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        assert!(
            line.contains("/usr/local/bin/copier-node"),
            "systemd-analyze: {line}"
        );
    }
}

#[test]
fn the_kubernetes_manifests_lint_clean_and_say_what_operators_need() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/config/kubernetes");
    let all: String = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "yaml"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    for needle in [
        "kind: Deployment",
        "fieldPath: metadata.name",
        "path: /healthz",
        "path: /readyz",
        "terminationGracePeriodSeconds: 30",
        "kind: PodDisruptionBudget",
        "kind: Job",
        "args: [\"migrate\"]",
        "secretRef:",
        "runAsNonRoot: true",
        "enableServiceLinks: false",
    ] {
        assert!(all.contains(needle), "manifests lack {needle}");
    }
    if !tool_available("yamllint") {
        return;
    }
    let out = std::process::Command::new("yamllint")
        .args(["-f", "parsable", "-c"])
        .arg(format!("{dir}/.yamllint"))
        .arg(dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.trim().is_empty(),
        "yamllint:\n{text}"
    );
}

/// No container engine runs here, so the Dockerfile is checked by hadolint (every rule; an
/// exception is written beside the line it excuses, with its reason).
#[test]
fn the_dockerfile_passes_hadolint() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/Dockerfile");
    let text = std::fs::read_to_string(file).unwrap();
    for needle in ["USER 10001", "--locked", "FROM debian:bookworm-slim"] {
        assert!(text.contains(needle), "Dockerfile lacks {needle}");
    }
    if !tool_available("hadolint") {
        return;
    }
    let out = std::process::Command::new("hadolint")
        .args(["--no-color", file])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "hadolint:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every `copier_*` name the alert rules and the dashboard use, without a histogram's suffixes.
fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    let mut out = std::collections::BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("copier_") {
        let start = i + at;
        let preceded =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len()
            && (bytes[end].is_ascii_lowercase()
                || bytes[end].is_ascii_digit()
                || bytes[end] == b'_')
        {
            end += 1;
        }
        if !preceded {
            let name = &text[start..end];
            let base = ["_bucket", "_count", "_sum"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| b.ends_with("_seconds")))
                .unwrap_or(name);
            out.insert(base.to_string());
        }
        i = end.max(start + 1);
    }
    out
}

/// The alert rules and the dashboard name only metrics a running node exports on `/metrics`, and
/// the rules pass `promtool check rules` and their unit tests (`promtool test rules`).
#[tokio::test]
async fn alert_rules_and_the_dashboard_use_only_exported_metrics_and_pass_promtool() {
    let root = env!("CARGO_MANIFEST_DIR");
    let rules =
        std::fs::read_to_string(format!("{root}/config/prometheus/copier-node.rules.yml")).unwrap();
    let dashboard =
        std::fs::read_to_string(format!("{root}/config/grafana/copier-node.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    let exprs: Vec<String> = json["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| {
            t["expr"]
                .as_str()
                .expect("every target has an expr")
                .to_string()
        })
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");

    let db = TestDb::new().await;
    let node = start_node(&config(&db, "metrics-names", 10, FAST)).await;
    let exported = get(node.http_addr, "/metrics").await.1;
    let families: std::collections::BTreeSet<String> = exported
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    for (what, text) in [("rules", rules.clone()), ("dashboard", exprs.join("\n"))] {
        let used = metric_names(&text);
        assert!(!used.is_empty(), "{what} names no metric");
        let missing: Vec<&String> = used.iter().filter(|n| !families.contains(*n)).collect();
        assert!(
            missing.is_empty(),
            "{what} uses metrics the node does not export: {missing:?}\nexported: {families:?}"
        );
    }
    node.shutdown();

    if tool_available("promtool") {
        let dir = format!("{root}/config/prometheus");
        for args in [
            ["check", "rules", "copier-node.rules.yml"],
            ["test", "rules", "copier-node.rules.test.yml"],
        ] {
            let out = std::process::Command::new("promtool")
                .args(args)
                .current_dir(&dir)
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "promtool {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    if tool_available("yamllint") {
        let out = std::process::Command::new("yamllint")
            .args(["-f", "parsable", "-c"])
            .arg(format!("{root}/config/kubernetes/.yamllint"))
            .arg(format!("{root}/config/prometheus"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.trim().is_empty(),
            "yamllint:\n{text}"
        );
    }
}

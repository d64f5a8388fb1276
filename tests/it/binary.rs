//! The real binary with its documented flags (docs/cli.md): replicas sharing accounts, handoff, failover, refusals.

use std::time::Duration;

use sqlx::Executor;
use tokio::time::Instant;

use crate::support::chaos::{ChaosProxy, Mode};
use crate::support::process::{NodeProcess, NodeSpec, run_to_end};
use crate::support::{
    FAST, TestDb, Timing, claimed_after, counts, eventually, insert_accounts, last_lease,
    wait_owned,
};

#[tokio::test]
async fn three_replicas_share_300_accounts_within_capacity() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=300, "mt5").await;
    insert_accounts(&mut conn, 301..=320, "mt4").await;
    let nodes: Vec<_> = ["r1", "r2", "r3"]
        .iter()
        .map(|id| NodeProcess::spawn(&db, id, 120, FAST, &[]))
        .collect();
    let shares = eventually(
        "300 accounts owned by three replicas",
        Duration::from_secs(30),
        async || {
            let c = counts(&mut conn).await;
            (c.values().sum::<usize>() == 300 && c.len() == 3).then_some(c)
        },
    )
    .await;
    for (node, n) in &shares {
        assert!(*n <= 120, "{node} owns {n} > 120");
    }
    let mt4_owned: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trading_accounts WHERE platform = 'mt4' AND node_id IS NOT NULL",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        mt4_owned, 0,
        "an mt5 node never claims another platform's accounts"
    );

    // Disabling releases; the owners drop them.
    conn.execute("UPDATE trading_accounts SET enabled = false WHERE id <= 30")
        .await
        .unwrap();
    eventually(
        "disabled accounts released",
        Duration::from_secs(10),
        async || {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM trading_accounts WHERE id <= 30 AND node_id IS NULL",
            )
            .fetch_one(&mut conn)
            .await
            .unwrap();
            (n == 30).then_some(())
        },
    )
    .await;
    for mut n in nodes {
        n.signal("TERM");
        assert!(
            n.wait_exit(Duration::from_secs(15)).await.success(),
            "{}",
            n.output()
        );
    }
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NOT NULL")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(left, 0, "every replica released everything on SIGTERM");
    let nodes: i64 = sqlx::query_scalar("SELECT count(*) FROM nodes")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(nodes, 0, "every replica deleted its membership");
}

#[tokio::test]
async fn sigterm_releases_before_exit_and_a_peer_claims_them_soon_after() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=50, "mt5").await;
    let mut a = NodeProcess::spawn(&db, "a", 100, FAST, &[]);
    wait_owned(&mut conn, "a", 50, Duration::from_secs(20)).await;
    // b's regular cycle is 20 s: only the release announcement can make it claim quickly.
    let slow = Timing {
        lease: "60s",
        fence: "15s",
        cycle: "20s",
    };
    let mut b = NodeProcess::spawn(&db, "b", 100, slow, &[]);
    b.wait_for_output("joined the cluster", Duration::from_secs(20))
        .await;
    b.wait_for_output(
        "listening for release announcements",
        Duration::from_secs(20),
    )
    .await;

    a.signal("TERM");
    let status = a.wait_exit(Duration::from_secs(15)).await;
    let exited = Instant::now();
    assert!(
        status.success(),
        "a exits 0 after a clean release: {status}\n{}",
        a.output()
    );
    let a_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id = 'a'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(a_rows, 0, "a released every row before it exited");
    wait_owned(&mut conn, "b", 50, Duration::from_secs(3)).await;
    let handoff = exited.elapsed();
    eprintln!(
        "handoff after SIGTERM: {} ms from a's exit until b owned all 50",
        handoff.as_millis()
    );
    assert!(
        a.output()
            .contains("released accounts and left the cluster"),
        "{}",
        a.output()
    );
}

#[tokio::test]
async fn kill9_moves_accounts_only_after_their_leases_expire() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=30, "mt5").await;
    let mut a = NodeProcess::spawn(&db, "a", 100, FAST, &["--rebalance-margin", "1"]);
    wait_owned(&mut conn, "a", 30, Duration::from_secs(20)).await;
    let mut b = NodeProcess::spawn(&db, "b", 100, FAST, &[]);
    b.wait_for_output("joined the cluster", Duration::from_secs(20))
        .await;

    a.kill9();
    let killed = Instant::now();
    let last_lease = last_lease(&mut conn, None).await;
    wait_owned(&mut conn, "b", 30, Duration::from_secs(15)).await;
    let failover = killed.elapsed();
    let early: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trading_accounts WHERE claimed_at <= $1::timestamptz",
    )
    .bind(&last_lease)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        early, 0,
        "no row moved before a's last lease_until ({last_lease})"
    );
    eprintln!(
        "failover after kill -9: {} ms (lease 3 s)",
        failover.as_millis()
    );
    // L1: lease + cycle, plus a second of slack for a loaded two-core machine (measured 2.6-3.0 s).
    assert!(
        failover < Duration::from_millis(3000 + 500 + 1000),
        "failover took {failover:?}"
    );
    b.signal("TERM");
    b.wait_exit(Duration::from_secs(15)).await;
}

#[tokio::test]
async fn a_hung_database_connection_moves_the_nodes_accounts_soon_after_its_last_lease() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=20, "mt5").await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let via = db.url_via(proxy.port);
    let mut a = NodeProcess::spawn(
        &db,
        "a",
        100,
        FAST,
        &["--database-url", &via, "--rebalance-margin", "1"],
    );
    wait_owned(&mut conn, "a", 20, Duration::from_secs(20)).await;
    let mut b = NodeProcess::spawn(&db, "b", 100, FAST, &[]);
    b.wait_for_output("joined the cluster", Duration::from_secs(20))
        .await;

    proxy.set(Mode::Hang);
    a.wait_for_output("gate closed: lease trust lapsed", Duration::from_secs(10))
        .await;
    let last_lease = last_lease(&mut conn, Some("a")).await;
    wait_owned(&mut conn, "b", 20, Duration::from_secs(15)).await;
    let (_, after_expiry_ms) = claimed_after(&mut conn, "b", &last_lease).await;
    eprintln!(
        "hung database: b claimed a's accounts {after_expiry_ms:.0} ms after a's last lease_until"
    );
    assert!(
        after_expiry_ms > 0.0 && after_expiry_ms < 1500.0,
        "{after_expiry_ms} ms"
    );

    // The network comes back: a finds its accounts gone and owns nothing; nobody owns twice.
    proxy.set(Mode::Forward);
    a.wait_for_output("lease cycle succeeded again", Duration::from_secs(15))
        .await;
    assert_eq!(counts(&mut conn).await.get("b"), Some(&20));
    for mut n in [a, b] {
        n.signal("TERM");
        assert!(
            n.wait_exit(Duration::from_secs(15)).await.success(),
            "{}",
            n.output()
        );
    }
}

#[tokio::test]
async fn a_second_process_with_a_live_node_id_exits_having_taken_nothing() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=10, "mt5").await;
    let mut a = NodeProcess::spawn(&db, "same", 5, FAST, &[]);
    eventually(
        "the first process owns 5",
        Duration::from_secs(20),
        async || (counts(&mut conn).await.get("same") == Some(&5)).then_some(()),
    )
    .await;
    let epochs_before: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, owner_epoch FROM trading_accounts WHERE node_id = 'same' ORDER BY id",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let instance_before: String =
        sqlx::query_scalar("SELECT instance_id FROM nodes WHERE node_id = 'same'")
            .fetch_one(&mut conn)
            .await
            .unwrap();

    let mut dup = NodeProcess::spawn(&db, "same", 5, FAST, &[]);
    let status = dup.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(
        status.code(),
        Some(3),
        "the duplicate exits with the node-id code (3), which systemd does not restart"
    );
    let out = dup.output();
    assert!(
        out.contains("node id `same` is in use by another live process"),
        "{out}"
    );
    assert!(
        out.contains("waiting for its membership to expire"),
        "it waited before giving up: {out}"
    );

    let epochs_after: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT id, owner_epoch FROM trading_accounts WHERE node_id = 'same' ORDER BY id",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        epochs_after, epochs_before,
        "the duplicate took nothing and bumped nothing"
    );
    let instance_after: String =
        sqlx::query_scalar("SELECT instance_id FROM nodes WHERE node_id = 'same'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(instance_after, instance_before);
    let free: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NULL")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(
        free, 5,
        "the duplicate claimed none of the free rows either"
    );
    a.signal("TERM");
    assert!(a.wait_exit(Duration::from_secs(15)).await.success());
}

#[tokio::test]
async fn a_restart_after_kill9_waits_out_the_old_membership_then_reclaims_with_new_epochs() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=8, "mt5").await;
    // A 10 s lease: the second process starts and runs its first cycle while the dead one's
    // membership is still live, however slowly it starts on a loaded machine (with a 3 s lease
    // a late start would find it expired and join without waiting).
    let timing = Timing {
        lease: "10s",
        fence: "3s",
        cycle: "1s",
    };
    let mut first = NodeProcess::spawn(&db, "n", 100, timing, &[]);
    wait_owned(&mut conn, "n", 8, Duration::from_secs(20)).await;
    first.kill9();
    let before: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, owner_epoch FROM trading_accounts ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    let last_lease = last_lease(&mut conn, None).await;

    let mut second = NodeProcess::spawn(&db, "n", 100, timing, &[]);
    second
        .wait_for_output(
            "waiting for its membership to expire",
            Duration::from_secs(10),
        )
        .await;
    second
        .wait_for_output("joined the cluster", Duration::from_secs(30))
        .await;
    eventually(
        "the restarted node owns all again",
        Duration::from_secs(10),
        async || (counts(&mut conn).await.get("n") == Some(&8)).then_some(()),
    )
    .await;
    let after: Vec<(i64, i64)> =
        sqlx::query_as("SELECT id, owner_epoch FROM trading_accounts ORDER BY id")
            .fetch_all(&mut conn)
            .await
            .unwrap();
    for ((id, old), (_, new)) in before.iter().zip(&after) {
        assert!(
            new > old,
            "account {id}: re-claimed with a new epoch, not renewed ({old} -> {new})"
        );
    }
    let early: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM trading_accounts WHERE claimed_at <= $1::timestamptz",
    )
    .bind(&last_lease)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        early, 0,
        "nothing re-claimed before the old instance's leases expired"
    );
    second.signal("TERM");
    assert!(second.wait_exit(Duration::from_secs(15)).await.success());
}

#[tokio::test]
async fn bad_configuration_is_refused_with_the_key_named() {
    let dir = std::env::temp_dir().join(format!("copier-bad-config-{}", fastrand::u32(..)));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.toml");
    std::fs::write(
        &file,
        "database_url = \"postgres://x@127.0.0.1:1/x\"\nplatform = \"mt5\"\nleese = \"60s\"\n",
    )
    .unwrap();
    let file = file.to_string_lossy().into_owned();
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["run", "--config", &file],
            vec![],
            "unknown configuration key `leese`",
        ),
        (
            vec!["run", "--platform", "mt5", "--lease", "3s", "--fence", "5s"],
            vec![("DATABASE_URL", "postgres://x@127.0.0.1:1/x")],
            "`fence` (5s) must be less than `lease` (3s)",
        ),
        (
            vec!["run", "--platform", "mt5", "--cycle", "40s"],
            vec![("DATABASE_URL", "postgres://x@127.0.0.1:1/x")],
            "`cycle`",
        ),
        (
            vec!["run", "--platform", "mt5"],
            vec![
                ("DATABASE_URL", "postgres://x@127.0.0.1:1/x"),
                ("COPIER_CAPACITY", "zero"),
            ],
            "invalid `capacity` from environment variable COPIER_CAPACITY",
        ),
        (
            vec!["run"],
            vec![("DATABASE_URL", "postgres://x@127.0.0.1:1/x")],
            "missing `platform`",
        ),
        (
            vec!["run", "--platform", "mt5"],
            vec![],
            "missing `database_url`",
        ),
        (
            vec!["run", "--config", "/nonexistent/copier.toml"],
            vec![],
            "cannot read config file /nonexistent/copier.toml",
        ),
    ];
    // Every problem at once: a newcomer's first `run` names both missing keys.
    let (code, _, stderr) = run_to_end(&["run", "--capacity", "0"], &[]);
    assert_eq!(code, 2);
    for needle in [
        "missing `database_url`",
        "COPIER_DATABASE_URL or DATABASE_URL",
        "missing `platform`",
        "invalid `capacity` from flag --capacity",
    ] {
        assert!(stderr.contains(needle), "{stderr:?} lacks {needle:?}");
    }
    for (args, env, needle) in cases {
        let (code, stdout, stderr) = run_to_end(&args, &env);
        assert_eq!(code, 2, "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: {stderr:?} lacks {needle:?}"
        );
        assert!(stdout.is_empty(), "{args:?}: nothing on stdout");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn sigterm_while_waiting_for_the_database_is_a_clean_stop() {
    let mut node = NodeProcess::spawn_with(&NodeSpec {
        node_id: "waiting".into(),
        capacity: 1,
        timing: FAST,
        database_url: "postgres://copier@127.0.0.1:1/none".into(),
        listen_url: None,
        env: Vec::new(),
        extra: Vec::new(),
    });
    node.wait_for_output("database unreachable", Duration::from_secs(20))
        .await;
    node.signal("TERM");
    let status = node.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(
        status.code(),
        Some(0),
        "a stop during a database outage is not a failure:\n{}",
        node.output()
    );
    assert!(node.output().contains("held nothing"), "{}", node.output());
}

#[tokio::test]
async fn an_unmigrated_database_is_refused_until_migrated() {
    let db = TestDb::empty().await;
    let url = db.url.clone();
    let env = [("DATABASE_URL", url.as_str())];
    let (code, _, stderr) = run_to_end(
        &[
            "run",
            "--platform",
            "mt5",
            "--lease",
            "3s",
            "--fence",
            "1s",
            "--cycle",
            "500ms",
        ],
        &env,
    );
    assert_eq!(code, 1);
    assert!(
        stderr.contains("pending migrations") && stderr.contains("copier-node migrate"),
        "{stderr}"
    );

    let (code, stdout, _) = run_to_end(&["migrate"], &env);
    assert_eq!(code, 0);
    // Every numbered file of migrations/, in order.
    let mut numbers: Vec<u32> =
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().to_string_lossy().into_owned();
                name.strip_suffix(".sql")?.split('_').next()?.parse().ok()
            })
            .collect();
    numbers.sort_unstable();
    let listed: Vec<String> = numbers.iter().map(u32::to_string).collect();
    assert!(numbers.len() >= 16, "{numbers:?}");
    assert_eq!(
        stdout.trim(),
        format!("applied migrations: {}", listed.join(", "))
    );
    let (code, stdout, _) = run_to_end(&["migrate", "--database-url", &url], &[]);
    assert_eq!(code, 0);
    assert_eq!(stdout.trim(), "no pending migrations");

    // `run --migrate` on a fresh database migrates and runs.
    let fresh = TestDb::empty().await;
    let mut node = NodeProcess::spawn(&fresh, "m", 10, FAST, &["--migrate"]);
    node.wait_for_output("joined the cluster", Duration::from_secs(20))
        .await;
    node.signal("TERM");
    assert!(node.wait_exit(Duration::from_secs(15)).await.success());
}

#[tokio::test]
async fn concurrent_migrate_commands_all_succeed() {
    let db = TestDb::empty().await;
    let url = db.url.clone();
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || run_to_end(&["migrate", "--database-url", &url], &[]))
        })
        .collect();
    let mut applied = 0;
    for h in handles {
        let (code, stdout, stderr) = h.join().unwrap();
        assert_eq!(code, 0, "{stderr}");
        if stdout.contains("applied migrations: 1, 2, 3, 4, 5, 6") {
            applied += 1;
        }
    }
    assert_eq!(applied, 1, "exactly one replica applied the migration");
}

#[tokio::test]
async fn logs_never_carry_the_database_password() {
    // Unreachable database: the node logs its retries, never the URL's password.
    let db = TestDb::new().await;
    let unreachable = "postgres://u:hunter2secret@127.0.0.1:1/none";
    let mut waiting = NodeProcess::spawn(&db, "p", 10, FAST, &["--database-url", unreachable]);
    waiting
        .wait_for_output("database unreachable; retrying", Duration::from_secs(20))
        .await;
    waiting.kill9();
    assert!(
        !waiting.output().contains("hunter2secret"),
        "{}",
        waiting.output()
    );

    // Trust authentication ignores the password, so a URL with one still connects.
    let with_password = db.url.replacen("postgres@", "postgres:hunter2secret@", 1);
    let mut node = NodeProcess::spawn(
        &db,
        "p",
        10,
        FAST,
        &["--database-url", &with_password, "--log-format", "json"],
    );
    node.wait_for_output("joined the cluster", Duration::from_secs(20))
        .await;
    node.signal("TERM");
    assert!(node.wait_exit(Duration::from_secs(15)).await.success());
    let out = node.output();
    assert!(!out.contains("hunter2secret"), "{out}");
    let mut with_node_id = 0;
    for line in out.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not one JSON object per line ({e}): {line}"));
        if v.to_string().contains("\"node_id\":\"p\"") {
            with_node_id += 1;
        }
    }
    assert!(with_node_id >= 3, "node lines carry node_id: {out}");
}

//! The lease core under a misbehaving network: a chaos proxy between a node and PostgreSQL that
//! stops forwarding while keeping sockets open, or swallows the server's replies.

use std::collections::BTreeMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::support::chaos::{ChaosProxy, Mode};
use crate::support::{
    FAST, TestDb, claimed_after, config, config_url, counts, eventually, insert_accounts,
    last_lease, start_node, wait_state,
};

#[tokio::test]
async fn a_hang_between_cycles_closes_the_gate_on_time_and_only_a_renewal_reopens_it() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=5, "mt5").await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let node = start_node(&config_url(&db.url_via(proxy.port), "a", 100, FAST)).await;
    let before = wait_state(&node.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 5 && s.trusted()
    })
    .await;

    proxy.set(Mode::Hang);
    let hung_at = Instant::now();
    let at_hang = node.state.borrow().clone();
    let closed = wait_state(
        &node.state,
        "the gate to close",
        Duration::from_secs(10),
        |s| !s.trusted(),
    )
    .await;
    let closed_at = Instant::now();
    // At most the cycle in flight when the proxy stopped could still have been acknowledged.
    assert!(closed.cycles <= at_hang.cycles + 1);
    if closed.cycles == at_hang.cycles {
        assert_eq!(
            closed.trusted_until, at_hang.trusted_until,
            "nothing extended trust while hung"
        );
    }
    let deadline = closed.trusted_until.unwrap();
    assert!(
        closed_at >= deadline && closed_at < deadline + Duration::from_millis(500),
        "closed {:?} after its deadline",
        closed_at - deadline
    );
    eprintln!(
        "gate closed {} ms after the hang began",
        (closed_at - hung_at).as_millis()
    );

    // Cycles keep failing on a bound instead of hanging: several attempts while the proxy hangs.
    let failing = wait_state(
        &node.state,
        "bounded cycle attempts",
        Duration::from_secs(15),
        |s| s.failed_cycles >= 2,
    )
    .await;
    assert!(failing.last_error.is_some());
    assert!(!failing.trusted());

    proxy.set(Mode::Forward);
    let reopened = wait_state(
        &node.state,
        "the gate to reopen",
        Duration::from_secs(15),
        |s| s.trusted(),
    )
    .await;
    assert!(
        reopened.cycles > closed.cycles,
        "only a successful renewal reopens the gate"
    );
    assert!(reopened.last_error.is_none());
    // The hang outlasted the lease: the renewal re-claimed every account with a new epoch (R1).
    let after = wait_state(
        &node.state,
        "all owned again",
        Duration::from_secs(10),
        |s| s.owned.len() == 5,
    )
    .await;
    if hung_at.elapsed() > Duration::from_secs(3) {
        for (id, epoch) in after.owned.iter() {
            assert!(
                *epoch > before.owned[id],
                "account {id} keeps epoch {epoch} after its lease lapsed"
            );
        }
    }
    node.shutdown();
    node.wait().await.unwrap();
}

#[tokio::test]
async fn a_hang_mid_cycle_holds_no_locks_and_a_peer_owns_the_accounts_soon_after_expiry() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=10, "mt5").await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    // a keeps everything (a margin of its whole share): this test is about expiry, not balance.
    let mut a_config = config_url(&db.url_via(proxy.port), "a", 100, FAST);
    a_config.rebalance_margin = 1.0;
    let a = start_node(&a_config).await;
    wait_state(&a.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 10
    })
    .await;
    let b = start_node(&config(&db, "b", 100, FAST)).await;
    wait_state(&b.state, "b runs", Duration::from_secs(10), |s| {
        s.cycles >= 1
    })
    .await;

    // a's next statement reaches the server and commits; its reply never comes back.
    proxy.set(Mode::HangReplies);
    wait_state(
        &a.state,
        "a's gate to close",
        Duration::from_secs(10),
        |s| !s.trusted(),
    )
    .await;
    // A statement a sent just before its gate closed may be running this instant and hold its
    // rows for that long; what must never be is a lock held by a transaction older than the
    // server-side bounds (statement_timeout, idle_in_transaction_session_timeout: a third of the
    // 1 s fence each), as a stalled client inside an open transaction would hold.
    let held: Vec<(String, String, String, f64)> = sqlx::query_as(
        "SELECT l.locktype, coalesce(s.state, ''), coalesce(s.query, ''),
                coalesce(extract(epoch FROM now() - s.xact_start)::float8 * 1000, 0)
           FROM pg_locks l JOIN pg_stat_activity s USING (pid)
          WHERE s.application_name = 'copier-node a' AND l.locktype IN ('transactionid', 'tuple')",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    eprintln!("a's row locks as its gate closed: {held:?}");
    let stale: Vec<_> = held
        .iter()
        .filter(|(.., age_ms)| *age_ms > 1000.0)
        .collect();
    assert!(
        stale.is_empty(),
        "a stalled node holds row locks past the fence: {stale:?}"
    );
    let last_lease = last_lease(&mut conn, Some("a")).await;

    wait_state(
        &b.state,
        "b owns a's accounts",
        Duration::from_secs(15),
        |s| s.owned.len() == 10,
    )
    .await;
    let (first_ms, last_ms) = claimed_after(&mut conn, "b", &last_lease).await;
    eprintln!("b claimed {first_ms:.0}..{last_ms:.0} ms after a's last lease_until");
    assert!(first_ms > 0.0, "nothing claimed before a's lease expired");
    assert!(
        last_ms < 1500.0,
        "claimed {last_ms:.0} ms after expiry; failover at expiry aims at about 25 ms"
    );

    proxy.set(Mode::Forward);
    a.shutdown();
    b.shutdown();
    a.wait().await.unwrap();
    b.wait().await.unwrap();
}

#[tokio::test]
async fn a_node_whose_database_is_cut_reconnects_and_keeps_its_accounts() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=4, "mt5").await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let node = start_node(&config_url(&db.url_via(proxy.port), "a", 100, FAST)).await;
    let before = wait_state(&node.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 4
    })
    .await;
    let cycles = before.cycles;
    proxy.cut();
    let after = wait_state(
        &node.state,
        "a renews after the cut",
        Duration::from_secs(10),
        |s| s.cycles >= cycles + 3,
    )
    .await;
    let owned: BTreeMap<i64, i64> = (*after.owned).clone();
    assert_eq!(
        owned, *before.owned,
        "a short cut keeps every account at its epoch"
    );
    assert_eq!(counts(&mut conn).await.get("a"), Some(&4));
    node.shutdown();
    node.wait().await.unwrap();
}

#[tokio::test]
async fn a_failing_database_at_shutdown_does_not_hang_the_exit() {
    let db = TestDb::new().await;
    let mut conn = db.conn().await;
    insert_accounts(&mut conn, 1..=2, "mt5").await;
    let proxy = ChaosProxy::start(db.server_addr()).await;
    let node = start_node(&config_url(&db.url_via(proxy.port), "a", 100, FAST)).await;
    wait_state(&node.state, "a owns all", Duration::from_secs(10), |s| {
        s.owned.len() == 2
    })
    .await;
    proxy.set(Mode::Hang);
    let asked = Instant::now();
    node.shutdown();
    node.wait().await.unwrap();
    // The release is retried within the trust window (lease - fence), then given up on.
    assert!(
        asked.elapsed() < Duration::from_secs(8),
        "shutdown took {:?}",
        asked.elapsed()
    );
    proxy.set(Mode::Forward);
    // The accounts were not released: they move when their leases expire.
    eventually(
        "a's leases to expire",
        Duration::from_secs(10),
        async || counts(&mut conn).await.is_empty().then_some(()),
    )
    .await;
}

/// The node's pool pings a connection that sat idle (a second or more) before handing it out,
/// and only then: one whose server process was terminated meanwhile (a restart, a failover, an
/// idle timeout) is replaced, and the unit of work runs on a live one.
#[tokio::test]
async fn a_pooled_connection_killed_while_idle_is_replaced_before_use() {
    use copier_node::db::{self, Db, Session, SessionBounds};

    let test_db = crate::support::TestDb::new().await;
    let session = Session::direct(SessionBounds::for_fence(Duration::from_secs(15)));
    let url =
        crate::support::config_url(&test_db.url, "idle-ping", 1, crate::support::FAST).database_url;
    let options = db::node_options(&url, "idle-ping", session).unwrap();
    let pool = Db::new(
        db::node_pool(options, Duration::from_secs(10), session),
        session,
    );
    let backend = async |pool: &Db| {
        pool.run(async |c| {
            sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
                .fetch_one(c)
                .await
        })
        .await
    };
    let pid = backend(&pool).await.unwrap();
    let mut admin = test_db.conn().await;
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .execute(&mut admin)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let alive: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
            .bind(pid)
            .fetch_one(&mut admin)
            .await
            .unwrap();
        if alive == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "backend {pid} still running");
        tokio::task::yield_now().await;
    }
    // Idle past the pool's threshold: the condition under test, not a synchronisation.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let again = backend(&pool)
        .await
        .expect("the dead connection is replaced before use");
    assert_ne!(again, pid);
}

/// A batch writer's own connection (the master publisher's, the copy ledger's) cut between two
/// writes, as a database restart does: the next batch still lands, written again on a new
/// connection, and the writer's connection runs its statements with generic plans.
#[tokio::test]
async fn a_batch_writer_whose_connection_was_cut_writes_its_next_batch_anyway() {
    use copier_node::db::copy::ledger::{CopyLedgerWriter, CopyRecord, CopyWrite};
    use copier_node::db::{self, Db, Session, SessionBounds};

    let test_db = TestDb::new().await;
    let mut conn = test_db.conn().await;
    crate::support::add_account(&mut conn, 1, "master", "broker:1", "m1").await;
    crate::support::add_account(&mut conn, 2, "follower", "broker:1", "f2").await;
    crate::support::insert_node(&mut conn, "n1", "1 minute", 2).await;
    sqlx::query(
        "UPDATE trading_accounts SET node_id = 'n1', owner_epoch = 7, lease_until = now() + interval '1 minute' WHERE id = 2",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    let proxy = ChaosProxy::start(test_db.server_addr()).await;
    let session = Session::direct(SessionBounds::for_fence(Duration::from_secs(15)));
    let url = config_url(&test_db.url_via(proxy.port), "writer-cut", 1, FAST).database_url;
    let options = db::node_options(&url, "writer-cut", session).unwrap();
    let writer_db = Db::new(
        db::writer_pool(options, Duration::from_secs(10), session),
        session,
    );
    let mode: String = writer_db
        .run(async |c| {
            sqlx::query_scalar("SELECT current_setting('plan_cache_mode')")
                .fetch_one(c)
                .await
        })
        .await
        .unwrap();
    assert_eq!(mode, "force_generic_plan");
    let writer = CopyLedgerWriter::spawn(writer_db);
    let write = |ticket: i64| CopyWrite {
        node_id: "n1".into(),
        follower_id: 2,
        epoch: 7,
        record: CopyRecord {
            server: "broker:1".into(),
            login: "f2".into(),
            follower_ticket: ticket,
            link_id: 1,
            master_id: 1,
            master_ticket: ticket,
            symbol: "EURUSD".into(),
            side: "buy".into(),
            volume: 0.1,
            requested_price: None,
            filled_price: 1.1,
            slippage: None,
            slippage_bps: None,
            slippage_points: None,
            master_fill_ms: None,
            event_committed_ms: None,
            decided_ms: None,
            accepted_ms: None,
            event_committed_us: None,
            notice_us: None,
            decided_us: None,
            sent_us: None,
            accepted_us: None,
            found_by_reconcile: false,
            opened_volume: None,
        },
    };
    assert_eq!(writer.write(write(1)).await, Ok(true));
    let backend: i32 = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'copier-node writer-cut'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    proxy.cut();
    // The cut has reached the server: the writer's backend is gone (its client side is dead).
    eventually(
        "the writer's backend to end",
        Duration::from_secs(10),
        async || {
            let left: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE pid = $1")
                    .bind(backend)
                    .fetch_one(&mut conn)
                    .await
                    .unwrap();
            (left == 0).then_some(())
        },
    )
    .await;
    assert_eq!(
        writer.write(write(2)).await,
        Ok(true),
        "the batch after the cut is written on a new connection"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM copy_ledger")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, 2);
}

/// Background work (session start-ups, reconciles) takes turns on the node's pool, so however
/// much of it queues, live work finds a connection: sixteen background units each holding their
/// connection on the server, and a live unit started after them all finishes while the first
/// turns are still busy. Judged by PostgreSQL: no more than the turns' worth of the pool's
/// connections ever run a background unit (`pg_stat_activity`).
#[tokio::test]
async fn live_work_never_waits_behind_queued_background_work() {
    use copier_node::db::{self, BACKGROUND_UNITS, Db, Session, SessionBounds};

    let test_db = crate::support::TestDb::new().await;
    let session = Session::direct(SessionBounds::for_fence(Duration::from_secs(15)));
    let url =
        crate::support::config_url(&test_db.url, "turns", 1, crate::support::FAST).database_url;
    let options = db::node_options(&url, "turns", session).unwrap();
    let pool = Db::new(
        db::node_pool(options, Duration::from_secs(10), session),
        session,
    );
    let finished = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut background = Vec::new();
    for _ in 0..16 {
        let (pool, finished) = (pool.clone(), finished.clone());
        background.push(tokio::spawn(async move {
            pool.background(async |c| {
                sqlx::query("SELECT pg_sleep(1) /* background unit */")
                    .execute(c)
                    .await
            })
            .await
            .unwrap();
            finished.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }));
    }
    let mut watcher = test_db.conn().await;
    let running = async |watcher: &mut sqlx::PgConnection| -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%/* background unit */%' AND pid <> pg_backend_pid()",
        )
        .fetch_one(watcher)
        .await
        .unwrap()
    };
    eventually(
        "the background turns all busy",
        Duration::from_secs(20),
        async || (running(&mut watcher).await == BACKGROUND_UNITS as i64).then_some(()),
    )
    .await;
    pool.run(async |c| sqlx::query("SELECT 1").execute(c).await)
        .await
        .unwrap();
    assert_eq!(
        finished.load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the live unit waited for background work to finish"
    );
    let mut most = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    while finished.load(std::sync::atomic::Ordering::SeqCst) < 16 {
        tick.tick().await;
        most = most.max(running(&mut watcher).await);
        assert!(
            most <= BACKGROUND_UNITS as i64,
            "{most} background units ran at once"
        );
    }
    for b in background {
        b.await.unwrap();
    }
}

//! The node behind PgBouncer 1.18 (issue 20): in session mode it works with every safety bound in
//! place; a pooler that silently drops the startup options is refused before it carries a cycle;
//! in transaction mode, with one server connection for many clients, every unit of work is an
//! explicit transaction carrying its bounds, and nodes copy without a duplicate.

use std::time::Duration;

use copier_node::broker::types::Side;

use crate::support::broker::Scratch;
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::pgbouncer;
use crate::support::{FAST, LinkSpec, config_url, eventually, start_node};

const WAIT: Duration = Duration::from_secs(30);

/// Through PgBouncer in session mode (`database_pooler = "session"`: the bounds SET after
/// connecting, since 1.18 refuses startup options) the node owns its accounts and copies.
#[tokio::test]
async fn a_node_copies_through_pgbouncer_in_session_mode_with_its_bounds_set() {
    if !pgbouncer::available() {
        return;
    }
    let mut s = CopySetup::unprotected("pooler-session").await;
    let dir = Scratch::new("pgbouncer-session");
    let bouncer = pgbouncer::start(&dir.0, &s.db.url, "session", "extra_float_digits");
    let (_, magic) = master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let mut cfg = config_url(&bouncer.url(&s.db.name), "pooled", 10, FAST);
    cfg.database_pooler = copier_node::config::Pooler::Session;
    let node = start_node(&cfg).await;
    let ticket = s.t.open("m1", "EURUSD", Side::Buy, 0.2, None, None).await;
    let copy = s.t.copy_of("f2", magic, ticket, WAIT).await;
    assert_eq!(copy.volume, 0.2);
    // Every connection was checked for its bounds before use (a refusal would show here).
    let state = node.state.borrow().clone();
    assert!(
        state.owned.len() == 2,
        "both accounts owned: {:?}",
        state.owned
    );
    assert!(state.last_error.is_none(), "{:?}", state.last_error);
    node.shutdown();
}

/// PgBouncer 1.18 told to drop the startup options (`ignore_startup_parameters = options`):
/// a node that sends its bounds there would run without them, so it refuses the connection
/// (naming the missing settings) and owns nothing; `database_pooler = "session"` sets them.
#[tokio::test]
async fn a_pooler_that_drops_the_startup_options_is_refused() {
    if !pgbouncer::available() {
        return;
    }
    let mut s = CopySetup::new("pooler-drops").await;
    let dir = Scratch::new("pgbouncer-drops");
    let bouncer = pgbouncer::start(&dir.0, &s.db.url, "session", "extra_float_digits,options");
    master_and_follower(&mut s.conn, &s.addr, LinkSpec::default()).await;
    let cfg = config_url(&bouncer.url(&s.db.name), "trusting", 10, FAST);
    let node = start_node(&cfg).await;
    let mut state = node.state.clone();
    let error = eventually("a cycle refused for the missing bounds", WAIT, async || {
        let s = state.borrow_and_update().clone();
        s.last_error.filter(|e| e.contains("safety bounds"))
    })
    .await;
    assert!(error.contains("statement_timeout"), "{error}");
    assert!(
        node.state.borrow().owned.is_empty(),
        "nothing owned without the bounds"
    );
    let owned: i64 =
        sqlx::query_scalar("SELECT count(*) FROM trading_accounts WHERE node_id IS NOT NULL")
            .fetch_one(&mut s.conn)
            .await
            .unwrap();
    assert_eq!(owned, 0);
    node.shutdown();
    // The same pooler with the bounds SET after connecting: the accounts are owned.
    let mut cfg = config_url(&bouncer.url(&s.db.name), "setting", 10, FAST);
    cfg.database_pooler = copier_node::config::Pooler::Session;
    let node = start_node(&cfg).await;
    let mut state = node.state.clone();
    eventually("both accounts owned", WAIT, async || {
        (state.borrow_and_update().owned.len() == 2).then_some(())
    })
    .await;
    node.shutdown();
}

/// Through PgBouncer in transaction mode with one (then three) server connections shared by forty clients, every
/// unit of work (`Db::run`) sees the node's bounds (set with `SET LOCAL` in its BEGIN), a bare
/// statement through the same pooler does not (nothing sticks to a client in this mode), and
/// parameterised statements run concurrently by many clients each get their own answer: the
/// driver's Parse/Describe/Sync and Bind/Execute/Sync halves stay on one server inside the
/// transaction, so no client binds to another's statement.
#[tokio::test]
async fn through_a_transaction_pooler_every_unit_of_work_carries_the_bounds_and_its_own_statement()
{
    use copier_node::db::{self, Db, Pooler, Session, SessionBounds};
    use sqlx::Row;
    if !pgbouncer::available() {
        return;
    }
    let db_ = crate::support::TestDb::new().await;
    // One server connection for all, then three (units of one client move between servers).
    for pool_size in [1, 3] {
        let dir = Scratch::new(&format!("pgbouncer-tx-units-{pool_size}"));
        let bouncer = pgbouncer::start_sized(
            &dir.0,
            &db_.url,
            "transaction",
            "extra_float_digits",
            pool_size,
        );
        let session = Session {
            bounds: SessionBounds::for_fence(Duration::from_millis(1500)),
            pooler: Pooler::Transaction,
        };
        // The URL as the node holds it (a secret), from the configuration layers.
        let url = config_url(&bouncer.url(&db_.name), "units", 10, FAST).database_url;
        let clients: Vec<Db> = (0..40)
            .map(|i| {
                let options = db::node_options(&url, &format!("client{i}"), session).unwrap();
                Db::new(
                    db::node_pool(options, Duration::from_secs(20), session),
                    session,
                )
            })
            .collect();
        let settings = clients[0]
            .run(async |c| {
                sqlx::query_as::<_, (String, String, String, String)>(
                    "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),
                            current_setting('idle_in_transaction_session_timeout'), current_setting('synchronous_commit')",
                )
                .fetch_one(c)
                .await
            })
            .await
            .unwrap();
        assert_eq!(
            settings,
            ("500ms".into(), "300ms".into(), "500ms".into(), "on".into()),
            "the bounds inside a unit of work"
        );
        // One simple-protocol message: an unnamed statement's Parse and Bind, sent with a Sync
        // each outside a transaction, may reach two servers of the pool (and the Bind then
        // fails: "unnamed prepared statement does not exist").
        let bare: String = sqlx::raw_sql("SELECT current_setting('statement_timeout')")
            .fetch_one(clients[0].pool())
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            bare, "0",
            "outside a unit of work nothing is set (no SET sticks)"
        );
        // Forty clients on `pool_size` server connections, 25 parameterised statements each,
        // interleaved (with more than one server, consecutive units move between servers).
        let tasks: Vec<_> = clients
            .iter()
            .enumerate()
            .map(|(i, client)| {
                let client = client.clone();
                tokio::spawn(async move {
                    for k in 0..25i64 {
                        let mine = i as i64 * 1000 + k;
                        let (back, text): (i64, String) = client
                            .run(async |c| {
                                sqlx::query_as("SELECT $1::bigint, $2::text")
                                    .bind(mine)
                                    .bind(format!("client {i}"))
                                    .fetch_one(c)
                                    .await
                            })
                            .await
                            .unwrap_or_else(|e| panic!("client {i}: {}", db::describe(&e)));
                        assert_eq!((back, text), (mine, format!("client {i}")));
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    }
}

/// Behind a transaction pooler the lease cycle is one message (`lease::cycle_on`: the bounds as
/// `SET LOCAL` and the statement with its parameters written in). Through PgBouncer in
/// transaction mode with one server connection: every parameter arrives as the node holds it (a
/// node id with a quote, a backslash and `$1` in it; capacity, sessions starting and owned; lease
/// and trust; the claim limit; the held epochs, renewed as they are; through a grace only the kept
/// one), no prepared statement is left on the shared server, and the bounds hold inside the
/// message: with the node's membership row locked elsewhere the cycle fails on the lock timeout
/// instead of waiting.
#[tokio::test]
async fn through_a_transaction_pooler_the_lease_cycle_is_one_message_with_its_parameters_and_bounds()
 {
    use copier_node::db::lease::{CycleParams, cycle_on};
    use copier_node::db::{self, Pooler, Session, SessionBounds};
    use sqlx::{Connection, PgConnection};
    if !pgbouncer::available() {
        return;
    }
    let db_ = crate::support::TestDb::new().await;
    let mut direct = db_.conn().await;
    crate::support::insert_accounts(&mut direct, 1..=10, "mt5").await;
    let dir = Scratch::new("pgbouncer-tx-cycle");
    let bouncer = pgbouncer::start_sized(&dir.0, &db_.url, "transaction", "extra_float_digits", 1);
    let session = Session {
        bounds: SessionBounds::for_fence(Duration::from_millis(1500)),
        pooler: Pooler::Transaction,
    };
    let url = config_url(&bouncer.url(&db_.name), "cycle", 10, FAST).database_url;
    let node = "o'bri\\en $1 $12";
    let options = db::node_options(&url, node, session).unwrap();
    let mut conn = PgConnection::connect_with(&options).await.unwrap();
    let params = |held: &'static [i64], kept: &'static [i64]| CycleParams {
        node_id: node,
        instance_id: "i'1",
        platform: "mt5",
        capacity: 10,
        claim_limit: 3,
        trust: Duration::from_millis(45_000),
        owned: held.len() as u32,
        starting: 2,
        lease: Duration::from_millis(60_000),
        held,
        claim: true,
        kept,
    };
    let first = cycle_on(&mut conn, &session, &params(&[], &[]))
        .await
        .unwrap();
    assert!(first.member, "the membership upsert matched");
    let ids: Vec<i64> = first.owned.iter().map(|r| r.id).collect();
    assert_eq!(
        ids,
        [1, 2, 3],
        "claimed up to the claim limit, lowest ids first"
    );
    let (instance, capacity, starting, owned, lease_ms, trust_ms): (
        String,
        i32,
        i32,
        i32,
        f64,
        f64,
    ) = sqlx::query_as(
        "SELECT instance_id, capacity, starting, owned,
                    extract(epoch FROM lease_until - renewed_at)::float8 * 1000,
                    extract(epoch FROM trust_until - renewed_at)::float8 * 1000
               FROM nodes WHERE node_id = $1",
    )
    .bind(node)
    .fetch_one(&mut direct)
    .await
    .unwrap();
    assert_eq!(
        (
            instance.as_str(),
            capacity,
            starting,
            owned,
            lease_ms.round(),
            trust_ms.round()
        ),
        ("i'1", 10, 2, 0, 60_000.0, 45_000.0),
        "the membership as the node holds it"
    );
    let rows: Vec<String> =
        sqlx::query_scalar("SELECT node_id FROM trading_accounts WHERE node_id IS NOT NULL")
            .fetch_all(&mut direct)
            .await
            .unwrap();
    assert_eq!(rows, [node; 3], "the claimed rows name the node exactly");

    let epochs: &'static [i64] = first
        .owned
        .iter()
        .map(|r| r.epoch)
        .collect::<Vec<_>>()
        .leak();
    let again = cycle_on(&mut conn, &session, &params(epochs, &[]))
        .await
        .unwrap();
    let renewed: Vec<(i64, i64)> = again.owned.iter().map(|r| (r.id, r.epoch)).collect();
    let before: Vec<(i64, i64)> = first.owned.iter().map(|r| (r.id, r.epoch)).collect();
    assert_eq!(
        renewed, before,
        "held epochs renewed as they are, nothing claimed past the limit"
    );

    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_prepared_statements")
        .persistent(false)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        left, 0,
        "the one server connection holds no prepared statement"
    );

    // Through a grace only the kept epochs are renewed.
    sqlx::query("UPDATE copier_database SET claims_after = now() + interval '1 hour'")
        .execute(&mut direct)
        .await
        .unwrap();
    let kept: &'static [i64] = vec![epochs[1]].leak();
    let grace = cycle_on(&mut conn, &session, &params(epochs, kept))
        .await
        .unwrap();
    assert!(
        grace.database.grace > Duration::ZERO,
        "the cycle saw the grace"
    );
    let renewed: Vec<(i64, i64)> = grace.owned.iter().map(|r| (r.id, r.epoch)).collect();
    assert_eq!(
        renewed,
        [before[1]],
        "only the kept epoch renewed through a grace"
    );

    // The bounds hold inside the message: a lock held elsewhere fails the cycle on the lock
    // timeout (a fifth of the fence) instead of waiting on it.
    let mut holder = direct.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM nodes WHERE node_id = $1 FOR UPDATE")
        .bind(node)
        .execute(&mut *holder)
        .await
        .unwrap();
    let blocked = tokio::time::timeout(
        Duration::from_secs(20),
        cycle_on(&mut conn, &session, &params(epochs, kept)),
    )
    .await
    .expect("the cycle waited on the lock: no lock timeout inside the message")
    .expect_err("a cycle whose membership row is locked elsewhere fails");
    let code = blocked
        .as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("55P03"), "lock timeout: {blocked}");
    holder.rollback().await.unwrap();
}

/// Three nodes through PgBouncer in transaction mode with one server connection
/// (`default_pool_size = 1`): two listen on a direct connection (`listen_database_url`), one polls
/// (`events_poll`). They share two masters and four followers and copy every trade once.
#[tokio::test]
async fn nodes_copy_through_a_transaction_pooler_with_one_server_connection() {
    use crate::support::{add_account, add_link, config_listen};
    if !pgbouncer::available() {
        return;
    }
    let mut s = CopySetup::unprotected("pooler-transaction").await;
    let dir = Scratch::new("pgbouncer-transaction");
    let bouncer = pgbouncer::start_sized(&dir.0, &s.db.url, "transaction", "extra_float_digits", 1);
    let mut magics = Vec::new();
    for m in 1..=2 {
        add_account(&mut s.conn, m, "master", &s.addr, &format!("m{m}")).await;
    }
    for f in 3..=6 {
        add_account(&mut s.conn, f, "follower", &s.addr, &format!("f{f}")).await;
        let (_, magic) = add_link(&mut s.conn, 1 + (f % 2), f, LinkSpec::default()).await;
        magics.push((f, 1 + (f % 2), magic));
    }
    let pooled = bouncer.url(&s.db.name);
    let mut nodes = Vec::new();
    for (i, id) in ["ta", "tb", "tc"].into_iter().enumerate() {
        let mut cfg = config_listen(&pooled, &s.db.url, id, 10, FAST);
        cfg.database_pooler = copier_node::config::Pooler::Transaction;
        if i == 2 {
            cfg.events_poll = Some(Duration::from_millis(100));
        }
        nodes.push(start_node(&cfg).await);
    }
    eventually("every account owned", WAIT, async || {
        let owned: usize = nodes.iter().map(|n| n.state.borrow().owned.len()).sum();
        (owned == 6).then_some(())
    })
    .await;
    let mut opened = Vec::new();
    for round in 0..3 {
        for m in 1..=2 {
            let t =
                s.t.open(
                    &format!("m{m}"),
                    "EURUSD",
                    Side::Buy,
                    0.1 * (round + 1) as f64,
                    None,
                    None,
                )
                .await;
            opened.push((m, t));
        }
    }
    for (f, m, magic) in &magics {
        for (_, ticket) in opened.iter().filter(|(om, _)| om == m) {
            s.t.copy_of(&format!("f{f}"), *magic, *ticket, WAIT).await;
        }
    }
    for (m, ticket) in &opened {
        s.t.close(&format!("m{m}"), *ticket, None).await;
    }
    for f in 3..=6 {
        eventually(format!("f{f} flat"), WAIT, async || {
            s.t.positions(&format!("f{f}"))
                .await
                .is_empty()
                .then_some(())
        })
        .await;
    }
    let journal = crate::support::broker::journal(&s.dir.path("journal.jsonl"));
    let mut opens = std::collections::HashMap::new();
    for l in journal
        .iter()
        .filter(|l| l.action == "open" && l.accepted && l.client != "manual")
    {
        *opens
            .entry((l.login.clone(), l.comment.clone()))
            .or_insert(0) += 1;
    }
    assert_eq!(
        opens.len(),
        12,
        "one copy per master trade per follower: {opens:?}"
    );
    assert!(opens.values().all(|n| *n == 1), "duplicates: {opens:?}");
    for n in &nodes {
        assert!(
            n.state.borrow().last_error.is_none(),
            "{:?}",
            n.state.borrow().last_error
        );
        n.shutdown();
    }
}

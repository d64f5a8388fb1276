//! The node behind PgBouncer 1.18 (issue 20): in session mode it works with every safety bound in
//! place; a pooler that silently drops the startup options is refused before it carries a cycle.

use std::time::Duration;

use copier_node::broker::types::Side;

use crate::support::broker::Scratch;
use crate::support::fixture::{CopySetup, master_and_follower};
use crate::support::pgbouncer::{self, PgBouncer};
use crate::support::{FAST, LinkSpec, config_url, eventually, start_node};

const WAIT: Duration = Duration::from_secs(30);

/// Through PgBouncer in session mode (`database_pooler = "session"`: the bounds SET after
/// connecting, since 1.18 refuses startup options) the node owns its accounts and copies.
#[tokio::test]
async fn a_node_copies_through_pgbouncer_in_session_mode_with_its_bounds_set() {
    if !pgbouncer::available() {
        return;
    }
    let mut s = CopySetup::new("pooler-session").await;
    let dir = Scratch::new("pgbouncer-session");
    let bouncer = PgBouncer::start(&dir.0, &s.db.url, "session", "extra_float_digits");
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
    let bouncer = PgBouncer::start(&dir.0, &s.db.url, "session", "extra_float_digits,options");
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

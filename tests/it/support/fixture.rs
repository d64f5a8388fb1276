//! The prologue most copy tests share: a database, a scratch directory, an in-process simulated
//! broker, a hand trader on it and a connection; and the smallest copy setup on top of it.

use sqlx::PgConnection;

use copier_node::sim_broker::server::{ServeOptions, SimBroker};

use super::broker::Scratch;
use super::{LinkSpec, TestDb, Trader, add_account, add_link};

/// A test's database, scratch directory (the broker's journal is `journal.jsonl` in it),
/// simulated broker (its address in `addr`), hand trader and connection.
pub struct CopySetup {
    pub db: TestDb,
    pub dir: Scratch,
    pub broker: SimBroker,
    pub addr: String,
    pub t: Trader,
    pub conn: PgConnection,
}

impl CopySetup {
    /// With the simulated broker's defaults (fence check and client-order-id dedupe on).
    pub async fn new(name: &str) -> CopySetup {
        Self::with(name, |_| {}).await
    }

    /// With the broker behaving as MT4/MT5 servers do: no fence check, no client-order-id dedupe
    /// (safety is then judged from the journal alone).
    pub async fn unprotected(name: &str) -> CopySetup {
        Self::with(name, |o| {
            o.fence_check = false;
            o.dedupe = false;
        })
        .await
    }

    /// With the broker's options tuned first.
    pub async fn with(name: &str, tune: impl FnOnce(&mut ServeOptions)) -> CopySetup {
        let db = TestDb::new().await;
        let dir = Scratch::new(name);
        let mut options = ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl"));
        tune(&mut options);
        let broker = SimBroker::start(options).await.unwrap();
        let addr = broker.addr.to_string();
        let conn = db.conn().await;
        CopySetup {
            t: Trader { addr: addr.clone() },
            db,
            dir,
            broker,
            addr,
            conn,
        }
    }
}

/// Master 1 (login `m1`) copied by follower 2 (`f2`) under `spec`: (link id, magic).
pub async fn master_and_follower(
    conn: &mut PgConnection,
    addr: &str,
    spec: LinkSpec,
) -> (i64, i64) {
    add_account(conn, 1, "master", addr, "m1").await;
    add_account(conn, 2, "follower", addr, "f2").await;
    add_link(conn, 1, 2, spec).await
}

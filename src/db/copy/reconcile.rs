//! What a follower's reconcile reads from the database, for many followers at once: the reads a
//! node's followers ask for at about the same time (a thousand sessions starting, the periodic
//! reconciles of every follower) go as one batch on one connection, in a background turn as each
//! follower's own reads did ([`crate::db::Db::background`]). A hundred followers of one master
//! read its snapshot once.
//!
//! Two readers, whose reads a reconcile makes at once, before it reads the follower's broker:
//! [`ReconcileRead`] (the master's snapshot and funds, the follower's late-copy bases and final
//! decisions) and [`LedgerRead`] (what the follower ever copied and placed, once its own rows are
//! written).

use std::collections::{HashMap, HashSet};

use sqlx::PgConnection;

use super::{
    Funds, MasterState, accounts_funds, ledger::LedgerKey, load_bases_of, load_decided_of,
    master_states,
};
use crate::db::batch::{BatchWriter, Batched};
use crate::future::BoxFuture;

/// One follower's reads for reconciling one master ([`ReconcileReader`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReconcileRead {
    pub follower: i64,
    pub master: i64,
}

/// What a [`ReconcileRead`] found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReconcileBasis {
    /// The master's published state ([`super::master_state`]).
    pub state: Option<MasterState>,
    /// The master's balance, equity and currency.
    pub master_funds: Funds,
    /// The follower's late-copy bases: copy ticket -> master volume.
    pub bases: HashMap<i64, f64>,
    /// The follower's (link, master ticket) pairs a final decision says never to copy.
    pub decided: HashSet<(i64, i64)>,
    /// When the read was answered, on the node's clock: the snapshot's `now_ms` plus the time
    /// since is the database's clock at a later decision.
    pub read_at: tokio::time::Instant,
}

/// The node's reader of its followers' reconcile reads: four statements a batch, however many
/// followers and masters it holds (up to 1,000 reads).
pub type ReconcileReader = BatchWriter<ReconcileRead>;

impl Batched for ReconcileRead {
    /// A master whose snapshot does not parse fails its own followers' reads only.
    type Outcome = Result<ReconcileBasis, String>;
    const WHAT: &'static str = "reconcile reader";
    const MAX: usize = 1000;
    const ALONE_WHEN_REFUSED: bool = false;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        reads: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>> {
        Box::pin(async move {
            let distinct = |f: fn(&ReconcileRead) -> i64| {
                let mut ids: Vec<i64> = reads.iter().map(f).collect();
                ids.sort_unstable();
                ids.dedup();
                ids
            };
            let masters = distinct(|r| r.master);
            let followers = distinct(|r| r.follower);
            let states = master_states(&mut *conn, &masters).await?;
            let funds = accounts_funds(&mut *conn, &masters).await?;
            let bases = load_bases_of(&mut *conn, &followers).await?;
            let decided = load_decided_of(&mut *conn, &followers).await?;
            let read_at = tokio::time::Instant::now();
            Ok(reads
                .iter()
                .map(|r| {
                    let state = match states.get(&r.master) {
                        Some(Ok(state)) => state.clone(),
                        Some(Err(e)) => {
                            return Err(format!(
                                "master {}'s published state: {}",
                                r.master,
                                crate::db::describe(e)
                            ));
                        }
                        None => None,
                    };
                    Ok(ReconcileBasis {
                        state,
                        master_funds: funds.get(&r.master).copied().unwrap_or_default(),
                        bases: bases.get(&r.follower).cloned().unwrap_or_default(),
                        decided: decided.get(&r.follower).cloned().unwrap_or_default(),
                        read_at,
                    })
                })
                .collect())
        })
    }
}

/// One follower's copies as the ledgers record them: what it ever copied
/// ([`super::ledger::copied`]) and the pending copies it ever placed
/// ([`super::ledger::placed_of`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerRead {
    pub follower: i64,
    pub server: String,
    pub login: String,
}

/// What a [`LedgerRead`] found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LedgerRows {
    pub copied: Vec<super::ledger::Copied>,
    pub placed: Vec<super::ledger::Placed>,
}

/// The node's reader of what its followers ever copied and placed: two statements a batch, on
/// one connection.
pub type LedgerReader = BatchWriter<LedgerRead>;

impl Batched for LedgerRead {
    type Outcome = LedgerRows;
    const WHAT: &'static str = "copy ledger reader";
    const MAX: usize = 1000;
    const ALONE_WHEN_REFUSED: bool = false;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        reads: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>> {
        Box::pin(async move {
            let keys: Vec<LedgerKey> = reads
                .iter()
                .map(|r| (r.follower, r.server.clone(), r.login.clone()))
                .collect();
            let copied = super::ledger::copied_of(conn, &keys).await?;
            let placed = super::ledger::placed_of(conn, &keys).await?;
            Ok(keys
                .iter()
                .map(|k| LedgerRows {
                    copied: copied.get(k).cloned().unwrap_or_default(),
                    placed: placed.get(k).cloned().unwrap_or_default(),
                })
                .collect())
        })
    }
}

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

use sqlx::postgres::PgRow;

use super::accounts::{FUNDS_SQL, funds_from};
use super::decisions::{BASES_SQL, DECIDED_SQL, bases_from, decided_from};
use super::ledger::{COPIED_SQL, LedgerKey, PLACED_SQL, copied_from, key_columns, placed_from};
use super::master::{MASTER_STATES_SQL, master_states_from};
use super::{Funds, MasterState};
use crate::db::batch::{BatchWriter, Batched};
use crate::db::together::{bigints, fetch_each, texts, with_literals};
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

/// The node's reader of its followers' reconcile reads: four statements a batch, sent as one
/// message ([`crate::db::together`]), however many followers and masters it holds (up to 1,000
/// reads).
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
            let masters = bigints(&distinct(|r| r.master));
            let followers = bigints(&distinct(|r| r.follower));
            let statements = [
                with_literals(MASTER_STATES_SQL, |_| masters.clone()),
                with_literals(FUNDS_SQL, |_| masters.clone()),
                with_literals(BASES_SQL, |_| followers.clone()),
                with_literals(DECIDED_SQL, |_| followers.clone()),
            ];
            let [states, funds, bases, decided]: [Vec<PgRow>; 4] = fetch_each(conn, &statements)
                .await?
                .try_into()
                .expect("fetch_each answers each statement");
            let read_at = tokio::time::Instant::now();
            let states = master_states_from(&states)?;
            let funds = funds_from(&funds)?;
            let bases = bases_from(&bases)?;
            let decided = decided_from(&decided)?;
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

/// The node's reader of what its followers ever copied and placed: two statements a batch, sent
/// as one message on one connection.
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
            let (followers, servers, logins) = key_columns(&keys);
            let columns = |n: usize| match n {
                1 => bigints(&followers),
                2 => texts(&servers),
                3 => texts(&logins),
                other => unreachable!("the ledger reads have no parameter ${other}"),
            };
            let statements = [
                with_literals(COPIED_SQL, columns),
                with_literals(PLACED_SQL, columns),
            ];
            let [copied, placed]: [Vec<PgRow>; 2] = fetch_each(conn, &statements)
                .await?
                .try_into()
                .expect("fetch_each answers each statement");
            let copied = copied_from(&copied)?;
            let placed = placed_from(&placed)?;
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

//! Every statement of the copy engine, one module per concern: account rows ([`accounts`]),
//! links ([`links`]), the master's fenced publication ([`master`]), the follower's fenced
//! records ([`decisions`]) and what its reconcile reads, batched ([`reconcile`]).
//!
//! Fenced writes to tables other than `trading_accounts` lock the account row `FOR SHARE` (the
//! batched ones, the copy ledger's and the masters' events, `FOR KEY SHARE`: renewals never wait
//! for them) and match `node_id = $me AND owner_epoch = $epoch` in the same statement: under READ
//! COMMITTED a concurrent claim (`FOR UPDATE SKIP LOCKED`) either skips the row while this
//! statement holds it or is seen by it, so a node that lost the account to another writes
//! nothing. (Under `FOR KEY SHARE` the owner's own renewal, release or re-epoch does not wait for
//! a batch in flight: its rows may commit just after, fenced by the epoch they were written
//! under; a newer epoch's (epoch, seq) and the ledger's keys keep them from overwriting it.)

use std::collections::HashMap;

pub mod accounts;
pub mod decisions;
pub mod ledger;
pub mod links;
pub mod master;
pub mod reconcile;
pub mod risk;

pub use accounts::{
    AccountRead, AccountReader, AccountRow, AccountRowAsked, Funds, Role, account_funds,
    accounts_funds, load_account, load_accounts, still_owned,
};
pub use decisions::{
    load_bases, load_bases_of, load_decided, load_decided_of, record_base, record_decision,
};
pub use links::{
    FollowerLinks, LinksRead, LinksReader, RemovedLink, forget_removed_link, load_links,
    read_followers_links,
};
pub use master::{
    FirstSeen, MasterPublisher, MasterState, MasterStateRead, MasterStateReader, PublishWrite,
    Published, announced, master_state, master_states, publish, publish_many, stamp_first_seen,
};
pub use reconcile::{
    LedgerRead, LedgerReader, LedgerRows, ReconcileBasis, ReconcileRead, ReconcileReader,
};
pub use risk::{Saved, save_risk_state};

/// Rows of a batched read gathered by whom they belong to (a follower, a ledger key): what each
/// one asked for, in the collection it reads as.
pub(crate) fn grouped<K, V, C>(rows: impl IntoIterator<Item = (K, V)>) -> HashMap<K, C>
where
    K: std::hash::Hash + Eq,
    C: Default + Extend<V>,
{
    let mut out: HashMap<K, C> = HashMap::new();
    for (key, value) in rows {
        out.entry(key).or_default().extend([value]);
    }
    out
}

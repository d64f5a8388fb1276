//! The FIX adapter's ledger, as the adapter sees it: a trait, so that the adapter never touches
//! the database. The node implements it over its database ([`crate::brokers`], the one module
//! that knows both the adapters and the database); every method is one statement of
//! `crate::db::fix`, named the same and documented there.

use std::fmt;

use crate::future::BoxFuture;
use crate::model::fix::{Entry, EntryFill, Fill, FixOrder, FixPosition, Working, Writer};

/// A ledger statement failed; the text says why (never a secret: database errors are described
/// without their connection string).
#[derive(Debug, Clone, PartialEq)]
pub struct LedgerError(pub String);

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a ledger statement returns.
pub type Result<T> = std::result::Result<T, LedgerError>;

/// Where the FIX adapter records its orders and positions, so that any later owner of the
/// account reads them (see `migrations/0008_fix_ledger.sql`).
pub trait Ledger: Send + Sync + fmt::Debug {
    /// Records an order about to be sent, fenced by `w`; false: not to be sent.
    fn record_order<'a>(&'a self, w: &'a Writer, o: &'a FixOrder) -> BoxFuture<'a, Result<bool>>;
    /// The order recorded under a ClOrdID, with its state.
    fn order<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<(FixOrder, String)>>>;
    /// Orders whose outcome is not known yet, oldest first.
    fn unresolved(&self, account_id: i64) -> BoxFuture<'_, Result<Vec<FixOrder>>>;
    /// Completes an order: filled, or refused with a reason.
    fn complete_order<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        outcome: std::result::Result<Fill, &'a str>,
    ) -> BoxFuture<'a, Result<()>>;
    /// Sets an order's state, from one of `from`.
    fn set_state<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        from: &'a [&'a str],
        state: &'a str,
    ) -> BoxFuture<'a, Result<()>>;
    /// The account's resting orders in force.
    fn working(&self, account_id: i64) -> BoxFuture<'_, Result<Vec<Working>>>;
    /// Removes an order that never left.
    fn forget_order<'a>(&'a self, account_id: i64, cl_ord_id: &'a str)
    -> BoxFuture<'a, Result<()>>;
    /// Every position of the account the ledger knows.
    fn positions(&self, account_id: i64) -> BoxFuture<'_, Result<Vec<FixPosition>>>;
    /// Records a position seen open.
    fn seen_open<'a>(&'a self, account_id: i64, p: &'a FixPosition) -> BoxFuture<'a, Result<()>>;
    /// Records a position gone.
    fn seen_closed(
        &self,
        account_id: i64,
        position_id: i64,
        close_price: Option<f64>,
    ) -> BoxFuture<'_, Result<()>>;
    /// Records an entry order, fenced by `w`; false: not to be sent.
    fn record_entry<'a>(&'a self, w: &'a Writer, e: &'a Entry) -> BoxFuture<'a, Result<bool>>;
    /// The entry order recorded under a ClOrdID.
    fn entry<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<Entry>>>;
    /// The account's entry orders in force or without an outcome.
    fn entries(&self, account_id: i64) -> BoxFuture<'_, Result<Vec<Entry>>>;
    /// The venue accepted an entry order as `ticket`.
    fn entry_working<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        ticket: i64,
    ) -> BoxFuture<'a, Result<()>>;
    /// The venue replaced entry order `old` by `new`.
    fn entry_replaced<'a>(
        &'a self,
        account_id: i64,
        old: &'a str,
        new: &'a str,
        ticket: i64,
    ) -> BoxFuture<'a, Result<()>>;
    /// An entry order's stops for the position it opens.
    fn entry_stops<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        sl: Option<f64>,
        tp: Option<f64>,
    ) -> BoxFuture<'a, Result<()>>;
    /// An entry order filled, opening a position.
    fn entry_filled<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        fill: EntryFill<'a>,
    ) -> BoxFuture<'a, Result<()>>;
}

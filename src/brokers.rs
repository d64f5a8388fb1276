//! Where account sessions get their brokers: [`BrokerConnector`] is the seam (tests wrap it to
//! inject broker faults), [`Brokers`] the node's implementation: one [`BridgeClient`] per trade
//! server (`host:port` from the account row), shared by every account session of the node on
//! that server. Servers written `fix://...` get a [`FixBroker`] (one FIX session per account),
//! whose ledger is [`DbLedger`]: the FIX adapter's [`Ledger`] over the node's database. This is
//! the one module that knows both the adapters and the database.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::broker::Broker;
use crate::broker::client::BridgeClient;
use crate::broker::fix::ledger::{self, LedgerError};
use crate::broker::fix::{FixBroker, FixEndpoint, Ledger};
use crate::db::{self, Db};
use crate::future::BoxFuture;
use crate::model::fix::{Entry, EntryFill, Fill, FixOrder, FixPosition, Working, Writer};

/// Gives account sessions a broker for a server address.
pub trait BrokerConnector: Send + Sync + std::fmt::Debug {
    /// The broker at `server` (connected in the background on first use).
    fn broker(&self, server: &str) -> Arc<dyn Broker>;
    /// Closes every connection (at shutdown).
    fn close_all(&self);
}

/// Connections by server address, opened on first use and kept for the node's lifetime.
#[derive(Debug)]
pub struct Brokers {
    node_id: String,
    clients: Mutex<HashMap<String, BridgeClient>>,
    /// The FIX adapter's ledger, in the node's database.
    ledger: Option<Arc<dyn Ledger>>,
}

impl Brokers {
    pub fn new(node_id: impl Into<String>) -> Self {
        Brokers {
            node_id: node_id.into(),
            clients: Mutex::new(HashMap::new()),
            ledger: None,
        }
    }

    /// Brokers that can also log in accounts on `fix://` servers (their ledger is in `pool`).
    pub fn with_database(mut self, pool: Db) -> Self {
        self.ledger = Some(Arc::new(DbLedger(pool)));
        self
    }

    /// The connection to `server`, opened (in the background) if this is its first use.
    pub fn client(&self, server: &str) -> BridgeClient {
        let mut clients = self.clients.lock().expect("broker registry");
        clients
            .entry(server.to_string())
            .or_insert_with(|| BridgeClient::connect(server, self.node_id.clone()))
            .clone()
    }
}

impl BrokerConnector for Brokers {
    fn broker(&self, server: &str) -> Arc<dyn Broker> {
        if FixEndpoint::is_fix(server) {
            // One QuickFIX session per account: nothing to share between accounts.
            return Arc::new(FixBroker::new(server, &self.node_id, self.ledger.clone()));
        }
        Arc::new(self.client(server))
    }

    fn close_all(&self) {
        for client in self.clients.lock().expect("broker registry").values() {
            client.close();
        }
    }
}

/// The FIX adapter's ledger in the node's database: each method one statement of [`db::fix`].
#[derive(Debug)]
pub struct DbLedger(pub Db);

fn described(e: sqlx::Error) -> LedgerError {
    LedgerError(db::describe(&e))
}

impl Ledger for DbLedger {
    fn record_order<'a>(
        &'a self,
        w: &'a Writer,
        o: &'a FixOrder,
    ) -> BoxFuture<'a, ledger::Result<bool>> {
        Box::pin(async move {
            db::fix::record_order(&self.0, w, o)
                .await
                .map_err(described)
        })
    }
    fn order<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
    ) -> BoxFuture<'a, ledger::Result<Option<(FixOrder, String)>>> {
        Box::pin(async move {
            db::fix::order(&self.0, account_id, cl_ord_id)
                .await
                .map_err(described)
        })
    }
    fn unresolved(&self, account_id: i64) -> BoxFuture<'_, ledger::Result<Vec<FixOrder>>> {
        Box::pin(async move {
            db::fix::unresolved(&self.0, account_id)
                .await
                .map_err(described)
        })
    }
    fn complete_order<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        outcome: Result<Fill, &'a str>,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::complete_order(&self.0, account_id, cl_ord_id, outcome)
                .await
                .map_err(described)
        })
    }
    fn set_state<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        from: &'a [&'a str],
        state: &'a str,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::set_state(&self.0, account_id, cl_ord_id, from, state)
                .await
                .map_err(described)
        })
    }
    fn working(&self, account_id: i64) -> BoxFuture<'_, ledger::Result<Vec<Working>>> {
        Box::pin(async move {
            db::fix::working(&self.0, account_id)
                .await
                .map_err(described)
        })
    }
    fn forget_order<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::forget_order(&self.0, account_id, cl_ord_id)
                .await
                .map_err(described)
        })
    }
    fn positions(&self, account_id: i64) -> BoxFuture<'_, ledger::Result<Vec<FixPosition>>> {
        Box::pin(async move {
            db::fix::positions(&self.0, account_id)
                .await
                .map_err(described)
        })
    }
    fn seen_open<'a>(
        &'a self,
        account_id: i64,
        p: &'a FixPosition,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::seen_open(&self.0, account_id, p)
                .await
                .map_err(described)
        })
    }
    fn seen_closed(
        &self,
        account_id: i64,
        position_id: i64,
        close_price: Option<f64>,
    ) -> BoxFuture<'_, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::seen_closed(&self.0, account_id, position_id, close_price)
                .await
                .map_err(described)
        })
    }
    fn record_entry<'a>(
        &'a self,
        w: &'a Writer,
        e: &'a Entry,
    ) -> BoxFuture<'a, ledger::Result<bool>> {
        Box::pin(async move {
            db::fix::record_entry(&self.0, w, e)
                .await
                .map_err(described)
        })
    }
    fn entry<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
    ) -> BoxFuture<'a, ledger::Result<Option<Entry>>> {
        Box::pin(async move {
            db::fix::entry(&self.0, account_id, cl_ord_id)
                .await
                .map_err(described)
        })
    }
    fn entries(&self, account_id: i64) -> BoxFuture<'_, ledger::Result<Vec<Entry>>> {
        Box::pin(async move {
            db::fix::entries(&self.0, account_id)
                .await
                .map_err(described)
        })
    }
    fn entry_working<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        ticket: i64,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::entry_working(&self.0, account_id, cl_ord_id, ticket)
                .await
                .map_err(described)
        })
    }
    fn entry_replaced<'a>(
        &'a self,
        account_id: i64,
        old: &'a str,
        new: &'a str,
        ticket: i64,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::entry_replaced(&self.0, account_id, old, new, ticket)
                .await
                .map_err(described)
        })
    }
    fn entry_stops<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        sl: Option<f64>,
        tp: Option<f64>,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::entry_stops(&self.0, account_id, cl_ord_id, sl, tp)
                .await
                .map_err(described)
        })
    }
    fn entry_filled<'a>(
        &'a self,
        account_id: i64,
        cl_ord_id: &'a str,
        fill: EntryFill<'a>,
    ) -> BoxFuture<'a, ledger::Result<()>> {
        Box::pin(async move {
            db::fix::entry_filled(&self.0, account_id, cl_ord_id, fill)
                .await
                .map_err(described)
        })
    }
}

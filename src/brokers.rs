//! Where account sessions get their brokers: [`BrokerConnector`] is the seam (tests wrap it to
//! inject broker faults), [`Brokers`] the node's implementation: one [`BridgeClient`] per trade
//! server (`host:port` from the account row), shared by every account session of the node on
//! that server. Servers written `fix://...` get a [`FixBroker`] (one FIX session per account).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::broker::Broker;
use crate::broker::client::BridgeClient;
use crate::broker::fix::{FixBroker, FixEndpoint};

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
    /// The FIX adapter's ledger lives in the node's database.
    pool: Option<crate::db::Db>,
}

impl Brokers {
    pub fn new(node_id: impl Into<String>) -> Self {
        Brokers {
            node_id: node_id.into(),
            clients: Mutex::new(HashMap::new()),
            pool: None,
        }
    }

    /// Brokers that can also log in accounts on `fix://` servers (their ledger is in `pool`).
    pub fn with_database(mut self, pool: crate::db::Db) -> Self {
        self.pool = Some(pool);
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
            return Arc::new(FixBroker::new(server, &self.node_id, self.pool.clone()));
        }
        Arc::new(self.client(server))
    }

    fn close_all(&self) {
        for client in self.clients.lock().expect("broker registry").values() {
            client.close();
        }
    }
}

//! The node's broker connections: one [`BridgeClient`] per trade server (`host:port` from the
//! account row), shared by every account session of the node on that server.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::broker::client::BridgeClient;

/// Connections by server address, opened on first use and kept for the node's lifetime.
#[derive(Debug)]
pub struct Brokers {
    node_id: String,
    clients: Mutex<HashMap<String, BridgeClient>>,
}

impl Brokers {
    pub fn new(node_id: impl Into<String>) -> Self {
        Brokers {
            node_id: node_id.into(),
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// The connection to `server`, opened (in the background) if this is its first use.
    pub fn get(&self, server: &str) -> BridgeClient {
        let mut clients = self.clients.lock().expect("broker registry");
        clients
            .entry(server.to_string())
            .or_insert_with(|| BridgeClient::connect(server, self.node_id.clone()))
            .clone()
    }

    /// Closes every connection.
    pub fn close_all(&self) {
        for client in self.clients.lock().expect("broker registry").values() {
            client.close();
        }
    }
}

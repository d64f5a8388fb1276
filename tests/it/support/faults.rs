//! A broker connector that injects broker faults into a node's sessions: positions and history
//! reads that come back empty (a glitch), and order replies that are lost after the order was
//! executed.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use copier_node::broker::types::{
    AccountInfo, AmendOrder, CancelOrder, CloseFill, CloseOrder, ClosedPosition, ModifyOrder,
    OpenFill, OpenOrder, PendingOrder, PlaceOrder, Position, SymbolSpec,
};
use copier_node::broker::{
    AccountLogin, BoxFuture, Broker, BrokerError, RejectCode, Rejection, Session, TradeApi,
};
use copier_node::brokers::{BrokerConnector, Brokers};

/// Which logins misbehave, and how.
#[derive(Debug, Default)]
pub struct Faults {
    /// Positions and history reads of these logins come back empty.
    pub empty_reads: Mutex<HashSet<String>>,
    /// History reads of these logins come back empty (a broker that keeps no history).
    pub no_history: Mutex<HashSet<String>>,
    /// The next open of these logins is executed, but its reply is lost (once per login).
    pub lose_open_reply: Mutex<HashSet<String>>,
    /// Orders whose reply was lost.
    pub lost_replies: Mutex<Vec<String>>,
    /// These logins' bridges refuse the `orders` request (older than pending orders).
    pub no_orders: Mutex<HashSet<String>>,
    /// The next pending order placed for these logins is executed, but its reply is lost.
    pub lose_place_reply: Mutex<HashSet<String>>,
}

impl Faults {
    pub fn set_empty_reads(&self, login: &str, on: bool) {
        let mut set = self.empty_reads.lock().unwrap();
        if on {
            set.insert(login.to_string());
        } else {
            set.remove(login);
        }
    }
}

#[derive(Debug)]
pub struct FaultyBrokers {
    inner: Brokers,
    pub faults: Arc<Faults>,
}

impl FaultyBrokers {
    pub fn new(node_id: &str) -> Arc<FaultyBrokers> {
        Arc::new(FaultyBrokers {
            inner: Brokers::new(node_id),
            faults: Arc::new(Faults::default()),
        })
    }
}

impl BrokerConnector for FaultyBrokers {
    fn broker(&self, server: &str) -> Arc<dyn Broker> {
        Arc::new(FaultyBroker {
            inner: Arc::new(self.inner.client(server)),
            faults: self.faults.clone(),
        })
    }

    fn close_all(&self) {
        self.inner.close_all();
    }
}

struct FaultyBroker {
    inner: Arc<dyn Broker>,
    faults: Arc<Faults>,
}

impl Broker for FaultyBroker {
    fn login<'a>(
        &'a self,
        account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Session, BrokerError>> {
        Box::pin(async move {
            let session = self.inner.login(account).await?;
            let api = Arc::new(FaultyApi {
                inner: session.api,
                login: account.login.clone(),
                faults: self.faults.clone(),
            });
            Ok(Session {
                api,
                events: session.events,
                account: session.account,
                ahead: session.ahead,
            })
        })
    }
}

struct FaultyApi {
    inner: Arc<dyn TradeApi>,
    login: String,
    faults: Arc<Faults>,
}

impl FaultyApi {
    fn empty(&self) -> bool {
        self.faults
            .empty_reads
            .lock()
            .unwrap()
            .contains(&self.login)
    }
}

impl TradeApi for FaultyApi {
    fn positions(&self) -> BoxFuture<'_, Result<Vec<Position>, BrokerError>> {
        Box::pin(async move {
            if self.empty() {
                Ok(Vec::new())
            } else {
                self.inner.positions().await
            }
        })
    }
    fn history(&self) -> BoxFuture<'_, Result<Vec<ClosedPosition>, BrokerError>> {
        Box::pin(async move {
            let forgets = self.faults.no_history.lock().unwrap().contains(&self.login);
            if self.empty() || forgets {
                Ok(Vec::new())
            } else {
                self.inner.history().await
            }
        })
    }
    fn account(&self) -> BoxFuture<'_, Result<AccountInfo, BrokerError>> {
        self.inner.account()
    }
    fn symbols(&self) -> BoxFuture<'_, Result<Vec<SymbolSpec>, BrokerError>> {
        self.inner.symbols()
    }
    fn open(&self, order: OpenOrder) -> BoxFuture<'_, Result<OpenFill, BrokerError>> {
        Box::pin(async move {
            let lose = self
                .faults
                .lose_open_reply
                .lock()
                .unwrap()
                .remove(&self.login);
            let result = self.inner.open(order.clone()).await;
            if lose && result.is_ok() {
                self.faults
                    .lost_replies
                    .lock()
                    .unwrap()
                    .push(order.comment.clone());
                return Err(BrokerError::Unknown("reply lost (injected)".into()));
            }
            result
        })
    }
    fn close(&self, order: CloseOrder) -> BoxFuture<'_, Result<CloseFill, BrokerError>> {
        self.inner.close(order)
    }
    fn modify(&self, order: ModifyOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.modify(order)
    }
    fn places_orders(&self) -> bool {
        self.inner.places_orders()
    }
    fn logout(&self) -> BoxFuture<'_, ()> {
        self.inner.logout()
    }
    fn orders(&self) -> BoxFuture<'_, Result<Vec<PendingOrder>, BrokerError>> {
        Box::pin(async move {
            if self.faults.no_orders.lock().unwrap().contains(&self.login) {
                return Err(BrokerError::Rejected(Rejection::new(
                    RejectCode::InvalidRequest,
                    "unknown op orders (injected)",
                )));
            }
            self.inner.orders().await
        })
    }
    fn place(&self, order: PlaceOrder) -> BoxFuture<'_, Result<i64, BrokerError>> {
        Box::pin(async move {
            let lose = self
                .faults
                .lose_place_reply
                .lock()
                .unwrap()
                .remove(&self.login);
            let result = self.inner.place(order.clone()).await;
            if lose && result.is_ok() {
                self.faults
                    .lost_replies
                    .lock()
                    .unwrap()
                    .push(order.comment.clone());
                return Err(BrokerError::Unknown("reply lost (injected)".into()));
            }
            result
        })
    }
    fn amend(&self, order: AmendOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.amend(order)
    }
    fn cancel(&self, order: CancelOrder) -> BoxFuture<'_, Result<(), BrokerError>> {
        self.inner.cancel(order)
    }
}

//! The FIX 4.4 adapter: accounts whose `server` is `fix://host:port?...` trade over a FIX session
//! (the session layer is QuickFIX's, see [`engine`]); everything else speaks the bridge protocol.
//!
//! An account's server names the venue and its session identity:
//!
//! ```text
//! fix://host:port?target=VENUE[&sender=COMPID][&sub=SUBID][&heartbeat=30][&updates=drop_copy|subscribe|poll][&poll_ms=1000]
//! ```
//!
//! SenderCompID is `sender` (default: the account's login), TargetCompID is `target`; Username
//! (553) is the login and Password (554) the decrypted credentials. The node id goes in every
//! message as SenderSubID (50), or as SenderLocationID (142) when the account has its own `sub`.
//!
//! Orders: market NewOrderSingle (D) with ClOrdID = the intent's client order id (a retry after a
//! definitive rejection appends `~2`, `~3`: a venue remembers rejected ClOrdIDs too), OrderQty in
//! units (lots times the contract size from the venue's SecurityList), a price limit as a limit
//! order with TimeInForce IOC. Closes and trims name the position with PosMaintRptID (721) and
//! take the opposite side (cTrader's convention for hedging accounts). Every order is written to
//! the ledger (`fix_orders`, fenced by the owner's epoch) before it is sent, and completed from its
//! ExecutionReport; an order whose report never came is resolved by OrderStatusRequest (H) before
//! the account's positions are read, so a new owner finds out from the ledger and the venue, never
//! by guessing. Positions come from RequestForPositions (AN/AP); their copy markers from the
//! ledger (`fix_positions`), which also keeps the closes that are the account's history.

pub mod engine;
pub mod ledger;
pub mod msg;
mod session;

use std::collections::HashMap;
use std::time::Duration;

use super::{AccountLogin, BoxFuture, Broker, BrokerError, RejectCode, Rejection, Session};
pub use ledger::Ledger;

/// How the master's trades reach the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Updates {
    /// ExecutionReports of other sessions' trades (drop copy), as the venue sends them.
    DropCopy,
    /// RequestForPositions with SubscriptionRequestType=1: the venue pushes PositionReports.
    Subscribe,
    /// RequestForPositions every `poll_ms`.
    Poll,
}

/// A parsed `fix://` server.
#[derive(Debug, Clone, PartialEq)]
pub struct FixEndpoint {
    pub host: String,
    pub port: u16,
    pub target: String,
    pub sender: Option<String>,
    pub sub: Option<String>,
    pub heartbeat_secs: u16,
    pub updates: Updates,
    pub poll: Duration,
    pub request_timeout: Duration,
}

impl FixEndpoint {
    /// True for servers this adapter handles.
    pub fn is_fix(server: &str) -> bool {
        server.starts_with("fix://")
    }

    /// Parses `fix://host:port?target=...`; the error names what is wrong.
    pub fn parse(server: &str) -> Result<FixEndpoint, String> {
        let rest = server
            .strip_prefix("fix://")
            .ok_or_else(|| format!("{server:?} is not a fix:// server"))?;
        let (address, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (host, port) = address
            .rsplit_once(':')
            .ok_or_else(|| format!("{server:?}: expected fix://host:port?target=..."))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("{server:?}: port {port:?} is not a port number"))?;
        if host.is_empty() {
            return Err(format!("{server:?}: no host"));
        }
        let mut params: HashMap<&str, &str> = HashMap::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| format!("{server:?}: {pair:?} is not key=value"))?;
            if params.insert(k, v).is_some() {
                return Err(format!("{server:?}: {k} given twice"));
            }
        }
        let text = |k: &str| {
            params
                .get(k)
                .map(|v| v.to_string())
                .filter(|v| !v.is_empty())
        };
        let number = |k: &str, default: u64| -> Result<u64, String> {
            params.get(k).map_or(Ok(default), |v| {
                v.parse()
                    .map_err(|_| format!("{server:?}: {k}={v} is not a whole number"))
            })
        };
        let target = text("target")
            .ok_or_else(|| format!("{server:?}: target=<TargetCompID> is required"))?;
        let heartbeat = number("heartbeat", 30)?;
        if !(1..=3600).contains(&heartbeat) {
            return Err(format!("{server:?}: heartbeat must be 1..3600 seconds"));
        }
        let updates = match params.get("updates").copied().unwrap_or("drop_copy") {
            "drop_copy" => Updates::DropCopy,
            "subscribe" => Updates::Subscribe,
            "poll" => Updates::Poll,
            other => {
                return Err(format!(
                    "{server:?}: updates={other} (expected drop_copy, subscribe or poll)"
                ));
            }
        };
        let known = [
            "target",
            "sender",
            "sub",
            "heartbeat",
            "updates",
            "poll_ms",
            "timeout_ms",
        ];
        if let Some(k) = params.keys().find(|k| !known.contains(k)) {
            return Err(format!(
                "{server:?}: unknown parameter {k} (known: {})",
                known.join(", ")
            ));
        }
        Ok(FixEndpoint {
            host: host.to_string(),
            port,
            target,
            sender: text("sender"),
            sub: text("sub"),
            heartbeat_secs: heartbeat as u16,
            updates,
            poll: Duration::from_millis(number("poll_ms", 1000)?.max(50)),
            request_timeout: Duration::from_millis(number("timeout_ms", 10_000)?.max(100)),
        })
    }
}

/// A FIX venue: logs accounts in, one QuickFIX session each.
#[derive(Debug, Clone)]
pub struct FixBroker {
    server: String,
    endpoint: Result<FixEndpoint, String>,
    node_id: String,
    ledger: Option<std::sync::Arc<dyn Ledger>>,
}

impl FixBroker {
    /// The venue at `server`, its sessions recording their orders in `ledger` (none: FIX
    /// logins are refused, naming the server).
    pub fn new(
        server: &str,
        node_id: &str,
        ledger: Option<std::sync::Arc<dyn Ledger>>,
    ) -> FixBroker {
        FixBroker {
            server: server.to_string(),
            endpoint: FixEndpoint::parse(server),
            node_id: node_id.to_string(),
            ledger,
        }
    }
}

impl Broker for FixBroker {
    fn login<'a>(
        &'a self,
        account: &'a AccountLogin,
    ) -> BoxFuture<'a, Result<Session, BrokerError>> {
        Box::pin(async move {
            let refuse =
                |why: String| BrokerError::Rejected(Rejection::new(RejectCode::Rejected, why));
            let endpoint = self.endpoint.clone().map_err(refuse)?;
            let ledger = self.ledger.clone().ok_or_else(|| {
                refuse(format!(
                    "{}: FIX accounts need the node's database (the order ledger)",
                    self.server
                ))
            })?;
            let (Some(account_id), Some(epoch)) = (account.account_id, account.fence) else {
                return Err(refuse(format!(
                    "{}: a FIX login needs the account id and its epoch",
                    self.server
                )));
            };
            session::login(session::LoginArgs {
                endpoint,
                ledger,
                node_id: self.node_id.clone(),
                account_id,
                epoch,
                login: account.login.clone(),
                password: account.password.clone(),
            })
            .await
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_parse_with_defaults_and_errors_name_the_problem() {
        let e = FixEndpoint::parse(
            "fix://venue.example:9876?target=CSERVER&sub=desk1&updates=subscribe",
        )
        .unwrap();
        assert_eq!((e.host.as_str(), e.port), ("venue.example", 9876));
        assert_eq!(e.target, "CSERVER");
        assert_eq!(e.sub.as_deref(), Some("desk1"));
        assert_eq!(e.sender, None);
        assert_eq!(e.heartbeat_secs, 30);
        assert_eq!(e.updates, Updates::Subscribe);
        for (bad, says) in [
            ("fix://h:1", "target"),
            ("fix://h?target=X", "host:port"),
            ("fix://h:99999?target=X", "port"),
            ("fix://h:1?target=X&colour=red", "colour"),
            ("fix://h:1?target=X&updates=push", "updates"),
            ("fix://h:1?target=X&heartbeat=0", "heartbeat"),
        ] {
            let err = FixEndpoint::parse(bad).unwrap_err();
            assert!(err.contains(says), "{bad}: {err}");
        }
        assert!(FixEndpoint::is_fix("fix://h:1"));
        assert!(!FixEndpoint::is_fix("127.0.0.1:5000"));
    }
}

//! The simulated trade server (docs/design/bridge-protocol.md): a networked stand-in for MT4/MT5 trade servers
//! that many node processes share, and the impartial witness of every order any node sent.
//!
//! | module | owns |
//! | --- | --- |
//! | [`market`] | symbols, prices (fixed, or a deterministic walk), volume and stop rules |
//! | [`book`] | accounts, positions, history, fences, executed client order ids; every change as a record |
//! | [`journal`] | one JSON line per order request and login, flushed before the reply |
//! | [`store`] | `--state`: records appended and replayed across restarts |
//! | [`server`] | TCP, the bridge protocol, position streams |
//! | [`tools`] | the hand tools: `trade`, `positions`, `history` |

pub mod book;
pub mod journal;
pub mod market;
pub mod server;
pub mod store;
pub mod tools;

pub use server::{ServeOptions, SimBroker};

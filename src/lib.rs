//! # copier-node
//!
//! The headless node of a cloud trade copier. N identical replicas share the trading accounts of
//! one platform through two columns on the account row (`node_id`, `lease_until`) and one
//! `FOR UPDATE SKIP LOCKED` statement per lease cycle; no coordination service, no per-node
//! configuration.
//!
//! ## Crate map
//!
//! | module | owns |
//! | --- | --- |
//! | [`cli`], [`commands`] | the command line, and one module per command returning a typed error that maps to the exit codes in one place (`main.rs` only dispatches) |
//! | [`config`] | the layered configuration (file < env < flags), every problem reported at once with its key |
//! | [`secret`] | the type of every secret (database URLs, broker credentials): never printed |
//! | [`credentials`] | broker credentials encrypted at rest (ChaCha20-Poly1305), decrypted only by the session that logs in |
//! | [`telemetry`] | text or JSON log lines; every line carries `node_id`, and `account_id` where it concerns one |
//! | [`app`] | wiring: waits for the database, checks migrations, starts the tasks below, runs until shutdown |
//! | [`db`] | connection bounds, embedded migrations, and every SQL statement, one module per concern |
//! | [`lease`] | the lease loop: the cycle, fair share ([`lease::balance`]), membership |
//! | [`trust`], [`gate`] | the pure trust computation, and the per-(account, epoch) gate every order passes |
//! | [`node_state`] | the node as the lease loop publishes it to health, metrics and tests |
//! | [`supervisor`] | one task per owned (account, epoch): start on claim, stop on loss, release after stop |
//! | [`handoff`] | prepared fair-share hand-offs: the offer, the receiver's login ahead of the claim, the fence raise |
//! | [`account`], [`session`] | the account task, and the context it and the copy engine's sessions act through (gate, epoch, fenced writes, broker login) |
//! | [`model`] | the data layers share without depending on one another: master positions, markers, events, links, risk limits, the FIX ledger's rows, a trade's side and currency |
//! | `future` | the one boxed-future type trait objects return |
//! | [`copier`] | the copy engine: master sessions publish events, follower sessions apply and reconcile; pure copy rules |
//! | [`channels`] | every NOTIFY channel and the codec of its payload |
//! | [`hub`] | the node's one LISTEN connection: release announcements, master events and link changes, fanned out |
//! | [`brokers`] | one broker connection per trade server, shared by the node's sessions |
//! | [`http`], [`metrics`] | `/healthz`, `/readyz`, `/metrics` on `http_listen`; the node's Prometheus registry |
//! | [`status_writer`] | batched status writes fenced by (node, epoch); reports rows found lost |
//! | [`retry`] | the one backoff, and the named bounds of every retrying place |
//! | [`shutdown`] | SIGTERM / SIGINT |
//! | [`broker`] | the broker adapter (the only way to a trade server), its types, and the bridge-protocol client |
//! | [`sim_broker`] | the simulated trade server, its journal and hand tools |
//! | [`bridge_check`] | the conformance kit for bridges: a scripted session against any server of the bridge protocol, each check passed or failed |
//! | [`sim`] | the deterministic simulator of the lease protocol, and its database model (proven against PostgreSQL by a differential test) |
//! | [`pgtmp`] | throwaway PostgreSQL clusters, and the server the demo and benchmarks run on |
//! | [`failpoints`] | fault-injection points for the fault suite (the `failpoints` feature only) |
//! | [`cluster_status`], [`demo`] | `copier-node status` and `copier-node demo` |
//!
//! ## Layers
//!
//! Each module imports only from modules of lower layers: no import cycle, no upward or sideways
//! edge. The layering test (`tests/it/layering.rs`) reads this table and the lines below it, and
//! every `crate::` path of `src/` outside test modules, and fails on any edge they forbid; change
//! the table, not the test, when the design changes.
//!
//! | layer | modules |
//! | --- | --- |
//! | 0 | `model`, `future`, `secret`, `trust`, `retry`, `wall_clock`, `failpoints`, `shutdown` |
//! | 1 | `channels`, `gate` |
//! | 2 | `db`, `broker` |
//! | 3 | `brokers`, `credentials`, `node_state`, `status_writer`, `hub`, `sim_broker`, `bridge_check`, `cluster_status`, `pgtmp` |
//! | 4 | `config`, `metrics` |
//! | 5 | `session`, `telemetry`, `http` |
//! | 6 | `copier`, `handoff` |
//! | 7 | `account` |
//! | 8 | `supervisor` |
//! | 9 | `lease` |
//! | 10 | `app`, `sim` |
//! | 11 | `demo`, `cli` |
//! | 12 | `commands` |
//!
//! Never, whatever the layers: `lease` -> `copier`; `lease` -> `broker`; `supervisor` -> `copier`;
//! `supervisor` -> `broker`.
//!
//! So storage knows no copy rule and no adapter (`db` and `broker` share a layer: neither imports
//! the other; the FIX adapter reaches its ledger through [`broker::fix::Ledger`], which
//! [`brokers`] implements over `db`), the data every layer shares ([`model`]: positions, events,
//! links, risk limits, the FIX ledger's rows, a side, a currency) depends on nothing of the
//! crate, and the lease core reaches accounts only through the supervisor's tasks.
//!
//! ## How a claimed lease becomes a running account session
//!
//! 1. Every cycle the lease loop reads a monotonic `t0`, then runs one statement
//!    ([`db::lease::cycle`]) that renews the node's membership and its rows and claims free or
//!    expired rows up to its capacity, each claim with a fresh `owner_epoch` from a global
//!    sequence. The same statement watches the database itself: on a new WAL timeline (a
//!    failover that may have lost the last commits) it claims nothing for a grace of one lease
//!    and keeps only the rows whose gates stayed open.
//! 2. When the statement is acknowledged, the supervisor gets the rows the node owns. Rows no
//!    longer owned (or owned at a new epoch) have their gates closed first; rows still owned at
//!    the same epoch get the deadline `t0 + lease - fence`; new (account, epoch) pairs get a new
//!    gate and a new task.
//! 3. The task logs in to its broker with the epoch as the fence and runs the master or follower
//!    session ([`copier`]); it sends orders only while [`gate::AccountGate::holds`] says
//!    so, fences every write with its epoch, and reconciles after its trust lapsed and came back.
//! 4. On release (disable, shutdown) the gate closes, the task finishes its work in flight, and
//!    only then is the row released and the release announced, so peers claim at once.

#![warn(unreachable_pub)]

// Private by default. Public, for the binary (`cli`, `commands`), the integration tests and the
// benchmarks (separate crates): the node's entry points (`app`, `config`, `lease`), the database
// statements they drive directly (`db`, `channels`), the copy engine's data and rules they check
// against (`copier`), the broker adapter and the simulated broker with its tools (`broker`,
// `brokers`, `sim_broker`), the bridges' conformance kit (`bridge_check`), `credentials`, `hub`, the throwaway clusters (`pgtmp`) and the
// simulator's database model (`sim`, proven against PostgreSQL by a differential test).
pub(crate) mod account;
pub mod app;
pub mod bridge_check;
pub mod broker;
pub mod brokers;
pub mod channels;
pub mod cli;
pub(crate) mod cluster_status;
pub mod commands;
pub mod config;
pub mod copier;
pub mod credentials;
pub mod db;
pub(crate) mod demo;
pub(crate) mod failpoints;
pub(crate) mod future;
pub(crate) mod gate;
pub mod handoff;
pub(crate) mod http;
pub mod hub;
pub mod lease;
pub(crate) mod metrics;
pub mod model;
pub(crate) mod node_state;
pub mod pgtmp;
pub(crate) mod retry;
pub(crate) mod secret;
pub(crate) mod session;
pub(crate) mod shutdown;
pub mod sim;
pub mod sim_broker;
pub(crate) mod status_writer;
pub(crate) mod supervisor;
pub(crate) mod telemetry;
pub(crate) mod trust;
pub mod wall_clock;

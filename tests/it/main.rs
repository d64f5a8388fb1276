//! One integration test binary: the lease statements, whole nodes in-process, and the real
//! binary as separate processes, all against a real PostgreSQL (see `support::pg`).

mod balance;
mod binary;
mod bridge_check;
mod broker;
mod copy;
mod copy_rules;
mod credentials;
mod decisions;
mod docs;
mod failover;
mod faults;
mod fix_copy;
mod fix_venue;
mod handoff;
mod hardening;
mod layering;
mod lease_sql;
mod ledger;
mod manage;
mod master_stream;
mod model;
mod mt4;
mod nodes;
mod operate;
mod partial_closes;
mod pending_rules;
mod pooler;
mod read_ahead;
mod suite;
mod support;

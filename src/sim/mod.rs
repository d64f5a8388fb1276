//! The deterministic simulator of the lease protocol (issue 18), so far its database model: the
//! one permitted stand-in for PostgreSQL, proven against the real statements by a differential
//! test (`tests/it/model.rs`).

pub mod db;
mod lost_tail;

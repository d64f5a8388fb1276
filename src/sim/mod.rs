//! The deterministic simulator of the lease protocol (issue 18): the production lease core and
//! supervisor driven over simulated time ([`world`]), with the database model ([`db`]), the one
//! permitted stand-in for PostgreSQL, proven against the real statements by a differential test
//! (`tests/it/model.rs`).

pub mod db;
pub mod world;

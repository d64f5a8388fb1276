//! The operator commands' statements (`copier-node accounts`, `links`, `risk`, `why`): the rows
//! operators manage, read and written here so that the commands only check input and print.
//! Each change that the commands make in one transaction takes a `&mut PgConnection` the
//! caller's transaction derefs to.

pub mod accounts;
pub mod links;
pub mod risk;
pub mod why;

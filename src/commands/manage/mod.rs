//! The operator commands on the rows nodes act on, without SQL: `accounts`, `links`, `risk`,
//! `why` and `copies`, a module each. They check input and print; every statement is in
//! [`crate::db::admin`]. A change is one transaction, checked as the node checks the row (a link
//! is read back through the node's own parser before the transaction commits), and a refusal
//! exits 2 naming the field (`field: what is wrong`).

mod accounts;
mod copies;
mod links;
mod risk;
mod why;

pub(super) use accounts::accounts;
pub(super) use copies::copies;
pub(super) use links::links;
pub(super) use risk::risk;
pub(super) use why::why;

use serde::Serialize;
use sqlx::PgConnection;

use super::{CommandError, load};
use crate::cli::ManageArgs;
use crate::config::Config;
use crate::db;

/// The configuration (with `extra` flags) and a connection to its database.
async fn connect(
    manage: &ManageArgs,
    extra: Vec<(&'static str, Option<String>)>,
) -> Result<(Config, PgConnection), CommandError> {
    let mut flags = manage.db.flags();
    flags.extend(extra);
    let (config, _) = load(manage.db.config.as_deref(), &flags, false)?;
    let conn = db::admin_connect(&config.database_url).await?;
    Ok((config, conn))
}

/// A statement's failure about `what`: a constraint the schema enforces is a usage error (the
/// commands check what they can first, so this is rare), anything else a failure.
fn sql(what: &str) -> impl FnOnce(sqlx::Error) -> CommandError + '_ {
    move |e| {
        if let sqlx::Error::Database(d) = &e
            && (d.is_check_violation() || d.is_foreign_key_violation() || d.is_unique_violation())
        {
            // The duplicates an operator can make, named by the field (the database's own
            // message names a constraint).
            let refusal = match d.constraint() {
                Some("trading_accounts_pkey") => "id: an account with this id exists already",
                Some("copy_links_master_id_follower_id_key") => {
                    "master and follower: a link between these accounts exists already (links list)"
                }
                _ => {
                    return CommandError::usage(format!(
                        "{what}: refused by the schema: {}",
                        d.message()
                    ));
                }
            };
            return CommandError::usage(format!("{what}: {refusal}"));
        }
        CommandError::failed(format!("{what}: {}", db::describe(&e)))
    }
}

/// Prints a list: one JSON array, or a line each.
fn print<T: Serialize + std::fmt::Display>(json: bool, items: &[T]) {
    if json {
        println!("{}", serde_json::to_string(items).expect("serialises"));
    } else {
        for i in items {
            println!("{i}");
        }
    }
}

/// Prints one item: one JSON object, or its line.
fn print_one<T: Serialize + std::fmt::Display>(json: bool, item: &T) {
    if json {
        println!("{}", serde_json::to_string(item).expect("serialises"));
    } else {
        println!("{item}");
    }
}

/// Refuses every problem at once (each names its field), or passes.
fn refuse(problems: Vec<String>) -> Result<(), CommandError> {
    if problems.is_empty() {
        Ok(())
    } else {
        Err(CommandError::usage(problems.join("\n")))
    }
}

/// "`kind` `id`: no such `kind`", the refusal of a row that does not exist.
fn no_such(kind: &str, id: i64) -> CommandError {
    CommandError::usage(format!("{kind} {id}: no such {kind}"))
}

/// A limit given on the command line: a number, or `none` (lifted).
fn limit<T: std::str::FromStr>(
    name: &str,
    v: &Option<String>,
    problems: &mut Vec<String>,
) -> Option<Option<T>> {
    let text = v.as_deref()?;
    if text == "none" {
        return Some(None);
    }
    match text.parse::<T>() {
        Ok(n) => Some(Some(n)),
        Err(_) => {
            problems.push(format!("{name}: {text:?} is not a number (or `none`)"));
            None
        }
    }
}

/// A `max_open_copies` given on the command line (a link's or a follower's): 1 to the column's
/// largest integer, or `none`.
fn open_copies_limit(v: &Option<String>, problems: &mut Vec<String>) -> Option<Option<i64>> {
    let limit = limit::<i64>("max_open_copies", v, problems);
    if let Some(Some(n)) = limit
        && !(1..=i64::from(i32::MAX)).contains(&n)
    {
        problems.push(format!("max_open_copies: {n} must be 1 to {}", i32::MAX));
    }
    limit
}

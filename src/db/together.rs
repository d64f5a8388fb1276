//! Several statements sent as one message: one round trip for all of them.
//!
//! A statement with bound parameters (the extended protocol, as `sqlx::query` sends it) takes a
//! round trip of its own, and a reader that makes four statements per batch waits for four, each
//! behind the node's other work when the machine is busy (measured on a hand-off's receiver: a
//! batch of the followers' links took 6 ms for its four statements while the node claimed and
//! started sessions). Sent as one simple-protocol message ([`fetch_each`]), the statements run one
//! after the other in one implicit transaction on the server and come back together.
//!
//! The simple protocol takes no parameters, so each is written into the statement as a literal
//! ([`with_literals`]): numbers as digits, text as escape strings ([`text`], [`texts`]), never
//! anything read back as SQL. The lease cycle behind a transaction pooler is sent the same way
//! ([`crate::db::lease::cycle_on`]).

use sqlx::postgres::PgRow;
use sqlx::{Either, PgConnection};

/// `sql` with each parameter `$n` replaced by `literal(n)`, in one pass, so that nothing written
/// in is read again as a parameter (a `$` not followed by digits is kept).
pub fn with_literals(sql: &str, literal: impl Fn(usize) -> String) -> String {
    let mut out = String::with_capacity(sql.len() + 64);
    let mut rest = sql;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let digits = rest[at + 1..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len() - at - 1);
        match rest[at + 1..at + 1 + digits].parse::<usize>() {
            Ok(n) => out.push_str(&literal(n)),
            Err(_) => out.push('$'),
        }
        rest = &rest[at + 1 + digits..];
    }
    out.push_str(rest);
    out
}

/// A text literal: an escape string, whatever `standard_conforming_strings` says.
pub fn text(s: &str) -> String {
    format!("(E'{}'::text)", escaped(s))
}

/// A `bigint[]` literal.
pub fn bigints(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("('{{{}}}'::int8[])", items.join(","))
}

/// A `text[]` literal, each element an escape string.
pub fn texts<S: AsRef<str>>(v: &[S]) -> String {
    let items: Vec<String> = v
        .iter()
        .map(|s| format!("E'{}'", escaped(s.as_ref())))
        .collect();
    format!("(ARRAY[{}]::text[])", items.join(","))
}

fn escaped(s: &str) -> String {
    s.replace('\\', "\\\\").replace('\'', "''")
}

/// Runs `statements` (each with its parameters written in: [`with_literals`]) as one message,
/// and returns each one's rows, in order. The rows come in the text format, which every column
/// type the readers use decodes from. One statement failing fails them all (they run in one
/// implicit transaction).
pub async fn fetch_each(
    conn: &mut PgConnection,
    statements: &[String],
) -> Result<Vec<Vec<PgRow>>, sqlx::Error> {
    use futures_util::TryStreamExt;

    let sql = statements.join(";\n");
    let mut sets: Vec<Vec<PgRow>> = vec![Vec::new()];
    let mut results = sqlx::raw_sql(&sql).fetch_many(conn);
    while let Some(item) = results.try_next().await? {
        match item {
            // A statement completed: the next one's rows follow.
            Either::Left(_) => sets.push(Vec::new()),
            Either::Right(row) => sets.last_mut().expect("a set is always open").push(row),
        }
    }
    sets.pop();
    if sets.len() != statements.len() {
        return Err(sqlx::Error::Protocol(format!(
            "{} statements sent together, {} completed",
            statements.len(),
            sets.len()
        )));
    }
    Ok(sets)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_are_written_once_and_nothing_written_in_is_read_again() {
        let sql = with_literals("SELECT $1, $2, $10, '$', $1x", |n| match n {
            1 => text("it's $2 \\"),
            2 => bigints(&[1, -2]),
            10 => texts(&["a'b", "$1"]),
            other => unreachable!("no ${other}"),
        });
        assert_eq!(
            sql,
            r"SELECT (E'it''s $2 \\'::text), ('{1,-2}'::int8[]), (ARRAY[E'a''b',E'$1']::text[]), '$', (E'it''s $2 \\'::text)x"
        );
        assert_eq!(bigints(&[]), "('{}'::int8[])");
        assert_eq!(texts::<&str>(&[]), "(ARRAY[]::text[])");
    }
}

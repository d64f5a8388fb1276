//! Account rows as sessions read them: the connection (role, server, login, credentials), the
//! funds a master's owner last wrote, and whether a (node, epoch) still owns a row.

use std::collections::HashMap;

use sqlx::{PgConnection, Row};

use crate::db::batch::{BatchWriter, Batched};
use crate::future::BoxFuture;
use crate::model::named::named;
use crate::model::trade::Currency;
use crate::secret::Secret;

named! {
    /// An account's role (`trading_accounts.role`).
    pub enum Role as "role" {
        Master = "master": "its positions are copied",
        Follower = "follower": "it copies its masters' positions",
    }
}

/// An account row as its session needs it. `credentials` never reaches a log line.
#[derive(Debug, Clone)]
pub struct AccountRow {
    pub id: i64,
    pub role: Role,
    pub server: String,
    pub login: String,
    pub credentials: Option<Secret>,
    /// The masters the account's copy links named when the row was read (none for a master): a
    /// follower's session subscribes to them and reads their snapshots beside its links.
    pub masters: Vec<i64>,
}

/// Reads an account row. A role other than `master` or `follower` (the schema's CHECK forbids
/// one) is an error naming the account.
pub async fn load_account(
    conn: &mut PgConnection,
    id: i64,
) -> Result<Option<AccountRow>, sqlx::Error> {
    load_accounts(conn, &[id])
        .await?
        .remove(&id)
        .transpose()
        .map_err(|e| sqlx::Error::Decode(e.into()))
}

/// [`load_account`] of many accounts in one statement: each row read, or why it cannot be (a
/// role the session cannot run fails that account alone); an account whose row is gone is
/// absent.
pub async fn load_accounts(
    conn: &mut PgConnection,
    ids: &[i64],
) -> Result<HashMap<i64, Result<AccountRow, String>>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT a.id, a.role, a.server, a.login, a.credentials,
                ARRAY(SELECT DISTINCT l.master_id FROM copy_links l WHERE l.follower_id = a.id)
                    AS masters
           FROM trading_accounts a WHERE a.id = ANY($1)",
    )
    .bind(ids)
    .fetch_all(conn)
    .await?;
    rows.iter()
        .map(|r| {
            let id: i64 = r.try_get("id")?;
            let role: String = r.try_get("role")?;
            let role = match role.as_str() {
                "master" => Role::Master,
                "follower" => Role::Follower,
                other => {
                    return Ok((
                        id,
                        Err(format!(
                            "account {id} has role {other:?}; expected master or follower"
                        )),
                    ));
                }
            };
            Ok((
                id,
                Ok(AccountRow {
                    id,
                    role,
                    server: r.try_get("server")?,
                    login: r.try_get("login")?,
                    credentials: r
                        .try_get::<Option<String>, _>("credentials")?
                        .map(Secret::new),
                    masters: r.try_get("masters")?,
                }),
            ))
        })
        .collect()
}

/// An account row read by the node's [`AccountReader`].
#[derive(Debug, Clone, Copy)]
pub struct AccountRead(pub i64);

/// The account rows the node's sessions read as they start (and a prepared hand-off's receiver
/// as it logs in ahead), in batches, in background turns of the pool: a node claiming or
/// receiving thousands of accounts at once reads their rows in a few statements instead of one
/// statement and one pooled connection each.
pub type AccountReader = BatchWriter<AccountRead>;

/// An account row asked of the [`AccountReader`], its outcome still to come.
pub type AccountRowAsked = crate::db::batch::Submitted<<AccountRead as Batched>::Outcome>;

impl Batched for AccountRead {
    /// The row, `None` when it is gone, or why it cannot be run (that account's alone).
    type Outcome = Result<Option<AccountRow>, String>;
    const WHAT: &'static str = "account reader";
    const MAX: usize = 1000;
    const ALONE_WHEN_REFUSED: bool = false;

    fn write_batch<'a>(
        conn: &'a mut PgConnection,
        reads: &'a [Self],
    ) -> BoxFuture<'a, Result<Vec<Self::Outcome>, sqlx::Error>> {
        Box::pin(async move {
            let ids: Vec<i64> = reads.iter().map(|r| r.0).collect();
            let rows = load_accounts(conn, &ids).await?;
            Ok(reads
                .iter()
                .map(|r| match rows.get(&r.0) {
                    Some(Ok(row)) => Ok(Some(row.clone())),
                    Some(Err(e)) => Err(e.clone()),
                    None => Ok(None),
                })
                .collect())
        })
    }
}

/// An account's money figures as its owner last reported them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Funds {
    pub balance: Option<f64>,
    pub equity: Option<f64>,
    pub currency: Option<Currency>,
}

/// An account's balance, equity and currency as its owner last reported them (`None` each when
/// not reported yet, or the row is gone).
pub async fn account_funds(conn: &mut PgConnection, id: i64) -> Result<Funds, sqlx::Error> {
    Ok(accounts_funds(conn, &[id])
        .await?
        .remove(&id)
        .unwrap_or_default())
}

/// [`account_funds`] of many accounts in one statement (an account whose row is gone is absent).
pub async fn accounts_funds(
    conn: &mut PgConnection,
    ids: &[i64],
) -> Result<HashMap<i64, Funds>, sqlx::Error> {
    let rows = sqlx::query(FUNDS_SQL).bind(ids).fetch_all(conn).await?;
    funds_from(&rows)
}

/// [`accounts_funds`]' statement: $1 the accounts' ids (`bigint[]`).
pub(super) const FUNDS_SQL: &str =
    "SELECT id, balance, equity, currency FROM trading_accounts WHERE id = ANY($1::bigint[])";

/// What [`FUNDS_SQL`]'s rows say.
pub(super) fn funds_from(
    rows: &[sqlx::postgres::PgRow],
) -> Result<HashMap<i64, Funds>, sqlx::Error> {
    rows.iter()
        .map(|r| {
            Ok((
                r.try_get("id")?,
                Funds {
                    balance: r.try_get("balance")?,
                    equity: r.try_get("equity")?,
                    // A malformed code is refused by the column's check; unreadable reads as
                    // unknown.
                    currency: r
                        .try_get::<Option<String>, _>("currency")?
                        .and_then(|c| c.parse().ok()),
                },
            ))
        })
        .collect()
}

/// True while (node, epoch) owns account `id`.
pub async fn still_owned(
    conn: &mut PgConnection,
    node_id: &str,
    id: i64,
    epoch: i64,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar("SELECT EXISTS (SELECT FROM trading_accounts WHERE id = $1 AND node_id = $2 AND owner_epoch = $3)")
        .bind(id)
        .bind(node_id)
        .bind(epoch)
        .fetch_one(conn)
        .await
}

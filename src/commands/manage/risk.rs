//! `copier-node risk ...`: a follower's drawdown limits added, listed, reset and removed.

use sqlx::PgConnection;

use super::{CommandError, connect, no_such, print, print_one, sql};
use crate::cli::RiskCommand;
use crate::db::admin::accounts;
use crate::db::admin::risk::{self as rows, LimitView, NewLimit};
use crate::model::named::Named;
use crate::model::risk::{Basis, Period, RiskAction};

impl std::fmt::Display for LimitView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "limit {} of account {}: {} {} drawdown {}{}, {}; {}",
            self.id,
            self.account_id,
            self.period,
            self.basis,
            self.amount,
            if self.relative { " %" } else { "" },
            self.action,
            match (&self.hit_reason, &self.period_key, self.start_value) {
                (Some(reason), _, _) => format!(
                    "REACHED at {}: {reason}",
                    self.hit_at.as_deref().unwrap_or("?")
                ),
                (None, Some(key), Some(start)) => format!("clear in {key} (started at {start})"),
                _ => "not started (the owner's next reading starts it)".to_string(),
            }
        )
    }
}

pub(crate) async fn risk(command: RiskCommand) -> Result<(), CommandError> {
    match command {
        RiskCommand::Add(args) => {
            let mut problems = Vec::new();
            let period = Period::parse(&args.period);
            if period.is_none() {
                problems.push(Period::refusal(&args.period));
            }
            let basis = Basis::parse(&args.basis);
            if basis.is_none() {
                problems.push(Basis::refusal(&args.basis));
            }
            let action = RiskAction::parse(&args.action);
            if action.is_none() {
                problems.push(RiskAction::refusal(&args.action));
            }
            let amount = match (args.percent, args.amount) {
                (Some(p), None) if p > 0.0 && p <= 100.0 => Some((true, p)),
                (None, Some(a)) if a > 0.0 && a.is_finite() => Some((false, a)),
                (Some(p), None) => {
                    problems.push(format!("percent: {p} must be above 0 and at most 100"));
                    None
                }
                (None, Some(a)) => {
                    problems.push(format!("amount: {a} must be above 0"));
                    None
                }
                _ => {
                    problems.push("percent or amount: give one of them".to_string());
                    None
                }
            };
            let (Some(period), Some(basis), Some(action), Some((relative, amount))) =
                (period, basis, action, amount)
            else {
                return Err(CommandError::usage(problems.join("\n")));
            };
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("risk limit of account {}", args.account);
            match accounts::role_and_server(&mut conn, args.account)
                .await
                .map_err(sql(&what))?
            {
                None => return Err(no_such("account", args.account)),
                Some((_, server)) if server.starts_with("fix://") => {
                    return Err(CommandError::usage(format!(
                        "account {} trades over FIX, whose adapter reads no balance or equity: a risk limit could never be judged there",
                        args.account
                    )));
                }
                Some((role, _)) if role != "follower" => {
                    return Err(CommandError::usage(format!(
                        "account {} is a {role}: risk limits apply to followers",
                        args.account
                    )));
                }
                Some(_) => {}
            }
            let limit = NewLimit {
                account_id: args.account,
                period,
                basis,
                relative,
                amount,
                action,
            };
            match rows::add(&mut conn, &limit).await.map_err(sql(&what))? {
                Ok(id) => show_one(&mut conn, args.account, id, args.manage.json).await,
                Err(existing) => Err(CommandError::usage(format!(
                    "period and basis: account {} has a {} {} limit already (limit {existing}); one per period and basis (risk remove {existing} first)",
                    args.account,
                    period.as_str(),
                    basis.as_str()
                ))),
            }
        }
        RiskCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let limits = rows::list(&mut conn, args.account, None)
                .await
                .map_err(sql("risk limits"))?;
            print(args.manage.json, &limits);
            Ok(())
        }
        RiskCommand::Reset(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let what = format!("risk limits of account {}", args.account);
            if rows::reset(&mut conn, args.account, args.limit)
                .await
                .map_err(sql(&what))?
                == 0
            {
                return Err(CommandError::usage(format!("{what}: no such limit")));
            }
            match args.limit {
                Some(id) => show_one(&mut conn, args.account, id, args.manage.json).await,
                None => {
                    let limits = rows::list(&mut conn, Some(args.account), None)
                        .await
                        .map_err(sql(&what))?;
                    print(args.manage.json, &limits);
                    Ok(())
                }
            }
        }
        RiskCommand::Remove(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            if !rows::remove(&mut conn, args.id)
                .await
                .map_err(sql(&format!("risk limit {}", args.id)))?
            {
                return Err(CommandError::usage(format!(
                    "risk limit {}: no such limit",
                    args.id
                )));
            }
            if args.manage.json {
                println!("{}", serde_json::json!({ "removed": args.id }));
            } else {
                println!("risk limit {} removed", args.id);
            }
            Ok(())
        }
    }
}

/// Prints limit `id` of `account` (one object with `--json`).
async fn show_one(
    conn: &mut PgConnection,
    account: i64,
    id: i64,
    json: bool,
) -> Result<(), CommandError> {
    let limit = rows::list(conn, Some(account), Some(id))
        .await
        .map_err(sql("risk limits"))?
        .into_iter()
        .next()
        .ok_or_else(|| CommandError::usage(format!("risk limit {id}: no such limit")))?;
    print_one(json, &limit);
    Ok(())
}

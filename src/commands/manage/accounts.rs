//! `copier-node accounts ...`: add, list, show, set, disable and remove trading accounts.

use std::time::Duration;

use sqlx::{Connection, PgConnection};

use super::{CommandError, connect, no_such, open_copies_limit, print, print_one, refuse, sql};
use crate::broker::fix::FixEndpoint;
use crate::cli::{AccountFields, AccountsCommand};
use crate::config::Config;
use crate::db::admin::accounts::{self as rows, AccountChange, AccountView, NewAccount};

impl std::fmt::Display for AccountView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "account {}: {} {} {} login {} on {}{}; owner {}; status {}",
            self.id,
            self.platform,
            self.role,
            if self.enabled { "enabled" } else { "disabled" },
            self.login,
            self.server,
            if self.has_password {
                " (password stored)"
            } else {
                ""
            },
            self.owner.as_deref().unwrap_or("none"),
            self.status.as_deref().unwrap_or("-"),
        )?;
        if let Some(c) = &self.currency {
            write!(f, "; currency {c}")?;
        }
        if let Some(n) = self.max_open_copies {
            write!(f, "; max_open_copies {n}")?;
        }
        Ok(())
    }
}

/// Every problem of an account's fields, each naming its field.
fn check_account(fields: &AccountFields, adding: bool) -> Vec<String> {
    let mut problems = Vec::new();
    let need = |v: &Option<String>, name: &str, problems: &mut Vec<String>| {
        if adding && v.as_deref().is_none_or(str::is_empty) {
            problems.push(format!("{name}: required (--{name})"));
        }
    };
    need(&fields.platform, "platform", &mut problems);
    need(&fields.role, "role", &mut problems);
    need(&fields.server, "server", &mut problems);
    need(&fields.login, "login", &mut problems);
    if let Some(role) = &fields.role
        && role != "master"
        && role != "follower"
    {
        problems.push(format!("role: {role:?} is neither master nor follower"));
    }
    if !adding && fields.platform.as_deref() == Some("") {
        problems.push("platform: empty".into());
    }
    if !adding && fields.login.as_deref() == Some("") {
        problems.push("login: empty".into());
    }
    if let Some(server) = &fields.server {
        if FixEndpoint::is_fix(server) {
            if let Err(e) = FixEndpoint::parse(server) {
                problems.push(format!("server: {e}"));
            }
        } else {
            let ok = server
                .rsplit_once(':')
                .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok());
            if !ok {
                problems.push(format!(
                    "server: {server:?} is neither host:port nor fix://host:port?target=..."
                ));
            }
        }
    }
    problems
}

/// The password from standard input, encrypted with the configured key.
fn read_password(config: &Config) -> Result<String, CommandError> {
    let key = config.credentials_key.clone().ok_or_else(|| {
        CommandError::usage(
            "password: storing one needs a credentials key: set COPIER_CREDENTIALS_KEY or `credentials_key_file`",
        )
    })?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).map_err(|e| {
        CommandError::failed(format!("password: cannot read it from standard input: {e}"))
    })?;
    let password = line.trim_end_matches(['\n', '\r']);
    if password.is_empty() {
        return Err(CommandError::usage(
            "password: none on standard input (--password-stdin)",
        ));
    }
    Ok(key.encrypt(password))
}

/// The configuration (with the command's credentials key file) and a connection, and the
/// password read from standard input when asked for.
async fn connect_with_password(
    manage: &crate::cli::ManageArgs,
    fields: &AccountFields,
) -> Result<(PgConnection, Option<String>), CommandError> {
    let (config, conn) = connect(
        manage,
        vec![("credentials_key_file", fields.credentials_key_file.clone())],
    )
    .await?;
    let credentials = if fields.password_stdin {
        Some(read_password(&config)?)
    } else {
        None
    };
    Ok((conn, credentials))
}

pub(crate) async fn accounts(command: AccountsCommand) -> Result<(), CommandError> {
    match command {
        AccountsCommand::Add(args) => {
            refuse(check_account(&args.fields, true))?;
            let (mut conn, credentials) = connect_with_password(&args.manage, &args.fields).await?;
            let f = &args.fields;
            let account = NewAccount {
                id: args.id,
                platform: f.platform.as_deref().unwrap_or_default(),
                role: f.role.as_deref().unwrap_or_default(),
                server: f.server.as_deref().unwrap_or_default(),
                login: f.login.as_deref().unwrap_or_default(),
                credentials,
                enabled: !args.disabled,
            };
            rows::add(&mut conn, &account)
                .await
                .map_err(sql(&format!("account {}", args.id)))?;
            show(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::List(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            let views = rows::list(&mut conn, args.platform.as_deref())
                .await
                .map_err(sql("listing accounts"))?;
            print(args.manage.json, &views);
            Ok(())
        }
        AccountsCommand::Show(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            show(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Set(args) => {
            let mut problems = check_account(&args.fields, false);
            let max_open_copies = open_copies_limit(&args.max_open_copies, &mut problems);
            refuse(problems)?;
            let (mut conn, credentials) = connect_with_password(&args.manage, &args.fields).await?;
            let f = &args.fields;
            let what = format!("account {}", args.id);
            let mut tx = conn.begin().await.map_err(sql(&what))?;
            rows::lock(&mut tx, args.id).await.map_err(sql(&what))?;
            if let Some(role) = &f.role {
                let links = rows::links_in_other_role(&mut tx, args.id, role)
                    .await
                    .map_err(sql(&what))?;
                if !links.is_empty() {
                    return Err(CommandError::usage(format!(
                        "role: account {} is in copy links {links:?} as the other role; remove them first",
                        args.id
                    )));
                }
            }
            let change = AccountChange {
                platform: f.platform.as_deref(),
                role: f.role.as_deref(),
                server: f.server.as_deref(),
                login: f.login.as_deref(),
                credentials,
                clear_password: args.clear_password,
                enabled: args.enabled,
                max_open_copies,
            };
            if !rows::set(&mut tx, args.id, &change)
                .await
                .map_err(sql(&what))?
            {
                return Err(no_such("account", args.id));
            }
            tx.commit().await.map_err(sql(&what))?;
            show(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Disable(args) => {
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            if !rows::disable(&mut conn, args.id)
                .await
                .map_err(sql(&format!("account {}", args.id)))?
            {
                return Err(no_such("account", args.id));
            }
            show(&mut conn, args.id, args.manage.json).await
        }
        AccountsCommand::Remove(args) => {
            let wait = crate::config::parse_duration(&args.wait)
                .map_err(|e| CommandError::usage(format!("wait: {e}")))?;
            let (_, mut conn) = connect(&args.manage, vec![]).await?;
            remove(&mut conn, args.id, wait).await?;
            if args.manage.json {
                println!("{}", serde_json::json!({ "removed": args.id }));
            } else {
                println!("account {} removed", args.id);
            }
            Ok(())
        }
    }
}

async fn show(conn: &mut PgConnection, id: i64, json: bool) -> Result<(), CommandError> {
    let view = rows::get(conn, id)
        .await
        .map_err(sql(&format!("account {id}")))?
        .ok_or_else(|| no_such("account", id))?;
    print_one(json, &view);
    Ok(())
}

/// Deletes an account no node trades: one a node owns is disabled and deleted once its owner
/// released it (the delete itself matches only a row without a live owner), or refused after
/// `wait`; one with copy links is refused.
async fn remove(conn: &mut PgConnection, id: i64, wait: Duration) -> Result<(), CommandError> {
    let what = format!("account {id}");
    let links = rows::links_of(conn, id).await.map_err(sql(&what))?;
    if !links.is_empty() {
        return Err(CommandError::usage(format!(
            "account {id} is in copy links {links:?}: remove them first (copier-node links remove <id>)"
        )));
    }
    let deadline = tokio::time::Instant::now() + wait;
    let mut disabled = false;
    loop {
        if rows::delete_if_untraded(conn, id)
            .await
            .map_err(sql(&what))?
        {
            return Ok(());
        }
        let Some(owner) = rows::owner(conn, id).await.map_err(sql(&what))? else {
            return Err(no_such("account", id));
        };
        if !disabled {
            rows::disable(conn, id).await.map_err(sql(&what))?;
            disabled = true;
            eprintln!(
                "account {id} is traded by node {}: disabled it; waiting up to {wait:?} for the release",
                owner.as_deref().unwrap_or("?")
            );
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(CommandError::failed(format!(
                "account {id} is still owned by node {} after {wait:?}: it is disabled and was not deleted; run remove again once it is released",
                owner.as_deref().unwrap_or("?")
            )));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

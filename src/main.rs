//! The thin edge: parse the command line, load the configuration, start telemetry, run the
//! command until it finishes or a shutdown signal arrives, and report the error chain.

use std::process::ExitCode;

use clap::Parser;
use copier_node::cli::{
    Cli, Command, CredentialsCommand, DbArgs, DemoArgs, RunArgs, SimBrokerCommand, StatusArgs,
    TradeAction,
};
use copier_node::config::{Config, Layers, LogFormat, parse_duration};
use copier_node::sim_broker::{ServeOptions, SimBroker};
use copier_node::telemetry::{self, Output};
use copier_node::{app, cluster_status, db, shutdown};

/// Exit code for configuration errors (as for command-line usage errors).
const EXIT_CONFIG: u8 = 2;
/// Exit code when the node id belongs to another live process: restarting cannot fix it.
const EXIT_NODE_ID: u8 = 3;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match cli.command {
        Command::Run(args) => runtime.block_on(run(*args)),
        Command::Migrate(args) => runtime.block_on(migrate(args)),
        Command::SimBroker(command) => runtime.block_on(sim_broker(command)),
        Command::Status(args) => runtime.block_on(status(args)),
        Command::Demo(args) => runtime.block_on(demo(args)),
        Command::Credentials(command) => runtime.block_on(credentials(command)),
    }
}

async fn credentials(command: CredentialsCommand) -> ExitCode {
    use copier_node::credentials::CredentialsKey;
    match command {
        CredentialsCommand::Rotate(args) => {
            let mut flags = args.db.flags();
            flags.push(("credentials_key_file", args.credentials_key_file.clone()));
            let (config, _) = match load(args.db.config.as_deref(), &flags) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let Some(key) = config.credentials_key.clone() else {
                eprintln!(
                    "error: no credentials key: set COPIER_CREDENTIALS_KEY (new key first: new,old) or `credentials_key_file`"
                );
                return ExitCode::from(EXIT_CONFIG);
            };
            match rotate_credentials(&config, &key, args.encrypt_plaintext).await {
                Ok(true) => ExitCode::SUCCESS,
                Ok(false) => ExitCode::FAILURE,
                Err(e) => {
                    eprintln!("error: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
        CredentialsCommand::Keygen => {
            println!("{}", CredentialsKey::generate().encode());
            ExitCode::SUCCESS
        }
        CredentialsCommand::Encrypt(args) => {
            let flags = [("credentials_key_file", args.credentials_key_file)];
            let key = Layers::load(args.config.as_deref(), std::env::vars(), &flags)
                .and_then(|l| l.credentials_key());
            let key = match key {
                Ok(Some(key)) => key,
                Ok(None) => {
                    eprintln!(
                        "error: no credentials key: set COPIER_CREDENTIALS_KEY or `credentials_key_file` (make a key with `copier-node credentials keygen`)"
                    );
                    return ExitCode::from(EXIT_CONFIG);
                }
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let mut line = String::new();
            if let Err(e) = std::io::stdin().read_line(&mut line) {
                eprintln!("error: cannot read the password from standard input: {e}");
                return ExitCode::FAILURE;
            }
            let password = line.strip_suffix('\n').unwrap_or(&line);
            let password = password.strip_suffix('\r').unwrap_or(password);
            if password.is_empty() {
                eprintln!(
                    "error: no password on standard input (an account without a password leaves `credentials` NULL)"
                );
                return ExitCode::from(EXIT_CONFIG);
            }
            println!("{}", key.encrypt(password));
            ExitCode::SUCCESS
        }
    }
}

async fn status(args: StatusArgs) -> ExitCode {
    use sqlx::{ConnectOptions, Connection};
    let (config, _) = match load(args.db.config.as_deref(), &args.db.flags()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init(config.log_format, Output::Stderr);
    let options = match db::admin_options(&config.database_url) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: invalid `database_url`: {}", db::describe(&e));
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let mut conn = match options.connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "error: cannot connect to the database: {}",
                db::describe(&e)
            );
            return ExitCode::FAILURE;
        }
    };
    let result = cluster_status::read(&mut conn).await;
    let _ = conn.close().await;
    match result {
        Ok(s) if args.json => {
            println!("{}", serde_json::to_string(&s).expect("status serialises"));
            ExitCode::SUCCESS
        }
        Ok(s) => {
            print!("{}", cluster_status::render_text(&s));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!(
                "error: reading the cluster's state failed: {} (is the database migrated? run `copier-node migrate`)",
                db::describe(&e)
            );
            ExitCode::FAILURE
        }
    }
}

async fn demo(args: DemoArgs) -> ExitCode {
    // The demo's own lines tell the story; the in-process broker's and database's log lines
    // would interleave with them, so only warnings show (RUST_LOG shows more).
    telemetry::init_with(LogFormat::Text, Output::Stderr, "warn");
    let duration = match args.duration.as_deref().map(parse_duration).transpose() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: invalid --duration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let options = copier_node::demo::DemoOptions {
        duration,
        json: args.json,
        ..Default::default()
    };
    match copier_node::demo::run(options, shutdown::signal_received()).await {
        Ok(summary)
            if summary.duplicates == 0
                && summary.missed_copies == 0
                && summary.missed_closes == 0 =>
        {
            ExitCode::SUCCESS
        }
        Ok(summary) => {
            eprintln!(
                "error: {} duplicate copies in the journal, {} missed copies, {} missed closes",
                summary.duplicates, summary.missed_copies, summary.missed_closes
            );
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn sim_broker(command: SimBrokerCommand) -> ExitCode {
    use copier_node::sim_broker::tools::{self, HandOrder};
    telemetry::init(LogFormat::Text, Output::Stderr);
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("error: {e}");
        ExitCode::FAILURE
    };
    match command {
        SimBrokerCommand::Serve(args) => {
            let price_walk = match args.price_walk.as_deref().map(parse_duration).transpose() {
                Ok(d) => d,
                Err(e) => {
                    eprintln!("error: invalid --price-walk: {e}");
                    return ExitCode::from(EXIT_CONFIG);
                }
            };
            let options = ServeOptions {
                listen: args.listen,
                journal: args.journal,
                state: args.state,
                fence_check: !args.no_fence_check,
                dedupe: !args.no_dedupe,
                reply_first: args.reply_first,
                balance: args.balance,
                balances: Default::default(),
                price_walk,
            };
            let server = match SimBroker::start(options).await {
                Ok(s) => s,
                Err(e) => return fail(&format!("{e:#}")),
            };
            shutdown::signal_received().await;
            server.stop().await;
            ExitCode::SUCCESS
        }
        SimBrokerCommand::Trade(args) => {
            let order = match args.action {
                TradeAction::Open {
                    symbol,
                    side,
                    volume,
                    sl,
                    tp,
                    magic,
                    comment,
                } => match side.parse() {
                    Ok(side) => HandOrder::Open {
                        symbol,
                        side,
                        volume,
                        sl,
                        tp,
                        magic,
                        comment,
                    },
                    Err(e) => {
                        eprintln!("error: {e}");
                        return ExitCode::from(EXIT_CONFIG);
                    }
                },
                TradeAction::Close { ticket, volume } => HandOrder::Close { ticket, volume },
                TradeAction::Modify { ticket, sl, tp } => HandOrder::Modify { ticket, sl, tp },
            };
            match tools::trade(&args.account.broker, &args.account.login, order).await {
                Ok(Some(ticket)) => {
                    println!("{ticket}");
                    ExitCode::SUCCESS
                }
                Ok(None) => ExitCode::SUCCESS,
                Err(e) => fail(&e),
            }
        }
        SimBrokerCommand::Positions(args) => {
            match tools::positions(&args.broker, &args.login).await {
                Ok(list) => print_lines(&list),
                Err(e) => fail(&e),
            }
        }
        SimBrokerCommand::History(args) => match tools::history(&args.broker, &args.login).await {
            Ok(list) => print_lines(&list),
            Err(e) => fail(&e),
        },
    }
}

fn print_lines<T: serde::Serialize>(items: &[T]) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for item in items {
        let line = serde_json::to_string(item).expect("broker types serialise");
        if writeln!(out, "{line}").is_err() {
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn load(
    config: Option<&std::path::Path>,
    flags: &[(&'static str, Option<String>)],
) -> Result<(Config, Vec<String>), ExitCode> {
    load_for(config, flags, false)
}

/// Loads the configuration; `node`: for `run`, which needs a platform too. Every problem is
/// reported at once, one per line.
fn load_for(
    config: Option<&std::path::Path>,
    flags: &[(&'static str, Option<String>)],
    node: bool,
) -> Result<(Config, Vec<String>), ExitCode> {
    let loaded = Layers::load(config, std::env::vars(), flags).and_then(|l| {
        let config = if node {
            l.resolve_node()?
        } else {
            l.resolve()?
        };
        Ok((config, l.ignored_env))
    });
    loaded.map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

async fn run(args: RunArgs) -> ExitCode {
    let (config, ignored) = match load_for(args.db.config.as_deref(), &args.flags(), true) {
        Ok(c) => c,
        Err(code) => return code,
    };
    if let Err(e) = config.node() {
        eprintln!("error: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    telemetry::init(config.log_format, Output::Stdout);
    for var in ignored {
        tracing::warn!(variable = %var, "ignoring environment variable: it names no configuration key");
    }
    let options = app::RunOptions {
        migrate: args.migrate,
        ..Default::default()
    };
    match app::run(config, options, shutdown::signal_received()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("error: {e:#}");
            if e.downcast_ref::<copier_node::lease::NodeError>().is_some() {
                ExitCode::from(EXIT_NODE_ID)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

async fn migrate(args: DbArgs) -> ExitCode {
    let (config, _) = match load(args.config.as_deref(), &args.flags()) {
        Ok(c) => c,
        Err(code) => return code,
    };
    telemetry::init(config.log_format, Output::Stderr);
    match migrate_database(&config).await {
        Ok(applied) if applied.is_empty() => {
            println!("no pending migrations");
            ExitCode::SUCCESS
        }
        Ok(applied) => {
            let list: Vec<String> = applied.iter().map(i64::to_string).collect();
            println!("applied migrations: {}", list.join(", "));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `credentials rotate`: every stored value to the current key. True if every value was read.
async fn rotate_credentials(
    config: &Config,
    key: &copier_node::credentials::CredentialsKey,
    encrypt_plaintext: bool,
) -> anyhow::Result<bool> {
    use anyhow::Context;
    use copier_node::config::Secret;
    use copier_node::credentials::{Reseal, reseal};
    use sqlx::{ConnectOptions, Connection};
    let options = db::admin_options(&config.database_url).context("invalid `database_url`")?;
    let mut conn = options
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", db::describe(&e)))?;
    let (mut current, mut resealed, mut encrypted, mut problems) = (0, 0, 0, 0);
    for (id, stored) in db::credentials::stored(&mut conn).await? {
        let (new, was_plaintext) = match reseal(
            key,
            &Secret::new(stored.clone()),
            encrypt_plaintext,
        ) {
            Reseal::Current => {
                current += 1;
                continue;
            }
            Reseal::Resealed(v) => (v, false),
            Reseal::Plaintext(Some(v)) => (v, true),
            Reseal::Plaintext(None) => {
                problems += 1;
                eprintln!(
                    "account {id}: the credentials are stored in plaintext (rerun with --encrypt-plaintext to encrypt them)"
                );
                continue;
            }
            Reseal::Unreadable(e) => {
                problems += 1;
                eprintln!("account {id}: {e}; left as it is");
                continue;
            }
        };
        if !db::credentials::replace(&mut conn, id, &stored, &new).await? {
            problems += 1;
            eprintln!(
                "account {id}: the value changed meanwhile; left as it is (run rotate again)"
            );
        } else if was_plaintext {
            encrypted += 1;
        } else {
            resealed += 1;
        }
    }
    let _ = conn.close().await;
    println!(
        "credentials: {resealed} re-encrypted with the current key, {encrypted} plaintext encrypted, {current} already current, {problems} left as they were"
    );
    Ok(problems == 0)
}

async fn migrate_database(config: &Config) -> anyhow::Result<Vec<i64>> {
    use anyhow::Context;
    use sqlx::{ConnectOptions, Connection};
    let options = db::admin_options(&config.database_url).context("invalid `database_url`")?;
    let mut conn = options
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot connect to the database: {}", db::describe(&e)))?;
    let applied = db::migrate::apply(&mut conn)
        .await
        .context("applying migrations")?;
    let _ = conn.close().await;
    Ok(applied)
}

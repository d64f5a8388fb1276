//! One module per command. Each returns `Result<(), CommandError>`; [`CommandError::exit_code`]
//! maps every error to the documented exit codes in one place:
//!
//! | code | meaning |
//! | --- | --- |
//! | 0 | done (for `run`: a clean stop, also one asked for while waiting for the database) |
//! | 1 | a runtime failure (the error chain is printed) |
//! | 2 | a configuration or usage error (every problem at once, each naming its key) |
//! | 3 | `run`: the node id belongs to another live process (restarting cannot fix it) |

mod bridge_check;
mod credentials;
mod demo;
mod manage;
mod migrate;
mod run;
mod sim_broker;
mod status;

use crate::cli::{Cli, Command};
use crate::config::{Config, ConfigError, Layers};

/// Why a command failed, and so its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    /// Bad configuration or usage: exit 2.
    #[error("{0}")]
    Config(String),
    /// The node id belongs to another live process: exit 3.
    #[error("{0}")]
    NodeIdInUse(String),
    /// Anything else: exit 1.
    #[error("{0:#}")]
    Failed(#[from] anyhow::Error),
}

impl From<ConfigError> for CommandError {
    fn from(e: ConfigError) -> Self {
        CommandError::Config(e.to_string())
    }
}

impl From<crate::db::AdminConnectError> for CommandError {
    fn from(e: crate::db::AdminConnectError) -> Self {
        match e {
            crate::db::AdminConnectError::InvalidUrl(_) => CommandError::Config(e.to_string()),
            crate::db::AdminConnectError::Unreachable(_) => CommandError::failed(e.to_string()),
        }
    }
}

impl CommandError {
    /// The process's exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            CommandError::Failed(_) => 1,
            CommandError::Config(_) => 2,
            CommandError::NodeIdInUse(_) => 3,
        }
    }

    fn usage(message: impl Into<String>) -> Self {
        CommandError::Config(message.into())
    }

    fn failed(message: impl Into<String>) -> Self {
        CommandError::Failed(anyhow::anyhow!(message.into()))
    }
}

/// Runs the command the command line names.
pub async fn run(cli: Cli) -> Result<(), CommandError> {
    match cli.command {
        Command::Run(args) => run::run(*args).await,
        Command::Migrate(args) => migrate::migrate(args).await,
        Command::SimBroker(command) => sim_broker::sim_broker(command).await,
        Command::BridgeCheck(args) => bridge_check::bridge_check(args).await,
        Command::Status(args) => status::status(args).await,
        Command::Demo(args) => demo::demo(args).await,
        Command::Credentials(command) => credentials::credentials(command).await,
        Command::Accounts(command) => manage::accounts(command).await,
        Command::Risk(command) => manage::risk(command).await,
        Command::Links(command) => manage::links(command).await,
        Command::Why(args) => manage::why(args).await,
        Command::Copies(args) => manage::copies(args).await,
    }
}

/// The configuration from its layers (file < environment < flags); `node`: for `run`, which
/// needs a platform too. Also returns the `COPIER_*` variables that name no key.
fn load(
    file: Option<&std::path::Path>,
    flags: &[(&'static str, Option<String>)],
    node: bool,
) -> Result<(Config, Vec<String>), CommandError> {
    let layers = Layers::load(file, std::env::vars(), flags)?;
    let config = if node {
        layers.resolve_node()?
    } else {
        layers.resolve()?
    };
    Ok((config, layers.ignored_env))
}

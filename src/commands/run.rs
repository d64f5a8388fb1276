//! `copier-node run`: the node daemon.

use super::{CommandError, load};
use crate::cli::RunArgs;
use crate::lease::NodeError;
use crate::telemetry::{self, Output};
use crate::{app, shutdown};

pub(super) async fn run(args: RunArgs) -> Result<(), CommandError> {
    let (config, ignored) = load(args.db.config.as_deref(), &args.flags(), true)?;
    config.node()?;
    telemetry::init(config.log_format, Output::Stdout);
    for var in ignored {
        tracing::warn!(variable = %var, "ignoring environment variable: it names no configuration key");
    }
    let options = app::RunOptions {
        migrate: args.migrate,
        ..Default::default()
    };
    app::run(config, options, shutdown::signal_received())
        .await
        .map_err(|e| {
            tracing::error!("{e:#}");
            if e.downcast_ref::<NodeError>().is_some() {
                CommandError::NodeIdInUse(format!("{e:#}"))
            } else {
                CommandError::Failed(e)
            }
        })
}

//! `copier-node demo`: the whole system on one machine (the scenario is in [`crate::demo`]).

use super::CommandError;
use crate::cli::DemoArgs;
use crate::config::{LogFormat, parse_duration};
use crate::telemetry::{self, Output};
use crate::{demo, shutdown};

pub(super) async fn demo(args: DemoArgs) -> Result<(), CommandError> {
    // Installed first: a Ctrl-C from the first moment on is a clean stop.
    let stop = shutdown::signal_received();
    // The demo's own lines tell the story; the in-process broker's and database's log lines
    // would interleave with them, so only warnings show (RUST_LOG shows more).
    telemetry::init_with(LogFormat::Text, Output::Stderr, "warn");
    let duration = args
        .duration
        .as_deref()
        .map(parse_duration)
        .transpose()
        .map_err(|e| CommandError::usage(format!("invalid --duration: {e}")))?;
    let options = demo::DemoOptions {
        duration,
        json: args.json,
        ..Default::default()
    };
    let summary = demo::run(options, stop).await?;
    if summary.duplicates == 0 && summary.missed_copies == 0 && summary.missed_closes == 0 {
        Ok(())
    } else {
        Err(CommandError::failed(format!(
            "{} duplicate copies in the journal, {} missed copies, {} missed closes",
            summary.duplicates, summary.missed_copies, summary.missed_closes
        )))
    }
}

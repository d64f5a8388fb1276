//! Logging: `text` or `json` (one object per line). `run` logs to stdout; every other command
//! keeps stdout for its result and logs to stderr. `RUST_LOG` overrides the default filter.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Where log lines go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Output {
    Stdout,
    Stderr,
}

/// The default filter of the node and the tools: `info`, with sqlx's per-statement lines off.
pub(crate) const DEFAULT_FILTER: &str = "info,sqlx=warn";

/// Installs the global subscriber with [`DEFAULT_FILTER`]. Safe to call once per process; later
/// calls are ignored.
pub(crate) fn init(format: LogFormat, output: Output) {
    init_with(format, output, DEFAULT_FILTER);
}

/// As [`init`], with another default filter (`RUST_LOG` still overrides it).
pub(crate) fn init_with(format: LogFormat, output: Output, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let ansi = match output {
        Output::Stdout => std::io::stdout().is_terminal(),
        Output::Stderr => std::io::stderr().is_terminal(),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(ansi);
    let result = match (format, output) {
        (LogFormat::Text, Output::Stdout) => builder.with_writer(std::io::stdout).try_init(),
        (LogFormat::Text, Output::Stderr) => builder.with_writer(std::io::stderr).try_init(),
        (LogFormat::Json, Output::Stdout) => builder
            .json()
            .with_current_span(false)
            .with_span_list(true)
            .with_writer(std::io::stdout)
            .try_init(),
        (LogFormat::Json, Output::Stderr) => builder
            .json()
            .with_current_span(false)
            .with_span_list(true)
            .with_writer(std::io::stderr)
            .try_init(),
    };
    drop(result);
}

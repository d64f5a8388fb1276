//! `copier-node bridge-check`: the conformance kit's command line. Prints the report (text or
//! JSON) on standard output; exit 1 when a check failed, 2 on a usage error.

use crate::bridge_check::{self, Options};
use crate::cli::BridgeCheckArgs;

use super::CommandError;

pub(super) async fn bridge_check(args: BridgeCheckArgs) -> Result<(), CommandError> {
    let timeout = crate::config::parse_duration(&args.timeout)
        .map_err(|e| CommandError::usage(format!("--timeout: {e}")))?;
    if timeout.is_zero() {
        return Err(CommandError::usage("--timeout: must be above zero"));
    }
    let password = if args.password_stdin {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map_err(|e| {
            CommandError::failed(format!("password: cannot read it from standard input: {e}"))
        })?;
        let password = line.trim_end_matches(['\n', '\r']).to_string();
        if password.is_empty() {
            return Err(CommandError::usage(
                "password: none on standard input (--password-stdin)",
            ));
        }
        Some(password)
    } else {
        None
    };
    let options = Options {
        server: args.server,
        login: args.login,
        password,
        symbol: args.symbol,
        timeout,
    };
    let report = bridge_check::run(&options).await;
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| CommandError::failed(format!("writing the report: {e}")))?;
        println!("{text}");
    } else {
        print!("{}", report.text());
    }
    let failed = report.failed();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(CommandError::failed(format!(
            "bridge-check: {} of {} checks failed ({}) against {}",
            failed.len(),
            report.checks.len(),
            failed.join(", "),
            options.server
        )))
    }
}

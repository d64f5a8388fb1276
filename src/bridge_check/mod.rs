//! The conformance kit for bridges (`copier-node bridge-check`): a scripted session against any
//! server of the bridge protocol on a demo account, each check reported as passed or failed.
//!
//! The script opens, partially closes, modifies and closes one position of its own, places,
//! amends and cancels one pending order (where the bridge offers them), drops a connection with an
//! order in flight and looks for it by its marker, and asks for three refusals. Every order carries
//! a marker of its own (magic number and a `bc...` comment) and no fence, so the account's other
//! positions are left alone and a bridge's highest fence is not raised. What a check looks at is
//! the wire: the kit's client ([`wire`]) forgives nothing. Later checks need the earlier ones (no
//! partial close without an open): those it could not reach are failed with the reason.

mod script;
mod wire;

use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

pub use script::CHECKS;

/// What to check and where.
#[derive(Debug, Clone)]
pub struct Options {
    /// The bridge, `host:port`.
    pub server: String,
    /// A demo account's login on it.
    pub login: String,
    /// Its password, if it has one (never printed).
    pub password: Option<String>,
    /// The symbol to trade; `None`: the first the bridge lists.
    pub symbol: Option<String>,
    /// The longest wait for a reply or an event.
    pub timeout: Duration,
}

/// How one check ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Passed,
    Failed,
    /// The bridge says it does not offer what the check needs (pending orders).
    NotOffered,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "passed",
            Outcome::Failed => "FAILED",
            Outcome::NotOffered => "not offered",
        }
    }
}

/// One check's name, outcome and what it saw.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub check: &'static str,
    pub result: Outcome,
    pub detail: String,
}

/// Every check, in the script's order.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub server: String,
    pub login: String,
    pub passed: bool,
    pub checks: Vec<Check>,
}

impl Report {
    /// The check named `name`, if it ran.
    pub fn check(&self, name: &str) -> Option<&Check> {
        self.checks.iter().find(|c| c.check == name)
    }

    /// The names of the failed checks.
    pub fn failed(&self) -> Vec<&'static str> {
        self.checks
            .iter()
            .filter(|c| c.result == Outcome::Failed)
            .map(|c| c.check)
            .collect()
    }

    /// One line per check, under a summary line.
    pub fn text(&self) -> String {
        let count = |o: Outcome| self.checks.iter().filter(|c| c.result == o).count();
        let mut out = format!(
            "bridge-check {} login {}: {} passed, {} failed, {} not offered\n",
            self.server,
            self.login,
            count(Outcome::Passed),
            count(Outcome::Failed),
            count(Outcome::NotOffered)
        );
        for c in &self.checks {
            let _ = writeln!(
                out,
                "{:<12} {:<16} {}",
                c.result.as_str(),
                c.check,
                c.detail
            );
        }
        out
    }
}

/// Runs the script against `options.server` and reports every check.
pub async fn run(options: &Options) -> Report {
    let checks = script::Script::new(options).run().await;
    Report {
        server: options.server.clone(),
        login: options.login.clone(),
        passed: checks.iter().all(|c| c.result != Outcome::Failed),
        checks,
    }
}

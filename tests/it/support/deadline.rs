//! One deadline for a whole scenario, kept by a thread of its own so that it fires even when the
//! test's runtime thread is blocked (a blocking call, or an await with no timeout of its own).
//! At expiry it prints the last phase the scenario reached, the tail of every log it was told
//! about and the process tree, then aborts the test process: a hang becomes a failure that says
//! where it hung, before nextest's terminate-after kills the test without a word.

use std::path::{Path, PathBuf};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

#[derive(Default)]
struct Watched {
    phase: String,
    /// Log files, and directories whose `*.log`/`*.err` files (one level down too) are printed.
    paths: Vec<PathBuf>,
}

/// Dropping it disarms the deadline.
pub struct Deadline {
    name: String,
    started: Instant,
    watched: Arc<Mutex<Watched>>,
    _disarm: mpsc::Sender<()>,
}

impl Deadline {
    /// Arms a deadline of `within` for the scenario `name`: at expiry the report goes to stderr
    /// and the test process aborts.
    pub fn arm(name: &str, within: Duration) -> Deadline {
        Self::arm_with(name, within, |report| {
            eprintln!("{report}");
            std::process::abort();
        })
    }

    /// As [`Deadline::arm`], with `expired` given the report instead.
    fn arm_with(
        name: &str,
        within: Duration,
        expired: impl FnOnce(String) + Send + 'static,
    ) -> Deadline {
        let (disarm, armed) = mpsc::channel::<()>();
        let watched = Arc::new(Mutex::new(Watched {
            phase: "starting".into(),
            paths: Vec::new(),
        }));
        let (w, n) = (watched.clone(), name.to_string());
        std::thread::spawn(move || {
            if let Err(RecvTimeoutError::Timeout) = armed.recv_timeout(within) {
                let w = w.lock().unwrap_or_else(|e| e.into_inner());
                expired(format!(
                    "[{n}] DEADLINE: not done within {within:?}; last phase: {}\n{}{}{}",
                    w.phase,
                    scratch_dirs().iter().map(|p| tails(p)).collect::<String>(),
                    w.paths.iter().map(|p| tails(p)).collect::<String>(),
                    process_tree()
                ));
            }
        });
        Deadline {
            name: name.to_string(),
            started: Instant::now(),
            watched,
            _disarm: disarm,
        }
    }

    /// Records (and prints, with the time since the deadline was armed) the phase the scenario
    /// enters.
    pub fn phase(&self, what: &str) {
        eprintln!(
            "[{}] +{:.1}s: {what}",
            self.name,
            self.started.elapsed().as_secs_f64()
        );
        self.watched.lock().unwrap().phase = what.to_string();
    }

    /// A log file, or a directory of them, to print if the deadline fires (besides this test
    /// process's scratch directories, always printed).
    pub fn watch(&self, path: &Path) {
        self.watched.lock().unwrap().paths.push(path.to_path_buf());
    }
}

/// The last 40 lines of `path`, or of every `*.log` and `*.err` file in it and its
/// subdirectories (one level).
fn tails(path: &Path) -> String {
    if path.is_file() {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = &lines[lines.len().saturating_sub(40)..];
        return format!("--- {}\n{}\n", path.display(), tail.join("\n"));
    }
    let mut files: Vec<PathBuf> = Vec::new();
    for dir in std::iter::once(path.to_path_buf()).chain(subdirs(path)) {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        files.extend(
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "log" || e == "err")),
        );
    }
    files.sort();
    files.iter().map(|f| tails(f)).collect()
}

/// This test process's scratch directories (`Scratch` names them `<name>-<pid>-<random>`).
fn scratch_dirs() -> Vec<PathBuf> {
    let pid = format!("-{}-", std::process::id());
    let mut dirs: Vec<PathBuf> = subdirs(Path::new(env!("CARGO_TARGET_TMPDIR")))
        .into_iter()
        .filter(|d| {
            d.file_name()
                .is_some_and(|n| n.to_string_lossy().contains(&pid))
        })
        .collect();
    dirs.sort();
    dirs
}

fn subdirs(path: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

fn process_tree() -> String {
    std::process::Command::new("ps")
        .args(["-eo", "pid,ppid,stat,etime,args", "--forest"])
        .output()
        .map(|o| format!("--- ps\n{}", String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_deadline_fires_while_the_runtime_thread_is_blocked_and_reports_phase_and_logs() {
        let dir = crate::support::broker::Scratch::new("deadline-self-test");
        let log = dir.path("member.log");
        std::fs::write(&log, "first line\nthe last words of the member\n").unwrap();
        let (tx, rx) = mpsc::channel();
        let at = Deadline::arm_with("self-test", Duration::from_millis(200), move |r| {
            let _ = tx.send(r);
        });
        at.phase("waiting for something that never comes");
        at.watch(&log);
        // Blocks this (current-thread) runtime: no timer of its own could fire now.
        std::thread::sleep(Duration::from_millis(600));
        let report = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the deadline fired");
        assert!(
            report.contains("last phase: waiting for something that never comes"),
            "{report}"
        );
        assert!(report.contains("the last words of the member"), "{report}");
        assert!(report.contains("--- ps"), "{report}");
    }

    #[tokio::test]
    async fn a_disarmed_deadline_stays_silent() {
        let (tx, rx) = mpsc::channel();
        let at = Deadline::arm_with("self-test", Duration::from_millis(100), move |r| {
            let _ = tx.send(r);
        });
        drop(at);
        assert!(
            rx.recv_timeout(Duration::from_millis(400)).is_err(),
            "a dropped deadline fired"
        );
    }
}

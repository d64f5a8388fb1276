//! Nodes as real `copier-node` processes, with their output in a log file per node.

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::{TestDb, Timing};

/// The binary under test.
pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_copier-node")
}

fn log_dir() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("node-logs");
    fs::create_dir_all(&dir).unwrap();
    dir
}

/// A `copier-node run` process. Killed (SIGKILL) when dropped.
pub struct NodeProcess {
    pub node_id: String,
    child: Child,
    pub log: PathBuf,
    status: Option<ExitStatus>,
}

/// How to start a node process.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    pub node_id: String,
    pub capacity: u32,
    pub timing: Timing,
    pub database_url: String,
    pub listen_url: Option<String>,
    pub env: Vec<(String, String)>,
    pub extra: Vec<String>,
}

impl NodeProcess {
    /// Starts `copier-node run` on platform mt5 with the given identity, capacity and timings.
    pub fn spawn(
        db: &TestDb,
        node_id: &str,
        capacity: u32,
        timing: Timing,
        extra: &[&str],
    ) -> NodeProcess {
        Self::spawn_with(&NodeSpec {
            node_id: node_id.to_string(),
            capacity,
            timing,
            database_url: db.url.clone(),
            listen_url: None,
            env: Vec::new(),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        })
    }

    /// Starts `copier-node run` as `spec` says.
    pub fn spawn_with(spec: &NodeSpec) -> NodeProcess {
        let node_id = spec.node_id.as_str();
        let log = log_dir().join(format!("{node_id}-{:08x}.log", fastrand::u32(..)));
        let out = File::create(&log).unwrap();
        let timing = spec.timing;
        let mut cmd = Command::new(binary());
        cmd.arg("run")
            .args(["--platform", "mt5", "--node-id", node_id])
            .args(["--capacity", &spec.capacity.to_string()])
            .args([
                "--lease",
                timing.lease,
                "--fence",
                timing.fence,
                "--cycle",
                timing.cycle,
            ])
            .args(["--http-listen", "127.0.0.1:0"])
            .args(&spec.extra)
            .env("DATABASE_URL", &spec.database_url)
            .env("RUST_LOG", "info,sqlx=warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out);
        if let Some(listen) = &spec.listen_url {
            cmd.env("COPIER_LISTEN_DATABASE_URL", listen);
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawning copier-node");
        NodeProcess {
            node_id: node_id.to_string(),
            child,
            log,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (TERM, KILL, STOP, CONT).
    pub fn signal(&self, name: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        assert!(
            ok || self.status.is_some(),
            "kill -{name} {} failed",
            self.pid()
        );
        if name == "STOP" && ok {
            self.wait_stopped();
        }
    }

    /// Returns once every thread of the process is stopped. `kill` returns once the signal is
    /// sent, and a thread stops only as it next leaves the kernel: under load a node was seen
    /// copying a trade made after `kill -STOP` had returned.
    fn wait_stopped(&self) {
        let tasks = PathBuf::from(format!("/proc/{}/task", self.pid()));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let stopped = fs::read_dir(&tasks).map(|dir| {
                dir.filter_map(Result::ok).all(|t| {
                    // The state follows the parenthesised command name: `pid (comm) S ...`.
                    fs::read_to_string(t.path().join("stat")).is_ok_and(|stat| {
                        stat.rsplit_once(") ")
                            .is_some_and(|(_, rest)| rest.starts_with(['T', 't']))
                    })
                })
            });
            if stopped.unwrap_or(true) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} ({}) not stopped 10 s after SIGSTOP",
                self.node_id,
                self.pid()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        self.status = self.child.wait().ok();
    }

    /// Waits for the process to exit, polling; panics after `within`.
    pub async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            if let Some(s) = self.status {
                return s;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                self.status = Some(s);
                return s;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} did not exit within {within:?}; log:\n{}",
                    self.node_id,
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Everything the process printed so far.
    /// One series of the node's `/metrics` (its HTTP address read from its log); `None` until
    /// the node serves it.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        const SERVING: &str = "serving /healthz, /readyz and /metrics on ";
        let out = self.output();
        let at = out.find(SERVING)? + SERVING.len();
        let addr = out[at..].split_whitespace().next()?.parse().ok()?;
        let (status, body) = super::http::get(addr, "/metrics").await;
        (status == 200).then(|| super::http::sample(&body, series))
    }

    pub fn output(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the process has printed a line containing `needle`.
    pub async fn wait_for_output(&mut self, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if self.output().contains(needle) {
                return;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                self.status = Some(s);
                panic!(
                    "{} exited ({s}) before printing {needle:?}; log:\n{}",
                    self.node_id,
                    self.output()
                );
            }
            if Instant::now() >= deadline {
                panic!(
                    "{} did not print {needle:?} within {within:?}; log:\n{}",
                    self.node_id,
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A failing test shows what the node itself said (its own lines, not every
            // account's lines), for the run that cannot be repeated.
            let out = self.output();
            let own: Vec<&str> = out.lines().filter(|l| !l.contains("account_id")).collect();
            eprintln!(
                "--- {} ({}), its last own log lines:\n{}",
                self.node_id,
                self.log.display(),
                own[own.len().saturating_sub(60)..].join("\n")
            );
        }
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `copier-node` with `args` to completion; returns (exit code, stdout, stderr).
pub fn run_to_end(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(binary());
    cmd.args(args)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running copier-node");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

//! Simulated brokers for tests: in-process, or as a `copier-node sim-broker serve` process.

use std::fs::{self, File};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use copier_node::sim_broker::journal::JournalEntry;
use copier_node::sim_broker::{ServeOptions, SimBroker};
use tokio::time::Instant;

use super::process::binary;

/// A scratch directory under the target dir, removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(name: &str) -> Scratch {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "{name}-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        ));
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // KEEP_SCRATCH=1 keeps journals and logs for a failed test's post-mortem.
        if std::env::var_os("KEEP_SCRATCH").is_none() {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// Starts an in-process simulated broker on a free port with its journal in `dir`.
pub async fn start_sim(dir: &Scratch) -> SimBroker {
    SimBroker::start(ServeOptions::new("127.0.0.1:0", dir.path("journal.jsonl")))
        .await
        .unwrap()
}

/// Every journal line, parsed.
pub fn journal(path: &std::path::Path) -> Vec<JournalEntry> {
    copier_node::sim_broker::journal::read(path).unwrap()
}

/// A free loopback port (there is a small race until it is bound again).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `copier-node sim-broker serve` as a process.
pub struct BrokerProcess {
    child: Child,
    pub addr: String,
    pub log: PathBuf,
}

impl BrokerProcess {
    pub async fn spawn(dir: &Scratch, args: &[&str]) -> BrokerProcess {
        Self::spawn_on(dir, free_port(), args).await
    }

    pub async fn spawn_on(dir: &Scratch, port: u16, args: &[&str]) -> BrokerProcess {
        let addr = format!("127.0.0.1:{port}");
        let log = dir.path(&format!("broker-{:08x}.log", fastrand::u32(..)));
        let out = File::create(&log).unwrap();
        let journal = dir.path("journal.jsonl");
        let child = Command::new(binary())
            .args(["sim-broker", "serve", "--listen", &addr, "--journal"])
            .arg(&journal)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .unwrap();
        let mut b = BrokerProcess { child, addr, log };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !fs::read_to_string(&b.log)
            .unwrap_or_default()
            .contains("sim-broker listening")
        {
            if let Some(s) = b.child.try_wait().unwrap() {
                panic!(
                    "sim-broker exited ({s}): {}",
                    fs::read_to_string(&b.log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "sim-broker did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        b
    }

    /// SIGTERM, then wait.
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for BrokerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `copier-node sim-broker <args>` without blocking the runtime (an in-process broker
/// must keep serving meanwhile); returns (exit code, stdout, stderr).
pub async fn tool(args: &[&str]) -> (i32, String, String) {
    let out = tokio::process::Command::new(binary())
        .arg("sim-broker")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .await
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

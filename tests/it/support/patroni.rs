//! The database tier operators run, as test children: one etcd (Debian's 3.4, through Patroni's
//! `etcd3` section since 3.4 turns the v2 API off), two PostgreSQL members under Patroni (3.0, run
//! as the `postgres` user like PostgreSQL itself), and HAProxy (2.6) routing to whichever member
//! Patroni's REST API says is the primary (`OPTIONS /primary`). Nodes connect through HAProxy only.
//!
//! A crash is a machine crash: Patroni, the postmaster and its backends killed together with
//! SIGKILL (Patroni restarts a lone killed postmaster in place, which is not a failover).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use copier_node::pgtmp::{PgBinaries, as_postgres, prepare_dir, running_as_root};
use tokio::time::Instant;

const PATRONI: &str = "/usr/bin/patroni";
const PATRONICTL: &str = "/usr/bin/patronictl";
const ETCD: &str = "/usr/bin/etcd";
const HAPROXY: &str = "/usr/sbin/haproxy";

/// Whether Patroni, etcd and HAProxy are installed; when they are not, a test may skip only
/// outside CI (`COPIER_REQUIRE_TOOLS` makes their absence a failure).
pub fn available() -> bool {
    let missing: Vec<&str> = [PATRONI, PATRONICTL, ETCD, HAPROXY]
        .into_iter()
        .filter(|p| !Path::new(p).exists())
        .collect();
    if !missing.is_empty() {
        assert!(
            std::env::var_os("COPIER_REQUIRE_TOOLS").is_none(),
            "patroni, etcd-server and haproxy are required (COPIER_REQUIRE_TOOLS is set); missing {missing:?}"
        );
        eprintln!(
            "note: {missing:?} not installed; this test is skipped here (CI installs patroni, etcd-server, haproxy)"
        );
    }
    missing.is_empty()
}

/// One Patroni member: its PostgreSQL port, REST port and directory.
#[derive(Debug)]
struct Member {
    name: String,
    pg_port: u16,
    rest_port: u16,
    dir: PathBuf,
    patroni: Option<Child>,
}

impl Member {
    fn config(&self) -> PathBuf {
        self.dir.join("patroni.yml")
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The status of `GET path` on this member's REST API (None when it does not answer).
    fn rest_status(&self, path: &str) -> Option<u16> {
        http_status(self.rest_port, path)
    }

    async fn rest_status_async(&self, path: &str) -> Option<u16> {
        http_status_async(self.rest_port, path).await
    }
}

/// A running Patroni cluster behind HAProxy; everything is stopped when dropped.
pub struct Patroni {
    dir: PathBuf,
    etcd: Child,
    haproxy: Child,
    members: Vec<Member>,
    /// HAProxy's port: the primary, whichever member it is.
    pub port: u16,
    pub synchronous: bool,
}

/// Ports below the kernel's ephemeral range (`ip_local_port_range`, 32768-60999 here), from
/// which the rest of the suite's `bind(0)` ports and every outgoing connection take theirs.
const CLUSTER_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// A port for the cluster that is free now and that no other test takes meanwhile. A member's
/// ports are chosen before its start, and `m2` starts only once `m1` has bootstrapped (tens of
/// seconds under a loaded suite): a `bind(0)` port could be handed to another test's listener in
/// between, and `m2` would then never come up. Patroni scenarios run one at a time, so only this
/// cluster takes ports from this range; `taken` keeps its own seven apart.
fn cluster_port(taken: &mut Vec<u16>) -> u16 {
    let span = u64::from(CLUSTER_PORTS.end - CLUSTER_PORTS.start);
    // A random start (std's hasher keys are random per process), then the first free one.
    let seed = {
        use std::hash::{BuildHasher, Hasher};
        std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish()
    };
    (0..span)
        .map(|i| CLUSTER_PORTS.start + (seed.wrapping_add(i) % span) as u16)
        .find(|p| !taken.contains(p) && std::net::TcpListener::bind(("127.0.0.1", *p)).is_ok())
        .inspect(|p| taken.push(*p))
        .expect("a free port below the ephemeral range")
}

/// The status code of a plain HTTP GET on 127.0.0.1:port (2 s timeouts).
fn http_status(port: u16, path: &str) -> Option<u16> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw.split_whitespace().nth(1)?.parse().ok()
}

/// [`http_status`] without blocking the runtime.
async fn http_status_async(port: u16, path: &str) -> Option<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await
        .ok()?;
        let mut raw = String::new();
        let _ = s.read_to_string(&mut raw).await;
        raw.split_whitespace().nth(1)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(2), exchange)
        .await
        .ok()
        .flatten()
}

fn log_file(path: &Path) -> Stdio {
    Stdio::from(File::create(path).expect("a log file"))
}

fn chown_to_postgres(path: &Path) {
    if running_as_root() {
        let _ = Command::new("chown")
            .arg("postgres:postgres")
            .arg(path)
            .status();
    }
}

/// Polls `probe` every 100 ms until it gives a value, for at most `within`; past it, panics
/// naming `what` with `context()` (the members' logs once there are members).
fn poll<T>(
    what: &str,
    within: Duration,
    context: impl Fn() -> String,
    mut probe: impl FnMut() -> Option<T>,
) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {within:?}\n{}",
            context()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl Patroni {
    /// Starts etcd, two Patroni members (`m1` bootstraps, `m2` is cloned from it) and HAProxy in
    /// `dir`, and returns once `m1` is the primary and `m2` streams from it (and is its
    /// synchronous standby with `synchronous`). Blocking: call it from `spawn_blocking`.
    pub fn start(dir: &Path, synchronous: bool) -> Patroni {
        std::fs::create_dir_all(dir).unwrap();
        spawn_watchdog(dir);
        let bins = PgBinaries::find().unwrap();
        let bin_dir = bins.tool("initdb").parent().unwrap().to_path_buf();
        let mut taken = Vec::new();
        let (client, peer) = (cluster_port(&mut taken), cluster_port(&mut taken));
        let etcd = Command::new(ETCD)
            .args(["--name", "e1", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &format!("http://127.0.0.1:{client}"),
                "--advertise-client-urls",
                &format!("http://127.0.0.1:{client}"),
                "--listen-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-advertise-peer-urls",
                &format!("http://127.0.0.1:{peer}"),
                "--initial-cluster",
                &format!("e1=http://127.0.0.1:{peer}"),
                "--initial-cluster-state",
                "new",
            ])
            .stdin(Stdio::null())
            .stdout(log_file(&dir.join("etcd.log")))
            .stderr(log_file(&dir.join("etcd.err")))
            .spawn()
            .expect("starting etcd");
        let members: Vec<Member> = (1..=2)
            .map(|i| Member {
                name: format!("m{i}"),
                pg_port: cluster_port(&mut taken),
                rest_port: cluster_port(&mut taken),
                dir: dir.join(format!("m{i}")),
                patroni: None,
            })
            .collect();
        let port = cluster_port(&mut taken);
        let haproxy_cfg = dir.join("haproxy.cfg");
        let servers: String = members
            .iter()
            .map(|m| {
                format!(
                    "    server {} 127.0.0.1:{} maxconn 300 check port {}\n",
                    m.name, m.pg_port, m.rest_port
                )
            })
            .collect();
        // HAProxy routes to the member whose `/primary` says 200, checks twice a second, and
        // cuts the sessions of a member marked down (a demoted primary keeps no client).
        std::fs::write(
            &haproxy_cfg,
            format!(
                "global\n    maxconn 2000\ndefaults\n    mode tcp\n    timeout connect 2s\n    timeout client 30m\n    timeout server 30m\n    timeout check 2s\nlisten primary\n    bind 127.0.0.1:{port}\n    option httpchk OPTIONS /primary\n    http-check expect status 200\n    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions\n{servers}"
            ),
        )
        .unwrap();
        let haproxy = Command::new(HAPROXY)
            .arg("-f")
            .arg(&haproxy_cfg)
            .arg("-db")
            .stdin(Stdio::null())
            .stdout(log_file(&dir.join("haproxy.log")))
            .stderr(log_file(&dir.join("haproxy.err")))
            .spawn()
            .expect("starting haproxy");
        let mut cluster = Patroni {
            dir: dir.to_path_buf(),
            etcd,
            haproxy,
            members,
            port,
            synchronous,
        };
        poll(
            "etcd to answer",
            Duration::from_secs(30),
            String::new,
            || (http_status(client, "/version") == Some(200)).then_some(()),
        );
        let namespace = format!("/copier-test-{port}/");
        for m in &cluster.members {
            prepare_dir(&m.dir).unwrap();
            let hba = "    - local all all trust\n    - host all all 127.0.0.1/32 trust\n    - host replication all 127.0.0.1/32 trust\n";
            // ttl 20 s is Patroni's least; loop_wait + 2 * retry_timeout stays below it.
            let yml = format!(
                "scope: copier\nnamespace: {namespace}\nname: {name}\nrestapi:\n  listen: 127.0.0.1:{rest}\n  connect_address: 127.0.0.1:{rest}\netcd3:\n  hosts: 127.0.0.1:{client}\nbootstrap:\n  dcs:\n    ttl: 20\n    loop_wait: 1\n    retry_timeout: 5\n    maximum_lag_on_failover: 16777216\n    synchronous_mode: {synchronous}\n    postgresql:\n      use_pg_rewind: false\n      parameters:\n        max_connections: 300\n        wal_keep_size: 256MB\n        max_wal_senders: 5\n        max_replication_slots: 5\n  initdb:\n    - encoding: UTF8\n    - auth: trust\n  pg_hba:\n{hba}postgresql:\n  listen: 127.0.0.1:{pg}\n  connect_address: 127.0.0.1:{pg}\n  data_dir: {data}\n  bin_dir: {bin_dir}\n  pgpass: {dir}/pgpass\n  authentication:\n    superuser:\n      username: postgres\n    replication:\n      username: postgres\n  parameters:\n    unix_socket_directories: {dir}\n    fsync: off\n  pg_hba:\n{hba}",
                name = m.name,
                rest = m.rest_port,
                pg = m.pg_port,
                data = m.data().display(),
                bin_dir = bin_dir.display(),
                dir = m.dir.display(),
            );
            std::fs::write(m.config(), yml).unwrap();
            chown_to_postgres(&m.config());
        }
        cluster.spawn_member(0);
        poll(
            "m1 to bootstrap as the primary",
            Duration::from_secs(90),
            || cluster.logs(),
            || (cluster.members[0].rest_status("/primary") == Some(200)).then_some(()),
        );
        cluster.spawn_member(1);
        cluster.wait_replica(1, Duration::from_secs(120));
        cluster
    }

    /// Starts member `i`'s Patroni (as `postgres`), its output in `<member>.log`.
    fn spawn_member(&mut self, i: usize) {
        let m = &mut self.members[i];
        let log = self.dir.join(format!("{}.log", m.name));
        let child = as_postgres(Path::new(PATRONI))
            .arg(m.config())
            .stdin(Stdio::null())
            .stdout(log_file(&log))
            .stderr(Stdio::from(
                File::options().append(true).open(&log).unwrap(),
            ))
            .spawn()
            .expect("starting patroni");
        m.patroni = Some(child);
    }

    /// Waits until member `i` streams from the primary (and is its synchronous standby when the
    /// cluster is synchronous).
    fn wait_replica(&self, i: usize, within: Duration) {
        let m = &self.members[i];
        let path = if self.synchronous {
            "/sync"
        } else {
            "/replica"
        };
        poll(
            &format!("{} to become a streaming {path} member", m.name),
            within,
            || self.logs(),
            || (m.rest_status(path) == Some(200)).then_some(()),
        );
    }

    /// The member Patroni's REST API calls the primary now.
    pub async fn leader(&self) -> Option<String> {
        for m in self.members.iter().filter(|m| m.patroni.is_some()) {
            if m.rest_status_async("/primary").await == Some(200) {
                return Some(m.name.clone());
            }
        }
        None
    }

    fn index(&self, name: &str) -> usize {
        self.members
            .iter()
            .position(|m| m.name == name)
            .unwrap_or_else(|| panic!("no member {name}"))
    }

    /// The URL of database `db` through HAProxy.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// A planned switchover with `patronictl switchover` from the primary to the other member;
    /// returns the new primary once it is one and the old primary streams from it again.
    pub async fn switchover(&self) -> String {
        let leader = self
            .leader()
            .await
            .expect("a primary before the switchover");
        let candidate = self
            .members
            .iter()
            .find(|m| m.name != leader)
            .unwrap()
            .name
            .clone();
        let out = tokio::process::Command::new(PATRONICTL)
            .arg("-c")
            .arg(self.members[0].config())
            .args(["switchover", "--leader", &leader, "--candidate"])
            .arg(&candidate)
            .arg("--force")
            .stdin(Stdio::null())
            .output()
            .await
            .expect("running patronictl");
        assert!(
            out.status.success(),
            "patronictl switchover failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        self.wait_promoted(&leader, Duration::from_secs(60)).await;
        self.wait_replica_async(self.index(&leader), Duration::from_secs(120))
            .await;
        candidate
    }

    /// [`Self::wait_replica`] without blocking the runtime.
    async fn wait_replica_async(&self, i: usize, within: Duration) {
        let m = &self.members[i];
        let path = if self.synchronous {
            "/sync"
        } else {
            "/replica"
        };
        let deadline = Instant::now() + within;
        while m.rest_status_async(path).await != Some(200) {
            assert!(
                Instant::now() < deadline,
                "{} did not become a streaming {path} member within {within:?}:\n{}",
                m.name,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Kills the primary's Patroni, postmaster and backends together (a crash of its machine);
    /// returns the killed member's name.
    pub async fn crash_leader(&mut self) -> String {
        let leader = self.leader().await.expect("a primary to crash");
        let i = self.index(&leader);
        let m = &mut self.members[i];
        let mut pids: Vec<String> = Vec::new();
        if let Some(child) = &m.patroni {
            pids.push(child.id().to_string());
            // Through `runuser` Patroni is the wrapper's child.
            pids.extend(children(child.id()));
        }
        if let Some(postmaster) = postmaster_pid(&m.data()) {
            pids.extend(children(postmaster));
            pids.push(postmaster.to_string());
        }
        pids.sort();
        pids.dedup();
        Command::new("kill")
            .arg("-9")
            .args(&pids)
            .status()
            .expect("kill");
        if let Some(mut child) = m.patroni.take() {
            // Reaped without blocking the test's runtime thread (a blocking `wait` there would
            // stall every deadline of the scenario if the wrapper outlived the kill).
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().expect("waiting for patroni").is_none() {
                assert!(
                    Instant::now() < deadline,
                    "{leader}'s patroni (pid {}) still runs 10 s after SIGKILL",
                    child.id()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        leader
    }

    /// Waits until a member other than `dead` is the primary; returns its name.
    pub async fn wait_promoted(&self, dead: &str, within: Duration) -> String {
        let deadline = Instant::now() + within;
        loop {
            if let Some(l) = self.leader().await.filter(|l| l != dead) {
                return l;
            }
            assert!(
                Instant::now() < deadline,
                "no member promoted within {within:?}:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The tail of every member's Patroni log, for a failure message.
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let text = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)))
                    .unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(60).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                format!("--- {}\n{}", m.name, tail.join("\n"))
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The postmaster's pid from its pid file.
fn postmaster_pid(data: &Path) -> Option<u32> {
    std::fs::read_to_string(data.join("postmaster.pid"))
        .ok()?
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// The direct children of `pid`.
fn children(pid: u32) -> Vec<String> {
    let out = Command::new("pgrep")
        .args(["-P", &pid.to_string()])
        .output()
        .expect("pgrep");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

impl Drop for Patroni {
    fn drop(&mut self) {
        // Everything this cluster started names its directory on its command line (Patroni's
        // configuration, each postmaster's and initdb's `-D`, etcd's data directory, HAProxy's
        // configuration, the `runuser` wrappers, the watchdog): kill them all at once. Patroni
        // starts PostgreSQL in a session of its own, so killing our children would not reach it.
        kill_everything_under(&self.dir);
        for m in &mut self.members {
            if let Some(mut child) = m.patroni.take() {
                let _ = child.wait();
            }
        }
        for child in [&mut self.haproxy, &mut self.etcd] {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// SIGKILL to every process whose command line names `dir`.
fn kill_everything_under(dir: &Path) {
    let _ = Command::new("pkill")
        .args(["-9", "-f"])
        .arg(format!("{}/", dir.display()))
        .status();
}

/// A detached watchdog that kills everything under `dir` once this test process is gone (killed
/// by a timeout, or ended by a panic before `Drop` ran), so no cluster outlives its test.
fn spawn_watchdog(dir: &Path) {
    const SCRIPT: &str =
        r#"while kill -0 "$1" 2>/dev/null; do sleep 1; done; exec pkill -9 -f "$2""#;
    let _ = Command::new("setsid")
        .args(["sh", "-c", SCRIPT, "copier-test-patroni-watchdog"])
        .arg(std::process::id().to_string())
        .arg(format!("{}/", dir.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
}

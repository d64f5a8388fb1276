//! Throwaway PostgreSQL clusters from the machine's server binaries, for the tests and the demo.
//!
//! As root, PostgreSQL refuses to run, so every server command runs as the `postgres` user
//! (`runuser -u postgres -- ...`) and the data directory is handed to that user. The cluster is
//! tuned for throwaway use (no fsync: a crash of the machine, not of PostgreSQL, may lose it).

use std::fs;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, bail};

/// Where PostgreSQL's server binaries are.
#[derive(Debug, Clone)]
pub struct PgBinaries {
    bindir: PathBuf,
}

impl PgBinaries {
    /// Finds `initdb` and friends: `$PG_BIN`, then the newest `/usr/lib/postgresql/<v>/bin`
    /// (Debian, Ubuntu), then `PATH`. The error says what to install.
    pub fn find() -> anyhow::Result<Self> {
        if let Some(dir) = std::env::var_os("PG_BIN") {
            let bindir = PathBuf::from(dir);
            if bindir.join("initdb").is_file() {
                return Ok(PgBinaries { bindir });
            }
            bail!("PG_BIN={} has no initdb", bindir.display());
        }
        let mut versions: Vec<(u32, PathBuf)> = fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                let bin = e.path().join("bin");
                bin.join("initdb").is_file().then_some((v, bin))
            })
            .collect();
        versions.sort();
        if let Some((_, bindir)) = versions.pop() {
            return Ok(PgBinaries { bindir });
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                if dir.join("initdb").is_file() && dir.join("pg_ctl").is_file() {
                    return Ok(PgBinaries { bindir: dir });
                }
            }
        }
        bail!(
            "PostgreSQL's server binaries (initdb, pg_ctl, postgres) were not found in $PG_BIN, /usr/lib/postgresql/*/bin or PATH: install them (Debian/Ubuntu: `apt-get install postgresql`), or set DATABASE_URL to a server you have"
        )
    }

    pub fn tool(&self, name: &str) -> PathBuf {
        self.bindir.join(name)
    }
}

/// True when this process runs as root (PostgreSQL must then run as `postgres`).
pub fn running_as_root() -> bool {
    // The effective uid of this process is the owner of /proc/self.
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// A command that runs `program` as the user PostgreSQL must run as.
pub fn as_postgres(program: &Path) -> Command {
    if running_as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn postgres_ids() -> anyhow::Result<(u32, u32)> {
    let id = |flag: &str| -> anyhow::Result<u32> {
        let out = Command::new("id")
            .args([flag, "postgres"])
            .output()
            .context("running `id postgres`")?;
        if !out.status.success() {
            bail!(
                "running as root, but there is no `postgres` user to run PostgreSQL as (install the postgresql package, or create the user)"
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
    };
    Ok((id("-u")?, id("-g")?))
}

/// Makes `dir` (created if missing) usable by the user PostgreSQL runs as.
pub fn prepare_dir(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    if running_as_root() {
        let (uid, gid) = postgres_ids()?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid))
            .with_context(|| format!("handing {} to postgres", dir.display()))?;
    }
    Ok(())
}

/// A cluster whose data lives in `<root>/data`, with its socket and log in `<root>`.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub root: PathBuf,
    pub port: u16,
    bins: PgBinaries,
}

impl Cluster {
    /// Runs `initdb` into `<root>/data` (trust authentication on loopback only).
    pub fn init(bins: &PgBinaries, root: &Path) -> anyhow::Result<()> {
        prepare_dir(root)?;
        let data = root.join("data");
        let out = as_postgres(&bins.tool("initdb"))
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .stdin(Stdio::null())
            .output()
            .context("running initdb")?;
        if !out.status.success() {
            bail!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// Starts the cluster at `<root>` on a free loopback port and waits until it accepts
    /// connections.
    pub fn start(bins: &PgBinaries, root: &Path) -> anyhow::Result<Self> {
        let mut last = String::new();
        for _ in 0..5 {
            let port = free_port()?;
            let cluster = Cluster {
                root: root.to_path_buf(),
                port,
                bins: bins.clone(),
            };
            match cluster.pg_ctl_start() {
                Ok(()) => return Ok(cluster),
                Err(e) => last = format!("{e:#}"),
            }
        }
        bail!("could not start PostgreSQL: {last}")
    }

    /// The cluster at `<root>` already running on `port` (started by another process).
    pub fn attach(bins: &PgBinaries, root: &Path, port: u16) -> Self {
        Cluster {
            root: root.to_path_buf(),
            port,
            bins: bins.clone(),
        }
    }

    fn pg_ctl_start(&self) -> anyhow::Result<()> {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off -c max_connections=400 -c shared_buffers=128MB",
            self.port,
            self.root.display()
        );
        // A process group of its own: the server must not get a terminal's Ctrl-C meant for the
        // demo or a test run (the demo runs its final check against it after one).
        let out = as_postgres(&self.bins.tool("pg_ctl"))
            .process_group(0)
            .arg("-D")
            .arg(self.root.join("data"))
            .arg("-l")
            .arg(self.root.join("postgres.log"))
            .args(["-o", &opts, "-w", "-t", "60", "start"])
            .stdin(Stdio::null())
            .output()
            .context("running pg_ctl start")?;
        if !out.status.success() {
            let log = fs::read_to_string(self.root.join("postgres.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            bail!(
                "pg_ctl start failed: {} {}",
                String::from_utf8_lossy(&out.stderr).trim(),
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            );
        }
        Ok(())
    }

    /// Stops the server: `mode` is `smart`, `fast` or `immediate`.
    pub fn stop(&self, mode: &str) -> anyhow::Result<()> {
        let out = self
            .stop_command(mode)
            .output()
            .context("running pg_ctl stop")?;
        if !out.status.success() {
            bail!(
                "pg_ctl stop failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// The `pg_ctl stop` command line, for callers that run it elsewhere (a watchdog).
    pub fn stop_command(&self, mode: &str) -> Command {
        let mut c = as_postgres(&self.bins.tool("pg_ctl"));
        c.arg("-D")
            .arg(self.root.join("data"))
            .args(["-m", mode, "-w", "stop"])
            .stdin(Stdio::null());
        c
    }

    /// Starts the server again on the same port (after [`Cluster::stop`]).
    pub fn restart(&self) -> anyhow::Result<()> {
        self.pg_ctl_start()
    }

    /// A connection URL for database `db` as the superuser `postgres`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// A PostgreSQL server to work on, for the demo and the benchmarks: the one `DATABASE_URL`
/// names, or else a throwaway cluster under a directory (stopped when this is dropped).
#[derive(Debug)]
pub struct Server {
    /// A superuser connection to the server's `postgres` database.
    pub admin_url: String,
    /// The throwaway cluster, if this started one.
    pub cluster: Option<Cluster>,
}

impl Server {
    /// `DATABASE_URL`'s server when it is set; otherwise a new cluster at `<dir>/pg`.
    pub async fn from_env_or_throwaway(dir: &Path) -> anyhow::Result<Server> {
        if let Ok(url) = std::env::var("DATABASE_URL")
            && !url.is_empty()
        {
            return Ok(Server {
                admin_url: url,
                cluster: None,
            });
        }
        let bins = PgBinaries::find()?;
        let root = dir.join("pg");
        let cluster = tokio::task::spawn_blocking(move || -> anyhow::Result<Cluster> {
            Cluster::init(&bins, &root)?;
            Cluster::start(&bins, &root)
        })
        .await??;
        Ok(Server {
            admin_url: cluster.url("postgres"),
            cluster: Some(cluster),
        })
    }

    /// A fresh database `name` (dropped first if it exists), migrated; returns its URL.
    pub async fn fresh_database(&self, name: &str) -> anyhow::Result<String> {
        use sqlx::Connection;
        let secret = crate::secret::Secret::new(self.admin_url.clone());
        let mut admin = crate::db::admin_connect(&secret).await?;
        crate::db::setup::drop_database(&mut admin, name).await?;
        crate::db::setup::create_database(&mut admin, name)
            .await
            .with_context(|| format!("creating database {name}"))?;
        let _ = admin.close().await;
        let url = crate::db::with_database(&self.admin_url, name);
        let mut conn = crate::db::admin_connect(&crate::secret::Secret::new(url.clone())).await?;
        crate::db::migrate::apply(&mut conn)
            .await
            .with_context(|| format!("migrating database {name}"))?;
        let _ = conn.close().await;
        Ok(url)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(cluster) = &self.cluster {
            let _ = cluster.stop("immediate");
        }
    }
}

/// Where Debian installs PgBouncer.
pub const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

/// A throwaway PgBouncer in front of a PostgreSQL server, for the tests and the benchmarks; run
/// as the `postgres` user when this runs as root (PgBouncer refuses to run as root). Stopped
/// when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    child: std::process::Child,
    pub port: u16,
    dir: PathBuf,
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // PgBouncer runs in a process group of its own with its `runuser` wrapper. PgBouncer
        // first (its pid file), so the wrapper reaps it and exits; then the whole group, in case
        // the pid file was not written yet (a terminated `runuser` would give its child two
        // seconds); then reap the wrapper.
        if let Ok(pid) = fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill")
                .args(["-KILL", pid.trim()])
                .stderr(Stdio::null())
                .status();
            for _ in 0..500 {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.wait();
    }
}

/// (host, port, user, password) of a `postgres://user[:password]@host:port/db` URL.
fn server_of(url: &str) -> anyhow::Result<(String, String, String, Option<String>)> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (auth, rest) = rest
        .split_once('@')
        .context("the server URL names no user")?;
    let (user, password) = match auth.split_once(':') {
        Some((u, p)) => (u.to_string(), Some(p.to_string())),
        None => (auth.to_string(), None),
    };
    let hostport = rest.split(['/', '?']).next().unwrap_or(rest);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5432"));
    Ok((host.to_string(), port.to_string(), user, password))
}

impl PgBouncer {
    /// Starts PgBouncer in `dir` in `mode` (`session` or `transaction`) in front of the server
    /// of `server_url`, with `pool_size` server connections per database and user
    /// (`default_pool_size`); `ignore` lists the startup parameters it drops instead of
    /// refusing. Returns once it accepts connections (20 s at most). Blocking.
    pub fn start(
        dir: &Path,
        server_url: &str,
        mode: &str,
        ignore: &str,
        pool_size: u32,
    ) -> anyhow::Result<PgBouncer> {
        prepare_dir(dir)?;
        let (host, port, user, password) = server_of(server_url)?;
        let listen = free_port()?;
        let password = password
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let ini = format!(
            "[databases]\n* = host={host} port={port} user={user}{password}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\nauth_type = trust\nauth_file = {dir}/userlist.txt\npool_mode = {mode}\ndefault_pool_size = {pool_size}\nmax_client_conn = 500\nignore_startup_parameters = {ignore}\nlogfile = {dir}/pgbouncer.log\npidfile = {dir}/pgbouncer.pid\nserver_reset_query = DISCARD ALL\n",
            dir = dir.display()
        );
        fs::write(dir.join("pgbouncer.ini"), ini)?;
        fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n"))?;
        if running_as_root() {
            let (uid, gid) = postgres_ids()?;
            for f in ["pgbouncer.ini", "userlist.txt"] {
                std::os::unix::fs::chown(dir.join(f), Some(uid), Some(gid))?;
            }
        }
        let child = as_postgres(Path::new(PGBOUNCER))
            .arg(dir.join("pgbouncer.ini"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting pgbouncer")?;
        let bouncer = PgBouncer {
            child,
            port: listen,
            dir: dir.to_path_buf(),
        };
        for _ in 0..1000 {
            if std::net::TcpStream::connect(("127.0.0.1", listen)).is_ok() {
                return Ok(bouncer);
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        bail!(
            "pgbouncer did not listen within 20 s: {}",
            fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
        )
    }

    /// The URL of database `db` through this PgBouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

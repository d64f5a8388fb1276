//! PgBouncer (Debian's 1.18) as a test child in front of the test PostgreSQL, run as the
//! `postgres` user when the tests run as root (PgBouncer refuses to run as root).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use copier_node::pgtmp::{prepare_dir, running_as_root};

const BINARY: &str = "/usr/sbin/pgbouncer";

/// A running PgBouncer; stopped when dropped.
pub struct PgBouncer {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // Run through `runuser`, PgBouncer is its child: stop PgBouncer itself (its pid file),
        // then the wrapper.
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pgbouncer.pid")) {
            let _ = Command::new("kill").arg(pid.trim()).status();
            // The wrapper exits once PgBouncer has (and reaps it).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            while matches!(self.child.try_wait(), Ok(None))
                && tokio::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Whether PgBouncer is installed; when it is not, a test may skip only outside CI
/// (`COPIER_REQUIRE_TOOLS` makes its absence a failure).
pub fn available() -> bool {
    let found = Path::new(BINARY).exists();
    if !found {
        assert!(
            std::env::var_os("COPIER_REQUIRE_TOOLS").is_none(),
            "pgbouncer is required (COPIER_REQUIRE_TOOLS is set) but not installed"
        );
        eprintln!("note: pgbouncer is not installed; this test is skipped here (CI installs it)");
    }
    found
}

/// (host, port, user, password) of a `postgres://user[:password]@host:port/db` URL.
fn server_of(url: &str) -> (String, String, String, Option<String>) {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let (auth, rest) = rest.split_once('@').expect("a user in the test URL");
    let (user, password) = match auth.split_once(':') {
        Some((u, p)) => (u.to_string(), Some(p.to_string())),
        None => (auth.to_string(), None),
    };
    let hostport = rest.split(['/', '?']).next().unwrap_or(rest);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "5432"));
    (host.to_string(), port.to_string(), user, password)
}

impl PgBouncer {
    /// Starts PgBouncer in `mode` (`session` or `transaction`) in front of the server of
    /// `server_url`; `ignore` lists the startup parameters it drops instead of refusing.
    pub fn start(dir: &Path, server_url: &str, mode: &str, ignore: &str) -> PgBouncer {
        prepare_dir(dir).expect("pgbouncer dir");
        let (host, port, user, password) = server_of(server_url);
        let listen = crate::support::broker::free_port();
        let password = password
            .map(|p| format!(" password={p}"))
            .unwrap_or_default();
        let ini = format!(
            "[databases]\n* = host={host} port={port} user={user}{password}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {listen}\nunix_socket_dir =\nauth_type = trust\nauth_file = {dir}/userlist.txt\npool_mode = {mode}\ndefault_pool_size = 40\nmax_client_conn = 500\nignore_startup_parameters = {ignore}\nlogfile = {dir}/pgbouncer.log\npidfile = {dir}/pgbouncer.pid\nserver_reset_query = DISCARD ALL\n",
            dir = dir.display()
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).unwrap();
        std::fs::write(dir.join("userlist.txt"), format!("\"{user}\" \"\"\n")).unwrap();
        for f in ["pgbouncer.ini", "userlist.txt"] {
            if running_as_root() {
                let _ = Command::new("chown")
                    .args(["postgres:postgres"])
                    .arg(dir.join(f))
                    .status();
            }
        }
        let mut cmd = if running_as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--", BINARY]);
            c
        } else {
            Command::new(BINARY)
        };
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting pgbouncer");
        let bouncer = PgBouncer {
            child,
            port: listen,
            dir: dir.to_path_buf(),
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", listen)).is_err() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "pgbouncer did not listen within 20 s: {}",
                std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        bouncer
    }

    /// The URL of database `db` through PgBouncer.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }
}

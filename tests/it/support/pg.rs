//! A real PostgreSQL for every test: the server `DATABASE_URL` names, or a throwaway cluster
//! started from the machine's PostgreSQL binaries and shared by every test process of this run
//! (nextest runs each test in its own process).
//!
//! The shared cluster lives in `target/tmp/copier-test-pg`. A process attaches under an
//! exclusive `flock` on `lock` (starting the cluster if it is not running) and then holds a
//! shared `flock` on `users` for its lifetime. A detached watchdog stops the cluster and deletes
//! it once nobody has held `users` for a few seconds, so a test run leaves nothing behind.
//! Each test gets its own database, cloned from a migrated template.

use std::fs::{self, File, OpenOptions};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use copier_node::db;
use copier_node::pgtmp::{Cluster, PgBinaries};
use sqlx::{ConnectOptions, Connection, Executor, PgConnection};

/// Seconds without any attached test process before the watchdog removes the shared cluster.
const IDLE_SECONDS: u32 = 8;

enum Server {
    External(String),
    Shared { cluster: Cluster, _users: File },
}

static SERVER: OnceLock<Server> = OnceLock::new();

fn server() -> &'static Server {
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => Server::External(url),
        _ => attach_shared().unwrap_or_else(|e| panic!("cannot start a test PostgreSQL: {e:#}")),
    })
}

fn attach_shared() -> anyhow::Result<Server> {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("copier-test-pg");
    fs::create_dir_all(&root)?;
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(root.join("lock"))?;
    lock.lock()?;
    let users = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(root.join("users"))?;
    let bins = PgBinaries::find()?;
    let running = fs::read_to_string(root.join("port"))
        .ok()
        .and_then(|p| p.trim().parse::<u16>().ok())
        .filter(|port| {
            root.join("pg/data/postmaster.pid").exists()
                && std::net::TcpStream::connect(("127.0.0.1", *port)).is_ok()
        });
    let cluster = match running {
        Some(port) => Cluster::attach(&bins, &root.join("pg"), port),
        None => {
            let pg = root.join("pg");
            let _ = fs::remove_dir_all(&pg);
            Cluster::init(&bins, &pg)?;
            let cluster = Cluster::start(&bins, &pg)?;
            fs::write(root.join("port"), cluster.port.to_string())?;
            spawn_watchdog(&root, &cluster)?;
            cluster
        }
    };
    users.lock_shared()?;
    drop(lock);
    Ok(Server::Shared {
        cluster,
        _users: users,
    })
}

fn spawn_watchdog(root: &std::path::Path, cluster: &Cluster) -> anyhow::Result<()> {
    let stop = cluster.stop_command("immediate");
    let mut stop_line = vec![stop.get_program().to_string_lossy().into_owned()];
    stop_line.extend(
        stop.get_args()
            .map(|a| format!("'{}'", a.to_string_lossy())),
    );
    const SCRIPT: &str = r#"
cd "$1" || exit 0
idle=0
while sleep 1; do
  if flock -n -x users true; then idle=$((idle+1)); else idle=0; fi
  [ "$idle" -lt "$3" ] && continue
  exec 9>lock
  flock -x 9
  if flock -n -x users true; then
    sh -c "$2" >/dev/null 2>&1
    rm -rf pg port
    exit 0
  fi
  exec 9>&-
  idle=0
done
"#;
    Command::new("setsid")
        .args(["sh", "-c", SCRIPT, "copier-test-pg-watchdog"])
        .arg(root)
        .arg(stop_line.join(" "))
        .arg(IDLE_SECONDS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    Ok(())
}

fn admin_url(db: &str) -> String {
    match server() {
        Server::External(url) => db::with_database(url, db),
        Server::Shared { cluster, .. } => cluster.url(db),
    }
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    /// A fresh database cloned from the migrated template.
    pub async fn new() -> TestDb {
        let template = ensure_template().await;
        TestDb::create("t", &format!("TEMPLATE {template}")).await
    }

    /// An empty database with no migrations applied.
    pub async fn empty() -> TestDb {
        TestDb::create("e", "").await
    }

    async fn create(kind: &str, options: &str) -> TestDb {
        let name = format!(
            "copier_{kind}_{}_{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let mut admin = connect(&admin_url("postgres")).await;
        admin
            .execute(format!("CREATE DATABASE {name} {options}").as_str())
            .await
            .expect("creating the test database");
        admin.close().await.ok();
        TestDb {
            url: admin_url(&name),
            name,
        }
    }

    pub async fn conn(&self) -> PgConnection {
        connect(&self.url).await
    }

    /// The server's `host:port`.
    pub fn server_addr(&self) -> String {
        split_authority(&self.url).1
    }

    /// This database's URL, reached through `127.0.0.1:port` (a chaos proxy).
    pub fn url_via(&self, port: u16) -> String {
        let (before, authority, after) = split_url(&self.url);
        let userinfo = authority
            .rsplit_once('@')
            .map(|(u, _)| format!("{u}@"))
            .unwrap_or_default();
        format!("{before}{userinfo}127.0.0.1:{port}{after}")
    }
}

/// (scheme and `://`, authority, path and query) of a URL.
fn split_url(url: &str) -> (&str, &str, &str) {
    let start = url.find("://").map(|i| i + 3).unwrap_or(0);
    let end = url[start..]
        .find(['/', '?'])
        .map(|i| start + i)
        .unwrap_or(url.len());
    (&url[..start], &url[start..end], &url[end..])
}

/// (userinfo, host:port) of a URL's authority; the port defaults to 5432.
fn split_authority(url: &str) -> (String, String) {
    let (_, authority, _) = split_url(url);
    let (user, host) = authority.rsplit_once('@').unwrap_or(("", authority));
    let host = if host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
    {
        host.to_string()
    } else {
        format!("{host}:5432")
    };
    (user.to_string(), host)
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // The shared cluster is deleted whole when the run ends; only clean up elsewhere.
        if let Server::External(_) = server() {
            let name = self.name.clone();
            let url = admin_url("postgres");
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    if let Ok(mut c) = PgConnection::connect(&url).await {
                        let _ = c
                            .execute(
                                format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str(),
                            )
                            .await;
                    }
                });
            })
            .join();
        }
    }
}

async fn connect(url: &str) -> PgConnection {
    let opts: sqlx::postgres::PgConnectOptions = url.parse().expect("test database URL");
    opts.connect()
        .await
        .unwrap_or_else(|e| panic!("connecting to the test PostgreSQL: {}", db::describe(&e)))
}

/// The migrated template, named after the migrations' text so a change makes a new one.
async fn ensure_template() -> String {
    let mut hash: u64 = 0xcbf29ce484222325;
    for (_, _, sql) in db::migrate::MIGRATIONS {
        for b in sql.bytes() {
            hash = (hash ^ b as u64).wrapping_mul(0x100000001b3);
        }
    }
    let name = format!("copier_tmpl_{hash:016x}");
    let mut admin = connect(&admin_url("postgres")).await;
    admin
        .execute("SELECT pg_advisory_lock(815001)")
        .await
        .unwrap();
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await
            .unwrap();
    if !exists {
        let building = format!("{name}_build");
        admin
            .execute(format!("DROP DATABASE IF EXISTS {building}").as_str())
            .await
            .unwrap();
        admin
            .execute(format!("CREATE DATABASE {building}").as_str())
            .await
            .unwrap();
        let mut conn = connect(&admin_url(&building)).await;
        db::migrate::apply(&mut conn)
            .await
            .expect("migrating the template");
        conn.close().await.ok();
        admin
            .execute(format!("ALTER DATABASE {building} RENAME TO {name}").as_str())
            .await
            .unwrap();
    }
    admin
        .execute("SELECT pg_advisory_unlock(815001)")
        .await
        .unwrap();
    admin.close().await.ok();
    name
}

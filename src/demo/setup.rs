//! The demo's set-up: its database, the accounts and links it seeds, and the node processes.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use sqlx::{Connection, PgConnection};
use tokio::process::{Child, Command};

use crate::credentials::CredentialsKey;
use crate::db;
use crate::pgtmp::Server;
use crate::secret::Secret;

use super::{DemoOptions, Scratch, say};

const NODE_TIMINGS: [&str; 6] = ["--lease", "3s", "--fence", "1s", "--cycle", "500ms"];

pub(super) async fn connect(url: &str) -> anyhow::Result<PgConnection> {
    Ok(db::admin_connect(&Secret::new(url)).await?)
}

/// A fresh, migrated database on `DATABASE_URL`'s server, or on a throwaway cluster.
pub(super) async fn start_database(scratch: &mut Scratch) -> anyhow::Result<String> {
    let server = Server::from_env_or_throwaway(&scratch.dir).await?;
    match &server.cluster {
        Some(cluster) => say(&format!(
            "throwaway PostgreSQL on 127.0.0.1:{}",
            cluster.port
        )),
        None => say("using the server DATABASE_URL names (a fresh database, dropped at the end)"),
    }
    let name = format!(
        "copier_demo_{}_{:06x}",
        std::process::id(),
        fastrand::u32(..0xffffff)
    );
    let url = server.fresh_database(&name).await;
    scratch.database = Some((server, name));
    url
}

/// Masters and followers with a mix of link settings. Returns (master login, follower login) of
/// every link.
pub(super) async fn seed(
    url: &str,
    broker: &str,
    options: &DemoOptions,
    key: &CredentialsKey,
) -> anyhow::Result<Vec<(String, String)>> {
    let mut conn = connect(url).await?;
    let settings = [
        ("multiplier", 1.0, false, "{}"),
        ("multiplier", 0.5, false, "{}"),
        ("fixed", 0.1, false, "{}"),
        ("multiplier", 1.0, true, "{}"),
        (
            "balance_ratio",
            1.0,
            false,
            r#"{"EURUSD": "EURUSD.m", "GBPUSD": "GBPUSD.m"}"#,
        ),
    ];
    let mut id = 1i64;
    let mut links = Vec::new();
    for m in 1..=options.masters {
        let master = id;
        id += 1;
        db::setup::add_account(&mut conn, master, "mt5", "master", broker, &format!("m{m}"))
            .await?;
        for f in 0..options.followers_per_master {
            let follower = id;
            id += 1;
            links.push((format!("m{m}"), format!("f{follower}")));
            db::setup::add_account(
                &mut conn,
                follower,
                "mt5",
                "follower",
                broker,
                &format!("f{follower}"),
            )
            .await?;
            let (mode, value, reverse, map) = settings[f % settings.len()];
            db::setup::add_link(&mut conn, master, follower, mode, value, reverse, map).await?;
        }
    }
    // A password per account (the simulated broker keeps the one an account first logged in
    // with), stored as `copier-node credentials encrypt` would.
    for id in db::setup::account_ids(&mut conn).await? {
        let value = key.encrypt(&format!("demo-password-{id}-{}", fastrand::u64(..)));
        db::setup::set_credentials(&mut conn, id, &value).await?;
    }
    let _ = conn.close().await;
    say(&format!(
        "{} masters, {} followers (multiplier, fixed, reverse, balance ratio, symbol map); broker passwords encrypted at rest",
        options.masters,
        links.len()
    ));
    Ok(links)
}

pub(super) fn spawn_node(
    exe: &Path,
    url: &str,
    key: &CredentialsKey,
    dir: &Path,
    i: usize,
    capacity: usize,
) -> anyhow::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("node-{}.log", i + 1)))?;
    Command::new(exe)
        .arg("run")
        .args([
            "--platform",
            "mt5",
            "--node-id",
            &format!("demo-n{}", i + 1),
            "--capacity",
            &capacity.to_string(),
            "--http-listen",
            "127.0.0.1:0",
        ])
        .args(NODE_TIMINGS)
        .env("COPIER_DATABASE_URL", url)
        .env("COPIER_CREDENTIALS_KEY", key.encode())
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // A process group of its own: a terminal's Ctrl-C interrupts the demo, not its nodes (the
        // demo runs its final check and stops them itself).
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
        .context("starting a node process")
}

/// The last `most` warnings and errors of each node's log (`node-<i>.log` in `dir`), each line
/// prefixed with its node: what the demo shows when its final check finds a miss, before it
/// removes everything.
pub(super) fn log_warnings(dir: &Path, nodes: usize, most: usize) -> Vec<String> {
    let mut out = Vec::new();
    for i in 1..=nodes {
        let Ok(text) = std::fs::read_to_string(dir.join(format!("node-{i}.log"))) else {
            continue;
        };
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
            .collect();
        let from = lines.len().saturating_sub(most);
        out.extend(lines[from..].iter().map(|l| format!("demo-n{i}: {l}")));
    }
    out
}

/// SIGTERM to every running node (a clean hand-off), then waits up to 15 s for each; a node
/// still running then is killed.
pub(super) async fn stop_nodes(nodes: &mut [Option<Child>]) {
    for child in nodes.iter_mut().flatten() {
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
    }
    for child in nodes.iter_mut().flatten() {
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            let _ = child.start_kill();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_check_shows_each_nodes_last_warnings_and_errors() {
        let dir = std::env::temp_dir().join(format!("copier-demo-logs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("node-1.log"),
            "2026-12-01T08:00:00Z  INFO copier_node: started\n\
             2026-12-01T08:00:01Z  WARN copier_node: first\n\
             2026-12-01T08:00:02Z ERROR copier_node: second\n\
             2026-12-01T08:00:03Z  WARN copier_node: third\n",
        )
        .unwrap();
        // Node 2 never wrote a log; node 3 only information.
        std::fs::write(
            dir.join("node-3.log"),
            "2026-12-01T08:00:00Z  INFO copier_node: fine\n",
        )
        .unwrap();
        let lines = log_warnings(&dir, 3, 2);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            lines,
            [
                "demo-n1: 2026-12-01T08:00:02Z ERROR copier_node: second",
                "demo-n1: 2026-12-01T08:00:03Z  WARN copier_node: third",
            ]
        );
    }
}

//! The machine and the floors every figure is compared with.

use std::time::Duration;

use crate::nodes::BrokerProcess;
use crate::stats::Stats;
use crate::{Options, Pg, Report};
use copier_node::broker::client::BridgeClient;
use copier_node::broker::protocol::Request;
use sqlx::{Connection, Executor, PgConnection};
use tokio::time::Instant;

pub(crate) async fn machine(report: &mut Report, pg: &Pg) {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().map(|l| l.to_string()))
        .unwrap_or_default();
    report.machine.insert("cpu".into(), cpu);
    report.machine.insert("cores".into(), cores.to_string());
    report.machine.insert(
        "memory".into(),
        mem.replace("MemTotal:", "").trim().to_string(),
    );
    if let Ok(mut c) = PgConnection::connect(&pg.admin_url).await
        && let Ok(v) = sqlx::query_scalar::<_, String>("SHOW server_version")
            .fetch_one(&mut c)
            .await
    {
        report.machine.insert("postgresql".into(), v);
    }
    report.machine.insert(
        "profile".into(),
        if cfg!(debug_assertions) {
            "debug (smoke)".into()
        } else {
            "release".into()
        },
    );
    report.machine.insert(
        "date".into(),
        String::from_utf8_lossy(
            &std::process::Command::new("date")
                .arg("-u")
                .arg("+%Y-%m-%d %H:%M UTC")
                .output()
                .map(|o| o.stdout)
                .unwrap_or_default(),
        )
        .trim()
        .to_string(),
    );
}

// ---------------------------------------------------------------------------------------------
// Floors: one PostgreSQL round trip, one single-row UPDATE, one NOTIFY delivered, one broker
// round trip (to the simulated broker in a process of its own, as every section runs it).

pub(crate) async fn floors(options: &Options, pg: &Pg, report: &mut Report) -> anyhow::Result<()> {
    let n = if options.smoke { 30 } else { 300 };
    let url = pg.database("bench_floors").await?;
    let mut conn = PgConnection::connect(&url).await?;
    let mut select = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        sqlx::query("SELECT 1").execute(&mut conn).await?;
        select.push(t.elapsed());
    }
    conn.execute("CREATE TABLE floor_row (id int PRIMARY KEY, v bigint)")
        .await?;
    conn.execute("INSERT INTO floor_row VALUES (1, 0)").await?;
    let mut update = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        sqlx::query("UPDATE floor_row SET v = $1 WHERE id = 1")
            .bind(i as i64)
            .execute(&mut conn)
            .await?;
        update.push(t.elapsed());
    }
    let mut listener = sqlx::postgres::PgListener::connect(&url).await?;
    listener.listen("bench_floor").await?;
    let mut notify = Vec::new();
    for i in 0..n.min(100) {
        let t = Instant::now();
        sqlx::query("SELECT pg_notify('bench_floor', $1)")
            .bind(i.to_string())
            .execute(&mut conn)
            .await?;
        listener.recv().await?;
        notify.push(t.elapsed());
    }
    let dir = std::env::temp_dir().join(format!("copier-bench-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let broker = BrokerProcess::start(&dir, &[]).await?;
    let client = BridgeClient::connect(broker.addr.clone(), "bench");
    client.wait_ready(Duration::from_secs(10)).await?;
    let mut broker_rt = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let _ = client.call(Request::Symbols).await;
        broker_rt.push(t.elapsed());
    }
    client.close();
    broker.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    for (name, samples) in [
        ("pg_select_1", select),
        ("pg_single_row_update", update),
        ("notify_delivery", notify),
        ("broker_round_trip", broker_rt),
    ] {
        let s = Stats::of(&samples);
        println!("floor {name}: {}", s.show());
        report.floors.insert(name.into(), s);
    }
    Ok(())
}

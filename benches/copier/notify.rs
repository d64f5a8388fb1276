//! The notification path: publication rate, delivery, a stalled listener.

use std::fmt::Write as _;
use std::time::Duration;

use crate::stats::Stats;
use crate::{Options, Pg, Report};
use anyhow::Context;
use serde::Serialize;
use sqlx::{Connection, Executor, PgConnection};
use tokio::time::Instant;

/// The notification path: publish rate, delivery to listeners, a stalled listener.
#[derive(Serialize)]
#[serde(untagged)]
pub(crate) enum NotifyRow {
    Publishers {
        publishers: usize,
        events_per_second: f64,
    },
    Listeners {
        listeners: usize,
        delivery: Stats,
    },
    Stalled {
        listeners: usize,
        stalled_listener: bool,
        delivery: Stats,
        queue_usage_after: f64,
    },
}
// ---------------------------------------------------------------------------------------------
// The notification path: publication throughput (commits carrying NOTIFY are serialised),
// delivery latency with 1, 10 and 100 listeners, and what a stalled listener does.

pub(crate) async fn notification_path(
    options: &Options,
    pg: &Pg,
    report: &mut Report,
) -> anyhow::Result<()> {
    let url = pg.database("bench_notify").await?;
    let window = if options.smoke {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(3)
    };
    let mut md = String::from("| publishers | events/s |\n|---:|---:|\n");
    for publishers in [1usize, 4, 16] {
        let mut tasks = Vec::new();
        let end = Instant::now() + window;
        for _ in 0..publishers {
            let url = url.clone();
            tasks.push(tokio::spawn(async move {
                let mut c = PgConnection::connect(&url).await?;
                let mut n = 0u64;
                while Instant::now() < end {
                    sqlx::query("SELECT pg_notify('bench_tp', 'x')")
                        .execute(&mut c)
                        .await?;
                    n += 1;
                }
                Ok::<_, anyhow::Error>(n)
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await??;
        }
        let rate = total as f64 / window.as_secs_f64();
        println!("notify throughput with {publishers} publishers: {rate:.0}/s");
        let _ = writeln!(md, "| {publishers} | {rate:.0} |");
        report.notify.push(NotifyRow::Publishers {
            publishers,
            events_per_second: rate,
        });
    }
    let mut md2 = String::from("| listeners | delivery p50 | p99 | max |\n|---:|---:|---:|---:|\n");
    let counts: &[usize] = if options.smoke {
        &[1, 10]
    } else {
        &[1, 10, 100]
    };
    let sends = if options.smoke { 10 } else { 50 };
    for &listeners in counts {
        let (samples, _) = deliveries(&url, listeners, sends, false).await?;
        let s = Stats::of(&samples);
        println!("notify delivery to {listeners} listeners: {}", s.show());
        let _ = writeln!(
            md2,
            "| {listeners} | {:.2} ms | {:.2} ms | {:.2} ms |",
            s.p50_ms, s.p99_ms, s.max_ms
        );
        report.notify.push(NotifyRow::Listeners {
            listeners,
            delivery: s,
        });
    }
    let (stalled_samples, usage) = deliveries(&url, 10, sends, true).await?;
    let st = Stats::of(&stalled_samples);
    println!(
        "with a stalled listener: delivery {}; queue usage {usage:.6}",
        st.show()
    );
    report.notify.push(NotifyRow::Stalled {
        listeners: 10,
        stalled_listener: true,
        delivery: st.clone(),
        queue_usage_after: usage,
    });
    report.markdown.push(format!(
        "## Notification path\n\nMaster events reach followers' nodes through PostgreSQL's NOTIFY: commits carrying a NOTIFY are serialised on one lock, so this is the ceiling on events per second across all masters ({}s windows, each publisher an autocommit `pg_notify`, with no connection listening on the channel: \"Events per database\" measures the same bare `pg_notify` with a listener reading the notices, as a node's would, which PostgreSQL must signal at each commit).\n\n{md}\nDelivery latency, from sending the NOTIFY to its arrival at each listening connection ({sends} notifications, every listener a sample):\n\n{md2}\nA stalled listener (a connection that LISTENs and stops reading): the others' delivery stays {} ms p50 / {} ms p99, so a node that stops reading its LISTEN connection delays no one. `pg_notification_queue_usage()` after the run: {usage:.6}; at this volume the stalled connection's socket buffers absorbed everything. A listener stalled for long holds back the tail of PostgreSQL's shared queue (as its documentation says), and when the 8 GB queue fills every NOTIFY fails: the node's hub reads continuously, and on an error logs `LISTEN connection lost; reconnecting` and reconnects (the next reconcile repairs what it missed).\n",
        window.as_secs_f64(),
        (st.p50_ms * 100.0).round() / 100.0,
        (st.p99_ms * 100.0).round() / 100.0
    ));
    Ok(())
}

/// Sends `sends` notifications to `listeners` connections; optionally one more connection
/// listens and never reads. Returns every delivery latency and the queue usage at the end.
pub(crate) async fn deliveries(
    url: &str,
    listeners: usize,
    sends: usize,
    stalled: bool,
) -> anyhow::Result<(Vec<Duration>, f64)> {
    let channel = format!("bench_delivery_{listeners}_{stalled}");
    let _stall = if stalled {
        let mut c = PgConnection::connect(url).await?;
        c.execute(format!("LISTEN {channel}").as_str()).await?;
        Some(c)
    } else {
        None
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Instant)>();
    let mut tasks = Vec::new();
    for _ in 0..listeners {
        let mut l = sqlx::postgres::PgListener::connect(url).await?;
        l.listen(&channel).await?;
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..sends {
                let n = l.recv().await?;
                let _ = tx.send((n.payload().parse().unwrap_or(0), Instant::now()));
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    let mut sender = PgConnection::connect(url).await?;
    let mut sent_at = Vec::new();
    for i in 0..sends {
        sent_at.push(Instant::now());
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&channel)
            .bind(i.to_string())
            .execute(&mut sender)
            .await?;
        tokio::time::sleep(Duration::from_millis(5)).await; // spacing, so each delivery is measured on its own
    }
    let mut samples = Vec::new();
    for _ in 0..(listeners * sends) {
        let (i, at) = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .context("deliveries")?
            .context("listener ended")?;
        samples.push(at.saturating_duration_since(sent_at[i]));
    }
    for t in tasks {
        t.await??;
    }
    let usage: f64 = sqlx::query_scalar("SELECT pg_notification_queue_usage()")
        .fetch_one(&mut sender)
        .await?;
    Ok((samples, usage))
}

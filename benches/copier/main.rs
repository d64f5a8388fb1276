//! copier-node benchmarks: copy latency (over the bridge and over FIX), lease-cycle cost, claim storms, failover and handoff,
//! cost per account, the notification path, events per database, events without LISTEN and the cycle through PgBouncer, each beside a floor
//! measured in the same run.
//!
//!   cargo bench --bench copier                  # the full run: writes BENCHMARKS.md, benchmarks.json
//!   cargo test --bench copier -- --smoke        # a small version of every benchmark (CI)
//!   cargo bench --bench copier -- --only cycle  # one section (floors, cycle, storm, copy,
//!                                               #   fix, failover, handoff, rebalance, cost,
//!                                               #   notify, events, poll, pooler, scale)
//!   cargo bench --bench copier -- --only pooler,scale
//!                                               # several sections, in the full run's order,
//!                                               #   in one process on one cluster
//!   cargo bench --bench copier -- --only copy --rows 100x1,1000x1 --trades 40
//!                                               # chosen copy rows (followers x nodes)
//!   cargo bench --bench copier -- --only scale --scale-rows 1
//!                                               # chosen scale runs (by index)
//!   COPIER_BENCH_NODE=/path/to/other/copier-node cargo bench ...
//!                                               # node processes of another build (A/B runs)
//!
//! Everything it needs starts here: a throwaway PostgreSQL cluster (or the server DATABASE_URL
//! names), the simulated broker and node processes of the real binary, each a process of its
//! own, and for the floor of N orders sender processes (this executable again, `--floor-sender`).

mod copy;
mod cost;
mod cycle;
mod events;
mod failover;
mod fix;
mod floors;
mod handoff;
mod legs;
mod nodes;
mod notify;
mod orders_floor;
mod poll;
mod pooler;
mod rebalance;
mod scale;
mod stats;
mod storm;
mod trades;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use copier_node::pgtmp::{Server, prepare_dir};
use serde::Serialize;

use copy::{CopyRow, copy_latency};
use cost::{CostRow, cost_per_account};
use cycle::{CycleRow, lease_cycle};
use events::{EventsRow, events};
use failover::{FailoverRow, failover};
use fix::{FixHandoffRow, FixRow, fix_handoff, fix_latency};
use floors::{floors, machine};
use handoff::{HandoffRow, handoff};
use notify::{NotifyRow, notification_path};
use poll::{PollCostRow, PollRow, poll_latency};
use pooler::{PoolerRow, pooler};
use rebalance::{RebalanceRow, rebalance};
use scale::{ScaleRow, scale};
use stats::Stats;
use storm::{StormRow, claim_storm};

pub(crate) struct Options {
    smoke: bool,
    only: Option<String>,
    out: PathBuf,
    /// `--rows 100x1,1000x1`: the copy section's (followers, nodes) rows only, for quick runs
    /// while working on the fan-out (with `--only copy`).
    rows: Option<Vec<(usize, usize)>>,
    /// `--trades N`: the copy section's master opens per row.
    trades: Option<usize>,
    /// `--scale-rows 1,2`: the scale section's runs by their index (0: 20,000 over 4 nodes; 1
    /// and 2: 100,000 over 10 at the default and the short timing; 3: the search for the largest
    /// count served with every goal met), for quick runs while working on one (with
    /// `--only scale`).
    scale_rows: Option<Vec<usize>>,
}

#[derive(Default, Serialize)]
pub(crate) struct Report {
    machine: BTreeMap<String, String>,
    floors: BTreeMap<String, Stats>,
    cycle: Vec<CycleRow>,
    storm: Vec<StormRow>,
    copy: Vec<CopyRow>,
    fix: Vec<FixRow>,
    fix_handoff: Vec<FixHandoffRow>,
    failover: Vec<FailoverRow>,
    handoff: Vec<HandoffRow>,
    rebalance: Vec<RebalanceRow>,
    cost: Vec<CostRow>,
    notify: Vec<NotifyRow>,
    events: Vec<EventsRow>,
    poll: Vec<PollRow>,
    poll_cost: Vec<PollCostRow>,
    pooler: Vec<PoolerRow>,
    scale: Vec<ScaleRow>,
    scale_search: Option<scale::Search>,
    markdown: Vec<String>,
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).is_some_and(|a| a == "--floor-sender") {
        orders_floor::sender_main(&args[2..]);
    }
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let smoke = args.iter().any(|a| a == "--smoke");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let only = value("--only");
    // Only a full run of every section replaces the published results.
    let out = value("--out").map(PathBuf::from).unwrap_or_else(|| {
        if smoke {
            root.join("target/bench-smoke")
        } else if only.is_some() {
            root.join("target/bench-only")
        } else {
            root.clone()
        }
    });
    let rows = value("--rows").map(|r| {
        r.split(',')
            .map(|row| {
                let (f, n) = row.split_once('x').expect("--rows: FOLLOWERSxNODES,...");
                (
                    f.parse().expect("--rows: followers"),
                    n.parse().expect("--rows: nodes"),
                )
            })
            .collect()
    });
    let trades = value("--trades").map(|t| t.parse().expect("--trades: a count"));
    let scale_rows = value("--scale-rows").map(|r| {
        r.split(',')
            .map(|i| i.parse().expect("--scale-rows: indices, as 1,2"))
            .collect()
    });
    let options = Options {
        smoke,
        only,
        out,
        rows,
        trades,
        scale_rows,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    if let Err(e) = runtime.block_on(run(options)) {
        eprintln!("benchmark failed: {e:#}");
        std::process::exit(1);
    }
}

/// The server the benchmarks run on (`DATABASE_URL`'s, or a throwaway cluster) and the scratch
/// directory of the throwaway one.
pub(crate) struct Pg {
    admin_url: String,
    server: Server,
    dir: PathBuf,
}

impl Drop for Pg {
    fn drop(&mut self) {
        if let Some(cluster) = self.server.cluster.take() {
            let _ = cluster.stop("immediate");
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Pg {
    async fn start() -> anyhow::Result<Pg> {
        let dir = std::env::temp_dir().join(format!("copier-bench-{}", std::process::id()));
        prepare_dir(&dir)?;
        let server = Server::from_env_or_throwaway(&dir).await?;
        Ok(Pg {
            admin_url: server.admin_url.clone(),
            server,
            dir,
        })
    }

    /// A fresh migrated database; returns its URL.
    async fn database(&self, name: &str) -> anyhow::Result<String> {
        self.server.fresh_database(name).await
    }
}

/// Whether `section` runs: every section in a full run, else those `--only` names (one, or
/// several separated by commas).
pub(crate) fn wanted(options: &Options, section: &str) -> bool {
    options
        .only
        .as_deref()
        .is_none_or(|o| o.split(',').any(|s| s.trim() == section))
}

async fn run(options: Options) -> anyhow::Result<()> {
    std::fs::create_dir_all(&options.out)?;
    let pg = Pg::start().await?;
    let mut report = Report::default();
    machine(&mut report, &pg).await;
    floors(&options, &pg, &mut report).await?;
    if wanted(&options, "cycle") {
        lease_cycle(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "storm") {
        claim_storm(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "copy") {
        copy_latency(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "fix") {
        fix_latency(&options, &pg, &mut report).await?;
        fix_handoff(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "failover") {
        failover(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "handoff") {
        handoff(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "rebalance") {
        rebalance(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "cost") {
        cost_per_account(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "notify") {
        notification_path(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "events") {
        events(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "poll") {
        poll_latency(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "pooler") {
        pooler(&options, &pg, &mut report).await?;
    }
    if wanted(&options, "scale") {
        scale(&options, &pg, &mut report).await?;
    }
    write(&options, &report)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------

fn write(options: &Options, report: &Report) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(options.out.join("benchmarks.json"), json)?;
    let mut md = String::from("# Benchmarks\n\n");
    let _ = writeln!(
        md,
        "Measured by `cargo bench --bench copier` (the harness is `benches/copier/`, a module per section; raw figures in `benchmarks.json`). Every figure is a median (p50) and a tail (p99) over repeated runs, with the run count, beside a floor measured in the same run. Reproduce with the same command; `-- --only <section>` runs one section (its results go to `target/bench-only/`).\n"
    );
    let _ = writeln!(
        md,
        "Machine: {} ({} cores, {} memory), PostgreSQL {}, {} build, {}. Everything runs on this one machine: PostgreSQL (a throwaway cluster with `fsync = off` and `full_page_writes = off`, so a commit waits for the WAL write but not for the disk; the floors are measured on the same cluster), the simulated broker, the node processes and the benchmark itself share its cores.\n",
        report.machine.get("cpu").cloned().unwrap_or_default(),
        report.machine.get("cores").cloned().unwrap_or_default(),
        report.machine.get("memory").cloned().unwrap_or_default(),
        report
            .machine
            .get("postgresql")
            .cloned()
            .unwrap_or_default(),
        report.machine.get("profile").cloned().unwrap_or_default(),
        report.machine.get("date").cloned().unwrap_or_default()
    );
    md.push_str("## Floors\n\n| floor | p50 / p99 | runs |\n|---|---:|---:|\n");
    for (name, s) in &report.floors {
        let _ = writeln!(md, "| {name} | {} | {} |", s.show(), s.runs);
    }
    md.push('\n');
    for section in &report.markdown {
        md.push_str(section);
        md.push('\n');
    }
    std::fs::write(options.out.join("BENCHMARKS.md"), md)?;
    println!("wrote {}", options.out.join("BENCHMARKS.md").display());
    Ok(())
}

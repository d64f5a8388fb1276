//! Runs the deterministic simulator of the lease protocol outside the test suite: the scale run
//! (`--nodes 1000 --accounts 1000000 --minutes 60`), the long run (`--seeds 1000000` or
//! `--hours 2`, whichever ends first), or one seed with its trace (`--seed <n> --trace`).
//!
//! `cargo run --release --example simulate -- --help`

use std::time::Duration;

use tokio::time::Instant;

use clap::Parser;
use copier_node::sim::world::{self, Config, Faults, Report};

#[derive(Parser)]
#[command(about = "The lease protocol under deterministic simulation")]
struct Args {
    /// Replay one schedule (with --trace, print its events on failure).
    #[arg(long)]
    seed: Option<u64>,
    /// How many random schedules to run.
    #[arg(long, default_value_t = 1000)]
    seeds: u64,
    /// Stop starting schedules after this many hours.
    #[arg(long)]
    hours: Option<f64>,
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    #[arg(long, default_value_t = 24)]
    accounts: i64,
    #[arg(long, default_value_t = 16)]
    capacity: u32,
    /// Simulated minutes per schedule (faults in the first half).
    #[arg(long, default_value_t = 4.0)]
    minutes: f64,
    /// Lease, fence and cycle in seconds.
    #[arg(long, default_value_t = 20.0)]
    lease: f64,
    #[arg(long, default_value_t = 5.0)]
    fence: f64,
    #[arg(long, default_value_t = 5.0)]
    cycle: f64,
    /// Faults: `all` (every kind, often); `scale` (crashes, pauses, stalls, lost replies and
    /// notifications, at rates per node that suit a thousand nodes; no failovers, whose lost
    /// tails need a copy of the database per commit); `scale-all` (the scale rates with
    /// database failovers, joins and leaves as well, for the long scale run).
    #[arg(long, default_value = "all")]
    faults: String,
    /// No orders (the model broker stays idle; for the scale run).
    #[arg(long)]
    no_orders: bool,
    #[arg(long)]
    trace: bool,
    #[arg(long)]
    threads: Option<usize>,
    /// Derive every schedule's seed from this one (drawn and printed when absent), so that a
    /// run is repeated exactly by `--master-seed S --seeds N` with the same shape options.
    #[arg(long)]
    master_seed: Option<u64>,
    /// Write the run's report here (JSON): the command, commit, master seed, schedules, faults
    /// by kind, invariant checks and wall time (`reports/simulation/` holds the committed ones).
    #[arg(long, value_name = "PATH")]
    report: Option<std::path::PathBuf>,
    /// Run the same schedules again with every peer woken by every release announcement (the
    /// rule before the hubs chose whom a release wakes) and print its cycles and
    /// release-to-owner times after this run's; with `--report`, written beside them: the herd
    /// reports' floor.
    #[arg(long)]
    with_every_peer_woken: bool,
    /// Search where S1 first breaks, for several leases and fences: the slowest clock rate and
    /// the longest pause between a gate check and its order (200 schedules a point).
    #[arg(long)]
    envelope: bool,
}

/// The commit the run started from and whether the tree had changes then (read at the start: a
/// long run's tree may change before its report is written).
static SOURCE: std::sync::OnceLock<(Option<String>, bool)> = std::sync::OnceLock::new();

fn git(args: &[&str]) -> Option<String> {
    std::process::Command::new("git")
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn main() {
    let a = Args::parse();
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    let _ = SOURCE.set((git(&["rev-parse", "--short", "HEAD"]), dirty));
    let faults = match a.faults.as_str() {
        "all" => Faults::all(),
        "scale" => Faults {
            pause_per_s: 0.0002,
            crash_per_s: 0.0001,
            leave_per_s: 0.01,
            join_per_s: 0.0,
            stall_per_s: 0.002,
            stall_max: Duration::from_secs(4),
            failover_per_s: 0.0,
            lost_tail_max: Duration::ZERO,
            toggle_per_s: 0.02,
            ..Faults::all()
        },
        // A few failovers, tens of joins and leaves in half an hour of faults, whatever the size.
        "scale-all" => Faults {
            pause_per_s: 0.0002,
            crash_per_s: 0.0001,
            leave_per_s: 0.01,
            join_per_s: 0.01,
            stall_per_s: 0.002,
            stall_max: Duration::from_secs(4),
            failover_per_s: 0.01,
            lost_tail_max: Duration::from_secs(3),
            toggle_per_s: 0.02,
            ..Faults::all()
        },
        "none" => Faults::none(),
        other => panic!("--faults is all, scale, scale-all or none, not {other}"),
    };
    let duration = Duration::from_secs_f64(a.minutes * 60.0);
    let cfg = Config {
        nodes: a.nodes,
        max_nodes: a.nodes + a.nodes.div_ceil(2),
        accounts: a.accounts,
        capacity: a.capacity,
        lease: Duration::from_secs_f64(a.lease),
        fence: Duration::from_secs_f64(a.fence),
        cycle: Duration::from_secs_f64(a.cycle),
        duration,
        faults_until: duration / 2,
        faults,
        orders: !a.no_orders,
        trace: a.trace,
        progress: a.seed.is_some(),
        // The scale run's failovers go back to a state kept every 200 ms (a copy of the whole
        // database after every commit would not fit at that size).
        history_every: if a.faults == "scale-all" {
            Duration::from_millis(200)
        } else {
            Duration::ZERO
        },
        ..Config::small()
    };
    if a.envelope {
        envelope(a.threads);
        return;
    }
    if let Some(seed) = a.seed {
        let started = Instant::now();
        match world::run(seed, &cfg) {
            Ok(r) => {
                let wall = started.elapsed();
                print(&r, 1, wall, cfg.cycle);
                println!(
                    "settled {} s after the faults healed",
                    r.settled_after.map_or("-".into(), |s| format!("{s:.1}"))
                );
                // The floor a report's cycles compare with, by the same instrument: the same
                // shape and seed without faults (its cold start, then its steady rate).
                let steady = (a.report.is_some() && a.faults != "none").then(|| {
                    let calm = Config {
                        faults: Faults::none(),
                        ..cfg.clone()
                    };
                    world::run(seed, &calm).unwrap_or_else(|v| {
                        eprintln!("seed {seed} without faults: {v}");
                        std::process::exit(1);
                    })
                });
                let woken = every_peer_woken(&a, &cfg, &[seed], 1);
                write_report(&a, Seeds::One(seed), 1, &r, wall, steady.as_ref(), woken);
            }
            Err(v) => {
                eprintln!("seed {seed}: {v}");
                std::process::exit(1);
            }
        }
        print_memory();
        return;
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let master = a.master_seed.unwrap_or_else(|| fastrand::u64(..));
    println!("master seed {master}");
    let mut seed_source = fastrand::Rng::with_seed(master);
    let started = Instant::now();
    let stop = a
        .hours
        .map(|h| started + Duration::from_secs_f64(h * 3600.0));
    let mut total = Report::default();
    let mut done = 0u64;
    let mut drawn = Vec::new();
    // Batches, so a time limit ends the run between them.
    while done < a.seeds && stop.is_none_or(|s| Instant::now() < s) {
        let n = (a.seeds - done).min(10_000);
        let seeds: Vec<u64> = (0..n).map(|_| seed_source.u64(..)).collect();
        if a.with_every_peer_woken {
            drawn.extend_from_slice(&seeds);
        }
        match world::explore(&seeds, &cfg, threads) {
            Ok(r) => total.add(&r),
            Err((seed, v)) => {
                eprintln!("seed {seed}: {v}");
                eprintln!(
                    "replay: cargo run --release --example simulate -- --seed {seed} --trace (with the same shape options)"
                );
                std::process::exit(1);
            }
        }
        done += n;
        print(&total, done, started.elapsed(), cfg.cycle);
    }
    println!("repeat: --master-seed {master} --seeds {done} (with the same shape options)");
    print_memory();
    let wall = started.elapsed();
    let woken = every_peer_woken(&a, &cfg, &drawn, threads);
    write_report(&a, Seeds::Master(master), done, &total, wall, None, woken);
}

/// The same schedules with every peer woken by every release announcement
/// (`--with-every-peer-woken`): the floor the herd reports' release-to-owner times are set
/// against, and its wall time.
fn every_peer_woken(
    a: &Args,
    cfg: &Config,
    seeds: &[u64],
    threads: usize,
) -> Option<(Report, Duration)> {
    if !a.with_every_peer_woken {
        return None;
    }
    let started = Instant::now();
    let woken = Config {
        wake_every_peer: true,
        progress: false,
        ..cfg.clone()
    };
    let r = world::explore(seeds, &woken, threads).unwrap_or_else(|(seed, v)| {
        eprintln!("seed {seed} with every peer woken: {v}");
        std::process::exit(1);
    });
    let wall = started.elapsed();
    println!("the same schedules, every peer woken by every release announcement:");
    print(&r, seeds.len() as u64, wall, cfg.cycle);
    Some((r, wall))
}

/// Where a run's schedules came from.
#[derive(Clone, Copy)]
enum Seeds {
    /// One schedule (`--seed`).
    One(u64),
    /// Schedules whose seeds a master seed drew.
    Master(u64),
}

/// Writes the report `--report` asks for (and nothing without it).
/// `steady`: the same schedule without faults, when it ran.
fn write_report(
    a: &Args,
    seeds: Seeds,
    schedules: u64,
    r: &Report,
    wall: Duration,
    steady: Option<&Report>,
    woken: Option<(Report, Duration)>,
) {
    let Some(path) = &a.report else {
        return;
    };
    let report = report_json(a, seeds, schedules, r, wall, steady, woken.as_ref());
    let text = serde_json::to_string_pretty(&report).expect("a report is JSON") + "\n";
    if let Err(e) = std::fs::write(path, text) {
        eprintln!("writing the report to {}: {e}", path.display());
        std::process::exit(1);
    }
    println!("report: {}", path.display());
}

/// The run's report: enough to repeat it (command, commit, master seed, schedule count) and
/// what it found (faults by kind, invariant checks, no violation: a violation exits before).
fn report_json(
    a: &Args,
    seeds: Seeds,
    schedules: u64,
    r: &Report,
    wall: Duration,
    steady: Option<&Report>,
    woken: Option<&(Report, Duration)>,
) -> serde_json::Value {
    let (commit, dirty) = SOURCE.get().cloned().unwrap_or_default();
    let cycle = Duration::from_secs_f64(a.cycle);
    let rate = |r: f64| (r * 1000.0).round() / 1000.0;
    let args: Vec<String> = std::env::args().skip(1).collect();
    serde_json::json!({
        "command": format!("cargo run --release --example simulate -- {}", args.join(" ")),
        "repeat": match seeds {
            Seeds::One(seed) => format!(
                "cargo run --release --example simulate -- --seed {seed} {}",
                shape_args(a)
            ),
            Seeds::Master(master) => format!(
                "cargo run --release --example simulate -- --master-seed {master} --seeds {schedules} {}",
                shape_args(a)
            ),
        },
        "commit": commit,
        "uncommitted_changes": dirty,
        "master_seed": match seeds { Seeds::Master(m) => Some(m), Seeds::One(_) => None },
        "seed": match seeds { Seeds::One(s) => Some(s), Seeds::Master(_) => None },
        "settled_after_s": r.settled_after,
        "schedules": schedules,
        "wall_s": (wall.as_secs_f64() * 10.0).round() / 10.0,
        "shape": {
            "nodes": a.nodes, "accounts": a.accounts, "capacity": a.capacity,
            "minutes": a.minutes, "lease_s": a.lease, "fence_s": a.fence, "cycle_s": a.cycle,
            "faults": a.faults, "orders": !a.no_orders,
        },
        "events": r.events,
        "cycles": r.cycles,
        "orders": r.orders,
        "invariant_checks": r.checks,
        "faults": r.faults,
        "faults_total": r.faults_total(),
        "cycles_per_period": rate(r.cycles_per_period(cycle)),
        "cycles_per_period_after_faults": rate(r.calm_cycles_per_period(cycle)),
        // The same shape and seed without faults: its rates over the run and over the half
        // that was fault-free in this run (the steady rate).
        "without_faults": steady.map(|s| serde_json::json!({
            "cycles_per_period": rate(s.cycles_per_period(cycle)),
            "cycles_per_period_second_half": rate(s.calm_cycles_per_period(cycle)),
        })),
        // The same schedules with every peer woken by every release announcement.
        "every_peer_woken": woken.map(|(w, wall)| serde_json::json!({
            "cycles_per_period": rate(w.cycles_per_period(cycle)),
            "cycles_per_period_after_faults": rate(w.calm_cycles_per_period(cycle)),
            "release_to_owner_ms": release_to_owner(w),
            "wall_s": (wall.as_secs_f64() * 10.0).round() / 10.0,
        })),
        "cycles_by_cause": r.cycles_by_cause,
        "cycles_by_cause_after_faults": r.calm_cycles_by_cause,
        "release_to_owner_ms": release_to_owner(r),
        "violations": 0,
        "peak_memory_kib": peak_memory_kib(),
    })
}

/// How soon released accounts were owned again, in a report.
fn release_to_owner(r: &Report) -> serde_json::Value {
    serde_json::json!({
        "releases": r.release_to_owner_ms.values().sum::<u64>(),
        "p50": r.release_to_owner_quantile(0.5),
        "p99": r.release_to_owner_quantile(0.99),
        "max": (!r.release_to_owner_ms.is_empty()).then_some(r.release_to_owner_max_ms),
        "unowned_account_s": (r.release_to_owner_sum_ms as f64 / 100.0).round() / 10.0,
        "named": r.releases_named,
        "claimed_by_named": r.claimed_by_named,
    })
}

/// The options that shape a schedule, as they were given.
fn shape_args(a: &Args) -> String {
    let mut out = format!(
        "--nodes {} --accounts {} --capacity {} --minutes {} --lease {} --fence {} --cycle {} --faults {}",
        a.nodes, a.accounts, a.capacity, a.minutes, a.lease, a.fence, a.cycle, a.faults
    );
    if a.no_orders {
        out.push_str(" --no-orders");
    }
    if a.with_every_peer_woken {
        out.push_str(" --with-every-peer-woken");
    }
    out
}

fn peak_memory_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM"))?;
    line.trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

fn print(r: &Report, schedules: u64, wall: Duration, cycle: Duration) {
    let secs = wall.as_secs_f64();
    println!(
        "{schedules} schedules in {secs:.1} s ({:.0} per second): {} events, {} cycles, {} orders, {} faults {:?}, {} invariant checks, no violation",
        schedules as f64 / secs,
        r.events,
        r.cycles,
        r.orders,
        r.faults_total(),
        r.faults,
        r.checks
    );
    println!(
        "{} releases owned again ({} named a receiver, {} claimed by it): p50 {} ms, p99 {} ms after the release; {:.3} cycles per node per period ({:.3} once the faults were over)",
        r.release_to_owner_ms.values().sum::<u64>(),
        r.releases_named,
        r.claimed_by_named,
        r.release_to_owner_quantile(0.5)
            .map_or("-".into(), |v| v.to_string()),
        r.release_to_owner_quantile(0.99)
            .map_or("-".into(), |v| v.to_string()),
        r.cycles_per_period(cycle),
        r.calm_cycles_per_period(cycle)
    );
    println!(
        "cycles by cause: {:?} (once the faults were over: {:?})",
        r.cycles_by_cause, r.calm_cycles_by_cause
    );
}

/// The process's peak resident memory, from /proc (Linux).
fn print_memory() {
    if let Ok(status) = std::fs::read_to_string("/proc/self/status")
        && let Some(line) = status.lines().find(|l| l.starts_with("VmHWM"))
    {
        println!("peak memory: {}", line.trim_start_matches("VmHWM:").trim());
    }
}

/// Whether any of `n` schedules breaks S1 (gates or journal) under `cfg`; how many.
fn breaks(cfg: &Config, n: u64, threads: usize) -> usize {
    let per = n.div_ceil(threads as u64);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads as u64)
            .map(|t| {
                scope.spawn(move || {
                    (t * per..((t + 1) * per).min(n))
                        .filter(|seed| {
                            matches!(world::run(*seed, cfg), Err(v) if matches!(v.invariant, "S1" | "journal"))
                        })
                        .count()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().expect("worker")).sum()
    })
}

fn envelope(threads: Option<usize>) {
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(2, |n| n.get()));
    let mut faults = Faults::all();
    faults.failover_per_s = 0.0;
    println!(
        "| lease | fence | cycle | analysis: rate > (lease - fence) / lease | slowest rate without a break | first rate with one | longest check-to-send pause without a break | first with one |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (lease, fence, cycle) in [(20u64, 5u64, 5u64), (60, 15, 20), (30, 10, 10), (20, 2, 5)] {
        let base = Config {
            lease: Duration::from_secs(lease),
            fence: Duration::from_secs(fence),
            cycle: Duration::from_secs(cycle),
            duration: Duration::from_secs(lease * 12),
            faults_until: Duration::from_secs(lease * 6),
            clock_spread: 0.0,
            check_liveness: false,
            faults: faults.clone(),
            ..Config::small()
        };
        let bound = (lease - fence) as f64 / lease as f64;
        let (mut ok_rate, mut bad_rate) = (1.0, None);
        let mut rate = 1.0f64;
        while rate > 0.4 {
            let cfg = Config {
                n0_rate: Some(rate),
                ..base.clone()
            };
            if breaks(&cfg, 200, threads) > 0 {
                bad_rate = Some(rate);
                break;
            }
            ok_rate = rate;
            rate -= 0.01;
        }
        let mut pauses = Faults::all();
        pauses.failover_per_s = 0.0;
        pauses.pause_per_s = 0.0;
        let (mut ok_pause, mut bad_pause) = (0.0, None);
        let mut pause = fence as f64 / 4.0;
        while pause <= fence as f64 * 6.0 {
            let cfg = Config {
                check_to_send: Duration::from_secs_f64(pause),
                faults: pauses.clone(),
                ..base.clone()
            };
            if breaks(&cfg, 200, threads) > 0 {
                bad_pause = Some(pause);
                break;
            }
            ok_pause = pause;
            pause += fence as f64 / 4.0;
        }
        println!(
            "| {lease} s | {fence} s | {cycle} s | {bound:.3} | {ok_rate:.2} | {} | {ok_pause:.2} s | {} |",
            bad_rate.map_or("none to 0.4".into(), |r| format!("{r:.2}")),
            bad_pause.map_or("none".into(), |p| format!("{p:.2} s"))
        );
    }
}

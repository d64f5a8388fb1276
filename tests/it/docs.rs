//! The documentation says what the code does: rendered figures match the committed artefacts
//! they come from, the configuration reference lists exactly the keys the code accepts with the
//! code's defaults, the CLI reference is the clap definition's own help, every command line in
//! the docs parses, the tests the guarantees cite exist, and the tutorial's shell blocks run.
//!
//! `COPIER_RENDER=write cargo nextest run -E 'test(/docs::/)'` rewrites what is generated (the
//! marked blocks of README.md and docs/, and docs/cli.md) from the code and `benchmarks.json`;
//! without it, a difference fails with the command to run.

use std::path::{Path, PathBuf};

use clap::CommandFactory;
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn writing() -> bool {
    std::env::var("COPIER_RENDER").is_ok_and(|v| v == "write")
}

/// Checks `path` holds `want` (or writes it when rendering).
fn generated(path: &Path, want: &str) {
    let have = std::fs::read_to_string(path).unwrap_or_default();
    if have == want {
        return;
    }
    if writing() {
        std::fs::write(path, want).unwrap();
        return;
    }
    panic!(
        "{} is out of date with what it is generated from; run \
         `COPIER_RENDER=write cargo nextest run -E 'test(/docs::/)'` and commit the result",
        path.display()
    );
}

/// A figure in milliseconds as the tables print it.
fn ms(v: &Value) -> String {
    let x = v.as_f64().unwrap_or(f64::NAN);
    if x >= 100.0 {
        format!("{x:.0} ms")
    } else {
        format!("{x:.2} ms")
    }
}

fn find(list: &Value, pred: impl Fn(&Value) -> bool) -> &Value {
    list.as_array()
        .and_then(|l| l.iter().find(|v| pred(v)))
        .unwrap_or(&Value::Null)
}

/// The README's headline table, from `benchmarks.json`.
fn headline(b: &Value) -> String {
    let copy = |followers: i64, nodes: i64| {
        find(&b["copy"], |r| {
            r["followers"] == followers && r["nodes"] == nodes
        })
    };
    let mut rows: Vec<(String, String, String)> = Vec::new();
    let one = copy(1, 1);
    rows.push((
        "a copy, one follower (master's fill to the copy's, broker's clock)".into(),
        format!(
            "{} / {}",
            ms(&one["latency_journal"]["p50_ms"]),
            ms(&one["latency_journal"]["p99_ms"])
        ),
        "Copy latency".into(),
    ));
    for (followers, nodes) in [(100, 4), (1000, 4)] {
        let r = copy(followers, nodes);
        let last = r["last_follower_journal"]["p50_ms"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let floor = r["orders_floor_journal_last"]["p50_ms"]
            .as_f64()
            .unwrap_or(f64::NAN);
        rows.push((
            format!("the last of {followers} followers served, {nodes} nodes (broker's clock)"),
            format!(
                "{} ({:.1}× the floor of {followers} orders)",
                ms(&r["last_follower_journal"]["p50_ms"]),
                last / floor
            ),
            "The floor for N orders".into(),
        ));
    }
    let kill = find(&b["failover"], |r| r["fault"] == "kill -9");
    rows.push((
        format!(
            "every follower served by another node after kill -9 (lease {} s)",
            kill["lease_ms"].as_f64().unwrap_or(f64::NAN) / 1000.0
        ),
        ms(&kill["served_again"]["p50_ms"]),
        "Failover and handoff".into(),
    ));
    let cycle = find(&b["cycle"], |r| {
        r["table_rows"] == 1_000_000 && r["owned"] == 10_000
    });
    rows.push((
        "a lease cycle owning 10,000 of 1,000,000 rows".into(),
        format!(
            "{} / {}",
            ms(&cycle["node"]["p50_ms"]),
            ms(&cycle["node"]["p99_ms"])
        ),
        "Lease cycle".into(),
    ));
    let cost = find(&b["cost"], |r| r["accounts"] == 10_000);
    rows.push((
        "memory per live account (10,000 on one node)".into(),
        format!(
            "{:.1} KiB",
            cost["rss_bytes_per_account"].as_f64().unwrap_or(f64::NAN) / 1024.0
        ),
        "Cost per account".into(),
    ));
    let mut out = format!(
        "Measured {} on {} ({} cores); p50 / p99 where two figures are given.\n\n\
         | what | measured | section of BENCHMARKS.md |\n| --- | ---: | --- |\n",
        b["machine"]["date"].as_str().unwrap_or("?"),
        b["machine"]["cpu"].as_str().unwrap_or("?"),
        b["machine"]["cores"]
            .as_str()
            .map_or_else(|| b["machine"]["cores"].to_string(), str::to_string)
    );
    for (what, figure, section) in rows {
        let anchor = section.to_lowercase().replace(' ', "-");
        out.push_str(&format!(
            "| {what} | {figure} | [{section}](BENCHMARKS.md#{anchor}) |\n"
        ));
    }
    out
}

/// Replaces the body of every `<!-- render:NAME -->` ... `<!-- /render -->` block.
fn render_blocks(text: &str, mut render: impl FnMut(&str) -> String) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("<!-- render:") {
        let head_end = rest[at..].find("-->").expect("a closed marker") + at + 3;
        let name = rest[at + "<!-- render:".len()..head_end - 3].trim();
        let close = rest[head_end..]
            .find("<!-- /render -->")
            .expect("every render block is closed")
            + head_end;
        out.push_str(&rest[..head_end]);
        out.push('\n');
        out.push_str(&render(name));
        rest = &rest[close..];
    }
    out.push_str(rest);
    out
}

/// Markdown files of the repository a reader meets.
fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let mut stack = vec![root().join("docs")];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "md") {
                files.push(p);
            }
        }
    }
    files.sort();
    files
}

/// The committed simulation reports (`reports/simulation/*.json`) by file name, sorted, parsed.
fn simulation_report_files() -> Vec<(String, Value)> {
    let dir = root().join("reports/simulation");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let r: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (path.file_name().unwrap().to_string_lossy().into_owned(), r)
        })
        .collect()
}

/// What the committed simulation reports that carry them say of release announcements: cycles
/// per node per period, over the run and once its faults were over, and beside them the same
/// shape and seed without faults (the floor: over its run, and over the half that was
/// fault-free in the faulty run, the steady rate) and the ratios to it; how
/// soon a released account is owned again, and how long released accounts went unowned in all
/// (account-seconds); how many releases named the hand-off's receiver, and of those how many it
/// claimed (figures a report written before they existed lacks show `-`).
fn simulation_herd() -> String {
    let mut out = String::from(
        "\n| report | cycles per node per period | once the faults were over | same seed without faults | ratio | releases owned again | p50 | p99 | unowned in all | named a receiver | claimed by it |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, r) in simulation_report_files() {
        let Some(cycles) = r["cycles_per_period"].as_f64() else {
            continue;
        };
        let t = &r["release_to_owner_ms"];
        let ms = |k: &str| t[k].as_u64().map_or("-".to_string(), |v| format!("{v} ms"));
        let count = |k: &str| t[k].as_u64().map_or("-".to_string(), |v| v.to_string());
        let calm = r["cycles_per_period_after_faults"].as_f64();
        let floor = &r["without_faults"];
        let (floor_all, floor_calm) = (
            floor["cycles_per_period"].as_f64(),
            floor["cycles_per_period_second_half"].as_f64(),
        );
        let (floors, ratios) = match (floor_all, floor_calm, calm) {
            (Some(all), Some(second), Some(calm)) => (
                format!("{all:.2} / {second:.2}"),
                format!("{:.2}x / {:.2}x", cycles / all, calm / second),
            ),
            _ => ("-".to_string(), "-".to_string()),
        };
        out.push_str(&format!(
            "| `{}` | {cycles:.2} | {} | {floors} | {ratios} | {} | {} | {} | {} | {} | {} |\n",
            name,
            calm.map_or("-".to_string(), |c| format!("{c:.2}")),
            t["releases"],
            ms("p50"),
            ms("p99"),
            t["unowned_account_s"]
                .as_f64()
                .map_or("-".to_string(), |s| format!("{s:.0} account-s")),
            count("named"),
            count("claimed_by_named"),
        ));
    }
    out.push('\n');
    out
}

/// The committed herd reports that ran their schedules again with every peer woken by every
/// release announcement (`--with-every-peer-woken`): how soon a released account was owned
/// again under the hubs' rules and under that floor, and the cycles each cost.
fn simulation_herd_floor() -> String {
    let mut out = String::from(
        "\n| report | releases owned again | p50 | p99 | max | every peer woken: releases | p50 | p99 | max | p99 ratio | cycles per node per period (ratio) |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, r) in simulation_report_files() {
        let floor = &r["every_peer_woken"];
        if floor.is_null() {
            continue;
        }
        let ms = |t: &Value, k: &str| t[k].as_u64().map_or("-".to_string(), |v| format!("{v} ms"));
        let (ours, theirs) = (&r["release_to_owner_ms"], &floor["release_to_owner_ms"]);
        let ratio = match (ours["p99"].as_f64(), theirs["p99"].as_f64()) {
            (Some(a), Some(b)) if b > 0.0 => format!("{:.2}x", a / b),
            _ => "-".to_string(),
        };
        let (cycles, floor_cycles) = (
            r["cycles_per_period"].as_f64().unwrap_or(0.0),
            floor["cycles_per_period"].as_f64().unwrap_or(0.0),
        );
        out.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {ratio} | {cycles:.2} / {floor_cycles:.2} ({:.2}x) |\n",
            name,
            ours["releases"],
            ms(ours, "p50"),
            ms(ours, "p99"),
            ms(ours, "max"),
            theirs["releases"],
            ms(theirs, "p50"),
            ms(theirs, "p99"),
            ms(theirs, "max"),
            cycles / floor_cycles,
        ));
    }
    out.push('\n');
    out
}

/// Where the cycles of the committed simulation reports that count them by cause come from: per
/// cause, cycles per node per period over the run and once its faults were over (the causes'
/// shares of the reports' own rates).
fn simulation_herd_causes() -> String {
    let mut out = String::from(
        "\n| report | cause | cycles per node per period | once the faults were over |\n| --- | --- | --- | --- |\n",
    );
    for (name, r) in simulation_report_files() {
        let Some(all) = r["cycles_by_cause"].as_object() else {
            continue;
        };
        let calm = r["cycles_by_cause_after_faults"].as_object();
        // A cause's cycles at the report's rate: its share of the cycles counted.
        let rate = |causes: Option<&serde_json::Map<String, Value>>, rate: &Value, cause: &str| {
            let causes = causes?;
            let total: u64 = causes.values().filter_map(Value::as_u64).sum();
            let n = causes.get(cause).and_then(Value::as_u64).unwrap_or(0);
            (total > 0).then(|| rate.as_f64().unwrap_or(0.0) * n as f64 / total as f64)
        };
        let mut causes: Vec<&String> = all.keys().collect();
        causes.sort_by(|a, b| all[*b].as_u64().cmp(&all[*a].as_u64()).then(a.cmp(b)));
        for cause in causes {
            let show = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            out.push_str(&format!(
                "| `{}` | {cause} | {} | {} |\n",
                name,
                show(rate(Some(all), &r["cycles_per_period"], cause)),
                show(rate(calm, &r["cycles_per_period_after_faults"], cause)),
            ));
        }
    }
    out.push('\n');
    out
}

/// The committed simulation reports (`reports/simulation/*.json`, written by `--report`), one
/// row each: what ran, what it found, and how to repeat it.
fn simulation_reports() -> String {
    let mut out = String::from(
        "\n| report | shape | schedules | faults injected | of which failovers / joins / leaves / crashes | orders | invariant checks | violations | wall time | peak memory | commit, seeds |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, r) in simulation_report_files() {
        let shape = &r["shape"];
        let kind = |k: &str| r["faults"][k].as_u64().unwrap_or(0);
        out.push_str(&format!(
            "| `{}` | {} nodes, {} accounts, {} simulated minutes each, faults `{}`{} | {} | {} | {} / {} / {} / {} | {} | {} | {} | {:.0} s | {:.1} GiB | `{}`, {} |\n",
            name,
            shape["nodes"],
            shape["accounts"],
            shape["minutes"],
            shape["faults"].as_str().unwrap_or("?"),
            if shape["orders"] == true { ", orders" } else { ", no orders" },
            r["schedules"],
            r["faults_total"],
            kind("database failover"),
            kind("join"),
            kind("leave"),
            kind("crash"),
            r["orders"],
            r["invariant_checks"],
            r["violations"],
            r["wall_s"].as_f64().unwrap_or(f64::NAN),
            r["peak_memory_kib"].as_f64().unwrap_or(f64::NAN) / (1024.0 * 1024.0),
            r["commit"].as_str().unwrap_or("?"),
            if r["master_seed"].is_null() {
                format!("seed {}", r["seed"])
            } else {
                format!("master seed {}", r["master_seed"])
            },
        ));
    }
    out.push('\n');
    out
}

/// The recorded clean-clone runs of `.ci/run` (`reports/ci.json`: each as `.ci/run` reported
/// it in `target/ci-report.json`, or as the project's CI recorded a landing), the last two.
/// The scale section's runs, for operators sizing their nodes: what this machine did with many
/// accounts, per core.
fn scale_runs(b: &Value) -> String {
    let cores: f64 = b["machine"]["cores"]
        .as_str()
        .and_then(|c| c.parse().ok())
        .unwrap_or(f64::NAN);
    let mut out = format!(
        "Measured {} on {} ({} cores, everything on the one machine):\n\n\
         | accounts | nodes | lease / fence / cycle | accounts per core | until steady | logins per account | last of 100 followers p99 (missed) | lease cycles failed after steady |\n\
         | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |\n",
        b["machine"]["date"].as_str().unwrap_or("?"),
        b["machine"]["cpu"].as_str().unwrap_or("?"),
        b["machine"]["cores"].as_str().unwrap_or("?"),
    );
    for r in b["scale"].as_array().into_iter().flatten() {
        let accounts = r["accounts"].as_f64().unwrap_or(f64::NAN);
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {} | {:.2} | {} ({}) | {} |\n",
            r["accounts"],
            r["nodes"],
            r["timing"].as_str().unwrap_or("?"),
            accounts / cores,
            r["until_steady_s"]
                .as_f64()
                .map_or("not steady".to_string(), |s| format!("{s:.0} s")),
            r["logins_per_account"].as_f64().unwrap_or(f64::NAN),
            match r["last_follower"]["p99_ms"].as_f64() {
                None => "none copied".to_string(),
                Some(p) if p >= 10_000.0 => format!("{:.0} s", p / 1000.0),
                Some(_) => ms(&r["last_follower"]["p99_ms"]),
            },
            r["trades_missed"],
            r["cycles_failed_after_steady"],
        ));
    }
    let search = &b["scale_search"];
    let count = |v: &Value| v.as_u64().map(|n| (n, n as f64 / cores));
    match (count(&search["largest_met"]), count(&search["smallest_missed"])) {
        (Some((met, per_core)), missed) => out.push_str(&format!(
            "\nThe largest count served with every goal met (the scale section's search: 10 nodes, \
             default timing, the last of 100 followers within 50 ms at the p99): {met} accounts, \
             {per_core:.0} per core{}.\n",
            missed.map_or(String::new(), |(m, _)| format!("; {m} missed a goal"))
        )),
        (None, Some((missed, _))) => out.push_str(&format!(
            "\nNo count the scale section's search tried met every goal, down to {missed} accounts.\n"
        )),
        (None, None) => {}
    }
    out
}

fn ci_runs() -> String {
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("reports/ci.json")).unwrap())
            .unwrap();
    let runs = r["runs"].as_array().expect("runs");
    assert!(runs.len() >= 2, "reports/ci.json: two runs at least");
    let mut out = String::new();
    for run in &runs[runs.len() - 2..] {
        let seconds = run["seconds"].as_u64().expect("seconds");
        out.push_str(&format!(
            "* {seconds} s ({:.1} min) on a clean clone of `{}`, {} cores, {}: {} the budget of {} s\n",
            seconds as f64 / 60.0,
            run["commit"].as_str().expect("commit"),
            run["cores"],
            run["source"].as_str().expect("source"),
            if seconds <= r["budget_s"].as_u64().unwrap() { "within" } else { "over" },
            r["budget_s"],
        ));
    }
    out
}

#[test]
fn rendered_figures_match_the_committed_benchmarks() {
    let bench: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("benchmarks.json")).unwrap())
            .unwrap();
    let mut blocks = 0;
    for path in documents() {
        let text = std::fs::read_to_string(&path).unwrap();
        if !text.contains("<!-- render:") {
            continue;
        }
        let want = render_blocks(&text, |name| {
            blocks += 1;
            match name {
                "headline" => headline(&bench),
                "scale" => scale_runs(&bench),
                "simulation" => simulation_reports(),
                "simulation-herd" => simulation_herd(),
                "simulation-herd-causes" => simulation_herd_causes(),
                "simulation-herd-floor" => simulation_herd_floor(),
                "ci" => ci_runs(),
                other => panic!("{}: no renderer named {other:?}", path.display()),
            }
        });
        generated(&path, &want);
    }
    assert!(blocks >= 1, "the README's headline block was found");
}

/// The configuration reference's table lists exactly the keys the code accepts, each with its
/// environment variable and the flag `run` takes (or none).
#[test]
fn the_configuration_reference_lists_every_key_the_code_accepts() {
    let text = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let rows: Vec<Vec<String>> = text
        .lines()
        .filter(|l| l.starts_with("| `"))
        .map(|l| {
            l.trim_matches('|')
                .split(" | ")
                .map(|c| c.trim().to_string())
                .collect()
        })
        .collect();
    let keys: Vec<String> = rows.iter().map(|r| r[0].trim_matches('`').into()).collect();
    let code: Vec<String> = copier_node::config::KEYS
        .iter()
        .map(|k| k.to_string())
        .collect();
    assert_eq!(
        keys, code,
        "docs/configuration.md's keys, in the code's order"
    );
    let cli = copier_node::cli::Cli::command();
    let run = cli.find_subcommand("run").expect("the run command");
    for row in &rows {
        let key = row[0].trim_matches('`');
        assert_eq!(
            row[3],
            format!("`COPIER_{}`", key.to_uppercase()),
            "{key}: its environment variable"
        );
        let flag = key.replace('_', "-");
        let has = run
            .get_arguments()
            .any(|a| a.get_long() == Some(flag.as_str()));
        if row[4] == "—" {
            assert!(!has, "{key}: `run` takes --{flag}, the reference says none");
        } else {
            assert_eq!(row[4], format!("`--{flag}`"), "{key}: its flag");
            assert!(has, "{key}: `run` takes no --{flag}");
        }
        assert!(
            row.len() == 6 && !row[5].is_empty(),
            "{key}: type, default and meaning"
        );
    }
}

/// Every default the configuration reference gives as a value (`` `60s` ``, `` `0.1` ``) is the
/// code's: a configuration that sets the key to it explicitly is the configuration that does
/// not set it at all.
#[test]
fn the_configuration_references_defaults_are_the_codes() {
    use copier_node::config::Layers;

    let text = std::fs::read_to_string(root().join("docs/configuration.md")).unwrap();
    let base = [
        (
            "database_url",
            Some("postgres://copier@db/copier".to_string()),
        ),
        ("platform", Some("mt5".to_string())),
    ];
    let resolve = |flags: &[(&'static str, Option<String>)]| {
        let config = Layers::load(None, Vec::new(), flags)
            .and_then(|l| l.resolve())
            .unwrap_or_else(|e| panic!("{flags:?}: {e}"));
        format!("{config:?}")
    };
    let unset = resolve(&base);
    let mut checked = 0;
    for line in text.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        let key = cells[0].trim_matches('`');
        let default = cells[2];
        // A value, not words ("none", "the value of `database_url`", "`<platform>-<hostname>`").
        let Some(value) = default
            .strip_prefix('`')
            .and_then(|d| d.strip_suffix('`'))
            .filter(|v| !v.contains(['`', '<', ' ']))
        else {
            continue;
        };
        let key = copier_node::config::KEYS
            .iter()
            .find(|k| **k == key)
            .unwrap_or_else(|| panic!("{key}: not a key of the code"));
        let mut flags = base.to_vec();
        flags.push((key, Some(value.to_string())));
        assert_eq!(
            resolve(&flags),
            unset,
            "{key}: docs/configuration.md gives its default as {value}, the code's differs"
        );
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} defaults were checked");
}

/// Every test `docs/guarantees.md` names as showing a guarantee exists: a name is a path of
/// modules and a function in `tests/it/` or `src/`, and a module's name stands for its tests.
#[test]
fn every_test_the_guarantees_name_exists() {
    let text = std::fs::read_to_string(root().join("docs/guarantees.md")).unwrap();
    let mut named = Vec::new();
    for (i, part) in text.split('`').enumerate() {
        // Inside backticks, with at least one `::` and only path characters.
        if i % 2 == 1
            && part.contains("::")
            && part
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        {
            named.push(part.to_string());
        }
    }
    assert!(named.len() > 50, "only {} test names found", named.len());
    let mut sources = Vec::new();
    for dir in ["tests/it", "src"] {
        let mut stack = vec![root().join(dir)];
        while let Some(d) = stack.pop() {
            for entry in std::fs::read_dir(&d).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    sources.push(std::fs::read_to_string(&path).unwrap());
                }
            }
        }
    }
    let missing: Vec<&String> = named
        .iter()
        .filter(|name| {
            let last = name.rsplit("::").next().unwrap();
            !sources.iter().any(|s| {
                s.contains(&format!("fn {last}("))
                    || s.contains(&format!("mod {last} "))
                    || s.contains(&format!("mod {last};"))
                    || s.contains(&format!("in_both_position_modes!({last})"))
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/guarantees.md names tests that do not exist: {missing:?}"
    );
}

/// docs/copying.md lists every lot mode the code defines (its formula table) and every skip
/// code, final and not final as the code decides: a mode or code added to the definitions and
/// not to the page fails here.
#[test]
fn the_copy_rules_page_lists_every_lot_mode_and_skip_code() {
    use copier_node::copier::rules::SkipCode;
    use copier_node::model::link::LotMode;
    use copier_node::model::named::Named;

    let text = std::fs::read_to_string(root().join("docs/copying.md")).unwrap();
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let table = text
        .split("| `lot_mode` | raw copy volume |")
        .nth(1)
        .expect("the lot-mode table");
    let documented: Vec<String> = table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with("| `"))
        .map(|l| {
            l.trim_start_matches("| `")
                .split('`')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    let defined: Vec<String> = LotMode::names().into_iter().map(String::from).collect();
    assert_eq!(
        sorted(documented),
        sorted(defined),
        "docs/copying.md's lot modes"
    );

    let list = text
        .split("The codes:")
        .nth(1)
        .and_then(|t| t.split("`copier_copies_skipped_total`").next())
        .expect("the list of skip codes");
    let (finals, others) = list.split_once("(final);").expect("the final codes first");
    let names = |t: &str| -> Vec<String> {
        sorted(t.split('`').skip(1).step_by(2).map(String::from).collect())
    };
    let defined = |is_final: bool| -> Vec<String> {
        sorted(
            SkipCode::VALUES
                .iter()
                .filter(|(code, _, _)| code.is_final() == is_final)
                .map(|(_, name, _)| name.to_string())
                .collect(),
        )
    };
    assert_eq!(names(finals), defined(true), "the final skip codes");
    assert_eq!(
        names(others),
        defined(false),
        "the skip codes that are not final"
    );
}

/// Words of a shell command line: quotes ('…', "…") hold a word together; a `#` comment, a
/// redirection (`< file`) and what follows a pipe or `&&` are not the command's.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, c) if c.is_whitespace() => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, c) => word.push(c),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    let end = words
        .iter()
        .position(|w| w.starts_with('#') || ["<", ">", "|", "&&", "&"].contains(&w.as_str()))
        .unwrap_or(words.len());
    words.truncate(end);
    words
}

/// A command line's shortest form: its optional parts (` [--json]`, outside quotes) removed.
fn without_optional_parts(line: &str) -> String {
    let mut out = String::new();
    let (mut quote, mut depth, mut prev) = (None, 0, ' ');
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (None, '\'' | '"') if depth == 0 => quote = Some(c),
            (None, '[') if depth > 0 || prev == ' ' => {
                depth += 1;
                prev = c;
                continue;
            }
            (None, ']') if depth > 0 => {
                depth -= 1;
                prev = c;
                continue;
            }
            _ => {}
        }
        if depth == 0 {
            out.push(c);
        }
        prev = c;
    }
    out
}

/// Every `copier-node` command line in a code block of the README and `docs/` parses with the
/// clap definition, in its shortest form: a renamed flag or command fails here, not at a
/// reader's prompt. (The tutorial's blocks also run: [`the_tutorial_runs_as_written`].) Lines
/// with placeholders (`<ticket>`, `TICKET`, `$ticket`, `...`) are shapes, not commands, and are
/// left out.
#[test]
fn every_command_line_in_the_docs_parses() {
    let mut files = vec![root().join("README.md")];
    let mut stack = vec![root().join("docs")];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") && !path.ends_with("cli.md") {
                files.push(path);
            }
        }
    }
    let mut parsed = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let mut in_block = false;
        let mut lines = text.lines().enumerate();
        while let Some((n, line)) = lines.next() {
            if line.trim_start().starts_with("```") {
                in_block = !in_block;
                continue;
            }
            let mut line = line.trim().trim_start_matches("$ ").to_string();
            while line.ends_with('\\') {
                line.pop();
                line.push_str(lines.next().map_or("", |(_, l)| l.trim()));
            }
            if !in_block
                || !line.starts_with("copier-node ")
                || line.contains(['<', '…', '$'])
                || line.contains("...")
            {
                continue;
            }
            let words = shell_words(&without_optional_parts(&line));
            let placeholder =
                |w: &String| w.len() > 2 && w.chars().all(|c| c.is_ascii_uppercase() || c == '_');
            if words.iter().any(placeholder) {
                continue;
            }
            parsed += 1;
            if let Err(e) = <copier_node::cli::Cli as clap::Parser>::try_parse_from(&words) {
                let shown = file.strip_prefix(root()).unwrap().display();
                wrong.push(format!("{shown}:{}: {line}\n{e}", n + 1));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(parsed >= 20, "only {parsed} command lines found");
}

/// Every command's help, as `copier-node <command> --help` prints it.
fn cli_reference() -> String {
    fn walk(cmd: &mut clap::Command, path: &str, out: &mut String) {
        let name = if path.is_empty() {
            "copier-node".to_string()
        } else {
            format!("copier-node {path}")
        };
        out.push_str(&format!(
            "\n## `{name}`\n\n```text\n{}```\n",
            cmd.render_long_help()
        ));
        let subs: Vec<String> = cmd
            .get_subcommands()
            .map(|s| s.get_name().to_string())
            .filter(|n| n != "help")
            .collect();
        for s in subs {
            let sub = cmd.find_subcommand_mut(&s).unwrap();
            let p = if path.is_empty() {
                s.clone()
            } else {
                format!("{path} {s}")
            };
            walk(sub, &p, out);
        }
    }
    let mut cmd = copier_node::cli::Cli::command().term_width(100);
    cmd.build();
    let mut out = String::from(
        "# Command-line reference\n\nEvery command's `--help`, generated from the clap definition \
         (`src/cli.rs`) by `COPIER_RENDER=write cargo nextest run -E 'test(/docs::/)'`; a test \
         fails when this file differs from it.\n",
    );
    walk(&mut cmd, "", &mut out);
    out
}

#[test]
fn the_cli_reference_is_the_clap_definition_help() {
    generated(&root().join("docs/cli.md"), &cli_reference());
}

/// Measured figures are rendered, never typed: a number with a unit of time or size, or a
/// ratio ("1.4×"), outside a render block is a hand-typed figure. Configured values and design
/// constants are written in code style (`lease = "60s"`, `10 ms`), which this check skips.
#[test]
fn no_measured_figure_is_typed_by_hand_in_the_docs() {
    let mut found = Vec::new();
    for path in documents() {
        let text = std::fs::read_to_string(&path).unwrap();
        let outside = render_blocks(&text, |_| String::new());
        for (n, line) in outside.lines().enumerate() {
            // Code spans are constants and syntax, not measurements.
            let line: String = line.split('`').step_by(2).collect::<Vec<_>>().join(" ");
            let line = line.as_str();
            let words: Vec<&str> = line.split_whitespace().collect();
            for pair in words.windows(2) {
                let number = pair[0]
                    .trim_start_matches(['(', '~'])
                    .replace(',', "")
                    .parse::<f64>()
                    .is_ok();
                let unit = pair[1].trim_end_matches([',', '.', ';', ')', ':']);
                if number && matches!(unit, "ms" | "µs" | "us" | "KiB" | "MiB") {
                    found.push(format!("{}:{}: {line}", path.display(), n + 1));
                }
            }
            if line.contains('×') && line.chars().any(|c| c.is_ascii_digit()) {
                // A ratio ("1.4×"), not a multiplication sign between factors.
                let hand = line.split_whitespace().any(|w| {
                    let w = w.trim_end_matches([',', '.', ';', ')']);
                    w.ends_with('×') && w.chars().any(|c| c.is_ascii_digit())
                });
                if hand {
                    found.push(format!("{}:{}: {line}", path.display(), n + 1));
                }
            }
        }
    }
    found.dedup();
    assert!(
        found.is_empty(),
        "hand-typed measured figures (render them from an artefact, or link to BENCHMARKS.md):\n{}",
        found.join("\n")
    );
}

/// The tutorial's shell blocks, in order, as one script.
fn tutorial_script() -> String {
    let text = std::fs::read_to_string(root().join("docs/tutorial.md")).unwrap();
    let mut script = String::new();
    let mut in_sh = false;
    for line in text.lines() {
        match (in_sh, line.trim_end()) {
            (false, "```sh") => in_sh = true,
            (true, "```") => in_sh = false,
            (true, l) => {
                script.push_str(l);
                script.push('\n');
            }
            _ => {}
        }
    }
    script
}

/// docs/tutorial.md runs as written: its shell blocks, concatenated, under `bash -euo
/// pipefail`, against a throwaway database and the built `copier-node`, from an empty database
/// to two nodes copying and one failing over. Its fixed ports are swapped for free ones, so the
/// run shares the machine with the suite.
#[tokio::test]
async fn the_tutorial_runs_as_written() {
    use crate::support::broker::{Scratch, free_port};

    let script = tutorial_script();
    assert!(
        script.contains("copier-node run") && script.contains("kill -9"),
        "the tutorial's blocks were read"
    );
    let mut script = script;
    for port in ["17000", "17001", "17002"] {
        assert!(script.contains(port), "the tutorial uses port {port}");
        script = script.replace(port, &free_port().to_string());
    }
    let db = crate::support::TestDb::new().await;
    let dir = Scratch::new("tutorial");
    std::fs::write(dir.path("tutorial.sh"), &script).unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_copier-node"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let child = tokio::process::Command::new("bash")
        .args(["-euo", "pipefail", "tutorial.sh"])
        .current_dir(&dir.0)
        .env("PATH", path)
        .env("DATABASE_URL", &db.url)
        .env_remove("COPIER_DATABASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(240), child)
        .await
        .expect("the tutorial finishes within 4 minutes")
        .unwrap();
    if !out.status.success() {
        let mut logs = String::new();
        for log in ["broker.log", "node-a.log", "node-b.log"] {
            let text = std::fs::read_to_string(dir.path(log)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            logs.push_str(&format!(
                "--- {log} (last lines, newest first)\n{}\n",
                tail.join("\n")
            ));
        }
        panic!(
            "the tutorial failed ({}):\nstdout:\n{}\nstderr:\n{}\n{logs}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("master ticket:"), "{stdout}");
}

//! What the broker's journal says about the demo's copies: how many, duplicates, and copy latency
//! split into live copies and copies during moves.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::sim_broker::journal::{self, JournalEntry};

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Latency {
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
    pub samples: usize,
}

/// The broker's journal so far (the in-process broker writes whole lines, so a read never meets
/// a half-written one; an unreadable journal counts as empty for the progress line).
pub(super) fn read_journal(path: &Path) -> Vec<JournalEntry> {
    journal::read(path).unwrap_or_default()
}

/// What the journal says about the copies.
pub(crate) struct Stats {
    pub copies: usize,
    pub duplicates: usize,
    pub node_orders: usize,
    /// Copies whose master order came while no move (failover, hand-off) was under way.
    pub latency: Option<Latency>,
    /// Copies whose master order came during a move.
    pub moved: Option<Latency>,
}

impl Latency {
    fn of(mut samples: Vec<i64>) -> Option<Latency> {
        samples.sort_unstable();
        (!samples.is_empty()).then(|| Latency {
            p50: samples[samples.len() / 2],
            p99: samples[((samples.len() as f64 * 0.99).ceil() as usize)
                .saturating_sub(1)
                .min(samples.len() - 1)],
            max: samples[samples.len() - 1],
            samples: samples.len(),
        })
    }

    pub(super) fn describe(l: &Option<Latency>) -> String {
        match l {
            Some(l) => format!("p50 {} ms, p99 {} ms ({} copies)", l.p50, l.p99, l.samples),
            None => "-".into(),
        }
    }
}

impl Stats {
    /// Counts from journal lines: accepted opens by nodes (copies), (login, marker) pairs opened
    /// more than once (duplicates), and the time from each master open to each of its copies,
    /// split by whether the master's order came during a move: a window of `moves` (journal
    /// clock, ms), or after `moving_since` (a move still under way).
    pub(crate) fn from(
        journal: &[JournalEntry],
        moves: &[(i64, i64)],
        moving_since: Option<i64>,
    ) -> Stats {
        let during_move = |ts: i64| {
            moves.iter().any(|(a, b)| ts >= *a && ts <= *b) || moving_since.is_some_and(|a| ts >= a)
        };
        let is_node = |l: &JournalEntry| l.client != "manual" && l.action != "login";
        let mut opens: HashMap<(String, String), usize> = HashMap::new();
        let mut master_open: HashMap<i64, i64> = HashMap::new();
        let mut live = Vec::new();
        let mut moved = Vec::new();
        for l in journal {
            if l.client == "manual"
                && l.action == "open"
                && l.accepted
                && let Some(t) = l.ticket
            {
                master_open.insert(t, l.ts_ms);
            }
        }
        let mut node_orders = 0;
        for l in journal.iter().filter(|l| is_node(l)) {
            node_orders += 1;
            if l.action == "open" && l.accepted {
                let comment = l.comment.clone().unwrap_or_default();
                *opens.entry((l.login.clone(), comment.clone())).or_insert(0) += 1;
                if let Some(t) = crate::model::parse_marker(&comment)
                    && let Some(m) = master_open.get(&t)
                {
                    let ts = l.ts_ms;
                    if during_move(*m) {
                        moved.push(ts - m);
                    } else {
                        live.push(ts - m);
                    }
                }
            }
        }
        Stats {
            copies: opens.values().sum(),
            duplicates: opens.values().filter(|n| **n > 1).count(),
            node_orders,
            latency: Latency::of(live),
            moved: Latency::of(moved),
        }
    }
}

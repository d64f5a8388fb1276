//! Median, tail and maximum of repeated measurements.

use std::time::Duration;

use serde::Serialize;

/// Median, tail and maximum of a set of samples, in milliseconds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Stats {
    pub(crate) runs: usize,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) max_ms: f64,
}

impl Stats {
    pub(crate) fn of(samples: &[Duration]) -> Stats {
        let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let at = |q: f64| {
            if ms.is_empty() {
                f64::NAN
            } else {
                ms[((ms.len() as f64 * q).ceil() as usize)
                    .saturating_sub(1)
                    .min(ms.len() - 1)]
            }
        };
        Stats {
            runs: ms.len(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: ms.last().copied().unwrap_or(f64::NAN),
        }
    }

    pub(crate) fn show(&self) -> String {
        format!("{:.2} / {:.2} ms", self.p50_ms, self.p99_ms)
    }

    /// p50 / p99 in microseconds.
    pub(crate) fn show_us(&self) -> String {
        format!(
            "{:.0} / {:.0} µs",
            self.p50_ms * 1000.0,
            self.p99_ms * 1000.0
        )
    }
}

//! Request latency histograms per NBD command (lock-free counters, Prometheus-style buckets).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::proto::*;

/// Upper bounds of the latency buckets, in microseconds.
pub const BUCKETS_US: [u64; 12] = [
    50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 100_000, 1_000_000, 10_000_000,
];

#[derive(Default, Debug)]
pub struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_us: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
}

impl Histogram {
    pub fn record(&self, d: Duration, bytes: u64, ok: bool) {
        let us = d.as_micros() as u64;
        if let Some(i) = BUCKETS_US.iter().position(|&b| us <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
    }

    /// Appends this histogram in Prometheus text format under `name` with `labels`.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        use std::fmt::Write;
        let mut cum = 0;
        for (i, b) in BUCKETS_US.iter().enumerate() {
            cum += self.buckets[i].load(Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels},le=\"{}\"}} {cum}",
                *b as f64 / 1e6
            );
        }
        let count = self.count.load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {count}");
        let _ = writeln!(
            out,
            "{name}_sum{{{labels}}} {}",
            self.sum_us.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count{{{labels}}} {count}");
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }
    pub fn errors(&self) -> u64 {
        self.errors.load(Relaxed)
    }
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Relaxed)
    }
}

/// One histogram per command, shared by every connection of a server (or of a daemon).
#[derive(Default, Debug)]
pub struct NbdMetrics {
    pub read: Histogram,
    pub write: Histogram,
    pub flush: Histogram,
    pub trim: Histogram,
    pub write_zeroes: Histogram,
    pub block_status: Histogram,
}

impl NbdMetrics {
    pub fn for_command(&self, kind: u16) -> Option<&Histogram> {
        Some(match kind {
            CMD_READ => &self.read,
            CMD_WRITE => &self.write,
            CMD_FLUSH => &self.flush,
            CMD_TRIM => &self.trim,
            CMD_WRITE_ZEROES => &self.write_zeroes,
            CMD_BLOCK_STATUS => &self.block_status,
            _ => return None,
        })
    }

    pub fn all(&self) -> [(&'static str, &Histogram); 6] {
        [
            ("read", &self.read),
            ("write", &self.write),
            ("flush", &self.flush),
            ("trim", &self.trim),
            ("write_zeroes", &self.write_zeroes),
            ("block_status", &self.block_status),
        ]
    }

    /// Prometheus text for all commands.
    pub fn render(&self, out: &mut String) {
        use std::fmt::Write;
        let _ = writeln!(out, "# TYPE strata_nbd_request_seconds histogram");
        for (cmd, h) in self.all() {
            h.render(
                out,
                "strata_nbd_request_seconds",
                &format!("command=\"{cmd}\""),
            );
        }
        let _ = writeln!(out, "# TYPE strata_nbd_request_errors_total counter");
        for (cmd, h) in self.all() {
            let _ = writeln!(
                out,
                "strata_nbd_request_errors_total{{command=\"{cmd}\"}} {}",
                h.errors()
            );
        }
        let _ = writeln!(out, "# TYPE strata_nbd_bytes_total counter");
        for (cmd, h) in [("read", &self.read), ("write", &self.write)] {
            let _ = writeln!(
                out,
                "strata_nbd_bytes_total{{command=\"{cmd}\"}} {}",
                h.bytes()
            );
        }
    }
}

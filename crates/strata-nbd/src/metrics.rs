//! Request latency, errors and bytes per NBD command, shared by every connection of a server (or
//! of a daemon), exposed through `prometheus-client` as
//! `strata_nbd_request_seconds{command}` (histogram), `strata_nbd_request_errors_total{command}`
//! and `strata_nbd_bytes_total{command}`.

use std::time::Duration;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;

use crate::proto::*;

/// Upper bounds of the latency buckets, in seconds (50 µs to 10 s).
pub const BUCKETS_SECONDS: [f64; 12] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0,
];

/// One command's latency histogram, error count and payload bytes. Recording is a few
/// relaxed atomic adds (the request path of every connection shares it; a histogram behind a
/// lock would serialise them).
#[derive(Debug, Default)]
pub struct CommandStats {
    buckets: [AtomicU64; BUCKETS_SECONDS.len()],
    count: AtomicU64,
    sum_ns: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
}

impl CommandStats {
    pub fn record(&self, d: Duration, bytes: u64, ok: bool) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS_SECONDS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.count.fetch_add(1, Relaxed);
        self.sum_ns
            .fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
        if !ok {
            self.errors.fetch_add(1, Relaxed);
        }
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

    fn encode_histogram(&self, m: &mut MetricEncoder) -> Result<(), std::fmt::Error> {
        // Per-bucket counts (the encoder accumulates them), then what no finite bucket holds
        // (over 10 s) in `+Inf`. The count is read first: buckets recorded since only make
        // `+Inf` smaller, never the cumulative counts larger than `_count`.
        let count = self.count();
        let mut buckets: Vec<(f64, u64)> = BUCKETS_SECONDS
            .iter()
            .zip(&self.buckets)
            .map(|(&b, n)| (b, n.load(Relaxed)))
            .collect();
        let mut seen = 0u64;
        for (_, n) in &mut buckets {
            *n = (*n).min(count - seen);
            seen += *n;
        }
        buckets.push((f64::INFINITY, count - seen));
        m.encode_histogram::<NoLabelSet>(
            self.sum_ns.load(Relaxed) as f64 / 1e9,
            count,
            &buckets,
            None,
        )
    }
}

/// One [`CommandStats`] per command.
#[derive(Default, Debug)]
pub struct NbdMetrics {
    pub read: CommandStats,
    pub write: CommandStats,
    pub flush: CommandStats,
    pub trim: CommandStats,
    pub write_zeroes: CommandStats,
    pub block_status: CommandStats,
}

impl NbdMetrics {
    pub fn for_command(&self, kind: u16) -> Option<&CommandStats> {
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

    pub fn all(&self) -> [(&'static str, &CommandStats); 6] {
        [
            ("read", &self.read),
            ("write", &self.write),
            ("flush", &self.flush),
            ("trim", &self.trim),
            ("write_zeroes", &self.write_zeroes),
            ("block_status", &self.block_status),
        ]
    }
}

/// Registered once in a daemon's registry: encodes every command's series on each scrape.
impl Collector for NbdMetrics {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        {
            let mut m = enc.encode_descriptor(
                "strata_nbd_request",
                "Time from an NBD request's arrival to its reply, by command",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?;
            for (cmd, s) in self.all() {
                s.encode_histogram(&mut m.encode_family(&[("command", cmd)])?)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "strata_nbd_request_errors",
                "NBD requests answered with an error, by command",
                None,
                MetricType::Counter,
            )?;
            for (cmd, s) in self.all() {
                ConstCounter::new(s.errors()).encode(m.encode_family(&[("command", cmd)])?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "strata_nbd",
            "Payload bytes of NBD reads and writes",
            Some(&Unit::Bytes),
            MetricType::Counter,
        )?;
        for (cmd, s) in [("read", &self.read), ("write", &self.write)] {
            ConstCounter::new(s.bytes()).encode(m.encode_family(&[("command", cmd)])?)?;
        }
        Ok(())
    }
}

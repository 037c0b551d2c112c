//! Request latency, errors and bytes per NBD command, shared by every connection of a server (or
//! of a daemon), exposed through `prometheus-client` as
//! `strata_nbd_request_seconds{command}` (histogram), `strata_nbd_request_errors_total{command}`
//! and `strata_nbd_bytes_total{command}`. Recording is lock-free (atomic counters).

use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::TypedMetric;
use prometheus_client::registry::Unit;

use crate::proto::*;

/// Upper bounds of the latency buckets, in seconds (50 µs to 10 s).
pub const BUCKETS_SECONDS: [f64; 12] = [
    50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 0.1, 1.0, 10.0,
];

/// One command's latency histogram, error count and payload bytes.
#[derive(Debug)]
pub struct CommandStats {
    seconds: Histogram,
    errors: Counter,
    bytes: Counter,
}

impl Default for CommandStats {
    fn default() -> Self {
        CommandStats {
            seconds: Histogram::new(BUCKETS_SECONDS),
            errors: Counter::default(),
            bytes: Counter::default(),
        }
    }
}

impl CommandStats {
    pub fn record(&self, d: Duration, bytes: u64, ok: bool) {
        self.seconds.observe(d.as_secs_f64());
        self.bytes.inc_by(bytes);
        if !ok {
            self.errors.inc();
        }
    }

    pub fn errors(&self) -> u64 {
        self.errors.get()
    }
    pub fn bytes(&self) -> u64 {
        self.bytes.get()
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
                Histogram::TYPE,
            )?;
            for (cmd, s) in self.all() {
                s.seconds.encode(m.encode_family(&[("command", cmd)])?)?;
            }
        }
        {
            let mut m = enc.encode_descriptor(
                "strata_nbd_request_errors",
                "NBD requests answered with an error, by command",
                None,
                Counter::<u64>::TYPE,
            )?;
            for (cmd, s) in self.all() {
                ConstCounter::new(s.errors()).encode(m.encode_family(&[("command", cmd)])?)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "strata_nbd",
            "Payload bytes of NBD reads and writes",
            Some(&Unit::Bytes),
            Counter::<u64>::TYPE,
        )?;
        for (cmd, s) in [("read", &self.read), ("write", &self.write)] {
            ConstCounter::new(s.bytes()).encode(m.encode_family(&[("command", cmd)])?)?;
        }
        Ok(())
    }
}

//! `/metrics`: the daemon's Prometheus exposition, through `prometheus-client`.
//!
//! Every series has HELP and TYPE lines and a base unit in its name (`_seconds`, `_bytes`);
//! counters end in `_total`. Labels use the API's names: `tenant`, `workspace`, `stream`,
//! `command`. Two kinds of series:
//! - owned by the daemon and updated where things happen (checkpoint and fork latency,
//!   workspaces deleted at the end of their TTL), registered once in [`Metrics`];
//! - read from the engine, the relay and the exports at each scrape ([`Scrape`]): per-volume
//!   series, GC totals and the last pass, object-store traffic, relay lag, vhost-user counters,
//!   and the NBD command histograms ([`strata_nbd::NbdMetrics`]). None of these take a lock
//!   that the data path holds for long: a busy volume reports its real values, not zeros.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Weak};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};

use crate::Daemon;

/// The `Content-Type` of what [`Metrics::render`] returns.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

pub(crate) struct Metrics {
    registry: Registry,
    /// Duration of checkpoint calls through the API (local or published, as asked).
    pub checkpoint: Histogram,
    /// Duration of fork calls through the API.
    pub fork: Histogram,
    /// Ephemeral workspaces deleted at the end of their TTL.
    pub expired_deleted: Counter,
    /// API requests by method, route template and status (`observe.rs`).
    pub http: crate::observe::HttpSeconds,
}

impl Metrics {
    /// The registry of a daemon; `d` is read at each scrape (a daemon that is gone reports
    /// only what is registered here).
    pub fn new(d: Weak<Daemon>, nbd: Arc<strata_nbd::NbdMetrics>) -> Metrics {
        let buckets = strata_nbd::metrics::BUCKETS_SECONDS;
        let m = Metrics {
            registry: Registry::default(),
            checkpoint: Histogram::new(buckets),
            fork: Histogram::new(buckets),
            expired_deleted: Counter::default(),
            http: crate::observe::http_seconds(),
        };
        let mut registry = Registry::default();
        registry.register_with_unit(
            "strata_checkpoint",
            "Duration of checkpoint calls through the API",
            Unit::Seconds,
            m.checkpoint.clone(),
        );
        registry.register_with_unit(
            "strata_fork",
            "Duration of fork calls through the API",
            Unit::Seconds,
            m.fork.clone(),
        );
        registry.register(
            "strata_expired_workspaces_deleted",
            "Ephemeral workspaces deleted at the end of their TTL",
            m.expired_deleted.clone(),
        );
        registry.register_with_unit(
            "strata_http_request",
            "Duration of API requests by method, route template and status",
            Unit::Seconds,
            m.http.clone(),
        );
        registry.register_collector(Box::new(nbd));
        registry.register_collector(Box::new(Scrape(d)));
        Metrics { registry, ..m }
    }

    /// The Prometheus text exposition (format 0.0.4) of every series.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail; an encoder error would be a bug in a collector.
        if let Err(e) =
            prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry)
        {
            tracing::error!(error = %e, "encoding /metrics failed");
        }
        out
    }
}

/// Series read from the daemon's parts at each scrape.
struct Scrape(Weak<Daemon>);

impl std::fmt::Debug for Scrape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Scrape")
    }
}

/// One metric family: a descriptor, then one sample per label set.
fn family<L: EncodeLabelSet, M: EncodeMetric + TypedMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    samples: impl IntoIterator<Item = (L, M)>,
) -> Result<(), std::fmt::Error> {
    // The descriptor is written even without samples (no volume attached, no relay backlog):
    // a scraper and a reader of `/metrics` see every family the daemon has.
    let mut m = enc.encode_descriptor(name, help, unit.as_ref(), M::TYPE)?;
    for (labels, v) in samples {
        v.encode(m.encode_family(&labels)?)?;
    }
    Ok(())
}

/// A family without labels and a single value.
fn single<M: EncodeMetric>(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    unit: Option<Unit>,
    v: M,
) -> Result<(), std::fmt::Error> {
    let m = enc.encode_descriptor(name, help, unit.as_ref(), v.metric_type())?;
    v.encode(m)
}

fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(i64::try_from(v).unwrap_or(i64::MAX))
}

fn seconds(ms: u64) -> ConstGauge<f64> {
    ConstGauge::new(ms as f64 / 1000.0)
}

type Labels = [(&'static str, String); 2];

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(d) = self.0.upgrade() else {
            return Ok(());
        };
        let e = &mut enc;

        // Garbage collection: totals of this node's passes, then the last pass's findings.
        let g = &d.gc;
        for (name, help, unit, v) in [
            (
                "strata_gc_runs",
                "GC passes completed on this node",
                None,
                &g.runs,
            ),
            (
                "strata_gc_failures",
                "GC passes that failed on this node",
                None,
                &g.failures,
            ),
            (
                "strata_gc_tenant_failures",
                "Tenants whose part of a GC pass failed on this node (the pass went on without them)",
                None,
                &g.tenant_failures,
            ),
            (
                "strata_gc_deleted_keys",
                "Object-store keys deleted by GC",
                None,
                &g.deleted_keys,
            ),
            (
                "strata_gc_reclaimed",
                "Bytes deleted from the object store by GC",
                Some(Unit::Bytes),
                &g.deleted_bytes,
            ),
            (
                "strata_gc_checkpoints_expired",
                "Checkpoints expired by retention",
                None,
                &g.checkpoints_expired,
            ),
        ] {
            single(e, name, help, unit, counter(v.load(Relaxed)))?;
        }
        // Stored and live bytes are counted by passes that list the store (reconciliation).
        if let Some(r) = g
            .last_listed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
        {
            for (name, help, v) in [
                (
                    "strata_gc_live",
                    "Bytes referenced by heads, retained checkpoints and templates (last GC pass that listed the store)",
                    r.live_bytes,
                ),
                (
                    "strata_gc_stored",
                    "Bytes stored in the object store (last GC pass that listed the store)",
                    r.stored_bytes,
                ),
            ] {
                single(e, name, help, Some(Unit::Bytes), gauge(v))?;
            }
            single(
                e,
                "strata_gc_live_objects",
                "Objects referenced (last GC pass that marked everything: a reconciliation)",
                None,
                gauge(r.live_objects),
            )?;
            // An ordinary pass counts only what changed since the pass before it.
            single(
                e,
                "strata_gc_unreferenced",
                "Bytes stored and referenced by nothing (last GC pass that listed the store)",
                Some(Unit::Bytes),
                gauge(r.unreferenced_bytes),
            )?;
        }
        if let Some(r) = g.last.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            single(
                e,
                "strata_gc_last_duration",
                "Duration of the last GC pass",
                Some(Unit::Seconds),
                seconds(r.duration_ms),
            )?;
        }

        // The durable relay.
        let rl = &d.relay;
        single(
            e,
            "strata_relay_uploaded",
            "Relayed bytes uploaded to the object store",
            Some(Unit::Bytes),
            counter(rl.uploaded_bytes.load(Relaxed)),
        )?;
        single(
            e,
            "strata_relay_conflicts",
            "Relay puts refused: same name, different bytes",
            None,
            counter(rl.conflicts.load(Relaxed)),
        )?;
        single(
            e,
            "strata_relay_upload_failures",
            "Relay uploads that failed (retried)",
            None,
            counter(rl.failures.load(Relaxed)),
        )?;
        let lag = rl.lag();
        let by_stream = |(t, s): &(String, String)| [("tenant", t.clone()), ("stream", s.clone())];
        family(
            e,
            "strata_relay_pending_files",
            "Relayed files not yet in the object store",
            None,
            lag.iter()
                .map(|(k, l)| (by_stream(k), gauge(l.pending_files))),
        )?;
        family(
            e,
            "strata_relay_pending",
            "Relayed bytes not yet in the object store",
            Some(Unit::Bytes),
            lag.iter()
                .map(|(k, l)| (by_stream(k), gauge(l.pending_bytes))),
        )?;
        family(
            e,
            "strata_relay_upload_lag",
            "Age of the oldest relayed file not yet in the object store",
            Some(Unit::Seconds),
            lag.iter().map(|(k, l)| (by_stream(k), seconds(l.lag_ms))),
        )?;

        // Tenants on this node: attached workspaces, journal bytes against their quota.
        let mut tenants: std::collections::BTreeMap<String, u64> = Default::default();
        for v in d.engine.attached() {
            *tenants.entry(v.tenant().to_string()).or_default() += 1;
        }
        let by_tenant = |t: &String| [("tenant", t.clone())];
        family(
            e,
            "strata_tenant_attached",
            "A tenant's workspaces attached on this node",
            None,
            tenants.iter().map(|(t, n)| (by_tenant(t), gauge(*n))),
        )?;
        let journals: Vec<(String, (u64, Option<u64>))> = tenants
            .keys()
            .map(|t| (t.clone(), d.engine.local_journal_usage(t)))
            .collect();
        family(
            e,
            "strata_tenant_journal",
            "Journal bytes a tenant's workspaces hold on this node",
            Some(Unit::Bytes),
            journals
                .iter()
                .map(|(t, (used, _))| (by_tenant(t), gauge(*used))),
        )?;
        family(
            e,
            "strata_tenant_journal_quota",
            "A tenant's local_journal_bytes quota (tenants with one and an attached workspace)",
            Some(Unit::Bytes),
            journals
                .iter()
                .filter_map(|(t, (_, q))| Some((by_tenant(t), gauge((*q)?)))),
        )?;

        // vhost-user exports.
        let vs = d.vhost_stats();
        let by_ws = |(t, w): &(String, String)| -> Labels {
            [("tenant", t.clone()), ("workspace", w.clone())]
        };
        family(
            e,
            "strata_vhost_requests",
            "Requests taken from a vhost-user export's queues",
            None,
            vs.iter().map(|(k, n, _)| (by_ws(k), counter(*n))),
        )?;
        // Chains a frontend sent that could not be answered (descriptors outside its memory,
        // no status byte, a broken ring): a hostile or broken guest.
        family(
            e,
            "strata_vhost_malformed",
            "Descriptor chains from a vhost-user frontend that could not be answered",
            None,
            vs.iter().map(|(k, _, n)| (by_ws(k), counter(*n))),
        )?;

        // The object store and the node cache.
        let r = d.engine.reader().stats();
        for (name, help, unit, v) in [
            (
                "strata_object_gets",
                "Range GETs sent to the object store",
                None,
                r.gets,
            ),
            (
                "strata_object_fetched",
                "Bytes fetched from the object store",
                Some(Unit::Bytes),
                r.bytes_fetched,
            ),
            (
                "strata_object_prefetches",
                "Units fetched ahead of sequential readers",
                None,
                r.prefetches,
            ),
            (
                "strata_object_uploaded",
                "Bytes uploaded to the object store",
                Some(Unit::Bytes),
                r.bytes_put,
            ),
            (
                "strata_cache_hits",
                "Node-cache reads served locally",
                None,
                r.cache_hits,
            ),
            (
                "strata_cache_misses",
                "Node-cache reads that went to the object store",
                None,
                r.cache_misses,
            ),
            (
                "strata_verify_failures",
                "Fetched ranges whose hash did not match the manifest",
                None,
                r.verify_failures,
            ),
        ] {
            single(e, name, help, unit, counter(v))?;
        }
        single(
            e,
            "strata_frame_tables",
            "Memory held by frame tables of objects (bounded; the least recently used go first)",
            Some(Unit::Bytes),
            gauge(r.table_bytes),
        )?;

        // Attached volumes.
        let stats: Vec<(Labels, strata_engine::VolumeStats)> = d
            .engine
            .attached()
            .iter()
            .map(|v| {
                (
                    by_ws(&(v.tenant().to_string(), v.name().to_string())),
                    v.stats(),
                )
            })
            .collect();
        type Series = (
            &'static str,
            &'static str,
            Option<Unit>,
            MetricType,
            fn(&strata_engine::VolumeStats) -> u64,
        );
        let series: [Series; 9] = [
            ("strata_volume_written", "Bytes written by clients", Some(Unit::Bytes), MetricType::Counter, |s| s.bytes_written),
            ("strata_volume_read", "Bytes read by clients", Some(Unit::Bytes), MetricType::Counter, |s| s.bytes_read),
            ("strata_volume_flushes", "Flushes acknowledged", None, MetricType::Counter, |s| s.flushes),
            ("strata_volume_publishes", "Layers published to the object store", None, MetricType::Counter, |s| s.publishes),
            ("strata_volume_remote_window", "Bytes flushed on this node and not yet in the object store (the durable mode's window)", Some(Unit::Bytes), MetricType::Gauge, |s| s.window_bytes),
            ("strata_volume_journal", "Bytes held by the local journal's segments", Some(Unit::Bytes), MetricType::Gauge, |s| s.journal_bytes),
            // Cuts taken (local checkpoints among them) and not yet in the object store.
            ("strata_volume_pending_versions", "Cuts taken and not yet published", None, MetricType::Gauge, |s| s.pending_versions),
            ("strata_volume_lease_epoch", "Epoch of the lease this node holds", None, MetricType::Gauge, |s| s.lease_epoch),
            ("strata_volume_frozen", "1 while the workspace is frozen", None, MetricType::Gauge, |s| s.frozen as u64),
        ];
        for (name, help, unit, ty, f) in series {
            match ty {
                MetricType::Counter => family(
                    e,
                    name,
                    help,
                    unit,
                    stats.iter().map(|(l, s)| (l.clone(), counter(f(s)))),
                )?,
                _ => family(
                    e,
                    name,
                    help,
                    unit,
                    stats.iter().map(|(l, s)| (l.clone(), gauge(f(s)))),
                )?,
            }
        }
        family(
            e,
            "strata_volume_remote_window_age",
            "Age of the oldest write not yet in the object store",
            Some(Unit::Seconds),
            stats
                .iter()
                .map(|(l, s)| (l.clone(), seconds(s.window_age_ms))),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every family has HELP and TYPE lines (also a labelled family without samples, such as
    /// the relay's lag with nothing pending), and names end in a base unit or `_total`.
    #[test]
    fn families_have_help_type_and_units() {
        let nbd = Arc::new(strata_nbd::NbdMetrics::default());
        nbd.write
            .record(std::time::Duration::from_micros(70), 4096, true);
        let m = Metrics::new(Weak::new(), nbd);
        m.checkpoint.observe(0.2);
        m.expired_deleted.inc();
        let out = m.render();
        assert!(out.contains("# HELP strata_checkpoint_seconds "), "{out}");
        assert!(
            out.contains("# TYPE strata_checkpoint_seconds histogram"),
            "{out}"
        );
        assert!(out.contains("strata_checkpoint_seconds_count 1"), "{out}");
        assert!(
            out.contains("strata_expired_workspaces_deleted_total 1"),
            "{out}"
        );
        assert!(
            out.contains("strata_nbd_request_seconds_bucket{command=\"write\",le=\"0.0001\"} 1"),
            "{out}"
        );
        assert!(
            out.contains("strata_nbd_request_seconds_bucket{command=\"write\",le=\"+Inf\"} 1"),
            "{out}"
        );
        assert_eq!(
            out.matches("le=\"+Inf\"").count(),
            6 + 2,
            "one +Inf per command, checkpoint and fork: {out}"
        );
        assert!(
            out.contains("strata_nbd_bytes_total{command=\"write\"} 4096"),
            "{out}"
        );
        let types: Vec<&str> = out.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let helps = out.lines().filter(|l| l.starts_with("# HELP ")).count();
        assert_eq!(types.len(), helps, "{out}");
        for t in types {
            let name = t.split(' ').nth(2).unwrap_or("");
            assert!(
                !name.ends_with("_ms") && !name.contains("_ms_"),
                "{name}: not a base unit"
            );
        }
    }
}

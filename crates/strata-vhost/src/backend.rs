//! The `vhost-user-backend` side: features, config space, and the queue loop that turns
//! available chains into [`Request`]s, runs them on the tokio runtime, and returns them used.
//!
//! One worker thread per queue (`queues_per_thread`). A kick runs a batch: chains are popped and
//! parsed until the batch holds [`BATCH_BYTES`] of data or the ring is empty, the batch's requests
//! run concurrently, then each is returned used and the driver notified. A batch holds its
//! queue's `busy` lock: `stop_vring` (the frontend's GET_VRING_BASE) waits on it, so the ring
//! position a frontend reads back never names a request still running here.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use strata_block::BlockDevice;
use vhost::vhost_user::message::{VhostUserProtocolFeatures, VhostUserVirtioFeatures};
use vhost_user_backend::{VhostUserBackend, VringRwLock, VringT};
use virtio_bindings::bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::bindings::virtio_ring::{
    VIRTIO_RING_F_EVENT_IDX, VIRTIO_RING_F_INDIRECT_DESC,
};
use virtio_queue::QueueOwnedT;
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic, GuestMemoryMmap};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::event::{
    new_event_consumer_and_notifier, EventConsumer, EventFlag, EventNotifier,
};

use crate::blk::{self, Features, Request};

/// Data one batch may hold in memory at once (reads being filled, writes copied out).
pub const BATCH_BYTES: usize = 64 << 20;

/// Counters of one backend (exported by the daemon).
#[derive(Default, Debug)]
pub struct Stats {
    pub requests: AtomicU64,
    pub malformed: AtomicU64,
}

/// The driver broke the ring (or the backend is stopping).
struct Broken;

/// Every region lies within its file, and (unless `unsealed_ok`) that file is sealed against
/// shrinking, so the VMM can never truncate memory this process has mapped (a SIGBUS here
/// would end every tenant's exports, not only this VMM's).
fn check_regions(mem: &GuestMemoryAtomic<GuestMemoryMmap>, unsealed_ok: bool) -> io::Result<()> {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    for r in mem.memory().iter() {
        let Some(fo) = r.file_offset() else { continue };
        if !unsealed_ok {
            // A file that cannot be sealed (not a memfd) reports EINVAL: no seals.
            let sealed = rustix::fs::fcntl_get_seals(fo.file())
                .is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK));
            if !sealed {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "guest memory must be a memfd sealed against shrinking (F_SEAL_SHRINK; QEMU: memory-backend-memfd with seal=on, its default): a VMM that truncates unsealed memory would crash the daemon's other exports",
                ));
            }
        }
        let len = fo.file().metadata()?.len();
        let end = fo.start().checked_add(r.len());
        if end.is_none_or(|end| end > len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("memory region of {} bytes at file offset {} past the end of its {len}-byte file", r.len(), fo.start()),
            ));
        }
    }
    Ok(())
}

pub struct BlkBackend {
    dev: Arc<dyn BlockDevice>,
    features: Features,
    mem: RwLock<GuestMemoryAtomic<GuestMemoryMmap>>,
    event_idx: AtomicBool,
    /// The driver accepted FLUSH. A driver that did not treats the disk as write-through, so
    /// every write is then made durable before it completes.
    flush_acked: AtomicBool,
    /// Set by a stop: batches end, so the worker threads can be joined even under a guest
    /// that keeps its ring full.
    pub(crate) stopping: AtomicBool,
    /// A broken ring was reported once on this connection (a guest cannot flood the log).
    warned: AtomicBool,
    /// One per queue, held by a running batch.
    busy: Vec<Mutex<()>>,
    rt: tokio::runtime::Handle,
    pub stats: Stats,
}

impl BlkBackend {
    pub fn new(dev: Arc<dyn BlockDevice>, features: Features, rt: tokio::runtime::Handle) -> Self {
        let busy = (0..features.num_queues).map(|_| Mutex::new(())).collect();
        BlkBackend {
            dev,
            flush_acked: AtomicBool::new(false),
            stopping: AtomicBool::new(false),
            warned: AtomicBool::new(false),
            features,
            mem: RwLock::new(GuestMemoryAtomic::new(GuestMemoryMmap::new())),
            event_idx: AtomicBool::new(false),
            busy,
            rt,
            stats: Stats::default(),
        }
    }

    fn memory(&self) -> GuestMemoryAtomic<GuestMemoryMmap> {
        self.mem.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Between frontends: the next one starts from a device reset, and the last one's guest
    /// memory is unmapped here (its pages are freed when the VMM goes).
    pub(crate) fn reset_connection(&self) {
        *self.mem.write().unwrap_or_else(|p| p.into_inner()) =
            GuestMemoryAtomic::new(GuestMemoryMmap::new());
        self.flush_acked.store(false, Ordering::Release);
        self.event_idx.store(false, Ordering::Release);
        self.warned.store(false, Ordering::Release);
    }

    fn broken(&self, why: &dyn std::fmt::Display) {
        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
        if !self.warned.swap(true, Ordering::AcqRel) {
            tracing::warn!(error = %why, "virtqueue broken by the driver: not served until it is reset");
        }
    }

    /// Runs batches until the ring is empty (re-checked after notifications are re-enabled,
    /// so a chain made available meanwhile is not left waiting for a kick that never comes).
    /// A ring the driver broke (an avail index more than a ring ahead) is left alone until
    /// the frontend resets it: nothing is popped from it, and no loop spins on it.
    fn process(&self, vring: &VringRwLock) -> io::Result<()> {
        if !self.event_idx.load(Ordering::Acquire) {
            return self.batches(vring).map(drop);
        }
        // Rounds in a row that found the ring "not empty" yet popped nothing: once is a chain
        // made available between the pop and re-enabling notifications; twice is a ring whose
        // entries cannot be read (placed at the end of guest memory, say).
        let mut empty = 0;
        loop {
            vring.disable_notification().map_err(io::Error::other)?;
            match self.batches(vring)? {
                Err(Broken) => return Ok(()),
                Ok(0) => empty += 1,
                Ok(_) => empty = 0,
            }
            if !vring.enable_notification().map_err(io::Error::other)? {
                return Ok(());
            }
            if empty >= 2 {
                self.broken(&"available entries that cannot be read");
                return Ok(());
            }
        }
    }

    /// Returns the chains it took, or `Broken` (the ring, or a stop: the queue is left alone).
    fn batches(&self, vring: &VringRwLock) -> io::Result<Result<usize, Broken>> {
        let atomic = self.memory();
        let mut taken = 0;
        loop {
            if self.stopping.load(Ordering::Acquire) {
                return Ok(Err(Broken));
            }
            let mem = atomic.memory();
            let mut pending: Vec<(u16, Request<'_>)> = vec![];
            let mut used: Vec<(u16, u32)> = vec![];
            let mut bytes = 0usize;
            let mut broken = false;
            let size = self.dev.size();
            // At most a ring's worth of chains per batch, and BATCH_BYTES of data.
            let max_chains = self.features.queue_size as usize;
            while bytes < BATCH_BYTES && pending.len() + used.len() < max_chains {
                let chain = match vring.get_mut().get_queue_mut().iter(mem.clone()) {
                    Ok(mut it) => it.next(),
                    // Stopped by the frontend (GET_VRING_BASE): not the driver's doing.
                    Err(virtio_queue::Error::QueueNotReady) => {
                        broken = true;
                        None
                    }
                    Err(e) => {
                        self.broken(&e);
                        broken = true;
                        None
                    }
                };
                let Some(chain) = chain else { break };
                let head = chain.head_index();
                self.stats.requests.fetch_add(1, Ordering::Relaxed);
                let parsed = blk::parse_chain(&mem, chain, size, &self.features);
                match parsed {
                    Ok(req) => {
                        bytes += req.cost();
                        pending.push((head, req));
                    }
                    Err(blk::Malformed(why)) => {
                        self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(
                            head,
                            why,
                            "malformed virtio-blk chain returned unanswered"
                        );
                        used.push((head, 0));
                    }
                }
            }
            if pending.is_empty() && used.is_empty() {
                return Ok(if broken { Err(Broken) } else { Ok(taken) });
            }
            taken += pending.len() + used.len();
            // Write-through unless the driver accepted FLUSH.
            let fua = !self.flush_acked.load(Ordering::Acquire);
            let dev = &*self.dev;
            let heads: Vec<u16> = pending.iter().map(|(h, _)| *h).collect();
            let lens = self.rt.block_on(futures::future::join_all(
                pending.into_iter().map(|(_, r)| r.run(dev, fua)),
            ));
            used.extend(heads.into_iter().zip(lens));
            for (head, len) in used {
                // A head the driver made up (past the ring): nothing to complete; the rest of
                // the batch is still returned.
                if let Err(e) = vring.add_used(head, len) {
                    self.broken(&e);
                    broken = true;
                }
            }
            if vring.needs_notification().map_err(io::Error::other)? {
                vring.signal_used_queue()?;
            }
            if broken {
                return Ok(Err(Broken));
            }
        }
    }
}

impl VhostUserBackend for BlkBackend {
    type Bitmap = ();
    type Vring = VringRwLock;

    fn num_queues(&self) -> usize {
        self.features.num_queues as usize
    }
    fn max_queue_size(&self) -> usize {
        self.features.queue_size as usize
    }
    fn features(&self) -> u64 {
        self.features.bits()
            | (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_RING_F_INDIRECT_DESC)
            | (1u64 << VIRTIO_RING_F_EVENT_IDX)
            | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits()
    }
    fn protocol_features(&self) -> VhostUserProtocolFeatures {
        VhostUserProtocolFeatures::CONFIG | VhostUserProtocolFeatures::MQ
    }
    fn acked_features(&self, features: u64) {
        use virtio_bindings::bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
        self.flush_acked.store(
            features & (1u64 << VIRTIO_BLK_F_FLUSH) != 0,
            Ordering::Release,
        );
    }
    fn set_event_idx(&self, enabled: bool) {
        self.event_idx.store(enabled, Ordering::Release);
    }
    fn get_config(&self, offset: u32, size: u32) -> Vec<u8> {
        let c = self.features.config(self.dev.size());
        let start = (offset as usize).min(c.len());
        let end = start.saturating_add(size as usize).min(c.len());
        c[start..end].to_vec()
    }
    fn set_config(&self, _offset: u32, _buf: &[u8]) -> io::Result<()> {
        // No CONFIG_WCE: the cache mode is fixed by the features, so it cannot be lost across
        // a VMM reconnect or a daemon restart.
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "the config space is read-only",
        ))
    }
    fn update_memory(&self, mem: GuestMemoryAtomic<GuestMemoryMmap>) -> io::Result<()> {
        // A region larger than its file would fault (SIGBUS, the whole daemon) on first touch:
        // refused, and the rings see no memory at all until a good table comes.
        if let Err(e) = check_regions(&mem, self.features.unsealed_memory) {
            let _ = mem.lock().map(|g| g.replace(GuestMemoryMmap::new()));
            *self.mem.write().unwrap_or_else(|p| p.into_inner()) =
                GuestMemoryAtomic::new(GuestMemoryMmap::new());
            return Err(e);
        }
        *self.mem.write().unwrap_or_else(|p| p.into_inner()) = mem;
        Ok(())
    }
    fn queues_per_thread(&self) -> Vec<u64> {
        (0..self.features.num_queues).map(|q| 1u64 << q).collect()
    }
    fn exit_event(&self, _thread_index: usize) -> Option<(EventConsumer, EventNotifier)> {
        new_event_consumer_and_notifier(EventFlag::NONBLOCK).ok()
    }
    fn stop_vring(&self, queue_index: u32) -> io::Result<()> {
        if let Some(b) = self.busy.get(queue_index as usize) {
            drop(b.lock().unwrap_or_else(|p| p.into_inner()));
        }
        Ok(())
    }
    fn handle_event(
        &self,
        device_event: u16,
        evset: EventSet,
        vrings: &[VringRwLock],
        thread_id: usize,
    ) -> io::Result<()> {
        if evset != EventSet::IN {
            return Err(io::Error::other(format!("unexpected event set {evset:?}")));
        }
        let vring = vrings
            .get(device_event as usize)
            .ok_or_else(|| io::Error::other(format!("no queue {device_event}")))?;
        let _busy = self
            .busy
            .get(thread_id)
            .map(|b| b.lock().unwrap_or_else(|p| p.into_inner()));
        self.process(vring)
    }
}

//! The nemesis's model of a workspace and its NBD writers (see the campaign's module docs).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use strata_nbd::client::Client;
use strata_nbd::proto::{CMD_FLAG_FUA, CMD_WRITE};

use crate::common::block;

pub const CLIENTS: u64 = 3;
pub const PER_CLIENT: u64 = 256;
pub const BLOCKS: u64 = CLIENTS * PER_CLIENT;
pub const DISK: u64 = 16 << 20;
/// Codes of zero-writes (trim, write-zeroes, the initial disk) have this bit set: every one
/// reads back as zeros, each is a distinct event in a block's history.
pub const ZERO: u64 = 1 << 63;

pub fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What each block of one workspace may hold.
pub struct Model {
    /// Per block: values in the order their writes were issued (codes, unique).
    pub hist: Vec<Vec<u64>>,
    /// Per block: the newest value a completed FLUSH (or FUA) covered.
    pub durable: Vec<u64>,
    pub next_zero: u64,
    /// Bumped by every rollback: a write or flush issued before a rollback completed may have
    /// been rolled away (or land after it), so it proves nothing afterwards.
    pub gen: u64,
    /// Values issued and not (yet) acknowledged: in flight, or failed without saying whether
    /// they landed. Such a value may land after a rollback.
    pub unsettled: std::collections::HashSet<u64>,
}

impl Model {
    pub fn new() -> Model {
        Model {
            hist: (0..BLOCKS).map(|b| vec![ZERO | b]).collect(),
            durable: (0..BLOCKS).map(|b| ZERO | b).collect(),
            next_zero: BLOCKS,
            gen: 0,
            unsettled: Default::default(),
        }
    }
    pub fn zero_code(&mut self) -> u64 {
        self.next_zero += 1;
        ZERO | self.next_zero
    }
    pub fn pos(&self, b: usize, v: u64) -> Option<usize> {
        self.hist[b].iter().rposition(|&x| x == v)
    }
    /// A FLUSH covered `v` at block `b` (ignored if a rollback replaced it since, or if a
    /// newer value is already durable).
    pub fn mark(&mut self, b: usize, v: u64) -> bool {
        if let (Some(p), Some(d)) = (self.pos(b, v), self.pos(b, self.durable[b])) {
            if p > d {
                self.durable[b] = v;
                return true;
            }
        }
        false
    }
    /// Values block `b` may read as now: the durable one or anything issued after it.
    pub fn allowed(&self, b: usize) -> &[u64] {
        let d = self.pos(b, self.durable[b]).unwrap_or(0);
        &self.hist[b][d..]
    }
    /// Where each block's allowed values begin (at a checkpoint's request).
    pub fn starts(&self) -> Vec<usize> {
        (0..BLOCKS as usize)
            .map(|b| self.pos(b, self.durable[b]).unwrap_or(0))
            .collect()
    }
    /// What a checkpoint requested at `starts` may hold, now that it completed.
    pub fn window(&self, starts: &[usize]) -> Vec<Vec<u64>> {
        (0..BLOCKS as usize)
            .map(|b| self.hist[b][starts[b].min(self.hist[b].len())..].to_vec())
            .collect()
    }
    /// What a rollback needs from before it is requested: history lengths and the values
    /// still unsettled then.
    pub fn before_rollback(&self) -> (Vec<usize>, std::collections::HashSet<u64>) {
        (
            self.hist.iter().map(|h| h.len()).collect(),
            self.unsettled.clone(),
        )
    }
    /// A rollback to a checkpoint holding `content`, requested at `before`, completed: each
    /// block holds the checkpoint's value, or a write that was unsettled at the request or
    /// issued after it.
    pub fn rebase(
        &mut self,
        content: &[u64],
        before: &(Vec<usize>, std::collections::HashSet<u64>),
    ) {
        let (lens, unsettled) = before;
        self.gen += 1;
        for b in 0..BLOCKS as usize {
            let base = if content[b] & ZERO != 0 {
                self.zero_code()
            } else {
                content[b]
            };
            let mut h = vec![base];
            h.extend(
                self.hist[b][..lens[b]]
                    .iter()
                    .filter(|v| unsettled.contains(v)),
            );
            h.extend_from_slice(&self.hist[b][lens[b]..]);
            self.hist[b] = h;
            self.durable[b] = base;
        }
    }
    /// After a check that flushed and read everything: the history collapses to what is there.
    pub fn settle(&mut self, seen: &[u64]) {
        self.unsettled.clear();
        for b in 0..BLOCKS as usize {
            self.hist[b] = vec![seen[b]];
            self.durable[b] = seen[b];
        }
    }
}

/// Whether `got` (a block's tag; 0 for zeros) is one of `allowed`.
pub fn matches(got: u64, allowed: &[u64]) -> Option<u64> {
    if got == 0 {
        allowed.iter().find(|&&v| v & ZERO != 0).copied()
    } else {
        allowed.contains(&got).then_some(got)
    }
}

#[derive(Default)]
pub struct Tally {
    pub ops: Mutex<HashMap<&'static str, u64>>,
    pub writes_acked: AtomicU64,
    pub flushes: AtomicU64,
    /// Writes a FLUSH (or FUA) made a promise of, each checked at the next step.
    pub flushed_writes: AtomicU64,
    pub verified: AtomicU64,
    pub lost: AtomicU64,
    pub wrong: AtomicU64,
    pub failures: Mutex<Vec<String>>,
}

/// One workspace under test: its model, where it is served, and its clients.
pub struct Ws {
    pub name: &'static str,
    pub model: Mutex<Model>,
    /// The socket it is exported on now (None while moving).
    pub socket: Mutex<Option<String>>,
    /// Bumped whenever the volume behind the socket changes (detach, restart, takeover):
    /// clients drop what they had not flushed when they reconnect across it.
    pub epoch: AtomicU64,
}

/// A client: random writes, FUA writes, trims, zeroing and flushes on its own block range,
/// until `stop`. Returns how many writes and flushes succeeded.
pub async fn client(ws: Arc<Ws>, id: u64, seed: u64, stop: Arc<AtomicBool>, tally: Arc<Tally>) {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tag = (id + 1) << 40 | seed & 0xffff_ffff;
    let mut conn: Option<(Client<tokio::net::UnixStream>, u64)> = None;
    // (block, value, model generation at its acknowledgement) acknowledged on this connection
    // since its last flush.
    let mut pending: Vec<(usize, u64, u64)> = vec![];
    while !stop.load(SeqCst) {
        let epoch = ws.epoch.load(SeqCst);
        if conn.as_ref().is_none_or(|(_, e)| *e != epoch) {
            pending.clear();
            conn = None;
            let sock = lock(&ws.socket).clone();
            if let Some(sock) = sock {
                if let Ok(Ok(c)) = tokio::time::timeout(
                    Duration::from_secs(2),
                    Client::connect_unix(Path::new(&sock), ws.name),
                )
                .await
                {
                    conn = Some((c, epoch));
                }
            }
            if conn.is_none() {
                tokio::time::sleep(Duration::from_millis(30)).await;
                continue;
            }
        }
        let Some((c, _)) = conn.as_mut() else {
            continue;
        };
        let base = id * PER_CLIENT;
        let roll = rng.random_range(0..100);
        let timeout = Duration::from_secs(30);
        let ok = if roll < 70 {
            let b = base + rng.random_range(0..PER_CLIENT);
            tag += 1;
            let fua = rng.random_bool(0.1);
            let gen = {
                let mut m = lock(&ws.model);
                m.hist[b as usize].push(tag);
                m.unsettled.insert(tag);
                m.gen
            };
            let r = tokio::time::timeout(
                timeout,
                c.request(
                    if fua { CMD_FLAG_FUA } else { 0 },
                    CMD_WRITE,
                    b * 4096,
                    4096,
                    &block(tag, b),
                ),
            )
            .await;
            let ok = matches!(r, Ok(Ok(_)));
            if ok {
                tally.writes_acked.fetch_add(1, SeqCst);
                let mut m = lock(&ws.model);
                m.unsettled.remove(&tag);
                if fua && m.gen == gen {
                    if m.mark(b as usize, tag) {
                        tally.flushed_writes.fetch_add(1, SeqCst);
                    }
                } else if !fua {
                    pending.push((b as usize, tag, gen));
                }
            }
            ok
        } else if roll < 85 {
            let b = base + rng.random_range(0..PER_CLIENT - 8);
            let n = rng.random_range(1..=8u64);
            let (codes, gen): (Vec<u64>, u64) = {
                let mut m = lock(&ws.model);
                let codes = (b..b + n)
                    .map(|x| {
                        let z = m.zero_code();
                        m.hist[x as usize].push(z);
                        m.unsettled.insert(z);
                        z
                    })
                    .collect();
                (codes, m.gen)
            };
            let r = if rng.random_bool(0.5) {
                tokio::time::timeout(timeout, c.trim(b * 4096, (n * 4096) as u32)).await
            } else {
                tokio::time::timeout(timeout, c.write_zeroes(b * 4096, (n * 4096) as u32)).await
            };
            let ok = matches!(r, Ok(Ok(_)));
            if ok {
                let mut m = lock(&ws.model);
                for z in &codes {
                    m.unsettled.remove(z);
                }
                pending.extend((b..b + n).zip(codes).map(|(x, z)| (x as usize, z, gen)));
            }
            ok
        } else {
            let covered = std::mem::take(&mut pending);
            let gen = lock(&ws.model).gen;
            let r = tokio::time::timeout(timeout, c.flush()).await;
            let ok = matches!(r, Ok(Ok(_)));
            if ok {
                tally.flushes.fetch_add(1, SeqCst);
                let mut m = lock(&ws.model);
                if m.gen == gen {
                    for (b, v, g) in covered {
                        if g == gen && m.mark(b, v) {
                            tally.flushed_writes.fetch_add(1, SeqCst);
                        }
                    }
                }
            }
            ok
        };
        if !ok {
            // Refused or cut off: reconnect (the workspace may be moving); unflushed writes stay
            // possible, never promised.
            pending.clear();
            conn = None;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    if let Some((c, _)) = conn {
        let _ = c.disconnect().await;
    }
}

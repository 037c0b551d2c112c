//! The overlay's sorted map of runs, dense: each run packed into 24 bytes, runs kept in sorted
//! chunks of at most [`CHUNK`] (a `BTreeMap` of chunks, keyed by a lower bound of their runs'
//! first blocks), so memory per run is about 24 bytes plus a few for the chunks.
//!
//! Chunks are shared between copies (`Arc`, copied on their first write): a copy of a map of
//! a million runs costs one pointer per chunk, and a live fork that inherits its source's
//! layers shares their runs until one side changes them.
//!
//! Packing (three `u64`s): the first block (38 bits: [`MAX_DISK_SIZE`] is 2^50 bytes) and the
//! length (26 bits; [`Runs::insert`] callers split longer runs, see [`MAX_LEN`]); the record's
//! sequence number (48 bits: 2^48 records of at least one header each) and the journal
//! segment id (40 bits, 2^40 - 1 meaning zeros); the byte offset in the segment (40 bits:
//! segments are bounded far below 1 TiB, see [`MAX_OFF`]). A value past its field is a broken
//! invariant of the engine, not tenant input (tenant block ranges are checked against the
//! disk size first), and panics rather than aliasing another run.
//!
//! [`MAX_DISK_SIZE`]: strata_format::manifest::MAX_DISK_SIZE

use std::collections::BTreeMap;
use std::sync::Arc;

use super::{Loc, Run};

/// Most blocks one packed run covers.
pub(crate) const MAX_LEN: u64 = (1 << 26) - 1;
/// Largest byte offset in a segment a run can name.
pub(crate) const MAX_OFF: u64 = (1 << 40) - 1;
const MAX_LBA: u64 = 1 << 38;
const MAX_SEQ: u64 = (1 << 48) - 1;
const ZERO_SEG: u64 = (1 << 40) - 1;
/// Most runs in one chunk; a full chunk splits in two.
const CHUNK: usize = 64;
/// Spare capacity a chunk grows by: a little slack, not doubling.
const GROW: usize = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Packed([u64; 3]);

impl Packed {
    fn new(lba: u64, r: Run) -> Packed {
        assert!(
            lba < MAX_LBA && (1..=MAX_LEN).contains(&r.len) && r.seq <= MAX_SEQ,
            "overlay run out of range: lba {lba}, {r:?}"
        );
        let (seg, off) = match r.loc {
            Loc::Journal { seg, off } => {
                assert!(
                    seg < ZERO_SEG && off <= MAX_OFF,
                    "journal location out of range: {r:?}"
                );
                (seg, off)
            }
            Loc::Zero => (ZERO_SEG, 0),
        };
        Packed([
            lba << 26 | r.len,
            r.seq << 16 | seg >> 24,
            (seg & 0xff_ffff) << 40 | off,
        ])
    }

    fn lba(&self) -> u64 {
        self.0[0] >> 26
    }

    fn run(&self) -> Run {
        let seg = (self.0[1] & 0xffff) << 24 | self.0[2] >> 40;
        Run {
            len: self.0[0] & MAX_LEN,
            seq: self.0[1] >> 16,
            loc: if seg == ZERO_SEG {
                Loc::Zero
            } else {
                Loc::Journal {
                    seg,
                    off: self.0[2] & MAX_OFF,
                }
            },
        }
    }
}

/// Non-overlapping runs by first block (the caller keeps them non-overlapping).
#[derive(Clone, Default, Debug)]
pub(crate) struct Runs {
    /// Chunk lower bound → runs sorted by first block, each `>=` the bound and `<` the next
    /// chunk's bound. No chunk is empty.
    chunks: BTreeMap<u64, Arc<Vec<Packed>>>,
    len: usize,
}

impl Runs {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, Run)> + '_ {
        self.chunks
            .values()
            .flat_map(|c| c.iter())
            .map(|p| (p.lba(), p.run()))
    }

    /// The run starting last before `lba`.
    pub fn last_before(&self, lba: u64) -> Option<(u64, Run)> {
        for c in self.chunks.range(..=lba).rev().map(|(_, c)| c) {
            let i = c.partition_point(|p| p.lba() < lba);
            if i > 0 {
                let p = c[i - 1];
                return Some((p.lba(), p.run()));
            }
        }
        None
    }

    /// Runs starting in `from..to`, in order.
    pub fn range(&self, from: u64, to: u64) -> impl Iterator<Item = (u64, Run)> + '_ {
        let first = self
            .chunks
            .range(..=from)
            .next_back()
            .map_or(0, |(k, _)| *k);
        self.chunks
            .range(first..to.max(first))
            .flat_map(move |(_, c)| {
                let i = c.partition_point(|p| p.lba() < from);
                c[i..].iter()
            })
            .take_while(move |p| p.lba() < to)
            .map(|p| (p.lba(), p.run()))
    }

    /// The bound of the chunk `lba` belongs in.
    fn home(&self, lba: u64) -> Option<u64> {
        self.chunks.range(..=lba).next_back().map(|(k, _)| *k)
    }

    /// Adds a run starting at `lba` (where none starts; callers remove first).
    pub fn insert(&mut self, lba: u64, r: Run) {
        let p = Packed::new(lba, r);
        let key = match self.home(lba) {
            Some(k) => k,
            None => match self.chunks.pop_first() {
                // Before every chunk: the first chunk's bound moves down to it.
                Some((_, c)) => {
                    self.chunks.insert(lba, c);
                    lba
                }
                None => {
                    self.chunks.insert(lba, Arc::new(Vec::with_capacity(GROW)));
                    lba
                }
            },
        };
        let c = Arc::make_mut(self.chunks.get_mut(&key).expect("home chunk"));
        let i = c.partition_point(|q| q.lba() < lba);
        debug_assert!(
            c.get(i).is_none_or(|q| q.lba() != lba),
            "run at {lba} exists"
        );
        if c.len() == c.capacity() {
            c.reserve_exact(GROW);
        }
        c.insert(i, p);
        self.len += 1;
        if c.len() > CHUNK {
            // In half; but a run appended at the end (a sequential writer) moves on alone, so
            // chunks behind an append point stay full.
            let at = if i == CHUNK { CHUNK } else { CHUNK / 2 };
            let mut upper = Vec::with_capacity(c.len() - at + GROW);
            upper.extend_from_slice(&c[at..]);
            c.truncate(at);
            c.shrink_to_fit();
            self.chunks.insert(upper[0].lba(), Arc::new(upper));
        }
    }

    /// Removes the run starting at `lba`, if there is one.
    pub fn remove(&mut self, lba: u64) -> Option<Run> {
        let key = self.home(lba)?;
        let i = self.chunks[&key]
            .binary_search_by_key(&lba, |p| p.lba())
            .ok()?;
        let c = Arc::make_mut(self.chunks.get_mut(&key)?);
        let r = c.remove(i).run();
        self.len -= 1;
        if c.is_empty() {
            self.chunks.remove(&key);
        } else if c.capacity() > c.len() + 2 * GROW {
            c.shrink_to(c.len() + GROW);
        }
        Some(r)
    }

    /// Keeps only the runs `keep` accepts, repacking the chunks.
    pub fn retain(&mut self, mut keep: impl FnMut(&Run) -> bool) {
        let kept: Vec<Packed> = self
            .chunks
            .values()
            .flat_map(|c| c.iter())
            .filter(|p| keep(&p.run()))
            .copied()
            .collect();
        self.chunks.clear();
        self.len = kept.len();
        for c in kept.chunks(CHUNK * 3 / 4) {
            let mut v = Vec::with_capacity(c.len() + GROW);
            v.extend_from_slice(c);
            self.chunks.insert(c[0].lba(), Arc::new(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn packing_round_trips(
            lba in 0u64..MAX_LBA,
            len in 1u64..=MAX_LEN,
            seq in 0u64..=MAX_SEQ,
            seg in proptest::option::of(0u64..ZERO_SEG),
            off in 0u64..=MAX_OFF,
        ) {
            let loc = seg.map_or(Loc::Zero, |seg| Loc::Journal { seg, off });
            let r = Run { len, seq, loc };
            let p = Packed::new(lba, r);
            prop_assert_eq!(p.lba(), lba);
            prop_assert_eq!(p.run(), r);
        }

        /// Against a `BTreeMap`: inserts, removals, `last_before`, `range` and `retain` agree,
        /// and copies taken along the way (sharing chunks) keep what they held.
        #[test]
        fn matches_a_btreemap(ops in proptest::collection::vec((0u8..4, 0u64..2000, 0u64..2000), 1..600)) {
            let mut m: BTreeMap<u64, Run> = BTreeMap::new();
            let mut r = Runs::default();
            let mut copies = vec![];
            for (i, (op, a, b)) in ops.into_iter().enumerate() {
                if i % 97 == 13 {
                    copies.push((r.clone(), m.clone()));
                }
                let run = Run { len: 1 + b % 7, seq: i as u64, loc: Loc::Journal { seg: b, off: a * 3 } };
                match op {
                    0 | 1 => if let std::collections::btree_map::Entry::Vacant(e) = m.entry(a) {
                        e.insert(run);
                        r.insert(a, run);
                    },
                    2 => prop_assert_eq!(m.remove(&a), r.remove(a)),
                    _ => if i % 50 == 0 {
                        m.retain(|_, x| x.seq % 3 != 0);
                        r.retain(|x| x.seq % 3 != 0);
                    },
                }
                prop_assert_eq!(r.len(), m.len());
                prop_assert_eq!(r.last_before(a), m.range(..a).next_back().map(|(k, v)| (*k, *v)));
                let (lo, hi) = (a.min(b), a.max(b));
                let want: Vec<_> = m.range(lo..hi).map(|(k, v)| (*k, *v)).collect();
                prop_assert_eq!(r.range(lo, hi).collect::<Vec<_>>(), want);
            }
            prop_assert_eq!(r.iter().collect::<Vec<_>>(), m.into_iter().collect::<Vec<_>>());
            for (r, m) in copies {
                prop_assert_eq!(r.len(), m.len());
                prop_assert_eq!(r.iter().collect::<Vec<_>>(), m.into_iter().collect::<Vec<_>>());
            }
            for c in r.chunks.values() {
                prop_assert!(!c.is_empty() && c.len() <= CHUNK);
            }
        }
    }

    #[test]
    #[should_panic(expected = "out of range")]
    fn a_value_past_its_field_is_refused() {
        let r = Run {
            len: 1,
            seq: 1,
            loc: Loc::Journal {
                seg: 1,
                off: MAX_OFF + 1,
            },
        };
        Packed::new(0, r);
    }
}

//! The overlay: blocks written locally since the base manifest, as a sorted map of runs.
//!
//! A volume reads through up to three layers: the *active* overlay (writes since the last cut),
//! a *frozen* overlay (a cut being published), and the base manifest. Each overlay maps
//! non-overlapping block runs to where their newest bytes are: a journal record, or zeros.
//! Memory is per run, not per block of disk size: about 24 bytes each ([`runs`]).

mod runs;

use std::sync::Arc;

use strata_format::BLOCK_SIZE;

pub(crate) use runs::MAX_OFF;
use runs::{Runs, MAX_LEN};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Loc {
    /// Bytes at `off` of journal segment `seg`.
    Journal { seg: u64, off: u64 },
    /// Reads as zeros.
    Zero,
}

impl Loc {
    pub(crate) fn advance(self, blocks: u64) -> Loc {
        match self {
            Loc::Journal { seg, off } => Loc::Journal {
                seg,
                off: off + blocks * BLOCK_SIZE,
            },
            Loc::Zero => Loc::Zero,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub len: u64,
    pub seq: u64,
    pub loc: Loc,
}

#[derive(Clone, Default, Debug)]
pub(crate) struct Overlay {
    map: Runs,
    blocks: u64,
}

/// Where a piece of a read comes from, from one overlay's point of view.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Hit {
    Here(Run),
    /// Not in this layer: look below.
    Below,
}

impl Overlay {
    pub fn runs(&self) -> usize {
        self.map.len()
    }

    /// Blocks covered by journal data (not zeros).
    pub fn data_blocks(&self) -> u64 {
        self.blocks
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, Run)> + '_ {
        self.map.iter()
    }

    fn count(&mut self, r: &Run, add: bool) {
        if matches!(r.loc, Loc::Journal { .. }) {
            if add {
                self.blocks += r.len;
            } else {
                self.blocks -= r.len;
            }
        }
    }

    /// Maps `lba..lba+r.len` to `r` where nothing starts (runs longer than a packed run can
    /// hold are stored as several).
    fn put(&mut self, lba: u64, r: Run) {
        self.count(&r, true);
        let mut at = 0;
        while at < r.len {
            let len = (r.len - at).min(MAX_LEN);
            let piece = Run {
                len,
                loc: r.loc.advance(at),
                ..r
            };
            self.map.insert(lba + at, piece);
            at += len;
        }
    }

    fn take(&mut self, lba: u64) -> Option<Run> {
        let r = self.map.remove(lba)?;
        self.count(&r, false);
        Some(r)
    }

    /// Re-inserts the part of run `r` (starting at `s`) that lies past `end`, if any.
    fn keep_tail(&mut self, s: u64, r: Run, end: u64) {
        if s + r.len > end {
            let tail = Run {
                len: s + r.len - end,
                loc: r.loc.advance(end - s),
                ..r
            };
            self.put(end, tail);
        }
    }

    /// [`Overlay::insert`] for a record written outside the journal's lock: blocks already
    /// mapped to a newer record (one reserved later that finished first) keep it, as replay,
    /// which applies records in sequence order, would leave them.
    pub fn insert_newer(&mut self, lba: u64, len: u64, seq: u64, loc: Loc) {
        let end = lba + len;
        let mut newer: Vec<(u64, u64)> = vec![];
        let before = self.map.last_before(lba);
        for (s, r) in before.into_iter().chain(self.map.range(lba, end)) {
            if r.seq > seq && s + r.len > lba {
                newer.push((s.max(lba), (s + r.len).min(end)));
            }
        }
        if newer.is_empty() {
            return self.insert(lba, len, seq, loc);
        }
        let mut at = lba;
        for (a, b) in newer.into_iter().chain([(end, end)]) {
            if a > at {
                self.insert(at, a - at, seq, loc.advance(at - lba));
            }
            at = at.max(b);
        }
    }

    /// Makes blocks `lba..lba+len` map to `loc` (written at `seq`), replacing what was there.
    pub fn insert(&mut self, lba: u64, len: u64, seq: u64, loc: Loc) {
        let end = lba + len;
        // A run starting before `lba` that reaches into the range: keep its head (and tail).
        if let Some((s, r)) = self.map.last_before(lba) {
            if s + r.len > lba {
                self.take(s);
                self.put(s, Run { len: lba - s, ..r });
                self.keep_tail(s, r, end);
            }
        }
        // Runs starting inside the range: drop them, keeping any tail past `end`.
        let inside: Vec<u64> = self.map.range(lba, end).map(|(k, _)| k).collect();
        for s in inside {
            if let Some(r) = self.take(s) {
                self.keep_tail(s, r, end);
            }
        }
        self.put(lba, Run { len, seq, loc });
    }

    /// Splits `lba..lba+len` into pieces: runs of this layer (trimmed to the range) or gaps.
    pub fn resolve(&self, lba: u64, len: u64, out: &mut Vec<(u64, u64, Hit)>) {
        let end = lba + len;
        let mut cur = lba;
        let start_key = match self.map.last_before(lba + 1) {
            Some((s, r)) if s + r.len > lba => s,
            _ => lba,
        };
        for (s, r) in self.map.range(start_key, end) {
            if s > cur {
                out.push((cur, s - cur, Hit::Below));
                cur = s;
            }
            let stop = (s + r.len).min(end);
            if stop <= cur {
                continue;
            }
            let trimmed = Run {
                len: stop - cur,
                loc: r.loc.advance(cur - s),
                ..r
            };
            out.push((cur, stop - cur, Hit::Here(trimmed)));
            cur = stop;
        }
        if cur < end {
            out.push((cur, end - cur, Hit::Below));
        }
    }

    /// Drops every run written at or before `seq` (they are in a published base now).
    pub fn drop_through(&mut self, seq: u64) {
        let mut gone = 0;
        self.map.retain(|r| {
            let old = r.seq <= seq;
            if old && matches!(r.loc, Loc::Journal { .. }) {
                gone += r.len;
            }
            !old
        });
        self.blocks -= gone;
    }

    /// Lays `self` over `lower`: the result has `lower`'s runs wherever `self` has none.
    pub fn over(self, lower: &Overlay) -> Overlay {
        let mut merged = lower.clone();
        merged.apply(&self);
        merged
    }

    /// Lays `newer` over `self`, in place: its runs replace what `self` has there.
    pub fn apply(&mut self, newer: &Overlay) {
        for (lba, r) in newer.map.iter() {
            self.insert(lba, r.len, r.seq, r.loc);
        }
    }

    /// Lays `self` over `older`, in place: `older`'s runs fill only what `self` has no run for.
    pub fn fill_under(&mut self, older: &Overlay) {
        let mut pieces = vec![];
        for (lba, r) in older.map.iter() {
            pieces.clear();
            self.resolve(lba, r.len, &mut pieces);
            for &(at, len, hit) in &pieces {
                if hit == Hit::Below {
                    self.insert(at, len, r.seq, r.loc.advance(at - lba));
                }
            }
        }
    }

    /// Layers stacked oldest first, as one overlay: the newest run of each block. Costs a copy
    /// of the largest layer and an insert per run of the others; a single layer is shared,
    /// not copied (a live fork of a source with one pending layer copies no run).
    pub fn stack(layers: &[Arc<Overlay>]) -> Arc<Overlay> {
        match layers {
            [] => Arc::new(Overlay::default()),
            [one] => one.clone(),
            _ => {
                let pivot = (0..layers.len())
                    .max_by_key(|&i| layers[i].runs())
                    .unwrap_or(0);
                let mut merged = (*layers[pivot]).clone();
                for older in layers[..pivot].iter().rev() {
                    merged.fill_under(older);
                }
                for newer in &layers[pivot + 1..] {
                    merged.apply(newer);
                }
                Arc::new(merged)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A run longer than one packed run holds (a trim of a large disk) is stored in pieces
    /// and reads back as one range; a write inside it and a drop leave the right blocks.
    #[test]
    fn runs_longer_than_a_packed_run_split_and_read_back() {
        let mut o = Overlay::default();
        let total = 3 * MAX_LEN + 5;
        o.insert(0, total, 1, Loc::Zero);
        assert_eq!(o.runs(), 4);
        let at = 2 * MAX_LEN - 1;
        let data = Loc::Journal { seg: 9, off: 4096 };
        o.insert(at, 4, 2, data);
        o.insert(7, MAX_LEN + 2, 3, Loc::Journal { seg: 10, off: 0 });
        assert_eq!(o.data_blocks(), 4 + MAX_LEN + 2);
        let mut pieces = vec![];
        o.resolve(0, total, &mut pieces);
        let mut lba = 0;
        for &(s, n, hit) in &pieces {
            assert_eq!(s, lba);
            let Hit::Here(r) = hit else {
                panic!("gap at {s}")
            };
            let want = if (7..MAX_LEN + 9).contains(&s) {
                Loc::Journal {
                    seg: 10,
                    off: (s - 7) * BLOCK_SIZE,
                }
            } else if (at..at + 4).contains(&s) {
                data.advance(s - at)
            } else {
                Loc::Zero
            };
            assert_eq!(r.loc, want, "at {s}");
            lba += n;
        }
        assert_eq!(lba, total);
        o.drop_through(2);
        assert_eq!(o.data_blocks(), MAX_LEN + 2);
        pieces.clear();
        o.resolve(0, total, &mut pieces);
        let here: u64 = pieces
            .iter()
            .filter(|p| matches!(p.2, Hit::Here(_)))
            .map(|p| p.1)
            .sum();
        assert_eq!(here, MAX_LEN + 2);
    }

    /// A resolved range block by block: (seq, location) of each, or None below.
    fn per_block(v: &[(u64, u64, Hit)]) -> Vec<Option<(u64, Loc)>> {
        v.iter()
            .flat_map(|&(_, n, h)| {
                (0..n).map(move |i| match h {
                    Hit::Here(r) => Some((r.seq, r.loc.advance(i))),
                    Hit::Below => None,
                })
            })
            .collect()
    }

    proptest! {
        #[test]
        fn matches_a_block_model(ops in proptest::collection::vec((0u64..64, 1u64..16, any::<bool>()), 1..40)) {
            let mut o = Overlay::default();
            let mut model: Vec<Option<Loc>> = vec![None; 80];
            for (seq, (lba, len, zero)) in ops.into_iter().enumerate() {
                let loc = if zero { Loc::Zero } else { Loc::Journal { seg: seq as u64, off: 0 } };
                o.insert(lba, len, seq as u64, loc);
                for i in 0..len {
                    model[(lba + i) as usize] = Some(loc.advance(i));
                }
            }
            let mut pieces = vec![];
            o.resolve(0, 80, &mut pieces);
            let mut lba = 0;
            for (s, n, hit) in pieces {
                prop_assert_eq!(s, lba);
                for i in 0..n {
                    let got = match hit { Hit::Here(r) => Some(r.loc.advance(i)), Hit::Below => None };
                    prop_assert_eq!(got, model[(s + i) as usize]);
                }
                lba += n;
            }
            prop_assert_eq!(lba, 80);
            let data = model.iter().filter(|l| matches!(l, Some(Loc::Journal { .. }))).count() as u64;
            prop_assert_eq!(o.data_blocks(), data);
        }

        /// Records finishing in any order, inserted with `insert_newer`, leave the map that
        /// inserting them in sequence order leaves (what replay rebuilds).
        #[test]
        fn out_of_order_inserts_match_sequence_order(
            ops in proptest::collection::vec((0u64..64, 1u64..16, any::<bool>()), 1..40),
            order in proptest::collection::vec(any::<proptest::sample::Index>(), 40),
        ) {
            let loc = |seq: usize, zero: bool| if zero { Loc::Zero } else { Loc::Journal { seg: seq as u64, off: 1000 * seq as u64 } };
            let mut want = Overlay::default();
            for (seq, &(lba, len, zero)) in ops.iter().enumerate() {
                want.insert(lba, len, seq as u64 + 1, loc(seq, zero));
            }
            let mut left: Vec<usize> = (0..ops.len()).collect();
            let mut got = Overlay::default();
            for ix in order.iter().take(ops.len()) {
                let seq = left.remove(ix.index(left.len()));
                let (lba, len, zero) = ops[seq];
                got.insert_newer(lba, len, seq as u64 + 1, loc(seq, zero));
            }
            let (mut a, mut b) = (vec![], vec![]);
            want.resolve(0, 80, &mut a);
            got.resolve(0, 80, &mut b);
            prop_assert_eq!(per_block(&a), per_block(&b));
            prop_assert_eq!(want.data_blocks(), got.data_blocks());
        }

        /// Stacking layers from the largest outwards leaves what laying each over the ones
        /// before it leaves (what a live fork inherited before `stack`), whatever the layers'
        /// sequence numbers say (a cleaned record can carry a newer one in an older layer).
        #[test]
        fn a_stack_is_each_layer_over_the_ones_before(
            layers in proptest::collection::vec(
                proptest::collection::vec((0u64..64, 1u64..16, any::<bool>(), 0u64..1000), 0..20),
                1..6,
            ),
        ) {
            let overlays: Vec<Arc<Overlay>> = layers.iter().enumerate().map(|(i, ops)| {
                let mut o = Overlay::default();
                for (j, &(lba, len, zero, seq)) in ops.iter().enumerate() {
                    let loc = if zero { Loc::Zero } else { Loc::Journal { seg: i as u64, off: 4096 * j as u64 } };
                    o.insert(lba, len, seq, loc);
                }
                Arc::new(o)
            }).collect();
            let mut want = (*overlays[0]).clone();
            for o in &overlays[1..] {
                want = (**o).clone().over(&want);
            }
            let got = Overlay::stack(&overlays);
            let (mut a, mut b) = (vec![], vec![]);
            want.resolve(0, 80, &mut a);
            got.resolve(0, 80, &mut b);
            prop_assert_eq!(per_block(&a), per_block(&b));
            prop_assert_eq!(want.data_blocks(), got.data_blocks());
        }
    }
}

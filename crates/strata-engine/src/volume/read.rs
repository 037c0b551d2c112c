//! Reads: a plan per block range over the active overlay, the pending layers (newest first)
//! and the base manifest, then the journal, the node cache or the store for each piece.

use super::*;

/// A piece of a read plan.
enum Src {
    Journal(SegFile, u64),
    Zero,
    Object(ObjectRef, u64),
}

impl Volume {
    pub(super) fn check_range(&self, offset: u64, len: u64) -> Result<()> {
        let size = self.size();
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(Error::OutOfRange { offset, len, size }),
        }
    }

    fn plan(&self, lba: u64, n: u64) -> Vec<(u64, u64, Src)> {
        let st = self.st();
        // Active, then pending layers newest first, then the base; under a local rollback to
        // version V only layers up to V, then V's manifest once it is published.
        let mut layers: Vec<&Overlay> = vec![&st.active];
        let mut base: &Manifest = &st.base;
        let mut floor = u64::MAX;
        for l in st.pending.iter().rev() {
            if l.rec.version > floor {
                continue;
            }
            layers.push(&l.overlay);
            if let Some(v) = l.rec.rollback_to {
                floor = floor.min(v);
                if let Some((_, m)) = &l.under {
                    base = m; // Every layer still below is later than V.
                    break;
                }
            }
        }
        let mut out = Vec::new();
        self.plan_layers(&st, base, &layers, lba, n, &mut out);
        out
    }

    /// The plan of `lba..lba+n` through `layers` (topmost first), then `base`.
    fn plan_layers(
        &self,
        st: &State,
        base: &Manifest,
        layers: &[&Overlay],
        lba: u64,
        n: u64,
        out: &mut Vec<(u64, u64, Src)>,
    ) {
        let Some((top, below)) = layers.split_first() else {
            let mut pieces = Vec::new();
            base.resolve(lba, n, &mut pieces);
            for p in &pieces {
                let src = match p.at {
                    None => Src::Zero,
                    Some((o, off)) => Src::Object(base.objects[o as usize], off),
                };
                out.push((p.lba, p.len, src));
            }
            return;
        };
        let mut hits = Vec::new();
        top.resolve(lba, n, &mut hits);
        for (s, len, hit) in hits {
            match hit {
                Hit::Here(r) => out.push((s, len, self.src_of(st, r.loc))),
                Hit::Below => self.plan_layers(st, base, below, s, len, out),
            }
        }
    }

    fn src_of(&self, st: &State, loc: Loc) -> Src {
        match loc {
            Loc::Zero => Src::Zero,
            Loc::Journal { seg, off } => match st.files.get(&seg) {
                Some(f) => Src::Journal(f.clone(), off),
                // Unreachable by construction; reading zeros would be wrong data, so fail loudly.
                None => Src::Journal(SegFile::new(Arc::new(MissingSegment(seg))), off),
            },
        }
    }

    /// Reads whole blocks `lba..lba+n` into `buf`.
    pub(super) async fn read_blocks(&self, lba: u64, n: u64, buf: &mut [u8]) -> Result<()> {
        let plan = self.plan(lba, n);
        let mut remote = Vec::new();
        for (s, len, src) in plan {
            let at = ((s - lba) * BLOCK_SIZE) as usize;
            let bytes = (len * BLOCK_SIZE) as usize;
            let dst = &mut buf[at..at + bytes];
            match src {
                Src::Zero => dst.fill(0),
                Src::Journal(f, off) => f
                    .file
                    .read_at(dst, off)
                    .map_err(Error::io(format!("reading journal of {}", self.name)))?,
                Src::Object(o, off) => remote.push((at, bytes, o, off)),
            }
        }
        if remote.is_empty() {
            return Ok(());
        }
        for &(_, bytes, o, off) in &remote {
            self.reader.read_ahead(&self.tenant, &o, off, bytes as u64);
        }
        let fetched =
            futures::future::join_all(remote.iter().map(|&(_, bytes, o, off)| async move {
                let mut v = vec![0u8; bytes];
                self.reader
                    .read_into(&self.tenant, &o, off, &mut v)
                    .await
                    .map(|_| v)
            }))
            .await;
        for ((at, bytes, _, _), v) in remote.iter().zip(fetched) {
            buf[*at..*at + *bytes].copy_from_slice(&v?);
        }
        Ok(())
    }

    /// Reads `len` bytes at `offset`.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let lba = offset / BLOCK_SIZE;
        let end = (offset + len).div_ceil(BLOCK_SIZE);
        let mut buf = vec![0u8; ((end - lba) * BLOCK_SIZE) as usize];
        self.read_blocks(lba, end - lba, &mut buf).await?;
        self.counters.bytes_read.fetch_add(len, SeqCst);
        let head = (offset - lba * BLOCK_SIZE) as usize;
        buf.drain(..head);
        buf.truncate(len as usize);
        Ok(buf)
    }

    /// Allocation map of `len` bytes at `offset`: runs of (bytes, reads-as-zeros), in order,
    /// covering exactly the range (NBD block status, `base:allocation`).
    pub fn allocation(&self, offset: u64, len: u64) -> Result<Vec<(u64, bool)>> {
        self.check_range(offset, len)?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let lba = offset / BLOCK_SIZE;
        let end = (offset + len).div_ceil(BLOCK_SIZE);
        let mut out: Vec<(u64, bool)> = Vec::new();
        for (s, n, src) in self.plan(lba, end - lba) {
            let a = (s * BLOCK_SIZE).max(offset);
            let b = ((s + n) * BLOCK_SIZE).min(offset + len);
            let zero = matches!(src, Src::Zero);
            match out.last_mut() {
                Some((l, z)) if *z == zero => *l += b - a,
                _ => out.push((b - a, zero)),
            }
        }
        Ok(out)
    }
}

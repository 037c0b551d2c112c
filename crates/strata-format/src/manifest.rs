//! The manifest: an immutable, flattened, cumulative map of a whole logical disk.
//!
//! Every block of the disk is either covered by exactly one extent (its bytes live in an object
//! at an offset) or by none (it reads as zeros; zeros cost nothing). A read is one binary search,
//! never a walk through parents. A manifest is named by the BLAKE3 hash of its encoding.
//!
//! Encoding, version 1 (little endian):
//! ```text
//! header 40 B : "STRATAMF" | version u32 (1) | block_size u32 (4096) | disk_size u64 |
//!               n_objects u32 | salt u32 | n_extents u64
//! objects     : n_objects x { id [32] | data_len u64 }                  (40 B each)
//! extents     : n_extents x { lba u64 | len u32 | object u32 | offset u64 } (24 B each),
//!               sorted by lba, non-overlapping, offset in bytes, block aligned
//! checksum    : BLAKE3 of everything above (32 B)
//! ```

use std::collections::HashMap;

use crate::{Error, Hash, Reader, BLOCK_SIZE};

pub const MANIFEST_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"STRATAMF";
const HEADER_LEN: usize = 40;
const OBJECT_LEN: usize = 40;
const EXTENT_LEN: usize = 24;
/// Largest logical disk strata accepts: 1 PiB.
pub const MAX_DISK_SIZE: u64 = 1 << 50;
/// Extents are at most this many blocks long (fits the u32 length field).
pub const MAX_EXTENT_BLOCKS: u64 = u32::MAX as u64;

/// An object referenced by a manifest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjectRef {
    pub id: Hash,
    pub data_len: u64,
}

/// `len` blocks starting at block `lba`, stored at byte `offset` of object number `object`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub lba: u64,
    pub len: u32,
    pub object: u32,
    pub offset: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.lba + self.len as u64
    }
}

/// Where a run of blocks comes from, as resolved by [`Manifest::resolve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub lba: u64,
    pub len: u64,
    /// `None` for zeros; otherwise (object index, byte offset in the object).
    pub at: Option<(u32, u64)>,
}

/// A replacement of `len` blocks at `lba`: new data in an object, or zeros (`None`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Change {
    pub lba: u64,
    pub len: u64,
    pub at: Option<(ObjectRef, u64)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    pub disk_size: u64,
    pub objects: Vec<ObjectRef>,
    pub extents: Vec<Extent>,
}

impl Manifest {
    /// An all-zero disk of `disk_size` bytes.
    pub fn empty(disk_size: u64) -> Result<Manifest, Error> {
        let m = Manifest {
            disk_size,
            objects: vec![],
            extents: vec![],
        };
        m.validate()?;
        Ok(m)
    }

    pub fn disk_blocks(&self) -> u64 {
        self.disk_size / BLOCK_SIZE
    }

    /// Bytes of data the manifest maps (not counting zeros).
    pub fn mapped_bytes(&self) -> u64 {
        self.extents.iter().map(|e| e.len as u64 * BLOCK_SIZE).sum()
    }

    /// Checks every structural invariant; decoders call it, builders may.
    pub fn validate(&self) -> Result<(), Error> {
        const W: &str = "manifest";
        if !self.disk_size.is_multiple_of(BLOCK_SIZE) || self.disk_size == 0 {
            return Err(Error::invalid(
                W,
                "disk size must be a non-zero multiple of 4096",
            ));
        }
        if self.disk_size > MAX_DISK_SIZE {
            return Err(Error::invalid(W, "disk size above 1 PiB"));
        }
        if self.objects.len() > u32::MAX as usize {
            return Err(Error::invalid(W, "too many objects"));
        }
        let blocks = self.disk_blocks();
        let mut prev_end = 0u64;
        for e in &self.extents {
            if e.len == 0 {
                return Err(Error::invalid(W, "empty extent"));
            }
            if e.lba < prev_end {
                return Err(Error::invalid(W, "extents overlap or are unsorted"));
            }
            if e.end() > blocks {
                return Err(Error::invalid(W, "extent past the end of the disk"));
            }
            let Some(obj) = self.objects.get(e.object as usize) else {
                return Err(Error::invalid(W, "extent names a missing object"));
            };
            if !e.offset.is_multiple_of(BLOCK_SIZE) {
                return Err(Error::invalid(W, "extent offset not block aligned"));
            }
            let end = e.offset.checked_add(e.len as u64 * BLOCK_SIZE);
            if end.is_none_or(|end| end > obj.data_len) {
                return Err(Error::invalid(W, "extent past the end of its object"));
            }
            prev_end = e.end();
        }
        Ok(())
    }

    /// The encoding with salt 0.
    pub fn encode(&self) -> Vec<u8> {
        self.encode_salted(0)
    }

    /// The encoding with `salt` in the header: the same manifest under another salt has another
    /// id (writers salt every stored manifest so a collected key is never written again).
    /// Decoders ignore the salt.
    pub fn encode_salted(&self, salt: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEADER_LEN + self.objects.len() * OBJECT_LEN + self.extents.len() * EXTENT_LEN + 32,
        );
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&MANIFEST_VERSION.to_le_bytes());
        out.extend_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        out.extend_from_slice(&self.disk_size.to_le_bytes());
        out.extend_from_slice(&(self.objects.len() as u32).to_le_bytes());
        out.extend_from_slice(&salt.to_le_bytes());
        out.extend_from_slice(&(self.extents.len() as u64).to_le_bytes());
        for o in &self.objects {
            out.extend_from_slice(&o.id.0);
            out.extend_from_slice(&o.data_len.to_le_bytes());
        }
        for e in &self.extents {
            out.extend_from_slice(&e.lba.to_le_bytes());
            out.extend_from_slice(&e.len.to_le_bytes());
            out.extend_from_slice(&e.object.to_le_bytes());
            out.extend_from_slice(&e.offset.to_le_bytes());
        }
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        out
    }

    /// The manifest's id: BLAKE3 of its encoding.
    pub fn id(&self) -> Hash {
        Hash::of(&self.encode())
    }

    /// Decodes untrusted bytes. Any corruption or truncation is an error, never a panic, and no
    /// allocation is sized from an unchecked count.
    pub fn decode(buf: &[u8]) -> Result<Manifest, Error> {
        const W: &str = "manifest";
        if buf.len() < HEADER_LEN + 32 {
            return Err(Error::Truncated {
                what: W,
                need: (HEADER_LEN + 32) as u64,
                have: buf.len() as u64,
            });
        }
        let mut r = Reader::new(buf, W);
        if r.take(8)? != MAGIC {
            return Err(Error::BadMagic { what: W });
        }
        let version = r.u32()?;
        if version != MANIFEST_VERSION {
            return Err(Error::UnsupportedVersion { what: W, version });
        }
        let (body, sum) = buf.split_at(buf.len() - 32);
        if blake3::hash(body).as_bytes() != sum {
            return Err(Error::Checksum { what: W });
        }
        let block_size = r.u32()?;
        if block_size as u64 != BLOCK_SIZE {
            return Err(Error::invalid(
                W,
                format!("block size {block_size} is not 4096"),
            ));
        }
        let disk_size = r.u64()?;
        let n_objects = r.u32()? as u64;
        let _reserved = r.u32()?;
        let n_extents = r.u64()?;
        let need = n_objects
            .checked_mul(OBJECT_LEN as u64)
            .and_then(|a| n_extents.checked_mul(EXTENT_LEN as u64).map(|b| (a, b)))
            .and_then(|(a, b)| a.checked_add(b))
            .and_then(|n| n.checked_add(32));
        if need != Some(r.remaining() as u64) {
            return Err(Error::invalid(W, "counts disagree with length"));
        }
        let mut objects = Vec::with_capacity(n_objects as usize);
        for _ in 0..n_objects {
            objects.push(ObjectRef {
                id: Hash(r.array()?),
                data_len: r.u64()?,
            });
        }
        let mut extents = Vec::with_capacity(n_extents as usize);
        for _ in 0..n_extents {
            extents.push(Extent {
                lba: r.u64()?,
                len: r.u32()?,
                object: r.u32()?,
                offset: r.u64()?,
            });
        }
        let m = Manifest {
            disk_size,
            objects,
            extents,
        };
        m.validate()?;
        Ok(m)
    }

    /// Index of the first extent that ends after `lba`.
    fn first_after(&self, lba: u64) -> usize {
        self.extents.partition_point(|e| e.end() <= lba)
    }

    /// Appends to `out` the pieces covering blocks `lba..lba+len`, in order, gaps as zeros.
    pub fn resolve(&self, lba: u64, len: u64, out: &mut Vec<Piece>) {
        let end = lba + len;
        let mut cur = lba;
        let mut i = self.first_after(lba);
        while cur < end {
            match self.extents.get(i) {
                Some(e) if e.lba < end => {
                    if e.lba > cur {
                        out.push(Piece {
                            lba: cur,
                            len: e.lba - cur,
                            at: None,
                        });
                        cur = e.lba;
                    }
                    let stop = e.end().min(end);
                    let off = e.offset + (cur - e.lba) * BLOCK_SIZE;
                    out.push(Piece {
                        lba: cur,
                        len: stop - cur,
                        at: Some((e.object, off)),
                    });
                    cur = stop;
                    i += 1;
                }
                _ => {
                    out.push(Piece {
                        lba: cur,
                        len: end - cur,
                        at: None,
                    });
                    cur = end;
                }
            }
        }
    }

    /// A new manifest: this one with `changes` (sorted by lba, non-overlapping) laid on top.
    /// Unreferenced objects are dropped from the table; adjacent contiguous extents merge.
    pub fn apply(&self, changes: &[Change]) -> Result<Manifest, Error> {
        let mut table: Vec<ObjectRef> = Vec::new();
        let mut index: HashMap<Hash, u32> = HashMap::new();
        let mut intern = |o: ObjectRef| -> u32 {
            *index.entry(o.id).or_insert_with(|| {
                table.push(o);
                (table.len() - 1) as u32
            })
        };
        let mut out: Vec<Extent> = Vec::with_capacity(self.extents.len() + changes.len());
        let push = |out: &mut Vec<Extent>, e: Extent| {
            if let Some(last) = out.last_mut() {
                if last.end() == e.lba
                    && last.object == e.object
                    && last.offset + last.len as u64 * BLOCK_SIZE == e.offset
                    && last.len as u64 + e.len as u64 <= MAX_EXTENT_BLOCKS
                {
                    last.len += e.len;
                    return;
                }
            }
            out.push(e);
        };
        let mut ci = 0usize;
        let mut bi = 0usize;
        let mut base_cur: Option<(Extent, u64)> = None; // (extent, next block to emit)
        loop {
            if base_cur.is_none() && bi < self.extents.len() {
                base_cur = Some((self.extents[bi], self.extents[bi].lba));
                bi += 1;
            }
            let change = changes.get(ci);
            match (base_cur, change) {
                (None, None) => break,
                (Some((e, cur)), c) if c.is_none_or(|c| cur < c.lba) => {
                    // Emit base blocks up to the next change (or the extent's end).
                    let stop = c.map_or(e.end(), |c| c.lba.min(e.end()));
                    let obj = intern(self.objects[e.object as usize]);
                    push(
                        &mut out,
                        Extent {
                            lba: cur,
                            len: (stop - cur) as u32,
                            object: obj,
                            offset: e.offset + (cur - e.lba) * BLOCK_SIZE,
                        },
                    );
                    base_cur = if stop < e.end() {
                        Some((e, stop))
                    } else {
                        None
                    };
                }
                (_, Some(c)) => {
                    if c.len == 0 || c.lba + c.len > self.disk_blocks() {
                        return Err(Error::invalid("manifest change", "outside the disk"));
                    }
                    if let Some((o, off)) = c.at {
                        let mut lba = c.lba;
                        let mut off = off;
                        let obj = intern(o);
                        while lba < c.lba + c.len {
                            let n = (c.lba + c.len - lba).min(MAX_EXTENT_BLOCKS);
                            push(
                                &mut out,
                                Extent {
                                    lba,
                                    len: n as u32,
                                    object: obj,
                                    offset: off,
                                },
                            );
                            lba += n;
                            off += n * BLOCK_SIZE;
                        }
                    }
                    // Skip base blocks under the change.
                    let cend = c.lba + c.len;
                    if let Some((e, cur)) = base_cur {
                        base_cur = if e.end() > cend {
                            Some((e, cur.max(cend)))
                        } else {
                            None
                        };
                    }
                    while base_cur.is_none()
                        && bi < self.extents.len()
                        && self.extents[bi].lba < cend
                    {
                        let e = self.extents[bi];
                        bi += 1;
                        if e.end() > cend {
                            base_cur = Some((e, cend));
                        }
                    }
                    if let Some(next) = changes.get(ci + 1) {
                        if next.lba < cend {
                            return Err(Error::invalid(
                                "manifest change",
                                "changes overlap or are unsorted",
                            ));
                        }
                    }
                    ci += 1;
                }
                (Some(_), None) => unreachable!("handled by the first arm"),
            }
        }
        let m = Manifest {
            disk_size: self.disk_size,
            objects: table,
            extents: out,
        };
        m.validate()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests;

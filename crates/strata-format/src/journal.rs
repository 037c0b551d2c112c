//! Journal records: the local, append-only log a volume writes before acknowledging.
//!
//! ```text
//! header 40 B : magic u32 ("SRJ1") | kind u8 | reserved [3] | seq u64 | lba u64 |
//!               nblocks u32 | payload_len u32 | check [8]
//! payload     : nblocks x 4096 bytes for a write, nothing for zeros
//! ```
//! Each segment file starts with a 32-byte segment header:
//! `"SRJSEG01" | version u32 (1) | reserved u32 | segment id u64 | nonce u64`, where the nonce is
//! chosen at random each time a file (new or recycled) becomes a segment.
//! `check` is the first 8 bytes of BLAKE3(nonce ++ header[0..32] ++ payload), so a record is
//! valid only in the segment incarnation that wrote it: stale records left in a recycled file
//! never verify. Recovery reads records in order and stops at the first one whose header or
//! check is invalid: a torn tail is dropped, never replayed.

use crate::{Error, Reader, BLOCK_SIZE};

pub const HEADER_LEN: usize = 40;
pub const MAGIC: u32 = u32::from_le_bytes(*b"SRJ1");
/// Largest single record: 32 MiB of data.
pub const MAX_RECORD_BLOCKS: u32 = 8192;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Block data follows.
    Write = 1,
    /// The blocks read as zeros (TRIM, WRITE_ZEROES).
    Zero = 2,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: Kind,
    pub seq: u64,
    pub lba: u64,
    pub nblocks: u32,
    pub payload_len: u32,
    pub check: [u8; 8],
}

impl RecordHeader {
    pub fn total_len(&self) -> u64 {
        HEADER_LEN as u64 + self.payload_len as u64
    }
}

pub const SEGMENT_HEADER_LEN: usize = 32;
const SEGMENT_MAGIC: &[u8; 8] = b"SRJSEG01";

/// Encodes a segment header.
pub fn encode_segment_header(id: u64, nonce: u64) -> [u8; SEGMENT_HEADER_LEN] {
    let mut b = [0u8; SEGMENT_HEADER_LEN];
    b[..8].copy_from_slice(SEGMENT_MAGIC);
    b[8..12].copy_from_slice(&1u32.to_le_bytes());
    b[16..24].copy_from_slice(&id.to_le_bytes());
    b[24..32].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// Decodes a segment header: (segment id, nonce).
pub fn decode_segment_header(buf: &[u8]) -> Result<(u64, u64), Error> {
    const W: &str = "journal segment header";
    let mut r = Reader::new(buf, W);
    if r.take(8)? != SEGMENT_MAGIC {
        return Err(Error::BadMagic { what: W });
    }
    let version = r.u32()?;
    if version != 1 {
        return Err(Error::UnsupportedVersion { what: W, version });
    }
    let _reserved = r.u32()?;
    Ok((r.u64()?, r.u64()?))
}

fn check(nonce: u64, head: &[u8], payload: &[u8]) -> [u8; 8] {
    let mut h = blake3::Hasher::new();
    h.update(&nonce.to_le_bytes());
    h.update(head);
    h.update(payload);
    let mut c = [0u8; 8];
    c.copy_from_slice(&h.finalize().as_bytes()[..8]);
    c
}

/// Encodes a whole record (header and payload) into one buffer, ready for a single write.
pub fn encode(nonce: u64, kind: Kind, seq: u64, lba: u64, nblocks: u32, payload: &[u8]) -> Vec<u8> {
    debug_assert_eq!(
        payload.len() as u64,
        if kind == Kind::Write {
            nblocks as u64 * BLOCK_SIZE
        } else {
            0
        }
    );
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&lba.to_le_bytes());
    out.extend_from_slice(&nblocks.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let c = check(nonce, &out[..32], payload);
    out.extend_from_slice(&c);
    out.extend_from_slice(payload);
    out
}

/// Decodes and sanity-checks a header; the payload is checked by [`verify`].
pub fn decode_header(buf: &[u8]) -> Result<RecordHeader, Error> {
    const W: &str = "journal record";
    let mut r = Reader::new(buf, W);
    if r.u32()? != MAGIC {
        return Err(Error::BadMagic { what: W });
    }
    let kind = match r.take(4)?[0] {
        1 => Kind::Write,
        2 => Kind::Zero,
        k => return Err(Error::invalid(W, format!("unknown kind {k}"))),
    };
    let h = RecordHeader {
        kind,
        seq: r.u64()?,
        lba: r.u64()?,
        nblocks: r.u32()?,
        payload_len: r.u32()?,
        check: r.array()?,
    };
    let want = match kind {
        Kind::Write => h.nblocks as u64 * BLOCK_SIZE,
        Kind::Zero => 0,
    };
    if h.nblocks == 0 || h.nblocks > MAX_RECORD_BLOCKS || h.payload_len as u64 != want {
        return Err(Error::invalid(W, "bad length"));
    }
    Ok(h)
}

/// True when `payload` is the intact payload of the record whose raw header is `head`, written
/// in the segment incarnation with this `nonce`.
pub fn verify(nonce: u64, head: &[u8], h: &RecordHeader, payload: &[u8]) -> bool {
    head.len() >= HEADER_LEN && check(nonce, &head[..32], payload) == h.check
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_torn_detection() {
        let payload = vec![9u8; 4096 * 2];
        let rec = encode(42, Kind::Write, 7, 100, 2, &payload);
        let h = decode_header(&rec).unwrap();
        assert_eq!((h.seq, h.lba, h.nblocks, h.kind), (7, 100, 2, Kind::Write));
        assert!(verify(42, &rec, &h, &rec[HEADER_LEN..]));
        assert!(
            !verify(43, &rec, &h, &rec[HEADER_LEN..]),
            "a stale incarnation's record must not verify"
        );
        let mut torn = rec.clone();
        torn[HEADER_LEN + 5000] = 0;
        assert!(!verify(42, &torn, &h, &torn[HEADER_LEN..]));
        let z = encode(1, Kind::Zero, 8, 0, 5, &[]);
        let hz = decode_header(&z).unwrap();
        assert!(verify(1, &z, &hz, &[]));
        let sh = encode_segment_header(9, 77);
        assert_eq!(decode_segment_header(&sh), Ok((9, 77)));
        assert!(decode_segment_header(&sh[..20]).is_err());
        assert_eq!(hz.total_len(), 40);
    }

    #[test]
    fn hostile_headers() {
        assert!(decode_header(&[0; 10]).is_err());
        assert!(decode_header(&[0; 40]).is_err());
        let mut r = encode(0, Kind::Zero, 1, 0, 1, &[]);
        r[4] = 9;
        assert!(decode_header(&r).is_err());
        let mut r = encode(0, Kind::Zero, 1, 0, 1, &[]);
        r[24..28].copy_from_slice(&0u32.to_le_bytes());
        assert!(decode_header(&r).is_err());
        let mut r = encode(0, Kind::Write, 1, 0, 1, &[0; 4096]);
        r[28..32].copy_from_slice(&1u32.to_le_bytes());
        assert!(decode_header(&r).is_err());
    }

    #[test]
    fn golden_v1_header() {
        let r = encode(0, Kind::Zero, 1, 2, 3, &[]);
        assert_eq!(&r[..4], b"SRJ1");
        assert_eq!(r[4], 2);
        assert_eq!(&r[8..16], &1u64.to_le_bytes());
        assert_eq!(&r[16..24], &2u64.to_le_bytes());
        assert_eq!(&r[24..28], &3u32.to_le_bytes());
    }
}

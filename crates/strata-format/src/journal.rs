//! Journal records: the local, append-only log a volume writes before acknowledging.
//!
//! ```text
//! header 40 B : magic u32 ("SRJ1") | kind u8 | reserved [3] | seq u64 | lba u64 |
//!               nblocks u32 | payload_len u32 | check [8]
//! payload     : nblocks x 4096 bytes for a write, nothing for zeros
//! ```
//! Each segment file starts with a 32-byte segment header:
//! `"SRJSEG01" | version u32 | first u32 | segment id u64 | nonce u64`, where the nonce is
//! chosen at random each time a file (new or recycled) becomes a segment, and `first` says
//! which sequence number the segment's first record has: [`seq_code`] of it (never 0), or 0
//! in headers written before it was recorded (the field was reserved, always 0; readers that
//! predate it ignore it). Replay uses it to tell a segment whose every record was lost from
//! one that legitimately held none. The version names the
//! check of every record in the segment, over `nonce ++ header[0..32] ++ payload`:
//! - version 2 (written now): CRC-64/NVME of it, little-endian. Linear, so a record of an earlier
//!   incarnation (another nonce, same bytes) can never verify: the difference is the CRC of a
//!   non-zero 64-bit prefix followed by zeros, never 0 for a degree-64 polynomial. It costs
//!   0.15 µs for a 4 KiB record where BLAKE3 cost 3.5 µs (docs/BENCHMARKS.md).
//! - version 1 (still read): the first 8 bytes of BLAKE3 of it.
//!
//! Either way a record is valid only in the segment incarnation that wrote it: stale records
//! left in a recycled file never verify. Recovery reads records in order and stops at the first
//! one whose header or check is invalid: a torn tail is dropped, never replayed. (The check
//! guards against torn and stale writes, not a tenant: a journal holds one workspace's records,
//! and nothing a record names reaches outside it.)

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

/// The segment format written now (see the module docs); 1 is still read.
pub const SEGMENT_VERSION: u32 = 2;

/// Encodes a segment header of the current version (first sequence number not recorded).
pub fn encode_segment_header(id: u64, nonce: u64) -> [u8; SEGMENT_HEADER_LEN] {
    encode_segment_header_version(SEGMENT_VERSION, id, nonce)
}

/// Encodes a segment header of `version` (an earlier one only to test that it is still read),
/// without its first sequence number.
pub fn encode_segment_header_version(
    version: u32,
    id: u64,
    nonce: u64,
) -> [u8; SEGMENT_HEADER_LEN] {
    encode_segment_header_first(version, id, nonce, 0)
}

/// Encodes a segment header whose first record will have a sequence number of code `first`
/// ([`seq_code`]; 0: not recorded).
pub fn encode_segment_header_first(
    version: u32,
    id: u64,
    nonce: u64,
    first: u32,
) -> [u8; SEGMENT_HEADER_LEN] {
    let mut b = [0u8; SEGMENT_HEADER_LEN];
    b[..8].copy_from_slice(SEGMENT_MAGIC);
    b[8..12].copy_from_slice(&version.to_le_bytes());
    b[12..16].copy_from_slice(&first.to_le_bytes());
    b[16..24].copy_from_slice(&id.to_le_bytes());
    b[24..32].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// A sequence number in a segment header's 32 bits: never 0 (0 means not recorded). Two
/// sequence numbers share a code only 2^32 - 1 apart: no gap replay meets is that long.
pub fn seq_code(seq: u64) -> u32 {
    (seq % 0xffff_ffff) as u32 + 1
}

/// A decoded segment header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentHeader {
    pub id: u64,
    pub nonce: u64,
    /// 1 or 2: which check its records carry.
    pub version: u32,
    /// [`seq_code`] of the sequence number its first record has; 0 if not recorded.
    pub first: u32,
}

/// Decodes a segment header.
pub fn decode_segment_header(buf: &[u8]) -> Result<SegmentHeader, Error> {
    const W: &str = "journal segment header";
    let mut r = Reader::new(buf, W);
    if r.take(8)? != SEGMENT_MAGIC {
        return Err(Error::BadMagic { what: W });
    }
    let version = r.u32()?;
    if version != 1 && version != 2 {
        return Err(Error::UnsupportedVersion { what: W, version });
    }
    let first = r.u32()?;
    Ok(SegmentHeader {
        first,
        id: r.u64()?,
        nonce: r.u64()?,
        version,
    })
}

fn check(version: u32, nonce: u64, head: &[u8], payload: &[u8]) -> [u8; 8] {
    if version == 1 {
        let mut h = blake3::Hasher::new();
        h.update(&nonce.to_le_bytes());
        h.update(head);
        h.update(payload);
        let mut c = [0u8; 8];
        c.copy_from_slice(&h.finalize().as_bytes()[..8]);
        return c;
    }
    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
    d.update(&nonce.to_le_bytes());
    d.update(head);
    d.update(payload);
    d.finalize().to_le_bytes()
}

/// Encodes a whole record (header and payload) for a segment of the current version, into one
/// buffer, ready for a single write.
pub fn encode(nonce: u64, kind: Kind, seq: u64, lba: u64, nblocks: u32, payload: &[u8]) -> Vec<u8> {
    encode_version(SEGMENT_VERSION, nonce, kind, seq, lba, nblocks, payload)
}

/// [`encode`] for a segment of `version` (an earlier one only to test that it is still read).
pub fn encode_version(
    version: u32,
    nonce: u64,
    kind: Kind,
    seq: u64,
    lba: u64,
    nblocks: u32,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    encode_version_into(&mut out, version, nonce, kind, seq, lba, nblocks, payload);
    out
}

/// [`encode_version`] appended to `out`: records written back to back in one buffer.
#[allow(clippy::too_many_arguments)]
pub fn encode_version_into(
    out: &mut Vec<u8>,
    version: u32,
    nonce: u64,
    kind: Kind,
    seq: u64,
    lba: u64,
    nblocks: u32,
    payload: &[u8],
) {
    debug_assert_eq!(
        payload.len() as u64,
        if kind == Kind::Write {
            nblocks as u64 * BLOCK_SIZE
        } else {
            0
        }
    );
    let start = out.len();
    out.reserve(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC.to_le_bytes());
    out.push(kind as u8);
    out.extend_from_slice(&[0; 3]);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&lba.to_le_bytes());
    out.extend_from_slice(&nblocks.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    let c = check(version, nonce, &out[start..start + 32], payload);
    out.extend_from_slice(&c);
    out.extend_from_slice(payload);
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
/// in the segment incarnation `seg` (its nonce, and its version's check).
pub fn verify(seg: &SegmentHeader, head: &[u8], h: &RecordHeader, payload: &[u8]) -> bool {
    head.len() >= HEADER_LEN && check(seg.version, seg.nonce, &head[..32], payload) == h.check
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(version: u32, nonce: u64) -> SegmentHeader {
        SegmentHeader {
            id: 1,
            nonce,
            version,
            first: 0,
        }
    }

    #[test]
    fn round_trip_and_torn_detection() {
        for v in [1, 2] {
            let payload = vec![9u8; 4096 * 2];
            let rec = encode_version(v, 42, Kind::Write, 7, 100, 2, &payload);
            let h = decode_header(&rec).unwrap();
            assert_eq!((h.seq, h.lba, h.nblocks, h.kind), (7, 100, 2, Kind::Write));
            assert!(verify(&seg(v, 42), &rec, &h, &rec[HEADER_LEN..]));
            assert!(
                !verify(&seg(v, 43), &rec, &h, &rec[HEADER_LEN..]),
                "a stale incarnation's record must not verify"
            );
            assert!(
                !verify(&seg(3 - v, 42), &rec, &h, &rec[HEADER_LEN..]),
                "nor one read with the other version's check"
            );
            let mut torn = rec.clone();
            torn[HEADER_LEN + 5000] = 0;
            assert!(!verify(&seg(v, 42), &torn, &h, &torn[HEADER_LEN..]));
            let z = encode_version(v, 1, Kind::Zero, 8, 0, 5, &[]);
            let hz = decode_header(&z).unwrap();
            assert!(verify(&seg(v, 1), &z, &hz, &[]));
            assert_eq!(hz.total_len(), 40);
            let sh = encode_segment_header_version(v, 9, 77);
            assert_eq!(
                decode_segment_header(&sh),
                Ok(SegmentHeader {
                    id: 9,
                    nonce: 77,
                    version: v,
                    first: 0,
                })
            );
            assert!(decode_segment_header(&sh[..20]).is_err());
            let sh = encode_segment_header_first(v, 9, 77, seq_code(12));
            assert_eq!(decode_segment_header(&sh).unwrap().first, seq_code(12));
        }
        for s in [0, 1, 0xffff_fffe, 0xffff_ffff, 0x1_0000_0000, u64::MAX] {
            assert_ne!(seq_code(s), 0, "{s}");
        }
        assert_ne!(seq_code(7), seq_code(8));
        assert_eq!(encode_segment_header(9, 77)[8..12], 2u32.to_le_bytes());
        assert!(decode_segment_header(&encode_segment_header_version(3, 9, 77)).is_err());
    }

    /// Records of a later incarnation never take a stale one for theirs, whatever the two
    /// nonces: with a CRC the difference of the checks is the CRC of the nonces' difference
    /// followed by zeros, which is never 0 (checked here over many pairs and lengths).
    #[test]
    fn a_stale_record_never_verifies_under_another_nonce() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..2000u64 {
            let (a, b) = (next(), next());
            let payload = vec![(i % 251) as u8; 4096 * (1 + (i % 3) as usize)];
            let n = payload.len() as u32 / 4096;
            let rec = encode(a, Kind::Write, i, i, n, &payload);
            let h = decode_header(&rec).unwrap();
            assert!(verify(&seg(2, a), &rec, &h, &rec[HEADER_LEN..]));
            assert_eq!(
                verify(&seg(2, b), &rec, &h, &rec[HEADER_LEN..]),
                a == b,
                "nonces {a:#x} {b:#x}"
            );
        }
    }

    /// The version 2 check is CRC-64/NVME (its standard check value), and a record's check
    /// is pinned: a change of algorithm or of what it covers fails here, not in a replay.
    #[test]
    fn golden_checks() {
        let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
        d.update(b"123456789");
        assert_eq!(d.finalize(), 0xae8b_1486_0a79_9888);
        let r = encode(0x0102_0304_0506_0708, Kind::Write, 1, 2, 1, &[0xab; 4096]);
        let mut want = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc64Nvme);
        want.update(&0x0102_0304_0506_0708u64.to_le_bytes());
        want.update(&r[..32]);
        want.update(&[0xab; 4096]);
        assert_eq!(r[32..40], want.finalize().to_le_bytes());
        // Version 1, still read: the first 8 bytes of BLAKE3 over the same.
        let r = encode_version(1, 9, Kind::Write, 1, 2, 1, &[0xab; 4096]);
        let mut want = blake3::Hasher::new();
        want.update(&9u64.to_le_bytes());
        want.update(&r[..32]);
        want.update(&[0xab; 4096]);
        assert_eq!(r[32..40], want.finalize().as_bytes()[..8]);
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

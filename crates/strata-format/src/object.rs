//! Immutable objects: data split into fixed-size frames, followed by a trailer of frame hashes.
//!
//! ```text
//! [ data: data_len bytes, frames of FRAME_SIZE (the last may be short) ]
//! [ frame hashes: n_frames x 32 bytes (BLAKE3 of each frame)            ]
//! [ footer, 32 bytes: "STRATAOB" | version u32 | frame_size u32 |
//!                     data_len u64 | n_frames u32 | salt u32            ]
//! ```
//!
//! The object id is the BLAKE3 hash of the trailer (frame hashes + footer). The trailer is
//! self-verifying against the id, and every frame against the trailer, so any byte range can be
//! fetched and verified without reading the whole object. Identical data gives an identical id
//! (content addressing), and the footer binds the data length into the id.
//!
//! Version 2 (an encrypted tenant's objects): the frame hashes and the id are BLAKE3 *keyed*
//! with a key derived from the tenant's data key. An id in a bucket listing then says nothing
//! of the content to anyone without the key: no confirming a guess of a file's bytes by hashing
//! it under each of the 2^32 salts, no telling that two objects hold the same bytes. Version 1
//! (unkeyed) objects stay readable.

use crate::{Error, Hash, Reader};

pub const FRAME_SIZE: u32 = 64 * 1024;
pub const FOOTER_LEN: u64 = 32;
pub const OBJECT_VERSION: u32 = 1;
/// Frame hashes and id keyed (see the module docs).
pub const KEYED_OBJECT_VERSION: u32 = 2;
const MAGIC: &[u8; 8] = b"STRATAOB";
/// Objects larger than this are refused by decoders (bounded memory for frame tables).
pub const MAX_DATA_LEN: u64 = 1 << 36;

/// Number of frames for an object holding `data_len` bytes.
pub fn n_frames(data_len: u64) -> u64 {
    data_len.div_ceil(FRAME_SIZE as u64)
}

/// Byte length of the trailer for `data_len` bytes of data.
pub fn trailer_len(data_len: u64) -> u64 {
    n_frames(data_len) * 32 + FOOTER_LEN
}

/// Encodes `data` as an object with salt 0; returns its id and the full object bytes.
pub fn encode(data: &[u8]) -> (Hash, Vec<u8>) {
    encode_salted(data, 0)
}

/// Encodes `data` with `salt` in the footer: the same data under another salt is another
/// object id. Writers salt new objects so that a key, once garbage-collected, is never written
/// again (GC can never race a re-upload of the same key). Decoders ignore the salt.
pub fn encode_salted(data: &[u8], salt: u32) -> (Hash, Vec<u8>) {
    let mut owned = Vec::with_capacity(data.len() + trailer_len(data.len() as u64) as usize);
    owned.extend_from_slice(data);
    seal_salted(owned, salt)
}

/// [`encode_salted`] on data the caller hands over: the trailer is appended to `data` itself,
/// so the object costs no copy of its data (give `data` capacity for [`trailer_len`] more).
pub fn seal_salted(data: Vec<u8>, salt: u32) -> (Hash, Vec<u8>) {
    let mut s = Sealer::new(data);
    while !s.hash_frames(usize::MAX) {}
    s.finish(salt)
}

/// [`seal_salted`] a few frames at a time, so a caller on an async runtime can let other work
/// run between them (hashing 8 MiB takes milliseconds).
pub struct Sealer {
    data: Vec<u8>,
    /// Bytes of `data` before the object (padding that puts the object at an aligned address).
    lead: usize,
    data_len: usize,
    next: usize,
    key: Option<[u8; 32]>,
}

/// BLAKE3 of `data`, keyed with `key` if given.
fn hash_with(key: Option<&[u8; 32]>, data: &[u8]) -> [u8; 32] {
    match key {
        Some(k) => *blake3::keyed_hash(k, data).as_bytes(),
        None => *blake3::hash(data).as_bytes(),
    }
}

impl Sealer {
    pub fn new(data: Vec<u8>) -> Sealer {
        Sealer::new_keyed(data, None)
    }

    /// A version 2 object (frame hashes and id keyed with `key`), or version 1 without one.
    pub fn new_keyed(data: Vec<u8>, key: Option<[u8; 32]>) -> Sealer {
        Sealer::new_keyed_at(data, 0, key)
    }

    /// [`Sealer::new_keyed`] for an object that starts `lead` bytes into `data` (the bytes
    /// before it are not part of it, and stay in the returned buffer).
    pub fn new_keyed_at(mut data: Vec<u8>, lead: usize, key: Option<[u8; 32]>) -> Sealer {
        assert!(lead <= data.len(), "the lead is inside the buffer");
        let data_len = data.len() - lead;
        data.reserve(trailer_len(data_len as u64) as usize);
        Sealer {
            data,
            lead,
            data_len,
            next: 0,
            key,
        }
    }

    /// Hashes up to `max` more frames; true once every frame is hashed.
    pub fn hash_frames(&mut self, max: usize) -> bool {
        let total = n_frames(self.data_len as u64) as usize;
        let end = total.min(self.next.saturating_add(max));
        while self.next < end {
            let at = self.next * FRAME_SIZE as usize;
            let stop = (at + FRAME_SIZE as usize).min(self.data_len);
            let h = hash_with(
                self.key.as_ref(),
                &self.data[self.lead + at..self.lead + stop],
            );
            self.data.extend_from_slice(&h);
            self.next += 1;
        }
        self.next == total
    }

    /// The object: id and bytes (after the lead, if any). Hashes whatever frames are left
    /// first.
    pub fn finish(mut self, salt: u32) -> (Hash, Vec<u8>) {
        while !self.hash_frames(usize::MAX) {}
        let data_len = self.data_len as u64;
        let data = &mut self.data;
        data.extend_from_slice(MAGIC);
        let version = if self.key.is_some() {
            KEYED_OBJECT_VERSION
        } else {
            OBJECT_VERSION
        };
        data.extend_from_slice(&version.to_le_bytes());
        data.extend_from_slice(&FRAME_SIZE.to_le_bytes());
        data.extend_from_slice(&data_len.to_le_bytes());
        data.extend_from_slice(&(n_frames(data_len) as u32).to_le_bytes());
        data.extend_from_slice(&salt.to_le_bytes());
        let id = Hash(hash_with(
            self.key.as_ref(),
            &data[self.lead + self.data_len..],
        ));
        (id, self.data)
    }
}

/// The verified frame hashes of one object.
#[derive(Clone, Debug)]
pub struct FrameTable {
    pub data_len: u64,
    hashes: Vec<[u8; 32]>,
    /// Version 2: the key the frame hashes are keyed with.
    key: Option<[u8; 32]>,
}

impl FrameTable {
    /// Decodes and verifies a trailer fetched for object `id` expected to hold `data_len` bytes
    /// (a version 1 object: [`FrameTable::decode_keyed`] reads both versions).
    pub fn decode(id: &Hash, data_len: u64, trailer: &[u8]) -> Result<FrameTable, Error> {
        FrameTable::decode_keyed(id, data_len, trailer, None)
    }

    /// Decodes and verifies a trailer fetched for object `id` expected to hold `data_len`
    /// bytes: a version 1 trailer against its BLAKE3, a version 2 trailer against its BLAKE3
    /// keyed with `key` (refused without one). An encrypted tenant's reader passes its key and
    /// reads both its new objects and those written before ids were keyed.
    pub fn decode_keyed(
        id: &Hash,
        data_len: u64,
        trailer: &[u8],
        key: Option<&[u8; 32]>,
    ) -> Result<FrameTable, Error> {
        const WHAT: &str = "object trailer";
        if data_len > MAX_DATA_LEN {
            return Err(Error::invalid(WHAT, "object too large"));
        }
        if trailer.len() as u64 != trailer_len(data_len) {
            return Err(Error::Truncated {
                what: WHAT,
                need: trailer_len(data_len),
                have: trailer.len() as u64,
            });
        }
        let n = n_frames(data_len) as usize;
        // The version decides how the id is checked; it is checked with it (a changed version
        // changes the trailer's hash).
        let at = n * 32 + 8;
        let version = u32::from_le_bytes(
            trailer
                .get(at..at + 4)
                .and_then(|b| b.try_into().ok())
                .ok_or(Error::Truncated {
                    what: WHAT,
                    need: at as u64 + 4,
                    have: trailer.len() as u64,
                })?,
        );
        let table_key = match (version, key) {
            (OBJECT_VERSION, _) => None,
            (KEYED_OBJECT_VERSION, Some(k)) => Some(*k),
            (KEYED_OBJECT_VERSION, None) => return Err(Error::Checksum { what: WHAT }),
            (version, _) => {
                return Err(Error::UnsupportedVersion {
                    what: WHAT,
                    version,
                })
            }
        };
        if hash_with(table_key.as_ref(), trailer) != id.0 {
            return Err(Error::Checksum { what: WHAT });
        }
        let mut r = Reader::new(trailer, WHAT);
        let mut hashes = Vec::with_capacity(n);
        for _ in 0..n {
            hashes.push(r.array::<32>()?);
        }
        if r.take(8)? != MAGIC {
            return Err(Error::BadMagic { what: WHAT });
        }
        let _version = r.u32()?;
        let (fs, dl, nf) = (r.u32()?, r.u64()?, r.u32()?);
        if fs != FRAME_SIZE || dl != data_len || nf as usize != n {
            return Err(Error::invalid(WHAT, "footer disagrees with manifest"));
        }
        Ok(FrameTable {
            data_len,
            hashes,
            key: table_key,
        })
    }

    pub fn n_frames(&self) -> usize {
        self.hashes.len()
    }

    /// Verifies `data`, which must be exactly frames `first..first+k` of the object.
    pub fn verify(&self, first: usize, data: &[u8]) -> Result<(), Error> {
        const WHAT: &str = "object frame";
        let start = first as u64 * FRAME_SIZE as u64;
        let end = start + data.len() as u64;
        if start >= self.data_len && !data.is_empty() || end > self.data_len {
            return Err(Error::invalid(WHAT, "range outside object"));
        }
        for (i, frame) in (first..).zip(data.chunks(FRAME_SIZE as usize)) {
            let full = (self.data_len - i as u64 * FRAME_SIZE as u64).min(FRAME_SIZE as u64);
            if frame.len() as u64 != full {
                return Err(Error::invalid(
                    WHAT,
                    "range does not end on a frame boundary",
                ));
            }
            if hash_with(self.key.as_ref(), frame) != self.hashes[i] {
                return Err(Error::Checksum { what: WHAT });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object sealed after a lead of padding is the same object, byte for byte, with the
    /// same id, keyed or not: the lead only moves where it starts in the buffer.
    #[test]
    fn an_object_sealed_after_a_lead_is_the_same_object() {
        for key in [None, Some([7u8; 32])] {
            for len in [0usize, 1, 4096, FRAME_SIZE as usize + 3] {
                let data: Vec<u8> = (0..len).map(|i| (i % 241) as u8).collect();
                let mut s = Sealer::new_keyed(data.clone(), key);
                while !s.hash_frames(1) {}
                let (id, plain) = s.finish(9);
                let mut led = vec![0xAAu8; 100];
                led.extend_from_slice(&data);
                let (id2, out) = Sealer::new_keyed_at(led, 100, key).finish(9);
                assert_eq!(id, id2, "length {len}");
                assert_eq!(&out[..100], &[0xAAu8; 100][..]);
                assert_eq!(&out[100..], &plain[..], "length {len}");
            }
        }
    }

    #[test]
    fn sealing_in_place_is_the_same_object_as_encoding() {
        // The expected bytes are built here from the format's definition, not by the encoder.
        for len in [0usize, 1, 4096, 65535, 65536, 65537, 3 * 65536 + 17] {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            let mut want = data.clone();
            let frames: Vec<&[u8]> = data.chunks(65536).collect();
            for f in &frames {
                want.extend_from_slice(blake3::hash(f).as_bytes());
            }
            want.extend_from_slice(b"STRATAOB");
            want.extend_from_slice(&1u32.to_le_bytes());
            want.extend_from_slice(&65536u32.to_le_bytes());
            want.extend_from_slice(&(len as u64).to_le_bytes());
            want.extend_from_slice(&(frames.len() as u32).to_le_bytes());
            want.extend_from_slice(&9u32.to_le_bytes());
            let id = Hash::of(&want[len..]);
            let mut owned = data.clone();
            owned.shrink_to_fit(); // No spare room: sealing must grow it.
            assert_eq!(seal_salted(owned, 9), (id, want.clone()), "{len} bytes");
            assert_eq!(encode_salted(&data, 9), (id, want.clone()), "{len} bytes");
            // Hashed one frame at a time, and two frames then the rest in `finish`.
            let mut one = Sealer::new(data.clone());
            while !one.hash_frames(1) {}
            assert_eq!(one.finish(9), (id, want.clone()), "{len} bytes, by frame");
            let mut two = Sealer::new(data.clone());
            two.hash_frames(2);
            assert_eq!(two.finish(9), (id, want), "{len} bytes, finished early");
        }
    }

    fn trailer(obj: &[u8], data_len: u64) -> &[u8] {
        &obj[data_len as usize..]
    }

    #[test]
    fn encode_verify_round_trip() {
        let data: Vec<u8> = (0..(FRAME_SIZE as usize * 2 + 100))
            .map(|i| i as u8)
            .collect();
        let (id, obj) = encode(&data);
        let ft =
            FrameTable::decode(&id, data.len() as u64, trailer(&obj, data.len() as u64)).unwrap();
        assert_eq!(ft.n_frames(), 3);
        ft.verify(0, &data).unwrap();
        ft.verify(1, &data[FRAME_SIZE as usize..]).unwrap();
        ft.verify(2, &data[2 * FRAME_SIZE as usize..]).unwrap();
        let mut bad = data.clone();
        bad[FRAME_SIZE as usize + 5] ^= 1;
        assert_eq!(
            ft.verify(1, &bad[FRAME_SIZE as usize..]),
            Err(Error::Checksum {
                what: "object frame"
            })
        );
        assert!(ft
            .verify(1, &data[FRAME_SIZE as usize..FRAME_SIZE as usize + 10])
            .is_err());
    }

    /// Version 2, built here from the format's definition: frame hashes and id keyed. Its id
    /// says nothing without the key (the same bytes under the same salt, unkeyed or under
    /// another key, are other ids); the keyed reader verifies it and version 1 objects alike,
    /// and refuses a version 2 trailer without the key or under another.
    #[test]
    fn keyed_objects_hide_their_content_and_verify_with_the_key() {
        let key = [7u8; 32];
        let data: Vec<u8> = (0..(FRAME_SIZE as usize + 100))
            .map(|i| (i * 3) as u8)
            .collect();
        let mut want = data.clone();
        for f in data.chunks(FRAME_SIZE as usize) {
            want.extend_from_slice(blake3::keyed_hash(&key, f).as_bytes());
        }
        want.extend_from_slice(b"STRATAOB");
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&65536u32.to_le_bytes());
        want.extend_from_slice(&(data.len() as u64).to_le_bytes());
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice(&5u32.to_le_bytes());
        let want_id = Hash(*blake3::keyed_hash(&key, &want[data.len()..]).as_bytes());
        let mut s = Sealer::new_keyed(data.clone(), Some(key));
        while !s.hash_frames(1) {}
        let (id, obj) = s.finish(5);
        assert_eq!((id, &obj), (want_id, &want));
        let (plain, _) = encode_salted(&data, 5);
        let mut other = Sealer::new_keyed(data.clone(), Some([8u8; 32]));
        while !other.hash_frames(1) {}
        assert!(id != plain && id != other.finish(5).0);
        let len = data.len() as u64;
        let t = FrameTable::decode_keyed(&id, len, &obj[data.len()..], Some(&key)).unwrap();
        t.verify(0, &data[..FRAME_SIZE as usize]).unwrap();
        t.verify(1, &data[FRAME_SIZE as usize..]).unwrap();
        let mut bad = data.clone();
        bad[3] ^= 1;
        assert!(t.verify(0, &bad[..FRAME_SIZE as usize]).is_err());
        let tr = &obj[data.len()..];
        assert!(FrameTable::decode(&id, len, tr).is_err(), "no key");
        assert!(FrameTable::decode_keyed(&id, len, tr, Some(&[8u8; 32])).is_err());
        // Version 1 objects (written before keys) still read with a key at hand.
        let (v1, o1) = encode(&data);
        let t1 = FrameTable::decode_keyed(&v1, len, &o1[data.len()..], Some(&key)).unwrap();
        t1.verify(1, &data[FRAME_SIZE as usize..]).unwrap();
    }

    #[test]
    fn same_content_same_id_and_length_is_bound() {
        let (a, _) = encode(b"hello");
        let (b, _) = encode(b"hello");
        assert_eq!(a, b);
        let (c, _) = encode(b"hello\0");
        assert_ne!(a, c);
        let (_, obj) = encode(b"hello");
        assert!(FrameTable::decode(&a, 6, &obj[5..]).is_err());
    }

    #[test]
    fn corrupt_trailer_is_refused() {
        let (id, mut obj) = encode(&[7u8; 1000]);
        let n = obj.len();
        obj[n - 10] ^= 0xff;
        assert!(matches!(
            FrameTable::decode(&id, 1000, &obj[1000..]),
            Err(Error::Checksum { .. })
        ));
        assert!(FrameTable::decode(&id, 1000, &obj[1001..]).is_err());
    }

    #[test]
    fn golden_empty_and_small() {
        // Freezes the v1 layout: changing it must change OBJECT_VERSION.
        let (id, obj) = encode(b"strata");
        assert_eq!(obj.len(), 6 + 32 + 32);
        assert_eq!(&obj[38..46], b"STRATAOB");
        assert_eq!(
            id.to_hex(),
            "9ae761c889b28a28fc9df9ce5c560b1101a51f1a36ecac1cdfa60a3f65460dd8"
        );
        assert_eq!(&obj[6..38], blake3::hash(b"strata").as_bytes());
    }
}

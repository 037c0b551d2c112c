#![no_main]
//! Object trailers (frame tables) and frame verification, both versions: unkeyed (1) and keyed
//! (2, an encrypted tenant's).
use libfuzzer_sys::fuzz_target;
use strata_format::object::FrameTable;
use strata_format::Hash;

const KEY: [u8; 32] = [0x5a; 32];

fuzz_target!(|data: &[u8]| {
    if data.len() < 40 {
        return;
    }
    let (head, rest) = data.split_at(8);
    let data_len = u64::from_le_bytes(head.try_into().unwrap_or([0; 8])) % (1 << 24);
    // Use the real id of the trailer (unkeyed or keyed) most of the time, so decoding gets past
    // the hash check.
    let id = match data[0] % 3 {
        0 => Hash::of(rest),
        1 => Hash(*blake3::keyed_hash(&KEY, rest).as_bytes()),
        _ => Hash::of(b"other"),
    };
    let key = (data[1] & 1 == 0).then_some(&KEY);
    if let Ok(t) = FrameTable::decode_keyed(&id, data_len, rest, key) {
        let _ = t.verify(0, &rest[..rest.len().min(data_len as usize)]);
    }
});

#![no_main]
//! Object trailers (frame tables) and frame verification.
use libfuzzer_sys::fuzz_target;
use strata_format::object::FrameTable;
use strata_format::Hash;

fuzz_target!(|data: &[u8]| {
    if data.len() < 40 {
        return;
    }
    let (head, rest) = data.split_at(8);
    let data_len = u64::from_le_bytes(head.try_into().unwrap_or([0; 8])) % (1 << 24);
    // Use the real id of the trailer half the time, so decoding gets past the hash check.
    let id = if data[0] & 1 == 0 { Hash::of(rest) } else { Hash::of(b"other") };
    if let Ok(t) = FrameTable::decode(&id, data_len, rest) {
        let _ = t.verify(0, &rest[..rest.len().min(data_len as usize)]);
    }
});

#![no_main]
//! Journal record headers and checks.
use libfuzzer_sys::fuzz_target;
use strata_format::journal::{
    decode_header, decode_segment_header, verify, SegmentHeader, HEADER_LEN,
};

fuzz_target!(|data: &[u8]| {
    let _ = decode_segment_header(data);
    if let Ok(h) = decode_header(data) {
        let payload = data.get(HEADER_LEN..HEADER_LEN + h.payload_len as usize).unwrap_or(&[]);
        for version in [1, 2] {
            let seg = SegmentHeader { id: 1, nonce: 7, version, first: 0 };
            let _ = verify(&seg, data, &h, payload);
        }
    }
});

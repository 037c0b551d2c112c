#![no_main]
//! NBD transmission request headers.
use libfuzzer_sys::fuzz_target;
use strata_nbd::proto::{encode_request, parse_request, REQUEST_LEN};

fuzz_target!(|data: &[u8]| {
    if data.len() < REQUEST_LEN {
        return;
    }
    let mut b = [0u8; REQUEST_LEN];
    b.copy_from_slice(&data[..REQUEST_LEN]);
    if let Ok(r) = parse_request(&b) {
        assert_eq!(encode_request(&r), b);
    }
});

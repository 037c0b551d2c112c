#![no_main]
//! NBD negotiation payloads: NBD_OPT_INFO/GO and LIST/SET_META_CONTEXT.
use libfuzzer_sys::fuzz_target;
use strata_nbd::proto::{parse_go, parse_meta};

fuzz_target!(|data: &[u8]| {
    let _ = parse_go(data);
    let _ = parse_meta(data);
});

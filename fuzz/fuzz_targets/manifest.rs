#![no_main]
//! Manifests: decode must never panic, and what decodes re-encodes identically.
use libfuzzer_sys::fuzz_target;
use strata_format::manifest::Manifest;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Manifest::decode(data) {
        assert_eq!(m.encode(), data);
        let mut out = Vec::new();
        m.resolve(0, m.disk_blocks().min(1 << 16), &mut out);
    }
});

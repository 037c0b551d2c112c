//! Hostile names (workspace, tenant, stream and relay file names, labels): validation never
//! panics, and whatever it accepts can never name a path outside its directory.
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_format::name;

fuzz_target!(|data: &[u8]| {
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    let safe = |n: &str| {
        !n.is_empty()
            && !n.contains('/')
            && !n.contains('\\')
            && !n.contains('\0')
            && !n.starts_with('.')
            && n != ".."
    };
    if name::validate("name", s).is_ok() {
        assert!(safe(s) && s.len() <= name::MAX_NAME_LEN, "{s:?}");
    }
    if name::validate_file_name(s).is_ok() {
        assert!(safe(s) && s.len() <= name::MAX_FILE_NAME_LEN, "{s:?}");
    }
    if name::validate_label(s).is_ok() {
        assert!(!s.chars().any(char::is_control), "{s:?}");
    }
});

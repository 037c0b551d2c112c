//! The HTTP API's request bodies as hostile JSON: every request type either refuses the input
//! or yields values whose names and labels go through the same validation the handlers apply,
//! and nothing panics (sizes, retention seconds and versions at their extremes included).
#![no_main]

use libfuzzer_sys::fuzz_target;
use strata_api::{
    BuildTemplate, CheckpointRequest, CreateStream, CreateTenant, CreateWorkspace, ForkRequest,
    GcRequest, RollbackRequest,
};
use strata_format::name;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<CreateWorkspace>(data) {
        let _ = name::validate("workspace name", &r.name);
    }
    if let Ok(r) = serde_json::from_slice::<ForkRequest>(data) {
        let _ = name::validate("workspace name", &r.name);
    }
    if let Ok(r) = serde_json::from_slice::<CheckpointRequest>(data) {
        if let Some(l) = &r.label {
            let _ = name::validate_label(l);
        }
        if let Some(s) = r.keep_secs {
            let _ = s.checked_mul(1000);
        }
    }
    if let Ok(r) = serde_json::from_slice::<CreateStream>(data) {
        let _ = name::validate("stream name", &r.name);
    }
    if let Ok(r) = serde_json::from_slice::<CreateTenant>(data) {
        let _ = name::validate("tenant name", &r.name);
    }
    if let Ok(r) = serde_json::from_slice::<BuildTemplate>(data) {
        let _ = name::validate("template name", &r.name);
    }
    let _ = serde_json::from_slice::<RollbackRequest>(data);
    let _ = serde_json::from_slice::<GcRequest>(data);
});

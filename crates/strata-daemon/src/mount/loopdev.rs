//! The loop devices under FUSE-backed mounts: which file backs one, and detaching it.

use std::path::{Path, PathBuf};

use super::run;

/// The loop device's backing file as the kernel reports it.
pub(crate) fn loop_backing(dev: &str) -> Option<PathBuf> {
    let name = Path::new(dev).file_name()?.to_str()?;
    let s = std::fs::read_to_string(format!("/sys/block/{name}/loop/backing_file")).ok()?;
    Some(PathBuf::from(
        s.trim_end_matches('\n').trim_end_matches(" (deleted)"),
    ))
}

pub(crate) async fn loop_detach(dev: &str, file: &Path) {
    loop_detach_within(dev, file, 250).await
}

/// Detaches, then waits up to `polls` × 20 ms for the kernel to release the file. A device
/// still held (a dead mount at a target pins it until that target is unmounted) is left to
/// autoclear.
pub(crate) async fn loop_detach_within(dev: &str, file: &Path, polls: u32) {
    // Only a device still backed by our file: after a crash the number may be someone else's.
    if loop_backing(dev).as_deref() != Some(file) {
        return;
    }
    if let Err(e) = run("losetup", &["-d", dev]).await {
        tracing::warn!(device = dev, error = %e.message, "detaching loop device failed");
    }
    // The kernel releases the file asynchronously; wait for it (bounded).
    for _ in 0..polls {
        if loop_backing(dev).as_deref() != Some(file) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    tracing::info!(
        device = dev,
        "loop device still held after detach: it clears when its last user goes"
    );
}

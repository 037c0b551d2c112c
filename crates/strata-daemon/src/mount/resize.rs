//! Growing a workspace's disk: `POST /v1/workspaces/{ws}/resize`, `strata ws resize`.
//!
//! ```text
//! resize ─▶ op lock ─▶ Volume::grow: a `resize` version, the catalog's size moving with the head
//!          mounted here ─▶ the device learns the size (FUSE: cached attributes dropped, then
//!          the loop device's LOOP_SET_CAPACITY; kernel NBD: RECONFIGURE with the size)
//!          ─▶ resize2fs, online (a read-only mount keeps its filesystem as it is; one the
//!          kernel will not grow, for want of CAP_SYS_RESOURCE, is reported pending)
//!          not attached here ─▶ attached for the call
//! mount ─▶ an ext4 smaller than its disk grows first, offline (e2fsck -fp, resize2fs)
//! ```
//!
//! A disk only grows: a mounted filesystem must never find its end gone. Every step is
//! idempotent, so a retry after a failure finishes what is left (the device and filesystem
//! catch up even when the volume had already grown).

use super::*;

/// `POST /v1/workspaces/{name}/resize`.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// The disk's new size in bytes (rounded up to 4 KiB); at least its current size.
    pub size: u64,
}

/// What a resize left.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub struct Resized {
    /// The disk's size now.
    pub disk_size: u64,
    /// Mounted here: the block device's size as the kernel sees it now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_size: Option<u64>,
    /// Mounted here and writable: the filesystem's size now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem_size: Option<u64>,
    /// Why the mounted filesystem did not grow with its disk (it grows at its next mount).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem_pending: Option<String>,
}

/// How a mounted disk learns its new size.
enum Refresh {
    Fuse(fuse::SizeRefresh),
    Nbd(u32, String),
}

/// Bytes an ext4 superblock (the 1 KiB at offset 1024 of the disk) says the filesystem spans.
pub(crate) fn ext4_bytes(sb: &[u8]) -> Option<u64> {
    let u32_at = |o: usize| Some(u32::from_le_bytes(sb.get(o..o + 4)?.try_into().ok()?) as u64);
    if sb.get(56..58)? != [0x53, 0xEF] {
        return None;
    }
    let log = u32_at(24)?;
    if log > 6 {
        return None;
    }
    const INCOMPAT_64BIT: u64 = 0x80;
    let hi = if u32_at(96)? & INCOMPAT_64BIT != 0 {
        u32_at(0x150)?
    } else {
        0
    };
    ((hi << 32) | u32_at(4)?).checked_mul(1024 << log)
}

/// The size of a block device, as the kernel sees it now (its end, by seeking there).
pub(crate) fn device_size(dev: &str) -> std::io::Result<u64> {
    use std::io::Seek;
    std::fs::File::open(dev)?.seek(std::io::SeekFrom::End(0))
}

impl Daemon {
    /// Grows the workspace's disk to `size` bytes; mounted here, its device and filesystem too.
    pub(crate) async fn resize_workspace(
        self: &Arc<Self>,
        t: &str,
        ws: &str,
        size: u64,
    ) -> Result<Resized, ApiError> {
        let (d, t, ws) = (self.clone(), t.to_string(), ws.to_string());
        own_task(async move {
            // Counted and under the op lock: the mount can neither go nor be stopped under it.
            let _running = d.mount_op();
            let k = (t.clone(), ws.clone());
            let lock = d.op_lock(&k);
            let _op = lock.lock().await;
            let mounted = d.lock_mounts().get(&k).map(|m| {
                let refresh = match (&m.fuse, &m.kernel) {
                    (Some(f), _) => Some(Refresh::Fuse(f.size_refresh())),
                    (None, Some(k)) => Some(Refresh::Nbd(k.index, d.nbd_backend_name(&t, &ws))),
                    (None, None) => None,
                };
                (m.vol.clone(), m.info.clone(), refresh)
            });
            let Some((vol, info, Some(refresh))) = mounted else {
                let disk_size = d.engine.grow(&t, &ws, size).await?;
                return Ok(Resized {
                    disk_size,
                    device_size: None,
                    filesystem_size: None,
                    filesystem_pending: None,
                });
            };
            if d.stopping() {
                return Err(stopping_error());
            }
            vol.grow(size).await?;
            let disk_size = vol.size();
            let dev = info
                .device
                .clone()
                .ok_or_else(|| ApiError::internal("a mount without a device"))?;
            match refresh {
                Refresh::Fuse(r) => {
                    let seen = blocking(move || r.refresh()).await?.map_err(|e| {
                        ApiError::internal(format!("re-reading the disk size: {e}"))
                    })?;
                    if seen != disk_size {
                        return Err(ApiError::internal(format!(
                            "the kernel sees a {seen}-byte disk file, the volume has {disk_size}"
                        )));
                    }
                    run("losetup", &["--set-capacity", &dev]).await?;
                }
                Refresh::Nbd(index, backend) => kernel::resize(index, backend, disk_size)
                    .await
                    .map_err(|e| ApiError::internal(format!("nbd reconfigure: {e}")))?,
            }
            let d2 = dev.clone();
            let device_size = blocking(move || device_size(&d2))
                .await?
                .map_err(|e| ApiError::internal(format!("reading the size of {dev}: {e}")))?;
            if device_size != disk_size {
                return Err(ApiError::internal(format!(
                    "{dev} has {device_size} bytes after the resize, the volume {disk_size}"
                )));
            }
            let (mut filesystem_size, mut filesystem_pending) = (None, None);
            if !info.read_only {
                match grow_filesystem(&dev).await {
                    Ok(n) => filesystem_size = Some(n),
                    Err(e) => {
                        tracing::warn!(workspace = %info.workspace, error = %e.message, "the mounted filesystem did not grow");
                        filesystem_size = sizes(&dev).await?.0;
                        filesystem_pending = Some(e.message);
                    }
                }
            }
            Ok(Resized {
                disk_size,
                device_size: Some(device_size),
                filesystem_size,
                filesystem_pending,
            })
        })
        .await
    }
}

/// (bytes the ext4 on `dev` spans, the device's size), read through the device: its cache
/// is the mounted filesystem's, so this is what the kernel has just changed, not yet written.
async fn sizes(dev: &str) -> Result<(Option<u64>, u64), ApiError> {
    let d = dev.to_string();
    blocking(move || {
        use std::os::unix::fs::FileExt;
        let mut sb = vec![0u8; 1024];
        std::fs::File::open(&d)?.read_exact_at(&mut sb, 1024)?;
        Ok::<_, std::io::Error>((ext4_bytes(&sb), device_size(&d)?))
    })
    .await?
    .map_err(|e| ApiError::internal(format!("reading the superblock on {dev}: {e}")))
}

/// Grows the ext4 mounted from `dev` onto the whole device, online, unless it already fills
/// it; returns its size afterwards. The kernel allows online growth only to a process with
/// CAP_SYS_RESOURCE: without it the disk has grown and the filesystem grows at its next mount.
pub(crate) async fn grow_filesystem(dev: &str) -> Result<u64, ApiError> {
    let (Some(before), size) = sizes(dev).await? else {
        return Err(ApiError::internal(format!("no ext4 superblock on {dev}")));
    };
    if before >= size {
        return Ok(before);
    }
    if let Err(e) = run("resize2fs", &[dev]).await {
        if e.message.contains("Permission denied") {
            return Err(ApiError::internal(format!(
                "growing a mounted ext4 needs CAP_SYS_RESOURCE, which this daemon lacks ({})",
                e.message
            )));
        }
        return Err(e);
    }
    match sizes(dev).await? {
        (Some(after), _) => Ok(after),
        _ => Err(ApiError::internal(format!("no ext4 superblock on {dev}"))),
    }
}

/// Before a mount: grows an ext4 left smaller than its device (a disk grown while it was not
/// mounted) offline, after `e2fsck -fp` (which resize2fs requires, and which replays a
/// journal the mount would have). A filesystem e2fsck cannot preen is mounted as it is.
pub(crate) async fn grow_unmounted(dev: &str) -> Result<(), ApiError> {
    let (Some(before), size) = sizes(dev).await? else {
        return Ok(());
    };
    if before >= size {
        return Ok(());
    }
    let fsck = tokio::process::Command::new("e2fsck")
        .args(["-f", "-p", dev])
        .kill_on_drop(true)
        .output()
        .await
        .map_err(|e| ApiError::internal(format!("e2fsck: {e} (is it installed?)")))?;
    // 0: clean; 1: errors corrected. Anything else: leave the filesystem to the kernel.
    if !matches!(fsck.status.code(), Some(0 | 1)) {
        return Err(ApiError::internal(format!(
            "e2fsck -fp {dev} before growing: {}",
            String::from_utf8_lossy(&fsck.stdout).trim()
        )));
    }
    run("resize2fs", &[dev]).await?;
    tracing::info!(
        device = dev,
        from = before,
        to = size,
        "grew the filesystem onto its disk"
    );
    Ok(())
}

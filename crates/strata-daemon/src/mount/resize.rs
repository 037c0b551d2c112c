//! Growing a workspace's disk: `POST /v1/workspaces/{ws}/resize`, `strata ws resize`.
//!
//! ```text
//! resize ─▶ op lock ─▶ Volume::grow: a `resize` version, the catalog's size moving with the head
//!          mounted here ─▶ the device learns the size (FUSE: cached attributes dropped, then
//!          the loop device's LOOP_SET_CAPACITY; kernel NBD: RECONFIGURE with the size)
//!          ─▶ resize2fs, online (a read-only mount keeps its filesystem as it is; one the
//!          kernel will not grow, for want of CAP_SYS_RESOURCE, is reported pending)
//!          not attached here ─▶ attached for the call
//! mount ─▶ an ext4 smaller than its disk grows: online once mounted, or (where the kernel
//!          refuses online growth) offline before (e2fsck -fp, resize2fs)
//! ```
//!
//! A disk only grows: a mounted filesystem must never find its end gone. A retry after a
//! failure finishes what is left (the device and filesystem catch up even when the volume had
//! already grown). An offline e2fsck or resize2fs that fails, is killed past its timeout, or
//! dies with the daemon refuses that mount; a marker in the mount's directory makes the next
//! mount (a restart's remount too) check and finish it before the kernel sees it.
//!
//! The host's e2fsck and resize2fs read a filesystem a tenant wrote: each is killed after
//! [`TOOL_TIMEOUT`] and never runs during a restart's remounts. The full `e2fsck -f` runs only
//! where online growth is not allowed (a daemon without CAP_SYS_RESOURCE); online, resize2fs
//! reads the superblock and group descriptors and the kernel does the rest.

use super::*;

/// `POST /v1/workspaces/{name}/resize`.
#[derive(Debug, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    /// The disk's new size in bytes (rounded up to 4 KiB); at least its current size.
    pub size: u64,
}

/// What a resize left.
#[derive(Debug, Serialize, Deserialize, PartialEq, utoipa::ToSchema)]
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
            let k = (t.clone(), ws.clone());
            let (_running, _op) = d.mount_op_on(&k).await;
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
            // The kernel may keep a stale file size when a write completes during the
            // attribute fetch: tried again until the device has the volume's size.
            let (mut dev_size, mut disk_size) = (0, disk_size);
            for attempt in 0..20 {
                // A publish adopting an earlier grow may have grown it further meanwhile.
                disk_size = vol.size();
                if attempt > 0 {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                match &refresh {
                    Refresh::Fuse(r) => {
                        let r = r.clone();
                        blocking(move || r.refresh()).await?.map_err(|e| {
                            ApiError::internal(format!("re-reading the disk size: {e}"))
                        })?;
                        run("losetup", &["--set-capacity", &dev]).await?;
                    }
                    Refresh::Nbd(index, backend) => {
                        kernel::resize(*index, backend.clone(), disk_size)
                            .await
                            .map_err(|e| ApiError::internal(format!("nbd reconfigure: {e}")))?
                    }
                }
                let d2 = dev.clone();
                dev_size = blocking(move || device_size(&d2)).await?.map_err(|e| {
                    ApiError::internal(format!("reading the size of {dev}: {e}"))
                })?;
                if dev_size == disk_size {
                    break;
                }
            }
            if dev_size != disk_size {
                return Err(ApiError::internal(format!(
                    "{dev} has {dev_size} bytes after the resize, the volume {disk_size}"
                )));
            }
            let device_size = dev_size;
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

/// How long e2fsck or resize2fs may take on a tenant's filesystem before it is killed (a
/// crafted filesystem must not hold the workspace's lock, or a stop, for ever).
const TOOL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Whether this process may grow a mounted ext4 (the kernel asks for CAP_SYS_RESOURCE).
pub(crate) fn can_grow_online() -> bool {
    static CAN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *CAN.get_or_init(|| {
        const CAP_SYS_RESOURCE: u32 = 24;
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                let hex = s
                    .lines()
                    .find_map(|l| l.strip_prefix("CapEff:"))?
                    .trim()
                    .to_string();
                u64::from_str_radix(&hex, 16).ok()
            })
            .is_some_and(|eff| eff & (1 << CAP_SYS_RESOURCE) != 0)
    })
}

/// A host tool run on a tenant's filesystem, killed past [`TOOL_TIMEOUT`]: its exit code and
/// output.
///
/// Confined (`strata_engine::confine`): no capabilities but CAP_SYS_RESOURCE for `resize2fs`
/// (the kernel asks for it to grow a mounted ext4), a mount namespace of its own, limits.
async fn tool(cmd: &str, args: &[&str]) -> Result<(Option<i32>, String), ApiError> {
    use strata_engine::confine;
    let keep = confine::Keep {
        sys_resource: cmd == "resize2fs",
        ..Default::default()
    };
    let limits = confine::Limits {
        wall: TOOL_TIMEOUT,
        ..Default::default()
    };
    let out = confine::run_async(tokio::process::Command::new(cmd).args(args), keep, limits)
        .await
        .map_err(|e| ApiError::internal(format!("{cmd} {}: {e}", args.join(" "))))?;
    let text = format!(
        "{} {}",
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok((out.status.code(), text))
}

/// The file that says an offline grow of this mount's filesystem began and has not ended.
pub(crate) fn grow_marker(home: &Path) -> PathBuf {
    home.join("growing")
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
    if !can_grow_online() {
        // Expected on such a host, and reported as pending: not logged as a failure.
        return Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "growing a mounted ext4 needs CAP_SYS_RESOURCE, which this daemon lacks",
        ));
    }
    match tool("resize2fs", &[dev]).await? {
        (Some(0), _) => {}
        (_, out) => return Err(ApiError::internal(format!("resize2fs {dev}: {out}"))),
    }
    match sizes(dev).await? {
        (Some(after), _) => Ok(after),
        _ => Err(ApiError::internal(format!("no ext4 superblock on {dev}"))),
    }
}

/// Before a mount, where online growth is not allowed: grows an ext4 left smaller than its
/// device (a disk grown while it was not mounted) offline, after `e2fsck -fp` (which resize2fs
/// requires, and which replays a journal the mount would have). An error (e2fsck cannot preen
/// it, or a tool failed or was killed part way) refuses the mount: the filesystem may be half
/// repaired or half grown.
pub(crate) async fn grow_unmounted(dev: &str, home: &Path) -> Result<(), ApiError> {
    let marker = grow_marker(home);
    let interrupted = marker.exists();
    let (Some(before), size) = sizes(dev).await? else {
        return Ok(());
    };
    if before >= size && !interrupted {
        return Ok(());
    }
    // Recorded before the tools touch the filesystem, removed once they are done: a daemon
    // killed in between finds it at its next mount of the workspace, restart or not.
    std::fs::write(&marker, b"")
        .and_then(|_| std::fs::File::open(home)?.sync_all())
        .map_err(|e| ApiError::internal(format!("recording an offline grow: {e}")))?;
    let refuse = |what: String| {
        ApiError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("not mounting: growing its filesystem onto the grown disk failed: {what}"),
        )
    };
    // 0: clean; 1: errors corrected.
    match tool("e2fsck", &["-f", "-p", dev])
        .await
        .map_err(|e| refuse(e.message))?
    {
        (Some(0 | 1), _) => {}
        (_, out) => return Err(refuse(format!("e2fsck -fp: {out}"))),
    }
    if before < size {
        match tool("resize2fs", &[dev])
            .await
            .map_err(|e| refuse(e.message))?
        {
            (Some(0), _) => {}
            (_, out) => return Err(refuse(format!("resize2fs: {out}"))),
        }
    }
    let _ = std::fs::remove_file(&marker);
    tracing::info!(
        device = dev,
        from = before,
        to = size,
        "grew the filesystem onto its disk"
    );
    Ok(())
}

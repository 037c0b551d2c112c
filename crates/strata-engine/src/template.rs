//! Template builds: a directory (through `mkfs.ext4 -d`, no root needed) or a raw/qcow2 image
//! becomes a manifest of content-addressed chunk objects. Each 4 MiB chunk's non-zero blocks are
//! packed into one object, so identical chunks in two templates are one object; zero blocks
//! store nothing.

use std::io::Read;
use std::path::Path;
use std::process::Command;

use futures::stream::{FuturesUnordered, StreamExt};
use strata_format::manifest::{Change, Manifest, ObjectRef};
use strata_format::BLOCK_SIZE;
use strata_store::ObjectReader;

use crate::{Error, Result};

pub const CHUNK_BYTES: u64 = 4 << 20;
const IN_FLIGHT: usize = 4;

type Run = (u64, u64, u64);

/// Progress callback: (bytes processed, total bytes).
pub type Progress<'a> = &'a (dyn Fn(u64, u64) + Send + Sync);

/// Builds the manifest for a raw image file. Returns it and the bytes stored.
pub async fn import_raw(
    reader: &ObjectReader,
    tenant: &str,
    path: &Path,
    progress: Progress<'_>,
) -> Result<(Manifest, u64)> {
    use tokio::io::AsyncReadExt;
    // Async reads: a long scan of a (sparse) image never holds a runtime worker.
    let mut f = tokio::fs::File::open(path)
        .await
        .map_err(Error::io(format!("opening {}", path.display())))?;
    let len = f.metadata().await.map_err(Error::io("stat image"))?.len();
    if len == 0 {
        return Err(Error::Invalid(format!("{} is empty", path.display())));
    }
    let size = len.div_ceil(BLOCK_SIZE) * BLOCK_SIZE;
    let mut changes: Vec<Change> = Vec::new();
    // Per uploaded chunk: its runs as (lba, blocks, offset in the chunk's object).
    let mut pending: Vec<(u64, Vec<Run>)> = Vec::new();
    let mut uploads = FuturesUnordered::new();
    let mut done: std::collections::HashMap<u64, ObjectRef> = Default::default();
    let mut stored = 0u64;
    let mut buf = vec![0u8; CHUNK_BYTES as usize];
    let mut pos = 0u64;
    let mut chunk_no = 0u64;
    // One salt per build: identical chunks within the build share an object; a later build
    // never reuses a key that garbage collection may be deleting.
    let salt: u32 = rand::random();
    while pos < len {
        let want = (len - pos).min(CHUNK_BYTES) as usize;
        let b = &mut buf[..want];
        f.read_exact(b)
            .await
            .map_err(Error::io(format!("reading {}", path.display())))?;
        let padded = want.div_ceil(BLOCK_SIZE as usize) * BLOCK_SIZE as usize;
        let mut data = Vec::new();
        let mut runs: Vec<Run> = Vec::new();
        for (i, block) in buf[..padded].chunks(BLOCK_SIZE as usize).enumerate() {
            let block_len = block
                .len()
                .min(want.saturating_sub(i * BLOCK_SIZE as usize));
            if block[..block_len].iter().all(|&x| x == 0) {
                continue;
            }
            let lba = pos / BLOCK_SIZE + i as u64;
            let off = data.len() as u64;
            data.extend_from_slice(&block[..block_len]);
            data.resize(off as usize + BLOCK_SIZE as usize, 0);
            match runs.last_mut() {
                Some((l, n, o)) if *l + *n == lba && *o + *n * BLOCK_SIZE == off => *n += 1,
                _ => runs.push((lba, 1, off)),
            }
        }
        if !data.is_empty() {
            if uploads.len() >= IN_FLIGHT {
                if let Some((c, n, r)) = uploads.next().await {
                    done.insert(c, r?);
                    stored += n;
                }
            }
            let c = chunk_no;
            uploads.push(async move {
                let n = data.len() as u64;
                (c, n, reader.put_object_salted(tenant, data, salt).await)
            });
            pending.push((c, runs));
        }
        pos += want as u64;
        chunk_no += 1;
        progress(pos, len);
    }
    while let Some((c, n, r)) = uploads.next().await {
        done.insert(c, r?);
        stored += n;
    }
    for (c, runs) in pending {
        let o = done[&c];
        for (lba, n, off) in runs {
            changes.push(Change {
                lba,
                len: n,
                at: Some((o, off)),
            });
        }
    }
    let m = Manifest::empty(size)?.apply(&changes)?;
    Ok((m, stored))
}

/// Runs a helper tool, turning failure into an error that names it and shows its stderr.
/// Runs a host tool on what a tenant sent, confined (`confine.rs`) with `keep` of root's
/// capabilities; its stdout, or its stderr as the error.
fn run_keeping(cmd: &mut Command, what: &str, keep: crate::confine::Keep) -> Result<String> {
    let program = cmd.get_program().to_owned();
    let out = crate::confine::run(cmd, keep, crate::confine::Limits::default()).map_err(|e| {
        Error::Tool(format!(
            "{what}: could not run {program:?}: {e} (is it installed?)"
        ))
    })?;
    if !out.status.success() {
        return Err(Error::Tool(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// [`run_keeping`] with no capabilities at all.
fn run(cmd: &mut Command, what: &str) -> Result<String> {
    run_keeping(cmd, what, crate::confine::Keep::default())
}

/// Bytes of regular files and entries under `dir` (for deriving an image size).
fn tree_size(dir: &Path) -> std::io::Result<(u64, u64)> {
    let mut bytes = 0;
    let mut entries = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let m = e.metadata()?;
            entries += 1;
            if m.is_dir() {
                stack.push(e.path());
            } else {
                bytes += m.len();
            }
        }
    }
    Ok((bytes, entries))
}

/// Size for an ext4 image holding `dir`: data + per-file overhead + journal, with headroom.
pub fn derive_size(dir: &Path) -> Result<u64> {
    let (bytes, entries) =
        tree_size(dir).map_err(Error::io(format!("walking {}", dir.display())))?;
    let raw = bytes + bytes / 4 + entries * 8192 + (64 << 20);
    Ok(raw.div_ceil(CHUNK_BYTES) * CHUNK_BYTES)
}

/// Makes an ext4 image of `dir` at `out` with `mkfs.ext4 -d` (no root needed).
pub fn mkfs_from_dir(dir: &Path, out: &Path, size: u64) -> Result<()> {
    if !dir.is_dir() {
        return Err(Error::Invalid(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let f = std::fs::File::create(out).map_err(Error::io(format!("creating {}", out.display())))?;
    f.set_len(size).map_err(Error::io("sizing image"))?;
    drop(f);
    // It reads the tree whatever modes its files were given (a tenant's archive may say 000).
    run_keeping(
        Command::new("mkfs.ext4")
            .args([
                "-q",
                "-F",
                "-b",
                "4096",
                "-E",
                "lazy_itable_init=0,lazy_journal_init=0",
                "-d",
            ])
            .arg(dir)
            .arg(out),
        "mkfs.ext4",
        crate::confine::Keep {
            read_any: true,
            ..Default::default()
        },
    )?;
    Ok(())
}

/// The format of an image to import. Always explicit: an image is never probed by a tool that
/// might then open files it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImageFormat {
    Raw,
    Qcow2,
}

impl std::str::FromStr for ImageFormat {
    type Err = Error;
    fn from_str(s: &str) -> Result<ImageFormat> {
        match s {
            "raw" => Ok(ImageFormat::Raw),
            "qcow2" => Ok(ImageFormat::Qcow2),
            _ => Err(Error::Invalid(format!(
                "image format {s:?} is not raw or qcow2"
            ))),
        }
    }
}

const QCOW2_MAGIC: &[u8; 4] = b"QFI\xfb";

/// The format of a local image file, from its first bytes (qcow2's magic, else raw).
pub fn detect_format(image: &Path) -> Result<ImageFormat> {
    let mut magic = [0u8; 4];
    let mut f =
        std::fs::File::open(image).map_err(Error::io(format!("opening {}", image.display())))?;
    let n = f.read(&mut magic).map_err(Error::io("reading image"))?;
    Ok(if n == 4 && &magic == QCOW2_MAGIC {
        ImageFormat::Qcow2
    } else {
        ImageFormat::Raw
    })
}

/// Reads a qcow2 header as hostile input before any tool opens the image: no backing file,
/// no external data file (incompatible feature bit 2), a version qemu knows. A tool that
/// opened such an image could read a file its author named (or hang on a FIFO).
pub fn check_qcow2_header(image: &Path) -> Result<()> {
    let mut h = [0u8; 104];
    let mut f =
        std::fs::File::open(image).map_err(Error::io(format!("opening {}", image.display())))?;
    let n = f.read(&mut h).map_err(Error::io("reading image"))?;
    let bad = |why: &str| Error::Invalid(format!("qcow2 image: {why}"));
    if n < 72 || &h[..4] != QCOW2_MAGIC {
        return Err(bad("not a qcow2 image"));
    }
    let be64 = |at: usize| u64::from_be_bytes(h[at..at + 8].try_into().unwrap_or([0; 8]));
    let version = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
    if !(2..=3).contains(&version) {
        return Err(bad(&format!("version {version} is not 2 or 3")));
    }
    if be64(8) != 0 {
        return Err(bad(
            "it names a backing file; flatten it first (qemu-img convert -O qcow2)",
        ));
    }
    if version == 3 {
        if n < 104 {
            return Err(bad("truncated header"));
        }
        if be64(72) & (1 << 2) != 0 {
            return Err(bad("it names an external data file; it is not imported"));
        }
    }
    Ok(())
}

/// Converts a qcow2 `image` to raw at `out`, opened as qcow2 and nothing else: an image that
/// names a backing file or an external data file is refused, so an import never reads a file
/// the image's author chose.
///
/// A qcow2 of compressed clusters expands: 651 KiB of upload once held 256 MiB of `out`. So
/// before converting, a bound on the bytes the raw file will hold (its allocated clusters,
/// from `qemu-img check`: metadata only) is checked against `limits.max_bytes` and handed to
/// `admit` (the node's free-space floor), which may refuse them.
pub fn qcow2_to_raw(
    image: &Path,
    out: &Path,
    limits: &ImportLimits,
    admit: &dyn Fn(u64) -> Result<()>,
) -> Result<()> {
    let max_disk = limits.max_disk;
    check_qcow2_header(image)?;
    let info = run(
        Command::new("qemu-img")
            .args(["info", "-f", "qcow2", "--output=json"])
            .arg(image),
        "qemu-img info",
    )?;
    let v: serde_json::Value = serde_json::from_str(&info)
        .map_err(|e| Error::Tool(format!("qemu-img info output: {e}")))?;
    if v.get("backing-filename").is_some() || v.get("full-backing-filename").is_some() {
        return Err(Error::Invalid(
            "the qcow2 image names a backing file; flatten it first (qemu-img convert -O qcow2)"
                .into(),
        ));
    }
    let virtual_size = v
        .get("virtual-size")
        .and_then(|n| n.as_u64())
        .unwrap_or(u64::MAX);
    if virtual_size > max_disk {
        return Err(Error::Invalid(format!(
            "the image's disk is {virtual_size} bytes, more than the {max_disk} allowed"
        )));
    }
    if v.pointer("/format-specific/data/data-file").is_some() {
        return Err(Error::Invalid(
            "the qcow2 image names an external data file; it is not imported".into(),
        ));
    }
    let cluster = v
        .get("cluster-size")
        .and_then(|n| n.as_u64())
        .filter(|c| c.is_power_of_two() && *c >= 512)
        .ok_or_else(|| Error::Tool("qemu-img info: no cluster size".into()))?;
    let data = qcow2_data_bytes(image, cluster)?;
    if data > limits.max_bytes {
        return Err(Error::Invalid(format!(
            "the image holds {data} bytes of data, more than the {} allowed",
            limits.max_bytes
        )));
    }
    admit(data)?;
    run(
        Command::new("qemu-img")
            .args(["convert", "-f", "qcow2", "-O", "raw"])
            .arg(image)
            .arg(out),
        "qemu-img convert",
    )?;
    Ok(())
}

/// A bound on the bytes of data a qcow2 image holds (its allocated clusters, compressed ones
/// included, times its cluster size), from `qemu-img check` (metadata only, a bounded answer
/// whatever the image): what its conversion to a sparse raw file writes at most. An image the
/// check finds corrupt is refused (leaked clusters are only wasted space, and pass).
fn qcow2_data_bytes(image: &Path, cluster_size: u64) -> Result<u64> {
    let out = crate::confine::run(
        Command::new("qemu-img")
            .args(["check", "-f", "qcow2", "--output=json"])
            .arg(image),
        crate::confine::Keep::default(),
        crate::confine::Limits::default(),
    )
    .map_err(|e| Error::Tool(format!("qemu-img check: {e} (is it installed?)")))?;
    // 0: clean; 3: leaked clusters only. 2 (corruptions) and anything else: refused.
    if !matches!(out.status.code(), Some(0) | Some(3)) {
        return Err(Error::Invalid(format!(
            "the qcow2 image does not pass qemu-img check ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| Error::Tool(format!("qemu-img check output: {e}")))?;
    if v.get("check-errors").and_then(|n| n.as_u64()) != Some(0) {
        return Err(Error::Invalid("the qcow2 image is corrupt".into()));
    }
    let clusters = v
        .get("allocated-clusters")
        .and_then(|n| n.as_u64())
        .unwrap_or(0);
    Ok(clusters.saturating_mul(cluster_size))
}

/// Limits of one import from content a tenant sent.
#[derive(Clone, Copy, Debug)]
pub struct ImportLimits {
    /// Sum of an archive's entry sizes; the data a qcow2 image expands to.
    pub max_bytes: u64,
    pub max_entries: u64,
    /// Largest disk a template may describe (an image's virtual size, an ext4 image's size).
    pub max_disk: u64,
}

impl ImportLimits {
    /// No limit beyond the formats' own: for the operator's own files.
    pub fn operator() -> ImportLimits {
        ImportLimits {
            max_bytes: u64::MAX,
            max_entries: u64::MAX,
            max_disk: strata_format::manifest::MAX_DISK_SIZE,
        }
    }
}

/// Removes a tree that may hold directories without owner permissions (an archive can ask for
/// mode 000): their permissions are opened first, so a daemon that is not root can still
/// clean up. Errors are ignored: this is cleanup.
pub fn remove_tree(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let _ = std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700));
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Unpacks a tar archive (a directory tree sent by a tenant) into `dst`, as hostile input:
/// only regular files, directories, symlinks and hard links; every path and hard-link target
/// relative and inside `dst` (also through symlinks unpacked before); no device nodes, fifos or
/// sparse entries; ownership not restored; sizes and entry count bounded. Symlinks are kept as
/// links (mkfs.ext4 -d copies them, it does not follow them).
pub fn unpack_archive(archive: &Path, dst: &Path, limits: ImportLimits) -> Result<()> {
    use std::path::Component;
    let bad = |why: String| Error::Invalid(format!("archive: {why}"));
    let relative = |p: &Path| {
        p.components()
            .all(|c| matches!(c, Component::Normal(_) | Component::CurDir))
    };
    let f = std::fs::File::open(archive).map_err(Error::io("opening archive"))?;
    let mut ar = tar::Archive::new(f);
    ar.set_preserve_ownerships(false);
    ar.set_preserve_permissions(true);
    ar.set_unpack_xattrs(false);
    ar.set_overwrite(true);
    let (mut bytes, mut entries) = (0u64, 0u64);
    for e in ar.entries().map_err(Error::io("reading archive"))? {
        let mut e = e.map_err(|e| bad(e.to_string()))?;
        entries += 1;
        if entries > limits.max_entries {
            return Err(bad(format!("more than {} entries", limits.max_entries)));
        }
        let path = e.path().map_err(|e| bad(e.to_string()))?.into_owned();
        if !relative(&path) {
            return Err(bad(format!("{} is not a relative path", path.display())));
        }
        use tar::EntryType as T;
        match e.header().entry_type() {
            T::Regular | T::Continuous | T::Directory | T::Symlink => {}
            T::Link => {
                let target = e
                    .link_name()
                    .map_err(|e| bad(e.to_string()))?
                    .ok_or_else(|| bad("hard link without a target".into()))?;
                if !relative(&target) {
                    return Err(bad(format!(
                        "hard link {} points outside the archive",
                        path.display()
                    )));
                }
            }
            t => {
                return Err(bad(format!(
                    "{} is a {t:?} entry (only files, directories and links)",
                    path.display()
                )))
            }
        }
        bytes = bytes.saturating_add(e.size());
        if bytes > limits.max_bytes {
            return Err(bad(format!("more than {} bytes", limits.max_bytes)));
        }
        // unpack_in also refuses paths that would land outside `dst` through a symlink.
        if !e.unpack_in(dst).map_err(|e| bad(e.to_string()))? {
            return Err(bad(format!("{} escapes the archive", path.display())));
        }
    }
    Ok(())
}

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
    let mut f =
        std::fs::File::open(path).map_err(Error::io(format!("opening {}", path.display())))?;
    let len = f.metadata().map_err(Error::io("stat image"))?.len();
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
                (c, n, reader.put_object_salted(tenant, &data, salt).await)
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
fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd.output().map_err(|e| {
        Error::Tool(format!(
            "{what}: could not run {:?}: {e} (is it installed?)",
            cmd.get_program()
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
    run(
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
    )?;
    Ok(())
}

/// Converts `image` to raw at `out` if it is not raw already; returns the path to import.
pub fn to_raw(image: &Path, out: &Path) -> Result<bool> {
    let info = run(
        Command::new("qemu-img")
            .args(["info", "--output=json"])
            .arg(image),
        "qemu-img info",
    )?;
    let v: serde_json::Value = serde_json::from_str(&info)
        .map_err(|e| Error::Tool(format!("qemu-img info output: {e}")))?;
    let format = v.get("format").and_then(|f| f.as_str()).unwrap_or("raw");
    if format == "raw" {
        return Ok(false);
    }
    run(
        Command::new("qemu-img")
            .args(["convert", "-O", "raw"])
            .arg(image)
            .arg(out),
        "qemu-img convert",
    )?;
    Ok(true)
}

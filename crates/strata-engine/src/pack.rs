//! Packing: turning a frozen overlay into immutable objects and manifest changes.
//!
//! Live journal runs are read in block order, all-zero blocks become holes (they store nothing),
//! and the rest is packed into objects of about `target` bytes, uploaded with bounded
//! concurrency. The result is the sorted, non-overlapping change list a manifest applies.

use std::collections::HashMap;
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use strata_format::manifest::{Change, ObjectRef};
use strata_format::BLOCK_SIZE;
use strata_store::{ObjectBuf, ObjectReader};

use crate::fs::FsFile;
use crate::overlay::{Loc, Overlay, Run};
use crate::{Error, Result};

const MAX_IN_FLIGHT: usize = 4;
const READ_CHUNK_BLOCKS: u64 = 256;

/// One piece of a read batch: (lba, blocks, journal file and offset; None for a zero run).
type Piece = (u64, u64, Option<(Arc<dyn FsFile>, u64)>);

pub(crate) struct Packed {
    pub changes: Vec<Change>,
    pub bytes_uploaded: u64,
}

enum Planned {
    Zero {
        lba: u64,
        len: u64,
    },
    Data {
        lba: u64,
        len: u64,
        obj: usize,
        off: u64,
    },
}

pub(crate) async fn pack(
    reader: &ObjectReader,
    tenant: &str,
    frozen: &Overlay,
    files: &HashMap<u64, Arc<dyn FsFile>>,
    target: u64,
    progress: &std::sync::atomic::AtomicU64,
) -> Result<Packed> {
    let mut planned: Vec<Planned> = Vec::new();
    let mut uploads = FuturesUnordered::new();
    let mut done: HashMap<usize, ObjectRef> = HashMap::new();
    // Room for the data and the trailer sealed onto it in place.
    let capacity = (target + strata_format::object::trailer_len(target) + BLOCK_SIZE) as usize;
    // At an address a local store writes from without a copy (see `ObjectBuf`).
    let mut buf = ObjectBuf::with_capacity(capacity);
    let mut n_objects = 0usize;
    let mut bytes_uploaded = 0u64;
    let mut chunk = vec![0u8; (READ_CHUNK_BLOCKS * BLOCK_SIZE) as usize];

    // One fresh salt per publish: every object it creates is a key that never existed.
    let salt: u32 = rand::random();
    let upload = move |idx: usize, data: ObjectBuf| async move {
        let n = data.len() as u64;
        (idx, n, reader.put_object_buf(tenant, data, salt).await)
    };

    // Journal reads happen on a blocking thread (never stall the runtime serving I/O), batched:
    // up to READ_CHUNK_BLOCKS blocks from any number of runs per task, since a random writer's
    // layer is mostly one-block runs. Runs are handled in block order, zeros included.
    let mut all = frozen.iter();
    let mut carry: Option<(u64, Run)> = None;
    loop {
        let mut batch: Vec<Piece> = Vec::new();
        let mut blocks = 0u64;
        while let Some((lba, run)) = carry.take().or_else(|| all.next()) {
            let (seg, off) = match run.loc {
                Loc::Zero => {
                    batch.push((lba, run.len, None));
                    continue;
                }
                Loc::Journal { seg, off } => (seg, off),
            };
            if blocks >= READ_CHUNK_BLOCKS {
                carry = Some((lba, run));
                break;
            }
            let file = files.get(&seg).ok_or_else(|| {
                Error::Invalid(format!("journal segment {seg} missing while packing"))
            })?;
            let n = run.len.min(READ_CHUNK_BLOCKS - blocks);
            batch.push((lba, n, Some((file.clone(), off))));
            blocks += n;
            if n < run.len {
                // The rest of a long run starts the next batch.
                let rest = Run {
                    len: run.len - n,
                    loc: run.loc.advance(n),
                    ..run
                };
                carry = Some((lba + n, rest));
                break;
            }
        }
        if batch.is_empty() {
            break;
        }
        let mut rbuf = std::mem::take(&mut chunk);
        let (batch, rbuf, res) = tokio::task::spawn_blocking(move || {
            let mut at = 0usize;
            for (_, n, src) in &batch {
                if let Some((f, off)) = src {
                    let len = (*n * BLOCK_SIZE) as usize;
                    if let Err(e) = f.read_at(&mut rbuf[at..at + len], *off) {
                        return (batch, rbuf, Err(e));
                    }
                    at += len;
                }
            }
            (batch, rbuf, Ok(()))
        })
        .await
        .map_err(|e| Error::Invalid(format!("journal read task failed: {e}")))?;
        chunk = rbuf;
        res.map_err(Error::io("reading the journal"))?;
        let mut at = 0usize;
        for (lba, n, src) in batch {
            if src.is_none() {
                planned.push(Planned::Zero { lba, len: n });
                continue;
            }
            let data = &chunk[at..at + (n * BLOCK_SIZE) as usize];
            at += data.len();
            for (i, block) in data.chunks(BLOCK_SIZE as usize).enumerate() {
                let blba = lba + i as u64;
                let zero = block.iter().all(|&x| x == 0);
                if zero {
                    match planned.last_mut() {
                        Some(Planned::Zero { lba: l, len }) if *l + *len == blba => *len += 1,
                        _ => planned.push(Planned::Zero { lba: blba, len: 1 }),
                    }
                    continue;
                }
                let o = buf.len() as u64;
                buf.extend_from_slice(block);
                match planned.last_mut() {
                    Some(Planned::Data {
                        lba: l,
                        len,
                        obj,
                        off,
                    }) if *l + *len == blba
                        && *obj == n_objects
                        && *off + *len * BLOCK_SIZE == o =>
                    {
                        *len += 1
                    }
                    _ => planned.push(Planned::Data {
                        lba: blba,
                        len: 1,
                        obj: n_objects,
                        off: o,
                    }),
                }
                if buf.len() as u64 >= target {
                    if uploads.len() >= MAX_IN_FLIGHT {
                        collect(
                            uploads.next().await,
                            &mut done,
                            &mut bytes_uploaded,
                            progress,
                        )?;
                    }
                    let full = std::mem::replace(&mut buf, ObjectBuf::with_capacity(capacity));
                    uploads.push(upload(n_objects, full));
                    n_objects += 1;
                }
            }
        }
    }
    if !buf.is_empty() {
        let last = std::mem::replace(&mut buf, ObjectBuf::from(Vec::new()));
        uploads.push(upload(n_objects, last));
    }
    while let Some(r) = uploads.next().await {
        collect(Some(r), &mut done, &mut bytes_uploaded, progress)?;
    }
    let mut changes = Vec::with_capacity(planned.len());
    for p in planned {
        changes.push(match p {
            Planned::Zero { lba, len } => Change { lba, len, at: None },
            Planned::Data { lba, len, obj, off } => Change {
                lba,
                len,
                at: Some((done[&obj], off)),
            },
        });
    }
    Ok(Packed {
        changes,
        bytes_uploaded,
    })
}

type UploadResult = (usize, u64, strata_store::Result<ObjectRef>);

fn collect(
    r: Option<UploadResult>,
    done: &mut HashMap<usize, ObjectRef>,
    bytes: &mut u64,
    progress: &std::sync::atomic::AtomicU64,
) -> Result<()> {
    if let Some((idx, n, r)) = r {
        done.insert(idx, r?);
        *bytes += n;
        progress.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
    Ok(())
}

//! virtio-blk requests (VIRTIO 1.2, 5.2): one descriptor chain parsed into a [`Request`]
//! (hostile input: every address, length and sector is checked), then run against a
//! [`BlockDevice`].
//!
//! ```text
//! chain: header (16 B, device-readable) ─ data (readable for OUT, DISCARD, WRITE_ZEROES;
//!        writable for IN, GET_ID) ─ status (1 B, the last device-writable byte)
//! ```
//! Guest memory is only reached through `vm-memory`'s checked slices (`Reader`/`Writer` of
//! `virtio-queue`): a descriptor outside the memory the frontend shared ends the request as
//! malformed, never as a host access. A request's data is bounded ([`MAX_REQUEST_BYTES`]); the
//! bytes a batch holds at once are bounded by the caller (`Request::cost`).

use std::io::{Read, Write};

use strata_block::BlockDevice;
use virtio_bindings::bindings::virtio_blk::*;
use virtio_queue::{DescriptorChain, Reader, Writer};
use vm_memory::GuestMemoryMmap;

/// Sector of the virtio-blk protocol (the `sector` field and `capacity` count these).
pub const SECTOR: u64 = 512;
/// Largest data a request may carry: `size_max × seg_max` as advertised stays under it.
pub const MAX_REQUEST_BYTES: usize = 32 << 20;
/// `size_max`: largest segment (descriptor) a driver may use.
pub const SIZE_MAX: u32 = 128 << 10;
/// Largest DISCARD / WRITE_ZEROES range, in sectors (2 GiB), and segments per request.
pub const MAX_RANGE_SECTORS: u32 = 1 << 22;
pub const MAX_RANGE_SEGMENTS: u32 = 32;
/// The engine's block: advertised as the physical block (topology), so guests align to it,
/// while the logical block (`blk_size`) stays 512 bytes, as most guests and boot loaders expect.
pub const BLOCK_SIZE: u32 = 4096;
pub const LOGICAL_BLOCK: u32 = 512;
/// Length of the config space we serve (`struct virtio_blk_config` up to `write_zeroes_may_unmap`).
pub const CONFIG_LEN: usize = 60;
/// Offset of `writeback` in the config space (1 when FLUSH is offered; read-only: no CONFIG_WCE).
pub const CONFIG_WRITEBACK: usize = 32;

/// What a device offers beyond the size: fixed when a backend is made.
#[derive(Clone, Debug)]
pub struct Features {
    pub read_only: bool,
    /// FLUSH offered (a write-back cache the guest must flush); off for ephemeral workspaces.
    pub flush: bool,
    pub num_queues: u16,
    pub queue_size: u16,
    /// `GET_ID`'s answer (at most 20 bytes, NUL-padded).
    pub serial: String,
    /// Accept guest memory whose file is not sealed against shrinking. Off by default: a VMM
    /// that truncates its memory file after `SET_MEM_TABLE` makes this process's next access to
    /// the mapping a SIGBUS, which takes down every export the daemon serves, every tenant's.
    /// With the seal (`F_SEAL_SHRINK`, as QEMU's `memory-backend-memfd` sets by default) the
    /// truncation fails in the VMM instead. For a VMM the operator trusts and cannot seal.
    pub unsealed_memory: bool,
}

impl Features {
    /// A disk with the default queue size and `queues` queues (default
    /// [`crate::DEFAULT_QUEUES`]); FLUSH offered when `flush` (the workspace honours it).
    pub fn new(read_only: bool, flush: bool, queues: Option<u16>, serial: String) -> Features {
        Features {
            read_only,
            flush,
            num_queues: queues.unwrap_or(crate::DEFAULT_QUEUES),
            queue_size: crate::DEFAULT_QUEUE_SIZE,
            serial,
            unsealed_memory: false,
        }
    }

    /// The virtio feature bits (device-specific and ring).
    pub fn bits(&self) -> u64 {
        let mut f = (1u64 << VIRTIO_BLK_F_SIZE_MAX)
            | (1u64 << VIRTIO_BLK_F_SEG_MAX)
            | (1u64 << VIRTIO_BLK_F_BLK_SIZE)
            | (1u64 << VIRTIO_BLK_F_TOPOLOGY)
            | (1u64 << VIRTIO_BLK_F_MQ);
        if self.read_only {
            f |= 1u64 << VIRTIO_BLK_F_RO;
        } else {
            f |= (1u64 << VIRTIO_BLK_F_DISCARD) | (1u64 << VIRTIO_BLK_F_WRITE_ZEROES);
        }
        if self.flush {
            f |= 1u64 << VIRTIO_BLK_F_FLUSH;
        }
        f
    }

    pub(crate) fn seg_max(&self) -> u32 {
        let by_size = (MAX_REQUEST_BYTES as u32) / SIZE_MAX;
        (self.queue_size as u32).saturating_sub(2).clamp(1, by_size)
    }

    /// `struct virtio_blk_config` (little-endian) for a device of `size` bytes.
    pub fn config(&self, size: u64) -> [u8; CONFIG_LEN] {
        let mut c = [0u8; CONFIG_LEN];
        c[0..8].copy_from_slice(&(size / SECTOR).to_le_bytes());
        c[8..12].copy_from_slice(&SIZE_MAX.to_le_bytes());
        c[12..16].copy_from_slice(&self.seg_max().to_le_bytes());
        // geometry (16..20) unused; blk_size:
        c[20..24].copy_from_slice(&LOGICAL_BLOCK.to_le_bytes());
        // topology: physical_block_exp (4 KiB = 2^3 logical blocks), alignment 0, min_io_size
        // one physical block (in logical blocks), opt_io_size unset.
        c[24] = 3;
        c[26..28].copy_from_slice(&((BLOCK_SIZE / LOGICAL_BLOCK) as u16).to_le_bytes());
        c[CONFIG_WRITEBACK] = u8::from(self.flush);
        c[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        for at in [36, 48] {
            c[at..at + 4].copy_from_slice(&MAX_RANGE_SECTORS.to_le_bytes());
            c[at + 4..at + 8].copy_from_slice(&MAX_RANGE_SEGMENTS.to_le_bytes());
        }
        // discard_sector_alignment: one block, in sectors.
        c[44..48].copy_from_slice(&(BLOCK_SIZE / SECTOR as u32).to_le_bytes());
        c[56] = 1; // write_zeroes_may_unmap
        c
    }
}

/// A parsed request: what to do, with the guest buffers it answers into.
pub struct Request<'a> {
    op: Op,
    /// Device-writable data of a read (held only for IN).
    data_out: Option<Writer<'a>>,
    status: Writer<'a>,
    /// Bytes already written into device-writable data at parse time (GET_ID).
    written: u32,
}

enum Op {
    Read {
        offset: u64,
        len: usize,
    },
    Write {
        offset: u64,
        data: Vec<u8>,
    },
    Flush,
    /// DISCARD (`zeroes` false) or WRITE_ZEROES: (offset, bytes) ranges.
    Ranges {
        zeroes: bool,
        ranges: Vec<(u64, u32)>,
    },
    /// Answered without touching the device.
    Status(u8),
}

/// Why a chain cannot be answered at all (no status byte to write): it is returned used,
/// with nothing written.
#[derive(Debug)]
pub struct Malformed(pub &'static str);

/// The outcome of one request: bytes written into device-writable buffers (the used length).
pub type Used = u32;

/// Parses one available chain: bounded to `seg_max` + 2 descriptors before anything is held
/// per descriptor, every buffer checked against guest memory, then [`Request::parse`].
pub fn parse_chain<'a, M>(
    mem: &'a GuestMemoryMmap,
    chain: DescriptorChain<M>,
    size: u64,
    f: &Features,
) -> Result<Request<'a>, Malformed>
where
    M: std::ops::Deref + Clone,
    M::Target: vm_memory::GuestMemory + Sized,
{
    if chain.clone().count() > f.seg_max() as usize + 2 {
        return Err(Malformed("more descriptors than seg_max allows"));
    }
    let reader = Reader::new(mem, chain.clone())
        .map_err(|_| Malformed("descriptor outside guest memory"))?;
    let writer =
        Writer::new(mem, chain).map_err(|_| Malformed("descriptor outside guest memory"))?;
    Request::parse(reader, writer, size, f, &f.serial)
}

impl<'a> Request<'a> {
    /// Parses one chain's buffers. `size` is the device's size now.
    fn parse(
        mut reader: Reader<'a>,
        mut writer: Writer<'a>,
        size: u64,
        f: &Features,
        serial: &str,
    ) -> Result<Request<'a>, Malformed> {
        let writable = writer.available_bytes();
        if writable == 0 {
            return Err(Malformed("no device-writable status byte"));
        }
        let status = writer
            .split_at(writable - 1)
            .map_err(|_| Malformed("status byte"))?;
        // Data writable by the device: everything before the status byte.
        let data_len = writable - 1;
        let mut hdr = [0u8; 16];
        let mut written = 0;
        let op = match reader.read_exact(&mut hdr) {
            Err(_) => Op::Status(VIRTIO_BLK_S_IOERR as u8),
            Ok(()) => {
                let kind = u32::from_le_bytes(hdr[0..4].try_into().expect("4 bytes"));
                let sector = u64::from_le_bytes(hdr[8..16].try_into().expect("8 bytes"));
                if kind == VIRTIO_BLK_T_GET_ID {
                    // Answered now: nothing of the chain is held while the batch runs.
                    let mut id = [0u8; VIRTIO_BLK_ID_BYTES as usize];
                    let s = serial.as_bytes();
                    let n = s.len().min(id.len());
                    id[..n].copy_from_slice(&s[..n]);
                    let n = writer.available_bytes().min(id.len());
                    match writer.write_all(&id[..n]) {
                        Ok(()) => {
                            written = n as u32;
                            Op::Status(VIRTIO_BLK_S_OK as u8)
                        }
                        Err(_) => Op::Status(VIRTIO_BLK_S_IOERR as u8),
                    }
                } else {
                    Self::op(kind, sector, &mut reader, data_len, size, f)
                }
            }
        };
        let data_out = matches!(op, Op::Read { .. }).then_some(writer);
        Ok(Request {
            op,
            data_out,
            status,
            written,
        })
    }

    fn op(
        kind: u32,
        sector: u64,
        r: &mut Reader<'_>,
        data_len: usize,
        size: u64,
        f: &Features,
    ) -> Op {
        let ioerr = Op::Status(VIRTIO_BLK_S_IOERR as u8);
        let in_bounds = |len: u64| -> Option<u64> {
            let off = sector.checked_mul(SECTOR)?;
            (off.checked_add(len)? <= size).then_some(off)
        };
        match kind {
            VIRTIO_BLK_T_IN | VIRTIO_BLK_T_OUT => {
                let len = if kind == VIRTIO_BLK_T_IN {
                    data_len
                } else {
                    r.available_bytes()
                };
                if len > MAX_REQUEST_BYTES || !(len as u64).is_multiple_of(SECTOR) {
                    return ioerr;
                }
                let Some(offset) = in_bounds(len as u64) else {
                    return ioerr;
                };
                if kind == VIRTIO_BLK_T_IN {
                    return Op::Read { offset, len };
                }
                if f.read_only {
                    return ioerr;
                }
                let mut data = vec![0u8; len];
                match r.read_exact(&mut data) {
                    Ok(()) => Op::Write { offset, data },
                    Err(_) => ioerr,
                }
            }
            VIRTIO_BLK_T_FLUSH => Op::Flush,
            VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
                if f.read_only {
                    return ioerr;
                }
                let n = r.available_bytes();
                if n == 0 || !n.is_multiple_of(16) || n / 16 > MAX_RANGE_SEGMENTS as usize {
                    return ioerr;
                }
                let mut ranges = Vec::with_capacity(n / 16);
                for _ in 0..n / 16 {
                    let mut seg = [0u8; 16];
                    if r.read_exact(&mut seg).is_err() {
                        return ioerr;
                    }
                    let s = u64::from_le_bytes(seg[0..8].try_into().expect("8 bytes"));
                    let num = u32::from_le_bytes(seg[8..12].try_into().expect("4 bytes"));
                    let flags = u32::from_le_bytes(seg[12..16].try_into().expect("4 bytes"));
                    // Only WRITE_ZEROES may set a flag (bit 0, unmap); any other is unsupported.
                    let allowed = if kind == VIRTIO_BLK_T_WRITE_ZEROES {
                        1
                    } else {
                        0
                    };
                    if flags & !allowed != 0 {
                        return Op::Status(VIRTIO_BLK_S_UNSUPP as u8);
                    }
                    if num > MAX_RANGE_SECTORS {
                        return ioerr;
                    }
                    let len = num as u64 * SECTOR;
                    let Some(off) = s
                        .checked_mul(SECTOR)
                        .filter(|o| o.checked_add(len).is_some_and(|end| end <= size))
                    else {
                        return ioerr;
                    };
                    ranges.push((off, len as u32));
                }
                Op::Ranges {
                    zeroes: kind == VIRTIO_BLK_T_WRITE_ZEROES,
                    ranges,
                }
            }
            _ => Op::Status(VIRTIO_BLK_S_UNSUPP as u8),
        }
    }

    /// Bytes this request holds in memory while it runs (for bounding a batch).
    pub fn cost(&self) -> usize {
        match &self.op {
            Op::Read { len, .. } => *len,
            Op::Write { data, .. } => data.len(),
            _ => 0,
        }
    }

    /// Runs the request and writes its answer into guest memory; returns the used length.
    /// `fua`: the disk is write-through to this driver (it never accepted FLUSH): every write is made durable before it completes.
    pub async fn run(self, dev: &dyn BlockDevice, fua: bool) -> Used {
        let Request {
            op,
            data_out,
            mut status,
            mut written,
        } = self;
        let ok = VIRTIO_BLK_S_OK as u8;
        let ioerr = VIRTIO_BLK_S_IOERR as u8;
        let st = match op {
            Op::Status(s) => s,
            Op::Read { offset, len } => match dev.read(offset, len as u32).await {
                Ok(buf) if buf.len() == len => match data_out.map(|mut w| w.write_all(&buf)) {
                    Some(Ok(())) => {
                        written = len as u32;
                        ok
                    }
                    _ => ioerr,
                },
                Ok(_) => ioerr,
                Err(e) => {
                    tracing::warn!(offset, len, error = %e.msg, "vhost-user read failed");
                    ioerr
                }
            },
            Op::Write { offset, data } => match dev.write(offset, &data, fua).await {
                Ok(()) => ok,
                Err(e) => {
                    tracing::warn!(offset, len = data.len(), error = %e.msg, "vhost-user write failed");
                    ioerr
                }
            },
            Op::Flush => match dev.flush().await {
                Ok(()) => ok,
                Err(e) => {
                    tracing::warn!(error = %e.msg, "vhost-user flush failed");
                    ioerr
                }
            },
            Op::Ranges { zeroes, ranges } => {
                let mut st = ok;
                for (off, len) in ranges {
                    let r = if zeroes {
                        dev.write_zeroes(off, len, fua).await
                    } else {
                        dev.trim(off, len, fua).await
                    };
                    if let Err(e) = r {
                        tracing::warn!(offset = off, len, error = %e.msg, "vhost-user discard/write-zeroes failed");
                        st = ioerr;
                        break;
                    }
                }
                st
            }
        };
        // The status byte's memory was checked at parse time; a write can only fail if the
        // frontend unmapped it meanwhile, and then nothing more can be said.
        let _ = status.write_all(&[st]);
        written + 1
    }
}

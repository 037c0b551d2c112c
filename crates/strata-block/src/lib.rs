//! What strata's front-ends serve (NBD, vhost-user-blk, the FUSE export, kernel NBD): a
//! [`BlockDevice`]. The engine implements it for its volumes; [`MemDevice`] is an in-memory
//! disk for protocol tests, benchmarks and fuzzing; [`ReadOnly`] refuses every change before it
//! reaches the device. Errors carry a Linux errno ([`errno`]), which NBD sends as it is and
//! vhost-user maps to a virtio status. Dependencies point one way: formats ← block ← engine,
//! and block ← each front-end, so no protocol crate needs the engine.

use std::sync::{Arc, RwLock};

use async_trait::async_trait;

/// The error numbers a device reports (Linux values, as the NBD protocol carries them).
pub mod errno {
    pub const EPERM: u32 = 1;
    pub const EIO: u32 = 5;
    pub const ENOMEM: u32 = 12;
    pub const EINVAL: u32 = 22;
    pub const ENOSPC: u32 = 28;
    pub const EOVERFLOW: u32 = 75;
    pub const ENOTSUP: u32 = 95;
    pub const ESHUTDOWN: u32 = 108;
}

use errno as proto;

/// A failed device operation: the NBD error number to send and a message for logs and
/// structured error replies.
#[derive(Debug, Clone)]
pub struct DevError {
    pub errno: u32,
    pub msg: String,
}

impl DevError {
    pub fn new(errno: u32, msg: impl Into<String>) -> Self {
        DevError {
            errno,
            msg: msg.into(),
        }
    }
}

pub type DevResult<T> = Result<T, DevError>;

#[async_trait]
pub trait BlockDevice: Send + Sync + 'static {
    fn size(&self) -> u64;
    fn read_only(&self) -> bool {
        false
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>>;
    async fn write(&self, offset: u64, data: &[u8], fua: bool) -> DevResult<()>;
    /// Whether [`BlockDevice::write_many`] does better than one write after another: a
    /// front-end then hands it the writes that arrived together.
    fn batches_writes(&self) -> bool {
        false
    }
    /// Several writes that arrived together (none with FUA), as if each were written by its own
    /// concurrent call: one result per write, in order, each meaning what `write`'s would.
    async fn write_many(&self, writes: &[(u64, &[u8])]) -> Vec<DevResult<()>> {
        let mut out = Vec::with_capacity(writes.len());
        for (offset, data) in writes {
            out.push(self.write(*offset, data, false).await);
        }
        out
    }
    /// Returns when every write completed before the call is as durable as the device promises.
    async fn flush(&self) -> DevResult<()>;
    async fn trim(&self, offset: u64, len: u32, fua: bool) -> DevResult<()>;
    async fn write_zeroes(&self, offset: u64, len: u32, fua: bool) -> DevResult<()>;
    /// Runs of (bytes, reads-as-zeros) covering exactly the range.
    async fn allocation(&self, offset: u64, len: u32) -> DevResult<Vec<(u64, bool)>>;
}

/// Another device offered read-only: the server refuses every change to it with EPERM before
/// it reaches the device (and advertises READ_ONLY), whatever the device itself would allow.
pub struct ReadOnly(pub Arc<dyn BlockDevice>);

#[async_trait]
impl BlockDevice for ReadOnly {
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_only(&self) -> bool {
        true
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.0.read(offset, len).await
    }
    async fn write(&self, _: u64, _: &[u8], _: bool) -> DevResult<()> {
        Err(DevError::new(proto::EPERM, "read-only"))
    }
    async fn flush(&self) -> DevResult<()> {
        Ok(())
    }
    async fn trim(&self, _: u64, _: u32, _: bool) -> DevResult<()> {
        Err(DevError::new(proto::EPERM, "read-only"))
    }
    async fn write_zeroes(&self, _: u64, _: u32, _: bool) -> DevResult<()> {
        Err(DevError::new(proto::EPERM, "read-only"))
    }
    async fn allocation(&self, offset: u64, len: u32) -> DevResult<Vec<(u64, bool)>> {
        self.0.allocation(offset, len).await
    }
}

/// An in-memory disk (protocol tests, tools).
pub struct MemDevice {
    data: RwLock<Vec<u8>>,
    read_only: bool,
}

impl MemDevice {
    pub fn new(size: u64) -> Arc<MemDevice> {
        Arc::new(MemDevice {
            data: RwLock::new(vec![0; size as usize]),
            read_only: false,
        })
    }
    pub fn read_only(data: Vec<u8>) -> Arc<MemDevice> {
        Arc::new(MemDevice {
            data: RwLock::new(data),
            read_only: true,
        })
    }
    fn check(&self, offset: u64, len: u64, write: bool) -> DevResult<()> {
        if write && self.read_only {
            return Err(DevError::new(proto::EPERM, "read-only export"));
        }
        match offset.checked_add(len) {
            Some(e) if e <= self.size() => Ok(()),
            _ => Err(DevError::new(
                if write { proto::ENOSPC } else { proto::EINVAL },
                "out of range",
            )),
        }
    }
}

#[async_trait]
impl BlockDevice for MemDevice {
    fn size(&self) -> u64 {
        self.data.read().map(|d| d.len() as u64).unwrap_or(0)
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        self.check(offset, len as u64, false)?;
        let d = self
            .data
            .read()
            .map_err(|_| DevError::new(proto::EIO, "poisoned"))?;
        Ok(d[offset as usize..offset as usize + len as usize].to_vec())
    }
    async fn write(&self, offset: u64, data: &[u8], _fua: bool) -> DevResult<()> {
        self.check(offset, data.len() as u64, true)?;
        let mut d = self
            .data
            .write()
            .map_err(|_| DevError::new(proto::EIO, "poisoned"))?;
        d[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    async fn flush(&self) -> DevResult<()> {
        Ok(())
    }
    async fn trim(&self, offset: u64, len: u32, fua: bool) -> DevResult<()> {
        self.write_zeroes(offset, len, fua).await
    }
    async fn write_zeroes(&self, offset: u64, len: u32, _fua: bool) -> DevResult<()> {
        self.check(offset, len as u64, true)?;
        let mut d = self
            .data
            .write()
            .map_err(|_| DevError::new(proto::EIO, "poisoned"))?;
        d[offset as usize..offset as usize + len as usize].fill(0);
        Ok(())
    }
    async fn allocation(&self, offset: u64, len: u32) -> DevResult<Vec<(u64, bool)>> {
        self.check(offset, len as u64, false)?;
        let d = self
            .data
            .read()
            .map_err(|_| DevError::new(proto::EIO, "poisoned"))?;
        let mut out: Vec<(u64, bool)> = vec![];
        let mut pos = offset;
        let end = offset + len as u64;
        while pos < end {
            let next = ((pos / 4096) + 1) * 4096;
            let stop = next.min(end);
            let zero = d[pos as usize..stop as usize].iter().all(|&b| b == 0);
            match out.last_mut() {
                Some((l, z)) if *z == zero => *l += stop - pos,
                _ => out.push((stop - pos, zero)),
            }
            pos = stop;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn read_only_refuses_changes_and_passes_reads() {
        let mem = MemDevice::new(1 << 20);
        mem.write(4096, &[7u8; 4096], false).await.unwrap();
        let ro = ReadOnly(mem.clone());
        assert!(ro.read_only());
        assert_eq!(ro.read(4096, 4096).await.unwrap(), vec![7u8; 4096]);
        for r in [
            ro.write(0, &[1u8; 512], false).await,
            ro.trim(0, 4096, false).await,
            ro.write_zeroes(4096, 4096, false).await,
        ] {
            assert_eq!(r.unwrap_err().errno, proto::EPERM);
        }
        assert_eq!(mem.read(4096, 4096).await.unwrap(), vec![7u8; 4096]);
    }
}

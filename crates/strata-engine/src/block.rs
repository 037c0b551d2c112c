//! Volumes as the block devices the front-ends serve ([`strata_block::BlockDevice`]): engine
//! errors become the errno a client sees (ENOSPC for a write past the end or a full node disk,
//! EINVAL for a bad range, ESHUTDOWN for a volume being closed, EIO for the rest).

use async_trait::async_trait;
use strata_block::errno as proto;
use strata_block::{BlockDevice, DevError, DevResult};

use crate::{Error, Volume};

fn map(e: Error, write: bool) -> DevError {
    let errno = match &e {
        Error::OutOfRange { .. } if write => proto::ENOSPC,
        Error::OutOfRange { .. } | Error::Invalid(_) => proto::EINVAL,
        // A full node disk: this request failed, the device did not (retry later).
        Error::NoSpace(_) => proto::ENOSPC,
        Error::Io { source, .. } if crate::is_no_space(source) => proto::ENOSPC,
        Error::Unavailable(..) => proto::ESHUTDOWN,
        _ => proto::EIO,
    };
    DevError::new(errno, e.to_string())
}

#[async_trait]
impl BlockDevice for Volume {
    fn size(&self) -> u64 {
        Volume::size(self)
    }
    async fn read(&self, offset: u64, len: u32) -> DevResult<Vec<u8>> {
        Volume::read(self, offset, len as u64)
            .await
            .map_err(|e| map(e, false))
    }
    async fn write(&self, offset: u64, data: &[u8], fua: bool) -> DevResult<()> {
        Volume::write(self, offset, data, fua)
            .await
            .map_err(|e| map(e, true))
    }
    fn batches_writes(&self) -> bool {
        true
    }
    async fn write_many(&self, writes: &[(u64, &[u8])]) -> Vec<DevResult<()>> {
        Volume::write_many(self, writes)
            .await
            .into_iter()
            .map(|r| r.map_err(|e| map(e, true)))
            .collect()
    }
    async fn flush(&self) -> DevResult<()> {
        Volume::flush(self).await.map_err(|e| map(e, true))
    }
    async fn trim(&self, offset: u64, len: u32, fua: bool) -> DevResult<()> {
        Volume::trim(self, offset, len as u64)
            .await
            .map_err(|e| map(e, true))?;
        if fua {
            Volume::flush(self).await.map_err(|e| map(e, true))?;
        }
        Ok(())
    }
    async fn write_zeroes(&self, offset: u64, len: u32, fua: bool) -> DevResult<()> {
        Volume::write_zeroes(self, offset, len as u64, fua)
            .await
            .map_err(|e| map(e, true))
    }
    async fn allocation(&self, offset: u64, len: u32) -> DevResult<Vec<(u64, bool)>> {
        Volume::allocation(self, offset, len as u64).map_err(|e| map(e, false))
    }
}

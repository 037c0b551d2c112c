//! strata's persistent formats.
//!
//! Everything strata writes to disk or to the object store and reads back later is encoded and
//! decoded here, and nowhere else: content ids ([`Hash`]), validated names ([`name`]), the
//! flattened disk [`manifest`], the framed immutable [`object`] layout and local [`journal`]
//! records. Every decoder treats its input as hostile: a corrupt, truncated or oversized input is
//! an [`Error`], never a panic. The byte layouts are documented in `docs/FORMATS.md` and frozen by
//! golden tests.

pub mod id;
pub mod journal;
pub mod manifest;
pub mod name;
pub mod object;

pub use id::Hash;

/// Milliseconds since the Unix epoch: the unit of every time strata records (checkpoints,
/// leases, TTLs, relay files). A clock before 1970 reads as 0.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether an I/O error may pass on a retry: anything but the kinds that recur for the same
/// call (a missing or misplaced file or directory, no permission, bad input, a read-only file
/// system, an unsupported operation). Unknown kinds (a resolver's temporary failure, too many
/// open files, a TLS read error) may pass. A full disk counts as retryable: space can be
/// freed. Shared by the store, the catalog and the engine so that "retryable" means the same
/// everywhere.
pub fn io_retryable(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    !matches!(
        e.kind(),
        K::NotFound
            | K::PermissionDenied
            | K::AlreadyExists
            | K::InvalidInput
            | K::InvalidData
            | K::NotADirectory
            | K::IsADirectory
            | K::DirectoryNotEmpty
            | K::ReadOnlyFilesystem
            | K::FileTooLarge
            | K::InvalidFilename
            | K::Unsupported
            | K::CrossesDevices
            | K::TooManyLinks
            | K::ArgumentListTooLong
    )
}

/// Logical block size of every strata disk, in bytes. Extents are counted in blocks.
pub const BLOCK_SIZE: u64 = 4096;

/// A decoding or validation failure. Carries what was being decoded and why it was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Error {
    #[error("{what}: truncated (need {need} bytes, have {have})")]
    Truncated {
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("{what}: bad magic")]
    BadMagic { what: &'static str },
    #[error("{what}: unsupported version {version}")]
    UnsupportedVersion { what: &'static str, version: u32 },
    #[error("{what}: checksum mismatch")]
    Checksum { what: &'static str },
    #[error("{what}: invalid: {why}")]
    Invalid { what: &'static str, why: String },
}

impl Error {
    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Self {
        Error::Invalid {
            what,
            why: why.into(),
        }
    }
}

/// Little-endian cursor over untrusted bytes; every read is bounds-checked.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Reader { buf, pos: 0, what }
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(Error::Truncated {
                what: self.what,
                need: (self.pos as u64).saturating_add(n as u64),
                have: self.buf.len() as u64,
            }),
        }
    }
    pub(crate) fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    pub(crate) fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

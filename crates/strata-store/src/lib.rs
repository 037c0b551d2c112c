//! Object storage for strata.
//!
//! - [`Store`]: the object store (local directory with fsync, in-memory for tests, S3 by URL)
//!   with tenant-partitioned keys; immutable objects are content-addressed and idempotent to put.
//! - [`NodeCache`]: verified, immutable ranges of objects on local disk, shared by every volume
//!   on the node, bounded, recency-evicted, restart-safe.
//! - [`ObjectReader`]: the read path for object data: node cache, then coalesced, single-flight
//!   range GETs, every byte verified against the object's frame hashes before it is served or
//!   cached.

mod cache;
mod reader;
mod store;

pub use cache::NodeCache;
pub use reader::{ObjectReader, ReaderStats, DEFAULT_READAHEAD_UNITS};
pub use store::{Credentials, Store};

/// What went wrong talking to the object store or the node cache.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("not found in object store: {0}")]
    NotFound(String),
    #[error("corrupt data in object store: {0}")]
    Corrupt(String),
    #[error("object store: {0}")]
    Backend(String),
    #[error("bad object store url {0:?}: {1}")]
    BadUrl(String, String),
    #[error("local i/o: {0}")]
    Io(String),
}

impl StoreError {
    /// Whether retrying the same call may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Backend(_) | StoreError::Io(_))
    }
}

impl From<object_store::Error> for StoreError {
    fn from(e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { path, .. } => StoreError::NotFound(path),
            e => StoreError::Backend(e.to_string()),
        }
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io(e.to_string())
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

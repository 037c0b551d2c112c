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
pub mod keys;
mod local_put;
mod object_buf;
mod reader;
mod seal;
mod store;

pub use cache::NodeCache;
pub use local_put::background;
pub use object_buf::ObjectBuf;
pub use reader::{ObjectReader, ReaderStats, DEFAULT_READAHEAD_UNITS};
pub use seal::{DataKey, MasterKey};
pub use store::{Credentials, Placed, Resolver, Store};

use std::sync::Arc;

/// What went wrong talking to the object store or the node cache. Backend and I/O errors keep
/// their source and say whether a retry can help.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("not found in object store: {0}")]
    NotFound(String),
    #[error("corrupt data in object store: {0}")]
    Corrupt(String),
    /// The object store refused or failed a call.
    #[error("object store: {source}")]
    Backend {
        retryable: bool,
        #[source]
        source: Arc<object_store::Error>,
    },
    /// A tenant's store cannot be found: its placement unreadable (the catalog down), or a
    /// store this node does not have.
    #[error("object store placement: {message}")]
    Placement { message: String, retryable: bool },
    #[error("bad object store url {0:?}: {1}")]
    BadUrl(String, String),
    #[error("local i/o: {source}")]
    Io {
        #[source]
        source: Arc<std::io::Error>,
    },
}

impl StoreError {
    /// Whether retrying the same call may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Backend { retryable, .. } => *retryable,
            StoreError::Io { source } => strata_format::io_retryable(source),
            StoreError::Placement { retryable, .. } => *retryable,
            _ => false,
        }
    }
}

/// Whether an object-store error may pass on a retry. A generic error (a connection, a 5xx
/// after the client's own retries, a local file) is, unless an I/O error in its chain says it
/// will recur (a missing directory, no permission, a read-only file system); refusals by kind
/// (permission, authentication, precondition, invalid path, unsupported) are not.
fn object_store_retryable(e: &object_store::Error) -> bool {
    use object_store::Error as E;
    match e {
        E::Generic { .. } => {
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
            while let Some(err) = cur {
                if let Some(io) = err.downcast_ref::<std::io::Error>() {
                    return strata_format::io_retryable(io);
                }
                cur = err.source();
            }
            true
        }
        E::JoinError { .. } => true,
        _ => false,
    }
}

impl From<object_store::Error> for StoreError {
    fn from(e: object_store::Error) -> Self {
        match e {
            object_store::Error::NotFound { path, .. } => StoreError::NotFound(path),
            e => StoreError::Backend {
                retryable: object_store_retryable(&e),
                source: Arc::new(e),
            },
        }
    }
}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        StoreError::Io {
            source: Arc::new(e),
        }
    }
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

use strata_catalog::CatalogError;
use strata_store::StoreError;

/// Errors of the engine. Each says what failed and whether retrying can help.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Format(#[from] strata_format::Error),
    #[error("local i/o failed ({context}): {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("offset {offset} + length {len} is outside the disk ({size} bytes)")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("volume {0} is unavailable: {1}")]
    Unavailable(String, String),
    #[error("{0}")]
    Tool(String),
    /// The node's disk (or quota) is full: this request was refused, nothing acknowledged is
    /// affected, and the same request succeeds once space is reclaimed.
    #[error("no space left on the node for {0}; retry once space is reclaimed")]
    NoSpace(String),
}

/// Whether an I/O error means the disk or a quota is full (ENOSPC, EDQUOT).
pub fn is_no_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull || matches!(e.raw_os_error(), Some(28) | Some(122))
}

impl Error {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Catalog(e) => e.is_retryable(),
            Error::Store(e) => e.is_retryable(),
            Error::NoSpace(_) => true,
            _ => false,
        }
    }

    /// True when the error means "no such thing" (for 404-style handling).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Catalog(CatalogError::NotFound { .. }))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

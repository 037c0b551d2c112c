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
            _ => false,
        }
    }

    /// True when the error means "no such thing" (for 404-style handling).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::Catalog(CatalogError::NotFound { .. }))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

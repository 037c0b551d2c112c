use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use strata_catalog::CatalogError;
use strata_engine::Error;

use crate::api::{ErrorBody, ErrorDetail};

/// An API error: status, stable kind, message that says what to do.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub retryable: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            retryable: false,
        }
    }
    pub fn invalid(m: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid", m)
    }
    pub fn not_found(m: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", m)
    }
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or unknown bearer token (Authorization: Bearer …)",
        )
    }
    pub fn forbidden(m: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", m)
    }
    pub fn internal(m: impl Into<String>) -> Self {
        let m = m.into();
        tracing::error!(error = %m, "request failed");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", m)
    }
}

/// The HTTP status and stable kind of an engine error: the API reports it so, and the CLI
/// maps it to its exit code, whichever way a verb ran.
pub fn classify(e: &Error) -> (StatusCode, &'static str) {
    match e {
        Error::Catalog(CatalogError::NotFound { .. }) => (StatusCode::NOT_FOUND, "not_found"),
        Error::Catalog(
            CatalogError::AlreadyExists { .. }
            | CatalogError::Conflict { .. }
            | CatalogError::Fenced { .. }
            | CatalogError::LeaseHeld { .. }
            | CatalogError::InUse(_),
        ) => (StatusCode::CONFLICT, "conflict"),
        Error::Catalog(CatalogError::Quota(_)) => (StatusCode::FORBIDDEN, "quota"),
        Error::Invalid(_) | Error::Format(_) | Error::OutOfRange { .. } | Error::Tool(_) => {
            (StatusCode::BAD_REQUEST, "invalid")
        }
        Error::Unavailable(..) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        Error::NoSpace(_) => (StatusCode::INSUFFICIENT_STORAGE, "no_space"),
        _ => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let retryable = e.is_retryable();
        let (status, kind) = classify(&e);
        if status.is_server_error() {
            tracing::error!(error = %e, "request failed");
        }
        ApiError {
            status,
            kind,
            message: e.to_string(),
            retryable,
        }
    }
}

impl From<CatalogError> for ApiError {
    fn from(e: CatalogError) -> Self {
        Error::from(e).into()
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind.into(),
                message: self.message,
                retryable: self.retryable,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

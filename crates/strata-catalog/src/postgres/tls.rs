//! TLS to the PostgreSQL catalog (rustls), with libpq's `sslmode` settings in the URL:
//!
//! | `sslmode`            | TLS                          | the server's certificate              |
//! |----------------------|------------------------------|---------------------------------------|
//! | `disable`            | never                        | -                                     |
//! | `prefer` (default)   | if the server offers it      | not checked                           |
//! | `require`            | always                       | not checked (as `verify-ca` with `sslrootcert`, as libpq does) |
//! | `verify-ca`          | always                       | chains to `sslrootcert`               |
//! | `verify-full`        | always                       | chains to `sslrootcert` and names the host |
//!
//! `sslrootcert=FILE` (PEM) or `sslrootcert=system` (the host's roots); `sslcert` and `sslkey`
//! (PEM) present a client certificate. These are taken out of the URL before tokio-postgres
//! parses the rest. Channel binding (SCRAM-SHA-256-PLUS) is not offered: plain SCRAM runs
//! inside the verified channel.

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;

use crate::{CatalogError, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// The TLS settings taken out of a catalog URL.
#[derive(Debug, Default)]
struct Params {
    mode: Option<Mode>,
    root: Option<String>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

fn bad(msg: impl Into<String>) -> CatalogError {
    CatalogError::backend(msg)
}

fn percent_decode(s: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let h = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| bad("bad percent-encoding in the catalog URL"))?;
            out.push(h);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad("the catalog URL is not UTF-8"))
}

impl Params {
    /// Takes `key=value` if it is one of ours; false leaves it to tokio-postgres.
    fn take(&mut self, key: &str, value: String) -> Result<bool> {
        match key {
            "sslmode" => {
                self.mode = Some(match value.as_str() {
                    "disable" => Mode::Disable,
                    "prefer" => Mode::Prefer,
                    "require" => Mode::Require,
                    "verify-ca" => Mode::VerifyCa,
                    "verify-full" => Mode::VerifyFull,
                    v => {
                        return Err(bad(format!(
                        "sslmode={v}: expected disable, prefer, require, verify-ca or verify-full"
                    )))
                    }
                })
            }
            "sslrootcert" => self.root = Some(value),
            "sslcert" => self.cert = Some(value.into()),
            "sslkey" => self.key = Some(value.into()),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Splits our TLS settings from the rest of `url` (URL or key=value form).
fn split(url: &str) -> Result<(String, Params)> {
    let mut p = Params::default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_string(), p));
        };
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|s| !s.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            if !p.take(&percent_decode(k)?, percent_decode(v)?)? {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok((rest, p))
    } else {
        let mut kept = Vec::new();
        for tok in url.split_whitespace() {
            match tok.split_once('=') {
                Some((k, v)) if !v.starts_with('\'') && p.take(k, v.to_string())? => {}
                _ => kept.push(tok),
            }
        }
        Ok((kept.join(" "), p))
    }
}

/// A parsed catalog URL and the TLS connector its settings call for.
pub(super) fn config(url: &str) -> Result<(tokio_postgres::Config, MakeRustls)> {
    let (rest, p) = split(url)?;
    let mut cfg: tokio_postgres::Config = rest
        .parse()
        .map_err(|e| CatalogError::from_source("bad PostgreSQL URL", false, e))?;
    let mode = match p.mode.unwrap_or(Mode::Prefer) {
        // libpq: `require` with a root certificate given checks the chain.
        Mode::Require if p.root.is_some() => Mode::VerifyCa,
        m => m,
    };
    cfg.ssl_mode(match mode {
        Mode::Disable => SslMode::Disable,
        Mode::Prefer => SslMode::Prefer,
        _ => SslMode::Require,
    });
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let verifier = match mode {
        Mode::VerifyCa | Mode::VerifyFull => {
            let Some(root) = &p.root else {
                return Err(bad(format!(
                    "sslmode={}: needs sslrootcert=FILE (PEM) or sslrootcert=system",
                    if mode == Mode::VerifyCa {
                        "verify-ca"
                    } else {
                        "verify-full"
                    }
                )));
            };
            let mut roots = rustls::RootCertStore::empty();
            if root == "system" {
                let found = rustls_native_certs::load_native_certs();
                roots.add_parsable_certificates(found.certs);
            } else {
                for c in CertificateDer::pem_file_iter(root)
                    .map_err(|e| bad(format!("sslrootcert {root}: {e}")))?
                {
                    let c = c.map_err(|e| bad(format!("sslrootcert {root}: {e}")))?;
                    roots
                        .add(c)
                        .map_err(|e| bad(format!("sslrootcert {root}: {e}")))?;
                }
            }
            if roots.is_empty() {
                return Err(bad(format!("sslrootcert {root}: no certificate")));
            }
            let inner =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|e| bad(format!("sslrootcert {root}: {e}")))?;
            Verifier {
                inner: Some(inner),
                check_name: mode == Mode::VerifyFull,
                provider: provider.clone(),
            }
        }
        _ => Verifier {
            inner: None,
            check_name: false,
            provider: provider.clone(),
        },
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let client = match (&p.cert, &p.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c)
                .and_then(|i| i.collect::<std::result::Result<Vec<_>, _>>())
                .map_err(|e| bad(format!("sslcert {}: {e}", c.display())))?;
            let key = PrivateKeyDer::from_pem_file(k)
                .map_err(|e| bad(format!("sslkey {}: {e}", k.display())))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| bad(format!("sslcert/sslkey: {e}")))?
        }
        _ => return Err(bad("sslcert and sslkey go together")),
    };
    Ok((cfg, MakeRustls(Arc::new(client))))
}

/// What the server's certificate must satisfy: nothing (`prefer`, `require`), a chain to the
/// roots (`verify-ca`), and the host's name too (`verify-full`).
#[derive(Debug)]
struct Verifier {
    inner: Option<Arc<WebPkiServerVerifier>>,
    check_name: bool,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        let Some(inner) = &self.inner else {
            return Ok(ServerCertVerified::assertion());
        };
        match inner.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.check_name => Ok(ServerCertVerified::assertion()),
            r => r,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The connector handed to tokio-postgres (and deadpool): one per catalog.
#[derive(Clone)]
pub struct MakeRustls(Arc<rustls::ClientConfig>);

impl MakeTlsConnect<Socket> for MakeRustls {
    type Stream = RustlsStream;
    type TlsConnect = RustlsConnect;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsConnect> {
        // A unix socket has no host name (tokio-postgres asks with ""): TLS is never tried
        // over one (the server does not offer it), so only a TLS attempt would fail.
        let name = match domain {
            "" => None,
            d => Some(
                ServerName::try_from(d.to_string())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
            ),
        };
        Ok(RustlsConnect {
            cfg: self.0.clone(),
            name,
        })
    }
}

pub struct RustlsConnect {
    cfg: Arc<rustls::ClientConfig>,
    name: Option<ServerName<'static>>,
}

impl TlsConnect<Socket> for RustlsConnect {
    type Stream = RustlsStream;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream>> + Send>>;

    fn connect(self, stream: Socket) -> Self::Future {
        Box::pin(async move {
            let name = self.name.ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidInput, "TLS needs a host name")
            })?;
            let s = tokio_rustls::TlsConnector::from(self.cfg)
                .connect(name, stream)
                .await?;
            Ok(RustlsStream(Box::new(s)))
        })
    }
}

pub struct RustlsStream(Box<tokio_rustls::client::TlsStream<Socket>>);

impl AsyncRead for RustlsStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for RustlsStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl tokio_postgres::tls::TlsStream for RustlsStream {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_come_out_of_the_url() {
        let (rest, p) = split(
            "postgres://u:p%40w@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca.pem",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u:p%40w@h:5/db?application_name=x");
        assert_eq!(p.mode, Some(Mode::VerifyFull));
        assert_eq!(p.root.as_deref(), Some("/etc/ca.pem"));
        let (rest, p) = split("host=h dbname=d sslmode=require sslrootcert=/ca.pem").unwrap();
        assert_eq!(rest, "host=h dbname=d");
        assert_eq!(p.mode, Some(Mode::Require));
        let (rest, p) = split("postgres://h/db").unwrap();
        assert_eq!((rest.as_str(), p.mode), ("postgres://h/db", None));
        assert!(split("postgres://h/db?sslmode=allow").is_err());
        assert!(config("postgres://h/db?sslmode=verify-full").is_err());
        assert!(config("postgres://h/db?sslcert=/a").is_err());
        assert!(config("postgres://h/db?sslmode=require").is_ok());
        assert!(config("postgres://h/db").is_ok());
    }
}

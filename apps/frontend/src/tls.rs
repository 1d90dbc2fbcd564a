//! TLS settings every front end that speaks over a socket shares: whether TLS is off,
//! offered or required, where the certificates are, and whether clients must show a
//! certificate; and loading them into a rustls server configuration once, at start, so a
//! bad file stops the server before any client connects. The TLS session of a connection
//! is in `tlsio.rs`.
//!
//! The certificate folder is laid out as nbdkit and qemu lay it out: `ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`. Pre-shared keys (nbdkit's `--tls-psk`) are not
//! offered: rustls has no server-side TLS-PSK for external keys.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

/// The CA whose client certificates are accepted (read only with `verify_peer`).
pub const CA_CERT_FILE: &str = "ca-cert.pem";
/// The server's certificate chain, its own certificate first.
pub const SERVER_CERT_FILE: &str = "server-cert.pem";
/// The server's private key.
pub const SERVER_KEY_FILE: &str = "server-key.pem";

/// Whether clients may or must use TLS (nbdkit's `--tls` values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// No TLS: a client that asks for it is told it is not supported.
    #[default]
    Off,
    /// Clients may upgrade to TLS, or go on without it.
    On,
    /// Clients must upgrade to TLS before anything else is answered.
    Require,
}

impl FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<TlsMode, String> {
        match s {
            "off" => Ok(TlsMode::Off),
            "on" => Ok(TlsMode::On),
            "require" => Ok(TlsMode::Require),
            _ => Err(format!("{s:?}: expected off, on or require")),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TlsMode::Off => "off",
            TlsMode::On => "on",
            TlsMode::Require => "require",
        })
    }
}

/// A service's TLS settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsConfig {
    pub mode: TlsMode,
    /// The folder of [`SERVER_CERT_FILE`], [`SERVER_KEY_FILE`] and [`CA_CERT_FILE`];
    /// needed unless the mode is off.
    pub certificates_dir: Option<PathBuf>,
    /// Clients must show a certificate signed by the CA of [`CA_CERT_FILE`].
    pub verify_peer: bool,
}

/// Why TLS cannot be set up, named by the setting at fault where there is one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("tls_certificates: a folder of certificates is needed when TLS is on or required")]
    NoCertificates,
    #[error("tls_certificates: given, but TLS is off")]
    CertificatesWithoutTls,
    #[error("tls_verify_peer: client certificates are verified only when TLS is on or required")]
    VerifyWithoutTls,
    #[error("tls_certificates: reading {path}: {error}")]
    Pem {
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("tls_certificates: {path} holds no certificate")]
    NoCertificate { path: PathBuf },
    #[error("tls_certificates: {path}: {error}")]
    BadCa { path: PathBuf, error: rustls::Error },
    #[error("tls_certificates: the server's key and certificate: {0}")]
    BadServerCert(rustls::Error),
    #[error("tls_verify_peer: {0}")]
    Verifier(rustls::server::VerifierBuilderError),
}

impl TlsError {
    /// The setting at fault: `tls_certificates` or `tls_verify_peer`.
    pub fn setting(&self) -> &'static str {
        match self {
            TlsError::VerifyWithoutTls | TlsError::Verifier(_) => "tls_verify_peer",
            _ => "tls_certificates",
        }
    }
}

impl TlsConfig {
    /// Refuses settings that contradict each other, before any file is read.
    pub fn check(&self) -> Result<(), TlsError> {
        match (self.mode, &self.certificates_dir) {
            (TlsMode::Off, Some(_)) => Err(TlsError::CertificatesWithoutTls),
            (TlsMode::Off, None) if self.verify_peer => Err(TlsError::VerifyWithoutTls),
            (TlsMode::On | TlsMode::Require, None) => Err(TlsError::NoCertificates),
            _ => Ok(()),
        }
    }

    /// The rustls configuration every connection's TLS session shares: `None` when TLS
    /// is off. Reads the certificate folder now, so a missing or bad file stops the
    /// server before it listens.
    pub(crate) fn load(&self) -> Result<Option<Arc<rustls::ServerConfig>>, TlsError> {
        self.check()?;
        let Some(dir) = &self.certificates_dir else {
            return Ok(None);
        };
        // One provider, named, so the choice does not depend on which features other crates
        // in the build happen to turn on.
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(TlsError::BadServerCert)?;
        let builder = if self.verify_peer {
            let roots = read_roots(&dir.join(CA_CERT_FILE))?;
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(TlsError::Verifier)?;
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let chain = read_certs(&dir.join(SERVER_CERT_FILE))?;
        let key_path = dir.join(SERVER_KEY_FILE);
        let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|error| TlsError::Pem {
            path: key_path,
            error,
        })?;
        let config = builder
            .with_single_cert(chain, key)
            .map_err(TlsError::BadServerCert)?;
        Ok(Some(Arc::new(config)))
    }
}

/// Whether `name` can name a client: a DNS name, as a certificate's subject alternative
/// names hold them.
pub fn client_name_ok(name: &str) -> bool {
    matches!(ServerName::try_from(name), Ok(ServerName::DnsName(_)))
}

/// Whether a client's certificate, already verified against the CA, names `name` among its
/// subject alternative names (DNS names; a wildcard name there covers the names it
/// matches, as it would for a server). The subject's common name is not read: certificates
/// put names in subject alternative names.
pub fn certificate_names(cert: &CertificateDer<'_>, name: &str) -> bool {
    let Ok(name @ ServerName::DnsName(_)) = ServerName::try_from(name) else {
        return false;
    };
    webpki::EndEntityCert::try_from(cert)
        .is_ok_and(|cert| cert.verify_is_valid_for_subject_name(&name).is_ok())
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |error| TlsError::Pem {
        path: path.to_path_buf(),
        error,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

fn read_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in read_certs(path)? {
        roots.add(cert).map_err(|error| TlsError::BadCa {
            path: path.to_path_buf(),
            error,
        })?;
    }
    Ok(roots)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_as_nbdkit_names_them() {
        for (text, mode) in [
            ("off", TlsMode::Off),
            ("on", TlsMode::On),
            ("require", TlsMode::Require),
        ] {
            assert_eq!(text.parse::<TlsMode>().unwrap(), mode);
            assert_eq!(mode.to_string(), text);
        }
        assert!("yes".parse::<TlsMode>().is_err());
    }

    #[test]
    fn contradicting_settings_are_refused_and_named() {
        let dir = Some(PathBuf::from("/nonexistent"));
        let cases = [
            (TlsMode::On, None, false, "tls_certificates"),
            (TlsMode::Require, None, true, "tls_certificates"),
            (TlsMode::Off, dir.clone(), false, "tls_certificates"),
            (TlsMode::Off, None, true, "tls_verify_peer"),
        ];
        for (mode, certificates_dir, verify_peer, setting) in cases {
            let cfg = TlsConfig {
                mode,
                certificates_dir,
                verify_peer,
            };
            let e = cfg.check().unwrap_err();
            assert_eq!(e.setting(), setting, "{e}");
            assert!(e.to_string().starts_with(setting), "{e}");
        }
        assert!(TlsConfig::default().check().is_ok());
        assert!(TlsConfig::default().load().unwrap().is_none());
    }

    #[test]
    fn a_missing_certificate_folder_is_refused_at_load_naming_the_file() {
        let cfg = TlsConfig {
            mode: TlsMode::Require,
            certificates_dir: Some(PathBuf::from("/nonexistent-hypoll-certs")),
            verify_peer: false,
        };
        let e = cfg.load().unwrap_err();
        assert!(e.to_string().contains(SERVER_CERT_FILE), "{e}");
    }
}

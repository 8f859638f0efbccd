//! `amqps://`: whether this build speaks TLS, and the certificate authority a
//! connection trusts besides the system's roots. Everything here is decided once,
//! before any connection: an `amqps://` URL in a build without TLS, or a CA file that
//! holds no usable certificate, is refused at once, never found out by a hang or a
//! handshake that cannot succeed.

use std::path::{Path, PathBuf};

use inbox_core::redact_url;
use lapin::tcp::OwnedTLSConfig;

use crate::{Error, Result};

/// The environment variable naming a PEM file of CA certificates to trust for
/// `amqps://` URLs, besides the system's roots: `AMQP_CA_CERT`. The library never
/// reads it by itself; [`ca_cert_from_env`] does, for programs that want it (the
/// examples and the `inbox` binary do).
pub const CA_CERT_ENV: &str = "AMQP_CA_CERT";

/// Whether this build of `inbox-amqp` connects to `amqps://` URLs (its feature
/// `rustls`).
pub const TLS_BUILT: bool = cfg!(feature = "rustls");

/// The path in [`CA_CERT_ENV`], if it is set and not empty.
pub fn ca_cert_from_env() -> Option<PathBuf> {
    std::env::var_os(CA_CERT_ENV)
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// How every connection to one URL does TLS, decided once.
#[derive(Clone, Debug, Default)]
pub(crate) struct Tls(OwnedTLSConfig);

impl Tls {
    /// What connecting to `url` takes, trusting `ca_cert` besides the system's roots:
    /// [`Error::TlsUnavailable`] for an `amqps://` URL in a build without TLS, and
    /// [`Error::InvalidSetting`] (`ca_cert`) for a CA given with a plain `amqp://` URL
    /// (it would be ignored) or a file without a usable certificate.
    pub(crate) fn for_url(url: &str, ca_cert: Option<&Path>) -> Result<Self> {
        let secure = is_amqps(url);
        check_tls_built(url, secure, TLS_BUILT)?;
        let Some(path) = ca_cert else {
            return Ok(Self::default());
        };
        if !secure {
            return Err(Error::invalid(
                "ca_cert",
                "an amqps:// URL for the CA to verify",
                format_args!("{} with {}", path.display(), redact_url(url)),
            ));
        }
        Ok(Self(OwnedTLSConfig {
            identity: None,
            cert_chain: Some(read_ca_cert(path)?),
        }))
    }

    /// lapin's configuration.
    pub(crate) fn config(&self) -> OwnedTLSConfig {
        self.0.clone()
    }
}

/// Whether `url` asks for TLS (its scheme is `amqps`, in any case).
fn is_amqps(url: &str) -> bool {
    url.get(..6)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("amqps:"))
}

/// Refuses a secure URL when TLS is not `built`: lapin without a TLS feature would
/// speak plain AMQP to the TLS port and wait for an answer that never comes.
fn check_tls_built(url: &str, secure: bool, built: bool) -> Result<()> {
    if secure && !built {
        return Err(Error::TlsUnavailable {
            url: redact_url(url),
        });
    }
    Ok(())
}

/// The PEM text of `path`, once it is known to hold at least one certificate and
/// nothing that is not one (lapin skips a certificate it cannot parse without a
/// word; the handshake would then fail for want of a CA the user believes given).
#[cfg(feature = "rustls")]
fn read_ca_cert(path: &Path) -> Result<String> {
    use rustls::pki_types::pem::{PemObject, SectionKind};

    let refused = |found: String| {
        Error::invalid(
            "ca_cert",
            "a PEM file of one or more X.509 CA certificates",
            format_args!("{}: {found}", path.display()),
        )
    };
    let bytes = std::fs::read(path).map_err(|e| refused(e.to_string()))?;
    let mut roots = rustls::RootCertStore::empty();
    for (n, section) in <(SectionKind, Vec<u8>)>::pem_slice_iter(&bytes).enumerate() {
        let (kind, der) = section.map_err(|e| refused(format!("not PEM ({e})")))?;
        if kind != SectionKind::Certificate {
            return Err(refused(format!(
                "PEM block {} is a {kind:?}, not a CERTIFICATE",
                n + 1
            )));
        }
        roots
            .add(der.into())
            .map_err(|e| refused(format!("certificate {} is unusable ({e})", n + 1)))?;
    }
    if roots.is_empty() {
        return Err(refused("no CERTIFICATE block".to_owned()));
    }
    String::from_utf8(bytes).map_err(|_| refused("not UTF-8 text".to_owned()))
}

/// Never reached: a CA is only read for an `amqps://` URL, which a build without TLS
/// refuses first.
#[cfg(not(feature = "rustls"))]
fn read_ca_cert(path: &Path) -> Result<String> {
    Err(Error::invalid(
        "ca_cert",
        "a build with TLS (inbox-amqp's feature `rustls`)",
        path.display(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amqps_is_told_in_any_case() {
        assert!(is_amqps("amqps://h/%2f"));
        assert!(is_amqps("AMQPS://h/%2f"));
        assert!(is_amqps("amqps:guest@h"));
        assert!(!is_amqps("amqp://h/%2f"));
        assert!(!is_amqps("amqp:"));
        assert!(!is_amqps(""));
    }

    #[test]
    fn a_secure_url_without_tls_built_is_refused_without_its_password() {
        let url = "amqps://guest:tls-s3cret@broker:5671/%2f";
        let refused = check_tls_built(url, true, false);
        let Err(Error::TlsUnavailable { url: shown }) = &refused else {
            panic!("expected TlsUnavailable, got {refused:?}");
        };
        assert!(!shown.contains("tls-s3cret"), "{shown}");
        let text = refused.map_err(|e| e.to_string()).unwrap_err();
        assert!(
            text.contains("rustls") && !text.contains("tls-s3cret"),
            "{text}"
        );
        assert!(check_tls_built(url, true, true).is_ok());
        assert!(check_tls_built("amqp://h/%2f", false, false).is_ok());
    }

    #[test]
    fn a_ca_with_a_plain_url_is_refused() {
        let refused = Tls::for_url(
            "amqp://guest:pl4in-s3cret@h/%2f",
            Some(Path::new("/etc/ca.pem")),
        );
        let (setting, found) = crate::connect::config_error(refused.map(|_| ()));
        assert_eq!(setting, "ca_cert");
        assert!(!found.contains("pl4in-s3cret"), "{found}");
    }

    /// Without the feature an `amqps://` URL fails at once and says which feature to
    /// enable, through the same path the consumer and the relay connect by.
    #[cfg(not(feature = "rustls"))]
    #[test]
    fn amqps_without_the_feature_errors_at_once() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("runtime: {e}"));
        // A listener that accepts and never answers: lapin speaking plain AMQP to it
        // would wait for the handshake until the timeout.
        let listener =
            std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("bind: {e}"));
        let port = listener.local_addr().map(|a| a.port()).unwrap_or_default();
        let url = format!("amqps://guest:n0tls-s3cret@127.0.0.1:{port}/%2f");
        let connected = runtime.block_on(crate::connect(&url, None));
        let err = match connected {
            Ok(_) => panic!("connected"),
            Err(err) => err,
        };
        assert!(matches!(err, Error::TlsUnavailable { .. }), "{err:?}");
        assert!(err.to_string().contains("`rustls`"), "{err}");
        assert!(
            !format!("{err} {err:?}").contains("n0tls-s3cret"),
            "{err:?}"
        );
    }

    #[cfg(feature = "rustls")]
    mod ca_files {
        use super::*;

        const CA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tls/ca.pem");
        const KEY: &str = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/tls/server.key"
        );

        fn refusal(contents: Option<&[u8]>) -> String {
            let dir = std::env::temp_dir().join(format!("inbox-amqp-ca-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
            let path = dir.join(format!("{}.pem", contents.map_or(0, <[u8]>::len)));
            if let Some(contents) = contents {
                std::fs::write(&path, contents).unwrap_or_else(|e| panic!("{e}"));
            }
            let read = Tls::for_url("amqps://h/%2f", Some(&path));
            let _ = std::fs::remove_file(&path);
            let (setting, found) = crate::connect::config_error(read.map(|_| ()));
            assert_eq!(setting, "ca_cert");
            found
        }

        #[test]
        fn a_good_ca_file_is_taken_whole() {
            let tls = Tls::for_url("amqps://h/%2f", Some(Path::new(CA)))
                .unwrap_or_else(|e| panic!("{e}"));
            let pem = std::fs::read_to_string(CA).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(tls.config().cert_chain, Some(pem));
        }

        #[test]
        fn a_bad_ca_file_is_refused_saying_why() {
            assert!(refusal(None).contains("No such file"));
            assert!(refusal(Some(b"")).contains("no CERTIFICATE block"));
            assert!(refusal(Some(b"not a certificate\n")).contains("no CERTIFICATE block"));
            let key = std::fs::read(KEY).unwrap_or_else(|e| panic!("{e}"));
            assert!(refusal(Some(&key)).contains("not a CERTIFICATE"));
            let garbage = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n";
            assert!(refusal(Some(garbage)).contains("certificate 1 is unusable"));
        }
    }
}

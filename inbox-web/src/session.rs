//! Sessions, CSRF tokens, the access token and the origin check.
//!
//! A session is a signed cookie, not a row or a map entry: `inbox_console=<id>.<expiry>.<mac>`
//! with the MAC an HMAC-SHA-256 over the id, the expiry and the session's kind under the
//! console's session key. Nothing is kept per session, so a console behind a load
//! balancer works on every replica that shares the key, and no visitor can grow the
//! process's memory. The key is derived from the access token when there is one (every
//! replica with the same `INBOX_WEB_TOKEN` accepts the same sessions, and changing the
//! token ends every session), from [`Console::session_key`](crate::Console::session_key)
//! when set, and is random per process otherwise (sessions end with the process).
//!
//! A CSRF token is the HMAC of the session's id under the same key: bound to that
//! session, useless with another one, and never stored. Every comparison of a secret
//! (the MAC, the CSRF token, the access token) is in constant time.
//!
//! Hand-written rather than through a session crate: what is needed is two HMACs and a
//! cookie header, and the session crates bring a store, a serializer and their own
//! cookie jar for it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// The session cookie's name.
pub const SESSION_COOKIE: &str = "inbox_console";

/// How long a session lasts.
pub(crate) const SESSION_LIFETIME: Duration = Duration::from_secs(12 * 60 * 60);

/// What a session was issued for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Issued by the login form, after the access token was presented.
    Login,
    /// Issued to a visitor of a mounted console (the host's auth layer admitted it):
    /// it carries the CSRF token's binding, not an identity.
    Visitor,
}

impl Kind {
    fn tag(self) -> &'static str {
        match self {
            Self::Login => "login",
            Self::Visitor => "visitor",
        }
    }
}

/// A verified session.
#[derive(Clone, Debug)]
pub(crate) struct Session {
    pub(crate) id: String,
    pub(crate) kind: Kind,
}

/// The console's secrets: the session key and, in token mode, the access token's digest.
pub(crate) struct Keys {
    key: [u8; 32],
    token: Option<[u8; 32]>,
}

impl Keys {
    /// Keys for a console with this access token (or none) and this session key (or none).
    pub(crate) fn new(token: Option<&str>, session_key: Option<&[u8]>) -> Self {
        let key = match (session_key, token) {
            // The token is mixed in: changing it ends every session, key or not.
            (Some(k), t) => digest(&[
                b"inbox-web session key\0",
                k,
                b"\0",
                &digest(&[t.unwrap_or_default().as_bytes()]),
            ]),
            (None, Some(t)) => digest(&[b"inbox-web session key from token\0", t.as_bytes()]),
            (None, None) => {
                let a = uuid::Uuid::new_v4();
                let b = uuid::Uuid::new_v4();
                digest(&[
                    b"inbox-web random session key\0",
                    a.as_bytes(),
                    b.as_bytes(),
                ])
            }
        };
        Self {
            key,
            token: token.map(|t| digest(&[t.as_bytes()])),
        }
    }

    /// Whether an access token is required.
    pub(crate) fn token_required(&self) -> bool {
        self.token.is_some()
    }

    /// Whether `presented` is the access token (constant time over their digests, so
    /// neither the token's length nor a prefix leaks).
    pub(crate) fn token_matches(&self, presented: &str) -> bool {
        match &self.token {
            Some(expected) => bool::from(digest(&[presented.as_bytes()]).ct_eq(expected)),
            None => false,
        }
    }

    fn mac(&self, parts: &[&str]) -> HmacSha256 {
        // An HMAC takes a key of any length: this never fails.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(&self.key)
            .unwrap_or_else(|_| unreachable!("HMAC accepts every key length"));
        for p in parts {
            mac.update(p.as_bytes());
            mac.update(&[0]);
        }
        mac
    }

    /// A new session's cookie value.
    pub(crate) fn issue(&self, kind: Kind) -> (Session, String) {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let expires = now_secs() + SESSION_LIFETIME.as_secs();
        let expires = expires.to_string();
        let mac = hex(&self
            .mac(&["session", &id, &expires, kind.tag()])
            .finalize()
            .into_bytes());
        let value = format!("{id}.{expires}.{mac}");
        (Session { id, kind }, value)
    }

    /// The session a cookie value stands for, if its MAC is ours and it has not expired.
    pub(crate) fn verify(&self, value: &str) -> Option<Session> {
        let mut parts = value.split('.');
        let (id, expires, mac) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let at: u64 = expires.parse().ok()?;
        let mac = unhex(mac)?;
        for kind in [Kind::Login, Kind::Visitor] {
            if self
                .mac(&["session", id, expires, kind.tag()])
                .verify_slice(&mac)
                .is_ok()
            {
                return (at > now_secs()).then(|| Session {
                    id: id.to_owned(),
                    kind,
                });
            }
        }
        None
    }

    /// The CSRF token of a session.
    pub(crate) fn csrf(&self, session: &Session) -> String {
        hex(&self.mac(&["csrf", &session.id]).finalize().into_bytes())
    }

    /// Whether `presented` is the session's CSRF token (constant time).
    pub(crate) fn csrf_matches(&self, session: &Session, presented: &str) -> bool {
        match unhex(presented) {
            Some(bytes) => self
                .mac(&["csrf", &session.id])
                .verify_slice(&bytes)
                .is_ok(),
            None => false,
        }
    }
}

fn digest(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || text.len() > 128 {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The value of the cookie `name` in a `Cookie` header.
pub(crate) fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').find_map(|pair| {
        let (k, v) = pair.trim().split_once('=')?;
        (k == name).then_some(v)
    })
}

/// The `Set-Cookie` value of a session: HttpOnly, SameSite=Strict, scoped to the
/// console's path; `Secure` when the console is told it is served over HTTPS.
pub(crate) fn set_cookie(value: &str, path: &str, secure: bool) -> String {
    format!(
        "{SESSION_COOKIE}={value}; Path={path}; Max-Age={}; HttpOnly; SameSite=Strict{}",
        SESSION_LIFETIME.as_secs(),
        if secure { "; Secure" } else { "" }
    )
}

/// The `Set-Cookie` value that ends a session.
pub(crate) fn clear_cookie(path: &str, secure: bool) -> String {
    format!(
        "{SESSION_COOKIE}=; Path={path}; Max-Age=0; HttpOnly; SameSite=Strict{}",
        if secure { "; Secure" } else { "" }
    )
}

/// Whether a console without a token answers a request for `host` (its `Host`
/// header): a loopback address or `localhost` (any port), or the host of an origin it
/// was told to accept. Anything else is refused, so that a page of another site whose
/// name an attacker points at 127.0.0.1 (DNS rebinding) is never served the console
/// as its own origin: its `Host` names the attacker's site.
pub(crate) fn host_allowed(host: Option<&str>, allowed: &[String]) -> bool {
    let Some(host) = host else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    if name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
    {
        return true;
    }
    allowed.iter().any(|origin| {
        origin
            .split_once("://")
            .map_or(origin.as_str(), |(_, authority)| authority)
            .trim_end_matches('/')
            .eq_ignore_ascii_case(host)
    })
}

/// Whether a state-changing request comes from the console's own origin.
///
/// `Origin` (sent by browsers on every POST) must name the request's own host, or one
/// of the origins the console was told to accept (a proxy's public name). Without
/// `Origin`, `Sec-Fetch-Site` must be `same-origin` or `none`. A request with neither
/// (not a browser: curl, a script) passes this check and still needs the CSRF token or
/// the bearer token.
pub(crate) fn same_origin(
    origin: Option<&str>,
    fetch_site: Option<&str>,
    host: Option<&str>,
    allowed: &[String],
) -> bool {
    if let Some(origin) = origin {
        if allowed.iter().any(|a| a.eq_ignore_ascii_case(origin)) {
            return true;
        }
        let authority = origin
            .strip_prefix("http://")
            .or_else(|| origin.strip_prefix("https://"));
        return match (authority, host) {
            (Some(a), Some(h)) => !a.is_empty() && a.eq_ignore_ascii_case(h),
            _ => false,
        };
    }
    match fetch_site {
        Some(site) => site == "same-origin" || site == "none",
        None => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_verifies_only_with_its_own_key_and_mac() {
        let keys = Keys::new(Some("secret"), None);
        let (session, value) = keys.issue(Kind::Login);
        let back = keys.verify(&value).expect("own session");
        assert_eq!(back.id, session.id);
        assert_eq!(back.kind, Kind::Login);
        assert!(Keys::new(Some("other"), None).verify(&value).is_none());
        let mut forged = value.clone();
        forged.pop();
        forged.push(if value.ends_with('0') { '1' } else { '0' });
        assert!(keys.verify(&forged).is_none());
        // A longer expiry with the old MAC is refused.
        let parts: Vec<&str> = value.split('.').collect();
        let extended = format!("{}.{}.{}", parts[0], u64::MAX, parts[2]);
        assert!(keys.verify(&extended).is_none());
    }

    #[test]
    fn the_csrf_token_is_bound_to_its_session() {
        let keys = Keys::new(None, Some(b"k"));
        let (a, _) = keys.issue(Kind::Visitor);
        let (b, _) = keys.issue(Kind::Visitor);
        assert!(keys.csrf_matches(&a, &keys.csrf(&a)));
        assert!(!keys.csrf_matches(&a, &keys.csrf(&b)));
        assert!(!keys.csrf_matches(&a, ""));
        assert!(!keys.csrf_matches(&a, "zz"));
    }

    #[test]
    fn the_token_is_compared_whole() {
        let keys = Keys::new(Some("s3cret-token"), None);
        assert!(keys.token_matches("s3cret-token"));
        assert!(!keys.token_matches("s3cret"));
        assert!(!keys.token_matches("s3cret-token "));
        assert!(!Keys::new(None, None).token_matches(""));
    }

    #[test]
    fn origins() {
        let host = Some("127.0.0.1:8080");
        assert!(same_origin(Some("http://127.0.0.1:8080"), None, host, &[]));
        assert!(!same_origin(Some("http://evil.example"), None, host, &[]));
        assert!(!same_origin(Some("null"), None, host, &[]));
        assert!(same_origin(
            Some("https://ops.example.com"),
            None,
            host,
            &["https://ops.example.com".into()]
        ));
        assert!(!same_origin(None, Some("cross-site"), host, &[]));
        assert!(same_origin(None, Some("same-origin"), host, &[]));
        assert!(same_origin(None, None, host, &[]));
        assert_eq!(
            cookie("a=1; inbox_console=x.y.z", SESSION_COOKIE),
            Some("x.y.z")
        );
    }

    #[test]
    fn hosts_of_a_console_without_a_token() {
        let none: &[String] = &[];
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:80",
            "[::1]:8080",
            "LOCALHOST",
        ] {
            assert!(host_allowed(Some(ok), none), "{ok}");
        }
        for bad in [
            "attacker.example:8080",
            "attacker.example",
            "127.0.0.1.nip.io",
            "[::2]:1",
            "10.0.0.1:80",
        ] {
            assert!(!host_allowed(Some(bad), none), "{bad}");
        }
        assert!(!host_allowed(None, none));
        let allowed = ["https://ops.example.com".to_owned()];
        assert!(host_allowed(Some("ops.example.com"), &allowed));
        assert!(!host_allowed(Some("ops.example.com.evil"), &allowed));
    }

    #[test]
    fn a_new_token_ends_the_sessions_of_a_shared_key() {
        let old = Keys::new(Some("old"), Some(b"k"));
        let (_, cookie) = old.issue(Kind::Login);
        assert!(old.verify(&cookie).is_some());
        assert!(Keys::new(Some("rotated"), Some(b"k"))
            .verify(&cookie)
            .is_none());
    }
}

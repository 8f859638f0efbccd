//! Connection URLs in messages.

/// Replaces the password of a URL's user info with `***`.
///
/// ```
/// use inbox_core::redact_url;
/// assert_eq!(redact_url("postgres://app:s3cret@db:5432/billing"), "postgres://app:***@db:5432/billing");
/// assert_eq!(redact_url("postgres://app@db/billing"), "postgres://app@db/billing");
/// ```
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    match userinfo.find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end + 3],
            &userinfo[..colon],
            &rest[at..]
        ),
        None => url.to_owned(),
    }
}

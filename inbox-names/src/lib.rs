//! The name rules shared by `inbox-core` and `inbox-macros`: one copy, so a consumer
//! group name the derive accepts at compile time is exactly one `ConsumerGroup::new`
//! accepts at run time. A crate of its own because inbox-core depends on inbox-macros,
//! which therefore cannot depend on inbox-core. Dependency-free.
#![forbid(unsafe_code)]

/// Longest consumer group name, in bytes.
pub const MAX_GROUP_LEN: usize = 100;

/// Longest message key, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// Checks a consumer group name: 1 to 100 bytes of `[a-z0-9._-]`.
///
/// Returns a lower-case description of the first problem found.
pub fn check_group_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("consumer group name must not be empty".to_owned());
    }
    if name.len() > MAX_GROUP_LEN {
        return Err(format!(
            "consumer group name must be at most {MAX_GROUP_LEN} bytes, found {} bytes",
            name.len()
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '.' | '_' | '-'))
    {
        return Err(format!(
            "consumer group name may only contain [a-z0-9._-], found {bad:?} in {name:?}"
        ));
    }
    Ok(())
}

/// Checks a message key: 1 to 255 bytes, no NUL byte (PostgreSQL's TEXT cannot hold
/// one, so a key with one could never be claimed).
pub fn check_message_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("message key must not be empty".to_owned());
    }
    if key.len() > MAX_KEY_LEN {
        return Err(format!(
            "message key must be at most {MAX_KEY_LEN} bytes, found {} bytes",
            key.len()
        ));
    }
    if let Some(at) = key.find('\0') {
        return Err(format!(
            "message key must not contain a NUL byte, found one at byte {at}"
        ));
    }
    Ok(())
}

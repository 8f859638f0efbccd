//! `usage_consumer` reads its retry ladder and attempt limit from the environment
//! (`INBOX_RETRY_LADDER`, `INBOX_MAX_ATTEMPTS`) and refuses bad values at startup,
//! before it connects anywhere, naming the variable.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::path::PathBuf;
use std::process::Command;

/// `cargo test` builds the package's examples next to its test binaries.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    dir.join("examples").join("usage_consumer")
}

fn start(vars: &[(&str, &str)]) -> (i32, String) {
    let out = Command::new(example())
        // Never reached: the settings are refused first.
        .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
        .env("AMQP_URL", "amqp://nobody@127.0.0.1:1/%2f")
        .envs(vars.iter().copied())
        .output()
        .unwrap();
    (
        out.status.code().unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn bad_settings_are_refused_naming_the_variable() {
    for (vars, named) in [
        (&[("INBOX_RETRY_LADDER", "50")][..], "INBOX_RETRY_LADDER"),
        (
            &[("INBOX_RETRY_LADDER", "50ms,0ms")][..],
            "INBOX_RETRY_LADDER",
        ),
        (&[("INBOX_MAX_ATTEMPTS", "0")][..], "INBOX_MAX_ATTEMPTS"),
        (&[("INBOX_MAX_ATTEMPTS", "three")][..], "INBOX_MAX_ATTEMPTS"),
    ] {
        let (code, stderr) = start(vars);
        assert_eq!(code, 1, "{vars:?}: {stderr}");
        assert!(stderr.contains(named), "{vars:?}: {stderr}");
    }
    // Good values get past the settings, to the (unreachable) database.
    let (code, stderr) = start(&[
        ("INBOX_RETRY_LADDER", "50ms,200ms"),
        ("INBOX_MAX_ATTEMPTS", "3"),
    ]);
    assert_eq!(code, 1);
    assert!(!stderr.contains("INBOX_"), "{stderr}");
    assert!(stderr.contains("startup failed"), "{stderr}");
}

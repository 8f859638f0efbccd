//! `inbox web` (the feature `web`): the real binary serves the console, refuses a
//! public address without a token, asks for the token when it has one, and stops on
//! SIGTERM.

#![cfg(feature = "web")]
#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use inbox_test_support::{Fixture, SqliteFixture};

fn inbox(fx: &SqliteFixture, args: &[&str]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_inbox"));
    cmd.env_remove("INBOX_SCHEMA")
        .env_remove("INBOX_PREFIX")
        .env_remove("INBOX_WEB_TOKEN")
        .env_remove("INBOX_WEB_LISTEN")
        .env("DATABASE_URL", format!("sqlite://{}", fx.path))
        .args(args);
    cmd
}

/// Starts `inbox web` and reads the address from its first line.
fn start(mut cmd: Command) -> (Child, String) {
    let mut child = cmd.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .trim()
        .strip_prefix("inbox: console on http://")
        .and_then(|r| r.split('/').next())
        .unwrap_or_else(|| panic!("first line: {line:?}"))
        .to_owned();
    (child, addr)
}

/// One HTTP/1.0 GET: the status line and headers, and the body.
fn get(addr: &str, path: &str) -> (String, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: text/html\r\n\r\n"
    )
    .unwrap();
    let mut all = String::new();
    s.read_to_string(&mut all).unwrap();
    let (head, body) = all.split_once("\r\n\r\n").unwrap();
    (head.to_owned(), body.to_owned())
}

fn sigterm(child: &mut Child) -> i32 {
    let pid = child.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    child.wait().unwrap().code().unwrap_or(-1)
}

#[test]
fn serves_the_console_on_loopback_and_stops_on_sigterm() {
    let fx = SqliteFixture::new();
    drop(fx.builder().build().unwrap());
    let (mut child, addr) = start(inbox(&fx, &["web", "--listen", "127.0.0.1:0"]));
    let (head, body) = get(&addr, "/failures");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(body.contains("Failure groups"), "{body}");
    assert_eq!(sigterm(&mut child), 0, "a SIGTERM ends it cleanly");
}

#[test]
fn a_public_address_needs_a_token_and_a_token_needs_a_login() {
    let fx = SqliteFixture::new();
    drop(fx.builder().build().unwrap());
    let refused = inbox(&fx, &["web", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8(refused.stderr).unwrap();
    assert!(
        err.contains("without a token: set INBOX_WEB_TOKEN"),
        "{err}"
    );
    let mut cmd = inbox(&fx, &["web", "--listen", "0.0.0.0:0", "--read-only"]);
    cmd.env("INBOX_WEB_TOKEN", "a-long-random-token");
    let (mut child, addr) = start(cmd);
    let port = addr.rsplit(':').next().unwrap();
    let (head, _) = get(&format!("127.0.0.1:{port}"), "/");
    assert!(head.contains(" 303 "), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("location: /login"),
        "{head}"
    );
    assert_eq!(sigterm(&mut child), 0);
}

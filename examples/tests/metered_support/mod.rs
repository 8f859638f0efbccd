//! The metered API's test support: the service as a child process on a schema of its
//! own, and a tiny HTTP/1.1 client over `std::net::TcpStream`.
//!
//! Why a hand-written client: the tests need requests, statuses, headers and an NDJSON
//! body read line by line as it streams (to kill the service mid-stream). HTTP/1.1
//! with `Connection: close` and chunked decoding is a page; hyper's client would add
//! hyper-util's client feature set and an async runtime to every test.

#![allow(dead_code, clippy::unwrap_used)] // not every test file uses every helper

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use diesel::connection::SimpleConnection;
use diesel::{Connection, PgConnection};
use serde_json::Value;

/// A bound on every read: only to catch a hang, never a timing assertion.
pub(crate) const HANG: Duration = Duration::from_secs(60);

/// `cargo test` builds the package's examples next to its test binaries.
pub(crate) fn example(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    let path = dir.join("examples").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --example {name}`",
        path.display()
    );
    path
}

/// The PostgreSQL and Redis URLs, found as the test support finds every service
/// (a variable, else the default local address); `None` only when the service is
/// missing and `INBOX_SKIP_SERVICES=1` lets the test return early.
pub(crate) fn services() -> Option<(String, String)> {
    let pg = inbox_test_support::postgres_url()?;
    let redis = inbox_test_support::redis_url()?;
    Some((pg, redis))
}

/// A schema of one test's own, dropped at the end.
pub(crate) struct Schema {
    pub url: String,
    pub name: String,
}

impl Schema {
    pub(crate) fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            name: inbox_test_support::unique_name("metered"),
        }
    }

    /// A connection inside the schema.
    pub(crate) fn connect(&self) -> PgConnection {
        let mut conn = PgConnection::establish(&self.url).unwrap();
        conn.batch_execute(&format!("SET search_path TO \"{}\"", self.name))
            .unwrap();
        conn
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.url) {
            let _ = conn.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name));
        }
        // A test that settles over a broker runs the service with the prefix
        // `<schema>.`; its retry tiers carry no expiry. The services are gone by now
        // (declared after the schema), so the whole topology goes.
        // Quietly: a test without a broker has nothing there to remove.
        let amqp = std::env::var("AMQP_URL")
            .unwrap_or_else(|_| inbox_test_support::Service::Amqp.default_url().to_owned());
        {
            use inbox_examples::metered::db::{SETTLEMENT_GROUP, SETTLEMENT_TYPE};
            let topology = inbox_amqp::Topology::new("metered")
                .and_then(|t| t.prefix(format!("{}.", self.name)))
                .map(|t| {
                    let group = inbox_core::ConsumerGroup::new(SETTLEMENT_GROUP);
                    t.group(group.expect("group name"), [SETTLEMENT_TYPE])
                });
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let (Ok(topology), Ok(rt)) = (topology, rt) {
                rt.block_on(async {
                    let props = lapin::ConnectionProperties::default();
                    let connect = lapin::Connection::connect(&amqp, props);
                    let within = Duration::from_secs(5);
                    if let Ok(Ok(conn)) = tokio::time::timeout(within, connect).await {
                        let _ = tokio::time::timeout(within, topology.delete(&conn)).await;
                        let _ = conn.close(200, "done".into()).await;
                    }
                });
            }
        }
    }
}

/// The admin token every test service runs with.
pub(crate) const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";

/// The service, running.
pub(crate) struct Service {
    child: Child,
    pub addr: String,
    pub admin_addr: String,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

/// `metered_api` on `schema` with `env` on top of the defaults (no AMQP_URL unless
/// given, free ports, short deadlines).
fn command(schema: &Schema, redis: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(example("metered_api"));
    cmd.env_remove("AMQP_URL")
        .env("DATABASE_URL", &schema.url)
        .env("METERED_SCHEMA", &schema.name)
        .env("REDIS_URL", redis)
        .env("LISTEN_ADDR", "127.0.0.1:0")
        .env("METERED_ADMIN_ADDR", "127.0.0.1:0")
        .env("METERED_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("METERED_CHUNK_DELAY_MS", "5")
        .env("METERED_RELAY_POLL_MS", "50")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// How a run of the service that was expected to fail at startup ended.
pub(crate) struct Exited {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the service to its end (a startup failure), within [`HANG`].
pub(crate) fn run_to_exit(schema: &Schema, redis: &str, env: &[(&str, &str)]) -> Exited {
    let mut child = command(schema, redis, env).spawn().unwrap();
    let (tx, rx) = mpsc::channel();
    let mut stdout = child.stdout.take().unwrap();
    let mut stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let (mut out, mut err) = (String::new(), String::new());
        let _ = stdout.read_to_string(&mut out);
        let _ = stderr.read_to_string(&mut err);
        let _ = tx.send((out, err));
    });
    match rx.recv_timeout(HANG) {
        Ok((stdout, stderr)) => Exited {
            code: child.wait().unwrap().code(),
            stdout,
            stderr,
        },
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!("metered_api kept running where it should have stopped");
        }
    }
}

impl Service {
    /// Starts `metered_api` (see [`command`]) and waits for its two listeners.
    pub(crate) fn start(schema: &Schema, redis: &str, env: &[(&str, &str)]) -> Self {
        let mut child = command(schema, redis, env).spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut admin = None;
            let mut hooks = false;
            let mut sent = false;
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                hooks |= line.starts_with("metered_api: test hooks on");
                if let Some(addr) = line.strip_prefix("metered_api: admin on http://") {
                    admin = Some(addr.to_owned());
                }
                if !sent {
                    if let Some(addr) = line.strip_prefix("metered_api: listening on http://") {
                        let _ =
                            tx.send((addr.to_owned(), admin.clone().unwrap_or_default(), hooks));
                        sent = true;
                    }
                }
            }
        });
        let stderr_text = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = std::sync::Arc::clone(&stderr_text);
        let stderr = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let (addr, admin_addr, hooks) = match rx.recv_timeout(HANG) {
            Ok(started) => started,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("metered_api did not start: {}", stderr_text.lock().unwrap());
            }
        };
        if hooks != cfg!(feature = "test-hooks") {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the metered_api binary has test hooks {}, these tests expect them {}: \
                 run `cargo build -p inbox-examples --example metered_api{}` first",
                if hooks { "on" } else { "off" },
                if hooks { "off" } else { "on" },
                if hooks { "" } else { " --features test-hooks" },
            );
        }
        Self {
            child,
            addr,
            admin_addr,
            stderr: stderr_text,
        }
    }

    /// SIGKILL: the process gets no chance to settle anything.
    pub(crate) fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What the service logged so far.
    pub(crate) fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// `/admin` paths go to the admin listener with the admin token, the rest to
    /// the public one.
    fn route(&self, path: &str, headers: &[(&str, &str)]) -> (String, Vec<(String, String)>) {
        let mut all: Vec<(String, String)> = headers
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        if path.starts_with("/admin") {
            all.push(("Authorization".into(), format!("Bearer {ADMIN_TOKEN}")));
            (self.admin_addr.clone(), all)
        } else {
            (self.addr.clone(), all)
        }
    }

    pub(crate) fn get(&self, path: &str, headers: &[(&str, &str)]) -> HttpResponse {
        let (addr, headers) = self.route(path, headers);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        request(&addr, "GET", path, &headers, None)
    }

    pub(crate) fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> HttpResponse {
        let (addr, headers) = self.route(path, headers);
        let headers: Vec<(&str, &str)> = headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        request(&addr, "POST", path, &headers, Some(body))
    }

    pub(crate) fn json(&self, path: &str) -> Value {
        let r = self.get(path, &[]);
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        r.json()
    }

    /// A new account with `balance` and one key with `cap`: (account id, api key).
    pub(crate) fn account(&self, balance: i64, cap: i64) -> (i64, String) {
        let r = self.post(
            "/admin/accounts",
            &[],
            &format!("{{\"balance\": {balance}}}"),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let account = r.json()["account_id"].as_i64().unwrap();
        (account, self.key(account, cap))
    }

    pub(crate) fn key(&self, account: i64, cap: i64) -> String {
        let r = self.post(
            "/admin/keys",
            &[],
            &format!("{{\"account_id\": {account}, \"spend_cap\": {cap}}}"),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["api_key"].as_str().unwrap().to_owned()
    }

    /// `POST /v1/speech`.
    pub(crate) fn speech(&self, key: &str, idempotency: Option<&str>, text: &str) -> HttpResponse {
        let auth = format!("Bearer {key}");
        let mut headers = vec![("Authorization", auth.as_str())];
        if let Some(k) = idempotency {
            headers.push(("Idempotency-Key", k));
        }
        let body = serde_json::json!({ "text": text }).to_string();
        self.post("/v1/speech", &headers, &body)
    }

    pub(crate) fn balance(&self, key: &str) -> Value {
        let auth = format!("Bearer {key}");
        let r = self.get("/v1/balance", &[("Authorization", &auth)]);
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    pub(crate) fn stats(&self) -> Value {
        self.json("/admin/stats")
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A response read to its end.
#[derive(Debug)]
pub(crate) struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    /// The NDJSON lines of a stream.
    pub(crate) fn lines(&self) -> Vec<Value> {
        self.text()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// The error code of a JSON error answer.
    pub(crate) fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

fn send(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(HANG)).unwrap();
    let body = body.unwrap_or("");
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !body.is_empty() {
        req.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    stream.write_all(req.as_bytes()).unwrap();
    stream
}

fn read_head(reader: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut status_line = String::new();
    reader.read_line(&mut status_line).unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_owned(), v.trim().to_owned()));
        }
    }
    (status, headers)
}

/// One request on its own connection, the body read to its end.
pub(crate) fn request(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> HttpResponse {
    let mut open = open(addr, method, path, headers, body);
    let mut body = Vec::new();
    while let Some(piece) = open.next_piece() {
        body.extend_from_slice(&piece);
    }
    HttpResponse {
        status: open.status,
        headers: open.headers,
        body,
    }
}

/// A response whose body is read as it arrives.
pub(crate) struct OpenResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    reader: BufReader<TcpStream>,
    chunked: bool,
    length: Option<usize>,
    done: bool,
    pending: Vec<u8>,
}

/// Sends a request and reads the status and headers.
pub(crate) fn open(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> OpenResponse {
    let mut reader = BufReader::new(send(addr, method, path, headers, body));
    let (status, headers) = read_head(&mut reader);
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    let chunked = find("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let length = find("content-length").and_then(|v| v.parse().ok());
    OpenResponse {
        status,
        headers,
        reader,
        chunked,
        length,
        done: false,
        pending: Vec::new(),
    }
}

impl OpenResponse {
    /// The next piece of the body (a chunk), `None` at its end.
    fn next_piece(&mut self) -> Option<Vec<u8>> {
        if self.done {
            return None;
        }
        if self.chunked {
            let mut size = String::new();
            if self.reader.read_line(&mut size).ok()? == 0 {
                self.done = true;
                return None;
            }
            let size = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            if size == 0 {
                self.done = true;
                return None;
            }
            let mut data = vec![0; size + 2];
            self.reader.read_exact(&mut data).ok()?;
            data.truncate(size);
            return Some(data);
        }
        self.done = true;
        let mut data = Vec::new();
        match self.length {
            Some(n) => {
                data.resize(n, 0);
                self.reader.read_exact(&mut data).ok()?;
            }
            None => {
                self.reader.read_to_end(&mut data).ok()?;
            }
        }
        Some(data)
    }

    /// The next NDJSON line, `None` at the body's end.
    pub(crate) fn next_line(&mut self) -> Option<Value> {
        loop {
            if let Some(pos) = self.pending.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=pos).collect();
                return Some(serde_json::from_slice(&line).unwrap());
            }
            let piece = self.next_piece()?;
            self.pending.extend_from_slice(&piece);
        }
    }
}

//! The operator console (`inbox-web`, mounted by the order service under `/ops`) in a
//! real browser: headless Chromium driven through chromedriver (WebDriver), as an
//! on-call engineer uses it. An order past its customer's credit limit is
//! dead-lettered; the engineer logs in with the console's token, finds the failure
//! group, opens the letter (payload and error), raises the limit, replays the letter
//! from the page and sees the order counted exactly once; a second replay from the
//! page is refused and counts nothing.
//!
//! Every page is saved as a PNG under `<CARGO_TARGET_TMPDIR>/console-screenshots/`
//! (the path is printed). Chromium and chromedriver are looked up on `PATH` (or
//! named by `CHROMIUM` and `CHROMEDRIVER`); without them the test prints a
//! `skipped:` line and returns, unless `INBOX_REQUIRE_SERVICES=1` (CI installs them:
//! `.ci/services`). It leaves nothing behind: the service, chromedriver and its
//! Chromium are stopped, its schema dropped, its queues deleted.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use diesel::connection::SimpleConnection;
use diesel::sql_types::BigInt;
use diesel::{Connection, PgConnection, QueryableByName, RunQueryDsl};
use fantoccini::{Client, ClientBuilder, Locator};
use inbox_amqp::Topology;
use inbox_core::ConsumerGroup;

const GROUP: &str = "shop.customer-totals";
/// The browser window (and so every screenshot).
const WINDOW: (u32, u32) = (1400, 900);
/// How long the test waits for the service to get somewhere.
const PATIENCE: Duration = Duration::from_secs(60);

#[derive(QueryableByName)]
struct Cents {
    #[diesel(sql_type = BigInt)]
    cents: i64,
}

/// A child process, stopped when dropped: `SIGTERM` to its process group, then
/// `SIGKILL` if it lingers. Each child is started as the leader of a process group of
/// its own, so chromedriver's Chromium (and Chromium's helpers) go with it.
struct Proc {
    child: Child,
    name: &'static str,
}

impl Proc {
    fn spawn(name: &'static str, cmd: &mut Command) -> Self {
        let child = cmd
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("{name} does not start: {e}"));
        Self { child, name }
    }

    fn signal_group(&self, signal: &str) -> bool {
        Command::new("kill")
            .args([signal, "--", &format!("-{}", self.child.id())])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Stops the group and reaps the leader; whether it exited of its own (0).
    fn stop(&mut self) -> bool {
        if let Ok(Some(status)) = self.child.try_wait() {
            self.signal_group("-KILL"); // what it left behind
            return status.success();
        }
        self.signal_group("-TERM");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Helpers a browser leaves behind share the group: none survives.
                self.signal_group("-KILL");
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = writeln!(
            std::io::stderr(),
            "{} ignored SIGTERM for 10 s: killed",
            self.name
        );
        self.signal_group("-KILL");
        let _ = self.child.wait();
        false
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.stop();
        } else {
            self.signal_group("-KILL");
        }
    }
}

/// The test's own schema and queue prefix, both gone when it is dropped.
struct Scene {
    base: String,
    url: String,
    amqp: String,
    schema: String,
    prefix: String,
}

impl Scene {
    fn new() -> Option<Self> {
        let base = inbox_test_support::postgres_url()?;
        let amqp = inbox_test_support::amqp::amqp_url()?;
        let schema = inbox_test_support::unique_name("console");
        PgConnection::establish(&base)
            .unwrap()
            .batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .unwrap();
        let url = inbox_test_support::search_path_url(&base, &schema);
        let prefix = format!("{schema}.");
        Some(Self {
            base,
            url,
            amqp,
            schema,
            prefix,
        })
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(inbox_test_support::example_path("order_service"));
        cmd.args(args)
            .env("DATABASE_URL", &self.url)
            .env("AMQP_URL", &self.amqp)
            .env("INBOX_PREFIX", &self.prefix)
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        let out = self.command(args).output().unwrap();
        assert!(
            out.status.success(),
            "order_service {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Ada's total in `customer_totals`, if she has one.
    fn total(&self) -> Option<i64> {
        let mut conn = PgConnection::establish(&self.url).unwrap();
        // The service creates the table when it starts.
        diesel::sql_query(
            "SELECT cents FROM customer_totals WHERE customer = 'ada' AND to_regclass('customer_totals') IS NOT NULL",
        )
        .load::<Cents>(&mut conn)
        .ok()
        .and_then(|rows| rows.first().map(|r| r.cents))
    }

    fn wait_for_total(&self, cents: i64) {
        let deadline = Instant::now() + PATIENCE;
        while self.total() != Some(cents) {
            assert!(
                Instant::now() < deadline,
                "ada's total after {PATIENCE:?}: {:?}, expected {cents}",
                self.total()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Scene {
    fn drop(&mut self) {
        if let Ok(mut conn) = PgConnection::establish(&self.base) {
            let _ = conn.batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
        let topology = Topology::new("shop")
            .and_then(|t| t.prefix(self.prefix.clone()))
            .map(|t| t.group(ConsumerGroup::new(GROUP).unwrap(), ["order.placed"]));
        if let (Ok(topology), Ok(rt)) = (topology, tokio::runtime::Runtime::new()) {
            let amqp = self.amqp.clone();
            rt.block_on(async move {
                if let Ok(conn) =
                    lapin::Connection::connect(&amqp, lapin::ConnectionProperties::default()).await
                {
                    let _ = topology.delete(&conn).await;
                    let _ = conn.close(200, "test over".into()).await;
                }
            });
        }
    }
}

/// Chromium and chromedriver, found on `PATH` (`CHROMIUM` and `CHROMEDRIVER` name
/// others).
fn browser() -> Option<(PathBuf, PathBuf)> {
    let find = |var: &str, names: &[&str]| -> Option<PathBuf> {
        if let Ok(p) = std::env::var(var) {
            return Some(PathBuf::from(p)).filter(|p| p.is_file());
        }
        let path = std::env::var_os("PATH")?;
        std::env::split_paths(&path)
            .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
            .find(|p| p.is_file())
    };
    let chromium = find(
        "CHROMIUM",
        &["chromium", "chromium-browser", "google-chrome"],
    );
    let driver = find("CHROMEDRIVER", &["chromedriver"]);
    match (chromium, driver) {
        (Some(c), Some(d)) => Some((c, d)),
        (c, d) => {
            let missing: Vec<&str> = [("chromium", c.is_none()), ("chromedriver", d.is_none())]
                .into_iter()
                .filter_map(|(n, m)| m.then_some(n))
                .collect();
            inbox_test_support::services::machine_lacks(
                "Chromium and chromedriver",
                &format!(
                    "{} not found on PATH (or where CHROMIUM / CHROMEDRIVER say)",
                    missing.join(" and ")
                ),
                "install the Debian packages chromium and chromium-driver (.ci/services does)",
            );
            None
        }
    }
}

/// A process whose command line names `dir` (the test's browser profile), if any.
fn process_with(dir: &Path) -> Option<String> {
    let needle = dir.to_string_lossy().into_owned();
    std::fs::read_dir("/proc").ok()?.find_map(|entry| {
        let entry = entry.ok()?;
        let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline)
            .contains(&needle)
            .then(|| entry.file_name().to_string_lossy().into_owned())
    })
}

/// A port nobody listens on now (chromedriver takes a port number, not 0).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A token nobody guesses: 16 bytes of the kernel's randomness, in hex.
fn random_token() -> String {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `GET path` of the console as a script does (bearer token, JSON), over HTTP/1.0.
fn get_json(addr: &str, path: &str, token: &str) -> serde_json::Value {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: application/json\r\nAuthorization: Bearer {token}\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    assert!(head.contains(" 200 "), "GET {path}: {head}\n{body}");
    serde_json::from_str(body).unwrap()
}

/// Where the screenshots of this run go.
fn screenshot_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

struct Browser {
    client: Client,
    console: String,
    shots: PathBuf,
}

impl Browser {
    async fn goto(&self, path: &str) {
        self.client
            .goto(&format!("{}{path}", self.console))
            .await
            .unwrap();
    }

    async fn path(&self) -> String {
        let url = self.client.current_url().await.unwrap();
        match url.query() {
            Some(q) => format!("{}?{q}", url.path()),
            None => url.path().to_owned(),
        }
    }

    async fn text(&self, css: &str) -> String {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
            .text()
            .await
            .unwrap()
    }

    /// Waits until the page's title (`h1`) is `title`: a click on a link or a submit
    /// button returns before the next page has necessarily replaced this one.
    async fn arrive(&self, title: impl AsRef<str>) {
        let title = title.as_ref();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let seen = match self.client.find(Locator::Css("h1")).await {
                Ok(h1) => h1.text().await.ok(),
                Err(_) => None,
            };
            if seen.as_deref() == Some(title) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "expected the page {title:?}, found {seen:?} at {}",
                self.path().await
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no {css} to click: {e}"))
            .click()
            .await
            .unwrap();
    }

    async fn nav(&self, link: &str) {
        self.client
            .find(Locator::XPath(&format!("//header/a[text()='{link}']")))
            .await
            .unwrap_or_else(|e| panic!("no header link {link:?}: {e}"))
            .click()
            .await
            .unwrap();
    }

    async fn shot(&self, name: &str) {
        let png = self.client.screenshot().await.unwrap();
        std::fs::write(self.shots.join(format!("{name}.png")), png).unwrap();
    }
}

#[test]
fn an_on_call_engineer_replays_a_dead_letter_from_the_console_once() {
    let Some((chromium, chromedriver)) = browser() else {
        return;
    };
    let Some(scene) = Scene::new() else { return };
    let token = random_token();

    // The service, with its console under /ops on a port of its own choosing.
    let mut service = Proc::spawn(
        "order_service",
        scene
            .command(&["run"])
            .env("INBOX_WEB_ADDR", "127.0.0.1:0")
            .env("INBOX_WEB_TOKEN", &token)
            .env_remove("INBOX_METRICS_ADDR")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped()),
    );
    // Its log, read as it comes (a full pipe would stall the service).
    let stderr = BufReader::new(service.child.stderr.take().unwrap());
    let log = std::thread::spawn(move || stderr.lines().map_while(Result::ok).collect::<Vec<_>>());
    let mut stdout = BufReader::new(service.child.stdout.take().unwrap());
    let mut line = String::new();
    stdout.read_line(&mut line).unwrap();
    let console = line
        .trim()
        .strip_prefix("order_service: console on ")
        .unwrap_or_else(|| panic!("the first line names the console: {line:?}"))
        .to_owned();
    std::thread::spawn(move || stdout.lines().map_while(Result::ok).count());
    let addr = console
        .strip_prefix("http://")
        .and_then(|a| a.strip_suffix("/ops"))
        .unwrap()
        .to_owned();

    // Ada may owe 1000 cents: her first order (600) passes, her second (700) would
    // take her to 1300 and is dead-lettered for good. One at a time, so that it is
    // the second order the limit refuses.
    scene.run(&["limit", "ada", "1000"]);
    scene.run(&["place", "ada", "600"]);
    scene.wait_for_total(600);
    scene.run(&["place", "ada", "700"]);
    let deadline = Instant::now() + PATIENCE;
    let letter = loop {
        let letters = get_json(&addr, "/ops/letters", &token);
        if let Some(l) = letters["dead_letters"].as_array().and_then(|a| a.first()) {
            break l.clone();
        }
        assert!(Instant::now() < deadline, "no dead letter: {letters}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let id = letter["id"].as_i64().unwrap();
    let key = letter["message_key"].as_str().unwrap().to_owned();
    assert_eq!(letter["reason"], "permanent", "{letter}");
    assert_eq!(scene.total(), Some(600));

    // chromedriver, and the browser it starts.
    let port = free_port();
    let mut driver = Proc::spawn(
        "chromedriver",
        Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let profile = tempfile::tempdir().unwrap();
    let shots = screenshot_dir();
    let _ = writeln!(
        std::io::stderr(),
        "console screenshots: {}",
        shots.display()
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    let browsed = rt.block_on(async {
        let client = connect(port, &chromium, profile.path()).await;
        let browser = Browser {
            client,
            console: console.clone(),
            shots: shots.clone(),
        };
        browse(&browser, &scene, id, &key, &token).await;
        browser.client.close().await
    });
    drop(rt);
    browsed.unwrap();
    // chromedriver ends on SIGTERM with its signal's status; what matters is that its
    // browser went with it (Chromium does not exit with its driver, hence the group).
    driver.stop();
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Some(pid) = process_with(profile.path()) {
        assert!(
            Instant::now() < deadline,
            "a browser process of the test outlives it: {pid}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(service.stop(), "the service stops cleanly on SIGTERM");
    let log = log.join().unwrap();
    assert!(
        log.iter()
            .any(|l| l.contains("console action") && l.contains("replay")),
        "the replay is in the audit log: {log:#?}"
    );
}

/// A WebDriver session of headless Chromium, retried while chromedriver starts.
async fn connect(port: u16, chromium: &Path, profile: &Path) -> Client {
    let args = [
        "--headless",
        "--no-sandbox", // as root, Chromium refuses to start sandboxed
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        &format!("--window-size={},{}", WINDOW.0, WINDOW.1),
        &format!("--user-data-dir={}", profile.display()),
    ];
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({ "binary": chromium, "args": args }),
    );
    let mut builder = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
    builder.capabilities(caps);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match builder.connect(&format!("http://127.0.0.1:{port}")).await {
            Ok(client) => {
                client.set_window_size(WINDOW.0, WINDOW.1).await.unwrap();
                return client;
            }
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no WebDriver session from chromedriver on port {port}: {e}"),
        }
    }
}

/// The engineer's path through the console.
async fn browse(b: &Browser, scene: &Scene, id: i64, key: &str, token: &str) {
    log_in(b, token).await;
    find_the_letter(b, id).await;
    replay_once(b, scene, id).await;
    replay_again(b, scene, id).await;
    look_around(b, id, key).await;
}

/// The login form, then the overview.
async fn log_in(b: &Browser, token: &str) {
    // Not logged in: every page sends the browser to the login form.
    b.goto("").await;
    assert_eq!(b.path().await, "/ops/login");
    b.arrive("Log in").await;
    b.shot("login").await;
    b.client
        .find(Locator::Id("token"))
        .await
        .unwrap()
        .send_keys(token)
        .await
        .unwrap();
    b.click("#login").await;
    b.arrive("Overview").await;
    assert_eq!(b.path().await, "/ops", "the login lands on the overview");
    assert_eq!(
        b.text("#letters-day").await,
        "1",
        "dead-lettered in the last day"
    );
    assert!(b.text("#groups").await.contains(GROUP));
    b.shot("overview").await;
}

/// From the failure groups to the letter: its payload and its error.
async fn find_the_letter(b: &Browser, id: i64) {
    // The failure group: its row shows the error's signature.
    b.nav("Failure groups").await;
    b.arrive("Failure groups").await;
    let rows = b
        .client
        .find_all(Locator::Css("#failure-groups tr"))
        .await
        .unwrap();
    let mut row = None;
    for r in rows {
        if r.text().await.unwrap().contains("past the credit limit") {
            row = Some(r);
        }
    }
    let row = row.unwrap_or_else(|| panic!("no failure group names the credit limit"));
    let row_text = row.text().await.unwrap();
    assert!(
        row_text.contains("order <n> would take ada past the credit limit of <n> cents"),
        "the row shows the error's signature: {row_text}"
    );
    assert!(row_text.contains("permanent"), "{row_text}");
    assert!(row_text.contains("order.placed"), "{row_text}");
    b.shot("failure-groups").await;
    row.find(Locator::Css("a.fg"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();

    // Its letters, and the letter.
    b.arrive("Dead letters").await;
    let path = b.path().await;
    assert!(path.starts_with("/ops/letters?failure_group="), "{path}");
    b.shot("letters").await;
    b.client
        .find(Locator::XPath(&format!(
            "//table[@id='letters']//a[@class='letter' and text()='{id}']"
        )))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    b.arrive(format!("Dead letter {id}")).await;
    assert_eq!(b.path().await, format!("/ops/letters/{id}"));
    let payload = b.text("#payload").await;
    assert!(
        payload.contains(r#""customer": "ada""#) && payload.contains(r#""cents": 700"#),
        "the payload, pretty: {payload}"
    );
    let error = b.text("#last-error").await;
    assert!(
        error.contains("would take ada past the credit limit of 1000 cents"),
        "{error}"
    );
    assert_eq!(b.text("#status").await, "pending");
    b.shot("letter").await;
}

/// The cause fixed, the letter replayed from its page and applied once.
async fn replay_once(b: &Browser, scene: &Scene, id: i64) {
    // The cause fixed, the letter replayed from the page.
    scene.run(&["limit", "ada", "100000"]);
    b.click("#replay").await;
    b.arrive("Confirm").await;
    let what = b.text("#confirm-what").await;
    assert!(what.contains(&format!("Replay dead letter {id}")), "{what}");
    b.shot("confirm").await;
    b.click("#confirm").await;
    b.arrive("Result").await;
    let notice = b.text("#notice").await;
    assert!(
        notice.contains(&format!("Dead letter {id} replayed")),
        "{notice}"
    );
    b.shot("result").await;

    // Applied, exactly once.
    scene.wait_for_total(1300);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(scene.total(), Some(1300), "the replay counts once");
}

/// A second replay from the page: refused, nothing counted.
async fn replay_again(b: &Browser, scene: &Scene, id: i64) {
    // A second replay from the page: the claim is done, nothing is enqueued.
    b.goto(&format!("/letters/{id}")).await;
    assert_eq!(b.text("#status").await, "replayed");
    if b.client.find(Locator::Id("replay")).await.is_ok() {
        b.click("#replay").await;
        b.arrive("Confirm").await;
        b.click("#confirm").await;
    } else {
        // No button once replayed: the confirmation page's form, submitted again.
        b.client.back().await.unwrap();
        b.client.back().await.unwrap();
        b.arrive("Confirm").await;
        b.click("#confirm").await;
    }
    b.arrive("Result").await;
    let notice = b.text("#notice").await;
    assert!(
        notice.starts_with("Refused") && notice.contains("not dead"),
        "the second replay is refused: {notice}"
    );
    b.shot("refused").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        scene.total(),
        Some(1300),
        "the refused replay counts nothing"
    );
}

/// The other pages: the claim of the order's key, halted groups, outbox, rebuilds.
async fn look_around(b: &Browser, id: i64, key: &str) {
    // The other pages, as the engineer looks around.
    b.goto(&format!("/letters/{id}")).await;
    b.client
        .find(Locator::LinkText("claims of this key"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    b.arrive("Claims").await;
    let claims = b.text("#claims").await;
    assert!(
        claims.contains(GROUP) && claims.contains("done"),
        "the order's claim is done: {claims}"
    );
    assert_eq!(b.path().await, format!("/ops/claims?key={key}"));
    b.shot("claims").await;
    b.nav("Halted groups").await;
    b.arrive("Halted consumer groups").await;
    assert!(b.text("main").await.contains("No group is halted."));
    b.shot("halts").await;
    b.nav("Outbox").await;
    b.arrive("Outbox").await;
    b.shot("outbox").await;
    b.nav("Rebuilds").await;
    b.arrive("Rebuilds and audits").await;
    b.shot("rebuilds").await;
}

//! The metered API as a client sees it: the service process on a schema of its own,
//! real PostgreSQL and Redis, requests over HTTP.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod metered_support;

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Text};
use inbox_core::idempotency::RequestFields;
use metered_support::{run_to_exit, services, HttpResponse, Schema, Service, ADMIN_TOKEN};
use sha2::{Digest, Sha256};

/// A 27-character text: two chunks.
const TEXT: &str = "hello world, this is a test";

fn is_done(r: &HttpResponse) -> bool {
    r.status == 200 && r.lines().last().is_some_and(|l| l["type"] == "done")
}

/// Balance, ledger sum and ledger rows of an account.
fn money(svc: &Service, account: i64) -> (i64, i64, i64, i64) {
    let a = svc.json(&format!("/admin/accounts/{account}"));
    (
        a["balance"].as_i64().unwrap(),
        a["ledger_sum"].as_i64().unwrap(),
        a["ledger_entries"].as_i64().unwrap(),
        a["refunds"].as_i64().unwrap(),
    )
}

#[test]
fn fifty_concurrent_requests_with_one_key_debit_once() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[("METERED_CHUNK_DELAY_MS", "30")]);
    let (account, key) = svc.account(10_000, 10_000);
    let answers: Vec<HttpResponse> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|_| s.spawn(|| svc.speech(&key, Some("burst-1"), TEXT)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let executed: Vec<&HttpResponse> = answers
        .iter()
        .filter(|r| r.status == 200 && r.header("idempotent-replayed").is_none())
        .collect();
    assert_eq!(executed.len(), 1, "exactly one request executes");
    let body = executed[0].body.clone();
    assert!(is_done(executed[0]), "{}", executed[0].text());
    for r in &answers {
        match r.status {
            200 => assert_eq!(r.body, body, "a replay is the saved response"),
            409 => assert_eq!(r.code(), "idempotency_in_flight", "{}", r.text()),
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    // One debit: the grant and one debit row.
    let (balance, sum, entries, _) = money(&svc, account);
    assert_eq!((balance, sum, entries), (10_000 - 27, 10_000 - 27, 2));
    // A replay after success: the saved body, 200, no charge.
    let replay = svc.speech(&key, Some("burst-1"), TEXT);
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, body);
    assert_eq!(money(&svc, account).0, 10_000 - 27);
}

// Needs the `[fail-after:N]` marker: `cargo test -p inbox-examples --features test-hooks`.
#[cfg(feature = "test-hooks")]
#[test]
fn replays_with_other_content_or_another_key_mismatch_and_refunded_ones_conflict() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let (account, key) = svc.account(1_000, 1_000);
    let other_key = svc.key(account, 1_000);
    assert!(is_done(&svc.speech(&key, Some("k-1"), TEXT)));
    let other = svc.speech(&key, Some("k-1"), "hello world, this is a tesT");
    assert_eq!(
        (other.status, other.code()),
        (422, "idempotency_mismatch".into())
    );
    // The same request through another API key of the same account.
    let same = svc.speech(&other_key, Some("k-1"), TEXT);
    assert_eq!(
        (same.status, same.code()),
        (422, "idempotency_mismatch".into())
    );

    let failing = "[fail-after:1] this one fails after its first chunk";
    let cut = svc.speech(&key, Some("k-2"), failing);
    assert_eq!(cut.status, 200);
    assert_eq!(cut.lines().last().unwrap()["type"], "error");
    let again = svc.speech(&key, Some("k-2"), failing);
    assert_eq!(
        (again.status, again.code()),
        (409, "idempotency_refunded".into())
    );
    let (balance, sum, _, refunds) = money(&svc, account);
    assert_eq!((balance, sum, refunds), (1_000 - 27, 1_000 - 27, 1));
}

#[cfg(feature = "test-hooks")]
#[test]
fn fail_after_two_chunks_ends_with_an_error_line_and_a_refund() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let (account, key) = svc.account(500, 500);
    let text = "please say this [fail-after:2] and then some more text to read";
    let r = svc.speech(&key, None, text);
    assert_eq!(r.status, 200);
    let lines = r.lines();
    assert_eq!(lines.len(), 3, "{}", r.text());
    assert!(lines[..2].iter().all(|l| l["type"] == "chunk"));
    let last = &lines[2];
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["code"], "upstream_failed");
    assert_eq!(last["refunded"], true);
    let usage = last["error"]["usage_id"].as_i64().unwrap();
    assert_eq!(r.header("x-usage-id"), Some(usage.to_string().as_str()));
    let u = svc.json(&format!("/admin/usage/{usage}"));
    assert_eq!(
        (u["status"].as_str(), u["refunds"].as_i64()),
        (Some("refunded"), Some(1))
    );
    let (balance, sum, entries, refunds) = money(&svc, account);
    assert_eq!((balance, sum, entries, refunds), (500, 500, 3, 1));
    let b = svc.balance(&key);
    assert_eq!(
        (b["balance"].as_i64(), b["spent"].as_i64()),
        (Some(500), Some(0))
    );
}

#[test]
fn two_hundred_concurrent_requests_never_overdraw_nor_pass_a_cap() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[("METERED_POOL_SIZE", "8")]);
    // The capped key reaches its cap after 10 of its 100 requests, long before the
    // account's 100 requests' worth is spent, so both limits bind in every run,
    // whatever the order the requests are served in (with a cap of 300, the open
    // key's requests could spend the balance before the capped key reached it).
    let (account, capped) = svc.account(1_000, 100);
    let open = svc.key(account, 1_000_000);
    let text = "ten chars!"; // cost 10
    let started = std::time::Instant::now();
    let answers: Vec<(bool, HttpResponse)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..200)
            .map(|i| {
                let (capped, open) = (&capped, &open);
                let svc = &svc;
                s.spawn(move || {
                    let on_cap = i % 2 == 0;
                    let key = if on_cap { capped } else { open };
                    (on_cap, svc.speech(key, None, text))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    eprintln!(
        "200 concurrent requests on one account answered in {} ms",
        started.elapsed().as_millis()
    );
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    let mut charged_on_cap = 0;
    let mut charged = 0;
    for (on_cap, r) in &answers {
        match r.status {
            200 => {
                assert!(is_done(r), "{}", r.text());
                charged += 10;
                if *on_cap {
                    charged_on_cap += 10;
                }
            }
            402 => *codes.entry(r.code()).or_default() += 1,
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    let (balance, sum, _, _) = money(&svc, account);
    assert!(balance >= 0);
    assert_eq!(balance, sum, "the balance equals the ledger sum");
    assert_eq!(balance, 1_000 - charged);
    assert_eq!(balance, 0, "the balance was the binding limit: {codes:?}");
    let spent = svc.balance(&capped)["spent"].as_i64().unwrap();
    assert!(spent <= 100, "the key stayed within its cap: {spent}");
    assert_eq!(spent, charged_on_cap);
    assert!(codes.contains_key("insufficient_credits"), "{codes:?}");
    assert!(codes.contains_key("spend_cap_reached"), "{codes:?}");
}

#[test]
fn the_fingerprint_needs_the_raw_key_which_no_column_holds() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let (account, key) = svc.account(1_000, 1_000);
    assert!(is_done(&svc.speech(&key, Some("fp-1"), TEXT)));

    #[derive(QueryableByName)]
    struct Stored {
        #[diesel(sql_type = Binary)]
        fingerprint: Vec<u8>,
        #[diesel(sql_type = Binary)]
        key_digest: Vec<u8>,
    }
    #[derive(QueryableByName)]
    struct Column {
        #[diesel(sql_type = Text)]
        table_name: String,
        #[diesel(sql_type = Text)]
        column_name: String,
    }
    #[derive(QueryableByName)]
    struct Found {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let mut conn = schema.connect();
    let stored: Stored = diesel::sql_query(
        "SELECT i.fingerprint, k.key_digest FROM idempotency_keys i, api_keys k \
         WHERE i.caller = k.account_id::text AND i.idempotency_key = 'fp-1'",
    )
    .get_result(&mut conn)
    .unwrap();
    let fields = RequestFields::new()
        .field("text", TEXT)
        .unwrap()
        .field("model", "standard")
        .unwrap()
        .field("amount", "27")
        .unwrap();
    // With the raw key, the client's side recomputes it.
    assert_eq!(
        fields.fingerprint(key.as_bytes()).as_bytes().as_slice(),
        stored.fingerprint
    );
    // What the database holds of the key is its SHA-256, which is not the HMAC key.
    assert_eq!(stored.key_digest, Sha256::digest(key.as_bytes()).to_vec());
    assert_ne!(
        fields.fingerprint(&stored.key_digest).as_bytes().as_slice(),
        stored.fingerprint
    );
    // No column anywhere in the schema holds the raw key or the text sent.
    let columns: Vec<Column> = diesel::sql_query(
        "SELECT table_name::text AS table_name, column_name::text AS column_name \
         FROM information_schema.columns WHERE table_schema = current_schema() \
           AND data_type IN ('text', 'bytea', 'character varying')",
    )
    .load(&mut conn)
    .unwrap();
    for c in &columns {
        let q = format!(
            "SELECT count(*) AS n FROM \"{}\" WHERE position($1 in \"{}\"::text) > 0 \
                OR position($2 in \"{}\"::text) > 0",
            c.table_name, c.column_name, c.column_name
        );
        let found: Found = diesel::sql_query(q)
            .bind::<Text, _>(&key)
            .bind::<Text, _>(TEXT)
            .get_result(&mut conn)
            .unwrap();
        assert_eq!(
            found.n, 0,
            "{}.{} holds the key or the text",
            c.table_name, c.column_name
        );
    }
    let _ = account;
}

#[test]
fn the_contract_s_errors() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[("METERED_RATE_LIMIT", "2"), ("METERED_CHUNK_DELAY_MS", "5")],
    );
    let (account, key) = svc.account(30, 20);
    let none = svc.post("/v1/speech", &[], "{\"text\":\"x\"}");
    assert_eq!((none.status, none.code()), (401, "unauthorized".into()));
    let wrong = svc.speech("mk_not_a_key", None, "x");
    assert_eq!((wrong.status, wrong.code()), (401, "unauthorized".into()));
    let auth = format!("Bearer {key}");
    let bad = svc.post("/v1/speech", &[("Authorization", &auth)], "{\"txt\":1}");
    assert_eq!((bad.status, bad.code()), (400, "invalid_request".into()));
    let long_key = "k".repeat(256);
    let r = svc.speech(&key, Some(&long_key), "x");
    assert_eq!(
        (r.status, r.code()),
        (400, "invalid_idempotency_key".into())
    );
    let over_cap = svc.speech(&key, None, &"x".repeat(21));
    assert_eq!(
        (over_cap.status, over_cap.code()),
        (402, "spend_cap_reached".into())
    );
    let key2 = svc.key(account, 100);
    let over_balance = svc.speech(&key2, None, &"x".repeat(31));
    assert_eq!(
        (over_balance.status, over_balance.code()),
        (402, "insufficient_credits".into())
    );
    let missing = svc.post(
        "/admin/keys",
        &[],
        "{\"account_id\": 999999, \"spend_cap\": 1}",
    );
    assert_eq!(
        (missing.status, missing.code()),
        (404, "account_not_found".into())
    );
    let negative = svc.post("/admin/accounts", &[], "{\"balance\": -1}");
    assert_eq!(negative.status, 400);
    // A refused debit gives its idempotency key back: the key works once the request
    // fits.
    let key3 = svc.key(account, 20);
    let refused = svc.speech(&key3, Some("retry-me"), &"x".repeat(21));
    assert_eq!(
        (refused.status, refused.code()),
        (402, "spend_cap_reached".into())
    );
    assert!(is_done(&svc.speech(&key3, Some("retry-me"), "xxxxx")));
    // The rate limit: two requests per second on a key, then 429.
    let statuses: Vec<u16> = (0..6)
        .map(|_| svc.speech(&key2, None, "y").status)
        .collect();
    assert!(statuses.contains(&429), "{statuses:?}");
    let limited = (0..6)
        .map(|_| svc.speech(&key2, None, "y"))
        .find(|r| r.status == 429)
        .unwrap();
    assert_eq!(limited.code(), "rate_limited");
    assert_eq!(money(&svc, account).0, money(&svc, account).1);
}

#[test]
fn no_free_concurrency_slot_is_503() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[
            ("METERED_MAX_CONCURRENCY", "1"),
            ("METERED_CHUNK_DELAY_MS", "200"),
        ],
    );
    let (_, key) = svc.account(1_000, 1_000);
    let auth = format!("Bearer {key}");
    let body = serde_json::json!({ "text": "x".repeat(64) }).to_string();
    let mut first = metered_support::open(
        &svc.addr,
        "POST",
        "/v1/speech",
        &[("Authorization", &auth)],
        Some(&body),
    );
    assert_eq!(first.status, 200);
    assert_eq!(first.next_line().unwrap()["type"], "chunk");
    let second = svc.speech(&key, None, "y");
    assert_eq!(
        (second.status, second.code()),
        (503, "concurrency_limited".into())
    );
    while first.next_line().is_some() {}
}

/// A Redis stand-in that accepts connections and never answers, or a closed port:
/// requests still succeed, the fallback counter shows the cache was bypassed, and
/// the database still guards the money.
#[test]
fn a_stalled_or_closed_redis_is_bypassed_and_money_is_still_guarded() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let target = redis::Client::open(redis.as_str())
        .unwrap()
        .get_connection_info()
        .addr()
        .to_string();
    let proxy = rt.block_on(inbox_test_support::amqp::Proxy::start(target));
    proxy.stall(true);
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }; // dropped: nothing listens there now
    for (name, url) in [
        ("healthy", redis.clone()),
        ("stalled", format!("redis://{}", proxy.addr)),
        ("closed", format!("redis://{closed}")),
    ] {
        let schema = Schema::new(&pg);
        // No background probe: the request path's budget alone keeps requests from
        // hanging on a server that never answers.
        let svc = Service::start(&schema, &url, &[("METERED_REDIS_PROBE_MS", "0")]);
        let (account, key) = svc.account(100, 100);
        let started = std::time::Instant::now();
        for i in 0..3 {
            let r = svc.speech(&key, Some(&format!("{name}-{i}")), TEXT);
            assert!(is_done(&r), "{name}: {}", r.text());
        }
        // A printed figure, not an assertion.
        eprintln!(
            "redis {name}: 3 requests in {} ms",
            started.elapsed().as_millis()
        );
        let stats = svc.stats();
        if name == "healthy" {
            assert_eq!(stats["redis_fallbacks"], 0, "{stats}");
            assert!(stats["key_cache_hits"].as_u64().unwrap() >= 2, "{stats}");
        } else {
            assert!(
                stats["redis_fallbacks"].as_u64().unwrap() >= 9,
                "{name}: {stats}"
            );
            assert!(
                stats["key_cache_fallbacks"].as_u64().unwrap() >= 3,
                "{name}: {stats}"
            );
            assert!(
                stats["rate_limit_fallbacks"].as_u64().unwrap() >= 3,
                "{name}: {stats}"
            );
            assert!(
                stats["slot_fallbacks"].as_u64().unwrap() >= 3,
                "{name}: {stats}"
            );
        }
        // The same counts on `GET /metrics`, each fallback under its kind. Scraped
        // after the stats: no request of a key runs in between (admin requests use
        // the admin token, not the key cache).
        let text = scrape(&svc);
        assert_advisory_counts_match(&text, &stats);
        if name != "healthy" {
            for kind in ["rate_limit", "slot", "key_cache"] {
                let series = format!("metered_api_redis_fallbacks_total{{kind=\"{kind}\"}}");
                assert!(sample(&text, &series) >= 3, "{name}: {series} in:\n{text}");
            }
        }
        // 19 credits left: the debit still refuses what the balance does not cover.
        let over = svc.speech(&key, None, TEXT);
        assert_eq!(
            (over.status, over.code()),
            (402, "insufficient_credits".into()),
            "{name}"
        );
        let (balance, sum, _, _) = money(&svc, account);
        assert_eq!((balance, sum), (100 - 81, 100 - 81), "{name}");
        let health = svc.get("/v1/health", &[]);
        let expected = if name == "healthy" {
            "ok"
        } else {
            "unavailable"
        };
        assert_eq!(health.json()["redis"], expected, "{name}");
    }
    drop(proxy);
}

/// A Redis connection that falls silent without closing (a partition: no reply, no
/// error) is one the `redis` crate's manager keeps; the health probe declares it dead
/// when its `PING` gets no answer, and the requests after it reach Redis again on a
/// new connection (no fallback any more) instead of failing open for good.
#[test]
fn a_silent_redis_connection_is_replaced_after_the_probe_fails() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let target = redis::Client::open(redis.as_str())
        .unwrap()
        .get_connection_info()
        .addr()
        .to_string();
    let proxy = rt.block_on(inbox_test_support::amqp::Proxy::start(target));
    let schema = Schema::new(&pg);
    let url = format!("redis://{}", proxy.addr);
    let svc = Service::start(&schema, &url, &[("METERED_REDIS_PROBE_MS", "200")]);
    let (_, key) = svc.account(100_000, 100_000);
    let fallbacks = |svc: &Service| svc.stats()["redis_fallbacks"].as_u64().unwrap();
    assert!(is_done(&svc.speech(&key, None, TEXT)));
    assert_eq!(fallbacks(&svc), 0);
    // The open connection goes silent; new connections through the proxy still work.
    proxy.freeze();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut recovered = false;
    while std::time::Instant::now() < deadline {
        let before = fallbacks(&svc);
        let r = svc.speech(&key, None, TEXT);
        assert!(is_done(&r), "{}", r.text());
        if fallbacks(&svc) == before {
            recovered = true;
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        recovered,
        "still failing open 30 s after the connection fell silent: {}",
        svc.stats()
    );
    assert_eq!(svc.get("/v1/health", &[]).json()["redis"], "ok");
    drop(svc);
    drop(proxy);
}

/// A Redis ACL user of this test's own, deleted when the test ends (passed or not).
struct AclUser {
    admin: redis::Client,
    name: String,
}

impl AclUser {
    /// Creates `name` with `password`, allowed every command on the service's keys.
    fn create(redis_url: &str, name: &str, password: &str) -> Self {
        let admin = redis::Client::open(redis_url).unwrap();
        let mut conn = admin.get_connection().unwrap();
        redis::cmd("ACL")
            .arg("SETUSER")
            .arg(name)
            .arg("reset")
            .arg("on")
            .arg(format!(">{password}"))
            .arg("~metered:*")
            .arg("+@all")
            .exec(&mut conn)
            .unwrap();
        Self {
            admin,
            name: name.to_owned(),
        }
    }

    /// Whether a client is connected as this user now.
    fn connected(&self) -> bool {
        let mut conn = self.admin.get_connection().unwrap();
        let clients: String = redis::cmd("CLIENT").arg("LIST").query(&mut conn).unwrap();
        clients
            .split_whitespace()
            .any(|field| field == format!("user={}", self.name))
    }
}

impl Drop for AclUser {
    fn drop(&mut self) {
        // Also disconnects the clients authenticated as the user.
        if let Ok(mut conn) = self.admin.get_connection() {
            let _ = redis::cmd("ACL")
                .arg("DELUSER")
                .arg(&self.name)
                .exec(&mut conn);
        }
    }
}

/// `REDIS_URL` with an ACL user name (percent-encoded in part) and a password holding
/// `:`, `%`, `@` and `/` (the last three percent-encoded): the service authenticates
/// as that user, Redis answers every command (no fallback, cache hits). The
/// hand-written client dropped the user name and cut the password at its last `:`.
#[test]
fn an_acl_user_and_a_password_with_colons_and_escapes_reach_redis_whole() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let password = "c0:l0n%25@at/sl:";
    let user = AclUser::create(
        &redis,
        &inbox_test_support::unique_name("metered-acl"),
        password,
    );
    let addr = redis::Client::open(redis.as_str())
        .unwrap()
        .get_connection_info()
        .addr()
        .to_string();
    // `-` as `%2D` in the user name; `%`, `@` and `/` encoded in the password.
    let url = format!(
        "redis://{}:c0:l0n%2525%40at%2Fsl:@{addr}",
        user.name.replacen('-', "%2D", 1)
    );
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &url, &[("METERED_REDIS_PROBE_MS", "0")]);
    let (_, key) = svc.account(100, 100);
    for i in 0..3 {
        let r = svc.speech(&key, Some(&format!("acl-{i}")), TEXT);
        assert!(is_done(&r), "{}", r.text());
    }
    let stats = svc.stats();
    assert_eq!(stats["redis_fallbacks"], 0, "{stats}");
    assert!(stats["key_cache_hits"].as_u64().unwrap() >= 2, "{stats}");
    assert!(user.connected(), "no client connected as {}", user.name);
    assert_eq!(svc.get("/v1/health", &[]).json()["redis"], "ok");
}

/// SIGKILL while a stream runs (after the debit, before any settlement): a new
/// instance settles it after the deadline, exactly once, even with two instances.
fn crash_between_debit_and_refund(amqp: Option<&str>) {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let prefix = format!("{}.", schema.name);
    // The deadline leaves two instances time to start (an AMQP handshake each) on a
    // loaded machine before the settlement is due: the replay below must find the
    // request still in flight.
    let mut env = vec![
        ("METERED_DEADLINE_MS", "4000"),
        ("METERED_SETTLE_MARGIN_MS", "300"),
        ("METERED_CHUNK_DELAY_MS", "100"),
    ];
    if let Some(url) = amqp {
        env.push(("AMQP_URL", url));
        env.push(("METERED_AMQP_PREFIX", prefix.as_str()));
        env.push(("METERED_AMQP_QUEUE_EXPIRES_MS", "60000"));
    }
    let first = Service::start(&schema, &redis, &env);
    let (account, key) = first.account(1_000, 1_000);
    let text = "a long text that streams for many chunks ".repeat(8);
    let cost = text.chars().count() as i64;
    let auth = format!("Bearer {key}");
    let body = serde_json::json!({ "text": text }).to_string();
    let mut stream = metered_support::open(
        &first.addr,
        "POST",
        "/v1/speech",
        &[("Authorization", &auth), ("Idempotency-Key", "crash-1")],
        Some(&body),
    );
    assert_eq!(stream.status, 200);
    let usage: i64 = stream
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-usage-id"))
        .unwrap()
        .1
        .parse()
        .unwrap();
    assert_eq!(stream.next_line().unwrap()["type"], "chunk");
    first.kill9();
    drop(stream);

    // Dead in between: debited, the money gone, nothing settled it.
    #[derive(QueryableByName)]
    struct Status {
        #[diesel(sql_type = Text)]
        status: String,
    }
    let mut conn = schema.connect();
    let status: Status = diesel::sql_query("SELECT status FROM usage_events WHERE id = $1")
        .bind::<BigInt, _>(usage)
        .get_result(&mut conn)
        .unwrap();
    assert_eq!(status.status, "debited");

    let second = Service::start(&schema, &redis, &env);
    let third = Service::start(&schema, &redis, &env);
    let replay = second.speech(&key, Some("crash-1"), &text);
    assert_eq!(
        (replay.status, replay.code()),
        (409, "idempotency_in_flight".into())
    );
    let settled = (0..600).any(|_| {
        let u = second.json(&format!("/admin/usage/{usage}"));
        if u["status"] == "refunded" {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
        false
    });
    assert!(
        settled,
        "the settlement refunded the usage: {}",
        second.stderr()
    );
    // Let both instances see the message (a redelivery, a second relay).
    std::thread::sleep(std::time::Duration::from_millis(1000));
    let (balance, sum, _, refunds) = money(&second, account);
    assert_eq!(
        (balance, sum, refunds),
        (1_000, 1_000, 1),
        "refunded exactly once"
    );
    let refunded_by: u64 = [&second, &third]
        .iter()
        .map(|s| s.stats()["settlements_refunded"].as_u64().unwrap())
        .sum();
    assert_eq!(refunded_by, 1);
    let u = second.json(&format!("/admin/usage/{usage}"));
    assert_eq!(u["refunds"], 1);
    let replay = second.speech(&key, Some("crash-1"), &text);
    assert_eq!(
        (replay.status, replay.code()),
        (409, "idempotency_refunded".into())
    );
    let _ = cost;
}

#[test]
fn kill_9_between_debit_and_refund_settles_once_in_process() {
    crash_between_debit_and_refund(None);
}

#[test]
fn kill_9_between_debit_and_refund_settles_once_through_rabbitmq() {
    let Some(amqp) = inbox_test_support::amqp::amqp_url() else {
        return;
    };
    crash_between_debit_and_refund(Some(&amqp));
}

/// Every debit's settlement message arrives after the deadline, also for requests
/// that finished: the guarded write from `debited` makes those a no-op.
#[cfg(feature = "test-hooks")]
#[test]
fn settlements_of_finished_requests_change_nothing() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[
            ("METERED_DEADLINE_MS", "400"),
            ("METERED_SETTLE_MARGIN_MS", "100"),
        ],
    );
    let (account, key) = svc.account(1_000, 1_000);
    assert!(is_done(&svc.speech(&key, Some("delivered"), TEXT)));
    let cut = svc.speech(&key, Some("cut"), "[fail-after:1] two chunks of text, cut");
    assert_eq!(cut.lines().last().unwrap()["type"], "error");
    let seen = (0..600).any(|_| {
        if svc.stats()["settlements_already_settled"].as_u64().unwrap() >= 2 {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        false
    });
    assert!(seen, "both settlements were consumed: {}", svc.stats());
    assert_eq!(svc.stats()["settlements_refunded"], 0);
    let (balance, sum, _, refunds) = money(&svc, account);
    assert_eq!((balance, sum, refunds), (1_000 - 27, 1_000 - 27, 1));
    let replay = svc.speech(&key, Some("delivered"), TEXT);
    assert_eq!(replay.status, 200);
    assert_eq!(replay.lines().last().unwrap()["type"], "done");
}

/// The last row of the state table: a refund that lands while a replay is served is
/// seen when the record is checked again after serving.
#[test]
fn a_refund_landing_while_a_replay_is_served_ends_it_with_an_error_line() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[("METERED_CHUNK_DELAY_MS", "300")]);
    let (account, key) = svc.account(1_000, 1_000);
    let first = svc.speech(&key, Some("r-1"), TEXT);
    assert!(is_done(&first));
    let usage = first.lines().last().unwrap()["usage_id"].as_i64().unwrap();
    let auth = format!("Bearer {key}");
    let body = serde_json::json!({ "text": TEXT }).to_string();
    let mut replay = metered_support::open(
        &svc.addr,
        "POST",
        "/v1/speech",
        &[("Authorization", &auth), ("Idempotency-Key", "r-1")],
        Some(&body),
    );
    assert_eq!(replay.status, 200);
    assert_eq!(replay.next_line().unwrap()["type"], "chunk");
    let refund = svc.post(&format!("/admin/usage/{usage}/refund"), &[], "");
    assert_eq!(refund.status, 200, "{}", refund.text());
    let mut rest = Vec::new();
    while let Some(line) = replay.next_line() {
        rest.push(line);
    }
    let last = rest.last().unwrap();
    assert_eq!(last["type"], "error", "{rest:?}");
    assert_eq!(last["error"]["code"], "idempotency_refunded");
    let (balance, sum, _, refunds) = money(&svc, account);
    assert_eq!((balance, sum, refunds), (1_000, 1_000, 1));
    let again = svc.speech(&key, Some("r-1"), TEXT);
    assert_eq!(
        (again.status, again.code()),
        (409, "idempotency_refunded".into())
    );
    let twice = svc.post(&format!("/admin/usage/{usage}/refund"), &[], "");
    assert_eq!((twice.status, twice.code()), (409, "not_refundable".into()));
}

/// A stream still running at the deadline is cut and refunded; so is one whose
/// client went away.
#[test]
fn a_stream_past_its_deadline_or_left_by_its_client_is_refunded() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[
            ("METERED_DEADLINE_MS", "400"),
            ("METERED_CHUNK_DELAY_MS", "100"),
            ("METERED_SETTLE_MARGIN_MS", "60000"),
        ],
    );
    let (account, key) = svc.account(1_000, 1_000);
    let long = "x".repeat(16 * 20); // 20 chunks, 2 s
    let r = svc.speech(&key, Some("late"), &long);
    assert_eq!(r.status, 200);
    let last = r.lines().last().unwrap().clone();
    assert_eq!(last["error"]["code"], "deadline_exceeded", "{}", r.text());
    assert_eq!(last["refunded"], true);
    assert_eq!(money(&svc, account).0, 1_000);

    let auth = format!("Bearer {key}");
    let body = serde_json::json!({ "text": long }).to_string();
    let mut gone = metered_support::open(
        &svc.addr,
        "POST",
        "/v1/speech",
        &[("Authorization", &auth)],
        Some(&body),
    );
    let usage = gone
        .headers
        .iter()
        .find(|(k, _)| k == "x-usage-id")
        .unwrap()
        .1
        .clone();
    assert_eq!(gone.next_line().unwrap()["type"], "chunk");
    drop(gone);
    // Refunded on the request path (the settlement is a minute away).
    let refunded = (0..600).any(|_| {
        if svc.json(&format!("/admin/usage/{usage}"))["status"] == "refunded" {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        false
    });
    assert!(refunded);
    let (balance, sum, _, refunds) = money(&svc, account);
    assert_eq!((balance, sum, refunds), (1_000, 1_000, 2));
}

/// The default build (no `test-hooks` feature) serves a text holding the marker
/// like any other: streamed whole, charged, no refund.
#[cfg(not(feature = "test-hooks"))]
#[test]
fn a_default_build_ignores_the_fail_after_marker() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let (account, key) = svc.account(500, 500);
    let text = "please say this [fail-after:0] whole"; // 36 characters, 3 chunks
    let r = svc.speech(&key, None, text);
    assert!(is_done(&r), "{}", r.text());
    assert_eq!(r.lines().len(), 4, "{}", r.text());
    let (balance, sum, _, refunds) = money(&svc, account);
    assert_eq!((balance, sum, refunds), (500 - 36, 500 - 36, 0));
}

/// The value of `series` (a name and its labels as rendered) in a Prometheus text
/// exposition.
fn sample(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("{series} in:\n{text}"))
        .parse()
        .unwrap()
}

/// `GET /metrics` on the admin listener, with the admin token.
fn scrape(svc: &Service) -> String {
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let r = metered_support::request(
        &svc.admin_addr,
        "GET",
        "/metrics",
        &[("Authorization", &bearer)],
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    r.text()
}

/// The Redis advisory layer's series in `text` equal `/admin/stats`' fields.
fn assert_advisory_counts_match(text: &str, stats: &serde_json::Value) {
    for (series, field) in [
        (
            "metered_api_redis_fallbacks_total{kind=\"rate_limit\"}",
            "rate_limit_fallbacks",
        ),
        (
            "metered_api_redis_fallbacks_total{kind=\"slot\"}",
            "slot_fallbacks",
        ),
        (
            "metered_api_redis_fallbacks_total{kind=\"key_cache\"}",
            "key_cache_fallbacks",
        ),
        (
            "metered_api_key_cache_lookups_total{outcome=\"hit\"}",
            "key_cache_hits",
        ),
        (
            "metered_api_key_cache_lookups_total{outcome=\"miss\"}",
            "key_cache_misses",
        ),
    ] {
        assert_eq!(
            sample(text, series),
            stats[field].as_u64().unwrap(),
            "{series} against {field}: {stats}\n{text}"
        );
    }
}

/// `GET /metrics` on the admin listener, with the admin token: the Prometheus text
/// format, the service's own counts equal to `/admin/stats`, described; refused
/// without the token, absent from the public listener.
#[test]
fn metrics_are_served_on_the_admin_listener_and_match_the_stats() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let (_, key) = svc.account(10_000, 10_000);
    assert!(is_done(&svc.speech(&key, Some("m-1"), TEXT)));
    assert_eq!(svc.speech(&key, Some("m-1"), TEXT).status, 200, "a replay");
    let bearer = format!("Bearer {ADMIN_TOKEN}");
    let r = metered_support::request(
        &svc.admin_addr,
        "GET",
        "/metrics",
        &[("Authorization", &bearer)],
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.header("content-type")
            .is_some_and(|t| t.starts_with("text/plain; version=0.0.4")),
        "{:?}",
        r.headers
    );
    let text = r.text();
    let stats = svc.stats();
    let sample = |series: &str| sample(&text, series);
    assert_eq!(stats["streams_delivered"], 1, "{stats}");
    assert_eq!(stats["replays"], 1, "{stats}");
    assert_eq!(sample("metered_api_streams_delivered_total"), 1);
    assert_eq!(sample("metered_api_replays_total"), 1);
    assert_eq!(
        sample("metered_api_connections_accepted_total{listener=\"public\"}"),
        stats["connections_accepted"].as_u64().unwrap()
    );
    assert!(
        text.contains("# HELP metered_api_replays_total Replays served from a saved response.\n"),
        "{text}"
    );
    // The Redis advisory layer: the first request missed the key cache (and cached
    // the key), the replay hit it; nothing failed open.
    assert!(stats["key_cache_misses"].as_u64().unwrap() >= 1, "{stats}");
    assert!(stats["key_cache_hits"].as_u64().unwrap() >= 1, "{stats}");
    assert_advisory_counts_match(&text, &stats);
    assert_eq!(stats["redis_fallbacks"], 0, "{stats}");
    for series in [
        "# HELP metered_api_redis_fallbacks_total ",
        "# HELP metered_api_key_cache_lookups_total ",
    ] {
        assert!(text.contains(series), "{series} in:\n{text}");
    }
    // Refused without the token; not on the public listener.
    let none = metered_support::request(&svc.admin_addr, "GET", "/metrics", &[], None);
    assert_eq!(none.status, 401, "{}", none.text());
    let public = metered_support::request(&svc.addr, "GET", "/metrics", &[], None);
    assert_eq!(public.status, 404, "{}", public.text());
}

/// `/admin` is not on the public listener, and the admin listener refuses a request
/// without the admin token or with a wrong one before any route runs.
#[test]
fn admin_routes_need_their_listener_and_the_token() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[]);
    let body = Some("{\"balance\": 9223372036854775807}");
    let public = metered_support::request(&svc.addr, "POST", "/admin/accounts", &[], body);
    assert_eq!(
        (public.status, public.code()),
        (404, "not_found".into()),
        "{}",
        public.text()
    );
    let none = metered_support::request(&svc.admin_addr, "POST", "/admin/accounts", &[], body);
    assert_eq!(
        (none.status, none.code()),
        (401, "unauthorized".into()),
        "{}",
        none.text()
    );
    let wrong = format!("Bearer {}x", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]);
    for path in [
        "/admin/accounts/1",
        "/admin/usage/1",
        "/admin/stats",
        "/admin/nothing",
    ] {
        let r = metered_support::request(
            &svc.admin_addr,
            "GET",
            path,
            &[("Authorization", &wrong)],
            None,
        );
        assert_eq!((r.status, r.code()), (401, "unauthorized".into()), "{path}");
    }
    // Nothing was created; with the token the same request works.
    let mut conn = schema.connect();
    #[derive(QueryableByName)]
    struct Count {
        #[diesel(sql_type = BigInt)]
        n: i64,
    }
    let accounts: Count = diesel::sql_query("SELECT count(*) AS n FROM accounts")
        .get_result(&mut conn)
        .unwrap();
    assert_eq!(accounts.n, 0);
    let (account, _) = svc.account(10, 10);
    assert!(account > 0);
    assert_eq!(svc.stats()["admin_unauthorized"], 5);
}

/// A broker that refuses the service's credentials stops it at startup with exit 1,
/// before it listens, and the password is not printed.
#[test]
fn a_broker_refusing_the_credentials_stops_startup_with_exit_1() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let Some(amqp) = inbox_test_support::amqp::amqp_url() else {
        return;
    };
    let schema = Schema::new(&pg);
    // The same broker, a password it does not take.
    let (scheme, rest) = amqp.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let wrong = format!("{scheme}://guest:wrong-s3cret@{host}");
    let prefix = format!("{}.", schema.name);
    let run = run_to_exit(
        &schema,
        &redis,
        &[("AMQP_URL", &wrong), ("METERED_AMQP_PREFIX", &prefix)],
    );
    assert_eq!(
        run.code,
        Some(1),
        "stdout: {}\nstderr: {}",
        run.stdout,
        run.stderr
    );
    assert!(!run.stdout.contains("listening"), "{}", run.stdout);
    assert!(
        run.stderr.contains("metered_api: startup failed"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("wrong-s3cret"), "{}", run.stderr);
}

/// A settlement consumer that ends for good after startup (its group's queue was
/// declared by someone else with other arguments: a topology conflict) stops the
/// service with exit 1 instead of leaving it serving without settling.
#[test]
fn a_settlement_consumer_that_stops_for_good_stops_the_service() {
    use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use lapin::{Connection, ConnectionProperties};
    let Some((pg, redis)) = services() else {
        return;
    };
    let Some(amqp) = inbox_test_support::amqp::amqp_url() else {
        return;
    };
    let schema = Schema::new(&pg);
    let prefix = format!("{}.", schema.name);
    let queue = format!("{prefix}metered.settlement");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let conn = rt
        .block_on(Connection::connect(&amqp, ConnectionProperties::default()))
        .unwrap();
    let channel = rt.block_on(conn.create_channel()).unwrap();
    // A classic queue where the consumer declares a quorum one.
    rt.block_on(channel.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    ))
    .unwrap();
    // The queue and the exchange go, whatever the test's outcome.
    struct Cleanup<'a> {
        rt: &'a tokio::runtime::Runtime,
        channel: lapin::Channel,
        queue: String,
        exchange: String,
    }
    impl Drop for Cleanup<'_> {
        fn drop(&mut self) {
            let (q, x) = (self.queue.as_str(), self.exchange.as_str());
            let _ = self.rt.block_on(
                self.channel
                    .queue_delete(q.into(), QueueDeleteOptions::default()),
            );
            let _ = self.rt.block_on(
                self.channel
                    .exchange_delete(x.into(), ExchangeDeleteOptions::default()),
            );
        }
    }
    let _cleanup = Cleanup {
        rt: &rt,
        channel,
        queue: queue.clone(),
        exchange: format!("{prefix}metered"),
    };
    let run = run_to_exit(
        &schema,
        &redis,
        &[("AMQP_URL", &amqp), ("METERED_AMQP_PREFIX", &prefix)],
    );
    assert_eq!(
        run.code,
        Some(1),
        "stdout: {}\nstderr: {}",
        run.stdout,
        run.stderr
    );
    assert!(
        run.stderr
            .contains("metered_api: settlement consumer stopped: "),
        "{}",
        run.stderr
    );
}

/// A mistyped scheme stops startup with exit 1 and the URL redacted.
#[test]
fn a_mistyped_database_scheme_exits_1_without_the_password() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let run = run_to_exit(
        &schema,
        &redis,
        &[("DATABASE_URL", "postgress://app:pg-s3cret@127.0.0.1/test")],
    );
    assert_eq!(run.code, Some(1), "{}", run.stderr);
    assert!(
        run.stderr.contains("postgress://app:***@127.0.0.1/test"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("pg-s3cret"), "{}", run.stderr);
}

/// Reads from `socket` until the server closes it (EOF or a reset); panics when it
/// stays open past the hang bound.
fn closed_by_server(mut socket: std::net::TcpStream, what: &str) {
    use std::io::Read;
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match socket.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue, // a 408 or 400 answer before the close
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{what}: still open ({e})"),
        }
    }
}

/// Idle sockets, slowloris headers (one silent, one sending a byte every 50 ms, so
/// that only the header timeout ends it), a stalled body (only the idle timeout
/// ends it) and an idle kept-alive connection: each is closed, and `/v1/health`
/// answers meanwhile although they outnumber the connection cap.
#[test]
fn idle_and_slow_clients_are_closed_and_health_still_answers() {
    use std::io::Write;
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[
            ("METERED_HEADER_TIMEOUT_MS", "1000"),
            ("METERED_IDLE_TIMEOUT_MS", "500"),
            ("METERED_MAX_CONNECTIONS", "8"),
        ],
    );
    let connect = || std::net::TcpStream::connect(&svc.addr).unwrap();
    // A header sent a byte at a time: progress, so never idle, but never complete.
    let mut trickle = connect();
    trickle
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        .unwrap();
    let trickler = std::thread::spawn(move || {
        for _ in 0..600 {
            if trickle.write_all(b"a").is_err() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        false
    });
    let mut held = Vec::new();
    for i in 0..12 {
        let mut s = connect();
        if i % 2 == 1 {
            // Slowloris: a header that never ends.
            s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Slow: a")
                .unwrap();
        }
        held.push((s, "an idle or slow header"));
    }
    let mut body = connect();
    body.write_all(
        b"POST /v1/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n{\"text\":",
    )
    .unwrap();
    held.push((body, "a stalled body"));
    let health = svc.get("/v1/health", &[]);
    assert_eq!(health.status, 200, "{}", health.text());
    // A kept-alive connection, answered once, then silent.
    let mut kept = connect();
    kept.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    held.push((kept, "an idle kept-alive connection"));
    for (socket, what) in held {
        closed_by_server(socket, what);
    }
    assert!(
        trickler.join().unwrap(),
        "a header sent a byte at a time was never cut"
    );
    let health = svc.get("/v1/health", &[]);
    assert_eq!(health.status, 200, "{}", health.text());
    let stats = svc.stats();
    assert!(stats["connections_peak"].as_u64().unwrap() <= 8, "{stats}");
}

/// Past the cap, connections wait in the backlog: while two kept-alive connections
/// hold the two places, six more requests are answered only as places free, and
/// no more than two connections are ever open at once.
#[test]
fn connections_past_the_cap_wait_in_the_backlog() {
    use std::io::{BufRead, BufReader, Read, Write};
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(
        &schema,
        &redis,
        &[
            ("METERED_MAX_CONNECTIONS", "2"),
            ("METERED_HEADER_TIMEOUT_MS", "120000"),
            ("METERED_IDLE_TIMEOUT_MS", "120000"),
        ],
    );
    // Two connections served once and kept alive: both places taken.
    let held: Vec<std::net::TcpStream> = (0..2)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&svc.addr).unwrap();
            s.set_read_timeout(Some(metered_support::HANG)).unwrap();
            s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut reader = BufReader::new(s.try_clone().unwrap());
            let mut length = 0;
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                if line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap();
                }
            }
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            s
        })
        .collect();
    let waiting: Vec<std::net::TcpStream> = (0..6)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&svc.addr).unwrap();
            s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            s
        })
        .collect();
    drop(held);
    for mut s in waiting {
        s.set_read_timeout(Some(metered_support::HANG)).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
    let stats = svc.stats();
    assert_eq!(stats["connections_accepted"], 8, "{stats}");
    assert_eq!(stats["connections_peak"], 2, "{stats}");
}

/// Unknown keys from one address spend its bucket of failed authentications; past
/// it, requests are refused with 429 before Redis or PostgreSQL is asked. Found
/// keys give their token back.
#[test]
fn unknown_keys_from_one_address_are_refused_before_any_look_up() {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let svc = Service::start(&schema, &redis, &[("METERED_AUTH_FAILURE_LIMIT", "3")]);
    let (_, key) = svc.account(100, 100);
    for _ in 0..10 {
        svc.balance(&key);
    }
    let looked_up = |svc: &Service| {
        let s = svc.stats();
        s["key_cache_hits"].as_u64().unwrap()
            + s["key_cache_misses"].as_u64().unwrap()
            + s["key_cache_fallbacks"].as_u64().unwrap()
    };
    let before = looked_up(&svc);
    let statuses: Vec<(u16, String)> = (0..10)
        .map(|i| {
            let r = svc.speech(&format!("mk_unknown_{i}"), None, "x");
            (r.status, r.code())
        })
        .collect();
    // The bucket refills at 3 a minute: one more failure may fit while this runs.
    let unauthorized = statuses.iter().filter(|(s, _)| *s == 401).count();
    assert!((3..=4).contains(&unauthorized), "{statuses:?}");
    assert!(statuses[..3].iter().all(|(s, _)| *s == 401), "{statuses:?}");
    for (status, code) in &statuses[4..] {
        assert_eq!(
            (*status, code.as_str()),
            (429, "auth_rate_limited"),
            "{statuses:?}"
        );
    }
    let limited = svc.stats()["auth_rate_limited"].as_u64().unwrap();
    assert_eq!(limited as usize, 10 - unauthorized);
    // Only the failures that fit looked anything up.
    assert_eq!(looked_up(&svc) - before, unauthorized as u64);
}

/// Two instances setting up one fresh schema at once: the first holds its set-up
/// transaction open (tables created, not committed) while the second runs its own;
/// the second waits for the first's advisory lock, then finds the tables. Without
/// the lock it would wait on the catalog's unique index and fail with a duplicate
/// key when the first commits.
#[test]
fn two_instances_set_up_one_fresh_schema_at_once() {
    use diesel::connection::SimpleConnection;
    use inbox_examples::metered::db;
    let Some((pg, _)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let mut admin = PgConnection::establish(&pg).unwrap();
    admin
        .batch_execute(&format!("CREATE SCHEMA \"{}\"", schema.name))
        .unwrap();
    let mut first = schema.connect();
    let mut second = schema.connect();
    #[derive(QueryableByName)]
    struct Pid {
        #[diesel(sql_type = diesel::sql_types::Integer)]
        pid: i32,
    }
    let second_pid = diesel::sql_query("SELECT pg_backend_pid() AS pid")
        .get_result::<Pid>(&mut second)
        .unwrap()
        .pid;
    #[derive(QueryableByName)]
    struct Waiting {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        waiting: bool,
    }
    // The first set-up's transaction stays open until the second waits on it.
    let other = first
        .transaction(|first| -> QueryResult<_> {
            db::create_schema(first)?;
            let other = std::thread::spawn(move || db::create_schema(&mut second));
            let blocked = (0..6000).any(|_| {
                let w: Waiting = diesel::sql_query(
                    "SELECT coalesce(wait_event_type = 'Lock', false) AS waiting \
                     FROM pg_stat_activity WHERE pid = $1",
                )
                .bind::<diesel::sql_types::Integer, _>(second_pid)
                .get_result(&mut admin)
                .unwrap();
                if !w.waiting {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                w.waiting
            });
            assert!(blocked, "the second set-up never waited for the first");
            Ok(other)
        })
        .unwrap();
    other.join().unwrap().unwrap();
}

/// A failover that loses a usage rolls its row back with the sequence that numbered
/// it, so the next usage can get its id; the lost usage's settlement message may be
/// in the broker already. That message must not settle the usage that took the id
/// (it would refund a request still being served), and the new usage's own message
/// must not share its key (it would be dropped as a duplicate). The loss is made by
/// hand: the debit's transaction rolled back and the sequence set back, as the
/// promoted standby has them. Nor may the lost request itself, still streaming when
/// the database failed over, mark that usage delivered or refund it when it ends.
#[test]
fn a_stale_settlement_of_a_usage_lost_in_a_failover_leaves_the_usage_that_took_its_id_alone() {
    use diesel::connection::SimpleConnection;
    use inbox_examples::metered::db;
    let Some((pg, _)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let store = inbox_diesel::Store::<PgConnection>::builder(&pg)
        .schema(&schema.name)
        .build()
        .unwrap();
    drop(store);
    let mut conn = schema.connect();
    db::create_schema(&mut conn).unwrap();
    let now = chrono::Utc::now();
    let account = db::create_account(&mut conn, 1_000, now).unwrap();
    let key = db::create_key(&mut conn, account, b"digest", 1_000, now)
        .unwrap()
        .unwrap();
    let debit = db::Debit {
        account,
        key_id: key,
        amount: 10,
        model: "m",
        idempotency: None,
        deadline: now,
        settle_at: now,
        exchange: "metered",
    };
    #[derive(QueryableByName)]
    struct Row {
        #[diesel(sql_type = Text)]
        message_key: String,
        #[diesel(sql_type = Binary)]
        payload: Vec<u8>,
    }
    let outbox = |conn: &mut PgConnection| -> Vec<Row> {
        diesel::sql_query("SELECT message_key, payload FROM outbox_messages ORDER BY id")
            .load(conn)
            .unwrap()
    };
    // The lost usage: debited, its message read (as the broker got it), then gone.
    let mut lost = None;
    let rolled_back = conn.transaction(|conn| -> QueryResult<()> {
        let usage = db::debit(conn, &debit, now).unwrap();
        lost = Some((usage, outbox(conn).pop().unwrap()));
        Err(diesel::result::Error::RollbackTransaction)
    });
    assert!(rolled_back.is_err());
    let (lost_usage, lost_row) = lost.unwrap();
    let lost_id = lost_usage.usage_id;
    conn.batch_execute(&format!(
        "SELECT setval('usage_events_id_seq', {lost_id}, false)"
    ))
    .unwrap();

    let id = db::debit(&mut conn, &debit, now).unwrap().usage_id;
    assert_eq!(id, lost_id, "the id came round again");
    let new_row = outbox(&mut conn).pop().unwrap();
    assert_ne!(
        new_row.message_key, lost_row.message_key,
        "the new usage's settlement has a key of its own"
    );
    // The lost request ends: its delivery and its refund find no usage of theirs.
    assert!(
        !db::deliver(&mut conn, &lost_usage, None, b"{}", now).unwrap(),
        "the lost request marked the usage that took its id delivered"
    );
    assert!(
        !db::refund(&mut conn, &lost_usage, now).unwrap(),
        "the lost request refunded the usage that took its id"
    );
    assert_eq!(db::usage(&mut conn, id).unwrap().unwrap().status, "debited");
    let stale: db::SettlementDue = serde_json::from_slice(&lost_row.payload).unwrap();
    assert_eq!(stale.usage_id, id);
    assert!(
        !db::settle(&mut conn, &stale, now).unwrap(),
        "the stale settlement refunded the usage that took its id"
    );
    assert_eq!(db::usage(&mut conn, id).unwrap().unwrap().status, "debited");
    let own: db::SettlementDue = serde_json::from_slice(&new_row.payload).unwrap();
    assert!(
        db::settle(&mut conn, &own, now).unwrap(),
        "its own settles it"
    );
    assert_eq!(
        db::usage(&mut conn, id).unwrap().unwrap().status,
        "refunded"
    );
}

/// A `usage_events` table from before `usage_ref` gets the column when the service
/// starts: each existing usage's is its id, so its settlement message (keyed by the
/// id) keeps its key; a new usage's is random.
#[test]
fn a_usage_table_from_before_usage_ref_keeps_each_usage_s_key() {
    use diesel::connection::SimpleConnection;
    use inbox_examples::metered::db;
    let Some((pg, _)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    drop(
        inbox_diesel::Store::<PgConnection>::builder(&pg)
            .schema(&schema.name)
            .build()
            .unwrap(),
    );
    let mut conn = schema.connect();
    db::create_schema(&mut conn).unwrap();
    let now = chrono::Utc::now();
    let account = db::create_account(&mut conn, 1_000, now).unwrap();
    let key = db::create_key(&mut conn, account, b"digest", 1_000, now)
        .unwrap()
        .unwrap();
    let debit = db::Debit {
        account,
        key_id: key,
        amount: 10,
        model: "m",
        idempotency: None,
        deadline: now,
        settle_at: now,
        exchange: "metered",
    };
    let old = db::debit(&mut conn, &debit, now).unwrap().usage_id;
    conn.batch_execute("ALTER TABLE usage_events DROP COLUMN usage_ref")
        .unwrap();
    db::create_schema(&mut conn).unwrap();
    let new = db::debit(&mut conn, &debit, now).unwrap().usage_id;
    #[derive(QueryableByName)]
    struct Ref {
        #[diesel(sql_type = Text)]
        usage_ref: String,
    }
    let usage_ref = |conn: &mut PgConnection, id: i64| {
        diesel::sql_query("SELECT usage_ref FROM usage_events WHERE id = $1")
            .bind::<BigInt, _>(id)
            .get_result::<Ref>(conn)
            .unwrap()
            .usage_ref
    };
    assert_eq!(usage_ref(&mut conn, old), old.to_string());
    let fresh = usage_ref(&mut conn, new);
    assert_eq!(fresh.len(), 36, "a UUID: {fresh}");
}

//! The metered API as a client sees it: the service process on a schema of its own,
//! real PostgreSQL and Redis, requests over HTTP.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

mod metered_support;

use std::collections::BTreeMap;

use diesel::prelude::*;
use diesel::sql_types::{BigInt, Binary, Text};
use inbox_core::RequestFields;
use metered_support::{services, HttpResponse, Schema, Service};
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
    let (account, capped) = svc.account(1_000, 300);
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
    assert!(spent <= 300, "the key stayed within its cap: {spent}");
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
    let target = redis
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
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

/// SIGKILL while a stream runs (after the debit, before any settlement): a new
/// instance settles it after the deadline, exactly once, even with two instances.
fn crash_between_debit_and_refund(amqp: Option<&str>) {
    let Some((pg, redis)) = services() else {
        return;
    };
    let schema = Schema::new(&pg);
    let prefix = format!("{}.", schema.name);
    let mut env = vec![
        ("METERED_DEADLINE_MS", "1500"),
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

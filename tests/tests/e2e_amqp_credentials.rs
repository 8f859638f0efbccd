//! No password of a broker URL is printed when the consumer or the relay cannot
//! connect: not in the error's message, not in any cause below it, not in its
//! `Debug`. Each case really tries to connect to the RabbitMQ of `AMQP_URL` (or to a
//! listener of the test's own that never answers), with a URL that fails in its own
//! way.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::Arc;
use std::time::Duration;

use diesel::SqliteConnection;
use inbox_amqp::{
    CancellationToken, Consumer, ConsumerSettings, Error, Relay, RelaySettings, Topology,
};
use inbox_diesel::Store;
use inbox_test_support::amqp::{amqp_url, host_port};
use inbox_test_support::CredentialCase as Case;
use inbox_test_support::{Fixture, SqliteFixture};

const CASES: &[Case] = &[
    Case {
        name: "wrong password",
        url: "amqp://guest:Wr0ng-s3cret@{addr}/%2f",
        password: "Wr0ng-s3cret",
    },
    Case {
        name: "unknown user",
        url: "amqp://no_such_user:unkn0wn-s3cret@{addr}/%2f",
        password: "unkn0wn-s3cret",
    },
    Case {
        name: "percent-encoded wrong password",
        url: "amqp://guest:p%40ss%3Fw%2Frd@{addr}/%2f",
        password: "p@ss?w/rd",
    },
    Case {
        name: "percent-encoded wrong password, as written",
        url: "amqp://guest:p%40ss%3Fw%2Frd@{addr}/%2f",
        password: "p%40ss%3Fw%2Frd",
    },
    Case {
        name: "'@' in the wrong password",
        url: "amqp://guest:at@s3cret@{addr}/%2f",
        password: "at@s3cret",
    },
    Case {
        name: "':' in the wrong password",
        url: "amqp://guest:co:lon-s3cret@{addr}/%2f",
        password: "co:lon-s3cret",
    },
    Case {
        // The URL parser ends the authority at '?': the head of the password is a port.
        name: "'?' in the password",
        url: "amqp://guest:qu?es-s3cret@{addr}/%2f",
        password: "qu?es-s3cret",
    },
    Case {
        name: "'#' in the password",
        url: "amqp://guest:ha#sh-s3cret@{addr}/%2f",
        password: "ha#sh-s3cret",
    },
    Case {
        name: "'/' in the password",
        url: "amqp://guest:sl4sh/s3cret@{addr}/%2f",
        password: "sl4sh",
    },
    Case {
        name: "invalid UTF-8 once decoded",
        url: "amqp://guest:p%FFs3cret@{addr}/%2f",
        password: "p%FFs3cret",
    },
    Case {
        // Not a base URL: the parser quotes it back whole.
        name: "no '//' after the scheme",
        url: "amqp:guest:n0slash-s3cret@{addr}/%2f",
        password: "n0slash-s3cret",
    },
    Case {
        name: "nothing listening",
        url: "amqp://guest:unr3achable-s3cret@127.0.0.1:1/%2f",
        password: "unr3achable-s3cret",
    },
];

fn assert_hidden(case: &str, err: &Error, password: &str) {
    assert!(
        matches!(err, Error::Connect { .. } | Error::ConnectTimeout { .. }),
        "{case}: expected a connect error, found {err:?}"
    );
    for text in inbox_test_support::everything_printed(err) {
        assert!(
            !text.contains(password),
            "{case}: {password:?} printed in {text}"
        );
    }
}

fn store(fx: &SqliteFixture) -> Arc<Store<SqliteConnection>> {
    Arc::new(fx.builder().build().unwrap())
}

fn consumer(url: String, store: Arc<Store<SqliteConnection>>) -> Consumer<Store<SqliteConnection>> {
    Consumer::new(url, store, Topology::new("billing").unwrap())
        .with_settings(ConsumerSettings::default().connect_timeout(Duration::from_millis(500)))
}

fn relay(url: String, store: Arc<Store<SqliteConnection>>) -> Relay<Store<SqliteConnection>> {
    Relay::new(url, store)
        .with_settings(RelaySettings::default().connect_timeout(Duration::from_millis(500)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_and_relay_connect_errors_print_no_password() {
    let Some(broker) = amqp_url() else { return };
    let addr = host_port(&broker);
    let fx = SqliteFixture::new();
    let store = store(&fx);
    for case in CASES {
        let url = case.url.replace("{addr}", &addr);
        let consumed = consumer(url.clone(), Arc::clone(&store))
            .run(CancellationToken::new())
            .await;
        let Err(err) = consumed else {
            panic!("{}: the consumer ran", case.name);
        };
        assert_hidden(&format!("consumer, {}", case.name), &err, case.password);
        if let Error::Connect { .. } = &err {
            assert!(
                inbox_test_support::everything_printed(&err).len() >= 3,
                "{}: lapin's error is kept as a cause: {err:?}",
                case.name
            );
        }

        let relayed = relay(url, Arc::clone(&store))
            .run(CancellationToken::new())
            .await;
        let Err(err) = relayed else {
            panic!("{}: the relay ran", case.name);
        };
        assert_hidden(&format!("relay, {}", case.name), &err, case.password);
    }
}

/// A peer that accepts the connection and never speaks AMQP: the handshake times out,
/// and the error names the URL with its password hidden.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_timeout_prints_no_password() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let fx = SqliteFixture::new();
    let url = format!("amqp://guest:t1meout-s3cret@{addr}/%2f");
    let Err(err) = consumer(url.clone(), store(&fx))
        .run(CancellationToken::new())
        .await
    else {
        panic!("the consumer ran against a silent peer");
    };
    assert!(matches!(err, Error::ConnectTimeout { .. }), "{err:?}");
    assert_hidden("silent peer", &err, "t1meout-s3cret");
    silent.abort();
}

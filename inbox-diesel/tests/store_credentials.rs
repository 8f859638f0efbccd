//! No password of a store's URL is printed when the store cannot connect: not in the
//! error's message, not in any cause below it (libpq's own message quotes parts of the
//! URL back), not in its `Debug`. Each case really tries to connect to the PostgreSQL
//! server of `DATABASE_URL`, with a URL that fails in its own way.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use diesel::PgConnection;
use inbox_diesel::{Error, Store};
use inbox_test_support::postgres_url;
use inbox_test_support::CredentialCase as Case;

/// The server trusts every local user, so a "wrong password" is a password for a
/// role that does not exist: the server refuses the role.
const CASES: &[Case] = &[
    Case {
        name: "wrong password",
        url: "postgres://no_such_role:s3cret-Wr0ng@{addr}/test",
        password: "s3cret-Wr0ng",
    },
    Case {
        name: "bad percent escape in the password",
        url: "postgres://postgres:pa%zzs3cret@{addr}/test",
        password: "pa%zzs3cret",
    },
    Case {
        name: "forbidden %00 in the password",
        url: "postgres://postgres:pa%00s3cret@{addr}/test",
        password: "pa%00s3cret",
    },
    Case {
        name: "bad percent escape in a password query parameter",
        url: "postgres://postgres@{addr}/test?password=qu%zzs3cret",
        password: "qu%zzs3cret",
    },
    Case {
        name: "password query parameter, unknown role",
        url: "postgres://no_such_role@{addr}/test?password=qu3ry-s3cret",
        password: "qu3ry-s3cret",
    },
    Case {
        name: "password query parameter beside an invalid one",
        url: "postgres://postgres@{addr}/test?password=qu3ry-s3cret&bogus=1",
        password: "qu3ry-s3cret",
    },
    Case {
        name: "unreachable port",
        url: "postgres://postgres:unr3achable-s3cret@127.0.0.1:1/test",
        password: "unr3achable-s3cret",
    },
    Case {
        name: "unresolvable host",
        url: "postgres://postgres:n0host-s3cret@no-such-host.invalid/test",
        password: "n0host-s3cret",
    },
    Case {
        name: "'?' in the password",
        url: "postgres://no_such_role:qu?es-s3cret@{addr}/test",
        password: "qu?es-s3cret",
    },
    Case {
        name: "'#' in the password",
        url: "postgres://no_such_role:ha#sh-s3cret@{addr}/test",
        password: "ha#sh-s3cret",
    },
    Case {
        name: "':' in the password",
        url: "postgres://no_such_role:co:lon-s3cret@{addr}/test",
        password: "co:lon-s3cret",
    },
    Case {
        // libpq ends the password at the first '@': the rest is taken for the host.
        name: "'@' in the password",
        url: "postgres://postgres:at@s3cret@{addr}/test",
        password: "s3cret@",
    },
    Case {
        // libpq ends the authority at '/': the head of the password is taken for a port.
        name: "'/' in the password",
        url: "postgres://postgres:sl4sh/s3cret@{addr}/test",
        password: "sl4sh",
    },
    Case {
        name: "percent-encoded password, unknown role",
        url: "postgres://no_such_role:p%40ss%2Fw%3Frd@{addr}/test",
        password: "p@ss/w?rd",
    },
    Case {
        // libpq quotes the whole URI back.
        name: "unterminated IPv6 address",
        url: "postgres://postgres:ipv6-s3cret@[::1/test",
        password: "ipv6-s3cret",
    },
    Case {
        name: "key=value string, unreachable port",
        url: "host=127.0.0.1 port=1 user=postgres password=kv-s3cret dbname=test",
        password: "kv-s3cret",
    },
    Case {
        name: "key=value string, unterminated quote",
        url: "host=127.0.0.1 user=postgres password='kv s3cret",
        password: "kv s3cret",
    },
    Case {
        name: "key=value string, invalid option",
        url: "host=127.0.0.1 password=kv-s3cret bogus=1",
        password: "kv-s3cret",
    },
];

/// host:port of a postgres:// URL.
fn addr(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    }
}

#[test]
fn connect_errors_print_no_password_at_any_level() {
    let Some(server) = postgres_url() else { return };
    let addr = addr(&server);
    for case in CASES {
        let url = case.url.replace("{addr}", &addr);
        let err = match Store::<PgConnection>::builder(url.clone()).build() {
            Ok(_) => panic!(
                "{}: connected with {}",
                case.name,
                inbox_diesel::redact(&url)
            ),
            Err(err) => err,
        };
        assert!(
            matches!(err, Error::Connect { .. }),
            "{}: expected a connect error, found {err:?}",
            case.name
        );
        let printed = inbox_test_support::everything_printed(&err);
        assert!(
            printed.len() >= 3,
            "{}: the driver's error is kept as a cause: {printed:?}",
            case.name
        );
        for text in &printed {
            assert!(
                !text.contains(case.password),
                "{}: {:?} printed in {text}",
                case.name,
                case.password
            );
        }
    }
}

#[test]
fn the_driver_says_why() {
    let Some(server) = postgres_url() else { return };
    let url = format!("postgres://postgres:pa%zzs3cret@{}/test", addr(&server));
    let err = Store::<PgConnection>::builder(url).build().unwrap_err();
    let Error::Connect { url, source } = &err else {
        panic!("expected a connect error, found {err:?}");
    };
    assert_eq!(
        *url,
        format!("postgres://postgres:***@{}/test", addr(&server))
    );
    // libpq's message stays readable, the password masked in it.
    assert!(source.to_string().contains("\"***\""), "{source}");
}

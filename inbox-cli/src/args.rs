//! The command line: clap types a host binary mounts (see the crate docs).

use std::fmt;

use clap::{Args, Subcommand, ValueEnum};
use inbox_core::{redact_url, DeadLetterReason};

/// A URL as `Debug` shows it: every password replaced by `***`.
fn redacted(url: Option<&String>) -> Option<String> {
    url.map(|u| redact_url(u))
}

/// A broker setting (one URL or several) without any password.
fn redacted_brokers(urls: Option<&String>) -> Option<String> {
    urls.map(|u| inbox_amqp::BrokerUrls::redact(u))
}

impl fmt::Debug for GlobalArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Destructured: a new field must be placed here (and redacted if it is a URL).
        let Self {
            database_url,
            schema,
            prefix,
            json,
        } = self;
        f.debug_struct("GlobalArgs")
            .field("database_url", &redacted(database_url.as_ref()))
            .field("schema", schema)
            .field("prefix", prefix)
            .field("json", json)
            .finish()
    }
}

impl fmt::Debug for VerifyArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            amqp_url,
            ca_cert,
            exchange,
            consumer_groups,
            retry_ladder,
        } = self;
        f.debug_struct("VerifyArgs")
            .field("amqp_url", &redacted_brokers(amqp_url.as_ref()))
            .field("ca_cert", ca_cert)
            .field("exchange", exchange)
            .field("consumer_groups", consumer_groups)
            .field("retry_ladder", retry_ladder)
            .finish()
    }
}

impl fmt::Debug for SelftestArgs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            count,
            timeout,
            exchange,
            relay,
            amqp_url,
            ca_cert,
        } = self;
        f.debug_struct("SelftestArgs")
            .field("count", count)
            .field("timeout", timeout)
            .field("exchange", exchange)
            .field("relay", relay)
            .field("amqp_url", &redacted_brokers(amqp_url.as_ref()))
            .field("ca_cert", ca_cert)
            .finish()
    }
}

/// Options every subcommand takes. Mount them with `#[command(flatten)]`. Its `Debug`
/// shows the database URL with its password replaced by `***`.
#[derive(Clone, Default, Args)]
pub struct GlobalArgs {
    /// The database: postgres://... or sqlite://... (a password in it is never printed).
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// PostgreSQL: the schema holding the inbox tables (default: the search path).
    #[arg(long, env = "INBOX_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// The prefix of the exchange and queue names (as the consumer's topology has it).
    #[arg(long, env = "INBOX_PREFIX", global = true, default_value = "")]
    pub prefix: String,
    /// Print JSON (stable field names, see the README) instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
}

impl GlobalArgs {
    /// A builder of a store on `--database-url` (`DATABASE_URL`) in `--schema`
    /// (`INBOX_SCHEMA`), the database the commands open: for a binary's own store
    /// (add its handlers and projections, then `build`), so that it and the mounted
    /// commands agree. No URL is `InvalidSetting { setting: "database_url" }`.
    pub fn store_builder<C: inbox_diesel::StoreConnection>(
        &self,
    ) -> Result<inbox_diesel::StoreBuilder<C>, inbox_diesel::Error> {
        let url = self
            .database_url
            .as_deref()
            .filter(|url| !url.trim().is_empty())
            .ok_or_else(|| inbox_diesel::Error::InvalidSetting {
                setting: "database_url",
                expected: "a database URL (--database-url or DATABASE_URL)",
                found: "nothing".to_owned(),
            })?;
        let builder = inbox_diesel::Store::<C>::builder(url);
        Ok(match &self.schema {
            Some(schema) => builder.schema(schema.clone()),
            None => builder,
        })
    }

    /// `Topology::new(exchange)` with `--prefix` (`INBOX_PREFIX`): the names the
    /// commands check, for a binary's own consumer and producer.
    pub fn topology(&self, exchange: &str) -> Result<inbox_amqp::Topology, inbox_amqp::Error> {
        inbox_amqp::Topology::new(exchange)?.prefix(self.prefix.clone())
    }
}

/// The operator subcommands. Mount them with `#[command(flatten)]` in your own
/// `Subcommand` enum, or as one variant with `#[command(subcommand)]`.
#[derive(Clone, Debug, Subcommand)]
pub enum Command {
    /// Dead letters: list, show, failure groups, replay, discard.
    #[command(subcommand)]
    DeadLetters(DeadLetterCommand),
    /// Claims: show one key's, redrive failed ones whose retry copy was lost.
    #[command(subcommand)]
    Claims(ClaimCommand),
    /// Consumer groups halted by a claim invariant violation: list, resume.
    #[command(subcommand)]
    Groups(GroupCommand),
    /// Claims by status per group, retries, dead letters, the outbox backlog, halted
    /// groups.
    Stats,
    /// The stored reports of projection rebuilds and audits, newest first (a
    /// projection keeps its newest 100).
    RebuildReports {
        /// Only this projection's.
        #[arg(long)]
        projection: Option<String>,
        /// At most this many.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// Checks the database schema and, with AMQP_URL, the broker topology.
    Verify(VerifyArgs),
    /// Deletes published outbox rows, done claims and discarded dead letters past
    /// their retention, in bounded batches.
    Purge(PurgeArgs),
    /// Sends canary messages through the deployment (outbox, relay, broker, a
    /// consumer with the canary handler) and reports arrivals, losses, doubles and
    /// latency; exits 6 on any loss or double.
    Selftest(SelftestArgs),
    /// Serves the web console (inbox-web) on --listen until ctrl-c or SIGTERM; a
    /// non-loopback address needs INBOX_WEB_TOKEN.
    #[cfg(feature = "web")]
    #[cfg_attr(docsrs, doc(cfg(feature = "web")))]
    Web(WebArgs),
}

/// `web`. Its `Debug` never shows the token.
#[cfg(feature = "web")]
#[cfg_attr(docsrs, doc(cfg(feature = "web")))]
#[derive(Clone, Args)]
pub struct WebArgs {
    /// The address to listen on (`host:port`).
    #[arg(long, env = "INBOX_WEB_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: std::net::SocketAddr,
    /// The access token a browser presents on the login form (or a script as
    /// `Authorization: Bearer`); required on a non-loopback address.
    #[arg(long, env = "INBOX_WEB_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Refuse every action; show no action button.
    #[arg(long)]
    pub read_only: bool,
    /// The request header a proxy in front sets to the user's name (logged with every
    /// action).
    #[arg(long)]
    pub identity_header: Option<String>,
    /// An origin besides the request's own host that actions are accepted from (a
    /// proxy's public name, `https://ops.example.com`); repeatable.
    #[arg(long)]
    pub allow_origin: Vec<String>,
    /// Mark the session cookie `Secure` (served over HTTPS by a proxy in front).
    #[arg(long)]
    pub secure_cookie: bool,
}

#[cfg(feature = "web")]
impl std::fmt::Debug for WebArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebArgs")
            .field("listen", &self.listen)
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("read_only", &self.read_only)
            .field("identity_header", &self.identity_header)
            .field("allow_origin", &self.allow_origin)
            .field("secure_cookie", &self.secure_cookie)
            .finish()
    }
}

/// `selftest`. Its `Debug` shows the broker URL with its password replaced by `***`.
#[derive(Clone, Args)]
pub struct SelftestArgs {
    /// Canary messages to send.
    #[arg(long, default_value_t = 10)]
    pub count: u32,
    /// How long to wait for them (50ms, 10s, 1m, ...).
    #[arg(long, default_value = "30s")]
    pub timeout: String,
    /// The exchange (without the prefix) the consumers' canary group is bound to.
    #[arg(long, env = "INBOX_EXCHANGE", default_value = "billing")]
    pub exchange: String,
    /// Publish the canaries with a relay of this command's own (otherwise the
    /// deployment's running relay publishes them); needs AMQP_URL.
    #[arg(long)]
    pub relay: bool,
    /// The broker, for --relay (password never printed); `amqps://` needs the
    /// feature `rustls` of inbox-cli. The nodes of a cluster: several URLs
    /// separated by whitespace or commas, tried in turn.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// A PEM file of CA certificates the --relay trusts for an `amqps://` broker
    /// besides the system's roots.
    #[arg(long, env = "AMQP_CA_CERT")]
    pub ca_cert: Option<std::path::PathBuf>,
}

/// `dead-letters ...`.
#[derive(Clone, Debug, Subcommand)]
pub enum DeadLetterCommand {
    /// Lists dead letters, newest first.
    List {
        /// Which letters.
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: usize,
        /// Skip this many first (paging).
        #[arg(long, default_value_t = 0)]
        offset: usize,
    },
    /// Shows one dead letter: payload, headers, reason, error, attempts, failures, replays.
    Show {
        /// The letter's id.
        id: i64,
    },
    /// Groups dead letters by failure: reason, message type, error kind and first line.
    Groups {
        /// Which letters.
        #[command(flatten)]
        filter: FilterArgs,
    },
    /// Replays one letter (by id) or every letter matching the filter (needs --yes).
    Replay {
        /// One letter's id.
        id: Option<i64>,
        /// Which letters.
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many letters.
        #[arg(long)]
        limit: Option<usize>,
        /// Confirms a bulk replay.
        #[arg(long)]
        yes: bool,
    },
    /// Discards (archives) one letter or every letter matching the filter (needs --yes).
    Discard {
        /// One letter's id.
        id: Option<i64>,
        /// Which letters.
        #[command(flatten)]
        filter: FilterArgs,
        /// At most this many letters.
        #[arg(long)]
        limit: Option<usize>,
        /// Confirms a bulk discard.
        #[arg(long)]
        yes: bool,
    },
}

/// Which dead letters (every option narrows).
#[derive(Clone, Debug, Default, Args)]
pub struct FilterArgs {
    /// Only this consumer group.
    #[arg(long)]
    pub consumer_group: Option<String>,
    /// Only this reason (max_attempts, permanent, decode_error, key_collision,
    /// crash_loop, delivery_limit, no_handler, malformed).
    #[arg(long, value_parser = parse_reason)]
    pub reason: Option<DeadLetterReason>,
    /// Only this message type.
    #[arg(long = "type")]
    pub message_type: Option<String>,
    /// Only this message key.
    #[arg(long)]
    pub key: Option<String>,
    /// Only letters dead-lettered since: RFC 3339, or a duration ago (1h, 2d).
    #[arg(long)]
    pub since: Option<String>,
    /// Only letters dead-lettered before: RFC 3339, or a duration ago.
    #[arg(long)]
    pub until: Option<String>,
    /// Only this failure group (its fingerprint, from `dead-letters groups`).
    #[arg(long)]
    pub group: Option<String>,
    /// pending, replayed, discarded, or active (every letter not discarded: pending,
    /// replayed, or resolved by a rebuild). Default: active for list, pending for
    /// groups, replay and discard.
    #[arg(long, value_enum)]
    pub status: Option<StatusArg>,
}

/// A dead letter's status, as a filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum StatusArg {
    /// Neither replayed nor discarded.
    Pending,
    /// Replayed.
    Replayed,
    /// Discarded.
    Discarded,
    /// Pending or replayed.
    Active,
}

/// `claims ...`.
#[derive(Clone, Debug, Subcommand)]
pub enum ClaimCommand {
    /// Shows the claims of a message key, one per consumer group.
    Show {
        /// The message key.
        key: String,
        /// Only this consumer group.
        #[arg(long)]
        consumer_group: Option<String>,
    },
    /// Sends failed claims again whose retry copy was lost (due and unchanged for
    /// --overdue-for); needs --yes.
    Redrive {
        /// Only this consumer group.
        #[arg(long)]
        consumer_group: Option<String>,
        /// Only this message key.
        #[arg(long)]
        key: Option<String>,
        /// How long a retry must be overdue (50ms, 10s, 5m, ...).
        #[arg(long, default_value = "60s")]
        overdue_for: String,
        /// At most this many claims.
        #[arg(long)]
        limit: Option<usize>,
        /// Confirms the redrive.
        #[arg(long)]
        yes: bool,
    },
}

/// `groups ...`.
#[derive(Clone, Debug, Subcommand)]
pub enum GroupCommand {
    /// Lists the halted consumer groups: when, the message key, what was violated.
    List,
    /// Resumes a halted consumer group (fix the cause first): its running consumers
    /// resume at their next halt poll, without a restart. Exits 4 when the group is
    /// not halted.
    Resume {
        /// The consumer group.
        group: String,
    },
}

/// `verify`. Its `Debug` shows the broker URL with its password replaced by `***`.
#[derive(Clone, Default, Args)]
pub struct VerifyArgs {
    /// The broker; with it, the topology is checked too (password never printed).
    /// `amqps://` needs the feature `rustls` of inbox-cli. The nodes of a cluster:
    /// several URLs separated by whitespace or commas, tried in turn.
    #[arg(long, env = "AMQP_URL", hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// A PEM file of CA certificates trusted for an `amqps://` broker besides the
    /// system's roots.
    #[arg(long, env = "AMQP_CA_CERT")]
    pub ca_cert: Option<std::path::PathBuf>,
    /// The topic exchange the groups are bound to (without the prefix); checked when set.
    #[arg(long, env = "INBOX_EXCHANGE")]
    pub exchange: Option<String>,
    /// A consumer group to check (repeatable); default: every group with a claim.
    #[arg(long = "consumer-group")]
    pub consumer_groups: Vec<String>,
    /// The retry ladder of the consumers (50ms,200ms); default: the framework's.
    #[arg(long, env = "INBOX_RETRY_LADDER")]
    pub retry_ladder: Option<String>,
}

/// `purge`.
#[derive(Clone, Debug, Args)]
pub struct PurgeArgs {
    /// Keep published outbox rows this long.
    #[arg(long, default_value = "7d")]
    pub published: String,
    /// Keep done claims this long (at least --longest-retry).
    #[arg(long, default_value = "30d")]
    pub done_claims: String,
    /// Keep discarded dead letters this long.
    #[arg(long, default_value = "30d")]
    pub discarded: String,
    /// The longest retry delay of the consumers (the done-claim window may not be shorter).
    #[arg(long, default_value = "10m")]
    pub longest_retry: String,
    /// Rows per transaction.
    #[arg(long, default_value_t = 1000)]
    pub batch: usize,
    /// Count what would be deleted; delete nothing.
    #[arg(long)]
    pub dry_run: bool,
}

/// A dead-letter reason as stored (`max_attempts`, ...); any other text is refused
/// with the list of reasons (clap exits 2).
fn parse_reason(text: &str) -> Result<DeadLetterReason, String> {
    DeadLetterReason::parse(text).ok_or_else(|| {
        let known: Vec<&str> = DeadLetterReason::ALL.iter().map(|r| r.as_str()).collect();
        format!("expected one of {}", known.join(", "))
    })
}

#[cfg(test)]
mod global_args_tests {
    use diesel::SqliteConnection;

    use super::GlobalArgs;

    #[test]
    fn a_binarys_own_store_and_topology_come_from_the_commands_options() {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("app.db").display());
        let global = GlobalArgs {
            database_url: Some(url),
            prefix: "staging.".to_owned(),
            ..GlobalArgs::default()
        };
        let store = global.store_builder::<SqliteConnection>().unwrap().build();
        assert!(store.is_ok(), "{:?}", store.err());
        let topology = global.topology("shop").unwrap();
        assert_eq!(topology.exchange(), "staging.shop");
    }

    #[test]
    fn without_a_database_url_the_store_builder_says_which_option() {
        for url in [None, Some("  ".to_owned())] {
            let global = GlobalArgs {
                database_url: url,
                ..GlobalArgs::default()
            };
            match global.store_builder::<SqliteConnection>() {
                Err(inbox_diesel::Error::InvalidSetting { setting, .. }) => {
                    assert_eq!(setting, "database_url")
                }
                other => panic!("expected InvalidSetting, got {:?}", other.err()),
            }
        }
    }
}

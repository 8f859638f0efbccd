use std::collections::BTreeSet;
use std::time::Duration;

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Connection, ExchangeKind};

use inbox_core::{ConsumerGroup, RetryLadder};

use crate::connect::close_channel;
use crate::{Error, Result};

/// The `x-delivery-limit` of a group's dead-letter queue. Past it a message moves to
/// the group's parking queue `<group>:unreadable` (never dropped): a dead letter no
/// reader can parse ends there after a bounded number of tries.
const DLQ_DELIVERY_LIMIT: i64 = 50;

/// One consumer group's queues.
#[derive(Clone, Debug, PartialEq, Eq)]
struct GroupTopology {
    group: ConsumerGroup,
    message_types: BTreeSet<String>,
}

/// The broker objects the inbox consumes from, declared idempotently.
///
/// A topic exchange; per consumer group a durable quorum queue bound for the group's
/// message types, dead-lettering to `<group>:dlq` when the broker's delivery limit (a
/// backstop, well above the store's crash limit) is reached; a ladder of quorum
/// retry-tier queues `<group>:retry:<delay>` whose TTL dead-letters back to the
/// group's queue, at-least-once; `<group>:dlq` itself dead-letters to the parking
/// queue `<group>:unreadable` (no consumer: an operator inspects it) after 50
/// deliveries, what a dead letter no reader can even parse reaches. `:` is outside the group-name alphabet, so no group's
/// name is another group's tier or dead-letter queue. Every name takes an optional
/// prefix, so tests and tenants of one broker never collide.
///
/// ```
/// use inbox_amqp::Topology;
/// use inbox_core::ConsumerGroup;
/// let group = ConsumerGroup::new("billing.daily-usage")?;
/// let topology = Topology::new("billing")?.group(group.clone(), ["usage.recorded"]);
/// assert_eq!(topology.queue(&group), "billing.daily-usage");
/// assert_eq!(topology.dlq(&group), "billing.daily-usage:dlq");
/// assert_eq!(topology.unreadable(&group), "billing.daily-usage:unreadable");
/// assert_eq!(
///     topology.retry_queue(&group, std::time::Duration::from_secs(30)),
///     "billing.daily-usage:retry:30s"
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug)]
pub struct Topology {
    exchange: String,
    prefix: String,
    ladder: RetryLadder,
    delivery_limit: u32,
    queue_expires: Option<Duration>,
    initial_group_size: Option<u32>,
    groups: Vec<GroupTopology>,
}

fn check_name(setting: &'static str, name: &str, allow_empty: bool) -> Result<()> {
    if name.is_empty() && !allow_empty {
        return Err(Error::invalid(setting, "a non-empty name", "\"\""));
    }
    if name.len() > 200 {
        return Err(Error::invalid(
            setting,
            "at most 200 bytes",
            format_args!("{} bytes", name.len()),
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | 'A'..='Z' | '0'..='9' | '.' | '_' | '-'))
    {
        return Err(Error::invalid(
            setting,
            "only [A-Za-z0-9._-]",
            format_args!("{bad:?} in {name:?}"),
        ));
    }
    Ok(())
}

impl Topology {
    /// A topology publishing through the topic exchange `exchange`, with the default
    /// retry ladder (1 s, 5 s, 30 s, 2 min, 10 min) and a delivery limit of 20.
    pub fn new(exchange: impl Into<String>) -> Result<Self> {
        let exchange = exchange.into();
        check_name("exchange", &exchange, false)?;
        Ok(Self {
            exchange,
            prefix: String::new(),
            ladder: RetryLadder::default(),
            delivery_limit: 20,
            queue_expires: None,
            initial_group_size: None,
            groups: Vec::new(),
        })
    }

    /// Prefixes every queue and the exchange name (e.g. a test's own `t123.`).
    pub fn prefix(mut self, prefix: impl Into<String>) -> Result<Self> {
        let prefix = prefix.into();
        check_name("prefix", &prefix, true)?;
        self.prefix = prefix;
        Ok(self)
    }

    /// The retry tiers.
    pub fn ladder(mut self, ladder: RetryLadder) -> Self {
        self.ladder = ladder;
        self
    }

    /// The broker's `x-delivery-limit` on group queues: a backstop for crash loops,
    /// set well above the store's crash limit (default 20).
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit;
        self
    }

    /// `x-expires` on the group queues and dead-letter queues (never on retry tiers,
    /// which have no consumers and would vanish with copies in them). For tests.
    pub fn queue_expires(mut self, expires: Duration) -> Self {
        self.queue_expires = Some(expires);
        self
    }

    /// `x-quorum-initial-group-size` of every queue it creates: how many nodes of a
    /// cluster hold a replica of a new quorum queue (RabbitMQ's default is every
    /// node, up to its `quorum_cluster_size`; a size above the cluster's is capped to
    /// it). Off by default: nothing changes on one node.
    ///
    /// The group size only matters when a queue is created, but RabbitMQ compares it
    /// on every redeclaration and answers 406 PRECONDITION_FAILED to a mismatch: so a
    /// declaration refused over this argument alone is made again with the size the
    /// queue has (none, or the one the broker quotes). Turning the setting on (or
    /// off, or changing it) over queues that exist thus works, an existing queue
    /// keeps its replicas (grow or shrink them with `rabbitmq-queues add_member` /
    /// `grow`), and every other argument is still compared. Zero is refused when
    /// declaring, as [`Error::InvalidSetting`] (`quorum_initial_group_size`).
    pub fn quorum_initial_group_size(mut self, size: u32) -> Self {
        self.initial_group_size = Some(size);
        self
    }

    /// Adds a consumer group and the message types its queue is bound for.
    pub fn group<I, T>(mut self, group: ConsumerGroup, message_types: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let types = message_types.into_iter().map(Into::into);
        match self.groups.iter_mut().find(|g| g.group == group) {
            Some(existing) => existing.message_types.extend(types),
            None => self.groups.push(GroupTopology {
                group,
                message_types: types.collect(),
            }),
        }
        self
    }

    /// Adds every (group, message type) a store's handlers take (say
    /// [`InboxStore::routes`](inbox_core::InboxStore::routes)).
    pub fn with_routes(
        mut self,
        routes: impl IntoIterator<Item = (ConsumerGroup, String)>,
    ) -> Self {
        for (group, message_type) in routes {
            self = self.group(group, [message_type]);
        }
        self
    }

    /// The consumer groups.
    pub fn groups(&self) -> impl Iterator<Item = &ConsumerGroup> {
        self.groups.iter().map(|g| &g.group)
    }

    /// The retry ladder.
    pub fn retry_ladder(&self) -> &RetryLadder {
        &self.ladder
    }

    /// The exchange's name as the broker has it: the prefix, then the name given to
    /// [`Topology::new`].
    pub fn exchange(&self) -> String {
        format!("{}{}", self.prefix, self.exchange)
    }

    /// An outbox message to this topology's exchange, routed by its `message_type`
    /// (what the consumer groups bind): the one way to name the exchange that cannot
    /// disagree with the consumers, whatever the prefix.
    ///
    /// ```
    /// use inbox_amqp::Topology;
    /// use inbox_core::MessageKey;
    /// let topology = Topology::new("shop")?.prefix("staging.")?;
    /// let key = MessageKey::derive("shop", "order:1", "order.placed");
    /// let msg = topology.message(key, "order.placed", b"{}".to_vec());
    /// assert_eq!((msg.exchange.as_str(), msg.routing_key.as_str()), ("staging.shop", "order.placed"));
    /// # Ok::<(), inbox_amqp::Error>(())
    /// ```
    pub fn message(
        &self,
        key: inbox_core::MessageKey,
        message_type: impl Into<String>,
        payload: Vec<u8>,
    ) -> inbox_core::OutboxMessage {
        inbox_core::OutboxMessage::new(key, self.exchange(), message_type, payload)
    }

    /// The broker's `x-delivery-limit` on group queues.
    pub(crate) fn group_delivery_limit(&self) -> u32 {
        self.delivery_limit
    }

    /// The group's queue.
    pub fn queue(&self, group: &ConsumerGroup) -> String {
        format!("{}{}", self.prefix, group)
    }

    /// The group's retry tier for `delay` (the smallest tier not shorter).
    pub fn retry_queue(&self, group: &ConsumerGroup, delay: Duration) -> String {
        let tier = self.ladder.tier_for(delay);
        format!("{}:retry:{}", self.queue(group), RetryLadder::label(tier))
    }

    /// The group's dead-letter queue (messages over the delivery limit).
    pub fn dlq(&self, group: &ConsumerGroup) -> String {
        format!("{}:dlq", self.queue(group))
    }

    /// The group's parking queue: dead letters its `:dlq` reader failed to take in
    /// 50 deliveries (ones the client cannot parse). Nothing consumes it.
    pub fn unreadable(&self, group: &ConsumerGroup) -> String {
        format!("{}:unreadable", self.queue(group))
    }

    /// The dead-letter queue's arguments: a delivery limit (RabbitMQ 4 gives quorum
    /// queues a default of 20) past which a message moves, at-least-once, to the
    /// parking queue `unreadable`, never dropped.
    fn dlq_arguments(&self, unreadable: &str) -> FieldTable {
        let mut args = quorum();
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(DLQ_DELIVERY_LIMIT),
        );
        args.insert("x-dead-letter-exchange".into(), long(""));
        args.insert("x-dead-letter-routing-key".into(), long(unreadable));
        args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
        args.insert("x-overflow".into(), long("reject-publish"));
        self.expires(&mut args);
        args
    }

    fn expires(&self, args: &mut FieldTable) {
        if let Some(expires) = self.queue_expires {
            let ms = i64::try_from(expires.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-expires".into(), AMQPValue::LongLongInt(ms));
        }
    }

    /// Declares the exchange and every group's queues and bindings. Declaring twice
    /// is a no-op; declaring over objects with other arguments is
    /// [`Error::TopologyConflict`], naming the object and the argument.
    pub async fn declare(&self, connection: &Connection) -> Result<()> {
        self.declare_some(connection, |_| true).await
    }

    /// Declares the exchange and `group`'s queues and bindings only: what a
    /// connection serving that group needs.
    pub(crate) async fn declare_group(
        &self,
        connection: &Connection,
        group: &ConsumerGroup,
    ) -> Result<()> {
        self.declare_some(connection, |g| g == group).await
    }

    async fn declare_some(
        &self,
        connection: &Connection,
        wanted: impl Fn(&ConsumerGroup) -> bool,
    ) -> Result<()> {
        let exchange = self.exchange();
        let channel = connection.create_channel().await?;
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..ExchangeDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| conflict(&exchange, e))?;
        for g in self.groups.iter().filter(|g| wanted(&g.group)) {
            self.declare_group_queues(connection, &channel, g).await?;
        }
        close_channel(&channel, "declared").await;
        Ok(())
    }

    /// One group's queues, tiers and bindings (on `channel`).
    async fn declare_group_queues(
        &self,
        connection: &Connection,
        channel: &lapin::Channel,
        g: &GroupTopology,
    ) -> Result<()> {
        let exchange = self.exchange();
        let queue = self.queue(&g.group);
        let dlq = self.dlq(&g.group);
        let unreadable = self.unreadable(&g.group);

        let mut parking = quorum();
        self.expires(&mut parking);
        let size = self.initial_group_size;
        declare_queue(connection, &unreadable, parking, size).await?;
        declare_queue(connection, &dlq, self.dlq_arguments(&unreadable), size).await?;

        let mut args = quorum();
        args.insert("x-dead-letter-exchange".into(), long(""));
        args.insert("x-dead-letter-routing-key".into(), long(&dlq));
        args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
        args.insert("x-overflow".into(), long("reject-publish"));
        args.insert(
            "x-delivery-limit".into(),
            AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
        );
        self.expires(&mut args);
        declare_queue(connection, &queue, args, size).await?;

        for tier in self.ladder.tiers() {
            let name = format!("{queue}:retry:{}", RetryLadder::label(*tier));
            let mut args = quorum();
            let ttl = i64::try_from(tier.as_millis()).unwrap_or(i64::MAX);
            args.insert("x-message-ttl".into(), AMQPValue::LongLongInt(ttl));
            args.insert("x-dead-letter-exchange".into(), long(""));
            args.insert("x-dead-letter-routing-key".into(), long(&queue));
            args.insert("x-dead-letter-strategy".into(), long("at-least-once"));
            args.insert("x-overflow".into(), long("reject-publish"));
            declare_queue(connection, &name, args, size).await?;
        }

        for message_type in &g.message_types {
            channel
                .queue_bind(
                    queue.as_str().into(),
                    exchange.as_str().into(),
                    message_type.as_str().into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
        }
        Ok(())
    }
}

impl Topology {
    /// Every queue of the topology: each group's queue, dead-letter queue, parking
    /// queue and tiers.
    pub fn queues(&self) -> Vec<String> {
        let mut queues = Vec::new();
        for g in &self.groups {
            queues.push(self.queue(&g.group));
            queues.push(self.dlq(&g.group));
            queues.push(self.unreadable(&g.group));
            for tier in self.ladder.tiers() {
                queues.push(self.retry_queue(&g.group, *tier));
            }
        }
        queues
    }

    /// Checks, without creating anything, that the exchange (when `exchange`) and
    /// every queue of [`queues`](Self::queues) exist: passive declares, one channel
    /// each (a failed passive declare closes its channel). Returns the queues checked.
    ///
    /// An object that does not exist is [`Error::TopologyMissing`], naming it; any
    /// other answer of the broker is [`Error::Amqp`]. Arguments are not compared (a
    /// passive declare takes none): [`declare`](Self::declare) is what names a
    /// conflict. The operator CLI's `verify --amqp-url` runs this check.
    pub async fn check(&self, connection: &Connection, exchange: bool) -> Result<Vec<String>> {
        if exchange {
            let name = self.exchange();
            let channel = connection.create_channel().await?;
            channel
                .exchange_declare(
                    name.as_str().into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..ExchangeDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| missing("exchange", &name, e))?;
            close_channel(&channel, "verified").await;
        }
        let queues = self.queues();
        for queue in &queues {
            let channel = connection.create_channel().await?;
            channel
                .queue_declare(
                    queue.as_str().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..QueueDeclareOptions::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| missing("queue", queue, e))?;
            close_channel(&channel, "verified").await;
        }
        Ok(queues)
    }

    /// Deletes the exchange and every queue of the topology, messages included (a
    /// teardown for tests and for retiring a consumer group).
    pub async fn delete(&self, connection: &Connection) -> Result<()> {
        let channel = connection.create_channel().await?;
        for queue in self.queues() {
            channel
                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                .await?;
        }
        channel
            .exchange_delete(
                self.exchange().as_str().into(),
                ExchangeDeleteOptions::default(),
            )
            .await?;
        close_channel(&channel, "deleted").await;
        Ok(())
    }
}

fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert("x-queue-type".into(), long("quorum"));
    args
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s))
}

/// The argument whose value is a creation-time choice, never compared on purpose.
const GROUP_SIZE: &str = "x-quorum-initial-group-size";

/// Declares on a channel of its own: a conflicting declaration closes the channel.
///
/// `group_size`, when given, is sent as `x-quorum-initial-group-size`, which a new
/// queue is created with. RabbitMQ compares it on a redeclaration like any other
/// argument (406 `inequivalent arg 'x-quorum-initial-group-size' ... received the
/// value '3' of type 'long' but current is none`, and the other way round), yet it
/// only ever mattered when the queue was created: so a 406 that names it is answered
/// by declaring once more with the group size the queue has (none, or the value the
/// broker quotes), and any other argument is still compared.
async fn declare_queue(
    connection: &Connection,
    name: &str,
    args: FieldTable,
    group_size: Option<u32>,
) -> Result<()> {
    if group_size == Some(0) {
        return Err(Error::invalid(
            "quorum_initial_group_size",
            "one or more nodes",
            0,
        ));
    }
    let with_size = |size: Option<i64>| {
        let mut args = args.clone();
        if let Some(size) = size {
            args.insert(GROUP_SIZE.into(), AMQPValue::LongLongInt(size));
        }
        args
    };
    let asked = group_size.map(i64::from);
    match declare_once(connection, name, with_size(asked)).await {
        Err(Error::TopologyConflict { detail, .. }) if detail.contains(GROUP_SIZE) => {
            match current_group_size(&detail) {
                Some(current) if current != asked => {
                    declare_once(connection, name, with_size(current)).await
                }
                _ => Err(Error::TopologyConflict {
                    name: name.to_owned(),
                    detail,
                }),
            }
        }
        declared => declared,
    }
}

/// The group size a 406 about `x-quorum-initial-group-size` says the queue has:
/// `Some(None)` for `current is none`, `Some(Some(n))` for `current is the value
/// 'n'` (another type than asked) or `current is 'n'` (the same type), `None` when
/// the text says none of these.
fn current_group_size(detail: &str) -> Option<Option<i64>> {
    let current = &detail[detail.find("current is ")? + "current is ".len()..];
    if current.starts_with("none") {
        return Some(None);
    }
    let value = current.strip_prefix("the value ").unwrap_or(current);
    let value = value.strip_prefix('\'')?;
    let value = &value[..value.find('\'')?];
    value.parse().ok().map(Some)
}

/// One queue declaration on a channel of its own.
async fn declare_once(connection: &Connection, name: &str, args: FieldTable) -> Result<()> {
    let channel = connection.create_channel().await?;
    channel
        .queue_declare(
            ShortString::from(name),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            args,
        )
        .await
        .map_err(|e| conflict(name, e))?;
    close_channel(&channel, "declared").await;
    Ok(())
}

/// A PRECONDITION_FAILED (406) answer to a declaration is a conflict with what exists.
fn conflict(name: &str, err: lapin::Error) -> Error {
    let detail = err.to_string();
    if detail.contains("PRECONDITION_FAILED") || detail.contains("inequivalent arg") {
        Error::TopologyConflict {
            name: name.to_owned(),
            detail,
        }
    } else {
        Error::Amqp(err)
    }
}

/// A NOT_FOUND (404) answer to a passive declaration is a missing object.
fn missing(kind: &'static str, name: &str, err: lapin::Error) -> Error {
    match err.kind() {
        lapin::ErrorKind::ProtocolError(e) if e.get_id() == 404 => Error::TopologyMissing {
            kind,
            name: name.to_owned(),
            detail: err.to_string(),
        },
        _ => Error::Amqp(err),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_apart() {
        let g = ConsumerGroup::new("a.b").unwrap();
        let t = Topology::new("billing").unwrap().prefix("t1.").unwrap();
        assert_eq!(t.queue(&g), "t1.a.b");
        assert_eq!(t.exchange(), "t1.billing");
        assert_eq!(
            t.retry_queue(&g, Duration::from_millis(1500)),
            "t1.a.b:retry:5s"
        );
        assert_eq!(
            t.retry_queue(&g, Duration::from_secs(3600)),
            "t1.a.b:retry:10m"
        );
        assert!(matches!(
            Topology::new("bad name"),
            Err(Error::InvalidSetting {
                setting: "exchange",
                ..
            })
        ));
        assert!(matches!(
            t.clone().prefix("x:"),
            Err(Error::InvalidSetting {
                setting: "prefix",
                ..
            })
        ));
    }

    #[test]
    fn the_group_size_a_refusal_quotes_is_read() {
        let refusal = |tail: &str| {
            format!("PRECONDITION_FAILED - inequivalent arg 'x-quorum-initial-group-size' for queue 'q' in vhost '/': {tail}")
        };
        let read = |tail: &str| current_group_size(&refusal(tail));
        assert_eq!(
            read("received the value '3' of type 'long' but current is none"),
            Some(None)
        );
        assert_eq!(
            read("received none but current is the value '1' of type 'long'"),
            Some(Some(1))
        );
        assert_eq!(
            read("received the value '1' of type 'long' but current is the value '5' of type 'signedint'"),
            Some(Some(5))
        );
        assert_eq!(read("received '5' but current is '1'"), Some(Some(1)));
        assert_eq!(read("something else"), None);
        assert_eq!(
            read("received none but current is the value 'x' of type 'longstr'"),
            None
        );
    }

    #[test]
    fn the_dead_letter_queue_never_drops_by_delivery_limit() {
        let g = ConsumerGroup::new("a.b").unwrap();
        let t = Topology::new("billing").unwrap().group(g.clone(), ["t"]);
        let args = t.dlq_arguments(&t.unreadable(&g));
        let inner = args.inner();
        assert_eq!(inner.get("x-queue-type"), Some(&long("quorum")));
        // Past its bounded limit a message moves to the parking queue, at-least-once
        // (which the broker honours only with reject-publish), never dropped.
        assert_eq!(
            inner.get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(50))
        );
        assert_eq!(inner.get("x-dead-letter-exchange"), Some(&long("")));
        assert_eq!(
            inner.get("x-dead-letter-routing-key"),
            Some(&long("a.b:unreadable"))
        );
        assert_eq!(
            inner.get("x-dead-letter-strategy"),
            Some(&long("at-least-once"))
        );
        assert_eq!(inner.get("x-overflow"), Some(&long("reject-publish")));
        assert!(t.queues().contains(&"a.b:unreadable".to_owned()));
    }
}

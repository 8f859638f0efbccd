//! `Topology::quorum_initial_group_size`: off by default. RabbitMQ compares the
//! argument on redeclaration (406), yet it only matters when a queue is created:
//! turned on over queues that an earlier version declared without it, changed, or
//! turned off, the redeclaration still succeeds, while any other argument that
//! differs is still a conflict; a size of zero is refused.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use inbox_amqp::{Error, Topology};
use inbox_core::ConsumerGroup;
use inbox_test_support::amqp::{self, amqp_url, test_topology, unique_prefix, DeleteOnDrop};
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};

fn topology(prefix: &str) -> Topology {
    let group = ConsumerGroup::new("billing.group-size").unwrap();
    test_topology(prefix, &[200]).group(group, ["usage.recorded"])
}

/// What RabbitMQ answers when a quorum queue declared without the group size is
/// declared again with it: `None` when it accepts, the error's text when not. Told
/// so the report says which brokers compare the argument.
async fn raw_redeclare_with_group_size(conn: &lapin::Connection, name: &str) -> Option<String> {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let channel = conn.create_channel().await.unwrap();
    channel
        .queue_declare(name.into(), durable, args.clone())
        .await
        .unwrap();
    args.insert(
        "x-quorum-initial-group-size".into(),
        AMQPValue::LongLongInt(1),
    );
    let again = conn.create_channel().await.unwrap();
    let answered = again.queue_declare(name.into(), durable, args).await.err();
    channel
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    answered.map(|e| e.to_string())
}

#[test]
fn turning_the_group_size_on_over_existing_queues_redeclares_them() {
    let Some(url) = amqp_url() else { return };
    let prefix = unique_prefix("group-size");
    let before = topology(&prefix);
    let _delete = DeleteOnDrop::new(url.clone(), before.clone());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let conn = amqp::connect(&url).await;
        let raw = format!("{prefix}raw");
        match raw_redeclare_with_group_size(&conn, &raw).await {
            None => eprintln!("this broker accepts a group size added on redeclaration"),
            Some(err) => {
                eprintln!("this broker refuses a group size added on redeclaration: {err}")
            }
        }
        // Declared as a topology without the setting declares (every version before it).
        before.declare(&conn).await.unwrap();
        // The same queues, the setting on: redeclared as they are, twice.
        let after = before.clone().quorum_initial_group_size(3);
        after.declare(&conn).await.unwrap();
        after.declare(&conn).await.unwrap();
        // Another size, and off again.
        before
            .clone()
            .quorum_initial_group_size(1)
            .declare(&conn)
            .await
            .unwrap();
        before.declare(&conn).await.unwrap();
    });
}

#[test]
fn new_queues_are_created_with_the_group_size_and_redeclared() {
    let Some(url) = amqp_url() else { return };
    let prefix = unique_prefix("group-size-new");
    let sized = topology(&prefix).quorum_initial_group_size(1);
    let _delete = DeleteOnDrop::new(url.clone(), sized.clone());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let conn = amqp::connect(&url).await;
        sized.declare(&conn).await.unwrap();
        sized.declare(&conn).await.unwrap();
        sized.check(&conn, true).await.unwrap();
        // Another size, and none: the queues are as they were created.
        sized.clone().quorum_initial_group_size(5).declare(&conn).await.unwrap();
        topology(&prefix).declare(&conn).await.unwrap();
        // Another argument that differs is still a conflict.
        let other = sized.clone().delivery_limit(7).declare(&conn).await;
        assert!(
            matches!(&other, Err(Error::TopologyConflict { detail, .. }) if detail.contains("x-delivery-limit")),
            "{other:?}"
        );
    });
}

#[test]
fn a_group_size_of_zero_is_refused() {
    let Some(url) = amqp_url() else { return };
    let prefix = unique_prefix("group-size-zero");
    let zero = topology(&prefix).quorum_initial_group_size(0);
    let _delete = DeleteOnDrop::new(url.clone(), zero.clone());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let declared = runtime.block_on(async { zero.declare(&amqp::connect(&url).await).await });
    assert!(
        matches!(
            &declared,
            Err(Error::InvalidSetting {
                setting: "quorum_initial_group_size",
                ..
            })
        ),
        "{declared:?}"
    );
}

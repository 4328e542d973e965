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
    let cache = WatchCache::new(api.clone(), watcher::Config::default().labels("app=x"));

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

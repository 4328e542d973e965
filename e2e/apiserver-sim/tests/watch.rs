//! WATCH semantics through kube-rs: resume, initial state, bookmarks, timeouts, selectors,
//! 410 Gone, and kube-runtime's watcher recovering by relisting.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use common::{create_ns, eventually, fast_config, start, start_with};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::{WatchStreamExt, reflector, watcher};
use serde_json::json;

fn cm(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}})).unwrap()
}

/// A simulator keeping only the last `window` events for watches, and its namespace `w`.
async fn with_watch_window(window: usize) -> (Sim, Api<ConfigMap>) {
    let sim = start_with(SimConfig {
        watch_window: window,
        ..fast_config()
    })
    .await;
    let api = configmaps_in_w(&sim).await;
    (sim, api)
}

/// Creates the ConfigMap `name` through `api`.
async fn create(api: &Api<ConfigMap>, name: &str) -> ConfigMap {
    api.create(&PostParams::default(), &cm(name)).await.unwrap()
}

/// The simulator's `w` namespace, created, and the ConfigMaps in it.
async fn configmaps_in_w(sim: &Sim) -> Api<ConfigMap> {
    let client = sim.client();
    create_ns(&client, "w").await;
    Api::namespaced(client, "w")
}

/// kube-runtime's watcher on `api` with `config`, feeding a reflector's store; errors (410s) are
/// left to the watcher, which recovers by itself on the next poll. Abort the task to stop it.
fn reflect(
    api: &Api<ConfigMap>,
    config: watcher::Config,
) -> (reflector::Store<ConfigMap>, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store::<ConfigMap>();
    let stream = reflector(writer, watcher(api.clone(), config))
        .touched_objects()
        .boxed();
    (reader, tokio::spawn(stream.for_each(|_| async {})))
}

/// Waits until the reflector's store holds `len` objects.
async fn store_holds(reader: &reflector::Store<ConfigMap>, len: usize, what: &str) {
    eventually(what, || {
        let reader = reader.clone();
        async move { reader.state().len() == len }
    })
    .await;
}

async fn next_event(
    stream: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<ConfigMap>>> + Unpin),
) -> WatchEvent<ConfigMap> {
    tokio::time::timeout(Duration::from_secs(20), stream.next())
        .await
        .expect("event within 20s")
        .expect("stream still open")
        .expect("event decodes")
}

fn describe(ev: &WatchEvent<ConfigMap>) -> String {
    match ev {
        WatchEvent::Added(o) => format!("ADDED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Modified(o) => format!("MODIFIED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Deleted(o) => format!("DELETED {}", o.metadata.name.clone().unwrap()),
        WatchEvent::Bookmark(_) => "BOOKMARK".into(),
        WatchEvent::Error(e) => format!("ERROR {} {}", e.code, e.reason),
    }
}

#[tokio::test]
async fn resume_from_resource_version() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    let first = create(&api, "a").await;
    let rv = first.metadata.resource_version.clone().unwrap();
    create(&api, "b").await;
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"x": "1"}})),
    )
    .await
    .unwrap();
    api.delete("b", &DeleteParams::default()).await.unwrap();

    let mut stream = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(describe(&next_event(&mut stream).await));
    }
    assert_eq!(seen, vec!["ADDED b", "MODIFIED a", "DELETED b"]);
    // Live events follow.
    create(&api, "c").await;
    assert_eq!(describe(&next_event(&mut stream).await), "ADDED c");
    sim.shutdown().await;
}

#[tokio::test]
async fn resource_version_zero_sends_current_state() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    for n in ["a", "b"] {
        create(&api, n).await;
    }
    let mut stream = api
        .watch(&WatchParams::default(), "0")
        .await
        .unwrap()
        .boxed();
    let mut seen = vec![
        describe(&next_event(&mut stream).await),
        describe(&next_event(&mut stream).await),
    ];
    seen.sort();
    assert_eq!(seen, vec!["ADDED a", "ADDED b"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn bookmarks_and_timeout() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    let c = create(&api, "a").await;
    let rv = c.metadata.resource_version.unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(2), &rv)
        .await
        .unwrap()
        .boxed();
    match next_event(&mut stream).await {
        WatchEvent::Bookmark(b) => {
            assert!(
                b.metadata.resource_version.parse::<u64>().unwrap() >= rv.parse::<u64>().unwrap()
            );
        }
        other => panic!("expected a bookmark, got {}", describe(&other)),
    }
    // timeoutSeconds=2 ends the stream.
    let ended = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(ev) = stream.next().await {
            ev.unwrap();
        }
    })
    .await;
    assert!(ended.is_ok(), "the watch ends after timeoutSeconds");
    sim.shutdown().await;
}

#[tokio::test]
async fn label_selector_watch_turns_updates_into_add_and_delete() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    let c = create(&api, "a").await;
    let rv = c.metadata.resource_version.unwrap();
    let mut stream = api
        .watch(&WatchParams::default().labels("app=web"), &rv)
        .await
        .unwrap()
        .boxed();
    let label = |v: serde_json::Value| Patch::Merge(json!({"metadata": {"labels": {"app": v}}}));
    api.patch("a", &PatchParams::default(), &label(json!("web")))
        .await
        .unwrap();
    api.patch("a", &PatchParams::default(), &label(json!("web")))
        .await
        .unwrap();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"data": {"k": "v"}})),
    )
    .await
    .unwrap();
    api.patch("a", &PatchParams::default(), &label(json!("db")))
        .await
        .unwrap();
    let seen: Vec<String> = vec![
        describe(&next_event(&mut stream).await),
        describe(&next_event(&mut stream).await),
        describe(&next_event(&mut stream).await),
    ];
    assert_eq!(seen, vec!["ADDED a", "MODIFIED a", "DELETED a"]);
    sim.shutdown().await;
}

#[tokio::test]
async fn too_old_resource_version_is_gone() {
    let (sim, api) = with_watch_window(5).await;
    let c = create(&api, "a").await;
    let old_rv = c.metadata.resource_version.unwrap();
    for i in 0..10 {
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"i": i.to_string()}})),
        )
        .await
        .unwrap();
    }
    let mut stream = api
        .watch(&WatchParams::default(), &old_rv)
        .await
        .unwrap()
        .boxed();
    match next_event(&mut stream).await {
        WatchEvent::Error(e) => {
            assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
            assert!(
                e.message
                    .starts_with(&format!("too old resource version: {old_rv} (")),
                "{}",
                e.message
            );
        }
        other => panic!("expected 410, got {}", describe(&other)),
    }
    sim.shutdown().await;
}

/// kube-runtime's watcher must recover on its own from a 410 by relisting.
#[tokio::test]
async fn watcher_relists_after_gone() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    create(&api, "before").await;
    // The watcher's first watch gets 410 Gone; it must relist and watch again.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1,
        FaultKind::WatchGone,
    ));
    let (reader, task) = reflect(&api, watcher::Config::default());
    eventually("relist after 410", || async {
        sim.request_count("list", "configmaps") >= 2
    })
    .await;
    eventually("second watch", || async {
        sim.request_count("watch", "configmaps") >= 2
    })
    .await;
    create(&api, "after").await;
    store_holds(&reader, 2, "store converges").await;
    task.abort();
    sim.shutdown().await;
}

/// A watch window of 3 events (what the simulator keeps to resume a watch from): the watcher
/// converges on 30 objects created in a row, whether or not one of its watches fell behind and
/// was answered 410 on the way (`watcher_relists_after_gone` makes sure of the 410 path).
#[tokio::test]
async fn watcher_converges_with_tiny_window() {
    let (sim, api) = with_watch_window(3).await;
    let (reader, task) = reflect(&api, watcher::Config::default());
    for i in 0..30 {
        create(&api, &format!("c{i}")).await;
    }
    store_holds(&reader, 30, "store has all 30").await;
    task.abort();
    sim.shutdown().await;
}

#[tokio::test]
async fn close_watches_ends_streams_and_watcher_resumes_without_relist() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    let rv = sim.resource_version().to_string();
    let stream = api.watch(&WatchParams::default(), &rv).await.unwrap();
    sim.close_watches();
    let rest: Vec<_> = tokio::time::timeout(Duration::from_secs(20), stream.collect::<Vec<_>>())
        .await
        .expect("stream ends after close_watches");
    assert!(rest.is_empty());

    let (reader, task) = reflect(&api, watcher::Config::default());
    eventually("watching", || async {
        sim.request_count("watch", "configmaps") >= 2
    })
    .await;
    let lists = sim.request_count("list", "configmaps");
    sim.close_watches();
    eventually("re-watch", || async {
        sim.request_count("watch", "configmaps") >= 3
    })
    .await;
    create(&api, "after-close").await;
    store_holds(&reader, 1, "store sees the new object").await;
    assert_eq!(
        sim.request_count("list", "configmaps"),
        lists,
        "resumed, not relisted"
    );

    // Dropping connections: the next request reconnects transparently.
    sim.drop_connections();
    create(&api, "after-drop").await;
    store_holds(&reader, 2, "store sees the object after reconnect").await;
    task.abort();
    sim.shutdown().await;
}

/// kube-runtime's streaming-list strategy (sendInitialEvents + the initial-events-end bookmark).
#[tokio::test]
async fn watcher_streaming_list() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    for n in ["a", "b", "c"] {
        create(&api, n).await;
    }
    let (reader, task) = reflect(&api, watcher::Config::default().streaming_lists());
    eventually("watch open", || async {
        sim.open_watches("configmaps") == 1
    })
    .await;
    let ready = tokio::time::timeout(Duration::from_secs(20), reader.wait_until_ready()).await;
    assert!(ready.is_ok(), "initial events end is recognised");
    assert_eq!(reader.state().len(), 3);
    assert_eq!(
        sim.request_count("list", "configmaps"),
        0,
        "no LIST with streaming lists"
    );
    create(&api, "d").await;
    store_holds(&reader, 4, "live event after the initial stream").await;
    task.abort();
    eventually("watch closed once the client is gone", || async {
        sim.open_watches("configmaps") == 0
    })
    .await;
    sim.shutdown().await;
}

/// `Backdoor::delete_unseen`: the object is gone (GET, LIST) but no watch hears of it; the
/// next change is the next event, and a watch resumed from before it still does not see it.
#[tokio::test]
async fn a_delete_unseen_sends_no_event() {
    let sim = start().await;
    let api = configmaps_in_w(&sim).await;
    let first = create(&api, "a").await;
    let rv = first.metadata.resource_version.clone().unwrap();
    let mut live = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    sim.backdoor()
        .delete_unseen("configmaps", "w", "a")
        .unwrap()
        .expect("it existed");
    assert!(api.get_opt("a").await.unwrap().is_none());
    assert!(
        api.list(&Default::default())
            .await
            .unwrap()
            .items
            .is_empty()
    );
    create(&api, "b").await;
    assert_eq!(describe(&next_event(&mut live).await), "ADDED b");
    let mut resumed = api
        .watch(&WatchParams::default(), &rv)
        .await
        .unwrap()
        .boxed();
    assert_eq!(describe(&next_event(&mut resumed).await), "ADDED b");
    assert!(
        sim.backdoor()
            .delete_unseen("configmaps", "w", "a")
            .unwrap()
            .is_none()
    );
    sim.shutdown().await;
}

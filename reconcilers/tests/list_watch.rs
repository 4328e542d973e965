//! The caches' list+watch against the in-process simulator: paged lists, watches resumed from
//! the last version seen (bookmarks included), relists on `410 Gone`, undecodable events and
//! over-long lines reported.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use common::sim;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::watcher::{self, Event};
use reconcilers::list_watch::{ListWatch, ListWatchError, MAX_LINE_BYTES};
use tokio::sync::mpsc;

fn config_map(name: &str, labelled: bool) -> ConfigMap {
    let labels = if labelled {
        serde_json::json!({"app": "x"})
    } else {
        serde_json::json!({})
    };
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "data": {"v": "1"}
    }))
    .unwrap()
}

fn describe(item: &Result<Event<ConfigMap>, ListWatchError>) -> String {
    let name = |cm: &ConfigMap| cm.metadata.name.clone().unwrap_or_default();
    match item {
        Ok(Event::Init) => "init".to_owned(),
        Ok(Event::InitApply(cm)) => format!("init-apply {}", name(cm)),
        Ok(Event::InitDone) => "init-done".to_owned(),
        Ok(Event::Apply(cm)) => format!("apply {}", name(cm)),
        Ok(Event::Delete(cm)) => format!("delete {}", name(cm)),
        Err(err) => format!("error: {err}"),
    }
}

/// The stream's items, described, from a task that polls it as a cache's task does (bookmarks
/// are read only while the stream is polled).
struct Driven {
    items: mpsc::UnboundedReceiver<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Driven {
    fn start(api: &Api<ConfigMap>, config: watcher::Config) -> Self {
        let mut list_watch = ListWatch::new(api.clone(), config);
        let (tx, items) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            loop {
                let item = list_watch.next().await;
                if tx.send(describe(&item)).is_err() {
                    return;
                }
            }
        });
        Driven { items, task }
    }

    async fn next(&mut self) -> String {
        // A guard against a hang only: events are counted, not timed.
        tokio::time::timeout(Duration::from_secs(120), self.items.recv())
            .await
            .expect("an item within two minutes")
            .unwrap()
    }

    async fn expect(&mut self, want: &[&str]) {
        for want in want {
            assert_eq!(self.next().await, *want);
        }
    }

    /// The next item that is not an error, after at least one error containing `error`.
    async fn expect_error(&mut self, error: &str) -> String {
        let first = self.next().await;
        assert!(
            first.starts_with("error: ") && first.contains(error),
            "{first:?} is not an error naming {error:?}"
        );
        self.skip_errors().await.0
    }

    /// The next item that is not an error, and the errors before it.
    async fn skip_errors(&mut self) -> (String, Vec<String>) {
        let mut errors = Vec::new();
        loop {
            let item = self.next().await;
            if !item.starts_with("error: ") {
                return (item, errors);
            }
            errors.push(item);
        }
    }
}

impl Drop for Driven {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn create(api: &Api<ConfigMap>, name: &str, labelled: bool) {
    api.create(&PostParams::default(), &config_map(name, labelled))
        .await
        .unwrap();
}

fn lists(sim: &Sim) -> usize {
    sim.request_count("list", "configmaps")
}

#[tokio::test]
async fn lists_in_pages_then_watches_resuming_where_it_left_off() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    for name in ["a", "b", "c", "d", "e"] {
        create(&api, name, true).await;
    }
    create(&api, "other", false).await;
    sim.clear_requests();

    let config = watcher::Config::default().labels("app=x").page_size(2);
    let mut driven = Driven::start(&api, config);
    driven
        .expect(&[
            "init",
            "init-apply a",
            "init-apply b",
            "init-apply c",
            "init-apply d",
            "init-apply e",
            "init-done",
        ])
        .await;
    assert_eq!(lists(&sim), 3, "five objects in pages of two");

    // Each watch ends after one event: the next resumes after it, so every change comes once.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        3,
        FaultKind::CutWatchAfterEvents { events: 1 },
    ));
    for name in ["f", "g", "h"] {
        create(&api, name, true).await;
    }
    driven.expect(&["apply f", "apply g", "apply h"]).await;
    api.delete("f", &DeleteParams::default()).await.unwrap();
    driven.expect(&["delete f"]).await;
    assert_eq!(lists(&sim), 3, "resumed without listing again");
    assert!(sim.request_count("watch", "configmaps") >= 4);
}

#[tokio::test]
async fn a_bookmark_moves_the_version_a_watch_resumes_from() {
    // Five events kept: a watch resumed from the list's version after more changes is gone.
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["default".into()],
        watch_window: 5,
        bookmark_interval: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    create(&api, "a", true).await;
    let mut driven = Driven::start(&api, watcher::Config::default().labels("app=x"));
    driven.expect(&["init", "init-apply a", "init-done"]).await;
    // Changes the watch does not select, past the window; its bookmarks follow them.
    for n in 0..10 {
        create(&api, &format!("other-{n}"), false).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.close_watches();
    create(&api, "b", true).await;
    driven.expect(&["apply b"]).await;
    assert_eq!(
        lists(&sim),
        1,
        "resumed from the bookmark, not listed again"
    );
}

#[tokio::test]
async fn a_gone_event_lists_again() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    create(&api, "a", true).await;
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1,
        FaultKind::WatchGone,
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-apply a", "init-done"]).await;
    let next = driven
        .expect_error("error returned by apiserver during watch")
        .await;
    assert_eq!(next, "init");
    driven.expect(&["init-apply a", "init-done"]).await;
    assert_eq!(lists(&sim), 2);
}

#[tokio::test]
async fn a_gone_answer_to_a_watch_lists_again() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    create(&api, "a", true).await;
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1,
        FaultKind::Error {
            code: 410,
            retry_after_seconds: None,
        },
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-apply a", "init-done"]).await;
    let next = driven.expect_error("failed to start watching").await;
    assert_eq!(next, "init", "not the same gone version again");
    driven.expect(&["init-apply a", "init-done"]).await;
    create(&api, "b", true).await;
    driven.expect(&["apply b"]).await;
}

#[tokio::test]
async fn another_error_answer_to_a_watch_retries_the_watch() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        2,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-done"]).await;
    let first = driven.next().await;
    assert!(first.contains("failed to start watching"), "{first}");
    create(&api, "a", true).await;
    let (next, errors) = driven.skip_errors().await;
    assert_eq!(next, "apply a", "the watch started from the listed version");
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(lists(&sim), 1);
}

#[tokio::test]
async fn an_event_that_does_not_decode_is_reported_and_lists_again() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    create(&api, "a", true).await;
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-apply a", "init-done"]).await;
    // A number where the kind has a string: a restored etcd or a newer apiserver could serve it.
    sim.backdoor()
        .put(serde_json::json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "a", "namespace": "default"},
            "data": {"v": 5}
        }))
        .unwrap();
    let first = driven.next().await;
    assert!(
        first.starts_with("error: a watch event could not be decoded"),
        "{first}"
    );
    assert_eq!(driven.next().await, "init");
    // The list fails on the same object until it is readable again.
    sim.backdoor()
        .put(serde_json::to_value(config_map("a", true)).unwrap())
        .unwrap();
    loop {
        let item = driven.next().await;
        if item == "init-apply a" {
            break;
        }
        assert!(
            item.starts_with("error: failed to perform initial object list"),
            "{item}"
        );
    }
    driven.expect(&["init-done"]).await;
}

#[tokio::test]
async fn an_event_over_the_line_bound_ends_the_watch_naming_the_bound() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("configmaps"),
        1,
        FaultKind::HugeWatchEvent {
            bytes: u64::try_from(MAX_LINE_BYTES).unwrap() + 1024,
        },
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-done"]).await;
    assert_eq!(
        driven.next().await,
        format!("error: a watch event exceeded {MAX_LINE_BYTES} bytes (the limit for one event)")
    );
    create(&api, "a", true).await;
    driven.expect(&["apply a"]).await;
    assert_eq!(lists(&sim), 1, "the watch resumed: nothing was lost");
}

#[tokio::test]
async fn a_field_selector_names_the_one_object() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    for name in ["a", "b"] {
        create(&api, name, true).await;
    }
    let config = watcher::Config::default().fields("metadata.name=b");
    let mut driven = Driven::start(&api, config);
    driven.expect(&["init", "init-apply b", "init-done"]).await;
    api.delete("a", &DeleteParams::default()).await.unwrap();
    create(&api, "c", true).await;
    api.delete("b", &DeleteParams::default()).await.unwrap();
    driven.expect(&["delete b"]).await;
}

#[tokio::test]
async fn a_server_that_ends_every_watch_at_once_is_watched_again_only_after_a_pause() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Watch),
        Some("configmaps"),
        1.0,
        FaultKind::CutWatchAfter { millis: 0 },
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    driven.expect(&["init", "init-done"]).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Pauses from 800 ms doubling: at most four watches in 3 s however fast the machine is;
    // without them, as many as the machine can send.
    let watches = sim.request_count("watch", "configmaps");
    assert!((1..=4).contains(&watches), "{watches} watches in 3 s");
    sim.faults().clear();
    create(&api, "a", true).await;
    driven.expect(&["apply a"]).await;
    assert_eq!(lists(&sim), 1, "an empty watch is no reason to list again");
}

#[tokio::test]
async fn a_list_that_keeps_failing_is_retried_after_pauses_that_grow() {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    sim.faults().inject(FaultRule::probability(
        Some(Verb::List),
        Some("configmaps"),
        1.0,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Pauses from 800 ms doubling (jitter adds up to as much again): lists at 0, by 1.6 s, by
    // 4.8 s, then not before 5.6 s; at most three in 5 s however fast the machine is. A pause
    // that never grew (0.8 to 1.6 s each) would have sent at least four.
    let failed = lists(&sim);
    assert!((1..=3).contains(&failed), "{failed} lists in 5 s");
    sim.faults().clear();
    loop {
        match driven.next().await.as_str() {
            "init-done" => break,
            item => assert!(item == "init" || item.starts_with("error: "), "{item}"),
        }
    }
}

/// How many LISTs a list+watch sends in 5 s when every watch answers with `fault`, each of which
/// forces a new LIST; then the watch is healthy again and the list+watch catches up.
async fn lists_in_five_seconds_when_every_watch_forces_one(fault: FaultKind) -> usize {
    let sim = sim().await;
    let api: Api<ConfigMap> = Api::namespaced(sim.client(), "default");
    create(&api, "a", true).await;
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Watch),
        Some("configmaps"),
        1.0,
        fault,
    ));
    let mut driven = Driven::start(&api, watcher::Config::default());
    tokio::time::sleep(Duration::from_secs(5)).await;
    let forced = lists(&sim);
    sim.faults().clear();
    create(&api, "b", true).await;
    loop {
        let item = driven.next().await;
        if item == "apply b" || item == "init-apply b" {
            break;
        }
    }
    forced
}

// Every list in these succeeds and yields objects, which reset the backoff of other errors; the
// forced LISTs' pauses grow regardless (800 ms doubling, jitter adding up to as much again):
// lists at 0, then not before 0.8 s, 2.4 s and 5.6 s, so at most three in 5 s however fast the
// machine is. Pauses reset by each list (0.8 to 1.6 s each) would have sent at least four.

#[tokio::test]
async fn a_server_whose_every_watch_is_gone_is_listed_again_after_pauses_that_grow() {
    let forced = lists_in_five_seconds_when_every_watch_forces_one(FaultKind::WatchGone).await;
    assert!((1..=3).contains(&forced), "{forced} lists in 5 s");
}

#[tokio::test]
async fn a_server_whose_every_watch_sends_an_undecodable_event_is_listed_again_after_pauses_that_grow()
 {
    let forced =
        lists_in_five_seconds_when_every_watch_forces_one(FaultKind::UndecodableWatchEvent).await;
    assert!((1..=3).contains(&forced), "{forced} lists in 5 s");
}

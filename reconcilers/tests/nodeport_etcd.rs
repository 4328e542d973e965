//! The NodePort repair's etcd mode against a real etcd (Debian's `etcd-server`, started by each
//! test on free loopback ports) and the in-process API simulator: the bitmap repaired as
//! upstream does, written only by compare-and-swap, left alone when it cannot be trusted or is
//! stored under another range than the configured one (rebuilt only when the operator opts in).

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use apiserver_sim::{FaultKind, FaultRule, Sim, Verb};
use common::etcd::{Etcd, Pki};
use fixedbitset::FixedBitSet;
use futures::StreamExt;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::alloc::PortRange;
use reconcilers::budget::{BudgetLimits, CacheBudget};
use reconcilers::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use reconcilers::legacy_alloc::etcd::{
    EtcdConfig, EtcdError, EtcdStore, KeyCache, MAX_VALUE_BYTES, RangeKey, Stored,
};
use reconcilers::nodeport_repair::{self, NodePortRepairLoop};
use reconcilers::section::Settings;
use reconcilers::watch_cache::WatchCache;
use serde_json::json;

const KEY: &str = "/registry/ranges/servicenodeports";

fn range() -> PortRange {
    PortRange::default()
}

/// `serviceNodePortRange` [`range`], in etcd mode with `etcd`.
fn settings(etcd: EtcdConfig) -> Settings {
    Settings {
        node_port_range: range(),
        etcd,
        ..common::settings(&[])
    }
}

fn bitmap(ports: &[u16]) -> Vec<u8> {
    let mut bits = FixedBitSet::with_capacity(range().size());
    for port in ports {
        bits.insert(usize::from(port - range().base()));
    }
    bitmap_to_bytes(&bits)
}

fn ports_of(value: &[u8]) -> Vec<u16> {
    let decoded = RangeAllocation::decode(value).unwrap();
    bitmap_from_bytes(&decoded.data, range().size())
        .ones()
        .map(|offset| range().base() + u16::try_from(offset).unwrap())
        .collect()
}

fn put_service(sim: &Sim, name: &str, node_port: i32) {
    sim.backdoor()
        .put(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"type": "NodePort", "ports": [{"port": 80, "protocol": "TCP", "nodePort": node_port}]}
        }))
        .unwrap();
}

/// A NodePort repair in etcd mode whose Service cache is fed in the background.
struct Harness {
    repair: Arc<NodePortRepairLoop>,
    registry: Registry,
    _cache: tokio::task::JoinHandle<()>,
}

impl Harness {
    /// Another pass finds nothing and leaves the stored `value` as it is.
    async fn settled_at(&self, sim: &Sim, store: &EtcdStore, value: &Stored) {
        let second = self.pass(sim, false).await.unwrap();
        assert!(second.drift.is_empty(), "{second:?}");
        assert_eq!(&store.get(KEY).await.unwrap().unwrap(), value);
    }

    async fn start(sim: &Sim, etcd: EtcdConfig, interval: Duration) -> Self {
        Self::start_with(sim, etcd, interval, false).await
    }

    /// `rebuild`: `rebuildBitmapOnRangeChange`.
    async fn start_with(sim: &Sim, etcd: EtcdConfig, interval: Duration, rebuild: bool) -> Self {
        let section = nodeport_repair::Section {
            interval,
            // Sightings of a leak count when an interval apart in these tests.
            leak_sighting_spacing: interval,
            page_size: 500,
            rebuild_bitmap_on_range_change: rebuild,
            ..nodeport_repair::Section::default()
        };
        Self::start_within(sim, settings(etcd), section, CacheBudget::default()).await
    }

    /// With `settings` and `section` as they are.
    async fn start_within(
        sim: &Sim,
        settings: Settings,
        section: nodeport_repair::Section,
        budget: CacheBudget,
    ) -> Self {
        let mut registry = Registry::default();
        let services = WatchCache::every(sim.client(), section.page_size, &budget);
        let repair = Arc::new(NodePortRepairLoop::new(
            sim.client(),
            section,
            &settings,
            reconcilers::kubernetes_service::Section::default().service(),
            Some(services),
            &mut registry,
        ));
        let mut triggers = repair.triggers();
        let cache = triggers.remove(0);
        let task = tokio::spawn(cache.for_each(|()| async {}));
        Harness {
            repair,
            registry,
            _cache: task,
        }
    }

    /// The value of `bootstrap_nodeport_repair_port_errors_total{type}`.
    fn errors(&self, error_type: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).unwrap();
        let series = format!("type=\"{error_type}\"}}");
        text.lines()
            .filter(|line| line.contains("port_errors_total") && line.contains(&series))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// One pass, once the Service cache has synced.
    async fn pass(
        &self,
        sim: &Sim,
        dry_run: bool,
    ) -> Result<reconcilers::PassReport, reconcilers::LoopError> {
        let ctx = common::ctx(sim, dry_run);
        for _ in 0..100 {
            match self.repair.reconcile(&ctx).await {
                Err(reconcilers::LoopError::NotSynced(_)) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                other => return other,
            }
        }
        panic!("the Service cache never synced");
    }
}

/// A real etcd, a client of it and the simulator, started for one test; bound in this order,
/// they drop the simulator first and etcd last.
async fn etcd_and_sim() -> (Etcd, EtcdStore, Sim) {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    (etcd, store, common::sim().await)
}

/// Writes the bitmap's first value: the key must not exist yet.
async fn store_first(store: &EtcdStore, value: Vec<u8>) {
    assert!(store.compare_and_swap(KEY, None, value).await.unwrap());
}

fn kinds(report: &reconcilers::PassReport) -> Vec<&'static str> {
    report.drift.iter().map(|drift| drift.kind).collect()
}

#[tokio::test]
async fn missing_allocations_are_set_and_leaks_released_on_the_third_sighting() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    put_service(&sim, "db", 30081);
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[30081, 30500]));
    store_first(&store, stored.encode()).await;

    // Sightings count when an interval apart: 1 ms here, so each pass is one.
    let harness = Harness::start(&sim, etcd.config(), Duration::from_millis(1)).await;
    let first = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&first), vec!["nodeport_not_allocated"]);
    assert!(first.drift[0].applied);
    assert_eq!(first.drift[0].object, "Service/default/web");
    assert_eq!(
        first.drift[0].change(),
        reconcilers::Change {
            was: format!("node port 30080 free in {KEY}"),
            became: format!("node port 30080 allocated in {KEY}"),
        }
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30080, 30081, 30500]);

    tokio::time::sleep(Duration::from_millis(5)).await;
    let second = harness.pass(&sim, false).await.unwrap();
    assert!(second.drift.is_empty(), "{second:?}");
    assert_eq!(
        store.get(KEY).await.unwrap().unwrap(),
        value,
        "nothing to write"
    );

    tokio::time::sleep(Duration::from_millis(5)).await;
    let third = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&third), vec!["nodeport_leaked"]);
    assert_eq!(
        third.drift[0].change(),
        reconcilers::Change {
            was: format!("node port 30500 allocated in {KEY}, held by no Service"),
            became: format!("node port 30500 free in {KEY}"),
        }
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30080, 30081]);

    // One PortNotAllocated event, on the Service holding the port, and one for the release.
    assert_eq!(
        common::event_reasons(&sim)
            .iter()
            .filter(|reason| *reason == "PortNotAllocated")
            .count(),
        1
    );
    let released = events(&sim, "PortReleased");
    assert_eq!(released.len(), 1, "{:?}", common::event_reasons(&sim));
    assert_eq!(released[0]["reportingController"], "bootstrap-controller");
    assert!(
        released[0]["note"].as_str().unwrap().contains("30500"),
        "{released:?}"
    );
}

/// A value with every bit set and no Service (a tenant's etcd is the tenant's): the bits are
/// followed `MAX_SUSPECTS` at a time, each pass naming at most ten of a kind in an event and
/// telling the rest in one, until every one is released.
#[tokio::test]
async fn a_value_with_every_bit_set_is_released_a_budget_at_a_time() {
    use reconcilers::legacy_alloc::repair::MAX_SUSPECTS;
    let (etcd, store, sim) = etcd_and_sim().await;
    let mut every = FixedBitSet::with_capacity(range().size());
    every.insert_range(..);
    let stored = RangeAllocation::new(range().to_string(), bitmap_to_bytes(&every));
    store_first(&store, stored.encode()).await;
    let harness = Harness::start(&sim, etcd.config(), Duration::from_millis(1)).await;
    // Event writes (a create, or a patch of its series), each one request.
    let event_writes = || {
        sim.requests()
            .iter()
            .filter(|r| r.resource == "events" && r.verb != "get" && r.verb != "list")
            .count()
    };
    let (mut released, mut passes, mut batches) = (0, 0, 0);
    while released < range().size() {
        passes += 1;
        assert!(passes <= 20, "{released} of {} released", range().size());
        tokio::time::sleep(Duration::from_millis(5)).await;
        sim.clear_requests();
        let report = harness.pass(&sim, false).await.unwrap();
        // A drift a followed bit, and one telling how many others are not followed yet.
        let unfollowed = range().size() - released - MAX_SUSPECTS.min(range().size() - released);
        // Its words stay the same (one finding); its change counts them.
        let told: Vec<_> = (report.drift.iter())
            .filter(|drift| drift.kind == "nodeport_leaks_unfollowed")
            .map(|drift| (drift.message.clone(), drift.change().was))
            .collect();
        match unfollowed {
            0 => assert!(told.is_empty(), "{told:?}"),
            n => assert!(
                told.len() == 1
                    && told[0].0.starts_with("more node ports are set")
                    && told[0]
                        .1
                        .starts_with(&format!("{n} node ports set in {KEY}")),
                "{n}: {told:?}"
            ),
        }
        assert!(
            report.drift.len() <= MAX_SUSPECTS + 1,
            "{}",
            report.drift.len()
        );
        let now = kinds(&report)
            .iter()
            .filter(|kind| **kind == "nodeport_leaked")
            .count();
        if now > 0 {
            // Ten events name a port each, one tells the others.
            batches += 1;
            assert_eq!(now, MAX_SUSPECTS.min(range().size() - released));
            assert_eq!(event_writes(), 11, "{now} released");
        } else {
            assert_eq!(event_writes(), 0);
        }
        released += now;
    }
    assert_eq!(batches, range().size().div_ceil(MAX_SUSPECTS));
    assert_eq!(
        harness.errors("leak"),
        u64::try_from(range().size()).unwrap()
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), Vec::<u16>::new());
}

/// A released port that kube-apiserver allocates again before the next pass (its Service still
/// in admission, so in no list yet) is a new suspect: it waits three sightings again, never
/// released on the old one's.
#[tokio::test]
async fn a_released_port_allocated_again_waits_its_own_sightings() {
    let (etcd, store, sim) = etcd_and_sim().await;
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[30500]));
    store_first(&store, stored.encode()).await;
    let harness = Harness::start(&sim, etcd.config(), Duration::from_millis(1)).await;
    let mut released = false;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let report = harness.pass(&sim, false).await.unwrap();
        released = kinds(&report).contains(&"nodeport_leaked");
    }
    assert!(released, "released on the third sighting");
    // kube-apiserver allocates it again.
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), Vec::<u16>::new());
    let again = RangeAllocation::new(range().to_string(), bitmap(&[30500]));
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), again.encode())
            .await
            .unwrap()
    );
    for sighting in 1..3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let report = harness.pass(&sim, false).await.unwrap();
        assert!(
            !kinds(&report).contains(&"nodeport_leaked"),
            "released again on sighting {sighting}: {report:?}"
        );
        let value = store.get(KEY).await.unwrap().unwrap();
        assert_eq!(ports_of(&value.value), vec![30500]);
    }
}

/// A bit cleared again right after its repair, before any pass saw it set, is a new occurrence:
/// reported (event, metric) and repaired again, not taken for the one already repaired.
#[tokio::test]
async fn a_bit_cleared_again_after_its_repair_is_counted_again() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[]));
    store_first(&store, stored.encode()).await;
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(60)).await;
    for round in 1..=2u64 {
        let report = harness.pass(&sim, false).await.unwrap();
        assert_eq!(
            kinds(&report),
            vec!["nodeport_not_allocated"],
            "round {round}"
        );
        assert_eq!(harness.errors("repair"), round, "round {round}");
        let value = store.get(KEY).await.unwrap().unwrap();
        assert_eq!(ports_of(&value.value), vec![30080]);
        // Cleared again by another writer before any pass sees it set.
        let cleared = RangeAllocation::new(range().to_string(), bitmap(&[]));
        assert!(
            store
                .compare_and_swap(KEY, Some(value.mod_revision), cleared.encode())
                .await
                .unwrap()
        );
    }
    // Both published: kube's recorder folds the second into the first event's series (a patch).
    assert_eq!(
        common::event_reasons(&sim)
            .iter()
            .filter(|reason| *reason == "PortNotAllocated")
            .count(),
        1
    );
    let event_writes = sim
        .requests()
        .iter()
        .filter(|r| r.resource == "events" && matches!(r.verb.as_str(), "create" | "patch"))
        .count();
    assert_eq!(event_writes, 2);
}

/// A bit the Service cache shows unused is released only when a fresh list of the Services
/// agrees: with the Service watch broken, a Service created after the cache synced holds a port
/// the cache does not know of, and that port stays allocated however often it is sighted; a
/// port no Service holds is released as usual.
#[tokio::test]
async fn a_leak_is_released_only_when_a_fresh_list_confirms_it() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    // The Service watch never starts: the cache holds the first list and nothing after it.
    sim.faults().inject(apiserver_sim::FaultRule::probability(
        Some(apiserver_sim::Verb::Watch),
        Some("services"),
        1.0,
        apiserver_sim::FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let harness = Harness::start(&sim, etcd.config(), Duration::from_millis(1)).await;
    harness.pass(&sim, false).await.unwrap();
    put_service(&sim, "late", 30600);
    let value = store.get(KEY).await.unwrap().unwrap();
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[30080, 30500, 30600]));
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), stored.encode())
            .await
            .unwrap()
    );
    let mut released = Vec::new();
    let mut held = 0;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let report = harness.pass(&sim, false).await.unwrap();
        for drift in &report.drift {
            match drift.kind {
                "nodeport_leaked" => released.push(drift.message.clone()),
                "nodeport_leak_held" => held += 1,
                _ => {}
            }
        }
    }
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30080, 30600], "{released:?}");
    assert_eq!(released.len(), 1, "{released:?}");
    assert!(released[0].contains("30500"), "{released:?}");
    assert_eq!(
        held, 0,
        "the fresh list settled every held suspect in its pass"
    );
    // The watcher's one list, then the fresh lists that confirmed the suspects.
    assert!(sim.request_count("list", "services") >= 2);
}

/// A tenant API whose list of Services never ends (each page small and valid, its `continue`
/// never empty): the fresh list that would confirm a leak stops once it has more Services than
/// the cache budget allows, holding one page at a time until then, and nothing is released on
/// it. Without the bound the pass would list for ever.
#[tokio::test]
async fn a_fresh_list_that_never_ends_stops_at_the_cache_budget_and_releases_nothing() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let limits = BudgetLimits {
        max_objects: 100,
        max_bytes: usize::MAX,
    };
    let budget = CacheBudget::new(limits, "the test's", None, &mut Registry::default());
    let settings = settings(etcd.config());
    let section = nodeport_repair::Section {
        interval: Duration::from_millis(1),
        leak_sighting_spacing: Duration::from_millis(1),
        ..nodeport_repair::Section::default()
    };
    let harness = Harness::start_within(&sim, settings, section, budget).await;
    harness.pass(&sim, false).await.unwrap();
    let value = store.get(KEY).await.unwrap().unwrap();
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[30080, 30500]));
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), stored.encode())
            .await
            .unwrap()
    );
    // The cache has listed; its watch goes on. Every LIST from now on never ends.
    sim.faults().inject(FaultRule::probability(
        Some(Verb::List),
        Some("services"),
        1.0,
        FaultKind::EndlessPages,
    ));
    let before = sim.request_count("list", "services");
    let mut held = Vec::new();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        // A guard against a hang only: the pass is not timed.
        let report = tokio::time::timeout(Duration::from_secs(60), harness.pass(&sim, false))
            .await
            .expect("the pass ends")
            .unwrap();
        assert!(!kinds(&report).contains(&"nodeport_leaked"), "{report:?}");
        held.extend(
            (report.drift.iter())
                .filter(|drift| drift.kind == "nodeport_leak_held")
                .map(|drift| drift.message.clone()),
        );
    }
    assert!(held.iter().any(|held| held.contains("30500")), "{held:?}");
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30080, 30500]);
    // Pages of 20 new Services: a fresh list stops at its sixth page (120 > 100).
    let lists = sim.request_count("list", "services") - before;
    assert!(
        (6..=5 * 2 * 6).contains(&lists),
        "{lists} LISTs in five passes"
    );
}

/// Passes closer than upstream's 3 minutes (a short interval, or Service changes waking the
/// loop) do not hasten a release: by default sightings count 3 minutes apart, whatever the
/// interval, so a bit kube-apiserver set for a Service still in admission is not taken back.
#[tokio::test]
async fn a_short_interval_does_not_hasten_the_release_of_a_leak() {
    let (etcd, store, sim) = etcd_and_sim().await;
    let section = nodeport_repair::Section {
        interval: Duration::from_millis(1),
        ..nodeport_repair::Section::default()
    };
    let harness = Harness::start_within(
        &sim,
        settings(etcd.config()),
        section,
        CacheBudget::default(),
    )
    .await;
    store_first(
        &store,
        RangeAllocation::new(range().to_string(), bitmap(&[30500])).encode(),
    )
    .await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let report = harness.pass(&sim, false).await.unwrap();
        assert!(!kinds(&report).contains(&"nodeport_leaked"), "{report:?}");
    }
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30500], "the leak is kept");
}

#[tokio::test]
async fn a_missing_key_is_created_only_if_absent() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    harness.pass(&sim, false).await.unwrap();
    let created = store.get(KEY).await.unwrap().unwrap();
    let decoded = RangeAllocation::decode(&created.value).unwrap();
    assert_eq!(decoded.range, "30000-32767");
    assert_eq!(ports_of(&created.value), vec![30080]);
    // A create that finds the key written meanwhile writes nothing.
    assert!(
        !store
            .compare_and_swap(KEY, None, b"other".to_vec())
            .await
            .unwrap()
    );
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), created);
}

#[tokio::test]
async fn dry_run_reports_and_writes_nothing() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let stored = RangeAllocation::new(range().to_string(), bitmap(&[]));
    store
        .compare_and_swap(KEY, None, stored.encode())
        .await
        .unwrap();
    let before = store.get(KEY).await.unwrap().unwrap();

    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    let report = harness.pass(&sim, true).await.unwrap();
    assert_eq!(kinds(&report), vec!["nodeport_not_allocated"]);
    assert!(!report.drift[0].applied);
    let after = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(after.mod_revision, before.mod_revision);
    assert!(common::event_reasons(&sim).is_empty());
}

/// A bitmap under `stored` (`"first-last"`) holding `ports`, as kube-apiserver encodes it.
fn value_under(stored: &str, ports: &[u16]) -> Vec<u8> {
    let (first, last) = stored.split_once('-').unwrap();
    let (first, last): (u16, u16) = (first.parse().unwrap(), last.parse().unwrap());
    let mut bits = FixedBitSet::with_capacity(usize::from(last - first) + 1);
    for port in ports {
        bits.insert(usize::from(port - first));
    }
    RangeAllocation::new(stored.to_owned(), bitmap_to_bytes(&bits)).encode()
}

/// The events of `reason` the simulator holds.
fn events(sim: &Sim, reason: &str) -> Vec<serde_json::Value> {
    common::events_of(sim, reason)
}

fn range_mismatches(report: &reconcilers::PassReport) -> Vec<&reconcilers::Drift> {
    common::drift_of_kind(report, "nodeport_range_mismatch")
}

/// A management cluster gives every tenant the default range, but this tenant's kube-apiserver
/// runs with `--service-node-port-range=20000-22767` and has allocated 20080. The bitmap is
/// stored under 20000-22767; rewriting it under 30000-32767 would lose 20080 and make
/// kube-apiserver refuse every new node port. It is reported once (a Warning event on the
/// `kubernetes` Service naming both ranges, the metric, the drift `check` lists on every pass)
/// and never written. Once the stored range is the configured one, the repair works as usual.
#[tokio::test]
async fn a_bitmap_under_another_range_is_reported_once_and_left_alone() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 20080);
    put_service(&sim, "db", 30081);
    store_first(&store, value_under("20000-22767", &[20080])).await;
    let before = store.get(KEY).await.unwrap().unwrap();
    // Sightings count when an interval apart: 1 ms here, so a leak would be released by the
    // third pass if the bitmap were read under the configured range.
    let harness = Harness::start(&sim, etcd.config(), Duration::from_millis(1)).await;

    for round in 0..4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        let report = harness.pass(&sim, round == 3).await.unwrap();
        let mismatch = range_mismatches(&report);
        assert_eq!(mismatch.len(), 1, "round {round}: {report:?}");
        assert!(!mismatch[0].applied);
        assert_eq!(mismatch[0].action, reconcilers::Action::Report);
        assert_eq!(mismatch[0].object, format!("etcd{KEY}"));
        for text in ["20000-22767", "30000-32767", "rebuildBitmapOnRangeChange"] {
            assert!(
                mismatch[0].message.contains(text),
                "{}",
                mismatch[0].message
            );
        }
        assert!(
            !report
                .drift
                .iter()
                .any(|drift| drift.kind == "nodeport_not_allocated" || drift.applied),
            "round {round}: {report:?}"
        );
        assert_eq!(
            store.get(KEY).await.unwrap().unwrap(),
            before,
            "round {round}: the bitmap was written"
        );
    }
    let kept = RangeAllocation::decode(&before.value).unwrap();
    assert_eq!(kept.range, "20000-22767");
    assert!(
        bitmap_from_bytes(&kept.data, 2768).contains(80),
        "20080 kept"
    );

    // Reported once: one event, one count.
    assert_eq!(harness.errors("rangeMismatch"), 1);
    assert_eq!(harness.errors("repair"), 0);
    let reported = events(&sim, "NodePortRangeMismatch");
    assert_eq!(reported.len(), 1, "{reported:?}");
    let event = &reported[0];
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "bootstrap-controller");
    assert_eq!(event["regarding"]["kind"], "Service");
    assert_eq!(event["regarding"]["namespace"], "default");
    assert_eq!(event["regarding"]["name"], "kubernetes");
    let note = event["note"].as_str().unwrap();
    for text in [
        "20000-22767",
        "30000-32767",
        KEY,
        "--service-node-port-range",
    ] {
        assert!(note.contains(text), "{note}");
    }

    // kube-apiserver restarted with the configured range rebuilt it: repaired as usual.
    let current = store.get(KEY).await.unwrap().unwrap();
    assert!(
        store
            .compare_and_swap(
                KEY,
                Some(current.mod_revision),
                RangeAllocation::new(range().to_string(), bitmap(&[])).encode()
            )
            .await
            .unwrap()
    );
    let report = harness.pass(&sim, false).await.unwrap();
    assert!(range_mismatches(&report).is_empty(), "{report:?}");
    assert!(
        report
            .drift
            .iter()
            .any(|drift| drift.kind == "nodeport_not_allocated" && drift.applied),
        "{report:?}"
    );
    assert_eq!(
        ports_of(&store.get(KEY).await.unwrap().unwrap().value),
        vec![30081]
    );
}

/// A value stored without a range: which range its bits belong to is not known here, so it is
/// reported and left alone; kube-apiserver's own repair fills in its range.
#[tokio::test]
async fn an_empty_range_is_reported_and_left_alone() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let stored = RangeAllocation::new(String::new(), bitmap(&[30080, 30500]));
    store_first(&store, stored.encode()).await;
    let before = store.get(KEY).await.unwrap().unwrap();
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    for _ in 0..2 {
        let report = harness.pass(&sim, false).await.unwrap();
        assert_eq!(
            kinds(&report),
            vec!["nodeport_range_mismatch"],
            "{report:?}"
        );
        assert!(!report.drift[0].applied);
        assert!(report.drift[0].message.contains("without a range"));
        assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);
    }
    assert_eq!(harness.errors("rangeMismatch"), 1);
    assert_eq!(events(&sim, "NodePortRangeMismatch").len(), 1);
}

/// With the opt-in, upstream's repair's behaviour: a value stored without a range
/// (`snapshot.Range == ""`) gets `serviceNodePortRange` filled in, keeping its bits: written
/// once, reported once, counted once.
#[tokio::test]
async fn with_the_opt_in_an_empty_range_is_filled_in() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let stored = RangeAllocation::new(String::new(), bitmap(&[30080, 30500]));
    store_first(&store, stored.encode()).await;
    let harness = Harness::start_with(&sim, etcd.config(), Duration::from_secs(180), true).await;

    let first = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&first), vec!["nodeport_range_mismatch"], "{first:?}");
    assert!(first.drift[0].applied);
    assert_eq!(
        first.drift[0].change().was,
        format!("{KEY} stored without a range")
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    let decoded = RangeAllocation::decode(&value.value).unwrap();
    assert_eq!(decoded.range, "30000-32767");
    assert_eq!(ports_of(&value.value), vec![30080, 30500]);

    let second = harness.pass(&sim, false).await.unwrap();
    assert!(second.drift.is_empty(), "{second:?}");
    assert_eq!(
        store.get(KEY).await.unwrap().unwrap(),
        value,
        "written once"
    );
    assert_eq!(harness.errors("repair"), 1);
    assert!(events(&sim, "NodePortRangeMismatch").is_empty());
    assert_eq!(
        events(&sim, "NodePortBitmapRebuilt").len(),
        1,
        "every repair has its event"
    );
}

/// With the opt-in, the apiserver's range grew from 30000-30999 to 30000-32767: the bitmap is
/// rebuilt under the new range with every allocation kept (the one no Service holds is a leak
/// suspect, as any), and the change is reported once.
#[tokio::test]
async fn with_the_opt_in_a_grown_range_is_rebuilt_keeping_every_allocation() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    put_service(&sim, "db", 32000);
    let stored = value_under("30000-30999", &[30080, 30500]);
    store_first(&store, stored).await;
    let harness = Harness::start_with(&sim, etcd.config(), Duration::from_secs(180), true).await;

    let first = harness.pass(&sim, false).await.unwrap();
    assert_eq!(
        kinds(&first),
        vec!["nodeport_not_allocated", "nodeport_range_mismatch"],
        "{first:?}"
    );
    assert!(first.drift.iter().all(|drift| drift.applied));
    assert_eq!(
        first.drift[1].change(),
        reconcilers::Change {
            was: format!("{KEY} stored under the range 30000-30999"),
            became: format!(
                "{KEY} stored under the range 30000-32767 (0 allocations outside it dropped)"
            ),
        }
    );
    assert!(first.drift[1].message.contains("30000-30999"));
    assert!(
        first.drift[1]
            .message
            .contains("0 allocations outside it dropped")
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    let decoded = RangeAllocation::decode(&value.value).unwrap();
    assert_eq!(decoded.range, "30000-32767");
    assert_eq!(ports_of(&value.value), vec![30080, 30500, 32000]);

    harness.settled_at(&sim, &store, &value).await;
    // The range change once, and 32000 set once.
    assert_eq!(harness.errors("repair"), 2);
}

/// With the opt-in, the apiserver's range shrank from 30000-40000 to 30000-32767: what falls
/// outside is dropped (upstream's rebuilt allocator cannot hold it), the rest kept, and only
/// after a fresh list of the Services.
#[tokio::test]
async fn with_the_opt_in_a_shrunk_range_drops_what_falls_outside() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let stored = value_under("30000-40000", &[30080, 31000, 35000, 40000]);
    store_first(&store, stored).await;
    let harness = Harness::start_with(&sim, etcd.config(), Duration::from_secs(180), true).await;

    let lists = || {
        sim.requests()
            .iter()
            .filter(|request| request.verb == "list" && request.resource == "services")
            .count()
    };
    // Until the cache is synced (listed, then watching), a pass waits for it.
    common::eventually("the Service cache watches", || async {
        sim.requests()
            .iter()
            .any(|request| request.verb == "watch" && request.resource == "services")
    })
    .await;
    sim.faults().inject(FaultRule::probability(
        Some(Verb::List),
        Some("services"),
        1.0,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let stored = store.get(KEY).await.unwrap().unwrap();
    let held = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&held), vec!["nodeport_range_mismatch"], "{held:?}");
    assert!(!held.drift[0].applied);
    assert!(held.drift[0].message.contains("once a fresh list"));
    assert_eq!(
        store.get(KEY).await.unwrap().unwrap(),
        stored,
        "nothing written"
    );
    sim.faults().clear();

    let before = lists();
    let first = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&first), vec!["nodeport_range_mismatch"], "{first:?}");
    assert!(first.drift[0].applied);
    assert!(
        first.drift[0]
            .message
            .contains("2 allocations outside it dropped")
    );
    assert_eq!(lists(), before + 1, "one fresh list of the Services");
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(
        RangeAllocation::decode(&value.value).unwrap().range,
        "30000-32767"
    );
    assert_eq!(ports_of(&value.value), vec![30080, 31000]);

    harness.settled_at(&sim, &store, &value).await;
    assert_eq!(harness.errors("repair"), 1);
}

/// Waits (at most 30 s) for the watched key's cache to hold `value`: `None`, unknown.
async fn cache_holds(cache: &KeyCache, value: Option<Vec<u8>>) {
    for _ in 0..600 {
        let held = cache.get().map(|stored| stored.unwrap().value);
        if held == value {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the cache never held {:?}", value.map(|v| v.len()));
}

/// A value larger than any bitmap kube-apiserver writes (a tenant's etcd is the tenant's) is
/// reported once and left alone, whether a message may carry it (over `MAX_VALUE_BYTES`) or not
/// (over 512 KiB, refused before it is read); the watch does not hold it, and holds the key
/// again once its value is back within bounds.
#[tokio::test]
async fn a_value_larger_than_any_bitmap_is_reported_once_and_left_alone() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let small = RangeAllocation::new(range().to_string(), bitmap(&[30080])).encode();
    store_first(&store, small.clone()).await;
    let cache = KeyCache::default();
    let watch = tokio::spawn(
        store
            .watch(KEY.to_owned(), cache.clone())
            .for_each(|()| async {}),
    );
    cache_holds(&cache, Some(small.clone())).await;
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    assert!(harness.pass(&sim, false).await.unwrap().drift.is_empty());

    let mut revision = store.get(KEY).await.unwrap().unwrap().mod_revision;
    for len in [MAX_VALUE_BYTES, 600 * 1024] {
        let large = RangeAllocation::new(range().to_string(), vec![0xff; len]).encode();
        revision = (store
            .compare_and_swap_revision(KEY, Some(revision), large)
            .await)
            .unwrap()
            .unwrap();
        // The watch drops what it held (the small value, each time).
        cache_holds(&cache, None).await;
        let err = store.get(KEY).await.unwrap_err();
        assert!(matches!(err, EtcdError::TooLarge { .. }), "{err}");
        let report = harness.pass(&sim, false).await.unwrap();
        assert_eq!(kinds(&report), vec!["nodeport_bitmap_unusable"], "{len}");
        assert!(
            (report.drift[0].message).contains(&format!("over {MAX_VALUE_BYTES} bytes")),
            "{}",
            report.drift[0].message
        );
        // Nothing was written over it: it is still at its revision. Put back, the small value
        // is held again, and the next large one is a finding of its own.
        revision = (store
            .compare_and_swap_revision(KEY, Some(revision), small.clone())
            .await)
            .unwrap()
            .expect("the large value was written over");
        cache_holds(&cache, Some(small.clone())).await;
        assert!(harness.pass(&sim, false).await.unwrap().drift.is_empty());
    }
    assert_eq!(harness.errors("invalid"), 2);
    watch.abort();
}

#[tokio::test]
async fn an_unreadable_value_or_range_is_reported_and_left_alone() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "web", 30080);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;

    let foreign = RangeAllocation::new("10.0.0.0/24".to_owned(), bitmap(&[]));
    store
        .compare_and_swap(KEY, None, foreign.encode())
        .await
        .unwrap();
    let before = store.get(KEY).await.unwrap().unwrap();
    let report = harness.pass(&sim, false).await.unwrap();
    assert_eq!(kinds(&report), vec!["nodeport_bitmap_unusable"]);
    assert!(report.drift[0].message.contains("10.0.0.0/24"));
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);

    for value in [
        &b"k8s:enc:aescbc:v1:key1:\x01\x02"[..],
        b"k8s\0\xff\xff",
        b"not a value",
    ] {
        let current = store.get(KEY).await.unwrap().unwrap();
        assert!(
            store
                .compare_and_swap(KEY, Some(current.mod_revision), value.to_vec())
                .await
                .unwrap()
        );
        let before = store.get(KEY).await.unwrap().unwrap();
        let report = harness.pass(&sim, false).await.unwrap();
        assert_eq!(
            kinds(&report),
            vec!["nodeport_bitmap_unusable"],
            "{value:?}"
        );
        assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);
    }
}

/// kube-apiserver allocating ports while the repair writes: every allocation it made survives,
/// because the repair writes only over the revision it read.
#[tokio::test]
async fn a_concurrent_writer_loses_no_allocation() {
    let (etcd, store, sim) = etcd_and_sim().await;
    for (i, port) in (30100..30120).enumerate() {
        put_service(&sim, &format!("svc-{i}"), port);
    }
    store
        .compare_and_swap(
            KEY,
            None,
            RangeAllocation::new(range().to_string(), bitmap(&[])).encode(),
        )
        .await
        .unwrap();
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;

    let writer = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut allocated = Vec::new();
            for port in 31000..31060u16 {
                loop {
                    let current = store.get(KEY).await.unwrap().unwrap();
                    let mut ports = ports_of(&current.value);
                    ports.push(port);
                    let value = RangeAllocation::decode(&current.value)
                        .unwrap()
                        .with_data(bitmap(&ports));
                    if store
                        .compare_and_swap(KEY, Some(current.mod_revision), value.encode())
                        .await
                        .unwrap()
                    {
                        allocated.push(port);
                        break;
                    }
                }
            }
            allocated
        })
    };
    let mut conflicts = 0;
    while !writer.is_finished() {
        if harness.pass(&sim, false).await.is_err() {
            conflicts += 1;
        }
    }
    let allocated = writer.await.unwrap();
    harness.pass(&sim, false).await.unwrap();
    let stored = ports_of(&store.get(KEY).await.unwrap().unwrap().value);
    for port in (30100..30120).chain(allocated.iter().copied()) {
        assert!(
            stored.contains(&port),
            "port {port} lost ({conflicts} passes gave up on conflicts)"
        );
    }
}

#[tokio::test]
async fn etcd_restarting_fails_passes_until_it_is_back() {
    let mut etcd = Etcd::start(None).await;
    let sim = common::sim().await;
    put_service(&sim, "web", 30080);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    harness.pass(&sim, false).await.unwrap();

    etcd.stop();
    let error = harness.pass(&sim, false).await.unwrap_err();
    assert!(error.to_string().contains("etcd"), "{error}");

    etcd.spawn().await;
    common::eventually("a pass succeeds once etcd is back", || async {
        harness.pass(&sim, false).await.is_ok()
    })
    .await;
}

#[tokio::test]
async fn tls_with_client_certificates() {
    let etcd = Etcd::start(Some(Pki::generate())).await;
    let sim = common::sim().await;
    put_service(&sim, "web", 30080);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(180)).await;
    harness.pass(&sim, false).await.unwrap();
    let store = EtcdStore::new(etcd.config());
    assert_eq!(
        ports_of(&store.get(KEY).await.unwrap().unwrap().value),
        vec![30080]
    );

    // Without the client certificate the server refuses.
    let mut anonymous = etcd.config();
    anonymous.cert_file = None;
    anonymous.key_file = None;
    assert!(EtcdStore::new(anonymous).get(KEY).await.is_err());
}

#[tokio::test]
async fn a_change_in_etcd_wakes_the_loop() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let cache = reconcilers::legacy_alloc::etcd::KeyCache::default();
    let mut watch = store.watch(etcd.config().key(RangeKey::NodePorts), cache.clone());
    // The first item: the watch is established.
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .unwrap();
    store
        .compare_and_swap(
            KEY,
            None,
            RangeAllocation::new(range().to_string(), bitmap(&[30001])).encode(),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("the watch yields after the change");
    let seen = cache
        .get()
        .expect("the watch keeps the value")
        .expect("the key exists");
    assert_eq!(ports_of(&seen.value), vec![30001]);
    assert_eq!(Some(seen), store.get(KEY).await.unwrap());
}

/// At rest a pass reads its key from the watch: no etcd request besides the watch.
#[tokio::test]
async fn passes_at_rest_send_etcd_nothing() {
    let etcd = Etcd::start(None).await;
    let sim = common::sim().await;
    put_service(&sim, "web", 30080);
    let repair = Arc::new(NodePortRepairLoop::new(
        sim.client(),
        nodeport_repair::Section {
            page_size: 500,
            ..nodeport_repair::Section::default()
        },
        &settings(etcd.config()),
        reconcilers::kubernetes_service::Section::default().service(),
        None,
        &mut Registry::default(),
    ));
    let mut triggers = futures::stream::select_all(repair.triggers());
    let (woken, mut wakes) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while triggers.next().await.is_some() {
            let _ = woken.send(());
        }
    });
    let harness = Harness {
        repair,
        registry: Registry::default(),
        _cache: tokio::spawn(async {}),
    };
    // The first pass creates the key; the watch then sees it.
    harness.pass(&sim, false).await.unwrap();
    let store = EtcdStore::new(etcd.config());
    assert_eq!(
        ports_of(&store.get(KEY).await.unwrap().unwrap().value),
        vec![30080]
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    while wakes.try_recv().is_ok() {}

    let before = etcd.kv_requests().await;
    for _ in 0..5 {
        let report = harness.pass(&sim, false).await.unwrap();
        assert!(report.drift.is_empty(), "{report:?}");
    }
    assert_eq!(
        etcd.kv_requests().await,
        before,
        "passes at rest sent etcd requests"
    );

    // The metric does count: a read from outside shows up.
    store.get(KEY).await.unwrap();
    assert!(etcd.kv_requests().await > before);
}

/// GETs of the Service `default/name` the simulator answered: the repair's live reads.
fn live_reads(sim: &Sim, name: &str) -> usize {
    sim.requests()
        .iter()
        .filter(|r| {
            r.verb == "get"
                && r.resource == "services"
                && r.namespace == "default"
                && r.name == name
        })
        .count()
}

/// Passes until `done` holds after one (a pass may fail while the simulator answers).
async fn passes_until(harness: &Harness, sim: &Sim, what: &str, done: impl Fn() -> bool) {
    common::eventually(what, || async {
        let _ = harness.pass(sim, false).await;
        done()
    })
    .await;
}

/// A Service deleted without the cache hearing of it (its DELETED event lost) and another
/// given its node port: the cache shows both, and the later one as a duplicate. The live read
/// finds the first gone, so nothing is reported (no event, no counter, no drift).
#[tokio::test]
async fn a_port_duplicated_with_a_service_gone_behind_the_caches_back_is_not_reported() {
    let (etcd, _store, sim) = etcd_and_sim().await;
    put_service(&sim, "a", 30080);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(60)).await;
    harness.pass(&sim, false).await.unwrap();
    sim.clear_requests();
    sim.backdoor()
        .delete_unseen("services", "default", "a")
        .unwrap();
    put_service(&sim, "b", 30080);
    passes_until(
        &harness,
        &sim,
        "the live read of the gone Service, or its duplicate reported",
        || live_reads(&sim, "a") > 0 || !events(&sim, "PortAlreadyAllocated").is_empty(),
    )
    .await;
    assert!(
        events(&sim, "PortAlreadyAllocated").is_empty(),
        "a duplicate of a Service that is gone was reported"
    );
    let report = harness.pass(&sim, false).await.unwrap();
    assert!(
        !kinds(&report).contains(&"nodeport_duplicate"),
        "{report:?}"
    );
    assert_eq!(harness.errors("duplicate"), 0);
}

/// A bit missing from the bitmap for a Service the cache still shows but that is gone: the live
/// read finds it gone, and the bit is neither set nor reported.
#[tokio::test]
async fn a_bit_is_not_set_for_a_service_gone_behind_the_caches_back() {
    let (etcd, store, sim) = etcd_and_sim().await;
    put_service(&sim, "a", 30081);
    let harness = Harness::start(&sim, etcd.config(), Duration::from_secs(60)).await;
    harness.pass(&sim, false).await.unwrap();
    let value = store.get(KEY).await.unwrap().unwrap();
    assert_eq!(ports_of(&value.value), vec![30081]);
    assert_eq!(harness.errors("repair"), 1);
    sim.clear_requests();
    sim.backdoor()
        .delete_unseen("services", "default", "a")
        .unwrap();
    // kube-apiserver released the port with the Service.
    let cleared = RangeAllocation::new(range().to_string(), bitmap(&[]));
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), cleared.encode())
            .await
            .unwrap()
    );
    passes_until(
        &harness,
        &sim,
        "the live read of the gone Service, or its port set again",
        || live_reads(&sim, "a") > 0 || harness.errors("repair") > 1,
    )
    .await;
    let report = harness.pass(&sim, false).await.unwrap();
    assert!(report.drift.is_empty(), "{report:?}");
    assert_eq!(
        ports_of(&store.get(KEY).await.unwrap().unwrap().value),
        Vec::<u16>::new(),
        "a port was set for a Service that is gone"
    );
    assert_eq!(harness.errors("repair"), 1);
    assert_eq!(events(&sim, "PortNotAllocated").len(), 1);
}

//! The ClusterIP repair's etcd mode against a real etcd and the in-process simulator: the
//! legacy `serviceips` bitmap repaired where kube-apiserver allocates with it (a cluster that
//! serves no IPAddress API), never created where it does not exist, left alone where the
//! IPAddress API is served (Kubernetes 1.33+, also once a control plane is upgraded in place),
//! and never rewritten under a range other than the one it is stored under unless the operator
//! opts in.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use apiserver_sim::{Sim, SimConfig};
use common::etcd::Etcd;
use fixedbitset::FixedBitSet;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::clusterip_repair::{self, ClusterIpRepairLoop, RepairMode};
use reconcilers::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use reconcilers::legacy_alloc::etcd::{EtcdStore, Stored};
use reconcilers::section::Settings;

const KEY: &str = "/registry/ranges/serviceips";
/// The simulator's default range; its legacy bitmap has 2^20 - 2 offsets.
const RANGE: &str = "10.96.0.0/12";
const SIZE: usize = (1 << 20) - 2;

fn offset(ip: &str) -> usize {
    let ip: std::net::Ipv4Addr = ip.parse().unwrap();
    usize::try_from(u32::from(ip) - u32::from(std::net::Ipv4Addr::new(10, 96, 0, 1))).unwrap()
}

fn bitmap(ips: &[&str]) -> Vec<u8> {
    let mut bits = FixedBitSet::with_capacity(SIZE);
    for ip in ips {
        bits.insert(offset(ip));
    }
    bitmap_to_bytes(&bits)
}

/// A cluster older than 1.33: no `networking.k8s.io/v1`, so kube-apiserver allocates cluster
/// IPs with the legacy bitmap.
async fn old_sim() -> Sim {
    Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        serve_networking_v1: false,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

async fn repair(sim: &Sim, etcd: &Etcd) -> Arc<ClusterIpRepairLoop> {
    repair_with(sim, etcd, RepairMode::Auto, false, &mut Registry::default()).await
}

/// `rebuild`: `rebuildBitmapOnRangeChange`.
async fn repair_with(
    sim: &Sim,
    etcd: &Etcd,
    mode: RepairMode,
    rebuild: bool,
    registry: &mut Registry,
) -> Arc<ClusterIpRepairLoop> {
    let section = clusterip_repair::Section {
        mode,
        interval: Duration::from_secs(180),
        rebuild_bitmap_on_range_change: rebuild,
        ..clusterip_repair::Section::default()
    };
    repair_in(sim, etcd, section, registry).await
}

/// The loop of `section`, its triggers driven.
async fn repair_in(
    sim: &Sim,
    etcd: &Etcd,
    section: clusterip_repair::Section,
    registry: &mut Registry,
) -> Arc<ClusterIpRepairLoop> {
    let settings = Settings {
        etcd: etcd.config(),
        ..common::settings(&[RANGE])
    };
    let repair = Arc::new(ClusterIpRepairLoop::new(
        sim.client(),
        section,
        &settings,
        reconcilers::kubernetes_service::Section::default().service(),
        registry,
    ));
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} });
    repair
}

async fn pass(sim: &Sim, repair: &ClusterIpRepairLoop) -> reconcilers::PassReport {
    for _ in 0..100 {
        match repair.reconcile(&common::ctx(sim, false)).await {
            Err(reconcilers::LoopError::NotSynced(_)) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other.unwrap(),
        }
    }
    panic!("the Service cache never synced");
}

async fn web_ip(sim: &Sim) -> String {
    web_ip_named(sim, "web").await
}

/// A Service `name` in `default` is created; its cluster IP.
async fn web_ip_named(sim: &Sim, name: &str) -> String {
    let services: Api<Service> = Api::namespaced(sim.client(), "default");
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"ports": [{"port": 80}]}
    }))
    .unwrap();
    let web = services.create(&Default::default(), &web).await.unwrap();
    web.spec.unwrap().cluster_ip.unwrap()
}

#[tokio::test]
async fn a_missing_key_stays_missing() {
    let etcd = Etcd::start(None).await;
    let sim = old_sim().await;
    web_ip(&sim).await;
    let repair = repair(&sim, &etcd).await;
    pass(&sim, &repair).await;
    assert!(
        EtcdStore::new(etcd.config())
            .get(KEY)
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn ips_in_use_are_set_and_leaks_flagged_with_upstreams_event() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = old_sim().await;
    let ip = web_ip(&sim).await;
    let leaked = "10.100.0.1";
    let stored = RangeAllocation::new(RANGE.to_owned(), bitmap(&[leaked]));
    assert!(
        store
            .compare_and_swap(KEY, None, stored.encode())
            .await
            .unwrap()
    );

    let repair = repair(&sim, &etcd).await;
    let report = pass(&sim, &repair).await;
    let kinds: Vec<_> = report.drift.iter().map(|d| d.kind).collect();
    assert_eq!(kinds, vec!["clusterip_bitmap_not_allocated"], "{report:?}");
    assert_eq!(report.drift[0].object, "Service/default/web");
    assert_eq!(
        report.drift[0].change(),
        reconcilers::Change {
            was: format!("cluster IP {ip} free in {KEY}"),
            became: format!("cluster IP {ip} allocated in {KEY}"),
        }
    );

    let value = store.get(KEY).await.unwrap().unwrap();
    let decoded = RangeAllocation::decode(&value.value).unwrap();
    let bits = bitmap_from_bytes(&decoded.data, SIZE);
    assert!(bits.contains(offset(&ip)), "the Service's IP is set");
    assert!(
        bits.contains(offset(leaked)),
        "a first sighting of a leak keeps it"
    );
    assert!(
        common::event_reasons(&sim)
            .iter()
            .any(|reason| reason == "ClusterIPNotAllocated")
    );

    // Nothing new: nothing written.
    let report = pass(&sim, &repair).await;
    assert!(report.drift.is_empty(), "{report:?}");
    assert_eq!(
        store.get(KEY).await.unwrap().unwrap().mod_revision,
        value.mod_revision
    );
}

/// A bitmap under the IPv4 CIDR `stored` holding `ips` (offsets from network + 1).
fn value_under(stored: &str, ips: &[&str]) -> Vec<u8> {
    let net: ipnet::Ipv4Net = stored.parse().unwrap();
    let size = (1usize << (32 - net.prefix_len())) - 2;
    let first = u32::from(net.network()) + 1;
    let mut bits = FixedBitSet::with_capacity(size);
    for ip in ips {
        let ip: std::net::Ipv4Addr = ip.parse().unwrap();
        bits.insert(usize::try_from(u32::from(ip) - first).unwrap());
    }
    RangeAllocation::new(stored.to_owned(), bitmap_to_bytes(&bits)).encode()
}

/// The IPs the stored value holds, under the configured range.
fn ips_of(value: &[u8]) -> Vec<String> {
    let decoded = RangeAllocation::decode(value).unwrap();
    assert_eq!(decoded.range, RANGE);
    let first = u32::from(std::net::Ipv4Addr::new(10, 96, 0, 1));
    bitmap_from_bytes(&decoded.data, SIZE)
        .ones()
        .map(|offset| std::net::Ipv4Addr::from(first + u32::try_from(offset).unwrap()).to_string())
        .collect()
}

fn range_drift(report: &reconcilers::PassReport) -> Vec<&reconcilers::Drift> {
    common::drift_of_kind(report, "clusterip_bitmap_range_mismatch")
}

/// An old cluster holding the `web` Service, etcd holding what `stored` makes of web's IP, and
/// the repair with `rebuildBitmapOnRangeChange`.
struct OptedIn {
    repair: Arc<ClusterIpRepairLoop>,
    web: String,
    sim: Sim,
    store: EtcdStore,
    _etcd: Etcd,
}

async fn opted_in(stored: impl FnOnce(&str) -> Vec<u8>) -> OptedIn {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = old_sim().await;
    let web = web_ip(&sim).await;
    store
        .compare_and_swap(KEY, None, stored(&web))
        .await
        .unwrap();
    let repair = repair_with(
        &sim,
        &etcd,
        RepairMode::Auto,
        true,
        &mut Registry::default(),
    )
    .await;
    OptedIn {
        repair,
        web,
        sim,
        store,
        _etcd: etcd,
    }
}

impl OptedIn {
    /// One pass: exactly one range finding, applied; returns it and the value stored after.
    async fn range_repaired(&self) -> (reconcilers::Drift, Stored) {
        let report = pass(&self.sim, &self.repair).await;
        let drift = range_drift(&report);
        assert_eq!(drift.len(), 1, "{report:?}");
        assert!(drift[0].applied);
        let drift = drift[0].clone();
        (drift, self.store.get(KEY).await.unwrap().unwrap())
    }

    /// Another pass finds nothing and leaves `value` as it is.
    async fn settled_at(&self, value: &Stored) {
        let again = pass(&self.sim, &self.repair).await;
        assert!(range_drift(&again).is_empty(), "{again:?}");
        assert_eq!(&self.store.get(KEY).await.unwrap().unwrap(), value);
    }
}

/// With the opt-in, a value stored without a range gets the configured one, its bits kept; once.
#[tokio::test]
async fn with_the_opt_in_an_empty_range_is_filled_in() {
    let setup =
        opted_in(|web| RangeAllocation::new(String::new(), bitmap(&[web, "10.96.0.20"])).encode())
            .await;
    let (_, value) = setup.range_repaired().await;
    let mut expected = vec![setup.web.clone(), "10.96.0.20".to_owned()];
    expected.sort_by_key(|ip| offset(ip));
    assert_eq!(ips_of(&value.value), expected);
    assert!(
        common::event_reasons(&setup.sim)
            .iter()
            .any(|reason| reason == "ClusterIPBitmapRebuilt"),
        "every repair has its event"
    );

    setup.settled_at(&value).await;
}

/// With the opt-in, the range grew from 10.96.0.0/24 to 10.96.0.0/12: every allocation is kept
/// at its IP.
#[tokio::test]
async fn with_the_opt_in_a_grown_range_is_rebuilt_keeping_every_allocation() {
    let setup = opted_in(|_| value_under("10.96.0.0/24", &["10.96.0.10", "10.96.0.20"])).await;
    let (drift, value) = setup.range_repaired().await;
    assert!(drift.message.contains("10.96.0.0/24"), "{drift:?}");
    let mut expected = vec![
        "10.96.0.10".to_owned(),
        "10.96.0.20".to_owned(),
        setup.web.clone(),
    ];
    expected.sort_by_key(|ip| offset(ip));
    expected.dedup();
    assert_eq!(ips_of(&value.value), expected);

    setup.settled_at(&value).await;
}

/// With the opt-in, the range shrank from 10.96.0.0/11 to 10.96.0.0/12: 10.112.0.5 falls
/// outside and is dropped; a range that is no CIDR at all is reported and left alone.
#[tokio::test]
async fn with_the_opt_in_a_shrunk_range_drops_what_falls_outside() {
    let setup = opted_in(|_| value_under("10.96.0.0/11", &["10.96.0.10", "10.112.0.5"])).await;
    let (repair, sim, store) = (&setup.repair, &setup.sim, &setup.store);
    let (drift, value) = setup.range_repaired().await;
    assert!(drift.message.contains("1 allocations outside it dropped"));
    let mut expected = vec!["10.96.0.10".to_owned(), setup.web.clone()];
    expected.sort_by_key(|ip| offset(ip));
    expected.dedup();
    assert_eq!(ips_of(&value.value), expected);

    let unreadable = RangeAllocation::new("30000-32767".to_owned(), Vec::new());
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), unreadable.encode())
            .await
            .unwrap()
    );
    let before = store.get(KEY).await.unwrap().unwrap();
    // The loop reads the key through its etcd watch: a pass before the watch delivers this write
    // still sees the repaired value.
    common::eventually("a pass reports the range that is no CIDR", || async {
        pass(sim, repair)
            .await
            .drift
            .iter()
            .any(|d| d.kind == "clusterip_bitmap_unusable" && d.message.contains("30000-32767"))
    })
    .await;
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);
}

fn ip_events(sim: &Sim, reason: &str) -> Vec<serde_json::Value> {
    common::events_of(sim, reason)
}

/// `bootstrap_clusterip_repair_ip_errors_total{type}` in `registry`.
fn ip_errors(registry: &Registry, error_type: &str) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    let series = format!("type=\"{error_type}\"}}");
    text.lines()
        .filter(|line| line.contains("ip_errors_total") && line.contains(&series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// A bitmap stored under another range than `serviceClusterIPRange` is kube-apiserver's, as far
/// as anyone here can tell: reported once (event on the `kubernetes` Service naming both ranges,
/// metric) and in every pass's drift, never written, even though a Service's IP is missing.
#[tokio::test]
async fn a_bitmap_under_another_range_is_reported_once_and_left_alone() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = old_sim().await;
    web_ip(&sim).await;
    let stored = value_under("10.96.0.0/24", &["10.96.0.10"]);
    store.compare_and_swap(KEY, None, stored).await.unwrap();
    let before = store.get(KEY).await.unwrap().unwrap();
    let mut registry = Registry::default();
    let repair = repair_with(&sim, &etcd, RepairMode::Auto, false, &mut registry).await;
    for round in 0..3 {
        let report = pass(&sim, &repair).await;
        let drift = range_drift(&report);
        assert_eq!(drift.len(), 1, "round {round}: {report:?}");
        assert!(!drift[0].applied);
        for text in ["10.96.0.0/24", RANGE, "rebuildBitmapOnRangeChange"] {
            assert!(drift[0].message.contains(text), "{}", drift[0].message);
        }
        assert!(
            !report
                .drift
                .iter()
                .any(|d| d.kind == "clusterip_bitmap_not_allocated"),
            "{report:?}"
        );
        assert_eq!(
            store.get(KEY).await.unwrap().unwrap(),
            before,
            "round {round}"
        );
    }
    assert_eq!(ip_errors(&registry, "rangeMismatch"), 1);
    assert_eq!(ip_errors(&registry, "repair"), 0);
    assert!(ip_events(&sim, "ClusterIPNotAllocated").is_empty());
    let reported = ip_events(&sim, "ClusterIPRangeMismatch");
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert_eq!(reported[0]["type"], "Warning");
    assert_eq!(reported[0]["regarding"]["name"], "kubernetes");
    let note = reported[0]["note"].as_str().unwrap();
    for text in ["10.96.0.0/24", RANGE, "--service-cluster-ip-range"] {
        assert!(note.contains(text), "{note}");
    }
}

/// Kubernetes 1.33+ allocates cluster IPs with IPAddress objects and (from 1.35 always)
/// neither reads nor writes the legacy bitmap, which an upgraded cluster still keeps in etcd.
/// Where the IPAddress API is served the bitmap is left alone: a new Service's IP is not set in
/// it, no `ClusterIPNotAllocated` is sent, its key is not even watched. Whatever the loop's
/// mode: `audit` chooses how the Services are checked, not who allocates.
#[tokio::test]
async fn where_the_ipaddress_api_is_served_the_legacy_bitmap_is_left_alone() {
    for mode in [RepairMode::Auto, RepairMode::Audit, RepairMode::IpAddress] {
        let etcd = Etcd::start(None).await;
        let store = EtcdStore::new(etcd.config());
        let sim = common::sim().await;
        let stored = RangeAllocation::new(RANGE.to_owned(), bitmap(&[]));
        assert!(
            store
                .compare_and_swap(KEY, None, stored.encode())
                .await
                .unwrap()
        );
        let before = store.get(KEY).await.unwrap().unwrap();
        let mut registry = Registry::default();
        let repair = repair_with(&sim, &etcd, mode, false, &mut registry).await;
        // IPAddress mode waits for the default ServiceCIDR, which kube-apiserver writes.
        create_default_service_cidr(&sim).await;
        let requests = etcd.kv_requests().await;
        let first = pass(&sim, &repair).await;
        web_ip(&sim).await;
        // A new Service wakes the loop; its passes see it.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let second = pass(&sim, &repair).await;
        for report in [&first, &second] {
            assert!(
                !report
                    .drift
                    .iter()
                    .any(|d| d.kind.starts_with("clusterip_bitmap")),
                "{mode:?}: {report:?}"
            );
        }
        assert_eq!(
            store.get(KEY).await.unwrap().unwrap(),
            before,
            "{mode:?}: the legacy bitmap was written"
        );
        assert!(
            ip_events(&sim, "ClusterIPNotAllocated").is_empty(),
            "{mode:?}"
        );
        assert_eq!(ip_errors(&registry, "repair"), 0, "{mode:?}");
        // The test's own read above is the last request etcd answered.
        assert_eq!(
            etcd.kv_requests().await,
            requests + 1,
            "{mode:?}: the repair sent etcd requests"
        );
    }
}

/// A control plane upgraded in place from 1.32 to 1.33+, this controller not restarted:
/// discovery's "not served" is believed for one interval only, so the passes after the upgrade
/// repair IPAddress objects (an IPAddress leaked before the upgrade is deleted) and leave the
/// legacy bitmap alone: a Service created after the upgrade, which kube-apiserver allocated by
/// its IPAddress, is not set in the bitmap and has no `ClusterIPNotAllocated`.
#[tokio::test]
async fn after_an_upgrade_in_place_the_ipaddress_repair_runs_and_the_bitmap_is_left_alone() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = old_sim().await;
    web_ip(&sim).await;
    let empty = RangeAllocation::new(RANGE.to_owned(), bitmap(&[]));
    assert!(
        store
            .compare_and_swap(KEY, None, empty.encode())
            .await
            .unwrap()
    );
    let leaked = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IPAddress",
        "metadata": {
            "name": "10.96.201.1",
            "creationTimestamp": "2020-01-01T00:00:00Z",
            "labels": {
                "ipaddress.kubernetes.io/ip-family": "IPv4",
                "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
            },
        },
        "spec": {"parentRef": {
            "group": "", "resource": "services", "namespace": "default", "name": "gone",
        }},
    });
    sim.backdoor().put(leaked).unwrap();
    let leaked_exists = || {
        sim.backdoor()
            .list("ipaddresses.networking.k8s.io")
            .unwrap()
            .iter()
            .any(|ip| ip["metadata"]["name"] == "10.96.201.1")
    };
    let interval = Duration::from_millis(300);
    let section = clusterip_repair::Section {
        interval,
        ..clusterip_repair::Section::default()
    };
    let mut registry = Registry::default();
    let repair = repair_in(&sim, &etcd, section, &mut registry).await;
    // Before the upgrade: the bitmap is kube-apiserver's, and repaired.
    let legacy = pass(&sim, &repair).await;
    assert!(
        legacy
            .drift
            .iter()
            .any(|d| d.kind == "clusterip_bitmap_not_allocated" && d.applied),
        "{legacy:?}"
    );
    assert_eq!(ip_events(&sim, "ClusterIPNotAllocated").len(), 1);
    let before = store.get(KEY).await.unwrap().unwrap();
    sim.set_serve_networking_v1(true);
    create_default_service_cidr(&sim).await;
    // The "not served" kept before the upgrade runs out.
    tokio::time::sleep(interval + Duration::from_millis(100)).await;
    web_ip_named(&sim, "api").await;
    common::eventually("the leaked IPAddress deleted", || async {
        let report = pass(&sim, &repair).await;
        assert!(
            !report
                .drift
                .iter()
                .any(|d| d.kind.starts_with("clusterip_bitmap")),
            "{report:?}"
        );
        !leaked_exists()
    })
    .await;
    let after = pass(&sim, &repair).await;
    assert!(after.drift.is_empty(), "{after:?}");
    assert_eq!(
        store.get(KEY).await.unwrap().unwrap(),
        before,
        "the legacy bitmap was written after the upgrade"
    );
    assert_eq!(ip_events(&sim, "ClusterIPNotAllocated").len(), 1);
    assert_eq!(ip_events(&sim, "IPAddressNotAllocated").len(), 1);
    assert_eq!(ip_errors(&registry, "leak"), 1);
}

/// The ServiceCIDR `kubernetes`, as kube-apiserver 1.33+ creates it from its flag.
async fn create_default_service_cidr(sim: &Sim) {
    use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
    Api::<ServiceCIDR>::all(sim.client())
        .create(
            &Default::default(),
            &ServiceCIDR {
                metadata: kube::api::ObjectMeta {
                    name: Some("kubernetes".into()),
                    ..Default::default()
                },
                spec: Some(ServiceCIDRSpec {
                    cidrs: Some(vec![RANGE.to_owned()]),
                }),
                status: None,
            },
        )
        .await
        .unwrap();
}

/// A Service deleted without the cache hearing of it, its IP released from the bitmap by
/// kube-apiserver: the bit the cache says is missing is checked live first, and as the
/// Service is gone it is neither set nor reported.
#[tokio::test]
async fn a_bit_is_not_set_for_a_service_gone_behind_the_caches_back() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = old_sim().await;
    let ip = web_ip(&sim).await;
    let stored = RangeAllocation::new(RANGE.to_owned(), bitmap(&[&ip]));
    assert!(
        store
            .compare_and_swap(KEY, None, stored.encode())
            .await
            .unwrap()
    );
    let repair = repair(&sim, &etcd).await;
    assert!(pass(&sim, &repair).await.drift.is_empty());
    sim.clear_requests();
    sim.backdoor()
        .delete_unseen("services", "default", "web")
        .unwrap();
    let value = store.get(KEY).await.unwrap().unwrap();
    let cleared = RangeAllocation::new(RANGE.to_owned(), bitmap(&[]));
    assert!(
        store
            .compare_and_swap(KEY, Some(value.mod_revision), cleared.encode())
            .await
            .unwrap()
    );
    let live_read = || {
        sim.requests()
            .iter()
            .any(|r| r.verb == "get" && r.resource == "services" && r.name == "web")
    };
    let set_again = || async {
        let value = store.get(KEY).await.unwrap().unwrap();
        let decoded = RangeAllocation::decode(&value.value).unwrap();
        bitmap_from_bytes(&decoded.data, SIZE).contains(offset(&ip))
    };
    common::eventually(
        "the live read of the gone Service, or its IP set again",
        || async {
            let _ = repair.reconcile(&common::ctx(&sim, false)).await;
            live_read() || set_again().await
        },
    )
    .await;
    let report = pass(&sim, &repair).await;
    assert!(report.drift.is_empty(), "{report:?}");
    assert!(
        !set_again().await,
        "an IP was set for a Service that is gone"
    );
    assert!(common::events_of(&sim, "ClusterIPNotAllocated").is_empty());
}

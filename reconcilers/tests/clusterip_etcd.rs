//! The ClusterIP repair's etcd mode against a real etcd and the in-process simulator: the
//! legacy `serviceips` bitmap repaired where it exists, never created where it does not.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::etcd::Etcd;
use fixedbitset::FixedBitSet;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::clusterip_repair::{ClusterIpRepair, ClusterIpRepairConfig, RepairMode};
use reconcilers::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use reconcilers::legacy_alloc::etcd::EtcdStore;

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

async fn repair(sim: &apiserver_sim::Sim, etcd: &Etcd) -> Arc<ClusterIpRepair> {
    let repair = Arc::new(
        ClusterIpRepair::new(
            sim.client(),
            ClusterIpRepairConfig {
                mode: RepairMode::Audit,
                service_ranges: vec![RANGE.parse().unwrap()],
                interval: Duration::from_secs(180),
                etcd: Some(etcd.config()),
                ..ClusterIpRepairConfig::default()
            },
            &mut Registry::default(),
        )
        .unwrap(),
    );
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} });
    repair
}

async fn pass(sim: &apiserver_sim::Sim, repair: &ClusterIpRepair) -> reconcilers::PassReport {
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

async fn web_ip(sim: &apiserver_sim::Sim) -> String {
    let services: Api<Service> = Api::namespaced(sim.client(), "default");
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"ports": [{"port": 80}]}
    }))
    .unwrap();
    let web = services.create(&Default::default(), &web).await.unwrap();
    web.spec.unwrap().cluster_ip.unwrap()
}

#[tokio::test]
async fn a_missing_key_stays_missing() {
    let etcd = Etcd::start(None).await;
    let sim = common::sim().await;
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
    let sim = common::sim().await;
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
    report
        .drift
        .iter()
        .filter(|d| d.kind == "clusterip_bitmap_range_mismatch")
        .collect()
}

/// A value stored without a range gets the configured one, its bits kept; once.
#[tokio::test]
async fn an_empty_range_is_filled_in() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = common::sim().await;
    let web = web_ip(&sim).await;
    let stored = RangeAllocation::new(String::new(), bitmap(&[&web, "10.96.0.20"]));
    store
        .compare_and_swap(KEY, None, stored.encode())
        .await
        .unwrap();
    let repair = repair(&sim, &etcd).await;
    let report = pass(&sim, &repair).await;
    let drift = range_drift(&report);
    assert_eq!(drift.len(), 1, "{report:?}");
    assert!(drift[0].applied);
    let value = store.get(KEY).await.unwrap().unwrap();
    let mut expected = vec![web, "10.96.0.20".to_owned()];
    expected.sort_by_key(|ip| offset(ip));
    assert_eq!(ips_of(&value.value), expected);

    let again = pass(&sim, &repair).await;
    assert!(range_drift(&again).is_empty(), "{again:?}");
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), value);
}

/// The range grew from 10.96.0.0/24 to 10.96.0.0/12: every allocation is kept at its IP.
#[tokio::test]
async fn a_grown_range_is_rebuilt_keeping_every_allocation() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = common::sim().await;
    let web = web_ip(&sim).await;
    let stored = value_under("10.96.0.0/24", &["10.96.0.10", "10.96.0.20"]);
    store.compare_and_swap(KEY, None, stored).await.unwrap();
    let repair = repair(&sim, &etcd).await;
    let report = pass(&sim, &repair).await;
    let drift = range_drift(&report);
    assert_eq!(drift.len(), 1, "{report:?}");
    assert!(drift[0].applied && drift[0].message.contains("10.96.0.0/24"));
    let value = store.get(KEY).await.unwrap().unwrap();
    let mut expected = vec!["10.96.0.10".to_owned(), "10.96.0.20".to_owned(), web];
    expected.sort_by_key(|ip| offset(ip));
    expected.dedup();
    assert_eq!(ips_of(&value.value), expected);

    let again = pass(&sim, &repair).await;
    assert!(range_drift(&again).is_empty(), "{again:?}");
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), value);
}

/// The range shrank from 10.96.0.0/11 to 10.96.0.0/12: 10.112.0.5 falls outside and is
/// dropped; a range that is no CIDR at all is reported and left alone.
#[tokio::test]
async fn a_shrunk_range_drops_what_falls_outside() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = common::sim().await;
    let web = web_ip(&sim).await;
    let stored = value_under("10.96.0.0/11", &["10.96.0.10", "10.112.0.5"]);
    store.compare_and_swap(KEY, None, stored).await.unwrap();
    let repair = repair(&sim, &etcd).await;
    let report = pass(&sim, &repair).await;
    let drift = range_drift(&report);
    assert_eq!(drift.len(), 1, "{report:?}");
    assert!(drift[0].applied);
    assert!(
        drift[0]
            .message
            .contains("1 allocations outside it dropped")
    );
    let value = store.get(KEY).await.unwrap().unwrap();
    let mut expected = vec!["10.96.0.10".to_owned(), web];
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
    let report = pass(&sim, &repair).await;
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "clusterip_bitmap_unusable" && d.message.contains("30000-32767")),
        "{report:?}"
    );
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);
}

/// No `serviceClusterIPRange`: the bitmaps are built for the range of the ServiceCIDR
/// `kubernetes` (what kube-apiserver 1.33+ creates from its flag), at the first pass.
#[tokio::test]
async fn without_a_configured_range_the_bitmap_follows_the_service_cidr() {
    use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = common::sim().await;
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
    let ip = web_ip(&sim).await;
    let stored = RangeAllocation::new(RANGE.to_owned(), bitmap(&[]));
    assert!(
        store
            .compare_and_swap(KEY, None, stored.encode())
            .await
            .unwrap()
    );

    let repair = Arc::new(
        ClusterIpRepair::new(
            sim.client(),
            ClusterIpRepairConfig {
                mode: RepairMode::Audit,
                etcd: Some(etcd.config()),
                ..ClusterIpRepairConfig::default()
            },
            &mut Registry::default(),
        )
        .unwrap(),
    );
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} });
    let report = pass(&sim, &repair).await;
    let kinds: Vec<_> = report.drift.iter().map(|d| d.kind).collect();
    assert_eq!(kinds, vec!["clusterip_bitmap_not_allocated"], "{report:?}");
    let value = store.get(KEY).await.unwrap().unwrap();
    let decoded = RangeAllocation::decode(&value.value).unwrap();
    assert_eq!(decoded.range, RANGE);
    assert!(bitmap_from_bytes(&decoded.data, SIZE).contains(offset(&ip)));
}

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

#[tokio::test]
async fn a_foreign_range_is_left_alone() {
    let etcd = Etcd::start(None).await;
    let store = EtcdStore::new(etcd.config());
    let sim = common::sim().await;
    web_ip(&sim).await;
    let stored = RangeAllocation::new("10.0.0.0/24".to_owned(), Vec::new());
    store
        .compare_and_swap(KEY, None, stored.encode())
        .await
        .unwrap();
    let before = store.get(KEY).await.unwrap().unwrap();
    let repair = repair(&sim, &etcd).await;
    let report = pass(&sim, &repair).await;
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "clusterip_bitmap_range_mismatch"),
        "{report:?}"
    );
    assert_eq!(store.get(KEY).await.unwrap().unwrap(), before);
}

//! No `serviceClusterIPRange` configured: the loops read the range from the cluster's
//! `kubernetes` ServiceCIDR, and where the cluster has none (before Kubernetes 1.33) the ClusterIP
//! repair refuses with an error naming the setting while the `kubernetes` Service loop goes on.
//! The cluster's range is TEST-NET-1, unlike kube-apiserver's or kubeadm's defaults. A cluster
//! upgraded in place to serve ServiceCIDRs gives the range from then on.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use anyhow::Result;
use apiserver_sim::{Sim, SimConfig};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, PostParams};
use prometheus_client::registry::Registry;
use reconcilers::clusterip_repair::{self, ClusterIpRepairLoop, RepairMode};
use reconcilers::kubernetes_service::{self, KubernetesServiceLoop};
use reconcilers::{LoopError, Reconciler};
use serde_json::json;

const RANGE: &str = "192.0.2.0/24";

async fn cluster(serve_networking_v1: bool) -> Result<Sim> {
    Ok(Sim::start(SimConfig {
        service_cluster_ip_ranges: vec![RANGE.parse()?],
        seed_namespaces: vec!["default".into(), "kube-system".into(), "shop".into()],
        serve_networking_v1,
        ..SimConfig::default()
    })
    .await?)
}

/// What kube-apiserver 1.33+ creates from its `--service-cluster-ip-range`.
async fn create_kubernetes_service_cidr(sim: &Sim) -> Result<()> {
    Api::<ServiceCIDR>::all(sim.client())
        .create(
            &PostParams::default(),
            &ServiceCIDR {
                metadata: ObjectMeta {
                    name: Some("kubernetes".into()),
                    ..ObjectMeta::default()
                },
                spec: Some(ServiceCIDRSpec {
                    cidrs: Some(vec![RANGE.to_owned()]),
                }),
                status: None,
            },
        )
        .await?;
    Ok(())
}

fn service(ns: &str, name: &str, cluster_ip: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": cluster_ip, "clusterIPs": [cluster_ip], "ports": [{"port": 443, "protocol": "TCP"}], "type": "ClusterIP"},
    })
}

fn unconfigured_repair(sim: &Sim) -> ClusterIpRepairLoop {
    ClusterIpRepairLoop::new(
        sim.client(),
        clusterip_repair::Section {
            mode: RepairMode::Audit,
            ..clusterip_repair::Section::default()
        },
        &common::settings(&[]),
        reconcilers::kubernetes_service::Section::default().service(),
        &mut Registry::default(),
    )
}

/// Runs passes until the Service cache has synced (the watch feeds it in the background).
async fn audit(
    repair: &ClusterIpRepairLoop,
    sim: &Sim,
) -> Result<reconcilers::PassReport, LoopError> {
    for _ in 0..150 {
        match repair.reconcile(&common::ctx(sim, false)).await {
            Err(LoopError::NotSynced(_)) => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            other => return other,
        }
    }
    repair.reconcile(&common::ctx(sim, false)).await
}

/// The cluster IP the `kubernetes` Service loop, with no range configured, gives the Service it
/// creates.
async fn kubernetes_service_ip(sim: &Sim) -> Result<Option<String>> {
    let service_loop = KubernetesServiceLoop::new(
        kubernetes_service::Section::default(),
        &common::settings(&[]),
        sim.client(),
        &mut Registry::default(),
    );
    service_loop.reconcile(&common::ctx(sim, false)).await?;
    let created = Api::<Service>::namespaced(sim.client(), "default")
        .get("kubernetes")
        .await?;
    Ok(created.spec.and_then(|spec| spec.cluster_ip))
}

fn drive(triggers: Vec<reconcilers::Trigger>) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    let mut triggers = futures::stream::select_all(triggers);
    tokio::spawn(async move { while triggers.next().await.is_some() {} })
}

#[tokio::test]
async fn the_range_is_read_from_the_kubernetes_service_cidr() -> Result<()> {
    let sim = cluster(true).await?;
    create_kubernetes_service_cidr(&sim).await?;
    sim.backdoor()
        .put(service("shop", "inside", "192.0.2.10"))?;
    sim.backdoor()
        .put(service("shop", "outside", "198.51.100.7"))?;

    // Audit mode with no range judges by the ServiceCIDR's: the Service inside it is fine, the
    // other one is outside 192.0.2.0/24 (not outside some default range).
    let repair = unconfigured_repair(&sim);
    let _triggers = drive(repair.triggers());
    let report = audit(&repair, &sim).await?;
    let found: Vec<_> = report
        .drift
        .iter()
        .map(|d| (d.kind, d.object.as_str(), d.message.as_str()))
        .collect();
    assert_eq!(
        found,
        [(
            "clusterip_out_of_range",
            "Service/shop/outside",
            "ClusterIPOutOfRange: Cluster IP [IPv4]:198.51.100.7 is not within the service CIDR \
             192.0.2.0/24; please recreate service"
        )]
    );

    // The `kubernetes` Service loop, with no range either, creates the Service with the first IP
    // of the cluster's range.
    assert_eq!(
        kubernetes_service_ip(&sim).await?.as_deref(),
        Some("192.0.2.1")
    );

    // Read once: later passes ask the cluster nothing more about the range.
    sim.clear_requests();
    for _ in 0..3 {
        repair.reconcile(&common::ctx(&sim, false)).await?;
    }
    let reads: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| r.resource == "servicecidrs" || r.path.ends_with("networking.k8s.io/v1"))
        .collect();
    assert_eq!(reads, [], "the range is read once");
    Ok(())
}

#[tokio::test]
async fn without_a_service_cidr_the_repair_refuses_and_names_the_setting() -> Result<()> {
    let sim = cluster(false).await?;
    sim.backdoor()
        .put(service("default", "kubernetes", "192.0.2.1"))?;
    sim.backdoor().put(service("shop", "web", "192.0.2.10"))?;

    let repair = ClusterIpRepairLoop::new(
        sim.client(),
        clusterip_repair::Section::default(),
        &common::settings(&[]),
        reconcilers::kubernetes_service::Section::default().service(),
        &mut Registry::default(),
    );
    let _triggers = drive(repair.triggers());
    let refused = audit(&repair, &sim).await.unwrap_err();
    assert!(matches!(refused, LoopError::Invalid(_)), "{refused:?}");
    let message = refused.to_string();
    for part in [
        "serviceClusterIPRange is not set",
        "serves no networking.k8s.io/v1 ServiceCIDR",
        "the default/kubernetes Service's ClusterIP 192.0.2.1 shows an IPv4 range, but not its size",
        "set serviceClusterIPRange (flag --service-cluster-ip-range)",
    ] {
        assert!(message.contains(part), "{message}");
    }
    // Refusing is all it does: no event, no write, however many passes.
    for _ in 0..3 {
        assert!(repair.reconcile(&common::ctx(&sim, false)).await.is_err());
    }
    assert_eq!(common::writes(&sim), Vec::<String>::new());
    let events = Api::<Event>::all(sim.client())
        .list(&Default::default())
        .await?;
    assert_eq!(events.items.len(), 0);

    // The `kubernetes` Service loop goes on: no range to judge the ClusterIP by, so none is
    // reported, and the rest of the Service is still kept.
    let service_loop = KubernetesServiceLoop::new(
        kubernetes_service::Section::default(),
        &common::settings(&[]),
        sim.client(),
        &mut Registry::default(),
    );
    let report = service_loop.reconcile(&common::ctx(&sim, false)).await?;
    assert!(
        report.drift.iter().all(|d| d.kind != "service_cluster_ip"),
        "{report:?}"
    );
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "service_labels" && d.applied),
        "{report:?}"
    );

    // A missing Service is not created with a guessed IP; the drift says why.
    Api::<Service>::namespaced(sim.client(), "default")
        .delete("kubernetes", &Default::default())
        .await?;
    let report = service_loop.reconcile(&common::ctx(&sim, false)).await?;
    let missing: Vec<_> = report
        .drift
        .iter()
        .filter(|d| d.kind == "service_missing")
        .collect();
    assert_eq!(missing.len(), 1, "{report:?}");
    assert!(!missing[0].applied);
    assert!(
        missing[0].message.contains("--service-cluster-ip-range"),
        "{}",
        missing[0].message
    );
    assert!(
        Api::<Service>::namespaced(sim.client(), "default")
            .get_opt("kubernetes")
            .await?
            .is_none()
    );
    Ok(())
}

/// The `kubernetes` ServiceCIDR as kube-apiserver stores it may hold what k8s-openapi refuses (a
/// condition whose `lastTransitionTime` is `null`) and fields of newer versions: the range is
/// still read, as a Go client reads it.
#[tokio::test]
async fn a_service_cidr_with_nulls_and_unknown_fields_still_gives_the_range() -> Result<()> {
    let sim = cluster(true).await?;
    let stored = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes", "labels": null},
        "spec": {"cidrs": [RANGE], "fieldFromANewerVersion": {"x": 1}},
        "status": {"conditions": [{
            "type": "Ready", "status": "True", "reason": "", "message": "",
            "lastTransitionTime": null,
        }]},
    });
    assert!(serde_json::from_value::<ServiceCIDR>(stored.clone()).is_err());
    sim.backdoor().put(stored)?;

    assert_eq!(
        kubernetes_service_ip(&sim).await?.as_deref(),
        Some("192.0.2.1")
    );
    Ok(())
}

/// The `kubernetes` Service loop, with no range configured, on a cluster before 1.33 whose
/// control plane is upgraded in place: discovery's no is believed for the loop's interval, then
/// asked again, and the range read from the ServiceCIDR kube-apiserver now creates.
#[tokio::test]
async fn after_an_upgrade_in_place_the_range_is_read_from_the_cluster() -> Result<()> {
    let sim = cluster(false).await?;
    let with_interval = |interval| {
        KubernetesServiceLoop::new(
            kubernetes_service::Section {
                interval,
                ..kubernetes_service::Section::default()
            },
            &common::settings(&[]),
            sim.client(),
            &mut Registry::default(),
        )
    };
    // Every pass of this one comes an interval after the one before.
    let every_pass = with_interval(Duration::ZERO);
    let hourly = with_interval(Duration::from_secs(3600));
    let missing_unapplied = |report: &reconcilers::PassReport| {
        let missing = common::drift_of_kind(report, "service_missing");
        missing.len() == 1 && !missing[0].applied
    };
    for service_loop in [&every_pass, &hourly] {
        let report = service_loop.reconcile(&common::ctx(&sim, false)).await?;
        assert!(missing_unapplied(&report), "{report:?}");
    }
    assert_eq!(common::networking_discoveries(&sim), 2);

    sim.set_serve_networking_v1(true);
    create_kubernetes_service_cidr(&sim).await?;
    let report = hourly.reconcile(&common::ctx(&sim, false)).await?;
    assert!(missing_unapplied(&report), "{report:?}");
    assert_eq!(
        common::networking_discoveries(&sim),
        2,
        "within the interval, discovery is not asked again"
    );

    every_pass.reconcile(&common::ctx(&sim, false)).await?;
    let created = Api::<Service>::namespaced(sim.client(), "default")
        .get("kubernetes")
        .await?;
    assert_eq!(
        created.spec.and_then(|spec| spec.cluster_ip).as_deref(),
        Some("192.0.2.1")
    );
    assert_eq!(common::networking_discoveries(&sim), 3);
    every_pass.reconcile(&common::ctx(&sim, false)).await?;
    assert_eq!(
        common::networking_discoveries(&sim),
        3,
        "the range read is kept"
    );
    Ok(())
}

//! The `kubernetes-service` loop against the in-process simulator.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use apiserver_sim::Sim;
use common::{ctx, event_reasons, eventually, sim, writes};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::discovery::NetworkingDiscovery;
use reconcilers::kubernetes_service::{
    KubernetesServiceLoop, RepairPolicy, Section, desired_service,
};
use reconcilers::section::Settings;
use reconcilers::service_cache::record::ServiceRecord;
use reconcilers::watch_cache::{Cached, WatchCache};

type Corruption = Box<dyn Fn(&mut Service)>;

/// `serviceClusterIPRange` 10.96.0.0/12, the other settings' defaults.
fn settings() -> Settings {
    common::settings(&["10.96.0.0/12"])
}

fn service_loop(sim: &Sim, section: Section, settings: Settings) -> KubernetesServiceLoop {
    KubernetesServiceLoop::new(section, &settings, sim.client(), &mut Registry::default())
}

fn api(sim: &Sim) -> Api<Service> {
    Api::namespaced(sim.client(), "default")
}

async fn service(sim: &Sim) -> Option<Service> {
    api(sim).get_opt("kubernetes").await.unwrap()
}

/// The Service's clusterIP.
async fn cluster_ip(sim: &Sim) -> Option<String> {
    service(sim).await.unwrap().spec.unwrap().cluster_ip
}

/// Rewrites the Service as `change` makes it, as another writer would.
async fn tamper_service(sim: &Sim, change: impl FnOnce(&mut Service)) {
    let mut s = service(sim).await.unwrap();
    change(&mut s);
    api(sim)
        .replace("kubernetes", &PostParams::default(), &s)
        .await
        .unwrap();
}

/// How many events of `reason` the simulator holds.
fn events_of_reason(sim: &Sim, reason: &str) -> usize {
    event_reasons(sim).iter().filter(|r| *r == reason).count()
}

#[tokio::test]
async fn creates_the_service_with_the_first_ip_and_then_rests() {
    let sim = sim().await;
    let l = service_loop(&sim, Section::default(), settings());
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert_eq!(report.drift.len(), 1);
    assert_eq!(report.drift[0].kind, "service_missing");
    assert!(report.drift[0].applied);
    let s = service(&sim).await.unwrap();
    let spec = s.spec.clone().unwrap();
    assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.1"));
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_eq!(spec.selector, None);
    let port = &spec.ports.unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.port, port.target_port.clone()),
        (Some("https"), 443, Some(IntOrString::Int(6443)))
    );
    assert_eq!(
        s.metadata
            .labels
            .unwrap()
            .get("provider")
            .map(String::as_str),
        Some("kubernetes")
    );

    sim.clear_requests();
    assert!(l.reconcile(&ctx(&sim, false)).await.unwrap().is_clean());
    assert_eq!(writes(&sim), Vec::<String>::new());
}

#[tokio::test]
async fn every_repairable_drift_is_repaired() {
    let sim = sim().await;
    // A NodePort Service is type drift only when ClusterIP is asked for: unset keeps it.
    let settings = Settings {
        kubernetes_service_node_port: Some(0),
        ..settings()
    };
    let l = service_loop(&sim, Section::default(), settings);
    l.reconcile(&ctx(&sim, false)).await.unwrap();

    let corruptions: Vec<(&str, Corruption)> = vec![
        (
            "service_ports",
            // The port: the targetPort is repaired only when securePort is set.
            Box::new(|s| s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8443),
        ),
        (
            "service_type",
            Box::new(|s| s.spec.as_mut().unwrap().type_ = Some("NodePort".into())),
        ),
        (
            "service_selector",
            Box::new(|s| {
                s.spec.as_mut().unwrap().selector =
                    Some(BTreeMap::from([("app".into(), "x".into())]))
            }),
        ),
        (
            "service_session_affinity",
            Box::new(|s| s.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into())),
        ),
        (
            "service_labels",
            Box::new(|s| {
                s.metadata.labels.as_mut().unwrap().remove("component");
            }),
        ),
    ];
    for (kind, corrupt) in corruptions {
        let mut s = service(&sim).await.unwrap();
        corrupt(&mut s);
        api(&sim)
            .replace("kubernetes", &PostParams::default(), &s)
            .await
            .unwrap();
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert!(
            report.drift.iter().any(|d| d.kind == kind && d.applied),
            "{kind}: {report:?}"
        );
        assert!(
            l.reconcile(&ctx(&sim, false)).await.unwrap().is_clean(),
            "{kind} stays repaired"
        );
        assert!(l.metrics().repairs(kind) >= 1, "{kind} counted");
    }
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert_eq!(
        spec.ports.unwrap()[0].node_port,
        None,
        "the node port allocated by the NodePort switch is gone"
    );
    eventually("KubernetesServiceRepaired event", || async {
        event_reasons(&sim).contains(&"KubernetesServiceRepaired".to_owned())
    })
    .await;
}

/// kube-apiserver run with `--kubernetes-service-node-port=30443` made the Service NodePort;
/// with `kubernetesServiceNodePort` unset the loop leaves its type and node port, which its
/// clients use.
#[tokio::test]
async fn without_a_node_port_a_node_port_service_is_left_as_it_is() {
    let sim = sim().await;
    sim.backdoor()
        .put(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": {"provider": "kubernetes", "component": "apiserver"}},
            "spec": {
                "clusterIP": "10.96.0.1",
                "clusterIPs": ["10.96.0.1"],
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443, "nodePort": 30443}],
                "sessionAffinity": "None",
                "type": "NodePort"
            }
        }))
        .unwrap();
    let l = service_loop(&sim, Section::default(), settings());
    sim.clear_requests();
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(writes(&sim), Vec::<String>::new());
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
    assert_eq!(spec.ports.unwrap()[0].node_port, Some(30443));
}

/// upstream controller_test.go's "service definition wrong port, no expected update": upstream's
/// periodic pass never rewrites the Service (it reconciles only at start-up). `repair: off` is
/// that policy: the wrong port is reported, nothing is written. The default, `repair: repair`,
/// fixes it (`every_repairable_drift_is_repaired`).
#[tokio::test]
async fn repair_off_only_reports_like_upstream() {
    let sim = sim().await;
    let l = service_loop(
        &sim,
        Section {
            repair: RepairPolicy::Off,
            ..Section::default()
        },
        settings(),
    );
    l.reconcile(&ctx(&sim, false)).await.unwrap();
    tamper_service(&sim, |s| {
        s.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8443
    })
    .await;
    sim.clear_requests();
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert_eq!(report.drift.len(), 1);
    assert_eq!(report.drift[0].kind, "service_ports");
    assert_eq!(report.drift[0].action, reconcilers::Action::Report);
    assert!(!report.drift[0].applied);
    assert_eq!(writes(&sim), Vec::<String>::new());
}

#[tokio::test]
async fn dry_run_writes_nothing() {
    let sim = sim().await;
    let l = service_loop(&sim, Section::default(), settings());
    let report = l.reconcile(&ctx(&sim, true)).await.unwrap();
    assert_eq!(report.drift[0].kind, "service_missing");
    assert!(!report.drift[0].applied);
    assert!(service(&sim).await.is_none());

    l.reconcile(&ctx(&sim, false)).await.unwrap();
    tamper_service(&sim, |s| {
        s.spec.as_mut().unwrap().session_affinity = Some("ClientIP".into())
    })
    .await;
    sim.clear_requests();
    let report = l.reconcile(&ctx(&sim, true)).await.unwrap();
    assert_eq!(report.drift.len(), 1);
    assert!(!report.drift[0].applied);
    assert!(report.drift[0].message.contains("would repair"));
    assert_eq!(writes(&sim), Vec::<String>::new());
}

/// A Service someone created with another clusterIP (e.g. before the range changed).
fn plant_wrong_ip(sim: &Sim) {
    sim.backdoor()
        .put(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": {"provider": "kubernetes", "component": "apiserver"}},
            "spec": {
                "clusterIP": "10.96.0.50",
                "clusterIPs": ["10.96.0.50"],
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}],
                "sessionAffinity": "None",
                "type": "ClusterIP"
            }
        }))
        .unwrap();
}

#[tokio::test]
async fn cluster_ip_mismatch_is_reported_never_fixed_by_default() {
    let sim = sim().await;
    plant_wrong_ip(&sim);
    let l = service_loop(&sim, Section::default(), settings());
    sim.clear_requests();
    for _ in 0..10 {
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert_eq!(report.drift.len(), 1);
        assert_eq!(report.drift[0].kind, "service_cluster_ip");
        assert_eq!(report.drift[0].action, reconcilers::Action::Report);
    }
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(l.metrics().cluster_ip_mismatch(), 1);
    eventually("one ClusterIPMismatch warning", || async {
        events_of_reason(&sim, "ClusterIPMismatch") == 1
    })
    .await;
    assert_eq!(cluster_ip(&sim).await.as_deref(), Some("10.96.0.50"));

    // Deleted and created again with the same wrong IP: another Service, another finding.
    let old_uid = uid(&sim).await;
    sim.backdoor()
        .delete("services", "default", "kubernetes")
        .unwrap();
    plant_wrong_ip(&sim);
    let new_uid = uid(&sim).await;
    assert_ne!(old_uid, new_uid);
    // Until the loop's cache has both the delete and the create, a pass may try a create of its
    // own, which the API refuses as the Service exists.
    eventually("a second ClusterIPMismatch warning", || async {
        l.reconcile(&ctx(&sim, false)).await.unwrap();
        events_of_reason(&sim, "ClusterIPMismatch") == 2
    })
    .await;
    for _ in 0..5 {
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert_eq!(report.drift.len(), 1, "{report:?}");
    }
    assert_eq!(events_of_reason(&sim, "ClusterIPMismatch"), 2);
    assert_eq!(uid(&sim).await, new_uid);
    assert_eq!(cluster_ip(&sim).await.as_deref(), Some("10.96.0.50"));
}

async fn uid(sim: &Sim) -> Option<String> {
    api(sim).get("kubernetes").await.unwrap().metadata.uid
}

#[tokio::test]
async fn cluster_ip_mismatch_recreated_only_with_opt_in() {
    let sim = sim().await;
    plant_wrong_ip(&sim);
    let l = service_loop(
        &sim,
        Section {
            recreate_on_cluster_ip_mismatch: true,
            ..Section::default()
        },
        settings(),
    );
    let report = l.reconcile(&ctx(&sim, true)).await.unwrap();
    assert_eq!(report.drift[0].action, reconcilers::Action::Delete);
    assert!(!report.drift[0].applied, "dry-run never deletes");
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert!(report.drift[0].applied, "{report:?}");
    assert_eq!(
        report.drift[0].change(),
        reconcilers::Change {
            was: "clusterIPs [10.96.0.50]".into(),
            became: "recreated to get clusterIPs [10.96.0.1]".into(),
        }
    );
    assert_eq!(cluster_ip(&sim).await.as_deref(), Some("10.96.0.1"));
    assert!(l.reconcile(&ctx(&sim, false)).await.unwrap().is_clean());
}

/// The desired clusterIP is another Service's: recreated there, the Service would be refused and
/// the cluster left without one. So it is not deleted; the refusal is reported once (a warning
/// event, a refusal counted), never as a recreation.
#[tokio::test]
async fn a_recreation_the_api_would_refuse_deletes_nothing() {
    let sim = sim().await;
    plant_wrong_ip(&sim);
    let taker: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "taker", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}
    }))
    .unwrap();
    api(&sim)
        .create(&PostParams::default(), &taker)
        .await
        .unwrap();
    // More Services than a page of the holder search, all after the holder in key order.
    for i in 0..600 {
        sim.backdoor()
            .put(serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("filler-{i}"), "namespace": "zz"},
                "spec": {"ports": [{"port": 80}]}
            }))
            .unwrap();
    }
    let l = service_loop(
        &sim,
        Section {
            recreate_on_cluster_ip_mismatch: true,
            ..Section::default()
        },
        settings(),
    );
    sim.clear_requests();
    for pass in 0..3 {
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert_eq!(report.drift.len(), 1, "pass {pass}: {report:?}");
        assert!(!report.drift[0].applied, "pass {pass}: {report:?}");
        assert!(
            report.drift[0].message.contains("not deleted"),
            "pass {pass}: {report:?}"
        );
    }
    let deletes: Vec<String> = (writes(&sim).into_iter())
        .filter(|w| w.starts_with("delete"))
        .collect();
    assert_eq!(deletes, Vec::<String>::new());
    assert_eq!(cluster_ip(&sim).await.as_deref(), Some("10.96.0.50"));
    assert_eq!(events_of_reason(&sim, "KubernetesServiceRecreated"), 0);
    assert_eq!(events_of_reason(&sim, "KubernetesServiceRepairRefused"), 1);
    assert_eq!(l.metrics().repairs("service_cluster_ip"), 0);
    assert_eq!(l.metrics().refusals("service_cluster_ip"), 1);
    // The holder, found on the first page of one live list of every namespace (the list stops
    // there), is believed for the interval.
    let everywhere = (sim.requests().into_iter())
        .filter(|r| r.verb == "list" && r.resource == "services" && r.namespace.is_empty())
        .count();
    assert_eq!(everywhere, 1);
}

/// A simulator allocating from an IPv4 and an IPv6 service range, and the ranges.
async fn dual_stack_sim() -> (Sim, Vec<ipnet::IpNet>) {
    let ranges: Vec<ipnet::IpNet> = vec![
        "10.96.0.0/12".parse().unwrap(),
        "fd00:10:96::/108".parse().unwrap(),
    ];
    let sim = Sim::start(apiserver_sim::SimConfig {
        seed_namespaces: vec!["default".into()],
        service_cluster_ip_ranges: ranges.clone(),
        ..apiserver_sim::SimConfig::default()
    })
    .await
    .unwrap();
    (sim, ranges)
}

/// A dual-stack Service of the wrong primary family holds the wanted IP as its secondary: its
/// own IPAddress, released with it, is no other holder, so the Service is recreated.
#[tokio::test]
async fn a_recreation_takes_the_ip_the_service_itself_holds_as_secondary() {
    let (sim, ranges) = dual_stack_sim().await;
    let dual: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"provider": "kubernetes", "component": "apiserver"}},
        "spec": {
            "clusterIP": "fd00:10:96::1",
            "clusterIPs": ["fd00:10:96::1", "10.96.0.1"],
            "ipFamilies": ["IPv6", "IPv4"],
            "ipFamilyPolicy": "RequireDualStack",
            "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}]
        }
    }))
    .unwrap();
    api(&sim)
        .create(&PostParams::default(), &dual)
        .await
        .unwrap();
    let own: Api<k8s_openapi::api::networking::v1::IPAddress> = Api::all(sim.client());
    assert!(
        own.get_opt("10.96.0.1").await.unwrap().is_some(),
        "the simulator allocates it"
    );
    let l = service_loop(
        &sim,
        Section {
            recreate_on_cluster_ip_mismatch: true,
            ..Section::default()
        },
        Settings {
            service_ranges: ranges,
            ..settings()
        },
    );
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    let recreated = (report.drift.iter())
        .find(|d| d.kind == "service_cluster_ip")
        .unwrap_or_else(|| panic!("{report:?}"));
    assert!(recreated.applied, "{report:?}");
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.cluster_ips, Some(vec!["10.96.0.1".to_owned()]));
    assert_eq!(events_of_reason(&sim, "KubernetesServiceRepairRefused"), 0);
}

/// A finalizer holds the deleted Service, so the create meets AlreadyExists: it is not
/// recreated yet, and not reported nor counted as if it were.
#[tokio::test]
async fn a_recreation_a_finalizer_holds_is_not_reported_as_done() {
    let sim = sim().await;
    plant_wrong_ip(&sim);
    tamper_service(&sim, |s| {
        s.metadata.finalizers = Some(vec!["example.com/hold".into()])
    })
    .await;
    let l = service_loop(
        &sim,
        Section {
            recreate_on_cluster_ip_mismatch: true,
            ..Section::default()
        },
        settings(),
    );
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert_eq!(report.drift.len(), 1, "{report:?}");
    assert!(!report.drift[0].applied, "{report:?}");
    assert!(
        report.drift[0].message.contains("still being removed"),
        "{report:?}"
    );
    let held = service(&sim).await.unwrap();
    assert!(held.metadata.deletion_timestamp.is_some());
    assert_eq!(events_of_reason(&sim, "KubernetesServiceRecreated"), 0);
    assert_eq!(l.metrics().repairs("service_cluster_ip"), 0);
}

#[tokio::test]
async fn node_port_with_two_ranges_is_single_stack() {
    let sim = Sim::start(apiserver_sim::SimConfig {
        seed_namespaces: vec!["default".into()],
        service_cluster_ip_ranges: vec![
            "10.96.0.0/12".parse().unwrap(),
            "fd00:10:96::/108".parse().unwrap(),
        ],
        ..apiserver_sim::SimConfig::default()
    })
    .await
    .unwrap();
    let c = Settings {
        service_ranges: vec![
            "10.96.0.0/12".parse().unwrap(),
            "fd00:10:96::/108".parse().unwrap(),
        ],
        kubernetes_service_node_port: Some(30443),
        ..settings()
    };
    let l = service_loop(&sim, Section::default(), c);
    l.reconcile(&ctx(&sim, false)).await.unwrap();
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
    assert_eq!(spec.ports.as_ref().unwrap()[0].node_port, Some(30443));
    assert_eq!(spec.cluster_ips, Some(vec!["10.96.0.1".to_owned()]));
    assert!(l.reconcile(&ctx(&sim, false)).await.unwrap().is_clean());
}

/// Two service ranges, but each apiserver advertises one address: the Service stays SingleStack
/// of the primary range's family, as upstream keeps it, so no ClusterIP of the other family
/// points at endpoints nobody serves. kube-apiserver's own SingleStack Service is left as it is.
#[tokio::test]
async fn two_ranges_keep_the_service_single_stack_of_the_primary_family() {
    let (sim, ranges) = dual_stack_sim().await;
    let dual = service_loop(
        &sim,
        Section::default(),
        Settings {
            service_ranges: ranges.clone(),
            ..settings()
        },
    );
    let report = dual.reconcile(&ctx(&sim, false)).await.unwrap();
    assert_eq!(report.drift[0].kind, "service_missing", "{report:?}");
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
    assert_eq!(spec.cluster_ips, Some(vec!["10.96.0.1".to_owned()]));
    assert_eq!(spec.ip_families, Some(vec!["IPv4".to_owned()]));
    sim.clear_requests();
    assert!(dual.reconcile(&ctx(&sim, false)).await.unwrap().is_clean());
    assert_eq!(
        writes(&sim),
        Vec::<String>::new(),
        "never upgraded in place"
    );

    // An IPv6-primary cluster: the IPv6 family alone.
    api(&sim)
        .delete("kubernetes", &Default::default())
        .await
        .unwrap();
    let v6_first = service_loop(
        &sim,
        Section::default(),
        Settings {
            service_ranges: vec![ranges[1], ranges[0]],
            ..settings()
        },
    );
    v6_first.reconcile(&ctx(&sim, false)).await.unwrap();
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
    assert_eq!(spec.cluster_ips, Some(vec!["fd00:10:96::1".to_owned()]));
}

/// A repair the API refuses (the configured node port is another Service's) is reported once, as
/// a warning event, counted as a refusal and never as a repair, however many passes see it; it
/// is repaired once the API accepts it.
#[tokio::test]
async fn a_refused_repair_is_reported_once_and_not_counted_as_a_repair() {
    let sim = sim().await;
    service_loop(&sim, Section::default(), settings())
        .reconcile(&ctx(&sim, false))
        .await
        .unwrap();
    let holder: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "holder", "namespace": "default"},
        "spec": {"type": "NodePort", "ports": [{"port": 80, "nodePort": 30443}]}
    }))
    .unwrap();
    api(&sim)
        .create(&PostParams::default(), &holder)
        .await
        .unwrap();

    let l = service_loop(
        &sim,
        Section::default(),
        Settings {
            kubernetes_service_node_port: Some(30443),
            ..settings()
        },
    );
    for pass in 0..3 {
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert!(!report.drift.is_empty(), "pass {pass}: {report:?}");
        for d in &report.drift {
            assert!(!d.applied, "pass {pass}: {report:?}");
            assert!(d.message.contains("refused"), "pass {pass}: {report:?}");
        }
    }
    let reasons = event_reasons(&sim);
    let count = |reason: &str| reasons.iter().filter(|r| *r == reason).count();
    assert_eq!(count("KubernetesServiceRepairRefused"), 1, "{reasons:?}");
    assert_eq!(count("KubernetesServiceRepaired"), 0, "{reasons:?}");
    for kind in ["service_type", "service_ports"] {
        assert_eq!(l.metrics().repairs(kind), 0, "{kind}");
        assert_eq!(l.metrics().refusals(kind), 1, "{kind}");
    }

    api(&sim)
        .delete("holder", &Default::default())
        .await
        .unwrap();
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert!(
        report.drift.iter().all(|d| d.applied),
        "repaired once accepted: {report:?}"
    );
    assert_eq!(l.metrics().repairs("service_type"), 1);
    let spec = service(&sim).await.unwrap().spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("NodePort"));
}

/// The loop with a Service cache of its own that watches `namespace`, its triggers driven, once
/// the cache has synced.
async fn synced_loop(
    sim: &Sim,
    namespace: &str,
) -> (
    WatchCache<ServiceRecord>,
    KubernetesServiceLoop,
    tokio::task::JoinHandle<()>,
) {
    let settings = settings();
    let services = WatchCache::<ServiceRecord>::new(
        Api::namespaced(sim.client(), namespace),
        watcher::Config::default(),
        &reconcilers::budget::CacheBudget::default(),
    );
    let l = KubernetesServiceLoop::with_shared(
        Section::default(),
        &settings,
        sim.client(),
        (services.clone(), NetworkingDiscovery::new(sim.client())),
        &mut Registry::default(),
    );
    let mut triggers = futures::stream::select_all(l.triggers());
    let driver = tokio::spawn(async move { while triggers.next().await.is_some() {} });
    eventually("the cache synced", || {
        let services = services.clone();
        async move { services.current().is_some() }
    })
    .await;
    (services, l, driver)
}

/// The cache had no Service (it lags behind the API; this one watches `kube-system` only) while
/// another writer, kube-apiserver starting say, created it: the loop's create meets
/// AlreadyExists. The Service was not missing, so nothing is reported as created, no event is
/// published and no repair counted.
#[tokio::test]
async fn a_service_another_writer_created_first_is_not_reported_as_created() {
    let sim = sim().await;
    let settings = settings();
    let (_, l, _driver) = synced_loop(&sim, "kube-system").await;
    let first = desired_service(&Section::default(), &settings, None);
    api(&sim)
        .create(&PostParams::default(), &first)
        .await
        .unwrap();
    sim.clear_requests();

    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    let creates: Vec<u16> = (sim.requests().iter())
        .filter(|r| r.verb == "create" && r.resource == "services")
        .map(|r| r.status)
        .collect();
    assert_eq!(creates, [409], "the cache did not know the Service");
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(events_of_reason(&sim, "KubernetesServiceCreated"), 0);
    assert_eq!(l.metrics().repairs("service_missing"), 0);
}

/// The loop keeps what its own create answered: once the watch brings the created Service, the
/// next pass reads it from the cache and asks the API nothing, where it would otherwise list the
/// Service again to have it whole.
#[tokio::test]
async fn a_pass_after_its_own_create_asks_the_api_nothing() {
    let sim = sim().await;
    let (services, l, _driver) = synced_loop(&sim, "default").await;
    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "service_missing" && d.applied),
        "{report:?}"
    );
    let created: u64 = (service(&sim).await.unwrap().metadata.resource_version)
        .unwrap()
        .parse()
        .unwrap();
    let key = (
        reconcilers::service_cache::record::Name::from("default"),
        reconcilers::service_cache::record::Name::from("kubernetes"),
    );
    eventually("the cache holds the created Service", || {
        let services = services.clone();
        let key = key.clone();
        async move {
            let state = services.current();
            state.and_then(|state| state.get(&key).and_then(|r| r.resource_version()))
                == Some(created)
        }
    })
    .await;
    sim.clear_requests();

    let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    let asked: Vec<String> = (sim.requests().iter())
        .filter(|r| r.resource == "services")
        .map(|r| format!("{} {}", r.verb, r.path))
        .collect();
    assert_eq!(asked, Vec::<String>::new());
}

/// A creation the API refuses (the primary range's first IP is another Service's) is reported
/// once too, and the loop keeps passing instead of failing.
#[tokio::test]
async fn a_refused_creation_is_reported_once() {
    let sim = sim().await;
    let taker: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "taker", "namespace": "default"},
        "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 80}]}
    }))
    .unwrap();
    api(&sim)
        .create(&PostParams::default(), &taker)
        .await
        .unwrap();
    let l = service_loop(&sim, Section::default(), settings());
    for _ in 0..3 {
        let report = l.reconcile(&ctx(&sim, false)).await.unwrap();
        assert_eq!(report.drift.len(), 1, "{report:?}");
        assert_eq!(report.drift[0].kind, "service_missing");
        assert!(!report.drift[0].applied);
        assert!(
            report.drift[0].message.contains("already allocated"),
            "{report:?}"
        );
    }
    let reasons = event_reasons(&sim);
    assert_eq!(
        reasons
            .iter()
            .filter(|r| *r == "KubernetesServiceCreateRefused")
            .count(),
        1,
        "{reasons:?}"
    );
    assert_eq!(l.metrics().repairs("service_missing"), 0);
    assert_eq!(l.metrics().refusals("service_missing"), 1);
}

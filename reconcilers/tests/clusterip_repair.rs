//! The ClusterIP repair and default ServiceCIDR loops against the API simulator, in-process.
//!
//! Each upstream `RepairIPAddress` case is produced by writing broken state through the
//! simulator's backdoor, then repaired (or only reported, where upstream only reports) with the
//! exact event reason, note and reporting controller. Timing is never asserted: conditions are
//! polled with generous deadlines.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::{Api, Client};
use prometheus_client::registry::Registry;
use reconcilers::clusterip_repair::{self, ClusterIpRepairLoop, RepairMode};
use reconcilers::service_cidr::{self, ServiceCidrLoop};
use reconcilers::{Action, PassContext, PassReport, Reconciler};
use serde_json::{Value, json};

const DEADLINE: Duration = Duration::from_secs(30);

fn ranges() -> Vec<ipnet::IpNet> {
    vec![
        "10.96.0.0/16".parse().unwrap(),
        "fd00:10:96::/108".parse().unwrap(),
    ]
}

/// The default ServiceCIDR loop with `ranges` as `serviceClusterIPRange`.
fn service_cidr_loop(client: &Client, ranges: Vec<ipnet::IpNet>) -> Result<ServiceCidrLoop> {
    let settings = reconcilers::section::Settings {
        service_ranges: ranges,
        ..common::settings(&[])
    };
    ServiceCidrLoop::new(client.clone(), service_cidr::Section::default(), &settings)
        .context("a loop for the configured ranges")
}

async fn start_sim() -> Result<Sim> {
    let sim = Sim::start(SimConfig {
        service_cluster_ip_ranges: ranges(),
        seed_namespaces: vec!["default".into(), "shop".into(), "kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    Ok(sim)
}

fn ctx(client: &Client, dry_run: bool) -> PassContext {
    PassContext::leading(client.clone(), dry_run)
}

/// Creates the default ServiceCIDR with the real loop, as a deployment would.
async fn ensure_default_service_cidr(client: &Client) -> Result<()> {
    let service_cidr = service_cidr_loop(client, ranges())?;
    service_cidr.reconcile(&ctx(client, false)).await?;
    Ok(())
}

/// Polls the loop's trigger streams in the background, as the runner does.
fn drive_triggers(repair: &ClusterIpRepairLoop) -> tokio::task::JoinHandle<()> {
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} })
}

/// The loop as the controller builds it.
async fn repair_with(
    _sim: &Sim,
    client: &Client,
    section: clusterip_repair::Section,
) -> Result<(Arc<ClusterIpRepairLoop>, Registry)> {
    let mut registry = Registry::default();
    let settings = reconcilers::section::Settings {
        service_ranges: ranges(),
        ..common::settings(&[])
    };
    let repair = ClusterIpRepairLoop::new(
        client.clone(),
        section,
        &settings,
        reconcilers::kubernetes_service::Section::default().service(),
        &mut registry,
    );
    Ok((Arc::new(repair), registry))
}

/// Auto mode with `grace` as `orphanGracePeriod` (below the file's minimum where a test waits).
fn config(grace: Duration) -> clusterip_repair::Section {
    clusterip_repair::Section {
        orphan_grace_period: grace,
        mode: RepairMode::Auto,
        ..clusterip_repair::Section::default()
    }
}

/// Runs passes until one succeeds and `done` holds for its report.
async fn pass_until(
    repair: &ClusterIpRepairLoop,
    client: &Client,
    dry_run: bool,
    what: &str,
    mut done: impl FnMut(&PassReport) -> bool,
) -> Result<PassReport> {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut last;
    loop {
        match repair.reconcile(&ctx(client, dry_run)).await {
            Ok(report) if done(&report) => return Ok(report),
            Ok(report) => last = format!("{report:#?}"),
            Err(err) => last = err.to_string(),
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}; last pass: {last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn create_service(
    client: &Client,
    ns: &str,
    name: &str,
    cluster_ip: Option<&str>,
    dual: bool,
) -> Result<Service> {
    let spec = ServiceSpec {
        cluster_ip: cluster_ip.map(str::to_owned),
        cluster_ips: cluster_ip.map(|ip| vec![ip.to_owned()]),
        ip_family_policy: Some(
            if dual {
                "PreferDualStack"
            } else {
                "SingleStack"
            }
            .to_owned(),
        ),
        ports: Some(vec![ServicePort {
            port: 80,
            ..ServicePort::default()
        }]),
        ..ServiceSpec::default()
    };
    let service = Service {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(ns.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    };
    Api::<Service>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &service)
        .await
        .with_context(|| format!("create Service {ns}/{name}"))
}

fn cluster_ips(service: &Service) -> Vec<String> {
    service
        .spec
        .as_ref()
        .and_then(|s| s.cluster_ips.clone())
        .unwrap_or_default()
}

fn ip_address_json(
    ip: &str,
    parent: Value,
    managed_by: Option<&str>,
    family: &str,
    created: &str,
) -> Value {
    let mut labels = serde_json::Map::new();
    labels.insert("ipaddress.kubernetes.io/ip-family".into(), json!(family));
    if let Some(manager) = managed_by {
        labels.insert("ipaddress.kubernetes.io/managed-by".into(), json!(manager));
    }
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IPAddress",
        "metadata": {"name": ip, "labels": labels, "creationTimestamp": created},
        "spec": {"parentRef": parent},
    })
}

fn service_ref(ns: &str, name: &str) -> Value {
    json!({"group": "", "resource": "services", "namespace": ns, "name": name})
}

const LONG_AGO: &str = "2020-01-01T00:00:00Z";

fn backdoor_service(ns: &str, name: &str, ips: &[&str]) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ips[0], "clusterIPs": ips, "ports": [{"port": 80, "protocol": "TCP"}], "type": "ClusterIP"},
    })
}

async fn ip_address(client: &Client, ip: &str) -> Result<Option<IPAddress>> {
    Ok(Api::<IPAddress>::all(client.clone()).get_opt(ip).await?)
}

fn parent_of(ip: &IPAddress) -> (String, String, String, String) {
    let parent = &ip.spec.as_ref().unwrap().parent_ref;
    (
        parent.group.clone().unwrap_or_default(),
        parent.resource.clone(),
        parent.namespace.clone().unwrap_or_default(),
        parent.name.clone(),
    )
}

/// Events with this reason from the ClusterIP repair's reporting controller.
async fn repair_events(client: &Client, reason: &str) -> Result<Vec<Event>> {
    let events = Api::<Event>::all(client.clone())
        .list(&Default::default())
        .await?;
    Ok(events
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter(|e| e.reporting_controller.as_deref() == Some("bootstrap-controller"))
        .collect())
}

async fn expect_event(client: &Client, reason: &str, regarding: &str, note: &str) -> Result<()> {
    let events = repair_events(client, reason).await?;
    let found = events.iter().any(|e| {
        e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(regarding)
            && e.note.as_deref() == Some(note)
            && e.type_.as_deref() == Some("Warning")
    });
    if !found {
        let seen: Vec<_> = events
            .iter()
            .map(|e| {
                (
                    e.regarding.as_ref().and_then(|r| r.name.clone()),
                    e.note.clone(),
                )
            })
            .collect();
        bail!("no {reason} event about {regarding} with note {note:?}; saw {seen:?}");
    }
    Ok(())
}

fn has_drift(report: &PassReport, kind: &str, object: &str) -> bool {
    report
        .drift
        .iter()
        .any(|d| d.kind == kind && d.object == object)
}

fn metric_text(registry: &Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
    text
}

#[tokio::test]
async fn default_service_cidr_is_created_upgraded_and_reported() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    let api = Api::<ServiceCIDR>::all(client.clone());
    // Single-stack first, as a cluster that later gains a secondary range.
    let single = service_cidr_loop(&client, ranges()[..1].to_vec())?;
    let report = single.reconcile(&ctx(&client, false)).await?;
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "servicecidr_missing" && d.applied)
    );
    let created = api.get("kubernetes").await?;
    assert_eq!(created.spec.unwrap().cidrs.unwrap(), ["10.96.0.0/16"]);
    let ready = created
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default();
    assert!(
        ready
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True"),
        "{ready:?}"
    );
    assert!(single.reconcile(&ctx(&client, false)).await?.is_clean());

    let dual = service_cidr_loop(&client, ranges())?;
    let dry = dual.reconcile(&ctx(&client, true)).await?;
    assert!(
        dry.drift
            .iter()
            .any(|d| d.kind == "servicecidr_single_stack" && !d.applied)
    );
    assert_eq!(
        api.get("kubernetes")
            .await?
            .spec
            .unwrap()
            .cidrs
            .unwrap()
            .len(),
        1,
        "dry-run wrote"
    );
    let upgraded = dual.reconcile(&ctx(&client, false)).await?;
    let upgrade = upgraded
        .drift
        .iter()
        .find(|d| d.kind == "servicecidr_single_stack" && d.applied)
        .with_context(|| format!("no upgrade in {upgraded:#?}"))?;
    assert_eq!(
        upgrade.change(),
        reconcilers::Change {
            was: "CIDRs [10.96.0.0/16]".into(),
            became: "CIDRs [10.96.0.0/16 fd00:10:96::/108]".into(),
        }
    );
    assert_eq!(
        api.get("kubernetes").await?.spec.unwrap().cidrs.unwrap(),
        ["10.96.0.0/16", "fd00:10:96::/108"]
    );

    // A different configuration is reported (event once however many passes), never applied or
    // shrunk.
    let other = service_cidr_loop(&client, vec!["10.100.0.0/16".parse()?])?;
    for _ in 0..10 {
        let report = other.reconcile(&ctx(&client, false)).await?;
        assert!(
            report
                .drift
                .iter()
                .any(|d| d.kind == "servicecidr_inconsistent" && d.action == Action::Report)
        );
    }
    assert_eq!(
        api.get("kubernetes")
            .await?
            .spec
            .unwrap()
            .cidrs
            .unwrap()
            .len(),
        2
    );
    let events = Api::<Event>::all(client.clone())
        .list(&Default::default())
        .await?;
    let inconsistent: Vec<_> = events
        .items
        .iter()
        .filter(|e| e.reason.as_deref() == Some("KubernetesDefaultServiceCIDRInconsistent"))
        .collect();
    assert_eq!(inconsistent.len(), 1, "{inconsistent:?}");
    assert_eq!(
        inconsistent[0].note.as_deref(),
        Some(
            "The default ServiceCIDR [10.96.0.0/16 fd00:10:96::/108] does not match the controller flag configurations [10.100.0.0/16]"
        )
    );
    assert_eq!(
        inconsistent[0].reporting_controller.as_deref(),
        Some("bootstrap-controller")
    );

    // Cleared (the object replaced by one matching `other`) and back: reported again, once.
    // kube's Recorder folds a repeat into the first event's series, so occurrences are counted.
    let inconsistent_events = || async {
        let events = Api::<Event>::all(client.clone())
            .list(&Default::default())
            .await?;
        anyhow::Ok(
            events
                .items
                .iter()
                .filter(|e| e.reason.as_deref() == Some("KubernetesDefaultServiceCIDRInconsistent"))
                .map(|e| e.series.as_ref().map_or(1, |series| series.count))
                .sum::<i32>(),
        )
    };
    let replace_with = |cidrs: &[&str]| {
        let cidrs: Vec<String> = cidrs.iter().map(|c| (*c).to_owned()).collect();
        let api = api.clone();
        async move {
            api.delete("kubernetes", &Default::default()).await?;
            // A finalizer would keep it; the simulator has none, kube-apiserver would.
            anyhow::ensure!(api.get_opt("kubernetes").await?.is_none());
            api.create(
                &PostParams::default(),
                &ServiceCIDR {
                    metadata: ObjectMeta {
                        name: Some("kubernetes".into()),
                        ..ObjectMeta::default()
                    },
                    spec: Some(k8s_openapi::api::networking::v1::ServiceCIDRSpec {
                        cidrs: Some(cidrs),
                    }),
                    status: None,
                },
            )
            .await?;
            anyhow::Ok(())
        }
    };
    replace_with(&["10.100.0.0/16"]).await?;
    for _ in 0..3 {
        other.reconcile(&ctx(&client, false)).await?;
    }
    assert_eq!(inconsistent_events().await?, 1);
    replace_with(&["10.96.0.0/16"]).await?;
    for _ in 0..3 {
        other.reconcile(&ctx(&client, false)).await?;
    }
    assert_eq!(inconsistent_events().await?, 2);
    Ok(())
}

/// Plants every upstream case; returns (description, expected reason, regarding, note).
struct Planted {
    missing_v6: String,
    wrong_kind_ip: String,
    dangling_ip: String,
    duplicate_ip: String,
    not_service_ip: &'static str,
    leaked_ip: &'static str,
    wrong_parent_ip: &'static str,
    foreign_ip: &'static str,
    relabel_ip: String,
}

/// Creates the default ServiceCIDR, then plants every upstream case.
async fn plant_every_case(sim: &Sim, client: &Client) -> Result<Planted> {
    ensure_default_service_cidr(client).await?;
    let backdoor = sim.backdoor();
    // Healthy services, allocated by the simulator like kube-apiserver does.
    let a = create_service(client, "shop", "a", None, true).await?;
    let b = create_service(client, "shop", "b", None, false).await?;
    let c = create_service(client, "shop", "c", None, false).await?;
    let d = create_service(client, "shop", "d", None, false).await?;
    let e = create_service(client, "shop", "e", None, true).await?;
    create_service(client, "shop", "f", Some("10.96.7.7"), false).await?;
    let a_ips = cluster_ips(&a);
    assert_eq!(a_ips.len(), 2, "dual-stack service {a_ips:?}");
    let missing_v6 = a_ips[1].clone();
    // ClusterIPNotAllocated: a's IPv6 IPAddress vanished.
    backdoor.delete("ipaddresses.networking.k8s.io", "", &missing_v6)?;
    // Wrong reference: b's IPAddress points at a Gateway.
    let wrong_kind_ip = cluster_ips(&b)[0].clone();
    backdoor.put(ip_address_json(
        &wrong_kind_ip,
        json!({"group": "gateway.networking.k8s.io", "resource": "gateways", "namespace": "shop", "name": "b"}),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    // Dangling reference: c's IPAddress points at a Service that does not exist.
    let dangling_ip = cluster_ips(&c)[0].clone();
    backdoor.put(ip_address_json(
        &dangling_ip,
        service_ref("shop", "ghost"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    // ClusterIPAlreadyAllocated: a second Service claims d's IP.
    let duplicate_ip = cluster_ips(&d)[0].clone();
    backdoor.put(backdoor_service("shop", "d-copy", &[&duplicate_ip]))?;
    // Out of range and invalid.
    backdoor.put(backdoor_service("shop", "far", &["192.0.2.5"]))?;
    backdoor.put(backdoor_service("shop", "bad", &["10.96.0.999"]))?;
    // IPAddress managed by the allocator but not referencing a Service.
    let not_service_ip = "10.96.200.1";
    backdoor.put(ip_address_json(
        not_service_ip,
        json!({"group": "example.io", "resource": "widgets", "namespace": "shop", "name": "w"}),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    // Leaked: its Service is gone, and it is old.
    let leaked_ip = "10.96.200.2";
    backdoor.put(ip_address_json(
        leaked_ip,
        service_ref("shop", "deleted-long-ago"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    // Wrong parent: e exists but does not list this IP.
    let wrong_parent_ip = "10.96.200.3";
    backdoor.put(ip_address_json(
        wrong_parent_ip,
        service_ref("shop", "e"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    // Someone else's IPAddress, parent gone: never touched.
    let foreign_ip = "10.96.200.4";
    backdoor.put(ip_address_json(
        foreign_ip,
        service_ref("shop", "nobody"),
        Some("example.io/allocator"),
        "IPv4",
        LONG_AGO,
    ))?;
    // Wrong family label on e's IPv6 IPAddress: recreated silently.
    let relabel_ip = cluster_ips(&e)[1].clone();
    backdoor.put(ip_address_json(
        &relabel_ip,
        service_ref("shop", "e"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    Ok(Planted {
        missing_v6,
        wrong_kind_ip,
        dangling_ip,
        duplicate_ip,
        not_service_ip,
        leaked_ip,
        wrong_parent_ip,
        foreign_ip,
        relabel_ip,
    })
}

/// A simulator with every upstream case planted, and the repair (a 60 s orphan grace) driven
/// by its triggers. Fields drop in the order the tests' locals did.
struct EveryCase {
    _triggers: tokio::task::JoinHandle<()>,
    registry: Registry,
    repair: Arc<ClusterIpRepairLoop>,
    planted: Planted,
    client: Client,
    sim: Sim,
}

async fn every_case() -> Result<EveryCase> {
    let sim = start_sim().await?;
    let client = sim.client();
    let planted = plant_every_case(&sim, &client).await?;
    let (repair, registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let triggers = drive_triggers(&repair);
    Ok(EveryCase {
        _triggers: triggers,
        registry,
        repair,
        planted,
        client,
        sim,
    })
}

impl EveryCase {
    /// Passes until one reports the planted leaked IPAddress: the planted drift is seen.
    async fn pass_with_the_planted_drift(&self) -> Result<PassReport> {
        let leaked = format!("IPAddress/{}", self.planted.leaked_ip);
        pass_until(
            &self.repair,
            &self.client,
            false,
            "a pass with the planted drift",
            |r| has_drift(r, "ipaddress_leaked", &leaked),
        )
        .await
    }
}

/// Each report-only finding of the planted cases has exactly one event; `context` is added to
/// the failure message.
async fn one_event_per_report_only_finding(client: &Client, context: &str) -> Result<()> {
    let reasons = event_reasons_of(client).await?;
    for reason in [
        "ClusterIPAlreadyAllocated",
        "ClusterIPOutOfRange",
        "ClusterIPNotValid",
    ] {
        assert_eq!(
            reasons.iter().filter(|r| *r == reason).count(),
            1,
            "{reason}{context}: {reasons:?}"
        );
    }
    Ok(())
}

/// Conditions the repair only reports (a duplicate, out-of-range or invalid cluster IP) get
/// their event once, however many passes find them again.
#[tokio::test]
async fn report_only_findings_get_one_event_however_many_passes() -> Result<()> {
    let setup = every_case().await?;
    let (repair, client, sim) = (&setup.repair, &setup.client, &setup.sim);
    setup.pass_with_the_planted_drift().await?;
    let event_writes = |sim: &Sim| {
        sim.requests()
            .iter()
            .filter(|r| {
                r.resource == "events" && matches!(r.verb.as_str(), "create" | "patch" | "update")
            })
            .count()
    };
    let before = event_writes(sim);
    for round in 0..10 {
        let report = pass_until(repair, client, false, "another pass", |_| true).await?;
        assert!(
            has_drift(&report, "clusterip_out_of_range", "Service/shop/far"),
            "round {round}: the finding is still reported to check: {report:#?}"
        );
    }
    assert_eq!(
        event_writes(sim),
        before,
        "passes wrote events about unchanged findings"
    );
    one_event_per_report_only_finding(client, "").await
}

#[tokio::test]
async fn a_finding_whose_event_is_refused_is_reported_on_a_later_pass() -> Result<()> {
    let setup = every_case().await?;
    let (repair, client, sim) = (&setup.repair, &setup.client, &setup.sim);
    // As when the namespace events go into is still being created: the first ten writes of an
    // event (more than one pass writes) are refused.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Create),
        Some("events"),
        10,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    pass_until(repair, client, false, "a pass that publishes", |_| true).await?;
    let after = repair.reconcile(&ctx(client, false)).await;
    one_event_per_report_only_finding(client, &format!(" (a pass after: {after:?})")).await
}

async fn event_reasons_of(client: &Client) -> Result<Vec<String>> {
    let events: Api<Event> = Api::all(client.clone());
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|e| e.reason)
        .collect())
}

#[tokio::test]
async fn every_upstream_case_is_repaired_or_reported_with_its_event() -> Result<()> {
    let setup = every_case().await?;
    let (repair, client, planted, registry) = (
        &setup.repair,
        &setup.client,
        &setup.planted,
        &setup.registry,
    );

    let report = setup.pass_with_the_planted_drift().await?;
    for (kind, object, applied) in [
        ("clusterip_not_allocated", "Service/shop/a", true),
        ("ipaddress_wrong_reference", "Service/shop/b", true),
        ("ipaddress_wrong_reference", "Service/shop/c", true),
        ("clusterip_already_allocated", "Service/shop/d-copy", false),
        ("clusterip_out_of_range", "Service/shop/far", false),
        ("clusterip_not_valid", "Service/shop/bad", false),
        ("ipaddress_not_a_service", "IPAddress/10.96.200.1", true),
        ("ipaddress_leaked", "IPAddress/10.96.200.2", true),
        ("ipaddress_wrong_parent", "IPAddress/10.96.200.3", true),
        ("ipaddress_wrong_labels", "Service/shop/e", true),
    ] {
        let drift = report
            .drift
            .iter()
            .find(|d| d.kind == kind && d.object == object)
            .with_context(|| format!("no {kind} drift for {object} in {report:#?}"))?;
        assert_eq!(drift.applied, applied, "{drift:?}");
        // A repair's log line says what the IPAddress was and became in the loop's own words;
        // a finding only reported has no change to tell.
        assert_eq!(drift.change.is_some(), applied, "{drift:?}");
    }
    assert!(
        !report
            .drift
            .iter()
            .any(|d| d.object.contains(planted.foreign_ip)),
        "{report:#?}"
    );

    // The cluster is repaired.
    let v6 = ip_address(client, &planted.missing_v6)
        .await?
        .context("a's IPv6 IPAddress recreated")?;
    assert_eq!(
        parent_of(&v6),
        ("".into(), "services".into(), "shop".into(), "a".into())
    );
    let labels: BTreeMap<String, String> = v6.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("ipaddress.kubernetes.io/ip-family")
            .map(String::as_str),
        Some("IPv6")
    );
    assert_eq!(
        labels
            .get("ipaddress.kubernetes.io/managed-by")
            .map(String::as_str),
        Some("ipallocator.k8s.io")
    );
    for (ip, owner) in [(&planted.wrong_kind_ip, "b"), (&planted.dangling_ip, "c")] {
        let object = ip_address(client, ip)
            .await?
            .context("repaired IPAddress")?;
        assert_eq!(
            parent_of(&object),
            ("".into(), "services".into(), "shop".into(), owner.into())
        );
    }
    let d_ip = ip_address(client, &planted.duplicate_ip)
        .await?
        .context("d's IPAddress")?;
    assert_eq!(
        parent_of(&d_ip).3,
        "d",
        "the duplicate claimant does not take the IPAddress"
    );
    for gone in [
        planted.not_service_ip,
        planted.leaked_ip,
        planted.wrong_parent_ip,
    ] {
        assert!(
            ip_address(client, gone).await?.is_none(),
            "{gone} should be deleted"
        );
    }
    assert!(
        ip_address(client, planted.foreign_ip).await?.is_some(),
        "foreign IPAddress touched"
    );
    let relabeled = ip_address(client, &planted.relabel_ip)
        .await?
        .context("relabelled")?;
    assert_eq!(
        relabeled
            .metadata
            .labels
            .unwrap_or_default()
            .get("ipaddress.kubernetes.io/ip-family")
            .map(String::as_str),
        Some("IPv6")
    );

    // The events, word for word.
    let ip6 = &planted.missing_v6;
    expect_event(
        client,
        "ClusterIPNotAllocated",
        "a",
        &format!("Cluster IP [IPv6]: {ip6} is not allocated; repairing"),
    )
    .await?;
    expect_event(
        client,
        "ClusterIPNotAllocated",
        "b",
        &format!(
            "the ClusterIP [IPv4]: {} for Service shop/b has a wrong reference; repairing",
            planted.wrong_kind_ip
        ),
    )
    .await?;
    expect_event(
        client,
        "ClusterIPNotAllocated",
        "c",
        &format!(
            "the ClusterIP [IPv4]: {} for Service shop/c has a wrong reference; repairing",
            planted.dangling_ip
        ),
    )
    .await?;
    expect_event(
        client,
        "ClusterIPAlreadyAllocated",
        "d-copy",
        &format!(
            "Cluster IP [IPv4]:{} was assigned to multiple services; please recreate service",
            planted.duplicate_ip
        ),
    )
    .await?;
    expect_event(
        client,
        "ClusterIPOutOfRange",
        "far",
        "Cluster IP [IPv4]: 192.0.2.5 is not within any configured Service CIDR; please recreate service",
    )
    .await?;
    expect_event(
        client,
        "ClusterIPNotValid",
        "bad",
        "Cluster IP 10.96.0.999 is not a valid IP; please recreate Service",
    )
    .await?;
    expect_event(
        client,
        "IPAddressNotAllocated",
        planted.not_service_ip,
        "IPAddress 10.96.200.1 appears to have been modified, not referencing a Service &{example.io widgets shop w}: cleaning up",
    )
    .await?;
    expect_event(
        client,
        "IPAddressNotAllocated",
        planted.leaked_ip,
        "IPAddress: 10.96.200.2 for Service shop/deleted-long-ago appears to have leaked: cleaning up",
    )
    .await?;
    expect_event(
        client,
        "IPAddressWrongReference",
        planted.wrong_parent_ip,
        "IPAddress: 10.96.200.3 for Service shop/e has a wrong reference; cleaning up",
    )
    .await?;
    let actions: Vec<_> = repair_events(client, "ClusterIPNotValid")
        .await?
        .iter()
        .map(|e| e.action.clone())
        .collect();
    assert_eq!(actions, [Some("ClusterIPValidation".to_owned())]);

    // Only reported drift remains.
    let again = pass_until(repair, client, false, "a settled pass", |r| {
        r.drift.iter().all(|d| d.action == Action::Report)
    })
    .await?;
    assert_eq!(again.drift.len(), 3, "{again:#?}");

    let metrics = metric_text(registry);
    for line in [
        "clusterip_repair_ip_errors_total{type=\"leak\"}",
        "clusterip_repair_ip_errors_total{type=\"repair\"}",
        "clusterip_repair_ip_errors_total{type=\"duplicate\"}",
        "clusterip_repair_ip_errors_total{type=\"outOfRange\"}",
        "clusterip_repair_ip_errors_total{type=\"invalid\"}",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
    Ok(())
}

#[tokio::test]
async fn dry_run_reports_every_case_and_writes_nothing() -> Result<()> {
    let setup = every_case().await?;
    let (repair, client, sim) = (&setup.repair, &setup.client, &setup.sim);
    let before = sim.backdoor().list("ipaddresses.networking.k8s.io")?;
    sim.clear_requests();
    let report = pass_until(
        repair,
        client,
        true,
        "a dry-run pass with every case",
        |r| r.drift.len() >= 10,
    )
    .await?;
    assert!(report.drift.iter().all(|d| !d.applied), "{report:#?}");
    let kinds: std::collections::BTreeSet<_> = report.drift.iter().map(|d| d.kind).collect();
    for kind in [
        "clusterip_not_allocated",
        "ipaddress_wrong_reference",
        "clusterip_already_allocated",
        "clusterip_out_of_range",
        "clusterip_not_valid",
        "ipaddress_not_a_service",
        "ipaddress_leaked",
        "ipaddress_wrong_parent",
        "ipaddress_wrong_labels",
    ] {
        assert!(kinds.contains(kind), "{kind} not reported: {kinds:?}");
    }
    let writes: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| !matches!(r.verb.as_str(), "get" | "list" | "watch" | "GET"))
        .collect();
    assert!(writes.is_empty(), "dry-run wrote: {writes:?}");
    assert_eq!(
        sim.backdoor().list("ipaddresses.networking.k8s.io")?,
        before
    );
    Ok(())
}

#[tokio::test]
async fn orphan_younger_than_the_grace_period_is_kept_then_deleted() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let grace = Duration::from_secs(4);
    let (repair, _registry) = repair_with(&sim, &client, config(grace)).await?;
    let _triggers = drive_triggers(&repair);
    // As kube-apiserver does mid-create: the IPAddress exists, its Service not yet.
    let now = jiff::Timestamp::now()
        .round(jiff::Unit::Second)?
        .to_string();
    sim.backdoor().put(ip_address_json(
        "10.96.201.1",
        service_ref("shop", "being-created"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        &now,
    ))?;
    let report = pass_until(
        &repair,
        &client,
        false,
        "a pass seeing the young orphan",
        |_| true,
    )
    .await?;
    assert!(
        !has_drift(&report, "ipaddress_leaked", "IPAddress/10.96.201.1"),
        "{report:#?}"
    );
    assert!(ip_address(&client, "10.96.201.1").await?.is_some());
    // The Service never arrives: once the grace period is over the orphan goes.
    pass_until(&repair, &client, false, "the orphan's deletion", |r| {
        r.drift
            .iter()
            .any(|d| d.object == "IPAddress/10.96.201.1" && d.applied)
    })
    .await?;
    assert!(ip_address(&client, "10.96.201.1").await?.is_none());
    Ok(())
}

/// kube-apiserver's clock 90 s behind this controller's: a Service being created (its IPAddress
/// written, the Service itself not yet) has an IPAddress that looks 90 s old, past the grace.
/// It is left alone until the grace has passed on this controller's clock too, and the Service
/// lands in time.
#[tokio::test]
async fn an_orphan_that_only_looks_old_to_a_clock_ahead_is_not_deleted() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a first pass", |_| true).await?;
    let ip_cache_before = repair.cache_bytes().1;
    let behind = (jiff::Timestamp::now() - jiff::SignedDuration::from_secs(90))
        .round(jiff::Unit::Second)?
        .to_string();
    sim.backdoor().put(ip_address_json(
        "10.96.201.2",
        service_ref("shop", "web"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        &behind,
    ))?;
    pass_until(
        &repair,
        &client,
        false,
        "a pass seeing the IPAddress",
        |_| repair.cache_bytes().1 != ip_cache_before,
    )
    .await?;
    let report = pass_until(&repair, &client, false, "a second pass", |_| true).await?;
    assert!(
        !has_drift(&report, "ipaddress_leaked", "IPAddress/10.96.201.2"),
        "{report:#?}"
    );
    assert!(ip_address(&client, "10.96.201.2").await?.is_some());
    // The Service lands; the IPAddress is its.
    sim.backdoor()
        .put(backdoor_service("shop", "web", &["10.96.201.2"]))?;
    pass_until(&repair, &client, false, "a pass with the Service", |_| {
        cached(&repair, "shop", "web")
    })
    .await?;
    assert!(ip_address(&client, "10.96.201.2").await?.is_some());
    assert!(
        repair_events(&client, "IPAddressNotAllocated")
            .await?
            .is_empty()
    );
    Ok(())
}

/// As above, with the IPAddress already there at the loop's first pass (a restart, a failover)
/// and kube-apiserver's clock an hour behind: nothing in the view was created after it, so
/// nothing shows it old on kube-apiserver's own clock, and it is held from first sight too.
#[tokio::test]
async fn an_orphan_that_only_looks_old_at_the_first_pass_is_not_deleted() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let behind = (jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1))
        .round(jiff::Unit::Second)?
        .to_string();
    sim.backdoor().put(ip_address_json(
        "10.96.201.3",
        service_ref("shop", "api"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        &behind,
    ))?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    let report = pass_until(&repair, &client, false, "a first pass", |_| true).await?;
    assert!(
        !has_drift(&report, "ipaddress_leaked", "IPAddress/10.96.201.3"),
        "{report:#?}"
    );
    assert!(ip_address(&client, "10.96.201.3").await?.is_some());
    sim.backdoor()
        .put(backdoor_service("shop", "api", &["10.96.201.3"]))?;
    pass_until(&repair, &client, false, "a pass with the Service", |_| {
        cached(&repair, "shop", "api")
    })
    .await?;
    assert!(ip_address(&client, "10.96.201.3").await?.is_some());
    assert!(
        repair_events(&client, "IPAddressNotAllocated")
            .await?
            .is_empty()
    );
    Ok(())
}

/// `check` (one dry-run pass, from a fresh start) says what a run's first pass would do with
/// leaks: one that kube-apiserver's own clock shows past its grace (another IPAddress was created
/// more than the grace after it) would be deleted; the newest one would be held until this
/// controller has seen it for the grace, and the report says so rather than leave it out or show
/// it as deleted at once. The note is the same on every pass, so `run --dry-run` logs it once.
#[tokio::test]
async fn a_dry_run_says_which_leaks_a_run_would_hold_and_for_how_long() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    for (ip, name, hours) in [("10.96.201.4", "old", 2), ("10.96.201.5", "newest", 1)] {
        let created = (jiff::Timestamp::now() - jiff::SignedDuration::from_hours(hours))
            .round(jiff::Unit::Second)?
            .to_string();
        sim.backdoor().put(ip_address_json(
            ip,
            service_ref("shop", name),
            Some("ipallocator.k8s.io"),
            "IPv4",
            &created,
        ))?;
    }
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    sim.clear_requests();
    let report = pass_until(&repair, &client, true, "a dry-run pass", |_| true).await?;
    let leak = |object: &str| {
        report
            .drift
            .iter()
            .find(|d| d.kind == "ipaddress_leaked" && d.object == object)
    };
    let old = leak("IPAddress/10.96.201.4").expect("the old leak is reported");
    assert!(!old.applied && !old.message.contains("held"), "{old:#?}");
    let newest = leak("IPAddress/10.96.201.5").expect("the newest leak is reported");
    assert!(!newest.applied, "{newest:#?}");
    assert!(
        newest
            .message
            .ends_with("(held: a run deletes it once this controller has seen it for 1m)"),
        "{newest:#?}"
    );
    // The same drift on a dry-run pass over a second later, so that `run --dry-run` logs it
    // once (a note counting down would be a new drift on every pass).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let again = pass_until(&repair, &client, true, "a second dry-run pass", |_| true).await?;
    assert!(
        again.drift.iter().any(|d| d == newest),
        "{newest:#?} not in {again:#?}"
    );
    let writes: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| !matches!(r.verb.as_str(), "get" | "list" | "watch" | "GET"))
        .collect();
    assert!(writes.is_empty(), "the dry run wrote: {writes:?}");
    // A run's first pass does just that: the old leak goes, the newest stays.
    pass_until(&repair, &client, false, "the old leak's deletion", |r| {
        has_drift(r, "ipaddress_leaked", "IPAddress/10.96.201.4")
    })
    .await?;
    assert!(ip_address(&client, "10.96.201.4").await?.is_none());
    assert!(ip_address(&client, "10.96.201.5").await?.is_some());
    Ok(())
}

/// From now on the IPAddress watch reopens `millis` late, and the open one ends: what happens
/// to IPAddresses reaches the cache that late, while the Services' watch goes on. The fault
/// delays new requests only, not the events of an open watch.
async fn ipaddress_events_late(sim: &Sim, millis: u64) {
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Watch),
        Some("ipaddresses.networking.k8s.io"),
        1.0,
        FaultKind::Latency { millis },
    ));
    sim.close_watches();
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// kube-apiserver writes the IPAddress, then the Service; their events come on two watches, and
/// the Service's may arrive first. The IPAddress is read live before one is created for it, so
/// the repair sends no create at all (the create would only meet 409, yet it is a write to an
/// object that is not the controller's).
#[tokio::test]
async fn an_ipaddress_the_cache_has_not_seen_yet_is_not_created_again() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a first clean pass", |r| {
        r.is_clean()
    })
    .await?;
    // Long enough that the Service reaches the cache first (within 6 s, below).
    ipaddress_events_late(&sim, 10_000).await;
    let object: IPAddress = serde_json::from_value(ip_address_json(
        "10.96.9.8",
        service_ref("shop", "early"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    Api::<IPAddress>::all(client.clone())
        .create(&PostParams::default(), &object)
        .await?;
    sim.backdoor()
        .put(backdoor_service("shop", "early", &["10.96.9.8"]))?;
    sim.clear_requests();
    // The Services' watch is back within 1.6 s (the list+watch's first pause), the IPAddresses'
    // not before 10 s: a pass once the Service is cached meets it without its IPAddress.
    until_cached(&repair, ("shop", "early"), Duration::from_secs(6)).await?;
    repair.reconcile(&ctx(&client, false)).await?;
    let requests = sim.requests();
    let of = |verb: &str| {
        (requests.iter())
            .filter(|r| r.verb == verb && r.resource.starts_with("ipaddresses"))
            .collect::<Vec<_>>()
    };
    assert!(of("create").is_empty(), "{:?}", of("create"));
    // The Service was met without its IPAddress, and the live read answered it: without that
    // read nothing here shows the race happened.
    assert!(!of("list").is_empty(), "no live read of the IPAddress");
    sim.faults().clear();
    Ok(())
}

#[tokio::test]
async fn service_visible_before_its_ipaddress_is_not_repaired_into_a_duplicate() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a first clean pass", |r| {
        r.is_clean()
    })
    .await?;
    // IPAddress watch events arrive late (8 s); the Service shows up first.
    ipaddress_events_late(&sim, 8000).await;
    sim.backdoor()
        .put(backdoor_service("shop", "late", &["10.96.9.9"]))?;
    // The allocator's own write, delayed, lands while the repair may be running.
    let writer = {
        let client = client.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let object: IPAddress = serde_json::from_value(ip_address_json(
                "10.96.9.9",
                service_ref("shop", "late"),
                Some("ipallocator.k8s.io"),
                "IPv4",
                LONG_AGO,
            ))
            .unwrap();
            Api::<IPAddress>::all(client)
                .create(&PostParams::default(), &object)
                .await
        })
    };
    sim.clear_requests();
    until_cached(&repair, ("shop", "late"), Duration::from_secs(5)).await?;
    for _ in 0..3 {
        // A create of the repair's may meet the allocator's (409): the next pass goes on.
        repair.reconcile(&ctx(&client, false)).await.ok();
    }
    // The passes met the Service without its IPAddress in the cache and read it live: without
    // that read nothing here shows the race happened.
    let live_reads = (sim.requests().iter())
        .filter(|r| r.verb == "list" && r.resource.starts_with("ipaddresses"))
        .count();
    assert!(live_reads > 0, "no live read of the IPAddress");
    // The allocator's create lands, or finds the repair's IPAddress for the same Service there
    // (the repair may act in the 300 ms when the IPAddress truly does not exist).
    match writer.await? {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(err) => bail!("the allocator's create failed otherwise: {err}"),
    }
    sim.faults().clear();
    let settled = pass_until(&repair, &client, false, "a settled pass", |r| r.is_clean()).await?;
    assert!(settled.is_clean());
    let held = ip_address(&client, "10.96.9.9")
        .await?
        .context("no IPAddress for the late Service's IP")?;
    assert_eq!(
        parent_of(&held),
        ("".into(), "services".into(), "shop".into(), "late".into()),
        "{held:?}"
    );
    assert!(
        repair_events(&client, "ClusterIPAlreadyAllocated")
            .await?
            .is_empty()
    );
    Ok(())
}

/// A Service the cache cannot know about, whose IPAddress looks leaked to it: the live read
/// before the delete finds it listing the IP, so the IPAddress stays, and the false finding is
/// neither reported (no drift, no event) nor counted; only the deferral is.
#[tokio::test]
async fn stale_service_cache_neither_deletes_nor_reports() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    // The Service watch is broken from the start: the cache holds the initial list and never
    // hears of anything newer.
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Watch),
        Some("services"),
        1.0,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let (repair, registry) = repair_with(&sim, &client, config(Duration::from_secs(1))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a first clean pass", |r| {
        r.is_clean()
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let fresh = create_service(&client, "shop", "unseen", Some("10.96.10.10"), false).await?;
    assert_eq!(cluster_ips(&fresh), ["10.96.10.10"]);
    sim.backdoor().put(ip_address_json(
        "10.96.10.10",
        service_ref("shop", "unseen"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    let report = pass_until(
        &repair,
        &client,
        false,
        "the live read of the Service",
        |_| live_reads(&sim, "shop", "unseen") > 0,
    )
    .await?;
    assert!(
        report
            .drift
            .iter()
            .all(|d| d.object != "IPAddress/10.96.10.10"),
        "a disproved finding was reported: {report:#?}"
    );
    assert!(
        ip_address(&client, "10.96.10.10").await?.is_some(),
        "a live Service's IPAddress was deleted"
    );
    assert!(
        repair_events(&client, "IPAddressNotAllocated")
            .await?
            .is_empty()
    );
    let metrics = metric_text(&registry);
    assert!(
        !metrics.contains("clusterip_repair_ip_errors_total{type=\"leak\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("clusterip_repair_deferred_deletes_total{reason=\"stale_cache\"}"),
        "{metrics}"
    );
    Ok(())
}

/// A dry run reads a held leak live before it says a run would delete it, as it does every
/// other finding: a Service the cache cannot know about lists the IP, so the leak is not in the
/// report at all.
#[tokio::test]
async fn a_dry_run_does_not_report_a_held_leak_that_a_live_read_disproves() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Watch),
        Some("services"),
        1.0,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, true, "a first clean pass", |r| {
        r.is_clean()
    })
    .await?;
    create_service(&client, "shop", "unseen", Some("10.96.10.11"), false).await?;
    sim.backdoor().put(ip_address_json(
        "10.96.10.11",
        service_ref("shop", "unseen"),
        Some("ipallocator.k8s.io"),
        "IPv4",
        LONG_AGO,
    ))?;
    let report = pass_until(
        &repair,
        &client,
        true,
        "the held leak's live read, or its report",
        |r| {
            live_reads(&sim, "shop", "unseen") > 0
                || has_drift(r, "ipaddress_leaked", "IPAddress/10.96.10.11")
        },
    )
    .await?;
    assert!(
        !has_drift(&report, "ipaddress_leaked", "IPAddress/10.96.10.11"),
        "a held leak that a live read disproves was reported: {report:#?}"
    );
    assert!(ip_address(&client, "10.96.10.11").await?.is_some());
    Ok(())
}

/// Repairs and events the API keeps refusing: every pass finds the same findings again and tries
/// again, but each finding is counted once, each refused repair warned about once, and the
/// refused events once for the streak.
#[tokio::test]
async fn refused_repairs_and_events_are_counted_and_warned_about_once() -> Result<()> {
    let setup = every_case().await?;
    let (repair, client, sim) = (&setup.repair, &setup.client, &setup.sim);
    for (verb, resource) in [
        (Verb::Create, "ipaddresses.networking.k8s.io"),
        (Verb::Delete, "ipaddresses.networking.k8s.io"),
        (Verb::Create, "events"),
    ] {
        sim.faults().inject(FaultRule::next(
            Some(verb),
            Some(resource),
            100_000,
            FaultKind::Error {
                code: 403,
                retry_after_seconds: None,
            },
        ));
    }
    let (captured, _guard) = common::Captured::warnings();
    let errors = |registry: &Registry| {
        metric_text(registry)
            .lines()
            .filter(|line| line.starts_with("clusterip_repair_ip_errors_total{"))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    let snapshot = || {
        (
            errors(&setup.registry),
            captured.count("repair failed"),
            captured.count("cannot publish event"),
        )
    };
    // The first pass on synced caches tries every repair.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while captured.count("repair failed") == 0 {
        let result = repair.reconcile(&ctx(client, false)).await;
        if tokio::time::Instant::now() > deadline {
            bail!("no repair tried; last pass: {result:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut seen = vec![snapshot()];
    for pass in 0..2 {
        let result = repair.reconcile(&ctx(client, false)).await;
        assert!(result.is_err(), "pass {pass}: the refused writes fail it");
        seen.push(snapshot());
    }
    let (counted, refused, events) = &seen[0];
    assert!(
        *refused >= 3,
        "the first pass warns of each refused repair: {seen:?}"
    );
    assert_eq!(*events, 1, "{}", captured.text());
    assert!(
        counted.iter().any(|line| line.contains("repair")),
        "{counted:?}"
    );
    assert!(
        seen.iter().all(|later| later == &seen[0]),
        "later passes counted or warned again: {seen:?}\n{}",
        captured.text()
    );
    Ok(())
}

/// GETs of the Service `namespace/name` the simulator answered: the repair's live reads.
fn live_reads(sim: &Sim, namespace: &str, name: &str) -> usize {
    sim.requests()
        .iter()
        .filter(|r| {
            r.verb == "get"
                && r.resource == "services"
                && r.namespace == namespace
                && r.name == name
        })
        .count()
}

/// Waits until the repair's Service cache holds `namespace/name`, at most `within`: past it,
/// the IPAddress held back behind it may have reached its cache too, and the race is gone.
async fn until_cached(
    repair: &ClusterIpRepairLoop,
    (namespace, name): (&str, &str),
    within: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if cached(repair, namespace, name) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    bail!("the Service {namespace}/{name} was not cached within {within:?}: no race to test")
}

/// Whether the repair's Service cache holds `namespace/name`.
fn cached(repair: &ClusterIpRepairLoop, namespace: &str, name: &str) -> bool {
    use reconcilers::service_cache::record::Name;
    repair
        .shared_services()
        .read()
        .contains_key(&(Name::new(namespace), Name::new(name)))
}

/// A Service deleted without the cache hearing of it (its DELETED event lost, as when the watch
/// cannot decode the object) and its IPAddress released by kube-apiserver: the cache still
/// shows the Service, the IPAddress cache does not show its IP, and the create the repair
/// would make is checked live first. The Service is gone, so no IPAddress is created, and
/// nothing is reported or counted.
#[tokio::test]
async fn a_service_deleted_behind_the_caches_back_gets_no_ipaddress() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    create_service(&client, "shop", "gone", Some("10.96.20.20"), false).await?;
    let (repair, registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a clean pass", |r| r.is_clean()).await?;
    assert!(cached(&repair, "shop", "gone"));

    sim.backdoor().delete_unseen("services", "shop", "gone")?;
    sim.backdoor()
        .delete("ipaddresses.networking.k8s.io", "", "10.96.20.20")?;
    assert!(
        cached(&repair, "shop", "gone"),
        "the cache heard of the delete after all; the test proves nothing"
    );
    let report = pass_until(
        &repair,
        &client,
        false,
        "the live read, or the IPAddress created",
        |_| live_reads(&sim, "shop", "gone") > 0 || sim_has_ip(&sim, "10.96.20.20"),
    )
    .await?;
    assert!(
        !sim_has_ip(&sim, "10.96.20.20"),
        "an IPAddress was created for a Service that is gone"
    );
    assert!(
        report.drift.iter().all(|d| d.object != "Service/shop/gone"),
        "a disproved finding was reported: {report:#?}"
    );
    assert!(
        repair_events(&client, "ClusterIPNotAllocated")
            .await?
            .is_empty()
    );
    let metrics = metric_text(&registry);
    assert!(
        !metrics.contains("clusterip_repair_ip_errors_total{type=\"repair\"}"),
        "{metrics}"
    );
    // Another pass, the cache still behind: still nothing.
    let again = pass_until(&repair, &client, false, "another pass", |_| true).await?;
    assert!(again.is_clean(), "{again:#?}");
    assert!(!sim_has_ip(&sim, "10.96.20.20"));
    Ok(())
}

fn sim_has_ip(sim: &Sim, ip: &str) -> bool {
    sim.backdoor()
        .get("ipaddresses.networking.k8s.io", "", ip)
        .unwrap()
        .is_some()
}

/// What the conformance test "should complete a service status lifecycle" does: a status
/// condition without `lastTransitionTime`, which kube-apiserver stores and serves as `null`,
/// then the Service deleted. The cache hears of both (k8s-openapi's Service could not decode
/// either event, and the cache kept the deleted Service), and the released IP's IPAddress is
/// not created again.
#[tokio::test]
async fn a_service_with_a_null_condition_time_is_followed_to_its_delete() -> Result<()> {
    use kube::api::{ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    create_service(&client, "shop", "lifecycle", Some("10.96.30.30"), false).await?;
    pass_until(
        &repair,
        &client,
        false,
        "a clean pass with the Service",
        |r| r.is_clean() && cached(&repair, "shop", "lifecycle"),
    )
    .await?;

    // Untyped: k8s-openapi's Service cannot decode the answers.
    let services: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), "shop", &ApiResource::erase::<Service>(&()));
    let patched = services
        .patch_status(
            "lifecycle",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{
                "type": "StatusUpdate", "status": "True", "lastTransitionTime": null,
                "reason": "E2E", "message": "Set from e2e test",
            }]}})),
        )
        .await?;
    let stored = sim
        .backdoor()
        .get("services", "shop", "lifecycle")?
        .unwrap();
    assert_eq!(
        stored["status"]["conditions"][0]["lastTransitionTime"],
        Value::Null,
        "the simulator stores the condition as given: {stored}"
    );
    let version: u64 = patched.metadata.resource_version.unwrap().parse()?;
    let seen_version = || {
        use reconcilers::service_cache::record::Name;
        repair
            .shared_services()
            .read()
            .get(&(Name::new("shop"), Name::new("lifecycle")))
            .map(|record| record.resource_version)
    };
    common::eventually("the cache to see the status update", || {
        std::future::ready(seen_version() == Some(version))
    })
    .await;

    services
        .delete("lifecycle", &DeleteParams::default())
        .await?;
    assert!(
        !sim_has_ip(&sim, "10.96.30.30"),
        "the delete released the IP"
    );
    common::eventually("the cache to see the delete", || {
        std::future::ready(!cached(&repair, "shop", "lifecycle"))
    })
    .await;
    let settled = pass_until(&repair, &client, false, "a clean pass", |r| r.is_clean()).await?;
    assert!(settled.is_clean());
    assert!(!sim_has_ip(&sim, "10.96.30.30"));
    Ok(())
}

/// A finding about a Service in a namespace being deleted: its event is refused ("because it
/// is being terminated") and dropped, once; the finding counts as reported, and passes go on
/// without retrying the event.
#[tokio::test]
async fn an_event_into_a_terminating_namespace_is_dropped_not_retried() -> Result<()> {
    let sim = Sim::start(SimConfig {
        service_cluster_ip_ranges: ranges(),
        seed_namespaces: vec!["default".into(), "doomed".into()],
        // The namespace stays terminating for the whole test, its Service with it.
        namespace_finalize_delay: Duration::from_secs(3600),
        ..SimConfig::default()
    })
    .await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    sim.backdoor()
        .put(backdoor_service("doomed", "far", &["192.0.2.10"]))?;
    Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone())
        .delete("doomed", &Default::default())
        .await?;
    let (repair, registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    let event_writes = |sim: &Sim| {
        sim.requests()
            .iter()
            .filter(|r| r.resource == "events" && r.namespace == "doomed")
            .map(|r| r.status)
            .collect::<Vec<_>>()
    };
    pass_until(
        &repair,
        &client,
        false,
        "a pass reporting the finding",
        |r| has_drift(r, "clusterip_out_of_range", "Service/doomed/far"),
    )
    .await?;
    assert_eq!(event_writes(&sim), [403], "one refused event write");
    for round in 0..5 {
        let report = repair.reconcile(&ctx(&client, false)).await?;
        assert!(
            has_drift(&report, "clusterip_out_of_range", "Service/doomed/far"),
            "round {round}: {report:#?}"
        );
    }
    assert_eq!(event_writes(&sim), [403], "the refused event was retried");
    let metrics = metric_text(&registry);
    assert!(
        metrics.contains("clusterip_repair_ip_errors_total{type=\"outOfRange\"} 1"),
        "{metrics}"
    );
    Ok(())
}

/// Audit mode: a Service deleted behind the cache's back and another given its IP. The cache
/// shows both, the later as a duplicate of the first; the live read finds the first gone, so
/// nothing is reported or counted.
#[tokio::test]
async fn a_duplicate_of_a_service_gone_behind_the_caches_back_is_not_reported() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    sim.backdoor()
        .put(backdoor_service("shop", "a", &["10.96.40.40"]))?;
    let (repair, registry) = repair_with(
        &sim,
        &client,
        clusterip_repair::Section {
            mode: RepairMode::Audit,
            ..clusterip_repair::Section::default()
        },
    )
    .await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a clean audit pass", |r| {
        r.is_clean()
    })
    .await?;
    assert!(cached(&repair, "shop", "a"));
    sim.clear_requests();
    sim.backdoor().delete_unseen("services", "shop", "a")?;
    sim.backdoor()
        .put(backdoor_service("shop", "b", &["10.96.40.40"]))?;
    let report = pass_until(
        &repair,
        &client,
        false,
        "the live read of the gone Service, or the duplicate reported",
        |r| live_reads(&sim, "shop", "a") > 0 || !r.is_clean(),
    )
    .await?;
    assert!(
        report.is_clean(),
        "a disproved finding was reported: {report:#?}"
    );
    assert!(
        repair_events(&client, "ClusterIPAlreadyAllocated")
            .await?
            .is_empty()
    );
    let metrics = metric_text(&registry);
    assert!(
        !metrics.contains("clusterip_repair_ip_errors_total{type=\"duplicate\"}"),
        "{metrics}"
    );
    Ok(())
}

#[tokio::test]
async fn audit_mode_reports_legacy_reasons_without_writing() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    let a = create_service(&client, "shop", "a", None, true).await?;
    let a_ip = cluster_ips(&a)[0].clone();
    sim.backdoor()
        .put(backdoor_service("shop", "copy", &[&a_ip]))?;
    sim.backdoor()
        .put(backdoor_service("shop", "far", &["10.200.0.1"]))?;
    sim.backdoor()
        .put(backdoor_service("shop", "bad", &["nope"]))?;
    let (repair, registry) = repair_with(
        &sim,
        &client,
        clusterip_repair::Section {
            mode: RepairMode::Audit,
            ..clusterip_repair::Section::default()
        },
    )
    .await?;
    let _triggers = drive_triggers(&repair);
    sim.clear_requests();
    let report = pass_until(&repair, &client, false, "an audit pass", |r| {
        r.drift.len() == 3
    })
    .await?;
    assert!(
        report
            .drift
            .iter()
            .all(|d| d.action == Action::Report && !d.applied)
    );
    expect_event(
        &client,
        "ClusterIPAlreadyAllocated",
        "copy",
        &format!(
            "Cluster IP [IPv4]:{a_ip} was assigned to multiple services; please recreate service"
        ),
    )
    .await?;
    expect_event(
        &client,
        "ClusterIPOutOfRange",
        "far",
        "Cluster IP [IPv4]:10.200.0.1 is not within the service CIDR 10.96.0.0/16; please recreate service",
    )
    .await?;
    expect_event(
        &client,
        "ClusterIPNotValid",
        "bad",
        "Cluster IP nope is not a valid IP; please recreate service",
    )
    .await?;
    let writes: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| {
            !matches!(r.verb.as_str(), "get" | "list" | "watch" | "GET") && r.resource != "events"
        })
        .collect();
    assert!(writes.is_empty(), "audit wrote: {writes:?}");
    assert!(
        metric_text(&registry).contains("clusterip_repair_ip_errors_total{type=\"duplicate\"} 1")
    );
    Ok(())
}

#[tokio::test]
async fn chaos_never_deletes_a_live_services_ipaddress() -> Result<()> {
    let sim = Sim::start(SimConfig {
        service_cluster_ip_ranges: ranges(),
        seed_namespaces: vec!["shop".into()],
        watch_window: 50,
        ..SimConfig::default()
    })
    .await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    // Live Services with IPs in 10.96.100.0/24; churn and planted orphans elsewhere.
    let mut live = Vec::new();
    for i in 0..60u32 {
        let ip = format!("10.96.100.{}", i + 1);
        create_service(&client, "shop", &format!("live-{i}"), Some(&ip), false).await?;
        live.push((format!("live-{i}"), ip));
    }
    for i in 0..5u32 {
        sim.backdoor().put(ip_address_json(
            &format!("10.96.150.{}", i + 1),
            service_ref("shop", &format!("gone-{i}")),
            Some("ipallocator.k8s.io"),
            "IPv4",
            LONG_AGO,
        ))?;
    }
    let (repair, registry) = repair_with(&sim, &client, config(Duration::from_secs(1))).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, false, "a first pass", |_| true).await?;
    sim.clear_requests();

    let faults = sim.faults();
    for (verb, fault, p) in [
        (
            None,
            FaultKind::Error {
                code: 500,
                retry_after_seconds: None,
            },
            0.15,
        ),
        (
            Some(Verb::List),
            FaultKind::Error {
                code: 503,
                retry_after_seconds: None,
            },
            0.2,
        ),
        (Some(Verb::Get), FaultKind::DropConnection, 0.1),
        (Some(Verb::List), FaultKind::DropConnection, 0.1),
        (
            Some(Verb::Watch),
            FaultKind::CutWatchAfterEvents { events: 3 },
            0.4,
        ),
        (Some(Verb::Watch), FaultKind::WatchGone, 0.2),
        (
            Some(Verb::Watch),
            FaultKind::CutWatchAfter { millis: 300 },
            0.2,
        ),
    ] {
        faults.inject(FaultRule::probability(verb, None, p, fault));
    }
    // Churn while the faults fire: Services created and deleted in 10.96.120.0/24.
    let churn = {
        let client = sim.new_client().await?;
        tokio::spawn(async move {
            for i in 0..40u32 {
                let name = format!("churn-{i}");
                let ip = format!("10.96.120.{}", i + 1);
                if create_service(&client, "shop", &name, Some(&ip), false)
                    .await
                    .is_ok()
                    && i % 2 == 0
                {
                    let _ = Api::<Service>::namespaced(client.clone(), "shop")
                        .delete(&name, &Default::default())
                        .await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let chaos_until = tokio::time::Instant::now() + Duration::from_secs(12);
    let mut passes = 0;
    let mut failures = 0;
    while tokio::time::Instant::now() < chaos_until {
        match repair.reconcile(&ctx(&client, false)).await {
            Ok(_) => passes += 1,
            Err(_) => failures += 1,
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    churn.await?;
    faults.clear();
    assert!(
        passes > 0,
        "no pass succeeded under chaos ({failures} failed)"
    );

    let wrong: Vec<_> = sim
        .requests()
        .into_iter()
        .filter(|r| {
            r.verb == "delete" && r.resource == "ipaddresses" && r.name.starts_with("10.96.100.")
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "deleted live Services' IPAddresses: {wrong:?}"
    );
    for (name, ip) in &live {
        let object = ip_address(&client, ip)
            .await?
            .with_context(|| format!("{ip} of {name} missing"))?;
        assert_eq!(
            parent_of(&object),
            ("".into(), "services".into(), "shop".into(), name.clone())
        );
    }
    // After the storm the planted orphans are gone and everything is consistent.
    pass_until(&repair, &client, false, "a clean pass after chaos", |r| {
        r.is_clean()
    })
    .await?;
    for i in 0..5u32 {
        assert!(
            ip_address(&client, &format!("10.96.150.{}", i + 1))
                .await?
                .is_none()
        );
    }
    for (name, ip) in &live {
        let object = ip_address(&client, ip)
            .await?
            .with_context(|| format!("{ip} of {name} missing"))?;
        assert_eq!(parent_of(&object).3, *name);
    }
    eprintln!(
        "chaos: {passes} passes ok, {failures} failed; metrics:\n{}",
        metric_text(&registry)
    );
    Ok(())
}

#[tokio::test]
async fn dry_run_before_the_default_service_cidr_exists_uses_the_configured_ranges() -> Result<()> {
    let sim = start_sim().await?;
    let client = sim.client();
    let web = create_service(&client, "shop", "web", None, false).await?;
    let ip = cluster_ips(&web)[0].clone();
    sim.backdoor()
        .delete("ipaddresses.networking.k8s.io", "", &ip)?;
    sim.backdoor()
        .put(backdoor_service("shop", "far", &["10.200.0.1"]))?;
    let (repair, _registry) = repair_with(&sim, &client, config(Duration::from_secs(60))).await?;
    let _triggers = drive_triggers(&repair);
    let report = pass_until(&repair, &client, true, "a dry-run pass", |r| {
        r.drift.len() == 2
    })
    .await?;
    assert!(
        has_drift(&report, "clusterip_not_allocated", "Service/shop/web"),
        "{report:#?}"
    );
    assert!(
        has_drift(&report, "clusterip_out_of_range", "Service/shop/far"),
        "{report:#?}"
    );
    // A real pass still waits for the ServiceCIDR, as upstream's repair does.
    let err = repair.reconcile(&ctx(&client, false)).await.unwrap_err();
    assert!(err.to_string().contains("default ServiceCIDR"), "{err}");
    assert!(ip_address(&client, &ip).await?.is_none());
    Ok(())
}

/// The caches list in pages, and a list that meets a failing page starts over: a cache says it
/// is synced only while it holds every object, and until then a pass decides nothing.
#[tokio::test]
async fn caches_are_synced_only_when_complete() -> Result<()> {
    use reconcilers::LoopError;

    let sim = start_sim().await?;
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    for i in 0..50u32 {
        let ip = format!("10.96.200.{}", i + 1);
        sim.backdoor()
            .put(backdoor_service("shop", &format!("svc-{i}"), &[&ip]))?;
        sim.backdoor().put(ip_address_json(
            &ip,
            service_ref("shop", &format!("svc-{i}")),
            Some("ipallocator.k8s.io"),
            "IPv4",
            LONG_AGO,
        ))?;
    }
    let expected = Api::<Service>::all(client.clone())
        .list(&Default::default())
        .await?
        .items
        .len();
    let error = FaultKind::Error {
        code: 500,
        retry_after_seconds: None,
    };
    // The first list of each fails (kube-runtime retries it after its backoff); which page of
    // a list failing leaves the cache unsynced the same way is the reflector's unit test.
    for resource in ["services", "ipaddresses"] {
        sim.faults().inject(FaultRule::next(
            Some(Verb::List),
            Some(resource),
            1,
            error.clone(),
        ));
    }
    let (repair, _registry) = repair_with(
        &sim,
        &client,
        clusterip_repair::Section {
            page_size: 7,
            ..config(Duration::from_secs(60))
        },
    )
    .await?;
    let services = repair.shared_services();
    let _triggers = drive_triggers(&repair);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut unsynced_passes = 0;
    loop {
        {
            let state = services.read();
            if state.synced {
                assert_eq!(state.len(), expected, "a synced cache holds every Service");
                break;
            }
        }
        match repair.reconcile(&ctx(&client, false)).await {
            Err(LoopError::NotSynced(_)) => unsynced_passes += 1,
            Err(err) => bail!("a pass before the caches synced: {err}"),
            Ok(report) => assert!(services.read().synced, "{report:?}"),
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the Service cache never synced");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        unsynced_passes > 0,
        "passes before the sync decided nothing"
    );
    let failed_lists = sim
        .requests()
        .iter()
        .filter(|r| r.verb == "list" && r.resource == "services" && r.status == 500)
        .count();
    assert!(failed_lists > 0, "the Service list met failing pages");
    sim.faults().clear();
    pass_until(&repair, &client, false, "a clean pass", |r| r.is_clean()).await?;
    sim.shutdown().await;
    Ok(())
}

/// A pass whose Service cache is emptied while it acts (its tenant paused over budget, a relist
/// begun) stops before the next finding: nothing more is checked live or written, and the pass
/// is `NotSynced`. The next pass on synced caches acts on the findings.
#[tokio::test]
async fn a_cache_emptied_mid_pass_stops_the_pass_before_the_next_finding() -> Result<()> {
    use reconcilers::LoopError;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let sim = Arc::new(start_sim().await?);
    let client = sim.client();
    ensure_default_service_cidr(&client).await?;
    let orphans = ["10.96.202.1", "10.96.202.2"];
    for (ip, parent) in orphans.iter().zip(["gone-a", "gone-b"]) {
        sim.backdoor().put(ip_address_json(
            ip,
            service_ref("shop", parent),
            Some("ipallocator.k8s.io"),
            "IPv4",
            LONG_AGO,
        ))?;
    }
    // A Service created now shows kube-apiserver's clock past the orphans' grace.
    create_service(&client, "shop", "now", None, false).await?;
    let section = clusterip_repair::Section {
        mode: RepairMode::IpAddress,
        ..config(Duration::from_secs(60))
    };
    let (repair, _registry) = repair_with(&sim, &client, section).await?;
    let _triggers = drive_triggers(&repair);
    pass_until(&repair, &client, true, "both orphans found", |report| {
        orphans.iter().all(|ip| {
            report
                .drift
                .iter()
                .any(|d| d.object == format!("IPAddress/{ip}"))
        })
    })
    .await?;

    // The pass's client: its first live read of a Service empties the Service cache (a relist
    // that cannot complete), waits until the cache says so, and fails; the others go through.
    let services = repair.shared_services();
    let service_reads = Arc::new(AtomicUsize::new(0));
    let pass_client = {
        let (sim, reads) = (sim.clone(), service_reads.clone());
        let service = tower::service_fn(move |request: http::Request<kube::client::Body>| {
            let (sim, reads, services) = (sim.clone(), reads.clone(), services.clone());
            async move {
                if !request.uri().path().contains("/services/")
                    || reads.fetch_add(1, Ordering::SeqCst) > 0
                {
                    return sim.client().send(request).await;
                }
                let error = FaultKind::Error {
                    code: 500,
                    retry_after_seconds: None,
                };
                for (verb, fault) in [(Verb::Watch, FaultKind::WatchGone), (Verb::List, error)] {
                    sim.faults().inject(FaultRule::probability(
                        Some(verb),
                        Some("services"),
                        1.0,
                        fault,
                    ));
                }
                sim.close_watches();
                let deadline = tokio::time::Instant::now() + DEADLINE;
                while services.read().synced {
                    assert!(
                        tokio::time::Instant::now() < deadline,
                        "the Service cache never began a relist"
                    );
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok(http::Response::builder()
                    .status(500)
                    .body(kube::client::Body::from(b"{}".to_vec()))
                    .unwrap())
            }
        });
        Client::new(service, "default")
    };
    let result = repair.reconcile(&ctx(&pass_client, false)).await;
    assert!(
        matches!(result, Err(LoopError::NotSynced(_))),
        "the pass stops when a cache it decided on is emptied: {result:?}"
    );
    assert_eq!(
        service_reads.load(Ordering::SeqCst),
        1,
        "the finding after the cache was emptied is not checked live"
    );
    assert_eq!(sim.request_count("delete", "ipaddresses"), 0);
    for ip in orphans {
        assert!(ip_address(&client, ip).await?.is_some(), "{ip} is kept");
    }

    sim.faults().clear();
    pass_until(&repair, &client, false, "both orphans deleted", |report| {
        report.drift.iter().filter(|d| d.applied).count() == orphans.len()
    })
    .await?;
    for ip in orphans {
        assert!(ip_address(&client, ip).await?.is_none(), "{ip} is deleted");
    }
    Ok(())
}

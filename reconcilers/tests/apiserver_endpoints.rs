//! The apiserver endpoint loops against the in-process simulator: passes are driven directly, so
//! every assertion is about state, not timing.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use apiserver_sim::Sim;
use common::{FakeResolver, Flag, ctx, event_reasons, eventually, ip, reporter, sim, writes};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Endpoints;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use prometheus_client::registry::Registry;
use reconcilers::alloc::IpFamily;
use reconcilers::apiserver_endpoints::{
    ApiserverEndpointsLoop, ApiserverLeaseLoop, EndpointsDeps, EndpointsMode, ReadinessProbe,
    Resolver, Section, ShutdownGate,
};
use reconcilers::section::{LoopSection, Settings};
use reconcilers::{PassContext, Reconciler};

/// One instance's configuration: the loops' section and the settings they read.
#[derive(Clone)]
struct Cfg {
    section: Section,
    settings: Settings,
}

/// `lease` mode, advertising `address`, with an identity of its own.
fn cfg(address: &str) -> Cfg {
    Cfg {
        section: Section {
            mode: Some(EndpointsMode::Lease),
            ..Section::default()
        },
        settings: Settings {
            advertise_address: Some(ip(address)),
            identity: format!("test-{address}"),
            ..common::settings(&[])
        },
    }
}

/// `static` mode with `addresses`.
fn static_cfg(addresses: &[&str]) -> Cfg {
    Cfg {
        section: Section {
            mode: Some(EndpointsMode::Static),
            static_addresses: addresses.iter().map(|a| (*a).to_owned()).collect(),
            ..Section::default()
        },
        settings: common::settings(&[]),
    }
}

fn deps(
    sim: &Sim,
    readiness: Arc<dyn ReadinessProbe>,
    resolver: Arc<dyn Resolver>,
) -> EndpointsDeps {
    // The shutdown probing's window is short here: what it decides is tested, not how long.
    let probing = Section {
        shutdown_probe_window: Duration::from_millis(20),
        ..Section::default()
    };
    EndpointsDeps {
        client: sim.client(),
        shutdown: Arc::new(ShutdownGate::new(&probing, readiness.clone())),
        readiness,
        resolver,
        reporter: reporter(),
        service: reconcilers::kubernetes_service::Section::default().service(),
        probed: None,
        budget: reconcilers::budget::CacheBudget::default(),
    }
}

struct Instance {
    ready: Arc<Flag>,
    shutdown: Arc<ShutdownGate>,
    lease: ApiserverLeaseLoop,
    endpoints: ApiserverEndpointsLoop,
}

fn instance(sim: &Sim, cfg: &Cfg, ready: bool) -> Instance {
    let flag = Arc::new(Flag::new(ready));
    let d = deps(sim, flag.clone(), Arc::new(FakeResolver::default()));
    let mut registry = Registry::default();
    Instance {
        ready: flag,
        shutdown: d.shutdown.clone(),
        lease: ApiserverLeaseLoop::new(&cfg.section, &cfg.settings, d.clone(), &mut registry)
            .unwrap(),
        endpoints: ApiserverEndpointsLoop::new(&cfg.section, &cfg.settings, d, &mut registry),
    }
}

async fn endpoints(sim: &Sim) -> Option<Endpoints> {
    Api::<Endpoints>::namespaced(sim.client(), "default")
        .get_opt("kubernetes")
        .await
        .unwrap()
}

/// Rewrites `default/kubernetes` Endpoints as `change` makes it, as another writer would.
async fn tamper_endpoints(sim: &Sim, change: impl FnOnce(&mut Endpoints)) {
    let mut e = endpoints(sim).await.unwrap();
    change(&mut e);
    Api::<Endpoints>::namespaced(sim.client(), "default")
        .replace("kubernetes", &PostParams::default(), &e)
        .await
        .unwrap();
}

/// The first port of the first subset of `e`, for tampering.
fn first_port(e: &mut Endpoints) -> &mut i32 {
    &mut e.subsets.as_mut().unwrap()[0].ports.as_mut().unwrap()[0].port
}

/// The kinds of the drift `report` found, in its order.
fn kinds(report: &reconcilers::PassReport) -> Vec<&'static str> {
    report.drift.iter().map(|d| d.kind).collect()
}

/// One pass of `l`, which must not fail.
async fn pass(l: &impl Reconciler, sim: &Sim) -> reconcilers::PassReport {
    l.reconcile(&ctx(sim, false)).await.unwrap()
}

/// One dry-run pass of `l`, which must not fail.
async fn dry_pass(l: &impl Reconciler, sim: &Sim) -> reconcilers::PassReport {
    l.reconcile(&ctx(sim, true)).await.unwrap()
}

/// The addresses the Endpoints list (which must exist).
async fn listed_now(sim: &Sim) -> Vec<String> {
    addresses(&endpoints(sim).await.unwrap())
}

/// The addresses listed after one pass of `instance`'s endpoints loop.
async fn listed_after_pass(sim: &Sim, instance: &Instance) -> Vec<String> {
    pass(&instance.endpoints, sim).await;
    listed_now(sim).await
}

fn addresses(e: &Endpoints) -> Vec<String> {
    e.subsets
        .iter()
        .flatten()
        .flat_map(|s| s.addresses.iter().flatten())
        .map(|a| a.ip.clone())
        .collect()
}

async fn slices(sim: &Sim) -> Vec<EndpointSlice> {
    Api::<EndpointSlice>::namespaced(sim.client(), "default")
        .list(&Default::default())
        .await
        .unwrap()
        .items
}

fn slice_addresses(s: &EndpointSlice) -> Vec<String> {
    s.endpoints
        .iter()
        .flat_map(|e| e.addresses.clone())
        .collect()
}

async fn three_members(sim: &Sim) -> Vec<Instance> {
    let instances: Vec<Instance> = ["192.0.2.10", "192.0.2.9", "192.0.2.2"]
        .iter()
        .map(|a| instance(sim, &cfg(a), true))
        .collect();
    for i in &instances {
        let report = i.lease.reconcile(&ctx(sim, false)).await.unwrap();
        assert_eq!(report.drift[0].kind, "member_lease_missing");
        let change = report.drift[0].change();
        assert_eq!(change.was, "absent");
        assert!(change.became.starts_with("listing 192.0.2."), "{change:?}");
    }
    let report = instances[0]
        .endpoints
        .reconcile(&ctx(sim, false))
        .await
        .unwrap();
    assert!(
        report
            .drift
            .iter()
            .any(|d| d.kind == "endpoints_missing" && d.applied),
        "{report:?}"
    );
    instances
}

#[tokio::test]
async fn lease_members_are_written_sorted_to_endpoints_and_slice() {
    let sim = sim().await;
    let instances = three_members(&sim).await;

    let e = endpoints(&sim).await.unwrap();
    assert_eq!(addresses(&e), vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]);
    let subset = &e.subsets.as_ref().unwrap()[0];
    let port = &subset.ports.as_ref().unwrap()[0];
    assert_eq!(
        (port.name.as_deref(), port.port, port.protocol.as_deref()),
        (Some("https"), 6443, Some("TCP"))
    );
    assert_eq!(
        e.metadata
            .labels
            .unwrap()
            .get("endpointslice.kubernetes.io/skip-mirror")
            .map(String::as_str),
        Some("true")
    );

    let all = slices(&sim).await;
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].metadata.name.as_deref(), Some("kubernetes"));
    assert_eq!(all[0].address_type, "IPv4");
    assert_eq!(
        slice_addresses(&all[0]),
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]
    );
    assert!(
        all[0]
            .endpoints
            .iter()
            .all(|e| e.conditions.as_ref().unwrap().ready == Some(true))
    );
    assert_eq!(all[0].ports.as_ref().unwrap()[0].port, Some(6443));

    let m = instances[0].endpoints.metrics();
    assert_eq!(m.members(IpFamily::V4), 3);
    assert_eq!(m.changes("joined"), 3);
    assert_eq!(m.repairs("endpoints_addresses"), 0, "joins are not repairs");
    eventually("MemberJoined events", || async {
        event_reasons(&sim)
            .iter()
            .filter(|r| *r == "MemberJoined")
            .count()
            == 3
    })
    .await;

    // At rest: another pass finds nothing and writes nothing.
    sim.clear_requests();
    let report = pass(&instances[0].endpoints, &sim).await;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(writes(&sim), Vec::<String>::new());
}

#[tokio::test]
async fn not_ready_instance_is_never_added_and_is_removed_when_it_fails() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    let late = instance(&sim, &cfg("192.0.2.4"), false);
    let report = pass(&late.lease, &sim).await;
    assert!(report.is_clean(), "nothing to withdraw: {report:?}");
    pass(&instances[0].endpoints, &sim).await;
    assert!(!listed_now(&sim).await.contains(&"192.0.2.4".to_owned()));

    // Its apiserver becomes ready: it joins.
    late.ready.set(true);
    pass(&late.lease, &sim).await;
    pass(&instances[0].endpoints, &sim).await;
    assert!(listed_now(&sim).await.contains(&"192.0.2.4".to_owned()));
    assert_eq!(late.lease.metrics().ready(), 1);

    // Another one starts failing: below the threshold (3 in a row) its Lease is renewed; at
    // the third failure the Lease goes, then its address.
    instances[1].ready.set(false);
    for failure in 1..=2 {
        let report = pass(&instances[1].lease, &sim).await;
        assert!(report.is_clean(), "failure {failure} tolerated: {report:?}");
    }
    assert_eq!(instances[1].lease.metrics().ready(), 1);
    let report = pass(&instances[1].lease, &sim).await;
    assert_eq!(report.drift[0].kind, "member_lease_not_ready");
    assert!(report.drift[0].applied);
    assert!(
        report.drift[0]
            .change()
            .was
            .starts_with("listing 192.0.2.9 (its apiserver not ready"),
        "{report:?}"
    );
    assert_eq!(report.drift[0].change().became, "deleted");
    assert_eq!(
        listed_after_pass(&sim, &instances[0]).await,
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.4"]
    );
    assert_eq!(
        slice_addresses(&slices(&sim).await[0]),
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.4"]
    );
    assert_eq!(instances[0].endpoints.metrics().changes("left"), 1);
    // Each write to a membership Lease is a repair with its event on that Lease.
    let regarding = |reason: &str| -> Vec<String> {
        let mut names: Vec<String> = common::events_of(&sim, reason)
            .iter()
            .map(|event| event["regarding"]["name"].as_str().unwrap().to_owned())
            .collect();
        names.sort();
        names
    };
    assert_eq!(
        regarding("MemberLeaseCreated"),
        [
            "apiserver-192.0.2.10",
            "apiserver-192.0.2.2",
            "apiserver-192.0.2.4",
            "apiserver-192.0.2.9"
        ]
    );
    assert_eq!(regarding("MemberLeaseWithdrawn"), ["apiserver-192.0.2.9"]);
}

#[tokio::test]
async fn expired_lease_removes_the_member_with_an_event() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    // 192.0.2.9 crashed: its Lease was last renewed long ago.
    let mut stale = sim
        .backdoor()
        .get(
            "leases.coordination.k8s.io",
            "kube-system",
            "apiserver-192.0.2.9",
        )
        .unwrap()
        .unwrap();
    stale["spec"]["renewTime"] = serde_json::json!("2020-01-01T00:00:00.000000Z");
    sim.backdoor().put(stale).unwrap();

    assert_eq!(
        listed_after_pass(&sim, &instances[0]).await,
        vec!["192.0.2.10", "192.0.2.2"]
    );
    assert_eq!(instances[0].endpoints.metrics().changes("expired"), 1);
    eventually("MemberExpired event", || async {
        event_reasons(&sim).contains(&"MemberExpired".to_owned())
    })
    .await;

    // Its sidecar restarts while its apiserver is still starting: nothing comes back.
    let restarted = instance(&sim, &cfg("192.0.2.9"), false);
    let report = pass(&restarted.lease, &sim).await;
    assert_eq!(
        report.drift[0].kind, "member_lease_not_ready",
        "the stale Lease is removed at start"
    );
    assert!(
        sim.backdoor()
            .get(
                "leases.coordination.k8s.io",
                "kube-system",
                "apiserver-192.0.2.9"
            )
            .unwrap()
            .is_none()
    );
}

/// A sidecar restarted beside a busy apiserver: failures before any probe passed keep the live
/// Lease its last process left, until readinessFailureThreshold (3) of them in a row.
#[tokio::test]
async fn a_restarted_sidecar_keeps_its_live_lease_until_the_threshold_of_failures() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    let restarted = instance(&sim, &cfg("192.0.2.9"), false);
    let lease = || {
        sim.backdoor()
            .get(
                "leases.coordination.k8s.io",
                "kube-system",
                "apiserver-192.0.2.9",
            )
            .unwrap()
    };
    for _ in 0..2 {
        let report = pass(&restarted.lease, &sim).await;
        assert!(report.drift.is_empty(), "{:?}", report.drift);
        assert!(lease().is_some(), "the live Lease is kept");
    }
    assert_eq!(
        listed_after_pass(&sim, &instances[0]).await,
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]
    );
    let report = pass(&restarted.lease, &sim).await;
    assert_eq!(report.drift[0].kind, "member_lease_not_ready");
    assert!(lease().is_none());
}

/// A replica that leads again after another led meets the members as they are listed, not as
/// it last wrote them: what joined meanwhile was announced by the other.
#[tokio::test]
async fn a_replica_leading_again_does_not_announce_what_another_announced() {
    let sim = sim().await;
    let fast = |address| {
        let mut cfg = cfg(address);
        cfg.section.interval = std::time::Duration::from_millis(200);
        cfg
    };
    let a = instance(&sim, &fast("192.0.2.10"), true);
    let b = instance(&sim, &fast("192.0.2.2"), true);
    pass(&a.lease, &sim).await;
    pass(&b.lease, &sim).await;
    pass(&a.endpoints, &sim).await;
    assert_eq!(a.endpoints.metrics().changes("joined"), 2);
    // b leads while a third member joins; then a leads again.
    let c = instance(&sim, &fast("192.0.2.9"), true);
    pass(&c.lease, &sim).await;
    assert_eq!(
        listed_after_pass(&sim, &b).await,
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]
    );
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    pass(&a.endpoints, &sim).await;
    assert_eq!(
        a.endpoints.metrics().changes("joined"),
        2,
        "announced again"
    );
}

#[tokio::test]
async fn lease_expiry_without_any_write_wakes_the_leader() {
    let sim = sim().await;
    let mut c = cfg("192.0.2.1");
    c.section.lease_ttl = Duration::from_secs(2);
    c.section.interval = Duration::from_secs(1);
    let leader = instance(&sim, &c, true);
    let short = instance(&sim, &cfg("192.0.2.2"), true);
    let mut short_cfg = cfg("192.0.2.2");
    short_cfg.section.lease_ttl = Duration::from_secs(2);
    short_cfg.section.interval = Duration::from_secs(1);
    let short_lived = instance(&sim, &short_cfg, true);
    drop(short);
    pass(&leader.lease, &sim).await;
    pass(&short_lived.lease, &sim).await;
    // Subscribe before the pass publishes the next deadline.
    let mut triggers = leader.endpoints.triggers();
    let expiry = triggers.pop().unwrap();
    pass(&leader.endpoints, &sim).await;
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1", "192.0.2.2"]);
    // Nobody renews 192.0.2.2 (its sidecar was SIGKILLed); the expiry trigger fires by itself.
    let fired = tokio::time::timeout(Duration::from_secs(20), expiry.into_future()).await;
    assert!(matches!(fired, Ok((Some(()), _))), "expiry trigger fired");
    pass(&leader.lease, &sim).await;
    pass(&leader.endpoints, &sim).await;
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1"]);
}

#[tokio::test]
async fn deleting_every_lease_never_empties_the_endpoints() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    for lease in sim.backdoor().list("leases.coordination.k8s.io").unwrap() {
        let name = lease["metadata"]["name"].as_str().unwrap().to_owned();
        sim.backdoor()
            .delete("leases.coordination.k8s.io", "kube-system", &name)
            .unwrap();
    }
    sim.clear_requests();
    let report = pass(&instances[0].endpoints, &sim).await;
    assert_eq!(report.drift.len(), 1);
    assert_eq!(report.drift[0].kind, "no_members");
    assert!(!report.drift[0].applied);
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(listed_now(&sim).await.len(), 3);
    assert_eq!(slice_addresses(&slices(&sim).await[0]).len(), 3);
}

#[tokio::test]
async fn every_drift_is_repaired_ports_included() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    let leader = &instances[0].endpoints;
    let ep_api = Api::<Endpoints>::namespaced(sim.client(), "default");
    let slice_api = Api::<EndpointSlice>::namespaced(sim.client(), "default");

    // Endpoints port (upstream never repairs this, kubernetes/kubernetes#104252).
    tamper_endpoints(&sim, |e| *first_port(e) = 443).await;
    let report = pass(leader, &sim).await;
    assert_eq!(report.drift.len(), 1, "{report:?}");
    assert_eq!(report.drift[0].kind, "endpoints_ports");
    assert!(report.drift[0].applied);
    assert_eq!(
        endpoints(&sim).await.unwrap().subsets.unwrap()[0]
            .ports
            .as_ref()
            .unwrap()[0]
            .port,
        6443
    );
    assert_eq!(leader.metrics().repairs("endpoints_ports"), 1);

    // An address swapped for a bogus one, and the skip-mirror label removed.
    tamper_endpoints(&sim, |e| {
        e.subsets.as_mut().unwrap()[0].addresses.as_mut().unwrap()[0].ip = "198.51.100.9".into();
        e.metadata.labels = None;
    })
    .await;
    let report = pass(leader, &sim).await;
    assert_eq!(
        kinds(&report),
        vec!["endpoints_label", "endpoints_addresses"]
    );
    assert_eq!(
        listed_now(&sim).await,
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]
    );
    assert_eq!(leader.metrics().repairs("endpoints_addresses"), 1);

    // Slice ports and an endpoint turned not-ready.
    let mut s = slice_api.get("kubernetes").await.unwrap();
    s.ports.as_mut().unwrap()[0].port = Some(1);
    s.endpoints[1].conditions.as_mut().unwrap().ready = Some(false);
    slice_api
        .replace("kubernetes", &PostParams::default(), &s)
        .await
        .unwrap();
    let report = pass(leader, &sim).await;
    assert_eq!(
        kinds(&report),
        vec!["endpointslice_endpoints", "endpointslice_ports"]
    );
    let s = slice_api.get("kubernetes").await.unwrap();
    assert_eq!(s.ports.as_ref().unwrap()[0].port, Some(6443));
    assert!(
        s.endpoints
            .iter()
            .all(|e| e.conditions.as_ref().unwrap().ready == Some(true))
    );

    // Slice deleted; a stray slice of the wrong family added.
    slice_api
        .delete("kubernetes", &Default::default())
        .await
        .unwrap();
    let mut stray = s.clone();
    stray.metadata = kube::api::ObjectMeta {
        name: Some("kubernetes-stray".into()),
        namespace: Some("default".into()),
        labels: s.metadata.labels.clone(),
        ..Default::default()
    };
    stray.address_type = "IPv6".into();
    stray.endpoints = vec![];
    slice_api
        .create(&PostParams::default(), &stray)
        .await
        .unwrap();
    let report = pass(leader, &sim).await;
    assert_eq!(
        kinds(&report),
        vec!["endpointslice_missing", "endpointslice_stray"]
    );
    assert_eq!(
        report.drift[0].change().was,
        "EndpointSlice kubernetes does not exist"
    );
    assert!(
        report.drift[0].change().became.starts_with("members "),
        "{report:?}"
    );
    assert_eq!(report.drift[1].change().became, "deleted", "{report:?}");
    let names: Vec<_> = slices(&sim)
        .await
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, vec!["kubernetes"]);

    // Endpoints deleted outright.
    ep_api
        .delete("kubernetes", &Default::default())
        .await
        .unwrap();
    let report = pass(leader, &sim).await;
    assert_eq!(report.drift[0].kind, "endpoints_missing");
    assert_eq!(listed_now(&sim).await.len(), 3);
    eventually("EndpointsRepaired event", || async {
        event_reasons(&sim).contains(&"EndpointsRepaired".to_owned())
    })
    .await;

    assert!(pass(leader, &sim).await.is_clean());
}

#[tokio::test]
async fn dry_run_reports_and_writes_nothing() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    tamper_endpoints(&sim, |e| *first_port(e) = 443).await;
    Api::<EndpointSlice>::namespaced(sim.client(), "default")
        .delete("kubernetes", &Default::default())
        .await
        .unwrap();
    let before = endpoints(&sim).await.unwrap();

    // A new, ready member whose sidecar runs in dry-run does not write its Lease either.
    let newcomer = instance(&sim, &cfg("192.0.2.5"), true);
    sim.clear_requests();
    let report = dry_pass(&newcomer.lease, &sim).await;
    assert!(
        report.is_clean(),
        "its own Lease is a heartbeat, not drift: {report:?}"
    );

    let report = dry_pass(&instances[0].endpoints, &sim).await;
    assert_eq!(
        kinds(&report),
        vec!["endpoints_ports", "endpointslice_missing"]
    );
    assert!(report.drift.iter().all(|d| !d.applied));
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(endpoints(&sim).await.unwrap(), before);
    assert!(slices(&sim).await.is_empty());

    // Shutdown hooks in dry-run write nothing too.
    instances[0].lease.shutdown(&ctx(&sim, true)).await.unwrap();
    instances[0]
        .endpoints
        .shutdown(&ctx(&sim, true))
        .await
        .unwrap();
    assert_eq!(writes(&sim), Vec::<String>::new());
}

/// A controller stopping next to an apiserver that stays ready (a sidecar restart or upgrade)
/// keeps its membership: the Lease stays, renewed once more on the way out (so it expires a TTL
/// after the stop if the controller does not come back), and the leader leaves its address
/// listed.
#[tokio::test]
async fn shutdown_with_a_ready_apiserver_keeps_the_lease_and_the_address() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    sim.clear_requests();
    for i in [&instances[1], &instances[0]] {
        i.lease.shutdown(&ctx(&sim, false)).await.unwrap();
        i.endpoints.shutdown(&ctx(&sim, false)).await.unwrap();
        assert_eq!(
            (i.shutdown.count("kept"), i.shutdown.count("withdrew")),
            (1, 0)
        );
    }
    assert_eq!(
        writes(&sim),
        vec![
            "update leases kube-system/apiserver-192.0.2.9",
            "update leases kube-system/apiserver-192.0.2.10",
        ],
        "each Lease renewed once on the way out; nothing withdrawn"
    );
    assert_eq!(
        sim.backdoor()
            .list("leases.coordination.k8s.io")
            .unwrap()
            .len(),
        3
    );
    assert_eq!(
        listed_now(&sim).await,
        vec!["192.0.2.10", "192.0.2.2", "192.0.2.9"]
    );
}

/// The apiserver fails its readiness at shutdown (it is stopping too): the controller withdraws.
#[tokio::test]
async fn shutdown_withdraws_at_once_and_the_last_member_empties_the_set() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    for i in &instances {
        i.ready.set(false);
    }
    // A non-leader stopping only deletes its Lease; the leader's next pass drops its address.
    let follower = &instances[1];
    follower.lease.shutdown(&ctx(&sim, false)).await.unwrap();
    follower
        .endpoints
        .shutdown(&ctx(&sim, false))
        .await
        .unwrap();
    assert!(
        listed_now(&sim).await.contains(&"192.0.2.9".to_owned()),
        "a non-leader never writes"
    );
    assert_eq!(
        listed_after_pass(&sim, &instances[0]).await,
        vec!["192.0.2.10", "192.0.2.2"]
    );

    // The leader stopping takes its own address out itself.
    let leader = &instances[0];
    leader.lease.shutdown(&ctx(&sim, false)).await.unwrap();
    leader.endpoints.shutdown(&ctx(&sim, false)).await.unwrap();
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.2"]);
    assert_eq!(slice_addresses(&slices(&sim).await[0]), vec!["192.0.2.2"]);

    // The last member, now leader, stops: the endpoints are emptied, as upstream does.
    let last = &instances[2];
    pass(&last.endpoints, &sim).await;
    last.lease.shutdown(&ctx(&sim, false)).await.unwrap();
    last.endpoints.shutdown(&ctx(&sim, false)).await.unwrap();
    assert!(listed_now(&sim).await.is_empty());
    assert!(slices(&sim).await[0].endpoints.is_empty());
    assert!(
        sim.backdoor()
            .list("leases.coordination.k8s.io")
            .unwrap()
            .is_empty()
    );
}

/// The only static name fails to resolve from the start: nothing is written (no member), and
/// the failure is still published as its Warning event.
#[tokio::test]
async fn a_finding_of_a_pass_that_writes_nothing_is_still_published() {
    let sim = sim().await;
    let resolver = Arc::new(FakeResolver::default());
    resolver.answer("lb.example.com", Err("SERVFAIL".into()));
    let c = static_cfg(&["lb.example.com"]);
    let mut registry = Registry::default();
    let l = ApiserverEndpointsLoop::new(
        &c.section,
        &c.settings,
        deps(&sim, Arc::new(Flag::new(true)), resolver),
        &mut registry,
    );
    pass(&l, &sim).await;
    assert!(endpoints(&sim).await.is_none());
    eventually("StaticAddressResolutionFailed event", || async {
        event_reasons(&sim).contains(&"StaticAddressResolutionFailed".to_owned())
    })
    .await;
}

#[tokio::test]
async fn static_names_keep_the_last_good_set_of_the_services_family() {
    let sim = sim().await;
    let resolver = Arc::new(FakeResolver::default());
    resolver.answer("lb.example.com", Ok(vec![ip("192.0.2.1"), ip("fd00::1")]));
    let c = static_cfg(&["lb.example.com", "192.0.2.7"]);
    let mut errors = Vec::new();
    c.section
        .validate("loops.apiserverEndpoints", &c.settings, &mut errors);
    assert_eq!(errors, []);
    let mut registry = Registry::default();
    let l = ApiserverEndpointsLoop::new(
        &c.section,
        &c.settings,
        deps(&sim, Arc::new(Flag::new(true)), resolver.clone()),
        &mut registry,
    );
    assert!(l.needs_leadership());
    pass(&l, &sim).await;
    // One family, the Service's (no range and no Service here: the members' rule, IPv4 while
    // there is any): the IPv6 address is left out, with a Warning.
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1", "192.0.2.7"]);
    eventually("MemberWrongFamily event", || async {
        event_reasons(&sim).contains(&"MemberWrongFamily".to_owned())
    })
    .await;
    let by_name: Vec<_> = slices(&sim)
        .await
        .iter()
        .map(|s| {
            (
                s.metadata.name.clone().unwrap(),
                s.address_type.clone(),
                slice_addresses(s),
            )
        })
        .collect();
    assert_eq!(
        by_name,
        vec![(
            "kubernetes".into(),
            "IPv4".into(),
            vec!["192.0.2.1".into(), "192.0.2.7".into()]
        )]
    );

    // The name now resolves to nothing, then fails: the last good set stays, with one warning.
    resolver.answer("lb.example.com", Ok(vec![]));
    sim.clear_requests();
    let report = pass(&l, &sim).await;
    assert!(report.is_clean(), "{report:?}");
    resolver.answer("lb.example.com", Err("SERVFAIL".into()));
    assert!(pass(&l, &sim).await.is_clean());
    assert_eq!(writes(&sim), Vec::<String>::new());
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1", "192.0.2.7"]);
    eventually("StaticAddressResolutionFailed event", || async {
        event_reasons(&sim)
            .iter()
            .filter(|r| *r == "StaticAddressResolutionFailed")
            .count()
            == 1
    })
    .await;

    // It moves to a single IPv4 address; a slice of the other family carrying the Service's
    // label (left by an older version, or by hand) goes.
    let stray: EndpointSlice = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes-ipv6", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv6",
        "endpoints": [{"addresses": ["fd00::1"], "conditions": {"ready": true}}],
        "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
    }))
    .unwrap();
    Api::<EndpointSlice>::namespaced(sim.client(), "default")
        .create(&Default::default(), &stray)
        .await
        .unwrap();
    resolver.answer("lb.example.com", Ok(vec![ip("192.0.2.3")]));
    pass(&l, &sim).await;
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.3", "192.0.2.7"]);
    let names: Vec<_> = slices(&sim)
        .await
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, vec!["kubernetes"]);
}

#[tokio::test]
async fn master_count_adds_itself_on_every_instance_and_trims() {
    let sim = sim().await;
    let mk = |a: &str| {
        let mut c = cfg(a);
        c.section.mode = Some(EndpointsMode::MasterCount);
        c.section.apiserver_count = 2;
        c
    };
    let a = instance(&sim, &mk("192.0.2.1"), true);
    let b = instance(&sim, &mk("192.0.2.2"), true);
    let c = instance(&sim, &mk("192.0.2.3"), true);
    assert!(
        !a.endpoints.needs_leadership(),
        "every apiserver adds itself, as upstream"
    );
    for i in [&a, &b] {
        pass(&i.endpoints, &sim).await;
    }
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1", "192.0.2.2"]);
    pass(&c.endpoints, &sim).await;
    let listed = listed_now(&sim).await;
    assert_eq!(listed.len(), 2);
    assert!(listed.contains(&"192.0.2.3".to_owned()));
    // Its apiserver still ready: a restart of the controller alone keeps the address.
    c.endpoints.shutdown(&ctx(&sim, false)).await.unwrap();
    assert!(listed_now(&sim).await.contains(&"192.0.2.3".to_owned()));
    let c = instance(&sim, &mk("192.0.2.3"), false);
    c.endpoints.shutdown(&ctx(&sim, false)).await.unwrap();
    assert!(!listed_now(&sim).await.contains(&"192.0.2.3".to_owned()));
}

#[tokio::test]
async fn watches_trigger_on_corruption() {
    let sim = sim().await;
    let instances = three_members(&sim).await;
    let mut triggers = futures::stream::select_all(instances[0].endpoints.triggers());
    // Let the watches start (each yields once when its initial list is done).
    for _ in 0..3 {
        tokio::time::timeout(Duration::from_secs(20), triggers.next())
            .await
            .unwrap()
            .unwrap();
    }
    tamper_endpoints(&sim, |e| *first_port(e) = 1).await;
    let fired = tokio::time::timeout(Duration::from_secs(20), triggers.next()).await;
    assert!(matches!(fired, Ok(Some(()))));
    let lease_api = Api::<Lease>::namespaced(sim.client(), "kube-system");
    lease_api
        .delete("apiserver-192.0.2.2", &Default::default())
        .await
        .unwrap();
    let fired = tokio::time::timeout(Duration::from_secs(20), triggers.next()).await;
    assert!(matches!(fired, Ok(Some(()))));
}

/// A full-URL probe whose connection fails (here: a TLS name mismatch, as with credentials that
/// changed on disk) builds its client again from the kubeconfig as it is now, within the same
/// check, and keeps a client that works.
#[tokio::test]
async fn a_full_url_probe_rebuilds_its_client_after_a_connection_failure() {
    use reconcilers::apiserver_endpoints::LazyUrlReadyz;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let sim = sim().await;
    let kubeconfig = kube::config::Kubeconfig::read_from(sim.kubeconfig_path()).unwrap();
    let good = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let mut stale = good.clone();
    stale.tls_server_name = Some("not-the-apiserver.example".to_owned());
    let loads = Arc::new(AtomicUsize::new(0));
    let counted = loads.clone();
    let lazy = LazyUrlReadyz::new(
        format!("{}/readyz", sim.base_url()),
        Duration::from_secs(5),
        Arc::new(move || {
            let config = if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                stale.clone()
            } else {
                good.clone()
            };
            Box::pin(async move { Ok(config) })
        }),
    );
    lazy.check().await.unwrap();
    assert_eq!(loads.load(Ordering::SeqCst), 2, "built again once");
    lazy.check().await.unwrap();
    assert_eq!(loads.load(Ordering::SeqCst), 2, "a working client is kept");
}

#[tokio::test]
async fn readyz_probe_follows_the_apiserver() {
    use reconcilers::apiserver_endpoints::{ApiserverReadyz, LazyUrlReadyz};
    let sim = sim().await;
    let by_client = ApiserverReadyz::new(sim.client(), "/readyz", Duration::from_secs(5));
    let kubeconfig = kube::config::Kubeconfig::read_from(sim.kubeconfig_path()).unwrap();
    let base = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let by_url = ApiserverReadyz::for_url(
        &base,
        &format!("{}/readyz", sim.base_url()),
        Duration::from_secs(5),
    )
    .unwrap();
    let lazy = LazyUrlReadyz::new(
        format!("{}/readyz", sim.base_url()),
        Duration::from_secs(5),
        Arc::new(move || {
            let base = base.clone();
            Box::pin(async move { Ok(base) })
        }),
    );
    by_client.check().await.unwrap();
    by_url.check().await.unwrap();
    lazy.check().await.unwrap();
    sim.set_ready(false);
    assert!(
        by_client
            .check()
            .await
            .unwrap_err()
            .to_string()
            .contains("500")
    );
    assert!(by_url.check().await.is_err());
    assert!(lazy.check().await.is_err());

    // The lease loop with the real probe withdraws and rejoins with the apiserver.
    let c = cfg("192.0.2.1");
    let mut registry = Registry::default();
    let d = deps(&sim, Arc::new(by_client), Arc::new(FakeResolver::default()));
    let lease_loop = ApiserverLeaseLoop::new(&c.section, &c.settings, d, &mut registry).unwrap();
    assert!(pass(&lease_loop, &sim).await.is_clean());
    sim.set_ready(true);
    let report = pass(&lease_loop, &sim).await;
    assert_eq!(report.drift[0].kind, "member_lease_missing");
    sim.set_ready(false);
    // Withdrawn at the third failure in a row (the default readinessFailureThreshold).
    for _ in 1..=2 {
        assert!(pass(&lease_loop, &sim).await.is_clean());
    }
    let report = pass(&lease_loop, &sim).await;
    assert_eq!(report.drift[0].kind, "member_lease_not_ready");
    assert!(
        Api::<Lease>::namespaced(sim.client(), "kube-system")
            .get_opt("apiserver-192.0.2.1")
            .await
            .unwrap()
            .is_none()
    );
}

#[tokio::test]
async fn only_the_current_leader_withdraws_itself_at_shutdown() {
    let sim = sim().await;
    let old = instance(&sim, &cfg("192.0.2.1"), true);
    let other = instance(&sim, &cfg("192.0.2.2"), true);
    pass(&old.lease, &sim).await;
    pass(&other.lease, &sim).await;
    // Its apiserver is stopping too, so a leader would withdraw.
    old.ready.set(false);
    // 192.0.2.1 led and ran a pass, then the election handed leadership over before its SIGTERM.
    pass(&old.endpoints, &sim).await;
    let (election, leader) = tokio::sync::watch::channel(false);
    let deposed = PassContext {
        leader,
        ..ctx(&sim, false)
    };
    sim.clear_requests();
    old.endpoints.shutdown(&deposed).await.unwrap();
    assert_eq!(
        writes(&sim),
        Vec::<String>::new(),
        "a deposed leader never writes"
    );

    // While the election says it leads, it withdraws itself at once.
    election.send(true).unwrap();
    old.endpoints.shutdown(&deposed).await.unwrap();
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.2"]);
}

#[tokio::test]
async fn renewal_is_one_write_and_a_hand_edited_lease_is_reclaimed() {
    let sim = sim().await;
    let member = instance(&sim, &cfg("192.0.2.1"), true);
    pass(&member.lease, &sim).await;
    sim.clear_requests();
    assert!(pass(&member.lease, &sim).await.is_clean());
    assert_eq!(
        sim.request_count("get", "leases"),
        0,
        "renewed on top of our last write"
    );
    assert_eq!(sim.request_count("update", "leases"), 1);

    // Someone strips the member label: the next renewal conflicts, re-reads, and restores it.
    let api = Api::<Lease>::namespaced(sim.client(), "kube-system");
    let mut edited = api.get("apiserver-192.0.2.1").await.unwrap();
    edited.metadata.labels = None;
    api.replace("apiserver-192.0.2.1", &PostParams::default(), &edited)
        .await
        .unwrap();
    pass(&member.lease, &sim).await;
    let lease = api.get("apiserver-192.0.2.1").await.unwrap();
    assert_eq!(
        lease
            .metadata
            .labels
            .unwrap()
            .get("bootstrap-controller.io/apiserver-endpoint")
            .map(String::as_str),
        Some("kubernetes")
    );

    // A foreign Lease with our name is never overwritten.
    sim.backdoor()
        .delete(
            "leases.coordination.k8s.io",
            "kube-system",
            "apiserver-192.0.2.1",
        )
        .unwrap();
    sim.backdoor()
        .put(serde_json::json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": "apiserver-192.0.2.1", "namespace": "kube-system"},
            "spec": {"holderIdentity": "someone-else"}
        }))
        .unwrap();
    let fresh = instance(&sim, &cfg("192.0.2.1"), true);
    let err = fresh.lease.reconcile(&ctx(&sim, false)).await.unwrap_err();
    assert!(err.to_string().contains("refusing to overwrite"), "{err}");
}

#[tokio::test]
async fn members_the_api_would_reject_are_left_out_not_fatal() {
    let sim = sim().await;
    let resolver = Arc::new(FakeResolver::default());
    // /etc/hosts style answer: loopback next to a real address.
    resolver.answer("lb.example.com", Ok(vec![ip("127.0.0.1"), ip("192.0.2.1")]));
    let c = static_cfg(&["lb.example.com"]);
    let l = ApiserverEndpointsLoop::new(
        &c.section,
        &c.settings,
        deps(&sim, Arc::new(Flag::new(true)), resolver),
        &mut Registry::default(),
    );
    pass(&l, &sim).await;
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.1"]);
    eventually("InvalidMemberAddress event", || async {
        event_reasons(&sim).contains(&"InvalidMemberAddress".to_owned())
    })
    .await;

    // A hand-made membership Lease with a link-local address does not break lease mode either.
    let lease_member = instance(&sim, &cfg("192.0.2.2"), true);
    pass(&lease_member.lease, &sim).await;
    let mut bogus = sim
        .backdoor()
        .get(
            "leases.coordination.k8s.io",
            "kube-system",
            "apiserver-192.0.2.2",
        )
        .unwrap()
        .unwrap();
    bogus["metadata"]["name"] = serde_json::json!("apiserver-bogus");
    bogus["metadata"]["annotations"]["bootstrap-controller.io/advertise-address"] =
        serde_json::json!("169.254.169.254");
    bogus["metadata"].as_object_mut().unwrap().remove("uid");
    bogus["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    sim.backdoor().put(bogus).unwrap();
    pass(&lease_member.endpoints, &sim).await;
    assert_eq!(listed_now(&sim).await, vec!["192.0.2.2"]);
}

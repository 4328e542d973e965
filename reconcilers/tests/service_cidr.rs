//! The service-cidr loop against the simulator: the default ServiceCIDR created and made Ready,
//! each repair an event from this controller, nothing written in a dry run; a cluster upgraded
//! in place to serve ServiceCIDRs is found by discovery asked again; one kube-apiserver created
//! first is no repair; a create refused at every retry is one event; a `Ready=False` someone
//! else set is one event, whatever its reason.

#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use anyhow::Result;
use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use futures::StreamExt;
use reconcilers::Reconciler;
use reconcilers::clusterip_repair::model::ServiceCidrRecord;
use reconcilers::discovery::NetworkingDiscovery;
use reconcilers::service_cidr::{Section, ServiceCidrLoop};
use reconcilers::watch_cache::{Cached, WatchCache};

#[tokio::test]
async fn a_missing_default_service_cidr_is_created_with_an_event_for_each_repair() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    let settings = common::settings(&["10.96.0.0/12"]);
    let repair = ServiceCidrLoop::new(sim.client(), Section::default(), &settings).unwrap();

    let dry = repair.reconcile(&common::ctx(&sim, true)).await?;
    assert_eq!(dry.drift[0].kind, "servicecidr_missing");
    assert!(!dry.drift[0].applied);
    assert_eq!(
        common::writes(&sim),
        Vec::<String>::new(),
        "a dry run writes nothing"
    );

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    let kinds: Vec<(&str, bool)> = report.drift.iter().map(|d| (d.kind, d.applied)).collect();
    assert!(kinds.contains(&("servicecidr_missing", true)), "{kinds:?}");
    let created = common::events_of(&sim, "DefaultServiceCIDRCreated");
    assert_eq!(created.len(), 1, "{:?}", common::event_reasons(&sim));
    assert_eq!(created[0]["reportingController"], "bootstrap-controller");
    assert_eq!(created[0]["type"], "Normal");
    assert_eq!(created[0]["regarding"]["name"], "kubernetes");
    assert!(
        kinds.contains(&("servicecidr_not_ready", true)),
        "{kinds:?}"
    );
    let ready = report
        .drift
        .iter()
        .find(|d| d.kind == "servicecidr_not_ready")
        .map(|d| d.change());
    assert_eq!(
        ready,
        Some(reconcilers::Change {
            was: "no Ready condition".into(),
            became: "condition Ready=True".into(),
        })
    );
    assert_eq!(common::events_of(&sim, "DefaultServiceCIDRReady").len(), 1);
    Ok(())
}

/// The loop keeps what its own writes answered (the create, then the Ready status): once the
/// watch brings them, the next pass reads the ServiceCIDR from the cache and asks the API
/// nothing, where it would otherwise list it again to have it whole.
#[tokio::test]
async fn a_pass_after_its_own_writes_asks_the_api_nothing() -> Result<()> {
    let sim = common::sim().await;
    let settings = common::settings(&["10.96.0.0/12"]);
    let cidrs = WatchCache::<ServiceCidrRecord>::shared(
        sim.client(),
        &reconcilers::budget::CacheBudget::default(),
    );
    let discovery = NetworkingDiscovery::new(sim.client());
    let shared = (cidrs.clone(), discovery);
    let repair =
        ServiceCidrLoop::with_shared(sim.client(), Section::default(), &settings, shared).unwrap();
    let triggers = futures::stream::select_all(repair.triggers());
    let drive = tokio::spawn(triggers.for_each(|_| async {}));
    common::eventually("the ServiceCIDR cache synced", || async {
        cidrs.current().is_some()
    })
    .await;
    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    assert!(
        common::drift_of_kind(&report, "servicecidr_not_ready")
            .iter()
            .any(|d| d.applied),
        "{report:?}"
    );
    let api: kube::Api<k8s_openapi::api::networking::v1::ServiceCIDR> =
        kube::Api::all(sim.client());
    let written: u64 = api
        .get("kubernetes")
        .await?
        .metadata
        .resource_version
        .unwrap()
        .parse()?;
    let key: Box<str> = "kubernetes".into();
    common::eventually("the cache holds the written ServiceCIDR", || async {
        let state = cidrs.current();
        state.and_then(|state| state.get(&key).and_then(|r| r.resource_version())) == Some(written)
    })
    .await;
    sim.clear_requests();

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    assert!(report.is_clean(), "{report:?}");
    let asked: Vec<String> = (sim.requests().iter())
        .filter(|r| r.resource == "servicecidrs")
        .map(|r| format!("{} {}", r.verb, r.path))
        .collect();
    assert_eq!(asked, Vec::<String>::new());
    drive.abort();
    Ok(())
}

/// A cluster before 1.33 serves no ServiceCIDR, and its control plane is upgraded in place. The
/// loop believes discovery's no for its interval, then asks again and creates the object; a yes
/// is kept for good.
#[tokio::test]
async fn a_cluster_that_serves_service_cidrs_after_an_upgrade_gets_the_default_one() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        serve_networking_v1: false,
        ..SimConfig::default()
    })
    .await?;
    let settings = common::settings(&["10.96.0.0/12"]);
    let with_interval = |interval| {
        let section = Section {
            interval,
            ..Section::default()
        };
        ServiceCidrLoop::new(sim.client(), section, &settings).unwrap()
    };
    // Every pass of this one comes an interval after the one before.
    let every_pass = with_interval(Duration::ZERO);
    let hourly = with_interval(Duration::from_secs(3600));
    for repair in [&every_pass, &hourly] {
        let report = repair.reconcile(&common::ctx(&sim, false)).await?;
        assert!(report.drift.is_empty(), "{report:?}");
    }
    assert_eq!(common::networking_discoveries(&sim), 2);

    sim.set_serve_networking_v1(true);
    let report = hourly.reconcile(&common::ctx(&sim, false)).await?;
    assert!(report.drift.is_empty(), "{report:?}");
    assert_eq!(
        common::networking_discoveries(&sim),
        2,
        "within the interval, discovery is not asked again"
    );

    let report = every_pass.reconcile(&common::ctx(&sim, false)).await?;
    let missing = common::drift_of_kind(&report, "servicecidr_missing");
    assert!(missing.len() == 1 && missing[0].applied, "{report:?}");
    assert_eq!(common::networking_discoveries(&sim), 3);
    every_pass.reconcile(&common::ctx(&sim, false)).await?;
    assert_eq!(
        common::networking_discoveries(&sim),
        3,
        "a cluster found serving ServiceCIDRs is not asked again"
    );
    Ok(())
}

/// kube-apiserver 1.33+ creates the ServiceCIDR `kubernetes` itself, and the loop's watch may not
/// have shown it yet: the create meets 409 AlreadyExists, which is no repair (no event, no
/// applied drift).
#[tokio::test]
async fn a_create_that_meets_the_one_kube_apiserver_made_is_no_repair() -> Result<()> {
    let sim = common::sim().await;
    let repair = ServiceCidrLoop::new(
        sim.client(),
        Section::default(),
        &common::settings(&["10.96.0.0/12"]),
    )
    .unwrap();
    let triggers = futures::stream::select_all(repair.triggers());
    let drive = tokio::spawn(triggers.for_each(|_| async {}));
    common::eventually("the ServiceCIDR watch is open", || async {
        sim.open_watches("servicecidrs") > 0
    })
    .await;
    // The watch ends and opens again, but is never answered: the cache stays as it was.
    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("servicecidrs"),
        1,
        FaultKind::Hang,
    ));
    sim.close_watches();
    common::eventually("the ServiceCIDR watch hangs", || async {
        sim.faults().rules().is_empty()
    })
    .await;
    sim.backdoor().put(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/12"]},
    }))?;

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    assert_eq!(sim.request_count("create", "servicecidrs"), 1);
    assert!(
        common::drift_of_kind(&report, "servicecidr_missing")
            .iter()
            .all(|d| !d.applied),
        "{report:?}"
    );
    assert_eq!(
        common::events_of(&sim, "DefaultServiceCIDRCreated").len(),
        0,
        "{:?}",
        common::event_reasons(&sim)
    );
    drive.abort();
    Ok(())
}

/// A create refused (403: RBAC, an admission webhook) fails the pass, and the runner retries it:
/// upstream's `KubernetesDefaultServiceCIDRError` is published when the failure appears, not at
/// every retry; once the create goes through, the object is made.
#[tokio::test]
async fn a_create_refused_at_every_retry_is_one_error_event() -> Result<()> {
    let sim = common::sim().await;
    let repair = ServiceCidrLoop::new(
        sim.client(),
        Section::default(),
        &common::settings(&["10.96.0.0/12"]),
    )
    .unwrap();
    sim.faults().inject(FaultRule::next(
        Some(Verb::Create),
        Some("servicecidrs"),
        3,
        FaultKind::Error {
            code: 403,
            retry_after_seconds: None,
        },
    ));
    for _ in 0..3 {
        assert!(repair.reconcile(&common::ctx(&sim, false)).await.is_err());
    }
    let errors = common::events_of(&sim, "KubernetesDefaultServiceCIDRError");
    assert_eq!(errors.len(), 1, "{:?}", common::event_reasons(&sim));
    assert_eq!(errors[0]["type"], "Warning");
    assert_eq!(
        errors[0]["series"],
        serde_json::Value::Null,
        "published once, not a series of retries"
    );

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    let missing = common::drift_of_kind(&report, "servicecidr_missing");
    assert!(missing.len() == 1 && missing[0].applied, "{report:?}");
    assert_eq!(sim.request_count("create", "servicecidrs"), 4);
    assert_eq!(
        common::events_of(&sim, "KubernetesDefaultServiceCIDRError").len(),
        1
    );
    Ok(())
}

/// Someone else set `Ready=False` with an empty reason, which events.k8s.io/v1 refuses as an
/// event's: the loop's one Warning event about it has a reason of its own, and the condition's
/// (quoted) and message in its note.
#[tokio::test]
async fn a_not_ready_condition_without_a_reason_is_one_warning_event() -> Result<()> {
    let sim = common::sim().await;
    sim.backdoor().put(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/12"]},
        "status": {"conditions": [{
            "type": "Ready", "status": "False", "reason": "",
            "message": "the allocator is down",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }]},
    }))?;
    let repair = ServiceCidrLoop::new(
        sim.client(),
        Section::default(),
        &common::settings(&["10.96.0.0/12"]),
    )
    .unwrap();
    for _ in 0..3 {
        let report = repair.reconcile(&common::ctx(&sim, false)).await?;
        assert_eq!(
            common::drift_of_kind(&report, "servicecidr_not_ready").len(),
            1,
            "{report:?}"
        );
    }
    let events = common::events_of(&sim, "KubernetesDefaultServiceCIDRNotReady");
    assert_eq!(events.len(), 1, "{:?}", common::event_reasons(&sim));
    assert_eq!(events[0]["type"], "Warning");
    assert_eq!(events[0]["regarding"]["name"], "kubernetes");
    assert_eq!(
        events[0]["note"],
        "Ready=False (reason \"\"): Configuration matches, but the allocator is down"
    );
    assert_eq!(events[0]["series"], serde_json::Value::Null);
    assert_eq!(common::writes(&sim), Vec::<String>::new());
    Ok(())
}

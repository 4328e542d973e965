//! The system-namespaces loop against the simulator: every namespace it creates gets its
//! event, even on a cluster that lacks `default`, where those events are written.

#![allow(clippy::unwrap_used)]

mod common;

use anyhow::Result;
use apiserver_sim::{Sim, SimConfig};
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::budget::CacheBudget;
use reconcilers::system_namespaces::{Section, SystemNamespacesLoop};

#[tokio::test]
async fn each_created_namespace_has_its_event_even_when_default_was_missing() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    let repair = SystemNamespacesLoop::new(
        sim.client(),
        Section::default(),
        &CacheBudget::default(),
        common::reporter(),
        &mut Registry::default(),
    );

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    let created: Vec<(&str, bool)> = report
        .drift
        .iter()
        .map(|d| (d.object.as_str(), d.applied))
        .collect();
    // Reported in the configured order, though `default` was written first.
    assert_eq!(
        created,
        [
            ("Namespace/kube-public", true),
            ("Namespace/kube-node-lease", true),
            ("Namespace/default", true),
        ]
    );
    let mut regarding: Vec<String> = common::events_of(&sim, "SystemNamespaceCreated")
        .iter()
        .map(|event| {
            assert_eq!(
                event["reportingController"],
                common::reporter().controller.as_str()
            );
            event["regarding"]["name"].as_str().unwrap().to_owned()
        })
        .collect();
    regarding.sort();
    assert_eq!(regarding, ["default", "kube-node-lease", "kube-public"]);
    Ok(())
}

/// A namespace this process creates for its own Lease is a repair like any other: it gets an
/// event from this controller; one that exists is only read.
#[tokio::test]
async fn a_namespace_created_for_a_lease_has_its_event() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    let namespaces = reconcilers::lease::LeaseNamespaces::new(
        sim.client(),
        reconcilers::events::reporter("replica-a"),
        "leader-election",
    );

    assert!(namespaces.ensure("bootstrap").await?);
    assert!(!namespaces.ensure("bootstrap").await?);
    assert!(!namespaces.ensure("kube-system").await?);

    let events = common::events_of(&sim, "LeaseNamespaceCreated");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["regarding"]["name"], "bootstrap");
    assert_eq!(events[0]["reportingController"], "bootstrap-controller");
    assert_eq!(events[0]["reportingInstance"], "replica-a");
    Ok(())
}

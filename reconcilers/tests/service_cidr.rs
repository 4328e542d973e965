//! The service-cidr loop against the simulator: the default ServiceCIDR created and made Ready,
//! each repair an event from this controller, nothing written in a dry run.

#![allow(clippy::unwrap_used)]

mod common;

use anyhow::Result;
use apiserver_sim::{Sim, SimConfig};
use reconcilers::Reconciler;
use reconcilers::service_cidr::{Section, ServiceCidrLoop};

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

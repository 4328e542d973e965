//! End to end: NodePort repair (API-only mode) with the real binary against a real simulator:
//! two Services sharing a node port and one outside the range get one upstream event each,
//! exactly once however many passes follow; `check` exits 1 naming them; no Service is changed.

mod common;

use anyhow::{Result, ensure};
use common::{
    CONVERGE, ConfigFile, ControllerProcess, Target, eventually, node_port_service, run_controller,
};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams};

/// The loop under test, with the ClusterIP repair beside it (they share the Service cache).
const NODEPORT_ONLY: &str =
    "loops:\n  kubernetesService: {enabled: false}\n  apiserverEndpoints: {enabled: false}\n";

fn controller_args<'a>(config: &'a ConfigFile, range: &'a str) -> Vec<&'a str> {
    vec![
        "--config",
        config.path.as_str(),
        "--service-node-port-range",
        "30000-32767",
        // The target's range: the ClusterIP repair beside this loop has nothing to say.
        "--service-cluster-ip-range",
        range,
        "--leader-elect=false",
    ]
}

/// The NodePort repair's events, as (reason, regarded Service, note).
async fn port_events(events: &Api<Event>) -> Result<Vec<(String, String, String)>> {
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reporting_controller.as_deref() == Some("bootstrap-controller"))
        .filter(|e| e.action.as_deref() == Some("PortAllocation"))
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.regarding.and_then(|r| r.name).unwrap_or_default(),
                e.note.unwrap_or_default(),
            )
        })
        .collect())
}

/// `bootstrap_loop_passes_total` of the loop, successful passes.
async fn passes(controller: &ControllerProcess) -> Result<u64> {
    let (_, metrics) = controller.admin_get("/metrics").await?;
    Ok(metrics
        .lines()
        .find(|line| {
            line.starts_with("bootstrap_loop_passes_total{")
                && line.contains("loop=\"nodeport-repair\"")
                && line.contains("result=\"success\"")
        })
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|count| count.parse().ok())
        .unwrap_or(0))
}

#[tokio::test]
async fn duplicates_and_out_of_range_ports_are_reported_once_and_by_check() -> Result<()> {
    let target = Target::start().await?;
    // A real kube-apiserver refuses both shapes, so only the backdoor can make them.
    let Some(sim) = target.sim("the whole test: node port duplicates written by the backdoor")
    else {
        return Ok(());
    };
    let client = target.client().await?;
    let events: Api<Event> = Api::all(client.clone());
    let services: Api<Service> = Api::namespaced(client, "default");
    let config = ConfigFile::new(NODEPORT_ONLY)?;
    let kubeconfig = target.kubeconfig().to_string_lossy().into_owned();
    let range = target.service_range().await?;

    let mut controller =
        ControllerProcess::start(target.kubeconfig(), &controller_args(&config, &range))?;
    controller.wait_ready().await?;

    for service in [
        node_port_service("a-first", 30080),
        node_port_service("b-second", 30080),
        node_port_service("c-outside", 40000),
    ] {
        sim.admin("PUT", "/sim/backdoor", Some(service)).await?;
    }

    let expected = vec![
        (
            "PortAlreadyAllocated".to_owned(),
            "b-second".to_owned(),
            "Port 30080 was assigned to multiple services; please recreate service".to_owned(),
        ),
        (
            "PortOutOfRange".to_owned(),
            "c-outside".to_owned(),
            "Port 40000 is not within the port range 30000-32767; please recreate service"
                .to_owned(),
        ),
    ];
    eventually("one event per problem", CONVERGE, || async {
        let mut found = port_events(&events).await?;
        found.sort();
        Ok((found == expected).then_some(()))
    })
    .await?;

    // Several more passes, each woken by a Service change, with the problems still there:
    // nothing more is written about them.
    let event_writes = |requests: &[apiserver_sim::RequestRecord]| {
        requests
            .iter()
            .filter(|r| {
                r.resource == "events" && matches!(r.verb.as_str(), "create" | "patch" | "update")
            })
            .count()
    };
    let writes_before = event_writes(&sim.requests().await?);
    let passes_before = passes(&controller).await?;
    for round in 0..5 {
        services
            .patch(
                "a-first",
                &PatchParams::default(),
                &Patch::Merge(
                    serde_json::json!({"metadata": {"labels": {"round": round.to_string()}}}),
                ),
            )
            .await?;
        let wanted = passes_before + round + 1;
        eventually("a pass after the change", CONVERGE, || async {
            Ok((passes(&controller).await? >= wanted).then_some(()))
        })
        .await?;
    }
    let requests = sim.requests().await?;
    ensure!(
        event_writes(&requests) == writes_before,
        "passes with unchanged problems wrote events again ({} writes before, {} after): {:?}\n{}",
        writes_before,
        event_writes(&requests),
        requests
            .iter()
            .filter(|r| r.resource == "events")
            .map(|r| format!("{} {} {}", r.verb, r.namespace, r.name))
            .collect::<Vec<_>>(),
        controller.log()
    );
    let mut found = port_events(&events).await?;
    found.sort();
    ensure!(found == expected, "events changed: {found:?}");
    ensure!(
        !requests.iter().any(|r| r.resource == "services"
            && matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete")
            && r.name != "a-first"),
        "the repair changed a Service"
    );
    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    controller.terminate()?;

    // `check`: exit 1, both problems named with their Services.
    let mut check_args = controller_args(&config, &range);
    check_args.extend(["check", "--kubeconfig", kubeconfig.as_str()]);
    let check = run_controller(&check_args)?;
    let stdout = String::from_utf8_lossy(&check.stdout);
    ensure!(
        check.status.code() == Some(1),
        "check should exit 1: {check:?}"
    );
    ensure!(
        stdout.contains("nodeport_duplicate")
            && stdout.contains("Service/default/b-second")
            && stdout.contains("nodeport_out_of_range")
            && stdout.contains("Service/default/c-outside")
            && !stdout.contains("Service/default/a-first"),
        "check does not name both problems:\n{stdout}"
    );
    Ok(())
}

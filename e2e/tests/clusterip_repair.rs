//! End to end: ClusterIP repair (IPAddress mode) with the real binary against a real simulator:
//! `check` reports corruption without writing, `run` repairs it with upstream's events.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{CONVERGE, ConfigFile, ControllerProcess, Target, eventually, run_controller};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::Api;
use kube::api::ListParams;

const RANGE: &str = "10.96.0.0/12";

/// Loops under test only, with a short orphan grace period so a leak is collected within the test.
const REPAIR_ONLY: &str = "loops:\n  kubernetesService: {enabled: false}\n  \
    apiserverEndpoints: {enabled: false}\n  clusterIPRepair: {orphanGracePeriod: 5s}\n";

fn controller_args(config: &ConfigFile) -> Vec<&str> {
    vec![
        "--config",
        config.path.as_str(),
        "--service-cluster-ip-range",
        RANGE,
        "--leader-elect=false",
    ]
}

async fn events_with(events: &Api<Event>, reason: &str, about: &str) -> Result<Option<Event>> {
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.reporting_controller.as_deref() == Some("ipallocator-repair-controller")
                && e.regarding
                    .as_ref()
                    .and_then(|r| r.name.as_deref())
                    .is_some_and(|name| name == about)
        }))
}

#[tokio::test]
async fn check_reports_and_run_repairs_ipaddress_corruption_with_upstream_events() -> Result<()> {
    let target = Target::start().await?;
    let Some(sim) = target.sim("clusterip repair corruption by backdoor") else {
        return Ok(());
    };
    let client = target.client().await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let addresses: Api<IPAddress> = Api::all(client.clone());
    let events: Api<Event> = Api::all(client);
    let config = ConfigFile::new(REPAIR_ONLY)?;
    let kubeconfig = target.kubeconfig().to_string_lossy().into_owned();

    // A healthy start: system namespaces and the default ServiceCIDR exist.
    let mut controller = ControllerProcess::start(target.kubeconfig(), &controller_args(&config))?;
    controller.wait_ready().await?;
    controller.terminate()?;

    // A Service whose IPAddress is lost (an etcd restore, a bug), and a leaked IPAddress whose
    // Service never existed, created long ago.
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"ports": [{"port": 80}]}
    }))?;
    let web = services.create(&Default::default(), &web).await?;
    let ip = web
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the simulator allocated no clusterIP")?;
    sim.admin("DELETE", &format!("/sim/backdoor/ipaddresses/{ip}"), None)
        .await?;
    let leaked = "10.96.200.200";
    sim.admin(
        "PUT",
        "/sim/backdoor",
        Some(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "IPAddress",
            "metadata": {
                "name": leaked,
                "creationTimestamp": "2020-01-01T00:00:00Z",
                "labels": {
                    "ipaddress.kubernetes.io/ip-family": "IPv4",
                    "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io"
                }
            },
            "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default", "name": "gone"}}
        })),
    )
    .await?;

    // `check`: exit 1, both findings named, nothing written.
    let mut check_args = controller_args(&config);
    check_args.extend(["check", "--kubeconfig", kubeconfig.as_str()]);
    let check = run_controller(&check_args)?;
    let stdout = String::from_utf8_lossy(&check.stdout);
    ensure!(
        check.status.code() == Some(1),
        "check should exit 1: {check:?}"
    );
    ensure!(
        stdout.contains("clusterip_not_allocated") && stdout.contains("ipaddress_leaked"),
        "check does not report both findings:\n{stdout}"
    );
    ensure!(
        addresses.get_opt(&ip).await?.is_none() && addresses.get_opt(leaked).await?.is_some(),
        "check wrote to the cluster"
    );

    // `run`: the missing IPAddress is recreated for its Service, the leak deleted, each with
    // upstream's event reason and reporting controller.
    let mut controller = ControllerProcess::start(target.kubeconfig(), &controller_args(&config))?;
    let repaired = eventually("the lost IPAddress recreated", CONVERGE, || async {
        Ok(addresses.get_opt(&ip).await?)
    })
    .await?;
    let parent = repaired.spec.map(|s| s.parent_ref).context("no spec")?;
    ensure!(
        parent.resource == "services"
            && parent.namespace.as_deref() == Some("default")
            && parent.name == "web",
        "wrong parentRef: {parent:?}"
    );
    eventually("ClusterIPNotAllocated event", CONVERGE, || {
        events_with(&events, "ClusterIPNotAllocated", "web")
    })
    .await?;
    eventually("the leaked IPAddress deleted", CONVERGE, || async {
        Ok(addresses.get_opt(leaked).await?.is_none().then_some(()))
    })
    .await?;
    eventually("IPAddressNotAllocated event", CONVERGE, || {
        events_with(&events, "IPAddressNotAllocated", leaked)
    })
    .await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    ensure!(
        addresses.get_opt(&ip).await?.is_some(),
        "the repaired IPAddress of a live Service was deleted again"
    );
    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    Ok(())
}

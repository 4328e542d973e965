//! End to end: ClusterIP repair (IPAddress mode) with the real binary against a real simulator
//! or a real cluster (`BOOTSTRAP_E2E_KUBECONFIG`): `check` reports corruption without writing,
//! `run` repairs it with upstream's events.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{
    CONVERGE, ConfigFile, ControllerProcess, Target, eventually, run_controller, service_ip,
};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};

/// Loops under test only, with a short orphan grace period so a leak is collected within the test.
const REPAIR_ONLY: &str = "loops:\n  kubernetesService: {enabled: false}\n  \
    apiserverEndpoints: {enabled: false}\n  clusterIPRepair: {orphanGracePeriod: 5s}\n";

/// The controller's flags, with the target's service `range`.
fn controller_args<'a>(config: &'a ConfigFile, range: &'a str) -> Vec<&'a str> {
    vec![
        "--config",
        config.path.as_str(),
        "--service-cluster-ip-range",
        range,
        "--leader-elect=false",
    ]
}

/// The Service whose IPAddress is lost; a name of its own, since a real cluster is shared.
const WEB: &str = "clusterip-repair-web";
/// The offset in the target's service range of the leaked IPAddress, whose Service never
/// existed: in the band kept for static addresses, which the Service's dynamic allocation
/// leaves alone (see [`service_ip`]).
const LEAKED: u32 = 200;

/// An event of upstream's repair controller with `reason` about the object with `uid` (this
/// run's object: a shared cluster keeps the events of earlier runs for an hour).
async fn events_with(events: &Api<Event>, reason: &str, uid: &str) -> Result<Option<Event>> {
    Ok(events
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .find(|e| {
            e.reason.as_deref() == Some(reason)
                && e.reporting_controller.as_deref() == Some("bootstrap-controller")
                && e.regarding
                    .as_ref()
                    .and_then(|r| r.uid.as_deref())
                    .is_some_and(|regarding| regarding == uid)
        }))
}

/// Deletes the Service and the `leaked` IPAddress (earlier runs' on a shared cluster, or this
/// run's when it ends) and waits until both are gone.
async fn remove_test_objects(
    services: &Api<Service>,
    addresses: &Api<IPAddress>,
    leaked: &str,
) -> Result<()> {
    for deleted in [
        services
            .delete(WEB, &DeleteParams::default())
            .await
            .map(drop),
        addresses
            .delete(leaked, &DeleteParams::default())
            .await
            .map(drop),
    ] {
        match deleted {
            Ok(()) => {}
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(err) => return Err(err.into()),
        }
    }
    eventually("the test's objects gone", CONVERGE, || async {
        let gone =
            services.get_opt(WEB).await?.is_none() && addresses.get_opt(leaked).await?.is_none();
        Ok(gone.then_some(()))
    })
    .await
}

/// The field managers of an object (a real apiserver's `managedFields`; the simulator serializes
/// none).
fn managers(address: &IPAddress) -> Vec<String> {
    address
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter_map(|f| f.manager.clone())
        .collect()
}

#[tokio::test]
async fn check_reports_and_run_repairs_ipaddress_corruption_with_upstream_events() -> Result<()> {
    let target = Target::start().await?;
    // Without the IPAddress API the repair audits instead (real_allocations.rs tests that).
    if !target
        .serves(
            "the whole test",
            "networking.k8s.io/v1",
            "ipaddresses",
            "1.33",
        )
        .await?
    {
        return Ok(());
    }
    let client = target.client().await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let addresses: Api<IPAddress> = Api::all(client.clone());
    let events: Api<Event> = Api::all(client);
    let config = ConfigFile::new(REPAIR_ONLY)?;
    let kubeconfig = target.kubeconfig().to_string_lossy().into_owned();
    let range = target.service_range().await?;
    let leaked = service_ip(&range, LEAKED)?;
    remove_test_objects(&services, &addresses, &leaked).await?;

    // A healthy start: system namespaces and the default ServiceCIDR exist.
    let mut controller =
        ControllerProcess::start(target.kubeconfig(), &controller_args(&config, &range))?;
    controller.wait_ready().await?;
    controller.terminate()?;

    // A Service whose IPAddress is lost (an etcd restore, a bug), and a leaked IPAddress whose
    // Service never existed.
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": WEB, "namespace": "default"},
        "spec": {"ports": [{"port": 80}]}
    }))?;
    let web = services.create(&Default::default(), &web).await?;
    let web_uid = web.metadata.uid.clone().context("the Service has no uid")?;
    let ip = web
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the apiserver allocated no clusterIP")?;
    let leaked_object = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "IPAddress",
        "metadata": {
            "name": leaked,
            "labels": {
                "ipaddress.kubernetes.io/ip-family": "IPv4",
                "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io"
            }
        },
        "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default", "name": "gone"}}
    });
    // The leak was made long ago: on the simulator its backdoor writes the creationTimestamp; a
    // real apiserver sets that itself, so there the leak is created through the API and `check`
    // waits out the orphan grace period (5 s; the apiserver's own repair waits 60 s).
    let leak_created = Instant::now();
    let leak_age = match &target {
        Target::Sim(sim) => {
            let mut old = leaked_object;
            old["metadata"]["creationTimestamp"] = "2020-01-01T00:00:00Z".into();
            sim.admin("PUT", "/sim/backdoor", Some(old)).await?;
            Duration::ZERO
        }
        Target::Cluster { .. } => {
            addresses
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(leaked_object)?,
                )
                .await?;
            Duration::from_secs(6)
        }
    };
    let leaked_uid = addresses
        .get(&leaked)
        .await?
        .metadata
        .uid
        .context("the leaked IPAddress has no uid")?;

    // `check`: exit 1, both findings named, nothing written. The Service's IPAddress is deleted
    // through the API. A real apiserver's own repair loop recreates it on its resync (every 3
    // minutes): if that falls between the deletion and the end of `check`, `check` rightly finds
    // less, and the attempt is made again.
    let mut check_args = controller_args(&config, &range);
    check_args.extend(["check", "--kubeconfig", kubeconfig.as_str()]);
    for attempt in 1.. {
        addresses.delete(&ip, &DeleteParams::default()).await?;
        eventually("the Service's IPAddress gone", CONVERGE, || async {
            Ok(addresses.get_opt(&ip).await?.is_none().then_some(()))
        })
        .await?;
        tokio::time::sleep(leak_age.saturating_sub(leak_created.elapsed())).await;
        let check = run_controller(&check_args)?;
        let stdout = String::from_utf8_lossy(&check.stdout);
        if let Some(recreated) = addresses.get_opt(&ip).await? {
            let managers = managers(&recreated);
            ensure!(
                !managers.iter().any(|m| m == "bootstrap-controller"),
                "check wrote to the cluster: {managers:?}"
            );
            ensure!(
                matches!(target, Target::Cluster { .. }) && attempt < 3,
                "the deleted IPAddress came back during check (managers {managers:?}):\n{stdout}"
            );
            // Only the apiserver's own allocator may have made it again: its repair labels what
            // it creates as its own.
            let managed_by = recreated
                .metadata
                .labels
                .as_ref()
                .and_then(|labels| labels.get("ipaddress.kubernetes.io/managed-by"))
                .cloned();
            ensure!(
                managed_by.as_deref() == Some("ipallocator.k8s.io"),
                "the deleted IPAddress came back during check, managed by {managed_by:?} \
                 (managers {managers:?}), not by the apiserver's allocator:\n{stdout}"
            );
            eprintln!(
                "attempt {attempt}: the apiserver's own repair ({managers:?}) recreated {ip} \
                 meanwhile; again"
            );
            continue;
        }
        ensure!(
            check.status.code() == Some(1),
            "check should exit 1: {check:?}"
        );
        ensure!(
            stdout.contains("clusterip_not_allocated") && stdout.contains("ipaddress_leaked"),
            "check does not report both findings:\n{stdout}"
        );
        ensure!(
            addresses.get_opt(&leaked).await?.is_some(),
            "check wrote to the cluster"
        );
        break;
    }

    // `run`: the missing IPAddress is recreated for its Service, the leak deleted, each with
    // upstream's event reason and reporting controller.
    let mut controller =
        ControllerProcess::start(target.kubeconfig(), &controller_args(&config, &range))?;
    let repaired = eventually("the lost IPAddress recreated", CONVERGE, || async {
        Ok(addresses.get_opt(&ip).await?)
    })
    .await?;
    if let Target::Cluster { .. } = target {
        // The apiserver's own repair could win this race too (rarely: it runs every 3 minutes);
        // then it writes the same IPAddress and event, so the outcome checked below is the same.
        println!("{ip} recreated by {:?}", managers(&repaired));
    }
    let parent = repaired.spec.map(|s| s.parent_ref).context("no spec")?;
    ensure!(
        parent.resource == "services"
            && parent.namespace.as_deref() == Some("default")
            && parent.name == WEB,
        "wrong parentRef: {parent:?}"
    );
    eventually("ClusterIPNotAllocated event", CONVERGE, || {
        events_with(&events, "ClusterIPNotAllocated", &web_uid)
    })
    .await?;
    eventually("the leaked IPAddress deleted", CONVERGE, || async {
        Ok(addresses.get_opt(&leaked).await?.is_none().then_some(()))
    })
    .await?;
    eventually("IPAddressNotAllocated event", CONVERGE, || {
        events_with(&events, "IPAddressNotAllocated", &leaked_uid)
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
    controller.terminate()?;
    remove_test_objects(&services, &addresses, &leaked).await?;
    Ok(())
}

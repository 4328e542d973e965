//! The controller as `run` assembles it (loops, runner, leader election, admin server), in-process
//! against the API simulator: it repairs, stays up while the API fails, and converges after.

use std::time::{Duration, Instant};

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig};
use bootstrap_controller::config::{Config, ConfigArgs, FileConfig};
use bootstrap_controller::kubeconfig;
use bootstrap_controller::process::Controller;
use k8s_openapi::api::core::v1::{Endpoints, Namespace};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;

async fn eventually<F, Fut>(what: &str, condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if let Err(err) = test_support::eventually(what, Duration::from_secs(30), condition).await {
        panic!("{err}");
    }
}

/// Only the system-namespaces loop, with leader election on (the default) and short leases.
fn config() -> anyhow::Result<Config> {
    let args = ConfigArgs {
        admin_addr: Some("127.0.0.1:0".to_owned()),
        leader_elect_lease_duration: Some("2s".to_owned()),
        leader_elect_renew_grace: Some("1s".to_owned()),
        ..ConfigArgs::default()
    };
    let mut config = Config::merge(&args, FileConfig::default())?;
    config.loops.kubernetes_service.enabled = false;
    config.loops.apiserver_endpoints.enabled = false;
    config.loops.service_cidr.enabled = false;
    config.loops.cluster_ip_repair.enabled = false;
    Ok(config)
}

async fn exists(api: &Api<Namespace>, name: &str) -> bool {
    matches!(api.get_opt(name).await, Ok(Some(ns)) if ns.metadata.deletion_timestamp.is_none())
}

#[tokio::test]
async fn repairs_and_survives_a_failing_api() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig {
        namespace_finalize_delay: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await?;
    let config = config()?;
    let kube_config = kubeconfig::load(Some(sim.kubeconfig_path())).await?;
    let client = kube::Client::try_from(kube_config.clone())?;
    let controller = Controller::start(&config, &kube_config, client)
        .await
        .map_err(anyhow::Error::msg)?;
    let namespaces: Api<Namespace> = Api::all(sim.client());

    eventually("ready", || async { controller.health.readiness().ready }).await;
    // A single replica is ready only once it leads and its loop succeeded (not as a standby
    // while it has not yet learned who leads).
    for name in ["kube-system", "kube-public", "kube-node-lease", "default"] {
        assert!(exists(&namespaces, name).await, "{name} created at start");
    }

    // 30% of all requests fail; the backdoor bypasses faults, so the breakage always lands.
    sim.faults().inject(FaultRule::probability(
        None,
        None,
        0.3,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        sim.backdoor().delete("namespaces", "", "kube-public")?;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(!controller.task_finished(), "the controller must stay up");

    sim.faults().clear();
    sim.backdoor().delete("namespaces", "", "kube-public")?;
    eventually("kube-public back after the faults stop", || async {
        exists(&namespaces, "kube-public").await
    })
    .await;
    eventually("ready again", || async {
        controller.health.readiness().ready
    })
    .await;

    controller.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(30), controller.wait()).await?;
    sim.shutdown().await;
    Ok(())
}

/// Lease writes in the simulator's request log (creations, updates, patches, deletions).
fn lease_writes(sim: &Sim) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|r| r.resource == "leases")
        .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
        .map(|r| format!("{} {}/{}", r.verb, r.namespace, r.name))
        .collect()
}

/// The Leases stored, as `namespace/name holder`.
fn leases(sim: &Sim) -> anyhow::Result<Vec<String>> {
    Ok(sim
        .backdoor()
        .list("leases")?
        .iter()
        .map(|lease| {
            format!(
                "{}/{} {}",
                lease["metadata"]["namespace"].as_str().unwrap_or_default(),
                lease["metadata"]["name"].as_str().unwrap_or_default(),
                lease["spec"]["holderIdentity"].as_str().unwrap_or_default()
            )
        })
        .collect())
}

/// A dry run holds no Lease of any kind: started first, with leader election on (the default)
/// and the endpoints in `lease` mode, it runs its loops' dry passes without leading and writes
/// neither the leader-election Lease nor a membership Lease; a real replica started after it
/// leads at once and repairs a deleted namespace.
#[tokio::test]
async fn a_dry_run_holds_no_lease_and_never_keeps_a_real_replica_from_leading() -> anyhow::Result<()>
{
    let sim = Sim::start(SimConfig {
        namespace_finalize_delay: Duration::from_millis(50),
        ..SimConfig::default()
    })
    .await?;
    let kube_config = kubeconfig::load(Some(sim.kubeconfig_path())).await?;
    let namespaces: Api<Namespace> = Api::all(sim.client());

    let dry_args = ConfigArgs {
        admin_addr: Some("127.0.0.1:0".to_owned()),
        dry_run: Some("true".to_owned()),
        leader_elect_identity: Some("dry-run".to_owned()),
        leader_elect_lease_duration: Some("2s".to_owned()),
        leader_elect_renew_grace: Some("1s".to_owned()),
        endpoint_reconciler_type: Some(bootstrap_controller::config::EndpointsMode::Lease),
        advertise_address: Some("192.0.2.1".to_owned()),
        ..ConfigArgs::default()
    };
    let mut dry_config = Config::merge(&dry_args, FileConfig::default())?;
    dry_config.loops.service_cidr.enabled = false;
    dry_config.loops.cluster_ip_repair.enabled = false;
    dry_config.loops.node_port_repair.enabled = false;
    let dry = Controller::start(
        &dry_config,
        &kube_config,
        kube::Client::try_from(kube_config.clone())?,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    // Ready means every loop, the leader-only ones included, had a (dry) pass.
    eventually("the dry run's passes", || async {
        dry.health.readiness().ready
    })
    .await;
    assert!(
        !exists(&namespaces, "kube-public").await,
        "a dry run creates nothing"
    );
    assert_eq!(lease_writes(&sim), Vec::<String>::new(), "no Lease written");
    assert_eq!(leases(&sim)?, Vec::<String>::new());

    let mut real_config = config()?;
    real_config.settings.identity = "real".to_owned();
    let real = Controller::start(
        &real_config,
        &kube_config,
        kube::Client::try_from(kube_config.clone())?,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    eventually("the real replica leads and creates kube-public", || async {
        exists(&namespaces, "kube-public").await
    })
    .await;
    sim.backdoor().delete("namespaces", "", "kube-public")?;
    eventually("kube-public back", || async {
        exists(&namespaces, "kube-public").await
    })
    .await;
    assert_eq!(
        leases(&sim)?,
        ["kube-system/bootstrap-controller real"],
        "the real replica holds the only Lease"
    );

    for controller in [real, dry] {
        controller.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(30), controller.wait()).await?;
    }
    sim.shutdown().await;
    Ok(())
}

/// `loops.kubernetesService` names the `kubernetes` Service once, in its section: its loop keeps
/// that Service, and the endpoints loop, built beside it, writes that Service's Endpoints and
/// EndpointSlice; nothing is written under the default name.
#[tokio::test]
async fn the_endpoints_follow_the_kubernetes_service_named_in_its_section() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let kube_config = kubeconfig::load(Some(sim.kubeconfig_path())).await?;
    let args = ConfigArgs {
        admin_addr: Some("127.0.0.1:0".to_owned()),
        leader_elect: Some("false".to_owned()),
        ..ConfigArgs::default()
    };
    let file = "endpointReconcilerType: static\n\
        serviceClusterIPRange: 10.96.0.0/16\n\
        loops:\n  \
          kubernetesService: {namespace: kube-system, name: apiserver}\n  \
          apiserverEndpoints: {interval: 1s, staticAddresses: [192.0.2.10]}\n  \
          serviceCIDR: {enabled: false}\n  \
          clusterIPRepair: {enabled: false}\n  \
          nodePortRepair: {enabled: false}\n";
    let config = Config::load_text(&args, file, None)?;
    let controller = Controller::start(
        &config,
        &kube_config,
        kube::Client::try_from(kube_config.clone())?,
    )
    .await
    .map_err(anyhow::Error::msg)?;

    let endpoints: Api<Endpoints> = Api::namespaced(sim.client(), "kube-system");
    eventually("kube-system/apiserver's Endpoints", || async {
        let addresses = endpoints
            .get_opt("apiserver")
            .await
            .ok()
            .flatten()
            .map(|e| {
                e.subsets
                    .unwrap_or_default()
                    .into_iter()
                    .flat_map(|subset| subset.addresses.unwrap_or_default())
                    .map(|address| address.ip)
                    .collect::<Vec<_>>()
            });
        addresses == Some(vec!["192.0.2.10".to_owned()])
    })
    .await;
    let slices: Api<EndpointSlice> = Api::namespaced(sim.client(), "kube-system");
    let slice = slices.get_opt("apiserver").await?;
    let addresses: Vec<String> = slice
        .map(|slice| {
            slice
                .endpoints
                .into_iter()
                .flat_map(|endpoint| endpoint.addresses)
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(
        addresses,
        ["192.0.2.10"],
        "kube-system/apiserver's EndpointSlice"
    );
    for (namespace, name) in [("default", "kubernetes"), ("kube-system", "kubernetes")] {
        let endpoints: Api<Endpoints> = Api::namespaced(sim.client(), namespace);
        let slices: Api<EndpointSlice> = Api::namespaced(sim.client(), namespace);
        assert!(
            endpoints.get_opt(name).await?.is_none(),
            "{namespace}/{name}"
        );
        assert!(slices.get_opt(name).await?.is_none(), "{namespace}/{name}");
    }

    controller.cancel.cancel();
    tokio::time::timeout(Duration::from_secs(30), controller.wait()).await?;
    Ok(())
}

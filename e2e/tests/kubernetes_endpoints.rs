//! End to end: the `kubernetes` endpoints with several real controller processes (one per
//! simulated apiserver) against a real `apiserver-sim` process, or a real cluster
//! (`BOOTSTRAP_E2E_KUBECONFIG`; its apiservers run with `--endpoint-reconciler-type=none`, so the
//! endpoints are the controllers' alone). `apiserver_endpoints.rs` covers joining, leaving,
//! crashes, corruption and `check`; this file covers what needs its own setup: an apiserver that
//! is not ready from the start, leader handovers (judged from the simulator's request log there,
//! followed by a quiet minute), and `static` mode with a name that stops resolving.

mod common;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::{
    CONVERGE, ConfigFile, ControllerLeftovers, ControllerProcess, SimProcess, Target, eventually,
    kubectl,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Endpoints;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::ListParams;

/// `lease` mode with short intervals so membership changes show within seconds; repair loops off (not under test).
fn endpoints_config(extra: &str) -> Result<ConfigFile> {
    ConfigFile::new(&format!(
        "endpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    interval: 1s\n    leaseTTL: 3s\n{extra}  \
         kubernetesService:\n    interval: 2s\n  serviceCIDR: {{enabled: false}}\n  \
         clusterIPRepair: {{enabled: false}}\n"
    ))
}

/// One controller standing in for the sidecar of the apiserver at `address`.
fn member(
    cluster: &Cluster,
    config: &ConfigFile,
    address: &str,
    extra: &[&str],
) -> Result<ControllerProcess> {
    let identity = format!("replica-{address}");
    let mut args = vec![
        "--config",
        config.path.as_str(),
        "--service-cluster-ip-range",
        cluster.range.as_str(),
        "--advertise-address",
        address,
        "--leader-elect-identity",
        identity.as_str(),
        "--leader-elect-lease-duration",
        "2s",
        "--leader-elect-renew-grace",
        "1s",
    ];
    args.extend_from_slice(extra);
    ControllerProcess::start(&cluster.kubeconfig, &args)
}

/// Addresses and ports of `default/kubernetes` Endpoints, if it exists.
async fn endpoint_view(api: &Api<Endpoints>) -> Result<Option<(Vec<String>, Vec<i32>)>> {
    let Some(endpoints) = api.get_opt("kubernetes").await? else {
        return Ok(None);
    };
    Ok(Some(common::endpoints_addresses_and_ports(endpoints)))
}

async fn slice_addresses(api: &Api<EndpointSlice>) -> Result<BTreeSet<String>> {
    let slices = api
        .list(&ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await?;
    Ok(slices
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter())
        .flat_map(|e| e.addresses.iter().cloned())
        .collect())
}

/// Waits until Endpoints list exactly `want` (in this order) on port 6443 and the slices agree.
async fn expect_members(
    endpoints: &Api<Endpoints>,
    slices: &Api<EndpointSlice>,
    want: &[&str],
) -> Result<()> {
    let want_sorted: Vec<String> = want.iter().map(|s| (*s).to_string()).collect();
    let want_set: BTreeSet<String> = want_sorted.iter().cloned().collect();
    eventually(&format!("endpoints == {want:?}"), CONVERGE, || async {
        let view = endpoint_view(endpoints).await?;
        let slice = slice_addresses(slices).await?;
        Ok((view == Some((want_sorted.clone(), vec![6443])) && slice == want_set).then_some(()))
    })
    .await
}

struct Cluster {
    kubeconfig: std::path::PathBuf,
    /// The target's service range.
    range: String,
    endpoints: Api<Endpoints>,
    slices: Api<EndpointSlice>,
    leases: Api<Lease>,
    // Dropped before the target, after the test's controllers (declared later in the test).
    _leftovers: ControllerLeftovers,
    target: Target,
}

/// The simulator, or the real cluster with earlier tests' Leases gone. The controllers advertise
/// TEST-NET addresses nobody serves on: on a test cluster whose apiservers do not write the
/// endpoints themselves, that is what its sidecars would write.
async fn cluster() -> Result<Cluster> {
    let target = Target::start().await?;
    let client = target.client().await?;
    Ok(Cluster {
        kubeconfig: target.kubeconfig().to_path_buf(),
        range: target.service_range().await?,
        endpoints: Api::namespaced(client.clone(), "default"),
        slices: Api::namespaced(client.clone(), "default"),
        leases: Api::namespaced(client, "kube-system"),
        _leftovers: ControllerLeftovers::forget(&target)?,
        target,
    })
}

#[tokio::test]
async fn an_instance_whose_apiserver_is_not_ready_is_never_added_and_leaves_when_it_fails()
-> Result<()> {
    let c = cluster().await?;
    // A second, plain-HTTP simulator plays the local apiserver of 192.0.2.3: its /readyz is what
    // that instance probes, and the test switches it.
    let local = SimProcess::start(&["--plain-http"]).await?;
    let local_kubeconfig = std::fs::read_to_string(&local.kubeconfig)?;
    let local_server = local_kubeconfig
        .lines()
        .find_map(|line| line.trim().strip_prefix("server:"))
        .context("no server in the local simulator's kubeconfig")?
        .trim()
        .trim_matches('"')
        .trim_end_matches('/')
        .to_string();
    local.set_ready(false).await?;

    let config = endpoints_config("")?;
    let probed = endpoints_config(&format!("    readyzURL: {local_server}/readyz\n"))?;

    let _a = member(&c, &config, "192.0.2.1", &[])?;
    let _b = member(&c, &probed, "192.0.2.3", &[])?;
    expect_members(&c.endpoints, &c.slices, &["192.0.2.1"]).await?;
    // Several renewal intervals in which 192.0.2.3 must never appear.
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        if let Some((addresses, _)) = endpoint_view(&c.endpoints).await? {
            ensure!(
                !addresses.iter().any(|a| a == "192.0.2.3"),
                "an instance whose apiserver is not ready was added: {addresses:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    local.set_ready(true).await?;
    expect_members(&c.endpoints, &c.slices, &["192.0.2.1", "192.0.2.3"]).await?;
    local.set_ready(false).await?;
    expect_members(&c.endpoints, &c.slices, &["192.0.2.1"]).await?;
    Ok(())
}

/// The pid in `bootstrap-controller/<v> (<host>; pid <pid>)`.
fn writer_pid(user_agent: &str) -> Option<&str> {
    user_agent
        .strip_prefix("bootstrap-controller/")?
        .rsplit_once("pid ")
        .map(|(_, pid)| pid.trim_end_matches(')'))
}

#[tokio::test]
async fn leader_handover_never_has_two_writers_and_a_quiet_minute_has_no_endpoint_writes()
-> Result<()> {
    let c = cluster().await?;
    let config = endpoints_config("")?;
    let kubeconfig = c.kubeconfig.clone();
    let mut replicas = [
        member(&c, &config, "192.0.2.1", &[])?,
        member(&c, &config, "192.0.2.2", &[])?,
        member(&c, &config, "192.0.2.3", &[])?,
    ];
    expect_members(
        &c.endpoints,
        &c.slices,
        &["192.0.2.1", "192.0.2.2", "192.0.2.3"],
    )
    .await?;
    // The request log judges the writers on the simulator; on a real cluster the handovers and
    // repairs below are what is checked.
    let sim = c
        .target
        .sim("the writers in order and a quiet minute, judged from the request log");
    if let Some(sim) = sim {
        sim.clear_requests().await?;
    }

    // Two handovers: the leader killed (its Lease must expire), then the next one stopped
    // cleanly (it releases the Lease). After each, corrupt the port so the new leader must write.
    let leader_lease: Api<Lease> = c.leases.clone();
    let mut survivors = vec!["192.0.2.1", "192.0.2.2", "192.0.2.3"];
    for (round, clean) in [(1, false), (2, true)] {
        let holder = eventually("a leader among the replicas", CONVERGE, || async {
            Ok(leader_lease
                .get_opt("bootstrap-controller")
                .await?
                .and_then(|l| l.spec?.holder_identity)
                .filter(|holder| holder.starts_with("replica-")))
        })
        .await?;
        let address = holder
            .strip_prefix("replica-")
            .context("unexpected leader identity")?
            .to_string();
        let index = ["192.0.2.1", "192.0.2.2", "192.0.2.3"]
            .iter()
            .position(|a| *a == address)
            .context("leader is no replica")?;
        if clean {
            replicas[index].terminate()?;
        } else {
            replicas[index].kill()?;
        }
        survivors.retain(|a| *a != address);
        expect_members(&c.endpoints, &c.slices, &survivors).await?;
        let out = kubectl(
            &kubeconfig,
            &[
                "patch",
                "endpoints",
                "kubernetes",
                "-n",
                "default",
                "--type=merge",
                "-p",
                r#"{"subsets":[{"addresses":[{"ip":"203.0.113.1"}],"ports":[{"name":"https","port":443,"protocol":"TCP"}]}]}"#,
            ],
        )?;
        ensure!(
            out.status.success(),
            "round {round}: kubectl patch: {out:?}"
        );
        expect_members(&c.endpoints, &c.slices, &survivors).await?;
    }

    let Some(sim) = sim else {
        return Ok(());
    };
    let log = sim.requests().await?;
    let cluster_writes: Vec<&str> = log
        .iter()
        .filter(|r| {
            matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete")
                && matches!(
                    r.resource.as_str(),
                    "endpoints" | "endpointslices" | "services"
                )
        })
        .filter_map(|r| writer_pid(&r.user_agent))
        .collect();
    ensure!(
        cluster_writes.len() >= 2,
        "too few controller writes to judge: {cluster_writes:?}"
    );
    // Each writer's writes form one contiguous run: a writer that handed over never writes again.
    let mut seen = Vec::new();
    for pid in &cluster_writes {
        if seen.last() != Some(pid) {
            ensure!(
                !seen.contains(pid),
                "two writers interleaved (pid {pid} wrote again after another replica): \
                 {cluster_writes:?}"
            );
            seen.push(*pid);
        }
    }

    eprintln!(
        "writers in order: {seen:?} ({} writes)",
        cluster_writes.len()
    );
    ensure!(
        seen.len() >= 2,
        "the handovers produced writes from only one replica: {seen:?}"
    );

    // A quiet minute: membership renewals go on, but nobody rewrites the endpoints.
    sim.clear_requests().await?;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let endpoint_writes = sim
        .requests()
        .await?
        .iter()
        .filter(|r| {
            r.resource == "endpoints"
                && matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete")
        })
        .count();
    ensure!(
        endpoint_writes == 0,
        "{endpoint_writes} Endpoints writes in a quiet minute"
    );
    Ok(())
}

/// `static` mode with a DNS name: the name is re-resolved every interval; when it stops
/// resolving, the last good set stays and a warning event says why; a new answer is taken up.
#[tokio::test]
async fn static_name_that_stops_resolving_keeps_the_last_good_set() -> Result<()> {
    let c = cluster().await?;
    let dir = tempfile::tempdir()?;
    let hosts = dir.path().join("hosts");
    let write_hosts = |lines: &str| std::fs::write(&hosts, lines);
    write_hosts("192.0.2.77 lb.bootstrap.test\n192.0.2.78 lb.bootstrap.test\n")?;

    let config = ConfigFile::new(
        "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    interval: 1s\n    \
         staticAddresses: [lb.bootstrap.test]\n  serviceCIDR: {enabled: false}\n  \
         clusterIPRepair: {enabled: false}\n",
    )?;
    let Some(mut controller) = ControllerProcess::start_with_hosts(
        &c.kubeconfig,
        &hosts,
        &[
            "--config",
            config.path.as_str(),
            "--service-cluster-ip-range",
            c.range.as_str(),
            "--leader-elect=false",
        ],
    )?
    else {
        return Ok(());
    };
    expect_members(&c.endpoints, &c.slices, &["192.0.2.77", "192.0.2.78"])
        .await
        .with_context(|| controller.log())?;

    // The name now resolves to nothing: several intervals later the last good set is still there.
    // Events of an earlier run on a shared cluster are older than this second.
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs() as i64
        - 1;
    write_hosts("")?;
    let events: Api<k8s_openapi::api::events::v1::Event> =
        Api::namespaced(common::client_from(&c.kubeconfig).await?, "default");
    eventually("a resolution warning event", CONVERGE, || async {
        let warned = events
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some("StaticAddressResolutionFailed")
                    && e.type_.as_deref() == Some("Warning")
                    && e.metadata
                        .creation_timestamp
                        .as_ref()
                        .is_some_and(|t| t.0.as_second() >= since)
            });
        Ok(warned.then_some(()))
    })
    .await?;
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let view = endpoint_view(&c.endpoints).await?;
        ensure!(
            view.as_ref().map(|(a, _)| a.as_slice())
                == Some(&["192.0.2.77".to_string(), "192.0.2.78".to_string()][..]),
            "the last good set was not kept: {view:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A new answer replaces the set: resolution is live, not cached.
    write_hosts("192.0.2.79 lb.bootstrap.test\n")?;
    expect_members(&c.endpoints, &c.slices, &["192.0.2.79"]).await?;
    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    Ok(())
}

//! End to end: start-up. The API is not there when the controller starts, and goes away while it
//! runs: the process never exits for it, it retries with backoff, `/readyz` says why it is not
//! ready, and every loop converges once the API answers. And on a new, empty cluster every loop
//! sets up its objects without a warning.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::{CONVERGE, ControllerProcess, SimProcess, eventually, free_port};
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use kube::Api;
use kube::api::DeleteParams;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_for_an_absent_api_and_survives_losing_it() -> Result<()> {
    // Nothing listens at this address yet.
    let address = free_port()?.to_string();
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: sim\n  cluster: {{server: \"http://{address}\"}}\n\
             users:\n- name: u\n  user: {{}}\ncontexts:\n- name: sim\n  context: {{cluster: sim, user: u}}\n\
             current-context: sim\n"
        ),
    )?;
    let mut controller = ControllerProcess::start(
        &kubeconfig,
        &[
            // The range of the simulator that appears later.
            "--service-cluster-ip-range",
            common::SIM_SERVICE_RANGE,
            "--endpoint-reconciler-type",
            "lease",
            "--advertise-address",
            "192.0.2.1",
            "--leader-elect=false",
        ],
    )?;

    // Not ready, and saying why, for a while: no exit.
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        controller.is_running(),
        "exited without an API:\n{}",
        controller.log()
    );
    let (status, why) = controller.admin_get("/readyz?verbose").await?;
    ensure!(status != 200, "ready without an API: {why}");
    ensure!(why.contains("no successful pass yet"), "{why}");
    // The failure names the server and the cause, not hyper's `client error (Connect)`.
    let refused = format!("cannot connect to http://{address}: Connection refused");
    ensure!(why.contains(&refused), "{why}");
    ensure!(!why.contains("client error (Connect)"), "{why}");

    // The API appears: every loop converges.
    let sim = SimProcess::start(&["--plain-http", "--listen", &address]).await?;
    controller.wait_ready().await?;
    let client = common::client_from(&sim.kubeconfig).await?;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    eventually("kube-public created", CONVERGE, || async {
        Ok(namespaces.get_opt("kube-public").await?)
    })
    .await?;

    // The API goes away (every request dropped) for a minute, then comes back.
    let lines_before_outage = controller.log().lines().count();
    sim.admin(
        "POST",
        "/sim/faults",
        Some(serde_json::json!({"fault": {"type": "dropConnection"},
                                "trigger": {"probability": 1.0}})),
    )
    .await?;
    // Checked every 10 s through the outage: still running, still live.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_secs(10)).await;
        ensure!(
            controller.is_running(),
            "exited while the API was gone:\n{}",
            controller.log()
        );
        let (status, _) = controller.admin_get("/livez").await?;
        ensure!(status == 200, "not live while the API was gone");
    }
    sim.clear_faults().await?;
    // The outage is reported when it starts, not on every retry: each kind of failure is warned
    // about once per loop, cache, watch and the election, so a minute of retries stays a few lines.
    let log = controller.log();
    let complaints: Vec<&str> = log
        .lines()
        .skip(lines_before_outage)
        .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
        .collect();
    let listed = complaints.join("\n");
    // Once is the point, and none is not once: the outage must be reported.
    ensure!(
        !complaints.is_empty(),
        "the outage was never warned about:\n{log}"
    );
    // And it happened: the controller's requests met dropped connections.
    let dropped = sim
        .requests()
        .await?
        .iter()
        .filter(|r| r.user_agent.starts_with("bootstrap-controller/") && r.status == 0)
        .count();
    ensure!(dropped > 0, "no request of the controller was dropped");
    ensure!(
        !listed.contains("kube_client"),
        "kube's per-request error lines are not the controller's report:\n{listed}"
    );
    // The same warning twice (its time and the next retry's delay aside) is a warning per retry.
    let mut seen = std::collections::BTreeSet::new();
    for line in &complaints {
        let without_time = line.split_once(' ').map_or(*line, |(_, rest)| rest);
        let what = without_time
            .split_once(" retry_in=")
            .map_or(without_time, |(what, _)| what);
        ensure!(
            seen.insert(what),
            "warned twice during one outage:\n{listed}"
        );
    }

    // Still repairing afterwards.
    namespaces
        .delete("kube-node-lease", &DeleteParams::default())
        .await?;
    eventually(
        "kube-node-lease recreated after the outage",
        CONVERGE,
        || async {
            Ok(namespaces
                .get_opt("kube-node-lease")
                .await?
                .filter(|ns| ns.metadata.deletion_timestamp.is_none()))
        },
    )
    .await?;
    ensure!(controller.is_running(), "{}", controller.log());
    Ok(())
}

/// An empty cluster (no namespaces at all, as a new etcd) with every default loop: the loops that
/// write into `default` and `kube-system` start alongside the loop that creates those namespaces,
/// and waiting a moment for them is not something to warn about.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_cluster_is_set_up_without_a_warning() -> Result<()> {
    let sim = SimProcess::start(&[]).await?;
    let mut controller = ControllerProcess::start(
        &sim.kubeconfig,
        &[
            "--service-cluster-ip-range",
            &sim.service_range,
            "--endpoint-reconciler-type",
            "lease",
            "--advertise-address",
            "192.0.2.1",
        ],
    )?;
    controller.wait_ready().await?;
    let client = common::client_from(&sim.kubeconfig).await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let endpoints: Api<Endpoints> = Api::namespaced(client, "default");
    eventually(
        "the kubernetes Service and its Endpoints",
        CONVERGE,
        || async {
            let service = services.get_opt("kubernetes").await?;
            let members = endpoints
                .get_opt("kubernetes")
                .await?
                .and_then(|endpoints| endpoints.subsets)
                .is_some_and(|subsets| !subsets.is_empty());
            Ok((service.is_some() && members).then_some(()))
        },
    )
    .await?;

    let log = controller.log();
    let complaints: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" WARN ") || line.contains(" ERROR "))
        .collect();
    ensure!(
        complaints.is_empty(),
        "warnings while setting up a new cluster:\n{}\n\nwhole log:\n{log}",
        complaints.join("\n")
    );
    ensure!(controller.is_running(), "{log}");
    Ok(())
}

//! End to end: what three replicas send while nothing changes. Every loop runs with a short
//! interval and the leader-election Lease is short, so many timer passes and renewals fall into
//! the window; the simulator's request log is counted per replica and kind.
//!
//! After start-up no replica reads (GET or LIST) anything: periodic passes work from their watch
//! caches, standbys follow the leader's Lease through a watch, and renewals are single writes.
//! What remains is the `/readyz` probes of the apiserver and the Lease writes.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::{ConfigFile, ControllerProcess, RequestsAtRest, SimProcess};

/// Every loop on, every interval short: a timer pass that reads would show many times over.
const CONFIG: &str = "\
endpointReconcilerType: lease
loops:
  systemNamespaces: {interval: 2s}
  kubernetesService: {interval: 2s}
  apiserverEndpoints: {interval: 2s, leaseTTL: 8s}
  serviceCIDR: {interval: 2s}
  clusterIPRepair: {interval: 2s}
  nodePortRepair: {interval: 2s}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_at_rest_read_nothing_after_start_up() -> Result<()> {
    let sim = SimProcess::start(&[]).await?;
    let config = ConfigFile::new(CONFIG)?;
    let mut replicas = Vec::new();
    for n in 1..=3 {
        let address = format!("10.0.0.{n}");
        replicas.push(ControllerProcess::start(
            &sim.kubeconfig,
            &[
                "--config",
                config.path.as_str(),
                "--service-cluster-ip-range",
                &sim.service_range,
                "--advertise-address",
                &address,
                "--leader-elect-lease-duration",
                "4s",
                "--leader-elect-renew-grace",
                "2s",
            ],
        )?);
    }
    for replica in &mut replicas {
        replica.wait_ready().await?;
    }
    // Start-up is over once every member is in the endpoints and the first passes have run.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let at_rest = RequestsAtRest::measure(&sim, &replicas, Duration::from_secs(20)).await?;
    println!(
        "requests per minute at rest ({:?} window):\n{}",
        at_rest.window,
        at_rest.table()
    );
    for replica in &mut replicas {
        ensure!(replica.is_running(), "a replica exited:\n{}", replica.log());
    }
    let reads = at_rest.reads();
    ensure!(
        reads.is_empty(),
        "reads after start-up:\n{}",
        reads.join("\n")
    );
    // The only writes: each replica's membership Lease, and the leader's election Lease.
    let writes: Vec<_> = at_rest
        .per_replica
        .keys()
        .filter(|(_, what)| !what.starts_with("get ") && !what.starts_with("watch "))
        .collect();
    ensure!(
        writes.iter().all(|(_, what)| what == "update leases"),
        "writes other than Lease renewals: {writes:?}"
    );
    // Every replica renews its membership Lease; nobody is silent. Counted, not timed: at least
    // twice each (one renewal could be the last of start-up), however slow the machine.
    for replica in 1..=3 {
        let renewals = at_rest
            .per_replica
            .get(&(replica, "update leases".to_owned()))
            .copied()
            .unwrap_or_default();
        ensure!(renewals >= 2, "replica {replica} renewed {renewals} times");
    }
    Ok(())
}

//! Benchmark for the NodePort repair loop, against real processes:
//! - time from a duplicate node port appearing (the second Service written) to its
//!   `PortAlreadyAllocated` event, seen by our own watch, over many trials;
//! - API requests of the NodePort loop while nothing changes (from the simulator's request log).
//!
//! `cargo bench -p e2e --bench nodeport_repair -- [--trials N] [--idle-secs S]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::{ConfigFile, ControllerProcess, SimProcess, summary};
use futures::StreamExt;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::runtime::watcher::{self, Event as WatchEvent};

fn parse_args() -> Result<(usize, u64)> {
    let (mut trials, mut idle_secs) = (200, 60);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--trials" => trials = value()?.parse()?,
            "--idle-secs" => idle_secs = value()?.parse()?,
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok((trials, idle_secs))
}

/// Only the NodePort repair (and the system namespaces, which the Services' namespace needs).
const NODEPORT_ONLY: &str = "loops:\n  kubernetesService: {enabled: false}\n  \
    apiserverEndpoints: {enabled: false}\n  serviceCIDR: {enabled: false}\n  \
    clusterIPRepair: {enabled: false}\n";

fn service(name: &str, node_port: i32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {"type": "NodePort", "ports": [{"port": 80, "protocol": "TCP", "nodePort": node_port}]}
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    let (trials, idle_secs) = parse_args()?;
    println!("nodeport_repair: {trials} trials, {idle_secs} s idle");
    let sim = SimProcess::start(&["--seed-namespace", "default"]).await?;
    let config = ConfigFile::new(NODEPORT_ONLY)?;
    let mut controller = ControllerProcess::start(
        &sim.kubeconfig,
        &["--config", config.path.as_str(), "--leader-elect=false"],
    )?;
    controller.wait_ready().await?;
    let client = common::client_from(&sim.kubeconfig).await?;
    let events: Api<Event> = Api::all(client);
    let mut watch = watcher::watcher(events, watcher::Config::default()).boxed();
    loop {
        if let WatchEvent::InitDone = watch.next().await.context("watch ended")?? {
            break;
        }
    }

    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        let port = 30000 + i32::try_from(trial)?;
        sim.admin(
            "PUT",
            "/sim/backdoor",
            Some(service(&format!("a-{trial}"), port)),
        )
        .await?;
        let started = Instant::now();
        let duplicate = format!("b-{trial}");
        sim.admin("PUT", "/sim/backdoor", Some(service(&duplicate, port)))
            .await?;
        let deadline = started + Duration::from_secs(30);
        loop {
            let next = tokio::time::timeout_at(deadline.into(), watch.next())
                .await
                .with_context(|| format!("trial {trial}: no event within 30 s"))?;
            if let WatchEvent::Apply(event) = next.context("watch ended")?? {
                let about = event.regarding.as_ref().and_then(|r| r.name.as_deref());
                if event.reason.as_deref() == Some("PortAlreadyAllocated")
                    && about == Some(duplicate.as_str())
                {
                    samples.push(started.elapsed());
                    break;
                }
            }
        }
    }
    summary("duplicate node port -> PortAlreadyAllocated event", samples);

    // At rest: what the controller asks of the API while nothing changes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.clear_requests().await?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let requests = sim.requests().await?;
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    let mut by_kind: BTreeMap<String, usize> = BTreeMap::new();
    for request in requests
        .iter()
        .filter(|r| r.user_agent.starts_with("bootstrap-controller/"))
    {
        *by_kind
            .entry(format!("{} {}", request.verb, request.resource))
            .or_default() += 1;
    }
    let total: usize = by_kind.values().sum();
    println!(
        "idle, nodeport-repair and system-namespaces, {minutes:.1} min: {:.2} requests/min in all {by_kind:?}",
        total as f64 / minutes
    );
    if !controller.is_running() {
        bail!("controller died:\n{}", controller.log());
    }
    Ok(())
}

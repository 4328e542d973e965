//! Benchmark for the system-namespaces loop, against real processes:
//! - time from a namespace's disappearance (its `Deleted` watch event) to its recreation (`Added`),
//!   over many trials, with watch triggers and in `--timer-only` mode;
//! - API requests the controller makes while nothing drifts (from the simulator's request log);
//! - the controller's resident memory when idle.
//!
//! `cargo bench -p e2e --bench namespace_heal -- [--trials N] [--timer-trials N] [--idle-secs S]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::{CONVERGE, ControllerProcess, SimProcess, eventually, rss_kib, summary};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::DeleteParams;
use kube::runtime::watcher::{self, Event};

struct Args {
    trials: usize,
    timer_trials: usize,
    idle_secs: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        trials: 200,
        timer_trials: 5,
        idle_secs: 120,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--trials" => args.trials = value()?.parse()?,
            "--timer-trials" => args.timer_trials = value()?.parse()?,
            "--idle-secs" => args.idle_secs = value()?.parse()?,
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

/// Deletes `kube-public` `trials` times and measures gone -> back, seen by our own watch. Trials
/// are 200 ms apart after each recreation.
async fn heal_latencies(api: &Api<Namespace>, trials: usize) -> Result<Vec<Duration>> {
    let mut events = watcher::watcher(
        api.clone(),
        watcher::Config::default().fields("metadata.name=kube-public"),
    )
    .boxed();
    // Drain the initial list.
    loop {
        match events.next().await.context("watch ended")?? {
            Event::InitDone => break,
            _ => continue,
        }
    }
    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        api.delete("kube-public", &DeleteParams::default())
            .await
            .with_context(|| format!("trial {trial}: delete"))?;
        let mut gone_at = None;
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            let next = tokio::time::timeout_at(deadline.into(), events.next())
                .await
                .with_context(|| format!("trial {trial}: no recreation within 180 s"))?;
            match next.context("watch ended")?? {
                Event::Delete(_) => gone_at = Some(Instant::now()),
                Event::Apply(ns) | Event::InitApply(ns) => {
                    if let Some(gone) = gone_at
                        && ns.metadata.deletion_timestamp.is_none()
                    {
                        samples.push(gone.elapsed());
                        // Let the controller's confirming pass see a clean state: deleting again
                        // at once would be a fight, which the runner deliberately slows down.
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        break;
                    }
                }
                Event::Init | Event::InitDone => {}
            }
        }
    }
    Ok(samples)
}

async fn wait_for_system_namespaces(api: &Api<Namespace>) -> Result<()> {
    eventually("system namespaces", CONVERGE, || async {
        for name in ["kube-system", "kube-public", "kube-node-lease", "default"] {
            if api.get_opt(name).await?.is_none() {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}

/// Counts what the controller asks of the API over `secs` seconds in which nothing drifts.
async fn idle_traffic(
    sim: &SimProcess,
    controller: &ControllerProcess,
    secs: u64,
    label: &str,
) -> Result<()> {
    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.clear_requests().await?;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let requests = sim.requests().await?;
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    let ours: Vec<_> = requests
        .iter()
        .filter(|r| r.user_agent.starts_with("bootstrap-controller/"))
        .collect();
    let watches = ours.iter().filter(|r| r.verb == "watch").count();
    let writes = ours
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
        .count();
    let reads = ours.len() - watches - writes;
    println!(
        "idle, {label}, {minutes:.1} min: {:.2} reads/min, {:.2} writes/min, {watches} watch (re)connects",
        reads as f64 / minutes,
        writes as f64 / minutes,
    );
    if let Some(pid) = controller.pid() {
        println!(
            "idle RSS, {label}: {:.1} MiB",
            rss_kib(pid)? as f64 / 1024.0
        );
    }
    Ok(())
}

const NAMESPACES_ONLY: &str = "loops:\n  kubernetesService: {enabled: false}\n  \
    apiserverEndpoints: {enabled: false}\n  serviceCIDR: {enabled: false}\n  \
    clusterIPRepair: {enabled: false}\n";

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    println!(
        "namespace_heal: {} trials with triggers, {} in --timer-only mode, {} s idle",
        args.trials, args.timer_trials, args.idle_secs
    );

    // Namespaces vanish right away, so the figures are the controller's reaction, not the
    // simulated namespace controller's finalisation delay.
    let sim = SimProcess::start(&["--namespace-finalize-delay", "0s"]).await?;
    let api: Api<Namespace> = Api::all(common::client_from(&sim.kubeconfig).await?);
    let dir = tempfile::tempdir()?;
    let config_path = dir.path().join("namespaces-only.yaml");
    std::fs::write(&config_path, NAMESPACES_ONLY)?;
    let config = config_path.to_string_lossy().into_owned();
    let namespaces_only = [
        "--leader-elect=false",
        "--service-cluster-ip-range",
        "10.96.0.0/12",
        "--config",
        config.as_str(),
    ];

    {
        let mut controller = ControllerProcess::start(&sim.kubeconfig, &namespaces_only)?;
        controller.wait_ready().await?;
        wait_for_system_namespaces(&api).await?;
        summary(
            "heal (watch triggers)",
            heal_latencies(&api, args.trials).await?,
        );
        idle_traffic(
            &sim,
            &controller,
            args.idle_secs,
            "system-namespaces loop only",
        )
        .await?;
        controller.terminate()?;
    }

    {
        // Every default loop, one replica: what a quiet control plane costs in total.
        let mut controller = ControllerProcess::start(
            &sim.kubeconfig,
            &[
                "--leader-elect=false",
                "--service-cluster-ip-range",
                "10.96.0.0/12",
            ],
        )?;
        controller.wait_ready().await?;
        idle_traffic(&sim, &controller, args.idle_secs, "all default loops").await?;
        controller.terminate()?;
    }

    if args.timer_trials > 0 {
        let mut timer_only = namespaces_only.to_vec();
        timer_only.push("--timer-only");
        let mut controller = ControllerProcess::start(&sim.kubeconfig, &timer_only)?;
        controller.wait_ready().await?;
        wait_for_system_namespaces(&api).await?;
        summary(
            "heal (--timer-only, upstream 60 s interval)",
            heal_latencies(&api, args.timer_trials).await?,
        );
        controller.terminate()?;
    }
    Ok(())
}

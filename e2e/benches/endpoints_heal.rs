//! Benchmark for the `kubernetes` endpoints, against real processes: three
//! `bootstrap-controller run` sidecars (one per simulated apiserver) and `apiserver-sim`.
//! - time from a SIGKILL of a non-leader sidecar to its address leaving the Endpoints;
//! - time from a SIGTERM of a non-leader sidecar whose apiserver is stopping (its `/readyz`
//!   failing) to its address leaving the Endpoints;
//! - how long a SIGTERM of a sidecar beside a ready apiserver takes to exit (it probes `/readyz`
//!   over `shutdownProbeWindow` and keeps its address);
//! - time from a corrupted Endpoints port to its repair (seen by our own watch);
//! - writes per minute to Endpoints/EndpointSlices/Services at rest, and all requests per minute.
//!
//! `cargo bench -p e2e --bench endpoints_heal -- [--interval 10s] [--ttl 15s] [--kill-trials N]
//!  [--term-trials N] [--port-trials N] [--idle-secs S]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::{CONVERGE, ControllerProcess, SimProcess, eventually, summary};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Endpoints;
use kube::api::PostParams;
use kube::runtime::watcher::{self, Event};
use kube::{Api, Client};
use test_support::readyz::FakeReadyz;

struct Args {
    interval: String,
    ttl: String,
    kill_trials: usize,
    term_trials: usize,
    port_trials: usize,
    idle_secs: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        interval: "10s".into(),
        ttl: "15s".into(),
        kill_trials: 5,
        term_trials: 20,
        port_trials: 100,
        idle_secs: 60,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--interval" => args.interval = value()?,
            "--ttl" => args.ttl = value()?,
            "--kill-trials" => args.kill_trials = value()?.parse()?,
            "--term-trials" => args.term_trials = value()?.parse()?,
            "--port-trials" => args.port_trials = value()?.parse()?,
            "--idle-secs" => args.idle_secs = value()?.parse()?,
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn start_member(kubeconfig: &Path, config: &Path, n: usize) -> Result<ControllerProcess> {
    ControllerProcess::start(
        kubeconfig,
        &[
            "--config",
            &config.display().to_string(),
            "--advertise-address",
            &format!("192.0.2.{n}"),
            "--leader-elect-identity",
            &format!("member-{n}"),
        ],
    )
}

async fn listed(api: &Api<Endpoints>) -> Result<Vec<String>> {
    Ok(api
        .get_opt("kubernetes")
        .await?
        .and_then(|e| e.subsets)
        .unwrap_or_default()
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .map(|a| a.ip.clone())
        .collect())
}

async fn wait_listed(api: &Api<Endpoints>, address: &str, present: bool) -> Result<()> {
    eventually(
        &format!("{address} listed={present}"),
        CONVERGE * 2,
        || async { Ok((listed(api).await?.iter().any(|a| a == address) == present).then_some(())) },
    )
    .await
}

async fn leader(client: &Client) -> Result<Option<String>> {
    Ok(Api::<Lease>::namespaced(client.clone(), "kube-system")
        .get_opt("bootstrap-controller")
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity))
}

/// Polls every 10 ms from the signal until the address is gone.
async fn removal_after(
    api: &Api<Endpoints>,
    address: &str,
    signal: impl FnOnce() -> Result<()>,
) -> Result<Duration> {
    let started = Instant::now();
    signal()?;
    loop {
        if !listed(api).await?.iter().any(|a| a == address) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > CONVERGE * 2 {
            bail!("{address} not removed within {:?}", CONVERGE * 2);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn signal(process: &ControllerProcess, sig: &str) -> Result<()> {
    let pid = process.pid().context("no pid")?;
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?;
    if !status.success() {
        bail!("kill {sig} {pid} failed");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let sim = SimProcess::start(&[
        "--seed-namespace",
        "default",
        "--seed-namespace",
        "kube-system",
    ])
    .await?;
    let client = common::client_from(&sim.kubeconfig).await?;
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
    let dir = tempfile::tempdir()?;
    // Each sidecar probes its own apiserver's /readyz.
    let mut configs = Vec::new();
    let mut readiness = Vec::new();
    for n in 1..=3 {
        let ready = FakeReadyz::start().await?;
        let url = ready.url();
        let config = dir.path().join(format!("config-{n}.yaml"));
        std::fs::write(
            &config,
            format!(
                "serviceClusterIPRange: 10.96.0.0/12\nendpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    interval: {}\n    leaseTTL: {}\n    readyzURL: {url}\n",
                args.interval, args.ttl
            ),
        )?;
        configs.push(config);
        readiness.push(ready);
    }
    println!(
        "three sidecars, endpoints interval {}, lease TTL {}",
        args.interval, args.ttl
    );
    let mut members: Vec<Option<ControllerProcess>> = Vec::new();
    for n in 1..=3 {
        members.push(Some(start_member(&sim.kubeconfig, &configs[n - 1], n)?));
    }
    for n in 1..=3 {
        wait_listed(&endpoints, &format!("192.0.2.{n}"), true).await?;
    }
    let leader_id = eventually("a leader", CONVERGE, || async { leader(&client).await }).await?;
    let victim = (1..=3)
        .find(|n| format!("member-{n}") != leader_id)
        .context("a follower")?;
    let victim_address = format!("192.0.2.{victim}");
    let config = &configs[victim - 1];

    let mut kills = Vec::new();
    for _ in 0..args.kill_trials {
        let process = members[victim - 1].take().context("victim running")?;
        kills.push(removal_after(&endpoints, &victim_address, || signal(&process, "-KILL")).await?);
        drop(process);
        members[victim - 1] = Some(start_member(&sim.kubeconfig, config, victim)?);
        wait_listed(&endpoints, &victim_address, true).await?;
    }
    summary("SIGKILL -> address removed", kills);

    // The node goes away: its apiserver fails /readyz, then the sidecar gets SIGTERM.
    let mut terms = Vec::new();
    for _ in 0..args.term_trials {
        let process = members[victim - 1].take().context("victim running")?;
        readiness[victim - 1].set(false);
        terms.push(removal_after(&endpoints, &victim_address, || signal(&process, "-TERM")).await?);
        drop(process);
        readiness[victim - 1].set(true);
        members[victim - 1] = Some(start_member(&sim.kubeconfig, config, victim)?);
        wait_listed(&endpoints, &victim_address, true).await?;
    }
    summary("SIGTERM, apiserver stopping -> address removed", terms);

    // Only the sidecar stops (a restart, an upgrade): it probes, keeps the address, exits.
    let mut stops = Vec::new();
    for _ in 0..args.term_trials.min(5) {
        let mut process = members[victim - 1].take().context("victim running")?;
        process.wait_ready().await?;
        let started = Instant::now();
        let status = process.terminate()?;
        stops.push(started.elapsed());
        if !status.success() {
            bail!("SIGTERM: exit status {status}:\n{}", process.log());
        }
        if !listed(&endpoints).await?.contains(&victim_address) {
            bail!("{victim_address} withdrawn although its apiserver is ready");
        }
        members[victim - 1] = Some(start_member(&sim.kubeconfig, config, victim)?);
    }
    summary("SIGTERM, apiserver ready -> exited, address kept", stops);

    let mut events = watcher::watcher(
        endpoints.clone(),
        watcher::Config::default().fields("metadata.name=kubernetes"),
    )
    .boxed();
    loop {
        if let Event::InitDone = events.next().await.context("watch ended")?? {
            break;
        }
    }
    let port_of = |e: &Endpoints| {
        e.subsets
            .as_ref()
            .and_then(|s| s.first())
            .and_then(|s| s.ports.as_ref())
            .and_then(|p| p.first())
            .map(|p| p.port)
    };
    let mut repairs = Vec::new();
    for _ in 0..args.port_trials {
        let mut current = endpoints.get("kubernetes").await?;
        if let Some(port) = current
            .subsets
            .as_mut()
            .and_then(|s| s.first_mut())
            .and_then(|s| s.ports.as_mut())
            .and_then(|p| p.first_mut())
        {
            port.port = 443;
        }
        let written = endpoints
            .replace("kubernetes", &PostParams::default(), &current)
            .await?;
        let corrupted_rv = written.metadata.resource_version.clone();
        // Timed from our write's watch event, so the watch delay counts on both ends.
        let mut corrupted_at = None;
        loop {
            let event = tokio::time::timeout(CONVERGE, events.next())
                .await
                .context("no repair within the timeout")?
                .context("watch ended")??;
            let Event::Apply(e) = event else { continue };
            if e.metadata.resource_version == corrupted_rv {
                corrupted_at = Some(Instant::now());
                continue;
            }
            if port_of(&e) == Some(6443)
                && let Some(at) = corrupted_at
            {
                repairs.push(at.elapsed());
                break;
            }
        }
        // Let the pass our own repair triggers run clean: back-to-back corruptions look like
        // another actor fighting us, and the runner then slows triggered passes on purpose.
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    summary("corrupted Endpoints port -> repaired", repairs);

    tokio::time::sleep(Duration::from_secs(2)).await;
    sim.clear_requests().await?;
    tokio::time::sleep(Duration::from_secs(args.idle_secs)).await;
    let requests = sim.requests().await?;
    let minutes = args.idle_secs as f64 / 60.0;
    let writes = |resource: &str| {
        requests
            .iter()
            .filter(|r| r.resource == resource)
            .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
            .count() as f64
            / minutes
    };
    let non_watch = requests.iter().filter(|r| r.verb != "watch").count() as f64 / minutes;
    println!(
        "at rest over {:.1} min, 3 sidecars: writes/min endpoints={:.2} endpointslices={:.2} services={:.2} leases={:.2}; all non-watch requests/min={:.1}",
        minutes,
        writes("endpoints"),
        writes("endpointslices"),
        writes("services"),
        writes("leases"),
        non_watch
    );
    Ok(())
}

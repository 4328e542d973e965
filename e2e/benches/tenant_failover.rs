//! Management mode with two replicas sharing the tenants: how long the tenants of a replica are
//! left without one when it dies (SIGKILL: its Lease must expire first) or stops (SIGTERM: it
//! stops its tenants, then deletes its Lease). Each trial starts two replicas over one simulated
//! fleet, waits until they split the tenants, stops one, and measures from the signal until the
//! survivor's `/readyz?verbose` shows every tenant running there (polled every 5 ms), and until
//! a namespace deleted at the signal in one of the moved tenants is back (backdoor polled every
//! millisecond). First, with one replica: from a tenant's Secret created until that tenant's
//! missing namespace is back (its loops started and made their first pass).
//!
//! `cargo bench -p e2e --bench tenant_failover -- [--tenants 50] [--trials 5]
//! [--lease-duration-secs 5] [--renew-grace-secs 2]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use apiserver_sim::{Fleet, FleetConfig};
use common::{ControllerProcess, summary};

struct Args {
    tenants: usize,
    trials: usize,
    lease_duration: u64,
    renew_grace: u64,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        tenants: 50,
        trials: 5,
        lease_duration: 5,
        renew_grace: 2,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--tenants" => args.tenants = value()?.parse()?,
            "--trials" => args.trials = value()?.parse()?,
            "--lease-duration-secs" => args.lease_duration = value()?.parse()?,
            "--renew-grace-secs" => args.renew_grace = value()?.parse()?,
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn running_here(readyz: &str) -> Vec<String> {
    readyz
        .lines()
        .filter(|line| line.starts_with("[+]tenant ") && line.ends_with(" ok"))
        .filter_map(|line| line.split(' ').nth(1).map(str::to_owned))
        .collect()
}

enum Stop {
    Kill,
    Terminate,
}

/// One trial: (time until the survivor runs every tenant, time until the deleted namespace is
/// back).
async fn trial(args: &Args, stop: &Stop) -> Result<(Duration, Duration)> {
    let fleet = Fleet::start(FleetConfig {
        tenants: args.tenants,
        ..FleetConfig::default()
    })
    .await?;
    let (lease, grace) = (
        format!("{}s", args.lease_duration),
        format!("{}s", args.renew_grace),
    );
    let replica = |identity: &str| -> Result<ControllerProcess> {
        let mut flags = common::MANAGEMENT_ARGS.to_vec();
        flags.extend([
            "--leader-elect-lease-namespace",
            "tenants",
            "--leader-elect-lease-duration",
            &lease,
            "--leader-elect-renew-grace",
            &grace,
            "--leader-elect-identity",
            identity,
        ]);
        ControllerProcess::start(fleet.management().kubeconfig_path(), &flags)
    };
    let mut leaving = replica("replica-a")?;
    let mut staying = replica("replica-b")?;
    leaving.wait_ready().await?;
    staying.wait_ready().await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let moved = loop {
        let (_, a) = leaving.admin_get("/readyz?verbose").await?;
        let (_, b) = staying.admin_get("/readyz?verbose").await?;
        let (a, b) = (running_here(&a), running_here(&b));
        if !a.is_empty() && a.len() + b.len() == args.tenants {
            break a;
        }
        if Instant::now() > deadline {
            bail!("the replicas did not split the tenants");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // A tenant of the leaving replica, by its Secret name `tenants/tenant-<i>-kubeconfig`.
    let index: usize = moved[0]
        .trim_start_matches("tenants/tenant-")
        .trim_end_matches("-kubeconfig")
        .parse()
        .context("tenant index")?;
    let tenant = fleet.tenant(index).context("tenant")?;
    // Everything converged before the clock starts.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(
        tenant.backdoor().get("namespaces", "", "kube-public"),
        Ok(Some(_))
    ) {
        if Instant::now() > deadline {
            bail!("tenant {index} never converged");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let start = Instant::now();
    match stop {
        Stop::Kill => leaving.kill()?,
        Stop::Terminate => {
            // SIGTERM returns once the process has exited; the clock runs meanwhile.
            let waiter = tokio::task::spawn_blocking(move || leaving.terminate());
            tenant.backdoor().delete("namespaces", "", "kube-public")?;
            let took_over = wait_all(&staying, args.tenants, start).await?;
            let healed = wait_healed(tenant, start).await?;
            waiter.await??;
            return Ok((took_over, healed));
        }
    }
    tenant.backdoor().delete("namespaces", "", "kube-public")?;
    let took_over = wait_all(&staying, args.tenants, start).await?;
    let healed = wait_healed(tenant, start).await?;
    Ok((took_over, healed))
}

async fn wait_all(staying: &ControllerProcess, tenants: usize, start: Instant) -> Result<Duration> {
    loop {
        let (_, b) = staying.admin_get("/readyz?verbose").await?;
        if running_here(&b).len() == tenants {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the survivor never ran every tenant:\n{b}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn wait_healed(tenant: &apiserver_sim::Sim, start: Instant) -> Result<Duration> {
    loop {
        if matches!(
            tenant.backdoor().get("namespaces", "", "kube-public"),
            Ok(Some(_))
        ) {
            return Ok(start.elapsed());
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the moved tenant's namespace was never recreated");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// From a tenant's Secret created (through the management cluster's API) until a system
/// namespace missing in that tenant is back: the tenant's loops started and made their first pass.
async fn secret_to_healed(trials: usize) -> Result<Vec<Duration>> {
    let fleet = Fleet::start(FleetConfig {
        tenants: 4,
        ..FleetConfig::default()
    })
    .await?;
    let mut controller = ControllerProcess::start(
        fleet.management().kubeconfig_path(),
        &[
            common::MANAGEMENT_ARGS.as_slice(),
            &["--leader-elect=false"],
        ]
        .concat(),
    )?;
    controller.wait_ready().await?;
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
        kube::Api::namespaced(fleet.management().client(), "tenants");
    let tenant = fleet.tenant(3).context("tenant")?;
    let secret: k8s_openapi::api::core::v1::Secret =
        serde_json::from_value(fleet.tenant_secret(3).context("secret")?)?;
    let mut samples = Vec::with_capacity(trials);
    for _ in 0..trials {
        // Gone: its runtime stops and closes its watches; then the namespace is removed.
        let _ = secrets
            .delete(&Fleet::secret_name(3), &Default::default())
            .await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while tenant.open_watches("namespaces") > 0 {
            if Instant::now() > deadline {
                bail!("tenant 3 still watched after its Secret was deleted");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tenant.backdoor().delete("namespaces", "", "kube-public")?;
        let mut fresh = secret.clone();
        fresh.metadata.resource_version = None;
        fresh.metadata.uid = None;
        let start = Instant::now();
        secrets.create(&Default::default(), &fresh).await?;
        samples.push(wait_healed(tenant, start).await?);
    }
    Ok(samples)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let args = parse_args()?;
    summary(
        "a tenant Secret created: its missing namespace back",
        secret_to_healed(args.trials * 4).await?,
    );
    println!(
        "tenant_failover: {} tenants, 2 replicas, lease duration {} s, renew grace {} s, {} trials each",
        args.tenants, args.lease_duration, args.renew_grace, args.trials
    );
    for (label, stop) in [
        ("SIGKILL (the Lease must expire)", Stop::Kill),
        ("SIGTERM (the Lease is deleted)", Stop::Terminate),
    ] {
        let mut took_over = Vec::new();
        let mut healed = Vec::new();
        for _ in 0..args.trials {
            let (all, heal) = trial(&args, &stop).await?;
            took_over.push(all);
            healed.push(heal);
        }
        summary(
            &format!("{label}: every tenant running on the survivor"),
            took_over,
        );
        summary(
            &format!("{label}: a moved tenant's deleted namespace back"),
            healed,
        );
    }
    Ok(())
}

//! Measures what a fleet costs: start time and resident memory of a management cluster plus N
//! tenant clusters (default 1,000), and of one request to every tenant.
//!
//! `cargo run -p apiserver-sim --example fleet [-- N]`

use std::time::Instant;

use apiserver_sim::{Fleet, FleetConfig};
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse().ok())
        })
        .unwrap_or(0)
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let n: usize = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 1000,
    };
    let before = rss_kib();
    let t = Instant::now();
    let fleet = Fleet::start(FleetConfig {
        tenants: n,
        ..FleetConfig::default()
    })
    .await?;
    let started = t.elapsed();
    let after = rss_kib();
    println!(
        "{n} tenants started in {started:.2?}; RSS {:.1} MiB -> {:.1} MiB, {:.1} KiB per tenant; {} open fds",
        before as f64 / 1024.0,
        after as f64 / 1024.0,
        (after - before) as f64 / n.max(1) as f64,
        open_fds()
    );
    let t = Instant::now();
    for sim in fleet.tenants() {
        Api::<Namespace>::all(sim.client())
            .list(&Default::default())
            .await?;
    }
    let listed = rss_kib();
    println!(
        "one LIST on every tenant: {:.2?}; RSS {:.1} MiB, {:.1} KiB per tenant",
        t.elapsed(),
        listed as f64 / 1024.0,
        (listed - before) as f64 / n.max(1) as f64
    );
    fleet.shutdown().await;
    Ok(())
}

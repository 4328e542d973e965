//! Requests per minute of three replicas at rest, with the default configuration (every loop,
//! default intervals, leader election on), counted from the simulator's request log per replica
//! and kind. `--controller PATH` measures another build (for a before/after comparison).
//!
//! `cargo bench -p e2e --bench quiet_at_rest -- [--window-secs S] [--controller PATH]`

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use common::{ControllerProcess, RequestsAtRest, SimProcess, controller_bin};

fn parse_args() -> Result<(u64, PathBuf)> {
    let (mut window, mut controller) = (60, None);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--window-secs" => window = value()?.parse()?,
            "--controller" => controller = Some(PathBuf::from(value()?)),
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok((window, controller.unwrap_or_else(controller_bin)))
}

#[tokio::main]
async fn main() -> Result<()> {
    let (window, controller) = parse_args()?;
    let sim = SimProcess::start(&[]).await?;
    let mut replicas = Vec::new();
    for n in 1..=3 {
        let address = format!("10.0.0.{n}");
        replicas.push(ControllerProcess::start_binary(
            &controller,
            &sim.kubeconfig,
            &[
                "--service-cluster-ip-range",
                "10.96.0.0/12",
                "--endpoint-reconciler-type",
                "lease",
                "--advertise-address",
                &address,
            ],
        )?);
    }
    for replica in &mut replicas {
        replica.wait_ready().await?;
    }
    // Past start-up: every replica has joined, the first passes are done.
    tokio::time::sleep(Duration::from_secs(20)).await;
    let at_rest = RequestsAtRest::measure(&sim, &replicas, Duration::from_secs(window)).await?;
    println!(
        "{} at rest, 3 replicas, default configuration, {window} s window",
        controller.display()
    );
    print!("{}", at_rest.table());
    let mut total = 0;
    for replica in 1..=3 {
        let (mut all, mut reads) = (0, 0);
        for ((r, what), count) in &at_rest.per_replica {
            if *r == replica && !what.starts_with("watch ") {
                all += count;
                if (what.starts_with("get ") || what.starts_with("list ")) && !what.contains(" /") {
                    reads += count;
                }
            }
        }
        total += all;
        println!(
            "replica {replica}: {:.1} requests/min ({:.1} reads/min), watches aside",
            at_rest.per_minute(all),
            at_rest.per_minute(reads)
        );
    }
    println!("total: {:.1} requests/min", at_rest.per_minute(total));
    Ok(())
}

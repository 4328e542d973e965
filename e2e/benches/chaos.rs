//! Chaos, long mode: the harness of `tests/chaos.rs` (faults, breakage, SIGKILLs, a leader
//! partition; the same invariants) for minutes instead of seconds, several runs in a row.
//!
//! `cargo bench -p e2e --bench chaos -- [--secs S] [--replicas N] [--runs R] [--seed SEED]`
//! (release binaries first: `cargo build --release -p bootstrap-controller -p apiserver-sim`, or
//! `--profile dev` with the debug ones).

#[path = "../tests/common/mod.rs"]
mod common;

use anyhow::{Context, Result, bail};

#[tokio::main]
async fn main() -> Result<()> {
    let (mut secs, mut replicas, mut runs, mut seed) = (180u64, 3usize, 1usize, None);
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().context("flag needs a value");
        match flag.as_str() {
            "--secs" => secs = value()?.parse()?,
            "--replicas" => replicas = value()?.parse()?,
            "--runs" => runs = value()?.parse()?,
            "--seed" => seed = Some(value()?.parse::<u64>()?),
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    for run in 1..=runs {
        let seed = seed.unwrap_or_else(|| {
            k8s_openapi::jiff::Timestamp::now()
                .as_nanosecond()
                .unsigned_abs() as u64
                | 1
        });
        println!("run {run}/{runs}: {replicas} replica(s), {secs} s, seed {seed}");
        common::chaos::run(seed, secs, replicas)
            .await
            .with_context(|| format!("run {run}, seed {seed}"))?;
    }
    Ok(())
}

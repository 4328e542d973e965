//! ClusterIP repair at scale: over 10,000 and 100,000 Services (30 % dual-stack, so 1.3
//! IPAddresses per Service, all consistent) against the API simulator, prints how long the
//! caches take to sync (kube-runtime watchers listing Services, IPAddresses and ServiceCIDRs in
//! pages, each object projected to its record), how long a pass over the synced caches takes,
//! and the peak RSS, with the resident memory after the sync and what the Service and IPAddress
//! caches take; and, with every watch answered `410 Gone`, the memory of relisting. `--sizes
//! 1000000` runs a million Services (the simulator then holds about 5 GiB in this process).
//!
//! `cargo bench -p bootstrap-reconcilers --bench clusterip_repair [-- --sizes 10000,100000] [--roles ipaddress-warm,ipaddress-relist,audit-warm]`
//!
//! Environment: `BENCH_PAGE_SIZE=N` (LIST page size, default the loop's), `BENCH_PASSES=N`
//! (passes timed, default 5).
//!
//! The simulator runs in this (parent) process; every measurement runs in a child process of
//! this binary, so each peak RSS is the repair's own, not the simulator's.

#![allow(clippy::unwrap_used)]

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use futures::StreamExt;
use prometheus_client::registry::Registry;
use reconcilers::clusterip_repair::{self, ClusterIpRepairLoop, RepairMode};
use reconcilers::section::Settings;
use reconcilers::{PassContext, Reconciler};
use serde_json::json;

fn page_size() -> u32 {
    std::env::var("BENCH_PAGE_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(reconcilers::watch_cache::DEFAULT_PAGE_SIZE)
}

fn passes() -> usize {
    std::env::var("BENCH_PASSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
}

const ROLES: [&str; 3] = ["ipaddress-warm", "ipaddress-relist", "audit-warm"];

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if let Some(at) = args.iter().position(|a| a == "--child") {
        let kubeconfig = args.get(at + 1).context("--child KUBECONFIG ROLE")?.clone();
        let role = args.get(at + 2).context("--child KUBECONFIG ROLE")?.clone();
        return runtime.block_on(child(&kubeconfig, &role));
    }
    let list = |flag: &str| -> Option<Vec<String>> {
        let at = args.iter().position(|a| a == flag)?;
        Some(args.get(at + 1)?.split(',').map(str::to_owned).collect())
    };
    let sizes: Vec<usize> = match list("--sizes") {
        Some(sizes) => sizes.iter().map(|s| s.parse()).collect::<Result<_, _>>()?,
        None => vec![10_000, 100_000],
    };
    let roles = list("--roles").unwrap_or_else(|| ROLES.map(str::to_owned).to_vec());
    runtime.block_on(parent(&sizes, &roles))
}

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    kib / 1024.0
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN);
    kib / 1024.0
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

// ------------------------------------------------------------------------------------------------
// Parent: the simulator and the cluster.

fn service_json(i: usize, dual: bool) -> (serde_json::Value, Vec<String>) {
    // Offsets from 10.96.0.1 upwards: unique, never the network or broadcast address.
    let v4 = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 96, 0, 1)) + i as u32)
        .to_string();
    let mut ips = vec![v4.clone()];
    if dual {
        let base = u128::from("fd00:10:96::".parse::<std::net::Ipv6Addr>().unwrap());
        ips.push(std::net::Ipv6Addr::from(base + i as u128 + 1).to_string());
    }
    let name = format!("svc-{i:06}");
    let ns = format!("ns-{}", i % 200);
    let object = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": name, "namespace": ns,
            "labels": {"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "bench"},
            "annotations": {"example.com/owner": "team-a"},
            "managedFields": [{
                "manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "v1",
                "time": "2026-11-22T00:00:00Z", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:metadata": {"f:labels": {".": {}, "f:app.kubernetes.io/name": {}}},
                             "f:spec": {"f:ports": {".": {}, "k:{\"port\":80,\"protocol\":\"TCP\"}": {".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}},
                                        "f:selector": {}, "f:sessionAffinity": {}, "f:type": {}}}
            }]
        },
        "spec": {
            "type": "ClusterIP",
            "clusterIP": v4,
            "clusterIPs": ips,
            "ipFamilies": if dual { json!(["IPv4", "IPv6"]) } else { json!(["IPv4"]) },
            "ipFamilyPolicy": if dual { "PreferDualStack" } else { "SingleStack" },
            "internalTrafficPolicy": "Cluster",
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
            "selector": {"app.kubernetes.io/name": name},
            "sessionAffinity": "None"
        },
        "status": {"loadBalancer": {}}
    });
    (object, ips)
}

fn populate(sim: &Sim, count: usize) -> Result<usize> {
    let backdoor = sim.backdoor();
    backdoor.put(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "kubernetes"},
        "spec": {"cidrs": ["10.96.0.0/12", "fd00:10:96::/108"]}
    }))?;
    let mut ip_count = 0;
    for i in 0..count {
        let dual = i % 10 < 3;
        let (object, ips) = service_json(i, dual);
        let (ns, name) = (
            object["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            object["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
        backdoor.put(object)?;
        for ip in ips {
            let family = if ip.contains(':') { "IPv6" } else { "IPv4" };
            backdoor.put(json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
                "metadata": {"name": ip, "labels": {
                    "ipaddress.kubernetes.io/ip-family": family,
                    "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io"}},
                "spec": {"parentRef": {"group": "", "resource": "services", "namespace": ns, "name": name}}
            }))?;
            ip_count += 1;
        }
    }
    Ok(ip_count)
}

async fn parent(sizes: &[usize], roles: &[String]) -> Result<()> {
    let exe = std::env::current_exe()?;
    println!(
        "{:>8} {:>9} {:<17} {:>9} {:>9} {:>9} {:>6}",
        "services", "ips", "mode", "sync ms", "pass ms", "peak MiB", "drift"
    );
    for &count in sizes {
        let sim = Sim::start(SimConfig {
            service_cluster_ip_ranges: vec!["10.96.0.0/12".parse()?, "fd00:10:96::/108".parse()?],
            watch_window: 1_000,
            ..SimConfig::default()
        })
        .await?;
        let ip_count = populate(&sim, count)?;
        let kubeconfig = sim.kubeconfig_path().display().to_string();
        for role in roles.iter().map(String::as_str) {
            let relist = role == "ipaddress-relist";
            if relist {
                sim.faults().inject(FaultRule::probability(
                    Some(Verb::Watch),
                    None,
                    1.0,
                    FaultKind::WatchGone,
                ));
                sim.clear_requests();
            }
            let output = Command::new(&exe)
                .args(["--child", &kubeconfig, role])
                .output()?;
            if relist {
                sim.faults().clear();
                println!(
                    "{:>8} # every watch answered 410 Gone for 15 s: {} Service and {} IPAddress LIST requests",
                    "",
                    sim.request_count("list", "services"),
                    sim.request_count("list", "ipaddresses"),
                );
            }
            if !output.status.success() {
                bail!(
                    "child {role} failed: {}\n{}",
                    output.status,
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            let line = String::from_utf8_lossy(&output.stdout);
            let result: serde_json::Value = serde_json::from_str(line.trim())
                .with_context(|| format!("child output {line:?}"))?;
            let num = |key: &str| result[key].as_f64().unwrap_or(f64::NAN);
            println!(
                "{:>8} {:>9} {:<17} {:>9.0} {:>9.1} {:>9.1} {:>6}",
                count,
                ip_count,
                role,
                num("sync_ms"),
                num("pass_ms"),
                num("peak_rss_mib"),
                result["drift"],
            );
            if let Some(memory) = result["memory"].as_str() {
                println!("{:>8} # {memory}", "");
            }
        }
        sim.shutdown().await;
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Child: one measurement.

async fn child(kubeconfig: &str, role: &str) -> Result<()> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    let client = kube::Client::try_from(config)?;
    let mode = match role {
        "ipaddress-warm" | "ipaddress-relist" => RepairMode::IpAddress,
        "audit-warm" => RepairMode::Audit,
        other => bail!("unknown role {other}"),
    };
    let mut registry = Registry::default();
    let settings = Settings {
        service_ranges: vec!["10.96.0.0/12".parse()?, "fd00:10:96::/108".parse()?],
        identity: "bench".to_owned(),
        ..Settings::default()
    };
    let repair = Arc::new(ClusterIpRepairLoop::new(
        client.clone(),
        clusterip_repair::Section {
            mode,
            page_size: page_size(),
            ..clusterip_repair::Section::default()
        },
        &settings,
        reconcilers::kubernetes_service::Section::default().service(),
        &mut registry,
    ));
    let ctx = PassContext::leading(client.clone(), true);
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} });
    if role == "ipaddress-relist" {
        // The parent answers every watch with 410 Gone, so the caches relist over and over and
        // are rarely synced: no passes, only the memory of relisting next to a full cache.
        tokio::time::sleep(Duration::from_secs(15)).await;
        println!(
            "{}",
            json!({"role": role, "sync_ms": f64::NAN, "pass_ms": f64::NAN,
                   "peak_rss_mib": peak_rss_mib(), "drift": 0})
        );
        return Ok(());
    }
    let started = Instant::now();
    loop {
        match repair.reconcile(&ctx).await {
            Ok(_) => break,
            Err(reconcilers::LoopError::NotSynced(_)) => {
                tokio::time::sleep(Duration::from_millis(5)).await
            }
            Err(err) => bail!("pass failed: {err}"),
        }
    }
    let sync_ms = ms(started.elapsed());
    let (rss_synced, peak_synced) = (rss_mib(), peak_rss_mib());
    let mut times = Vec::new();
    let mut drift = 0;
    for _ in 0..passes() {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        let report = repair.reconcile(&ctx).await?;
        times.push(ms(started.elapsed()));
        drift = report.drift.len();
    }
    let (services, ip_addresses) = repair.cache_bytes();
    let mib = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
    println!(
        "{}",
        json!({
            "role": role,
            "sync_ms": sync_ms,
            "pass_ms": median(times),
            "peak_rss_mib": peak_rss_mib(),
            "drift": drift,
            "memory": format!(
                "after the sync and first pass {rss_synced:.1} MiB resident (peak {peak_synced:.1}), \
                 after the passes {:.1}; the Service cache {:.1} MiB ({} B a record), the \
                 IPAddress cache {:.1} MiB ({} B a record)",
                rss_mib(),
                mib(services),
                std::mem::size_of::<reconcilers::service_cache::record::ServiceRecord>(),
                mib(ip_addresses),
                std::mem::size_of::<reconcilers::clusterip_repair::model::IpAddressRecord>(),
            ),
        })
    );
    Ok(())
}

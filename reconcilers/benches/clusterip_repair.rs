//! ClusterIP repair at scale: prints how long a full pass takes over 10,000 and 100,000 Services
//! (30 % dual-stack) against the API simulator, from a warm cache and from a fresh LIST, with
//! peak RSS, next to the floor: JSON-decoding the same LIST bodies into `serde::de::IgnoredAny`.
//! For fresh-LIST rows it also prints (stderr, as `#` lines) the transfer alone, each
//! collection's floor next to our compact decode, the decision alone, and 10 more passes each
//! measured right next to a floor: *paired* is the median of those per-pair ratios, which
//! compares a pass with a floor at the same moment of the VM (`benches/paired-ratios.py` pools
//! the pairs of several runs). Around each pair it probes every CPU's speed (`probes` lines):
//! each virtual CPU here runs at full or about half speed, independently of the other.
//!
//! `cargo bench -p bootstrap-reconcilers --bench clusterip_repair [-- --sizes 10000,100000] [--roles ipaddress-fresh,audit-fresh]`
//!
//! Environment: `BENCH_PAGE_SIZE=N` (LIST page size as configured, default 2000; IPAddresses
//! go three times as many per page), `BENCH_PLAIN_HTTP=1` (the simulator serves plain HTTP
//! instead of HTTPS), `BENCH_JSON=1` (the pass lists in JSON instead of protobuf),
//! `BENCH_PASSES=N` (only N passes, no floor or breakdown: for profiling), `BENCH_SETTLE_MS=N`
//! (the pause before each timed measurement, default 50), `BENCH_KUBE_LISTS=1` (LISTs go
//! through kube's client instead of the controller's LIST transport, `reconcilers::transport`),
//! `BENCH_FULL_SPEED_MS=T` (before each pair, wait up to 10 s for every CPU to probe at most
//! T ms: collects pairs at full speed), `BENCH_DECODE_LOOPS=N` (repeat the in-memory protobuf
//! decode of each collection N times instead of 5: for profiling the decoders).
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
use kube::api::ListParams;
use prometheus_client::registry::Registry;
use reconcilers::clusterip_repair::model::{
    IpAddressRecord, ListPage, ServiceCidrRecord, ServiceRecord,
};
use reconcilers::clusterip_repair::{ClusterIpRepair, ClusterIpRepairConfig, RepairMode};
use reconcilers::{PassContext, Reconciler};
use serde_json::json;

/// LIST page size of the pass (`ClusterIpRepairConfig::page_size`); `BENCH_PAGE_SIZE` overrides.
fn page_size() -> u32 {
    std::env::var("BENCH_PAGE_SIZE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(reconcilers::clusterip_repair::reflector::DEFAULT_PAGE_SIZE)
}
const PASSES: usize = 5;
/// Rounds of a fresh pass measured next to a floor.
const PAIRS: usize = 10;

/// `BENCH_PLAIN_HTTP=1`: the simulator serves plain HTTP instead of HTTPS.
fn plain_http() -> bool {
    std::env::var("BENCH_PLAIN_HTTP").is_ok_and(|v| v == "1")
}

/// The pass lists in protobuf (the default) unless `BENCH_JSON=1`.
fn list_protobuf() -> bool {
    !std::env::var("BENCH_JSON").is_ok_and(|v| v == "1")
}

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
    let sizes: Vec<usize> = match args.iter().position(|a| a == "--sizes") {
        Some(at) => args
            .get(at + 1)
            .context("--sizes N[,N...]")?
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()?,
        None => vec![10_000, 100_000],
    };
    let roles: Vec<String> = match args.iter().position(|a| a == "--roles") {
        Some(at) => args
            .get(at + 1)
            .context("--roles ROLE[,ROLE...]")?
            .split(',')
            .map(str::to_owned)
            .collect(),
        None => ROLES.iter().map(|r| (*r).to_owned()).collect(),
    };
    runtime.block_on(parent(&sizes, &roles))
}

const ROLES: [&str; 5] = [
    "ipaddress-warm",
    "ipaddress-relist",
    "ipaddress-fresh",
    "audit-warm",
    "audit-fresh",
];

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

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// A pause before each timed measurement: a pass hands its snapshot to a blocking thread to
/// free, and back to back the next measurement would share the cores with that (passes run
/// minutes apart in production).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(
        std::env::var("BENCH_SETTLE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(50),
    ))
    .await;
}

/// The floor: how long merely JSON-decoding `bodies` into `IgnoredAny` takes, in ms.
fn json_floor_ms(bodies: &[impl AsRef<str>]) -> Result<f64> {
    let started = Instant::now();
    for body in bodies {
        let _: serde::de::IgnoredAny = serde_json::from_str(body.as_ref())?;
    }
    Ok(ms(started.elapsed()))
}

/// The VM's speed, per CPU: how long the same JSON decode takes on a thread pinned to each
/// CPU, all CPUs at once. Each virtual CPU of these machines runs at full speed or at about half
/// of it, for seconds at a time and independently of the other: a floor (one thread) can run on
/// a fast CPU while the pass (both CPUs, and the simulator) runs half on a slow one. Probing
/// around each pair tells the pairs measured with every CPU at full speed
/// (`benches/paired-ratios.py`).
struct CpuProbe {
    body: Arc<String>,
    cpus: usize,
}

impl CpuProbe {
    fn new() -> Result<Self> {
        let services: Vec<serde_json::Value> =
            (0..100).map(|i| service_json(i, i % 10 < 3).0).collect();
        Ok(Self {
            body: Arc::new(serde_json::to_string(&services)?),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }

    /// With `BENCH_FULL_SPEED_MS=T`, probes again (for up to 10 s) until every CPU reads at
    /// most T ms, so that pairs at full speed, rare on this VM under load, can be collected on
    /// purpose; otherwise probes once. The last readings either way.
    async fn until_full_speed(&self) -> Vec<f64> {
        let limit: Option<f64> = std::env::var("BENCH_FULL_SPEED_MS")
            .ok()
            .and_then(|v| v.parse().ok());
        let started = Instant::now();
        loop {
            let readings = self.run();
            let slowest = readings.iter().copied().fold(0.0, f64::max);
            match limit {
                Some(limit) if slowest > limit && started.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                _ => return readings,
            }
        }
    }

    /// Milliseconds per CPU; NaN where the thread could not be pinned.
    fn run(&self) -> Vec<f64> {
        let threads: Vec<_> = (0..self.cpus)
            .map(|cpu| {
                let body = self.body.clone();
                std::thread::spawn(move || {
                    let mut set = nix::sched::CpuSet::new();
                    let pinned = set.set(cpu).is_ok()
                        && nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                            .is_ok();
                    if !pinned {
                        return f64::NAN;
                    }
                    let started = Instant::now();
                    for _ in 0..4 {
                        let _: serde::de::IgnoredAny =
                            serde_json::from_str(std::hint::black_box(&body)).unwrap();
                    }
                    ms(started.elapsed())
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|thread| thread.join().unwrap_or(f64::NAN))
            .collect()
    }
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
        "{:>8} {:>9} {:<15} {:>9} {:>10} {:>10} {:>10} {:>7} {:>9} {:>9} {:>6}",
        "services",
        "ips",
        "mode/source",
        "sync ms",
        "pass ms",
        "floor ms",
        "pass/floor",
        "paired",
        "MiB body",
        "peak MiB",
        "drift"
    );
    for &count in sizes {
        let sim = Sim::start(SimConfig {
            service_cluster_ip_ranges: vec!["10.96.0.0/12".parse()?, "fd00:10:96::/108".parse()?],
            watch_window: 1_000,
            plain_http: plain_http(),
            ..SimConfig::default()
        })
        .await?;
        let ip_count = populate(&sim, count)?;
        // The simulator encodes each object in protobuf on the first request for it (a one-off
        // of about 2 s at 100,000 Services that kube-apiserver does not have): pay it here, not
        // in the first child's sync.
        let client = sim.new_client().await?;
        for path in [
            reconcilers::clusterip_repair::reflector::SERVICES,
            reconcilers::clusterip_repair::reflector::IPADDRESSES,
        ] {
            let collection = reconcilers::clusterip_repair::reflector::Collection::new(path);
            reconcilers::clusterip_repair::reflector::fetch_raw_pages(&client, &collection).await?;
        }
        let kubeconfig = sim.kubeconfig_path().display().to_string();
        for role in roles.iter().map(String::as_str) {
            if role == "ipaddress-relist" {
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
            if role == "ipaddress-relist" {
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
            let floor = num("floor_ms");
            println!(
                "{:>8} {:>9} {:<15} {:>9.0} {:>10.1} {:>10.1} {:>10} {:>7} {:>9.1} {:>9.1} {:>6}",
                count,
                ip_count,
                role,
                num("sync_ms"),
                num("pass_ms"),
                floor,
                if floor.is_nan() {
                    "-".to_owned()
                } else {
                    format!("{:.2}x", num("pass_ms") / floor)
                },
                if num("paired_ratio").is_nan() {
                    "-".to_owned()
                } else {
                    format!("{:.2}x", num("paired_ratio"))
                },
                num("body_mib"),
                num("peak_rss_mib"),
                result["drift"],
            );
            for note in String::from_utf8_lossy(&output.stderr).lines() {
                println!("{:>8} # {note}", "");
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
    let client = kube::Client::try_from(config.clone())?;
    // LISTs go as the controller sends them (reconcilers::transport), or through kube's client
    // with BENCH_KUBE_LISTS=1.
    let list_client = if std::env::var("BENCH_KUBE_LISTS").is_ok_and(|v| v == "1") {
        client.clone()
    } else {
        reconcilers::transport::in_task_client(&config)?
            .context("the LIST transport does not cover this kubeconfig")?
    };
    let (mode, warm) = match role {
        "ipaddress-warm" | "ipaddress-relist" => (RepairMode::IpAddress, true),
        "ipaddress-fresh" => (RepairMode::IpAddress, false),
        "audit-warm" => (RepairMode::Audit, true),
        "audit-fresh" => (RepairMode::Audit, false),
        other => bail!("unknown role {other}"),
    };
    let mut registry = Registry::default();
    let repair = Arc::new(
        ClusterIpRepair::new(
            client.clone(),
            ClusterIpRepairConfig {
                mode,
                service_ranges: vec!["10.96.0.0/12".parse()?, "fd00:10:96::/108".parse()?],
                page_size: page_size(),
                list_protobuf: list_protobuf(),
                ..ClusterIpRepairConfig::default()
            },
            &mut registry,
        )?
        .with_list_client(list_client.clone()),
    );
    let ctx = PassContext {
        client: client.clone(),
        dry_run: true,
    };
    let mut sync_ms = f64::NAN;
    if role == "ipaddress-relist" {
        // The parent answers every watch with 410 Gone, so the caches relist over and over and
        // are rarely synced: no passes, only the memory of relisting next to a full cache.
        let mut triggers = futures::stream::select_all(repair.triggers());
        tokio::spawn(async move { while triggers.next().await.is_some() {} });
        tokio::time::sleep(Duration::from_secs(15)).await;
        println!(
            "{}",
            json!({"role": role, "sync_ms": f64::NAN, "pass_ms": f64::NAN, "floor_ms": f64::NAN,
                   "body_mib": f64::NAN, "peak_rss_mib": peak_rss_mib(), "drift": 0})
        );
        return Ok(());
    }
    if warm {
        let mut triggers = futures::stream::select_all(repair.triggers());
        tokio::spawn(async move { while triggers.next().await.is_some() {} });
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
        sync_ms = ms(started.elapsed());
    }
    let mut times = Vec::new();
    let mut drift = 0;
    let passes = std::env::var("BENCH_PASSES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(PASSES);
    // Profiling runs (BENCH_PASSES) with BENCH_FULL_SPEED_MS: each pass waits for full speed.
    let gate = (std::env::var("BENCH_PASSES").is_ok()
        && std::env::var("BENCH_FULL_SPEED_MS").is_ok())
    .then(CpuProbe::new)
    .transpose()?;
    for _ in 0..passes {
        if let Some(gate) = &gate {
            gate.until_full_speed().await;
        }
        settle().await;
        let started = Instant::now();
        let report = repair.reconcile(&ctx).await?;
        times.push(ms(started.elapsed()));
        drift = report.drift.len();
    }
    let peak_rss_mib = peak_rss_mib();
    let mut floor_ms = f64::NAN;
    let mut paired_ratio = f64::NAN;
    let mut body_mib = f64::NAN;
    if !warm && std::env::var("BENCH_PASSES").is_err() {
        // The same paged LIST bodies the pass decodes, fetched once, then only decoded.
        let mut paths: Vec<&'static str> = vec!["/api/v1/services"];
        if mode == RepairMode::IpAddress {
            paths.extend([
                "/apis/networking.k8s.io/v1/ipaddresses",
                "/apis/networking.k8s.io/v1/servicecidrs",
            ]);
        }
        let mut bodies = Vec::new();
        let mut paths_of_bodies = Vec::new();
        let fetch_started = Instant::now();
        for path in paths.iter().copied() {
            let mut token: Option<String> = None;
            loop {
                let mut params = ListParams::default().limit(
                    reconcilers::clusterip_repair::reflector::page_size_for(path, page_size()),
                );
                if let Some(t) = token.take() {
                    params = params.continue_token(&t);
                }
                let request = kube::core::Request::new(path).list(&params)?;
                let body = client.request_text(request).await?;
                let page: ListPage<serde::de::IgnoredAny> = serde_json::from_str(&body)?;
                bodies.push(body);
                paths_of_bodies.push(path);
                match page.metadata.continue_token.filter(|t| !t.is_empty()) {
                    Some(t) => token = Some(t),
                    None => break,
                }
            }
        }
        let _ = fetch_started;
        body_mib = bodies.iter().map(String::len).sum::<usize>() as f64 / (1024.0 * 1024.0);
        // The transfer alone, as the pass fetches (collections concurrently, each page requested
        // as soon as the previous one's continue token arrives), nothing decoded.
        let mut transfer = Vec::new();
        let mut raw_pages: Vec<Vec<bytes::Bytes>> = Vec::new();
        for _ in 0..PASSES {
            let started = Instant::now();
            let fetched = futures::future::try_join_all(paths.iter().map(|path| {
                let client = list_client.clone();
                let mut collection =
                    reconcilers::clusterip_repair::reflector::Collection::new(path)
                        .paged(page_size());
                collection.protobuf = list_protobuf();
                tokio::spawn(async move {
                    reconcilers::clusterip_repair::reflector::fetch_raw_pages(&client, &collection)
                        .await
                })
            }))
            .await?;
            transfer.push(ms(started.elapsed()));
            let pages: usize = fetched.iter().map(|r| r.as_ref().map_or(0, Vec::len)).sum();
            assert_eq!(pages, bodies.len(), "the raw fetch got every page");
            raw_pages = fetched.into_iter().collect::<Result<_, _>>()?;
        }
        let raw_mib = raw_pages
            .iter()
            .flatten()
            .map(bytes::Bytes::len)
            .sum::<usize>() as f64
            / (1024.0 * 1024.0);
        eprintln!(
            "transfer only, {} pages ({raw_mib:.1} MiB of {}) fetched as the pass fetches them, nothing decoded: {:.1} ms",
            bodies.len(),
            if list_protobuf() { "protobuf" } else { "JSON" },
            median(transfer)
        );
        let mut floors = Vec::new();
        for _ in 0..PASSES {
            floors.push(json_floor_ms(&bodies)?);
        }
        floor_ms = median(floors);
        // Per collection: the floor next to our compact decode of the same bodies (stderr).
        for path in paths_of_bodies
            .iter()
            .copied()
            .collect::<std::collections::BTreeSet<_>>()
        {
            let of_path: Vec<&String> = paths_of_bodies
                .iter()
                .zip(&bodies)
                .filter(|(p, _)| **p == path)
                .map(|(_, body)| body)
                .collect();
            let mut floors = Vec::new();
            let mut compact = Vec::new();
            let mut records = 0;
            for _ in 0..PASSES {
                floors.push(json_floor_ms(&of_path)?);
                let started = Instant::now();
                records = 0;
                for body in &of_path {
                    records += match path {
                        "/api/v1/services" => {
                            serde_json::from_str::<ListPage<ServiceRecord>>(body)?
                                .items
                                .len()
                        }
                        "/apis/networking.k8s.io/v1/ipaddresses" => {
                            serde_json::from_str::<ListPage<IpAddressRecord>>(body)?
                                .items
                                .len()
                        }
                        _ => serde_json::from_str::<ListPage<ServiceCidrRecord>>(body)?
                            .items
                            .len(),
                    };
                }
                compact.push(ms(started.elapsed()));
            }
            let mut from_protobuf = Vec::new();
            let pages = &raw_pages[paths.iter().position(|p| *p == path).unwrap()];
            if list_protobuf() {
                use reconcilers::clusterip_repair::protobuf::{ProtobufRecord, decode_list_into};
                // As the pass decodes: every page onto the end of one presized vector.
                fn decode_pages<T: ProtobufRecord>(
                    pages: &[bytes::Bytes],
                    per_page: u32,
                ) -> Result<usize> {
                    let mut all = Vec::<T>::with_capacity(pages.len() * per_page as usize);
                    for page in pages {
                        decode_list_into(page, &mut all)?;
                    }
                    Ok(all.len())
                }
                let loops = std::env::var("BENCH_DECODE_LOOPS")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(PASSES);
                for _ in 0..loops {
                    let started = Instant::now();
                    let per_page =
                        reconcilers::clusterip_repair::reflector::page_size_for(path, page_size());
                    let decoded = match path {
                        "/api/v1/services" => decode_pages::<ServiceRecord>(pages, per_page)?,
                        "/apis/networking.k8s.io/v1/ipaddresses" => {
                            decode_pages::<IpAddressRecord>(pages, per_page)?
                        }
                        _ => decode_pages::<ServiceCidrRecord>(pages, per_page)?,
                    };
                    from_protobuf.push(ms(started.elapsed()));
                    assert_eq!(
                        decoded, records,
                        "protobuf and JSON pages hold the same objects"
                    );
                }
            }
            let protobuf_note = if from_protobuf.is_empty() {
                String::new()
            } else {
                format!(
                    ", compact decode from protobuf {:.1} ms ({:.1} MiB)",
                    median(from_protobuf),
                    pages.iter().map(bytes::Bytes::len).sum::<usize>() as f64 / (1024.0 * 1024.0)
                )
            };
            eprintln!(
                "{path}: {records} records, JSON floor {:.1} ms, compact decode from JSON {:.1} ms{protobuf_note} (records dropped inside the timing)",
                median(floors),
                median(compact)
            );
        }
        // The VM's speed swings by up to 2x within seconds, so a pass and a floor measured
        // apart can compare a fast moment with a slow one. Here each pass is measured right
        // next to a floor (the order alternating), and the ratio is taken per pair.
        let mut pairs = Vec::new();
        let mut probes = Vec::new();
        let probe = CpuProbe::new()?;
        for round in 0..PAIRS {
            let floor = || json_floor_ms(&bodies);
            settle().await;
            let before = probe.until_full_speed().await;
            let floor_before = if round % 2 == 1 {
                settle().await;
                Some(floor()?)
            } else {
                None
            };
            settle().await;
            let started = Instant::now();
            repair.reconcile(&ctx).await?;
            let pass = ms(started.elapsed());
            settle().await;
            let floor = match floor_before {
                Some(floor) => floor,
                None => floor()?,
            };
            pairs.push((pass, floor));
            settle().await;
            let readings: Vec<f64> = before.into_iter().chain(probe.run()).collect();
            probes.push((
                readings.iter().copied().fold(f64::INFINITY, f64::min),
                readings.iter().copied().fold(0.0, f64::max),
            ));
        }
        let ratios: Vec<f64> = pairs.iter().map(|(pass, floor)| pass / floor).collect();
        paired_ratio = median(ratios.clone());
        let of_rounds = |parity: usize| {
            median(
                ratios
                    .iter()
                    .enumerate()
                    .filter(|(round, _)| round % 2 == parity)
                    .map(|(_, ratio)| *ratio)
                    .collect(),
            )
        };
        eprintln!(
            "paired, {PAIRS} rounds of a pass next to a floor: pass {:.1} ms, floor {:.1} ms (medians); pass/floor per pair: median {:.2}x ({:.2}x with the pass first, {:.2}x with the floor first), {:.2}x to {:.2}x",
            median(pairs.iter().map(|(pass, _)| *pass).collect()),
            median(pairs.iter().map(|(_, floor)| *floor).collect()),
            paired_ratio,
            of_rounds(0),
            of_rounds(1),
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
        eprintln!(
            "pairs (pass/floor ms, in order): {}",
            pairs
                .iter()
                .map(|(pass, floor)| format!("{pass:.1}/{floor:.1}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        eprintln!(
            "probes (fastest/slowest CPU ms around each pair, in order): {}",
            probes
                .iter()
                .map(|(fastest, slowest)| format!("{fastest:.2}/{slowest:.2}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        if mode == RepairMode::IpAddress {
            let started = Instant::now();
            let mut snapshot = reconcilers::clusterip_repair::Snapshot::list(
                &list_client,
                page_size(),
                list_protobuf(),
                None,
            )
            .await?;
            let listed = started.elapsed();
            let synced_ahead = snapshot.services_synced_ahead();
            let started = Instant::now();
            let decision = snapshot.decide(jiff::Timestamp::now(), Duration::from_secs(60));
            eprintln!(
                "snapshot list {:.1} ms ({synced_ahead} Services synced while listing), decide {:.1} ms ({} findings)",
                ms(listed),
                ms(started.elapsed()),
                decision.findings.len()
            );
        }
    }
    println!(
        "{}",
        json!({
            "role": role,
            "sync_ms": sync_ms,
            "pass_ms": median(times.clone()),
            "pass_ms_min": times.iter().copied().fold(f64::INFINITY, f64::min),
            "floor_ms": floor_ms,
            "paired_ratio": paired_ratio,
            "body_mib": body_mib,
            "peak_rss_mib": peak_rss_mib,
            "drift": drift,
        })
    );
    Ok(())
}

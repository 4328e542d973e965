//! Management mode at scale: one real `bootstrap-controller run` keeps the bootstrap state of
//! 10, 100 and 1,000 tenant clusters, each a simulator of an in-process [`Fleet`] whose
//! management cluster holds one kubeconfig Secret per tenant. Every loop is on. Per fleet size:
//! - time from the controller's start until every tenant has the four system namespaces and the
//!   `kubernetes` Service (seen through the backdoor, so watching costs the controller nothing);
//! - the controller's resident memory, and what each further tenant adds;
//! - requests per minute at rest, summed over the fleet, reads and writes per verb (reads of API
//!   objects should be none: watches keep the caches current);
//! - how long a system namespace deleted in a random tenant stays gone (backdoor polled every
//!   millisecond).
//!
//! `cargo bench -p e2e --bench multi_tenant -- [--tenants 10,100,1000] [--rest-secs 60]
//! [--heal-trials 100] [--converge-timeout-secs 600] [--controller PATH]`
//! (`MULTI_TENANT_SIZES=10,100` also chooses the sizes).

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use apiserver_sim::{Fleet, FleetConfig, RequestRecord, Sim, SimConfig, TENANT_LABEL};
use common::{ControllerProcess, controller_bin, percentile};

const SYSTEM_NAMESPACES: [&str; 4] = ["default", "kube-system", "kube-public", "kube-node-lease"];

/// Resources whose open watch streams are reported (those the loops can watch).
const WATCHED: [&str; 8] = [
    "namespaces",
    "services",
    "endpoints",
    "endpointslices",
    "leases",
    "ipaddresses",
    "servicecidrs",
    "events",
];

struct Args {
    sizes: Vec<usize>,
    rest: Duration,
    heal_trials: usize,
    converge_timeout: Duration,
    controller: PathBuf,
}

fn parse_sizes(list: &str) -> Result<Vec<usize>> {
    list.split(',')
        .map(|n| {
            n.trim()
                .parse()
                .with_context(|| format!("{n:?} is not a number of tenants"))
        })
        .collect()
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        sizes: match std::env::var("MULTI_TENANT_SIZES") {
            Ok(list) => parse_sizes(&list)?,
            Err(_) => vec![10, 100, 1000],
        },
        rest: Duration::from_secs(60),
        heal_trials: 100,
        converge_timeout: Duration::from_secs(600),
        controller: controller_bin(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().context("flag needs a value");
        match flag.as_str() {
            "--tenants" => args.sizes = parse_sizes(&value()?)?,
            "--rest-secs" => args.rest = Duration::from_secs(value()?.parse()?),
            "--heal-trials" => args.heal_trials = value()?.parse()?,
            "--converge-timeout-secs" => {
                args.converge_timeout = Duration::from_secs(value()?.parse()?)
            }
            "--controller" => args.controller = PathBuf::from(value()?),
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

/// What one fleet size measured; `None` where the run did not get that far.
#[derive(Default)]
struct Row {
    tenants: usize,
    converged: Option<Duration>,
    rss_kib: Option<u64>,
    reads_per_min: Option<f64>,
    writes_per_min: Option<f64>,
    heal: Vec<Duration>,
}

fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .context("no VmRSS")
}

fn own_rss_kib() -> u64 {
    rss_kib(std::process::id()).unwrap_or_default()
}

/// Whether a tenant has what the controller must create: the system namespaces (not being
/// deleted) and the `kubernetes` Service.
fn converged(sim: &Sim) -> bool {
    let backdoor = sim.backdoor();
    SYSTEM_NAMESPACES.iter().all(|ns| {
        backdoor
            .get("namespaces", "", ns)
            .ok()
            .flatten()
            .is_some_and(|o| o["metadata"]["deletionTimestamp"].is_null())
    }) && backdoor
        .get("services", "default", "kubernetes")
        .ok()
        .flatten()
        .is_some()
}

/// Polls every tenant through the backdoor until all have converged; returns when each did,
/// counted from `started`, or the tenants still pending at the timeout.
async fn wait_converged(
    fleet: &Fleet,
    controller: &mut ControllerProcess,
    started: Instant,
    timeout: Duration,
) -> Result<std::result::Result<Vec<Duration>, usize>> {
    let mut pending: Vec<usize> = (0..fleet.tenants().len()).collect();
    let mut at = vec![Duration::ZERO; pending.len()];
    while !pending.is_empty() {
        if !controller.is_running() {
            bail!("the controller exited:\n{}", tail(&controller.log(), 40));
        }
        if started.elapsed() > timeout {
            return Ok(Err(pending.len()));
        }
        pending.retain(|&i| {
            let done = converged(&fleet.tenants()[i]);
            if done {
                at[i] = started.elapsed();
            }
            !done
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(Ok(at))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `verb resource` (or `verb path` for non-resource requests, e.g. health probes).
fn kind_of(r: &RequestRecord) -> String {
    match (r.resource.is_empty(), r.subresource.is_empty()) {
        (true, _) => format!("{} {}", r.verb, r.path),
        (false, true) => format!("{} {}", r.verb, r.resource),
        (false, false) => format!("{} {}/{}", r.verb, r.resource, r.subresource),
    }
}

fn is_read(r: &RequestRecord) -> bool {
    !r.resource.is_empty() && matches!(r.verb.as_str(), "get" | "list")
}

fn is_write(r: &RequestRecord) -> bool {
    matches!(
        r.verb.as_str(),
        "create" | "update" | "patch" | "delete" | "deletecollection"
    )
}

/// Clears every request log, waits `window`, and prints what the controller asked of the
/// tenants (summed) and of the management cluster; returns (reads, writes) per minute over
/// the tenants.
async fn at_rest(fleet: &Fleet, window: Duration) -> (f64, f64) {
    fleet.management().clear_requests();
    for t in fleet.tenants() {
        t.clear_requests();
    }
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let minutes = started.elapsed().as_secs_f64() / 60.0;
    let mut tenants: BTreeMap<String, usize> = BTreeMap::new();
    let (mut reads, mut writes) = (0, 0);
    for t in fleet.tenants() {
        for r in t.requests() {
            reads += usize::from(is_read(&r));
            writes += usize::from(is_write(&r));
            *tenants.entry(kind_of(&r)).or_default() += 1;
        }
    }
    let mut management: BTreeMap<String, usize> = BTreeMap::new();
    for r in fleet.management().requests() {
        *management.entry(kind_of(&r)).or_default() += 1;
    }
    let per_min = |n: usize| n as f64 / minutes;
    println!(
        "  at rest over {:.0} s, all {} tenants together:",
        started.elapsed().as_secs_f64(),
        fleet.tenants().len()
    );
    for (what, n) in &tenants {
        println!("    {:>9.1}/min  {what}", per_min(*n));
    }
    if tenants.is_empty() {
        println!("    (no requests)");
    }
    println!("  at rest, management cluster:");
    for (what, n) in &management {
        println!("    {:>9.1}/min  {what}", per_min(*n));
    }
    if management.is_empty() {
        println!("    (no requests)");
    }
    let mut watching: BTreeMap<&str, usize> = BTreeMap::new();
    for resource in WATCHED {
        let open: usize = fleet
            .tenants()
            .iter()
            .map(|t| t.open_watches(resource))
            .sum();
        if open > 0 {
            watching.insert(resource, open);
        }
    }
    println!("  open watch streams over the tenants at the end: {watching:?}");
    println!(
        "  at rest: {:.1} reads/min{}, {:.1} writes/min over the tenants",
        per_min(reads),
        if reads == 0 {
            ""
        } else {
            " (expected none: watches should keep the caches current)"
        },
        per_min(writes)
    );
    (per_min(reads), per_min(writes))
}

/// A small xorshift generator: which tenant and namespace to break next need no statistics.
struct Random(u64);

impl Random {
    fn seeded() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        Random(0x9E37_79B9_7F4A_7C15 ^ u64::from(nanos))
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

/// Deletes a random system namespace in a random tenant through the backdoor (gone at once,
/// a DELETED watch event), then polls the backdoor every millisecond until it is back.
async fn heal_latencies(fleet: &Fleet, trials: usize) -> Result<Vec<Duration>> {
    let mut random = Random::seeded();
    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        let tenant = random.below(fleet.tenants().len());
        let namespace = SYSTEM_NAMESPACES[random.below(SYSTEM_NAMESPACES.len())];
        let sim = &fleet.tenants()[tenant];
        sim.backdoor()
            .delete("namespaces", "", namespace)
            .with_context(|| format!("trial {trial}: deleting {namespace} in tenant {tenant}"))?;
        let gone = Instant::now();
        loop {
            if sim
                .backdoor()
                .get("namespaces", "", namespace)?
                .is_some_and(|o| o["metadata"]["deletionTimestamp"].is_null())
            {
                samples.push(gone.elapsed());
                break;
            }
            if gone.elapsed() > Duration::from_secs(120) {
                bail!("trial {trial}: {namespace} in tenant {tenant} not recreated within 120 s");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // Let the controller's confirming pass see a clean state before the next break.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(samples)
}

fn tenant_config() -> SimConfig {
    SimConfig {
        // Namespaces vanish at once: the heal figure is the controller's, not the simulated
        // namespace controller's.
        namespace_finalize_delay: Duration::ZERO,
        // kube-apiserver sends a bookmark about once a minute; one a second on every watch of
        // 1,000 clusters would be load no real fleet has.
        bookmark_interval: Duration::from_secs(60),
        // kube-apiserver 1.33+ creates it, as the apiserver-sim binary does.
        default_service_cidr: true,
        ..SimConfig::default()
    }
}

async fn run_size(args: &Args, tenants: usize) -> Result<Row> {
    let mut row = Row {
        tenants,
        ..Row::default()
    };
    let before = own_rss_kib();
    let t = Instant::now();
    let fleet = Fleet::start(FleetConfig {
        tenants,
        management: SimConfig {
            bookmark_interval: Duration::from_secs(60),
            ..SimConfig::default()
        },
        tenant: tenant_config(),
        ..FleetConfig::default()
    })
    .await?;
    println!(
        "{tenants} tenants: fleet started in {:.2?} (simulators' RSS +{:.1} MiB)",
        t.elapsed(),
        own_rss_kib().saturating_sub(before) as f64 / 1024.0
    );
    let selector = format!("{TENANT_LABEL}=true");
    let started = Instant::now();
    let mut controller = ControllerProcess::start_binary(
        &args.controller,
        fleet.management().kubeconfig_path(),
        &[
            "--tenants-secret-selector",
            &selector,
            "--tenants-namespace",
            fleet.namespace(),
            "--service-cluster-ip-range",
            "10.96.0.0/12",
            "--advertise-address",
            "192.0.2.10",
            "--leader-elect=false",
        ],
    )?;
    let at = match wait_converged(&fleet, &mut controller, started, args.converge_timeout).await? {
        Ok(at) => at,
        Err(pending) => {
            println!(
                "  NOT converged: {pending} of {tenants} tenants still missing system namespaces or \
                 the kubernetes Service after {:.0?}; controller log tail:\n{}",
                args.converge_timeout,
                tail(&controller.log(), 20)
            );
            fleet.shutdown().await;
            return Ok(row);
        }
    };
    let all = started.elapsed();
    row.converged = Some(all);
    let mut sorted = at;
    sorted.sort();
    println!(
        "  converged: every tenant after {:.2} s (per tenant: p50 {:.2} s, p99 {:.2} s, first {:.2} s)",
        all.as_secs_f64(),
        percentile(&sorted, 50.0).as_secs_f64(),
        percentile(&sorted, 99.0).as_secs_f64(),
        sorted.first().copied().unwrap_or_default().as_secs_f64()
    );
    let pid = controller.pid().context("controller not running")?;
    println!(
        "  controller RSS when converged: {:.1} MiB",
        rss_kib(pid)? as f64 / 1024.0
    );
    // Past start-up: the first passes' confirmations and the events they write are done.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let (reads, writes) = at_rest(&fleet, args.rest).await;
    row.reads_per_min = Some(reads);
    row.writes_per_min = Some(writes);
    let rss = rss_kib(pid)?;
    row.rss_kib = Some(rss);
    println!(
        "  controller RSS at rest: {:.1} MiB ({:.1} KiB per tenant)",
        rss as f64 / 1024.0,
        rss as f64 / tenants.max(1) as f64
    );
    if args.heal_trials > 0 {
        row.heal = heal_latencies(&fleet, args.heal_trials).await?;
        common::summary(
            "  heal of a system namespace in a random tenant",
            row.heal.clone(),
        );
    }
    if !controller.is_running() {
        println!(
            "  the controller exited during the run:\n{}",
            tail(&controller.log(), 20)
        );
    }
    controller.terminate().ok();
    fleet.shutdown().await;
    Ok(row)
}

fn print_table(rows: &[Row]) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!();
    println!(
        "{:>8} {:>12} {:>9} {:>10} {:>11} {:>9} {:>9}",
        "tenants", "converge s", "RSS MiB", "reads/min", "writes/min", "heal p50", "heal p99"
    );
    for r in rows {
        let mut heal = r.heal.clone();
        heal.sort();
        let ms = |p: f64| {
            if heal.is_empty() {
                "-".to_string()
            } else {
                format!("{:.1}ms", percentile(&heal, p).as_secs_f64() * 1000.0)
            }
        };
        println!(
            "{:>8} {:>12} {:>9} {:>10} {:>11} {:>9} {:>9}",
            r.tenants,
            opt(r.converged.map(|d| d.as_secs_f64()), 2),
            opt(r.rss_kib.map(|k| k as f64 / 1024.0), 1),
            opt(r.reads_per_min, 1),
            opt(r.writes_per_min, 1),
            ms(50.0),
            ms(99.0),
        );
    }
    let measured: Vec<(usize, u64)> = rows
        .iter()
        .filter_map(|r| r.rss_kib.map(|k| (r.tenants, k)))
        .collect();
    if let (Some(&(n0, k0)), Some(&(n1, k1))) = (
        measured.iter().min_by_key(|(n, _)| *n),
        measured.iter().max_by_key(|(n, _)| *n),
    ) && n1 > n0
    {
        println!(
            "memory per further tenant: (RSS at {n1} - RSS at {n0}) / {} = {:.1} KiB",
            n1 - n0,
            (k1 as f64 - k0 as f64) / (n1 - n0) as f64
        );
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    println!(
        "multi_tenant: {} in management mode, fleets of {:?} tenants, {} s at rest, {} heal trials",
        args.controller.display(),
        args.sizes,
        args.rest.as_secs(),
        args.heal_trials
    );
    let mut rows = Vec::new();
    for &tenants in &args.sizes {
        rows.push(run_size(&args, tenants).await?);
    }
    print_table(&rows);
    Ok(())
}

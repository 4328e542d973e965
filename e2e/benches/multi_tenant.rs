//! Management mode at scale: one real `bootstrap-controller run` keeps the bootstrap state of
//! 10 to 10,000 tenant clusters, each a simulator of an in-process [`Fleet`] whose
//! management cluster holds one kubeconfig Secret per tenant. Every loop is on. Per fleet size:
//! - time from the controller's start until every tenant has the four system namespaces and the
//!   `kubernetes` Service (seen through the backdoor, so watching costs the controller nothing);
//! - the controller's resident memory, and what each further tenant adds;
//! - requests per minute at rest, summed over the fleet, reads and writes per verb (reads of API
//!   objects should be none: watches keep the caches current);
//! - how long a system namespace deleted in a random tenant stays gone (backdoor polled every
//!   millisecond), and the controller's CPU time over those trials.
//!
//! `cargo bench -p e2e --bench multi_tenant -- [--tenants 10,100,1000] [--rest-secs 60]
//! [--heal-trials 100] [--converge-timeout-secs 600] [--controller PATH] [--config FILE]
//! [--wait-for all|namespaces|started]`
//! (`MULTI_TENANT_SIZES=10,100` also chooses the sizes).
//! The fleet's simulators are behind one shared TLS listener, each tenant's kubeconfig naming its
//! own `tls-server-name`, and the bench reads them in-process (the backdoor), so a tenant costs
//! this process one descriptor at rest: its end of the controller's connection. The bench raises
//! its open-file limit to what its largest fleet needs (one and a half a tenant and 1,024), past
//! the hard limit too where it may (`CAP_SYS_RESOURCE`); otherwise it says which `ulimit -n` to
//! run.
//!
//! `--config FILE` is passed to the controller (e.g. loops switched off, to see what a tenant's
//! memory is made of); `--wait-for` then says what "converged" means: `all` (default) the system
//! namespaces and the `kubernetes` Service, `namespaces` the namespaces only, `started` every
//! tenant running (`bootstrap_tenants{state="running"}` on the admin port), for a configuration
//! that creates nothing. Heal trials need the namespaces loop.
//!
//! Isolation (`--isolation N [--bad-percent 10]`, instead of the sizes): two fleets of N tenants,
//! each with its own controller process, measured the same way one after the other: first all
//! healthy, then with a share of bad tenants, every other one bad from the start and the others
//! turning bad once the healthy ones have converged (answering every API request 503; delaying
//! every request 2 s; dropping every connection; answering every watch 410 Expired, so each
//! re-watch is a re-list; accepting requests and never answering; answering lists with an
//! endless body; sending a 10 MiB watch event; answering lists with small pages whose `continue`
//! token never ends, its watches expiring; streaming new objects on every watch for ever). Both
//! runs delete namespaces only in the same healthy tenants,
//! `--heal-trials` times, and print heal p50/p99, the controller's CPU time in the heal window
//! and the ratio of the two runs. After the second, the bad tenants' Secrets are deleted and the
//! controller's RSS 30 s later is compared with the all-healthy run's.
//!
//! Cache budget (`--large N`, instead of the sizes): three tenants, one of them holding N
//! Services with their IPAddresses, twice: under the default budget (the large one is paused,
//! with a `TenantOverBudget` event) and under a budget raised for it in the configuration file
//! (it converges and heals); prints RSS, what its caches hold and its heal figures.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use apiserver_sim::{
    FaultKind, FaultRule, Fleet, FleetConfig, RequestRecord, Sim, SimConfig, TENANT_LABEL, Verb,
};
use common::{ControllerProcess, controller_bin, percentile, rss_kib};

const SYSTEM_NAMESPACES: [&str; 4] = ["default", "kube-system", "kube-public", "kube-node-lease"];

/// Resources whose open watch streams are reported: those the loops can watch, and events.
const WATCHED: [&str; 8] = {
    let [a, b, c, d, e, f, g] = common::LOOP_WATCHED;
    [a, b, c, d, e, f, g, "events"]
};

/// What a fleet must show before it counts as converged.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum WaitFor {
    /// The system namespaces and the `kubernetes` Service in every tenant.
    All,
    /// The system namespaces only (the Service loop is off).
    Namespaces,
    /// Every tenant running in the controller (no loop creates anything).
    Started,
}

#[derive(Clone)]
struct Args {
    sizes: Vec<usize>,
    rest: Duration,
    heal_trials: usize,
    converge_timeout: Duration,
    controller: PathBuf,
    config: Option<PathBuf>,
    wait_for: WaitFor,
    /// Fleet size of the isolation scenario; `None`: the sizes are run instead.
    isolation: Option<usize>,
    /// Services of the one large tenant of the budget scenario (`--large N`).
    large: Option<usize>,
    bad_percent: usize,
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
        controller: PathBuf::new(),
        config: None,
        wait_for: WaitFor::All,
        isolation: None,
        large: None,
        bad_percent: 10,
    };
    let mut controller = None;
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
            "--controller" => controller = Some(PathBuf::from(value()?)),
            "--config" => args.config = Some(PathBuf::from(value()?)),
            "--wait-for" => {
                args.wait_for = match value()?.as_str() {
                    "all" => WaitFor::All,
                    "namespaces" => WaitFor::Namespaces,
                    "started" => WaitFor::Started,
                    other => bail!("--wait-for {other}: expected all, namespaces or started"),
                }
            }
            "--isolation" => args.isolation = Some(value()?.parse()?),
            "--large" => args.large = Some(value()?.parse()?),
            "--bad-percent" => args.bad_percent = value()?.parse()?,
            // cargo bench passes --bench to every bench binary.
            "--bench" => {}
            other => bail!("unknown argument {other}"),
        }
    }
    // The binary beside the bench is looked for (and its absence reported) only when no other
    // is named.
    args.controller = controller.unwrap_or_else(controller_bin);
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
    sockets: Option<usize>,
    heal: Vec<Duration>,
}

/// The process's CPU time so far (user + system), from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) in parentheses; utime and stime are
    // fields 14 and 15 of the line, 12 and 13 after it.
    let after = stat.rsplit_once(')').context("no command name")?.1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields.get(11).context("no utime")?.parse::<u64>()?
        + fields.get(12).context("no stime")?.parse::<u64>()?;
    Ok(Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64))
}

fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// Open sockets of the process (its connections to the tenants, the management cluster and the
/// admin listener), from `/proc/<pid>/fd`.
fn sockets(pid: u32) -> Result<usize> {
    Ok(std::fs::read_dir(format!("/proc/{pid}/fd"))?
        .filter_map(|e| e.ok())
        .filter(|e| {
            std::fs::read_link(e.path())
                .is_ok_and(|target| target.to_string_lossy().starts_with("socket:"))
        })
        .count())
}

fn own_rss_kib() -> u64 {
    rss_kib(std::process::id()).unwrap_or_default()
}

/// Whether a tenant has what the controller must create: the system namespaces (not being
/// deleted) and, unless `namespaces_only`, the `kubernetes` Service.
fn converged(sim: &Sim, namespaces_only: bool) -> bool {
    let backdoor = sim.backdoor();
    SYSTEM_NAMESPACES.iter().all(|ns| {
        backdoor
            .get("namespaces", "", ns)
            .ok()
            .flatten()
            .is_some_and(|o| o["metadata"]["deletionTimestamp"].is_null())
    }) && (namespaces_only
        || backdoor
            .get("services", "default", "kubernetes")
            .ok()
            .flatten()
            .is_some())
}

/// `bootstrap_tenants{state="running"}` from the controller's admin port.
async fn running_tenants(controller: &ControllerProcess) -> Option<usize> {
    let (status, body) = controller.admin_get("/metrics").await.ok()?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find(|l| l.starts_with("bootstrap_tenants{") && l.contains("state=\"running\""))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as usize)
}

/// Wall time spent in [`wait_converged`]'s polling rounds (one thread, so about their CPU time).
static POLLING_NANOS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Polls the tenants `which` through the backdoor until all have converged; returns when each
/// did, counted from `started`, or the tenants still pending at the timeout. With
/// [`WaitFor::Started`], waits for the controller to run them all instead (every tenant then
/// gets the same time).
async fn wait_converged(
    fleet: &Fleet,
    which: &[usize],
    wait_for: WaitFor,
    controller: &mut ControllerProcess,
    started: Instant,
    timeout: Duration,
) -> Result<std::result::Result<Vec<Duration>, usize>> {
    if wait_for == WaitFor::Started {
        loop {
            if !controller.is_running() {
                bail!("the controller exited:\n{}", tail(&controller.log(), 40));
            }
            let running = running_tenants(controller).await.unwrap_or(0);
            if running >= fleet.tenants().len() {
                return Ok(Ok(vec![started.elapsed(); which.len()]));
            }
            if started.elapsed() > timeout {
                return Ok(Err(fleet.tenants().len() - running));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let namespaces_only = wait_for == WaitFor::Namespaces;
    let mut pending: Vec<usize> = which.to_vec();
    let mut at = vec![Duration::ZERO; fleet.tenants().len()];
    // A tenant is looked at again only once its resourceVersion moved: most rounds, most pending
    // tenants have not changed since the last.
    let mut looked_at = vec![None; fleet.tenants().len()];
    while !pending.is_empty() {
        if !controller.is_running() {
            bail!("the controller exited:\n{}", tail(&controller.log(), 40));
        }
        if started.elapsed() > timeout {
            return Ok(Err(pending.len()));
        }
        let round = Instant::now();
        pending.retain(|&i| {
            let sim = &fleet.tenants()[i];
            let version = Some(sim.resource_version());
            if looked_at[i] == version {
                return true;
            }
            looked_at[i] = version;
            let done = converged(sim, namespaces_only);
            if done {
                at[i] = started.elapsed();
            }
            !done
        });
        POLLING_NANOS.fetch_add(
            u64::try_from(round.elapsed().as_nanos()).unwrap_or(u64::MAX),
            std::sync::atomic::Ordering::Relaxed,
        );
        // A round over 10,000 pending tenants can take tens of milliseconds here: polling every
        // 20 ms would take this process a core from the simulators the controller is waiting
        // for. Polling takes at most a fifth of the time instead, the instants a little coarser.
        tokio::time::sleep(Duration::from_millis(20).max(round.elapsed() * 4)).await;
    }
    Ok(Ok(which.iter().map(|&i| at[i]).collect()))
}

/// Ends a run: says whether the controller exited during it (with its last log lines), stops
/// it, and shuts the fleet down.
async fn stop(mut controller: ControllerProcess, fleet: Fleet) {
    if !controller.is_running() {
        println!(
            "  the controller exited during the run:\n{}",
            tail(&controller.log(), 20)
        );
    }
    controller.terminate().ok();
    fleet.shutdown().await;
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

/// Deletes a random system namespace in a random tenant of `which` through the backdoor (gone
/// at once, a DELETED watch event), then polls the backdoor every millisecond until it is back.
async fn heal_latencies(fleet: &Fleet, which: &[usize], trials: usize) -> Result<Vec<Duration>> {
    let mut random = Random::seeded();
    let mut samples = Vec::with_capacity(trials);
    for trial in 0..trials {
        let tenant = which[random.below(which.len())];
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

async fn start_fleet(tenants: usize) -> Result<Fleet> {
    let before = own_rss_kib();
    let t = Instant::now();
    let fleet = Fleet::start(FleetConfig {
        tenants,
        management: SimConfig {
            bookmark_interval: Duration::from_secs(60),
            ..SimConfig::default()
        },
        tenant: tenant_config(),
        shared_listener: true,
        ..FleetConfig::default()
    })
    .await?;
    println!(
        "{tenants} tenants: fleet started in {:.2?} (simulators' RSS +{:.1} MiB)",
        t.elapsed(),
        own_rss_kib().saturating_sub(before) as f64 / 1024.0
    );
    Ok(fleet)
}

fn start_controller(args: &Args, fleet: &Fleet) -> Result<ControllerProcess> {
    let selector = format!("{TENANT_LABEL}=true");
    let config = args
        .config
        .as_ref()
        .map(|p| p.to_string_lossy().into_owned());
    let mut extra = vec![
        "--tenants-secret-selector",
        &selector,
        "--tenants-namespace",
        fleet.namespace(),
        "--service-cluster-ip-range",
        "10.96.0.0/12",
        "--advertise-address",
        "192.0.2.10",
        "--leader-elect=false",
    ];
    if let Some(config) = &config {
        extra.extend(["--config", config.as_str()]);
    }
    ControllerProcess::start_binary(
        &args.controller,
        fleet.management().kubeconfig_path(),
        &extra,
    )
}

/// Starts the controller on `fleet` and waits until the tenants `which` converged; `None` (after
/// saying so) if they did not in time.
async fn converge(
    args: &Args,
    fleet: &Fleet,
    which: &[usize],
) -> Result<Option<(ControllerProcess, Duration)>> {
    let own_cpu0 = cpu_time(std::process::id()).unwrap_or_default();
    let polling0 = POLLING_NANOS.load(std::sync::atomic::Ordering::Relaxed);
    let started = Instant::now();
    let mut controller = start_controller(args, fleet)?;
    let waited = wait_converged(
        fleet,
        which,
        args.wait_for,
        &mut controller,
        started,
        args.converge_timeout,
    )
    .await?;
    // Where start-up time goes: the controller's CPU, and this process's (the simulators
    // answering it, and the polling).
    let wall = started.elapsed();
    let controller_cpu = controller
        .pid()
        .and_then(|pid| cpu_time(pid).ok())
        .unwrap_or_default();
    let own_cpu = cpu_time(std::process::id())
        .unwrap_or_default()
        .saturating_sub(own_cpu0);
    let polling = Duration::from_nanos(
        POLLING_NANOS
            .load(std::sync::atomic::Ordering::Relaxed)
            .saturating_sub(polling0),
    );
    let share = |d: Duration| 100.0 * d.as_secs_f64() / wall.as_secs_f64();
    println!(
        "  CPU from the controller's start over {:.1} s: controller {:.1} s ({:.0} % of one \
         core); this process {:.1} s ({:.0} %), of which polling about {:.1} s",
        wall.as_secs_f64(),
        controller_cpu.as_secs_f64(),
        share(controller_cpu),
        own_cpu.as_secs_f64(),
        share(own_cpu),
        polling.as_secs_f64()
    );
    let at = match waited {
        Ok(at) => at,
        Err(pending) => {
            println!(
                "  NOT converged ({:?}): {pending} of {} tenants still pending after {:.0?}; \
                 controller log tail:\n{}",
                args.wait_for,
                which.len(),
                args.converge_timeout,
                tail(&controller.log(), 20)
            );
            controller.terminate().ok();
            return Ok(None);
        }
    };
    let all = started.elapsed();
    let mut sorted = at;
    sorted.sort();
    println!(
        "  converged ({:?}, {} tenants): all after {:.2} s (per tenant: p50 {:.2} s, p99 {:.2} s, \
         first {:.2} s)",
        args.wait_for,
        which.len(),
        all.as_secs_f64(),
        percentile(&sorted, 50.0).as_secs_f64(),
        percentile(&sorted, 99.0).as_secs_f64(),
        sorted.first().copied().unwrap_or_default().as_secs_f64()
    );
    Ok(Some((controller, all)))
}

/// Heal trials in the tenants `which`, with the controller's CPU time over them.
async fn heal_window(
    fleet: &Fleet,
    pid: u32,
    which: &[usize],
    trials: usize,
    label: &str,
) -> Result<(Vec<Duration>, Duration, Duration)> {
    let cpu0 = cpu_time(pid)?;
    let t = Instant::now();
    let heal = heal_latencies(fleet, which, trials).await?;
    let wall = t.elapsed();
    let cpu = cpu_time(pid)?.saturating_sub(cpu0);
    common::summary(label, heal.clone());
    println!(
        "  controller CPU over the {:.1} s of heal trials: {:.2} s ({:.1} % of one core)",
        wall.as_secs_f64(),
        cpu.as_secs_f64(),
        100.0 * cpu.as_secs_f64() / wall.as_secs_f64()
    );
    Ok((heal, cpu, wall))
}

async fn run_size(args: &Args, tenants: usize) -> Result<Row> {
    let mut row = Row {
        tenants,
        ..Row::default()
    };
    let fleet = start_fleet(tenants).await?;
    let all: Vec<usize> = (0..tenants).collect();
    let Some((controller, converged)) = converge(args, &fleet, &all).await? else {
        fleet.shutdown().await;
        return Ok(row);
    };
    row.converged = Some(converged);
    let pid = controller.pid().context("controller not running")?;
    println!(
        "  controller RSS when converged: {:.1} MiB",
        rss_kib(pid)? as f64 / 1024.0
    );
    // Past start-up: the first passes' confirmations and the events they write are done.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let cpu0 = cpu_time(pid)?;
    let (reads, writes) = at_rest(&fleet, args.rest).await;
    let cpu = cpu_time(pid)?.saturating_sub(cpu0);
    row.reads_per_min = Some(reads);
    row.writes_per_min = Some(writes);
    let rss = rss_kib(pid)?;
    row.rss_kib = Some(rss);
    let open = sockets(pid)?;
    row.sockets = Some(open);
    println!(
        "  controller at rest: RSS {:.1} MiB ({:.1} KiB per tenant), {open} open sockets, \
         CPU {:.2} s over the {:.0} s window",
        rss as f64 / 1024.0,
        rss as f64 / tenants.max(1) as f64,
        cpu.as_secs_f64(),
        args.rest.as_secs_f64()
    );
    if args.heal_trials > 0 && args.wait_for != WaitFor::Started {
        row.heal = heal_window(
            &fleet,
            pid,
            &all,
            args.heal_trials,
            "  heal of a system namespace in a random tenant",
        )
        .await?
        .0;
    }
    stop(controller, fleet).await;
    Ok(row)
}

/// The ways a bad tenant misbehaves, one after the other over the bad tenants.
const BAD_KINDS: [&str; 9] = [
    "503",
    "latency 2 s",
    "drop connection",
    "watch 410",
    "never answers",
    "endless list",
    "10 MiB watch event",
    "endless pages",
    "endless new objects",
];

fn make_bad(sim: &Sim, kind: &str) {
    let every = |verb: Option<Verb>, fault: FaultKind| {
        sim.faults()
            .inject(FaultRule::probability(verb, None, 1.0, fault));
    };
    match kind {
        "503" => every(
            None,
            FaultKind::Error {
                code: 503,
                retry_after_seconds: None,
            },
        ),
        "latency 2 s" => every(None, FaultKind::Latency { millis: 2000 }),
        "drop connection" => every(None, FaultKind::DropConnection),
        "watch 410" => every(Some(Verb::Watch), FaultKind::WatchGone),
        "never answers" => every(None, FaultKind::Hang),
        "endless list" => {
            every(Some(Verb::List), FaultKind::EndlessResponse);
            // Every watch expires, so the caches list again, into the endless answer.
            every(Some(Verb::Watch), FaultKind::WatchGone);
        }
        "endless pages" => {
            every(Some(Verb::List), FaultKind::EndlessPages);
            // As for the endless list: every list a cache makes again never ends either.
            every(Some(Verb::Watch), FaultKind::WatchGone);
        }
        "endless new objects" => every(Some(Verb::Watch), FaultKind::EndlessNewObjects),
        _ => every(
            Some(Verb::Watch),
            FaultKind::HugeWatchEvent {
                bytes: 10 * 1024 * 1024,
            },
        ),
    }
    // Watches opened before the fault would go on as if nothing happened.
    sim.close_watches();
}

struct IsolationRun {
    heal: Vec<Duration>,
    cpu: Duration,
    wall: Duration,
    rss_kib: u64,
    /// RSS 30 s after the bad tenants' Secrets were deleted (runs with bad tenants).
    after_delete_kib: Option<u64>,
}

/// One controller on a fresh fleet of `tenants`, `bad` of them (spread evenly) misbehaving from
/// the start; heal trials in the healthy ones only (the same tenants whatever `bad` is).
async fn isolation_run(args: &Args, tenants: usize, bad: &[usize]) -> Result<Option<IsolationRun>> {
    let fleet = start_fleet(tenants).await?;
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    // Every other bad tenant is bad from the start; the others turn bad while running.
    // (position among the bad tenants, tenant index)
    let numbered: Vec<(usize, usize)> = bad.iter().copied().enumerate().collect();
    let from_start: Vec<(usize, usize)> = numbered
        .iter()
        .copied()
        .filter(|(n, _)| n % 2 == 0)
        .collect();
    let later: Vec<(usize, usize)> = numbered
        .iter()
        .copied()
        .filter(|(n, _)| n % 2 == 1)
        .collect();
    for &(n, i) in &from_start {
        make_bad(&fleet.tenants()[i], BAD_KINDS[n % BAD_KINDS.len()]);
    }
    for (n, _) in bad.iter().enumerate() {
        *kinds.entry(BAD_KINDS[n % BAD_KINDS.len()]).or_default() += 1;
    }
    println!(
        "  bad tenants: {} ({kinds:?}), {} from the start, {} turning bad after start-up",
        bad.len(),
        from_start.len(),
        later.len()
    );
    let healthy: Vec<usize> = (0..tenants).filter(|i| !bad.contains(i)).collect();
    let Some((controller, _)) = converge(args, &fleet, &healthy).await? else {
        fleet.shutdown().await;
        return Ok(None);
    };
    let pid = controller.pid().context("controller not running")?;
    for &(n, i) in &later {
        make_bad(&fleet.tenants()[i], BAD_KINDS[n % BAD_KINDS.len()]);
    }
    // Past start-up; the bad tenants are deep in their retries by now.
    tokio::time::sleep(Duration::from_secs(15)).await;
    for &i in bad {
        fleet.tenants()[i].clear_requests();
    }
    let (heal, cpu, wall) = heal_window(
        &fleet,
        pid,
        &healthy,
        args.heal_trials,
        "  heal of a system namespace in a random healthy tenant",
    )
    .await?;
    if !bad.is_empty() {
        let mut asked: BTreeMap<&str, usize> = BTreeMap::new();
        for (n, &i) in bad.iter().enumerate() {
            *asked.entry(BAD_KINDS[n % BAD_KINDS.len()]).or_default() +=
                fleet.tenants()[i].requests().len();
        }
        println!(
            "  requests to the bad tenants during the heal window (per kind, summed): {asked:?}"
        );
        let mut done: BTreeMap<&str, usize> = BTreeMap::new();
        for (n, &i) in bad.iter().enumerate() {
            *done.entry(BAD_KINDS[n % BAD_KINDS.len()]).or_default() +=
                usize::from(converged(&fleet.tenants()[i], false));
        }
        println!("  bad tenants converged at the end of the heal window (per kind): {done:?}");
    }
    let trials_kib = rss_kib(pid)?;
    println!(
        "  controller RSS after the trials: {:.1} MiB, {} open sockets",
        trials_kib as f64 / 1024.0,
        sockets(pid)?
    );
    // What the bad tenants made the process hold goes back once their Secrets are gone.
    let mut after_delete_kib = None;
    if !bad.is_empty() {
        let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> =
            kube::Api::namespaced(fleet.management().client(), fleet.namespace());
        for &i in bad {
            secrets
                .delete(&Fleet::secret_name(i), &Default::default())
                .await?;
        }
        tokio::time::sleep(Duration::from_secs(30)).await;
        let kib = rss_kib(pid)?;
        println!(
            "  controller RSS 30 s after the bad tenants' Secrets were deleted: {:.1} MiB",
            kib as f64 / 1024.0
        );
        after_delete_kib = Some(kib);
    }
    stop(controller, fleet).await;
    Ok(Some(IsolationRun {
        heal,
        cpu,
        wall,
        rss_kib: trials_kib,
        after_delete_kib,
    }))
}

async fn isolation(args: &Args, tenants: usize) -> Result<()> {
    let count = (tenants * args.bad_percent).div_ceil(100).min(tenants);
    let bad: Vec<usize> = (0..count).map(|n| n * tenants / count.max(1)).collect();
    println!("isolation, run 1 of 2: {tenants} tenants, all healthy");
    let healthy = isolation_run(args, tenants, &[]).await?;
    println!(
        "isolation, run 2 of 2: {tenants} tenants, {count} bad ({} %)",
        args.bad_percent
    );
    let with_bad = isolation_run(args, tenants, &bad).await?;
    let (Some(a), Some(b)) = (healthy, with_bad) else {
        println!("isolation: a run did not converge, no comparison");
        return Ok(());
    };
    let mut ha = a.heal.clone();
    ha.sort();
    let mut hb = b.heal.clone();
    hb.sort();
    let ms = |h: &[Duration], p: f64| percentile(h, p).as_secs_f64() * 1000.0;
    println!();
    println!(
        "{:<22} {:>6} {:>9} {:>9} {:>9} {:>12} {:>8}",
        "run", "n", "heal p50", "heal p99", "heal max", "CPU s (wall)", "RSS MiB"
    );
    for (name, r, h) in [("all healthy", &a, &ha), ("with bad tenants", &b, &hb)] {
        println!(
            "{:<22} {:>6} {:>7.1}ms {:>7.1}ms {:>7.1}ms {:>5.2} ({:>4.1}) {:>8.1}",
            name,
            h.len(),
            ms(h, 50.0),
            ms(h, 99.0),
            ms(h, 100.0),
            r.cpu.as_secs_f64(),
            r.wall.as_secs_f64(),
            r.rss_kib as f64 / 1024.0
        );
    }
    println!(
        "ratio with bad / all healthy: p50 {:.2}, p99 {:.2} (requirement: within 1.10)",
        ms(&hb, 50.0) / ms(&ha, 50.0),
        ms(&hb, 99.0) / ms(&ha, 99.0)
    );
    if let Some(kib) = b.after_delete_kib {
        println!(
            "RSS 30 s after the bad tenants' Secrets were deleted / all healthy: {:.1} / {:.1} MiB \
             = {:.2} (requirement: within 2)",
            kib as f64 / 1024.0,
            a.rss_kib as f64 / 1024.0,
            kib as f64 / a.rss_kib as f64
        );
    }
    Ok(())
}

/// Puts `services` Services, each with its IPAddress, into `sim` (the backdoor: no allocation
/// round trip per object), with cluster IPs from 10.96.1.0 on.
fn seed_services(sim: &Sim, services: usize) -> Result<()> {
    let backdoor = sim.backdoor();
    for i in 0..services {
        let n = u32::try_from(i)? + 256;
        let ip = std::net::Ipv4Addr::from(u32::from(std::net::Ipv4Addr::new(10, 96, 0, 0)) + n);
        let name = format!("svc-{i:07}");
        let service = backdoor.put(serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "type": "ClusterIP", "clusterIP": ip.to_string(), "clusterIPs": [ip.to_string()],
                "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}],
                "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
            },
        }))?;
        backdoor.put(serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
            "metadata": {
                "name": ip.to_string(),
                "labels": {
                    "ipaddress.kubernetes.io/ip-family": "IPv4",
                    "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                },
            },
            "spec": {"parentRef": {
                "group": "", "resource": "services", "namespace": "default", "name": name,
                "uid": service["metadata"]["uid"],
            }},
        }))?;
    }
    Ok(())
}

/// A tenant of `services` Services beside two small ones: under the default cache budget it is
/// paused (its Secret gets `TenantOverBudget`); under a budget the operator raised for it in the
/// configuration file it converges and heals like the others. Prints the controller's RSS.
async fn large_tenant(args: &Args, services: usize) -> Result<()> {
    let dir = tempfile::tempdir()?;
    for (run, raised) in [("default budget", false), ("raised budget", true)] {
        let fleet = start_fleet(3).await?;
        let t = Instant::now();
        seed_services(&fleet.tenants()[0], services)?;
        println!(
            "{run}: tenant 0 holds {services} Services and their IPAddresses (seeded in {:.1?})",
            t.elapsed()
        );
        let mut args = Args {
            config: None,
            ..args.clone()
        };
        if raised {
            let config = dir.path().join("raised.yaml");
            std::fs::write(
                &config,
                format!(
                    "tenants:\n  cacheBudgets:\n    {}/{}: {{maxObjects: {}, maxMiB: {}}}\n",
                    fleet.namespace(),
                    Fleet::secret_name(0),
                    3 * services,
                    (services / 1000).max(32)
                ),
            )?;
            args.config = Some(config);
        }
        let started = Instant::now();
        let mut controller = start_controller(&args, &fleet)?;
        let pid = controller.pid().context("controller not running")?;
        let small = wait_converged(
            &fleet,
            &[1, 2],
            WaitFor::All,
            &mut controller,
            started,
            args.converge_timeout,
        )
        .await?;
        println!(
            "  the small tenants converged: {:?}",
            small.map(|at| at.len())
        );
        let events: kube::Api<k8s_openapi::api::events::v1::Event> =
            kube::Api::namespaced(fleet.management().client(), fleet.namespace());
        let over_budget = || async {
            events
                .list(&Default::default())
                .await
                .map(|list| {
                    list.items
                        .iter()
                        .any(|e| e.reason.as_deref() == Some("TenantOverBudget"))
                })
                .unwrap_or(false)
        };
        if raised {
            let large = wait_converged(
                &fleet,
                &[0],
                WaitFor::All,
                &mut controller,
                started,
                args.converge_timeout,
            )
            .await?;
            match large {
                Ok(at) => println!("  the large tenant converged in {:.2?}", at[0]),
                Err(_) => println!("  the large tenant did not converge"),
            }
            // The ClusterIP repair keeps every Service and IPAddress: wait until its caches
            // hold them all, as /metrics says.
            let held = || async {
                let (_, metrics) = controller.admin_get("/metrics").await.ok()?;
                metrics
                    .lines()
                    .find(|l| {
                        l.starts_with("bootstrap_cache_objects{")
                            && l.contains(&Fleet::secret_name(0))
                    })
                    .and_then(|l| l.split_whitespace().last())
                    .and_then(|v| v.parse::<f64>().ok())
            };
            let deadline = Instant::now() + args.converge_timeout;
            let mut objects = 0.0;
            while Instant::now() < deadline {
                objects = held().await.unwrap_or(0.0);
                if objects >= (2 * services) as f64 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            println!(
                "  the large tenant's caches hold {objects} objects {:.2?} after the start, RSS \
                 {:.1} MiB",
                started.elapsed(),
                rss_kib(pid)? as f64 / 1024.0
            );
            let (heal, _, _) = heal_window(
                &fleet,
                pid,
                &[0],
                args.heal_trials,
                "  heal of a system namespace in the large tenant",
            )
            .await?;
            let _ = heal;
        } else {
            let deadline = Instant::now() + args.converge_timeout;
            while !over_budget().await && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        println!(
            "  TenantOverBudget event on a Secret: {}; controller RSS {:.1} MiB",
            over_budget().await,
            rss_kib(pid)? as f64 / 1024.0
        );
        stop(controller, fleet).await;
    }
    Ok(())
}

fn print_table(rows: &[Row]) {
    let opt = |v: Option<f64>, prec: usize| v.map_or("-".to_string(), |v| format!("{v:.prec$}"));
    println!();
    println!(
        "{:>8} {:>12} {:>9} {:>8} {:>10} {:>11} {:>9} {:>9}",
        "tenants",
        "converge s",
        "RSS MiB",
        "sockets",
        "reads/min",
        "writes/min",
        "heal p50",
        "heal p99"
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
            "{:>8} {:>12} {:>9} {:>8} {:>10} {:>11} {:>9} {:>9}",
            r.tenants,
            opt(r.converged.map(|d| d.as_secs_f64()), 2),
            opt(r.rss_kib.map(|k| k as f64 / 1024.0), 1),
            r.sockets.map_or("-".to_string(), |n| n.to_string()),
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

/// Raises this process's open-file limit to what a fleet of `tenants` needs: the simulators are
/// behind one shared listener, so a tenant holds one descriptor here at rest (this end of the
/// controller's connection to it), and half as many again are allowed for connections being
/// replaced; the rest of the process (the management cluster, the listeners, the controller's
/// pipes) stays within 1,024 more. The controller, spawned from here, inherits the limit (it
/// holds a connection per tenant). The soft limit goes up to the hard one; past that only a
/// privileged process may go, and an unprivileged one is told to run `ulimit -n` first.
fn raise_open_files(tenants: usize) -> Result<()> {
    let want = u64::try_from(tenants)
        .unwrap_or(u64::MAX)
        .saturating_mul(3)
        .div_ceil(2)
        .saturating_add(1024);
    let (soft, hard) = rlimit::Resource::NOFILE
        .get()
        .context("reading RLIMIT_NOFILE")?;
    if soft >= want {
        return Ok(());
    }
    rlimit::Resource::NOFILE
        .set(want, hard.max(want))
        .with_context(|| {
            format!(
                "{tenants} tenants need {want} open files, this process may have {soft} \
                 (hard limit {hard}): raise it with `ulimit -n {want}` and run again"
            )
        })?;
    println!("open-file limit raised from {soft} to {want} for {tenants} tenants");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let binary = std::fs::metadata(&args.controller)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or("?".to_string(), |d| {
            format!("modified {} s since the epoch", d.as_secs())
        });
    println!(
        "multi_tenant: {} ({binary}) in management mode, config {}, {} heal trials",
        args.controller.display(),
        args.config
            .as_ref()
            .map_or("none".to_string(), |p| p.display().to_string()),
        args.heal_trials
    );
    if let Some(services) = args.large {
        return large_tenant(&args, services).await;
    }
    if let Some(tenants) = args.isolation {
        return isolation(&args, tenants).await;
    }
    println!(
        "fleets of {:?} tenants, {} s at rest, waiting for {:?}",
        args.sizes,
        args.rest.as_secs(),
        args.wait_for
    );
    raise_open_files(args.sizes.iter().copied().max().unwrap_or(0))?;
    let mut rows = Vec::new();
    for &tenants in &args.sizes {
        rows.push(run_size(&args, tenants).await?);
    }
    print_table(&rows);
    Ok(())
}

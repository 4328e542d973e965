//! `bootstrap-demo`: the first command a newcomer runs.
//!
//! Starts the API simulator in-process, runs every enabled loop against it (the same code as
//! `bootstrap-controller run`), breaks things on purpose and shows each repair and how long it
//! took. Each scenario is one function; add yours to [`SCENARIOS`].

mod endpoints;
mod nodeport;
mod services;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use apiserver_sim::{Sim, SimConfig};
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::runtime::watcher;

use bootstrap_controller::cli::{
    EXIT_CONFIG, EXIT_DRIFT_OR_FAILURE, EXIT_OK, cancel_on_signals, init_logging,
};
use bootstrap_controller::config::{Config, ConfigArgs, EndpointsMode};
use bootstrap_controller::process::Controller;
use clap::Parser;
use reconcilers::system_namespaces::NamespaceSpec;

/// Runs bootstrap-controller against an in-process API simulator, breaks things on purpose and
/// shows each repair and how long it took. Exit status: 0 every repair seen, 1 otherwise, 2 bad
/// configuration.
#[derive(Debug, Parser)]
#[command(name = "bootstrap-demo", version)]
struct DemoCli {
    /// A bootstrap-controller configuration file to run the loops with (defaults otherwise).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Stay up after the demo and print a kubeconfig path for kubectl; stop with Ctrl-C.
    #[arg(long, env = "BOOTSTRAP_DEMO_KEEP_RUNNING")]
    keep_running: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = DemoCli::parse();
    let args = ConfigArgs {
        config: cli.config,
        ..ConfigArgs::default()
    };
    match Config::load(&args) {
        Ok(config) => demo(config, cli.keep_running).await,
        Err(errors) => {
            eprintln!("error: {errors}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// How long any repair may take before the demo calls it a failure. Generous: a healthy repair
/// takes milliseconds, but the demo must not fail on a busy laptop.
const REPAIR_TIMEOUT: Duration = Duration::from_secs(30);

/// A namespace the demo declares with a label, to show metadata repair.
const DEMO_NAMESPACE: &str = "bootstrap-demo";
const DEMO_LABEL: &str = "demo.bootstrap-controller.io/owner";

/// What a scenario needs.
pub struct DemoEnv<'a> {
    pub sim: &'a Sim,
    pub client: kube::Client,
    pub config: &'a Config,
}

/// One scenario: break something, wait for the repair, return a line for the summary.
type Scenario = for<'a> fn(&'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>>;

/// Scenarios run in order; each prints its own narration. Add one per loop.
const SCENARIOS: &[(&str, Scenario)] = &[
    ("delete the system namespace kube-public", |env| {
        Box::pin(delete_namespace(env, "kube-public"))
    }),
    ("remove a declared label from a namespace", |env| {
        Box::pin(strip_label(env))
    }),
    (
        "the default ServiceCIDR the ClusterIP allocator needs",
        services::default_service_cidr,
    ),
    (
        "change the port of the kubernetes Service",
        services::kubernetes_service_port,
    ),
    (
        "delete the IPAddress behind a Service's cluster IP",
        services::ip_address_deleted,
    ),
    (
        "three apiservers: one killed, one stopped cleanly, the endpoint port corrupted",
        endpoints::apiserver_members,
    ),
    (
        "two Services share a node port, a third is outside the range",
        nodeport::node_ports,
    ),
    (
        "etcd mode: a port in use lost from the NodePort bitmap",
        nodeport::etcd_bitmap,
    ),
];

async fn demo(mut config: Config, keep_running: bool) -> ExitCode {
    // Loops that start before the namespaces they write into exist fail their first pass and
    // retry; at the default level that noise would hide the story. RUST_LOG=info shows it all.
    init_logging(config.log_format, "error");
    // One replica, a throwaway admin port, and a namespace with a label to break.
    config.leader_election.enabled = false;
    config.admin_addr = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    // The demo's controller stands in for the sidecar of the simulated apiserver, so it names
    // lease mode, as a sidecar's manifest does, unless the file chose another.
    if config.loops.apiserver_endpoints.mode.is_none() {
        config.loops.apiserver_endpoints.mode = Some(EndpointsMode::Lease);
    }
    // Membership at demo speed: a killed member goes after seconds, not upstream's 15 s.
    config.loops.apiserver_endpoints.interval = Duration::from_secs(1);
    config.loops.apiserver_endpoints.lease_ttl = Duration::from_secs(3);
    let system_namespaces = &mut config.loops.system_namespaces;
    if system_namespaces.enabled
        && !system_namespaces
            .namespaces
            .iter()
            .any(|ns| ns.name == DEMO_NAMESPACE)
    {
        system_namespaces.namespaces.push(NamespaceSpec {
            name: DEMO_NAMESPACE.to_owned(),
            labels: BTreeMap::from([(DEMO_LABEL.to_owned(), "bootstrap-controller".to_owned())]),
            annotations: BTreeMap::new(),
        });
    }

    // etcd mode when an etcd is at hand: the NodePort repair then also repairs its bitmap.
    let etcd = if config.settings.etcd().is_none() {
        nodeport::DemoEtcd::start().await
    } else {
        None
    };
    if let Some(etcd) = &etcd {
        println!("Started etcd for etcd mode ({}), found on PATH", etcd.url);
        config.settings.etcd.servers = vec![etcd.url.clone()];
    }

    // The simulator plays a kube-apiserver started with a range; with none configured the demo
    // gives the controller kubeadm's, as an operator would (the simulator creates no
    // ServiceCIDR for the controller to read it from).
    if config.settings.service_ranges.is_empty() {
        config.settings.service_ranges = "10.96.0.0/12".parse().into_iter().collect();
    }
    let sim_config = SimConfig {
        service_cluster_ip_ranges: config.settings.service_ranges.clone(),
        service_node_port_range: config.settings.node_port_range.base()
            ..=config.settings.node_port_range.last(),
        ..SimConfig::default()
    };
    println!("Starting the API simulator (an in-memory Kubernetes API server)...");
    println!("  (controller logs: set RUST_LOG=info)");
    let sim = match Sim::start(sim_config).await {
        Ok(sim) => sim,
        Err(err) => {
            eprintln!("error: cannot start the API simulator: {err}");
            return ExitCode::from(EXIT_DRIFT_OR_FAILURE);
        }
    };
    println!("  API server: {}", sim.base_url());

    let code = run_demo(&sim, &config, keep_running).await;
    sim.shutdown().await;
    drop(etcd);
    code
}

async fn run_demo(sim: &Sim, config: &Config, keep_running: bool) -> ExitCode {
    let kube_config =
        match bootstrap_controller::kubeconfig::load(Some(sim.kubeconfig_path())).await {
            Ok(kube_config) => kube_config,
            Err(message) => {
                eprintln!("error: {message}");
                return ExitCode::from(EXIT_DRIFT_OR_FAILURE);
            }
        };
    let controller_client = match kube::Client::try_from(kube_config.clone()) {
        Ok(client) => client,
        Err(err) => {
            eprintln!("error: cannot build a client for the simulator: {err}");
            return ExitCode::from(EXIT_DRIFT_OR_FAILURE);
        }
    };
    let started = Instant::now();
    let controller = match Controller::start(config, &kube_config, controller_client).await {
        Ok(controller) => controller,
        Err(message) => {
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_DRIFT_OR_FAILURE);
        }
    };
    println!(
        "Started bootstrap-controller (admin server http://{}: /readyz, /metrics)",
        controller.admin_addr
    );

    let code = match wait_ready(&controller).await {
        Ok(()) => {
            println!(
                "All loops ready after {}: {}",
                millis(started.elapsed()),
                controller.health.readiness().lines.join(", ")
            );
            let env = DemoEnv {
                sim,
                client: sim.client(),
                config,
            };
            show_namespaces(&env).await;
            let code = run_scenarios(&env).await;
            where_to_look(&env, controller.admin_addr).await;
            code
        }
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(EXIT_DRIFT_OR_FAILURE)
        }
    };

    if keep_running {
        println!();
        println!("Still running. Try, in another terminal:");
        println!("  export KUBECONFIG={}", sim.kubeconfig_path().display());
        println!("  kubectl get namespaces --show-labels");
        println!("  kubectl delete namespace kube-public && kubectl get namespace kube-public -w");
        println!("  kubectl get events -A");
        println!(
            "  cargo run -p bootstrap-controller -- --kubeconfig {} check",
            sim.kubeconfig_path().display()
        );
        println!(
            "  curl -s http://{}/metrics | grep bootstrap_",
            controller.admin_addr
        );
        println!("Press Ctrl-C to stop.");
        cancel_on_signals(controller.cancel.clone());
    } else {
        controller.cancel.cancel();
    }
    controller.wait().await;
    code
}

async fn wait_ready(controller: &Controller) -> Result<(), String> {
    let deadline = Instant::now() + REPAIR_TIMEOUT;
    loop {
        let readiness = controller.health.readiness();
        if readiness.ready {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "loops not ready after {}s: {}",
                REPAIR_TIMEOUT.as_secs(),
                readiness.lines.join("; ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run_scenarios(env: &DemoEnv<'_>) -> ExitCode {
    let mut summary = Vec::new();
    let mut failed = false;
    for (index, (title, scenario)) in SCENARIOS.iter().enumerate() {
        println!();
        println!("[{}/{}] {title}", index + 1, SCENARIOS.len());
        match scenario(env).await {
            Ok(line) => summary.push(format!("  ok    {title}: {line}")),
            Err(message) => {
                println!("  FAILED: {message}");
                summary.push(format!("  FAIL  {title}: {message}"));
                failed = true;
            }
        }
    }
    println!();
    println!("Summary:");
    for line in &summary {
        println!("{line}");
    }
    if failed {
        ExitCode::from(EXIT_DRIFT_OR_FAILURE)
    } else {
        ExitCode::from(EXIT_OK)
    }
}

/// Where a person sees what the loops did: the events they wrote and their metrics.
async fn where_to_look(env: &DemoEnv<'_>, admin: std::net::SocketAddr) {
    use k8s_openapi::api::events::v1::Event;
    println!();
    println!("Where to look:");
    let events: Api<Event> = Api::all(env.client.clone());
    match events.list(&Default::default()).await {
        Ok(list) => {
            let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
            for event in &list.items {
                let reason = event.reason.clone().unwrap_or_default();
                let by = event.reporting_controller.clone().unwrap_or_default();
                *counts.entry((by, reason)).or_default() += 1;
            }
            println!("  events (kubectl get events -A), by reporting controller and reason:");
            for ((by, reason), count) in counts {
                println!("    {by:<34} {reason:<28} {count}");
            }
        }
        Err(err) => println!("  (cannot list events: {err})"),
    }
    match admin_metrics(admin).await {
        Ok(text) => {
            // One line per loop: what it repaired, from bootstrap_loop_drift_repaired_total.
            let mut repaired: BTreeMap<String, f64> = BTreeMap::new();
            for line in text
                .lines()
                .filter(|line| line.starts_with("bootstrap_loop_drift_repaired_total{"))
            {
                let name = line
                    .split("loop=\"")
                    .nth(1)
                    .and_then(|rest| rest.split('"').next());
                let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
                if let (Some(name), Some(value)) = (name, value) {
                    *repaired.entry(name.to_owned()).or_default() += value;
                }
            }
            println!(
                "  metrics (curl http://{admin}/metrics | grep bootstrap_), repairs per loop:"
            );
            let per_loop: Vec<String> = repaired
                .iter()
                .map(|(name, count)| format!("{name} {count}"))
                .collect();
            println!("    {}", per_loop.join(", "));
        }
        Err(err) => println!("  (cannot read metrics: {err})"),
    }
    println!(
        "  drift, without writing anything: bootstrap-controller check (exit 0 clean, 1 drift)"
    );
}

/// GET /metrics from the admin server (plain HTTP on loopback).
async fn admin_metrics(addr: std::net::SocketAddr) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    Ok(response
        .split_once("\r\n\r\n")
        .map_or(response.clone(), |(_, body)| body.to_owned()))
}

async fn show_namespaces(env: &DemoEnv<'_>) {
    let api: Api<Namespace> = Api::all(env.client.clone());
    match api.list(&Default::default()).await {
        Ok(list) => {
            let names: Vec<_> = list
                .items
                .iter()
                .filter_map(|ns| ns.metadata.name.clone())
                .collect();
            println!("Namespaces now: {}", names.join(", "));
        }
        Err(err) => println!("(could not list namespaces: {err})"),
    }
}

fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

type NamespaceEvents =
    futures::stream::BoxStream<'static, Result<watcher::Event<Namespace>, watcher::Error>>;

/// A namespace watch that has finished its initial list, so every later change shows up as an
/// event (a lazily started watch could list the already repaired state and miss the breakage).
async fn synced_watch(api: &Api<Namespace>) -> Result<NamespaceEvents, String> {
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let synced = tokio::time::timeout(REPAIR_TIMEOUT, async {
        while let Some(event) = events.next().await {
            if let Ok(watcher::Event::InitDone) = event {
                return true;
            }
        }
        false
    })
    .await;
    match synced {
        Ok(true) => Ok(events),
        _ => Err("cannot start a namespace watch on the simulator".to_owned()),
    }
}

/// Deletes a namespace and follows it through Terminating, gone, and back.
async fn delete_namespace(env: &DemoEnv<'_>, name: &str) -> Result<String, String> {
    if !env.config.loops.system_namespaces.enabled {
        return Ok("skipped: the system-namespaces loop is disabled".to_owned());
    }
    let api: Api<Namespace> = Api::all(env.client.clone());
    let before = api
        .get_opt(name)
        .await
        .map_err(|err| format!("cannot read namespace {name}: {err}"))?
        .ok_or_else(|| format!("namespace {name} does not exist before the demo breaks it"))?;
    let old_uid = before.metadata.uid.clone().unwrap_or_default();

    // Watch before deleting so no event is missed.
    let mut events = synced_watch(&api).await?;
    let deleted_at = Instant::now();
    api.delete(name, &DeleteParams::default())
        .await
        .map_err(|err| format!("cannot delete namespace {name}: {err}"))?;
    println!(
        "  deleted namespace {name} (uid {old_uid}); the simulator keeps it Terminating briefly, as a real API server finalizes it"
    );

    let mut gone_at = None;
    let outcome = tokio::time::timeout(REPAIR_TIMEOUT, async {
        while let Some(event) = events.next().await {
            let object = match event {
                Ok(watcher::Event::Delete(ns)) if ns.metadata.name.as_deref() == Some(name) => {
                    if gone_at.is_none() {
                        gone_at = Some(Instant::now());
                        println!("  +{}  {name} is gone", millis(deleted_at.elapsed()));
                    }
                    continue;
                }
                Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns)) => ns,
                Ok(_) => continue,
                Err(err) => {
                    println!("  (watch error, retrying: {err})");
                    continue;
                }
            };
            if object.metadata.name.as_deref() != Some(name) {
                continue;
            }
            let uid = object.metadata.uid.clone().unwrap_or_default();
            if uid != old_uid && object.metadata.deletion_timestamp.is_none() {
                return Some(uid);
            }
        }
        None
    })
    .await;
    let recreated_at = Instant::now();
    match outcome {
        Ok(Some(uid)) => {
            let since_gone = gone_at.map(|gone| recreated_at.duration_since(gone));
            println!(
                "  +{}  {name} recreated by the controller (new uid {uid})",
                millis(deleted_at.elapsed())
            );
            Ok(match since_gone {
                Some(since_gone) => format!(
                    "recreated {} after it was gone ({} after the delete request)",
                    millis(since_gone),
                    millis(recreated_at.duration_since(deleted_at))
                ),
                None => format!(
                    "recreated {} after the delete request",
                    millis(recreated_at.duration_since(deleted_at))
                ),
            })
        }
        Ok(None) => Err("the namespace watch ended before the repair".to_owned()),
        Err(_) => Err(format!(
            "{name} was not recreated within {}s",
            REPAIR_TIMEOUT.as_secs()
        )),
    }
}

/// Removes the declared label from the demo namespace and waits for it to come back.
async fn strip_label(env: &DemoEnv<'_>) -> Result<String, String> {
    let declared = env
        .config
        .loops
        .system_namespaces
        .namespaces
        .iter()
        .find(|ns| ns.name == DEMO_NAMESPACE);
    if !env.config.loops.system_namespaces.enabled || declared.is_none() {
        return Ok("skipped: the system-namespaces loop is disabled".to_owned());
    }
    let api: Api<Namespace> = Api::all(env.client.clone());
    let mut events = synced_watch(&api).await?;
    // A JSON merge patch with null deletes the key.
    let remove = serde_json::json!({ "metadata": { "labels": { DEMO_LABEL: null } } });
    let started = Instant::now();
    api.patch(
        DEMO_NAMESPACE,
        &PatchParams::default(),
        &Patch::Merge(&remove),
    )
    .await
    .map_err(|err| format!("cannot patch namespace {DEMO_NAMESPACE}: {err}"))?;
    println!("  removed label {DEMO_LABEL} from namespace {DEMO_NAMESPACE}");
    let outcome = tokio::time::timeout(REPAIR_TIMEOUT, async {
        let mut saw_removal = false;
        while let Some(event) = events.next().await {
            let Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns)) = event else {
                continue;
            };
            if ns.metadata.name.as_deref() != Some(DEMO_NAMESPACE) {
                continue;
            }
            let has_label = ns
                .metadata
                .labels
                .as_ref()
                .is_some_and(|labels| labels.contains_key(DEMO_LABEL));
            if !has_label {
                saw_removal = true;
            } else if saw_removal {
                return true;
            }
        }
        false
    })
    .await;
    match outcome {
        Ok(true) => {
            println!(
                "  +{}  label restored by the controller",
                millis(started.elapsed())
            );
            Ok(format!(
                "label restored after {}",
                millis(started.elapsed())
            ))
        }
        Ok(false) => Err("the namespace watch ended before the repair".to_owned()),
        Err(_) => Err(format!(
            "the label was not restored within {}s",
            REPAIR_TIMEOUT.as_secs()
        )),
    }
}

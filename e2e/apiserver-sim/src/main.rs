//! `apiserver-sim`: runs the simulator until SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use apiserver_sim::{Fleet, FleetConfig, Sim, SimConfig};
use clap::Parser;

/// An in-memory Kubernetes API server for tests and demos.
#[derive(Debug, Parser)]
#[command(name = "apiserver-sim", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port (the kubeconfig tells which).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where to write the kubeconfig once serving.
    #[arg(long)]
    kubeconfig_out: PathBuf,
    /// Service ClusterIP range(s), comma-separated, at most one per IP family.
    #[arg(long, default_value = "10.96.0.0/12", value_delimiter = ',')]
    service_cluster_ip_range: Vec<String>,
    /// NodePort range, `A-B`.
    #[arg(long, default_value = "30000-32767")]
    service_node_port_range: String,
    /// Serve plain HTTP instead of HTTPS. With --tenants it applies to the management cluster
    /// only: tenant clusters always serve HTTPS, the only scheme a tenant kubeconfig may use.
    #[arg(long)]
    plain_http: bool,
    /// Do not allocate ClusterIPs / node ports / IPAddresses.
    #[arg(long)]
    no_allocation: bool,
    /// How long a deleted namespace stays Terminating, e.g. `500ms`, `2s`.
    #[arg(long, default_value = "500ms")]
    namespace_finalize_delay: String,
    /// Watch events retained; older resourceVersions get 410 Gone.
    #[arg(long, default_value_t = 10_000)]
    watch_window: usize,
    /// Interval between watch bookmarks, e.g. `1s`.
    #[arg(long, default_value = "1s")]
    bookmark_interval: String,
    /// Namespace to create at startup (repeatable).
    #[arg(long = "seed-namespace")]
    seed_namespaces: Vec<String>,
    /// Refuse deleting default, kube-system and kube-public (403), as kube-apiserver's
    /// NamespaceLifecycle admission plugin does.
    #[arg(long)]
    protect_system_namespaces: bool,
    /// Do not create the ServiceCIDR `kubernetes` from --service-cluster-ip-range at start
    /// (kube-apiserver 1.33+ creates it; without it a controller must be given the range).
    #[arg(long)]
    no_default_service_cidr: bool,
    /// Serve no networking.k8s.io/v1 (ServiceCIDR, IPAddress), as clusters before 1.33.
    #[arg(long)]
    no_networking_v1: bool,
    /// Also serve this many tenant clusters (each on its own port of the --listen address) and
    /// store one Cluster API style kubeconfig Secret per tenant in the cluster at --listen,
    /// which becomes the management cluster.
    #[arg(long, default_value_t = 0)]
    tenants: usize,
    /// Namespace of the tenant kubeconfig Secrets in the management cluster (seeded).
    #[arg(long, default_value = "tenants")]
    tenants_namespace: String,
    /// Where to write `tenant-<i>.kubeconfig` for each tenant; default a temporary directory.
    #[arg(long)]
    tenants_kubeconfig_dir: Option<PathBuf>,
}

/// File descriptors a tenant holds with one client connected: its listener, the connection its
/// own start-up probe keeps pooled (both ends), and the client's connection, with some slack.
const FDS_PER_TENANT: u64 = 6;

/// The soft limit on open files, from `/proc/self/limits` (no unsafe `getrlimit` needed).
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

fn parse_duration(flag: &str, s: &str) -> anyhow::Result<Duration> {
    let s = s.trim();
    let (num, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .unwrap_or((s, "ms"));
    let n: u64 = num.parse().with_context(|| {
        format!("--{flag} {s:?}: expected a number followed by ms or s, e.g. 500ms")
    })?;
    Ok(match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        other => bail!("--{flag} {s:?}: unknown unit {other:?}; use ms or s, e.g. 500ms or 2s"),
    })
}

fn parse_port_range(s: &str) -> anyhow::Result<std::ops::RangeInclusive<u16>> {
    let (a, b) = s.split_once('-').with_context(|| {
        format!("--service-node-port-range {s:?}: expected A-B, e.g. 30000-32767")
    })?;
    let a: u16 = a
        .trim()
        .parse()
        .with_context(|| format!("--service-node-port-range {s:?}: {a:?} is not a port"))?;
    let b: u16 = b
        .trim()
        .parse()
        .with_context(|| format!("--service-node-port-range {s:?}: {b:?} is not a port"))?;
    if a > b {
        bail!("--service-node-port-range {s:?}: start is after end");
    }
    Ok(a..=b)
}

/// One cluster, or a management cluster with its tenants.
enum Running {
    One(Sim),
    Fleet(Fleet),
}

impl Running {
    /// The cluster at `--listen` whose kubeconfig is `--kubeconfig-out`.
    fn main(&self) -> &Sim {
        match self {
            Running::One(sim) => sim,
            Running::Fleet(fleet) => fleet.management(),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let mut ranges: Vec<ipnet::IpNet> = Vec::new();
    for r in &args.service_cluster_ip_range {
        ranges.push(r.trim().parse().with_context(|| {
            format!("--service-cluster-ip-range {r:?}: expected a CIDR such as 10.96.0.0/12")
        })?);
    }
    if ranges.len() > 2
        || (ranges.len() == 2 && ranges[0].addr().is_ipv4() == ranges[1].addr().is_ipv4())
    {
        bail!(
            "--service-cluster-ip-range {:?}: give at most one CIDR per IP family (e.g. 10.96.0.0/12,fd00::/108)",
            args.service_cluster_ip_range.join(",")
        );
    }
    let config = SimConfig {
        listen: args.listen,
        plain_http: args.plain_http,
        kubeconfig_path: Some(args.kubeconfig_out.clone()),
        service_cluster_ip_ranges: ranges,
        service_node_port_range: parse_port_range(&args.service_node_port_range)?,
        allocation: !args.no_allocation,
        namespace_finalize_delay: parse_duration(
            "namespace-finalize-delay",
            &args.namespace_finalize_delay,
        )?,
        watch_window: args.watch_window,
        bookmark_interval: parse_duration("bookmark-interval", &args.bookmark_interval)?,
        seed_namespaces: args.seed_namespaces,
        protect_system_namespaces: args.protect_system_namespaces,
        serve_networking_v1: !args.no_networking_v1,
        default_service_cidr: !args.no_default_service_cidr,
    };
    let running = if args.tenants == 0 {
        Running::One(Sim::start(config).await?)
    } else {
        if let Some(limit) = open_files_limit() {
            let needed = args.tenants as u64 * FDS_PER_TENANT + 64;
            if limit < needed {
                bail!(
                    "--tenants {}: needs about {needed} open files, the limit is {limit}; raise it (ulimit -n {needed}) or serve fewer tenants",
                    args.tenants
                );
            }
        }
        let tenant = SimConfig {
            listen: SocketAddr::new(args.listen.ip(), 0),
            plain_http: false,
            kubeconfig_path: None,
            seed_namespaces: Vec::new(),
            ..config.clone()
        };
        let fleet = Fleet::start(FleetConfig {
            tenants: args.tenants,
            management: config,
            tenant,
            namespace: args.tenants_namespace.clone(),
            kubeconfig_dir: args.tenants_kubeconfig_dir.clone(),
            write_secrets: true,
            shared_listener: false,
        })
        .await?;
        for (i, t) in fleet.tenants().iter().enumerate() {
            tracing::debug!(
                tenant = i,
                url = t.base_url(),
                kubeconfig = %t.kubeconfig_path().display(),
                "tenant cluster"
            );
        }
        Running::Fleet(fleet)
    };
    let main_sim = running.main();
    tracing::info!(
        url = main_sim.base_url(),
        kubeconfig = %main_sim.kubeconfig_path().display(),
        tenants = args.tenants,
        "apiserver-sim listening on {}",
        main_sim.base_url()
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("apiserver-sim shutting down");
    match running {
        Running::One(sim) => sim.shutdown().await,
        Running::Fleet(fleet) => fleet.shutdown().await,
    }
    Ok(())
}

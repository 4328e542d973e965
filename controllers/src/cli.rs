//! The binary's command line: `run`, `check`, `config validate`, `config print`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::{self, AdminState};
use crate::config::TenantBase;
use crate::config::{
    Config, ConfigArgs, ConfigError, ConfigErrors, LogFormat, format_duration, parse_duration,
};
use crate::health::Health;
use crate::kubeconfig;
use crate::leader::{self, LeaderMetrics, LeaderSettings};
use crate::loops::{build_loops, build_runner, kubeconfig_loader};
use crate::metrics::{RunnerMetrics, new_registry};
use crate::runner::{CheckResult, Runner, check_once};
use crate::shards::{ShardSettings, Shards};
use crate::tenant_kubeconfig::{self, CredentialPolicy};
use crate::tenants::{self, Directory, Ownership, TenantMetrics, TenantSettings};

/// No drift (`check`), or a clean exit.
pub const EXIT_OK: u8 = 0;
/// `check` found drift; `run` could not start (e.g. the admin address is taken).
pub const EXIT_DRIFT_OR_FAILURE: u8 = 1;
/// Invalid configuration, or (`check`) the API server could not be reached.
pub const EXIT_CONFIG: u8 = 2;

/// Runs kube-apiserver's bootstrap reconciliation from outside it: system namespaces, the
/// `kubernetes` Service and its endpoints, ClusterIP and NodePort repair.
///
/// Every loop runs once at start, then on its interval, and whenever a watch shows drift.
/// Configuration: flags (each also an environment variable, BOOTSTRAP_<FLAG>), then the --config
/// YAML file, then defaults.
#[derive(Debug, Parser)]
#[command(name = "bootstrap-controller", version, about, long_about)]
pub struct Cli {
    #[command(flatten)]
    pub config: ConfigArgs,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the controller: every enabled loop, leader election, and the admin server
    /// (/livez, /readyz, /metrics). Stops gracefully on SIGTERM or SIGINT.
    Run,
    /// Run one dry-run pass of every enabled loop against the cluster and print the drift found.
    /// Writes nothing. Exit status: 0 no drift, 1 drift, 2 configuration or connection error.
    Check {
        /// How long to wait for the API server and for each loop's caches before giving up
        /// (exit 2), e.g. `30s`.
        #[arg(
            long,
            env = "BOOTSTRAP_CHECK_TIMEOUT",
            value_name = "DURATION",
            default_value = "30s"
        )]
        timeout: String,
        /// Report format.
        #[arg(
            long,
            env = "BOOTSTRAP_CHECK_OUTPUT",
            value_name = "FORMAT",
            default_value = "text"
        )]
        output: OutputFormat,
    },
    /// Validate or print the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Runs a credential plugin the operator allowed for tenant kubeconfigs, on behalf of the
    /// controller's client: bounded in time and output, its stderr discarded.
    #[command(name = "credential-plugin", hide = true)]
    CredentialPlugin {
        /// The plugin and its arguments.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Validate the --config file (merged with any flags and environment variables), as
    /// `kubeadm config validate --config FILE` does. Exit status: 0 valid, 2 invalid.
    Validate,
    /// Print the effective configuration (flags > file > defaults) as YAML, in the shape the
    /// --config file accepts. Exit status 2 if it is invalid.
    Print,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    Text,
    Json,
}

/// Entry point of the binary.
pub async fn execute(cli: Cli) -> ExitCode {
    match cli.command {
        Command::CredentialPlugin { command } => tenant_kubeconfig::run_plugin(&command).await,
        Command::Config(ConfigCommand::Validate) => {
            let Some(file) = cli.config.config.clone() else {
                return config_error(&ConfigErrors(vec![ConfigError::new(
                    "--config",
                    "config validate checks the file given with --config FILE (or \
                     BOOTSTRAP_CONFIG); none was given",
                )]));
            };
            match Config::load(&cli.config) {
                Ok(_) => {
                    println!("{}: configuration is valid", file.display());
                    ExitCode::from(EXIT_OK)
                }
                Err(errors) => config_error(&errors),
            }
        }
        Command::Config(ConfigCommand::Print) => match Config::load(&cli.config) {
            Ok(config) => match config.to_yaml() {
                Ok(yaml) => {
                    print!("{yaml}");
                    ExitCode::from(EXIT_OK)
                }
                Err(err) => {
                    eprintln!("error: cannot print the configuration: {err}");
                    ExitCode::from(EXIT_DRIFT_OR_FAILURE)
                }
            },
            Err(errors) => config_error(&errors),
        },
        Command::Run => match Config::load(&cli.config) {
            Ok(config) if config.tenants.is_some() => {
                // Every tenant's configuration starts from the file: one the tenants cannot
                // use is refused now, not once per tenant.
                match TenantBase::load(&cli.config).and_then(|base| {
                    base.tenant(None)?;
                    Ok(base)
                }) {
                    Ok(base) => run(config, Some(base)).await,
                    Err(errors) => config_error(&errors),
                }
            }
            Ok(config) => run(config, None).await,
            Err(errors) => config_error(&errors),
        },
        Command::Check { timeout, output } => {
            let timeout = match parse_duration(&timeout) {
                Ok(timeout) if !timeout.is_zero() => timeout,
                Ok(_) => {
                    return config_error(&ConfigErrors(vec![crate::config::ConfigError::new(
                        "--timeout",
                        "must be greater than zero (e.g. 30s)",
                    )]));
                }
                Err(err) => {
                    return config_error(&ConfigErrors(vec![crate::config::ConfigError::new(
                        "--timeout",
                        err.to_string(),
                    )]));
                }
            };
            match Config::load(&cli.config) {
                Ok(config) if config.tenants.is_some() => {
                    config_error(&ConfigErrors(vec![crate::config::ConfigError::new(
                        "--tenants-secret-selector",
                        "check works on one cluster: point --kubeconfig at one tenant's \
                         kubeconfig and leave the tenants settings out",
                    )]))
                }
                Ok(config) => check(config, timeout, output).await,
                Err(errors) => config_error(&errors),
            }
        }
    }
}

fn config_error(errors: &ConfigErrors) -> ExitCode {
    eprintln!("error: {errors}");
    ExitCode::from(EXIT_CONFIG)
}

/// kube's log target for each failed request.
const KUBE_REQUEST_ERRORS: &str = "kube_client::client::builder";

/// Logs go to stderr, so `check` and `config print` keep stdout for their output.
pub fn init_logging(format: LogFormat, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    // kube's client logs every failed request at error level; the loops report those failures
    // themselves, once while they repeat, so an outage is not an error line per request. A
    // RUST_LOG that names kube_client gets exactly what it asks for.
    let quiet_kube = format!("{KUBE_REQUEST_ERRORS}=off");
    let directives = match std::env::var("RUST_LOG") {
        Ok(asked) if asked.contains("kube_client") => asked,
        Ok(asked) if !asked.trim().is_empty() => format!("{asked},{quiet_kube}"),
        _ => format!("{default_filter},{quiet_kube}"),
    };
    let filter = EnvFilter::try_new(directives)
        .unwrap_or_else(|_| EnvFilter::new(format!("{default_filter},{quiet_kube}")));
    // Colours only where a person reads them: not in a pipe, a file or a container log.
    let terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(terminal)
        .with_writer(std::io::stderr);
    // A second initialisation (tests, the demo) keeps the first subscriber.
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Cancels `token` on SIGTERM or SIGINT; a second signal exits at once.
pub fn cancel_on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        wait_for_signal().await;
        info!("signal received; shutting down gracefully (send it again to exit at once)");
        token.cancel();
        wait_for_signal().await;
        warn!("second signal; exiting without finishing the shutdown");
        std::process::exit(130);
    });
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(err) => {
                warn!(error = %err, "cannot listen for SIGTERM; only SIGINT stops the process");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// What `run` and the demo (`bootstrap-demo`) share: everything after the client exists.
pub struct Controller {
    pub cancel: CancellationToken,
    pub admin_addr: std::net::SocketAddr,
    pub health: crate::health::Health,
    task: tokio::task::JoinHandle<()>,
}

/// What one process keeps: one cluster, or every tenant of a management cluster.
enum Mode {
    Single(Box<Runner>),
    Management(Box<(crate::config::Tenants, TenantBase)>),
}

/// Why the controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "--admin-addr: cannot listen on {addr}: {source} (pick a free address, e.g. 127.0.0.1:8081)"
    )]
    AdminAddress {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot build the leader-election client: {0}")]
    ElectionClient(kube::Error),
}

impl Controller {
    /// Builds the loops, starts leader election, the admin server and the runner.
    pub async fn start(
        config: &Config,
        kube_config: &kube::Config,
        client: kube::Client,
    ) -> Result<Controller, StartError> {
        Controller::start_mode(config, kube_config, client, None).await
    }

    /// Management mode: one runtime per tenant Secret, shared between replicas (see
    /// [`crate::tenants`]); `base` is what every tenant's configuration is made from.
    pub async fn start_management(
        config: &Config,
        kube_config: &kube::Config,
        client: kube::Client,
        base: TenantBase,
    ) -> Result<Controller, StartError> {
        Controller::start_mode(config, kube_config, client, Some(base)).await
    }

    async fn start_mode(
        config: &Config,
        kube_config: &kube::Config,
        client: kube::Client,
        tenant_base: Option<TenantBase>,
    ) -> Result<Controller, StartError> {
        let cancel = CancellationToken::new();
        let mut registry = new_registry();
        let mode = match (&config.tenants, tenant_base) {
            (Some(tenants), Some(base)) => {
                info!(
                    selector = %tenants.secret_selector,
                    namespace = tenants.namespace.as_deref().unwrap_or("(all)"),
                    kubeconfig_key = %tenants.kubeconfig_key,
                    sharing = config.leader_election.enabled,
                    server = %kube_config.cluster_url,
                    "starting in management mode: one runtime per tenant Secret"
                );
                Mode::Management(Box::new((tenants.clone(), base)))
            }
            _ => {
                let runner =
                    build_runner(config, &client, kubeconfig_loader(config), &mut registry);
                info!(
                    loops = ?runner.loop_names(),
                    dry_run = config.dry_run,
                    timer_only = config.timer_only,
                    leader_election = config.leader_election.enabled,
                    server = %kube_config.cluster_url,
                    "starting"
                );
                if config.service_cluster_ip_range.is_empty() {
                    info!(
                        "--service-cluster-ip-range is not set: the loops read the range from the \
                         cluster's ServiceCIDR \"kubernetes\" (Kubernetes 1.33+), and the \
                         service-cidr loop, which would create that object from it, does not run"
                    );
                }
                Mode::Single(Box::new(runner))
            }
        };
        // Bind before joining the election: failing here must not leave a Lease behind.
        let listener = tokio::net::TcpListener::bind(config.admin_addr)
            .await
            .map_err(|source| StartError::AdminAddress {
                addr: config.admin_addr,
                source,
            })?;
        let health = match &mode {
            Mode::Single(runner) => runner.health(),
            Mode::Management(..) => Health::default(),
        };
        let admin_addr = listener.local_addr().unwrap_or(config.admin_addr);

        let (work, directory): (tokio::task::JoinHandle<()>, Option<Directory>) = match mode {
            Mode::Single(runner) => {
                let leader_metrics = LeaderMetrics::register(&mut registry);
                let work = Controller::spawn_single(
                    config,
                    kube_config,
                    &client,
                    *runner,
                    leader_metrics,
                    health.clone(),
                    cancel.clone(),
                )?;
                (work, None)
            }
            Mode::Management(management) => {
                let (tenants, base) = *management;
                let directory = Directory::default();
                let metrics = TenantMetrics::register(&mut registry);
                let identity = config.leader_identity();
                let shards_cancel = CancellationToken::new();
                let (ownership, shards) = if config.leader_election.enabled {
                    let shards = Shards::spawn(
                        client.clone(),
                        ShardSettings {
                            namespace: config.leader_election.lease_namespace.clone(),
                            group: config.leader_election.lease_name.clone(),
                            identity: identity.clone(),
                            lease_duration: config.leader_election.lease_duration,
                            renew_grace: config.leader_election.renew_grace,
                        },
                        shards_cancel.clone(),
                    );
                    let views = shards.views.clone();
                    let leadership = shards.leadership();
                    let shards = Arc::new(shards);
                    let acks = shards.clone();
                    (
                        Ownership {
                            views,
                            ack: Box::new(move |id| acks.ack(id)),
                            leadership,
                        },
                        Some(shards),
                    )
                } else {
                    (Ownership::single(&identity), None)
                };
                let settings = TenantSettings {
                    selector: tenants.secret_selector.clone(),
                    namespace: tenants.namespace.clone(),
                    kubeconfig_key: tenants.kubeconfig_key.clone(),
                    base,
                    identity,
                    credentials: CredentialPolicy {
                        plugins: tenants.credential_plugins.clone(),
                        // Allowed plugins run under this program's credential-plugin
                        // subcommand; without its path none can run.
                        runner: (!tenants.credential_plugins.is_empty())
                            .then(|| std::env::current_exe().ok())
                            .flatten(),
                    },
                    claims_namespace: config.leader_election.lease_namespace.clone(),
                    claims_group: config.leader_election.lease_name.clone(),
                };
                let manager = tenants::spawn(
                    client.clone(),
                    settings,
                    ownership,
                    health.clone(),
                    metrics,
                    directory.clone(),
                    cancel.clone(),
                );
                let work = tokio::spawn(async move {
                    if let Err(err) = manager.await {
                        error!(error = %err, "the tenant manager failed");
                    }
                    // Every tenant has stopped: withdraw from the replicas so the others
                    // take the tenants at once (the manager, gone now, held the other
                    // handle).
                    shards_cancel.cancel();
                    if let Some(shards) = shards.and_then(Arc::into_inner) {
                        shards.stopped().await;
                    }
                });
                (work, Some(directory))
            }
        };

        info!(%admin_addr, "admin server listening (/livez, /readyz, /metrics)");
        let admin_state = AdminState {
            health: health.clone(),
            registry: Arc::new(registry),
            tenants: directory,
            shutting_down: cancel.clone(),
        };
        let admin_stop = CancellationToken::new();
        let admin_task = tokio::spawn(admin::serve(listener, admin_state, admin_stop.clone()));
        let task = tokio::spawn(async move {
            if let Err(err) = work.await {
                error!(error = %err, "controller task failed");
            }
            admin_stop.cancel();
            match tokio::time::timeout(Duration::from_secs(5), admin_task).await {
                Ok(Ok(Err(err))) => warn!(error = %err, "admin server failed"),
                Ok(Err(err)) => warn!(error = %err, "admin server task failed"),
                Ok(Ok(Ok(()))) | Err(_) => {}
            }
        });
        Ok(Controller {
            cancel,
            admin_addr,
            health,
            task,
        })
    }

    /// The single-cluster mode's work: leader election (if on) and the runner.
    fn spawn_single(
        config: &Config,
        kube_config: &kube::Config,
        client: &kube::Client,
        runner: Runner,
        leader_metrics: LeaderMetrics,
        health: Health,
        cancel: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, StartError> {
        // Leadership outlives the runner, so passes running at shutdown may finish as leader.
        let leader_cancel = CancellationToken::new();
        let (leader, leader_task) = if config.leader_election.enabled {
            let election_client = leader::election_client(
                kube_config,
                config.kubeconfig.as_deref(),
                config.leader_election.renew_grace,
            )
            .map_err(StartError::ElectionClient)?;
            let settings = LeaderSettings {
                lease_name: config.leader_election.lease_name.clone(),
                lease_namespace: config.leader_election.lease_namespace.clone(),
                identity: config.leader_identity(),
                lease_duration: config.leader_election.lease_duration,
                renew_grace: config.leader_election.renew_grace,
            };
            let clients = leader::ElectionClients {
                watch: client.clone(),
                write: election_client,
            };
            let (receiver, task) = leader::spawn(
                clients,
                settings,
                leader_metrics,
                health,
                leader_cancel.clone(),
            );
            (receiver, Some(task))
        } else {
            (leader::always_leader(&leader_metrics), None)
        };
        Ok(tokio::spawn(async move {
            runner.run(leader, cancel).await;
            leader_cancel.cancel();
            if let Some(task) = leader_task {
                // Releasing the Lease is bounded by the renew grace inside the task.
                let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
            }
        }))
    }

    /// Whether the controller stopped (it only stops after `cancel`).
    pub fn task_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the controller stopped (after `cancel`).
    pub async fn wait(self) {
        if let Err(err) = self.task.await {
            error!(error = %err, "controller task failed");
        }
    }
}

async fn run(config: Config, tenant_base: Option<TenantBase>) -> ExitCode {
    init_logging(config.log_format, "info");
    let kube_config = match kubeconfig::load(config.kubeconfig.as_deref()).await {
        Ok(kube_config) => kube_config,
        Err(message) => {
            error!("{message}");
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let client = match crate::client::build(&kube_config, config.kubeconfig.as_deref()) {
        Ok(client) => client,
        Err(err) => {
            let message = format!(
                "cannot build a Kubernetes client for {}: {err} (check the kubeconfig's \
                 certificates and credentials)",
                kube_config.cluster_url
            );
            error!("{message}");
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let started = match tenant_base {
        Some(base) => Controller::start_management(&config, &kube_config, client, base).await,
        None => Controller::start(&config, &kube_config, client).await,
    };
    let controller = match started {
        Ok(controller) => controller,
        Err(message) => {
            error!("{message}");
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_DRIFT_OR_FAILURE);
        }
    };
    cancel_on_signals(controller.cancel.clone());
    controller.wait().await;
    info!("stopped");
    ExitCode::from(EXIT_OK)
}

/// Why `check` gave up waiting for the API.
#[derive(Debug, thiserror::Error)]
enum ApiWaitError {
    #[error("{0}")]
    Api(kube::Error),
    #[error("timed out")]
    TimedOut,
}

/// Retries `GET /version` until it answers or `timeout` passes; returns the last error.
async fn wait_for_api(client: &kube::Client, timeout: Duration) -> Result<(), ApiWaitError> {
    use backon::Retryable;
    let deadline = tokio::time::Instant::now() + timeout;
    let attempt = || async {
        match tokio::time::timeout_at(deadline, client.apiserver_version()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => Err(ApiWaitError::Api(err)),
            Err(_) => Err(ApiWaitError::TimedOut),
        }
    };
    attempt
        .retry(reconcilers::retry::backoff(
            Duration::from_millis(200),
            Duration::from_secs(2),
        ))
        .when(|_| tokio::time::Instant::now() < deadline)
        .await
}

async fn check(config: Config, timeout: Duration, output: OutputFormat) -> ExitCode {
    init_logging(config.log_format, "warn");
    let fail = |message: String| {
        eprintln!("error: {message}");
        ExitCode::from(EXIT_CONFIG)
    };
    let kube_config = match kubeconfig::load(config.kubeconfig.as_deref()).await {
        Ok(kube_config) => kube_config,
        Err(err) => return fail(err.to_string()),
    };
    let server = kube_config.cluster_url.to_string();
    let client = match crate::client::build(&kube_config, config.kubeconfig.as_deref()) {
        Ok(client) => client,
        Err(err) => {
            return fail(format!(
                "cannot build a Kubernetes client for {server}: {err}"
            ));
        }
    };
    if let Err(err) = wait_for_api(&client, timeout).await {
        return fail(format!(
            "cannot reach the API server at {server} within {}: {err} (check the kubeconfig \
             and that the server is up, or raise --timeout)",
            format_duration(timeout)
        ));
    }
    let mut registry = new_registry();
    let metrics = RunnerMetrics::register(&mut registry);
    let loops = build_loops(&config, &client, &mut registry);
    let results = check_once(&loops, client, &metrics, timeout).await;
    let (text, code) = check_report(&server, &results, output);
    print!("{text}");
    ExitCode::from(code)
}

/// Renders the `check` report and picks the exit status.
pub fn check_report(server: &str, results: &[CheckResult], output: OutputFormat) -> (String, u8) {
    let errors = results.iter().filter(|r| r.result.is_err()).count();
    let drifting = results
        .iter()
        .filter(|r| r.result.as_ref().is_ok_and(|report| !report.is_clean()))
        .count();
    let (verdict, code) = if errors > 0 {
        ("error", EXIT_CONFIG)
    } else if drifting > 0 {
        ("drift", EXIT_DRIFT_OR_FAILURE)
    } else {
        ("clean", EXIT_OK)
    };
    let text = match output {
        OutputFormat::Json => {
            let loops: Vec<_> = results
                .iter()
                .map(|result| match &result.result {
                    Ok(report) => serde_json::json!({
                        "name": result.name,
                        "drift": report.drift.iter().map(|drift| serde_json::json!({
                            "kind": drift.kind,
                            "object": drift.object,
                            "action": drift.action.as_str(),
                            "message": drift.message,
                        })).collect::<Vec<_>>(),
                    }),
                    Err(err) => {
                        serde_json::json!({ "name": result.name, "error": err.to_string() })
                    }
                })
                .collect();
            let document = serde_json::json!({
                "server": server,
                "result": verdict,
                "loops": loops,
            });
            format!("{document:#}\n")
        }
        OutputFormat::Text => {
            let mut out = format!("Checked {server} (dry run: nothing was written)\n\n");
            if results.is_empty() {
                out.push_str("No loop is enabled.\n");
            }
            for result in results {
                match &result.result {
                    Ok(report) if report.is_clean() => {
                        out.push_str(&format!("{}: no drift\n", result.name));
                    }
                    Ok(report) => {
                        out.push_str(&format!("{}: {} drift\n", result.name, report.drift.len()));
                        for drift in &report.drift {
                            out.push_str(&format!(
                                "  - {} [{}] {}: {}\n",
                                drift.object,
                                drift.kind,
                                would(drift.action),
                                drift.message
                            ));
                        }
                    }
                    Err(err) => out.push_str(&format!("{}: ERROR: {err}\n", result.name)),
                }
            }
            out.push('\n');
            out.push_str(&match verdict {
                "error" => format!(
                    "Result: {errors} of {} loops could not be checked (exit {code})\n",
                    results.len()
                ),
                "drift" => format!(
                    "Result: drift in {drifting} of {} loops (exit {code})\n",
                    results.len()
                ),
                _ => format!("Result: no drift (exit {code})\n"),
            });
            out
        }
    };
    (text, code)
}

fn would(action: reconcilers::Action) -> &'static str {
    match action {
        reconcilers::Action::Create => "would create",
        reconcilers::Action::Update => "would update",
        reconcilers::Action::Delete => "would delete",
        reconcilers::Action::Report => "report only",
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::CommandFactory;
    use reconcilers::{Action, Drift, PassReport};

    use super::*;

    #[test]
    fn verify_cli() {
        Cli::command().debug_assert();
    }

    #[test]
    fn every_config_flag_has_a_bootstrap_env_var() {
        let command = Cli::command();
        for arg in command.get_arguments() {
            if arg.get_long().is_none() || matches!(arg.get_id().as_str(), "help" | "version") {
                continue;
            }
            let env = arg
                .get_env()
                .unwrap_or_else(|| panic!("--{} has no env var", arg.get_id()));
            assert!(env.to_string_lossy().starts_with("BOOTSTRAP_"), "{env:?}");
        }
    }

    #[test]
    fn flags_parse_after_the_subcommand() {
        let cli = Cli::try_parse_from([
            "bootstrap-controller",
            "run",
            "--dry-run",
            "--service-cluster-ip-range=10.96.0.0/12",
            "--leader-elect=false",
        ])
        .unwrap();
        assert!(matches!(cli.command, Command::Run));
        assert_eq!(cli.config.dry_run, Some(true));
        assert_eq!(cli.config.leader_elect, Some(false));
        let config = Config::load(&cli.config).unwrap();
        assert!(config.dry_run);
        assert!(!config.leader_election.enabled);
    }

    #[test]
    fn check_report_exit_codes() {
        let clean = CheckResult {
            name: "a",
            result: Ok(PassReport::default()),
        };
        let drift = CheckResult {
            name: "system-namespaces",
            result: Ok(PassReport {
                drift: vec![Drift {
                    kind: "namespace_missing",
                    object: "Namespace/kube-public".to_owned(),
                    action: Action::Create,
                    message: "namespace kube-public is missing".to_owned(),
                    applied: false,
                }],
            }),
        };
        let failed = CheckResult {
            name: "b",
            result: Err(crate::runner::PassError::Failed(
                reconcilers::LoopError::Other("connection refused".to_owned()),
            )),
        };
        let (text, code) = check_report(
            "https://x",
            std::slice::from_ref(&clean),
            OutputFormat::Text,
        );
        assert_eq!(code, 0, "{text}");
        let (text, code) = check_report("https://x", &[clean, drift], OutputFormat::Text);
        assert_eq!(code, 1);
        assert!(
            text.contains("Namespace/kube-public [namespace_missing] would create"),
            "{text}"
        );
        let (text, code) = check_report("https://x", &[failed], OutputFormat::Json);
        assert_eq!(code, 2);
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(json["result"], "error");
        assert_eq!(json["loops"][0]["error"], "connection refused");
    }
}

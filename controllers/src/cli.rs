//! The binary's command line: `run`, `check`, `config validate`, `config print`, `sidecar
//! manifest`.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::config::{
    Config, ConfigArgs, ConfigError, ConfigErrors, LogFormat, TenantBase, format_duration,
    parse_duration, positive_duration,
};
use crate::kubeconfig;
use crate::metrics::{RunnerMetrics, new_registry};
use crate::process::{Controller, StartError};
use crate::runner::build_loops;
use crate::runner::{CheckResult, check_once};
use crate::tenant_kubeconfig;
use reconcilers::sanitize::Sanitized;

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
#[command(
    name = "bootstrap-controller",
    version = crate::build_info::LONG_VERSION,
    about,
    long_about
)]
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
    /// Install as a sidecar: generate its static pod manifest for this control-plane node.
    #[command(subcommand)]
    Sidecar(SidecarCommand),
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

#[derive(Debug, Subcommand)]
pub enum SidecarCommand {
    /// Print the sidecar's static pod manifest (deploy/sidecar/bootstrap-controller.yaml) for
    /// this node, with the values of kube-apiserver's flags read from its static pod manifest:
    /// --service-cluster-ip-range, --service-node-port-range, --secure-port,
    /// --advertise-address (and with --etcd its etcd client flags), kube-apiserver's defaults
    /// for those it does not set. Reads no cluster and none of the controller's settings.
    ///
    /// stderr says what was read and whether kube-apiserver runs with
    /// --endpoint-reconciler-type=none, as the sidecar needs; if not, how to set it (kubeadm's
    /// apiServer.extraArgs, or the static pod manifest's command). Exit status: 0 printed, 2
    /// the manifest could not be read or a value is invalid (the message names the flag or
    /// field and the fix).
    #[command(
        after_help = "Example, as root on each control-plane node:\n  bootstrap-controller sidecar manifest -o /etc/kubernetes/manifests/bootstrap-controller.yaml"
    )]
    Manifest(crate::sidecar::ManifestArgs),
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
        Command::Sidecar(SidecarCommand::Manifest(args)) => {
            // The controller's settings are accepted by every subcommand's parser; this one
            // takes its values from kube-apiserver's manifest, and ignoring a flag given here
            // would hide that it does nothing.
            let given = cli.config.given_flags();
            if !given.is_empty() {
                return config_error(&ConfigErrors(
                    given
                        .into_iter()
                        .map(|flag| {
                            ConfigError::new(
                                flag,
                                "is a setting of the controller, which `sidecar manifest` does \
                                 not read (it takes kube-apiserver's values from its manifest): \
                                 remove it, or unset its BOOTSTRAP_ environment variable",
                            )
                        })
                        .collect(),
                ));
            }
            sidecar_manifest(&args)
        }
        Command::Config(ConfigCommand::Validate) => config_validate(&cli.config),
        Command::Config(ConfigCommand::Print) => config_print(&cli.config),
        Command::Run => run_command(&cli.config).await,
        Command::Check { timeout, output } => check_command(&cli.config, &timeout, output).await,
    }
}

/// `config validate`: every error of the file given with `--config`, or that it is valid.
fn config_validate(args: &ConfigArgs) -> ExitCode {
    let Some(file) = args.config.clone() else {
        return config_error(&ConfigErrors(vec![ConfigError::new(
            "--config",
            "config validate checks the file given with --config FILE (or \
             BOOTSTRAP_CONFIG); none was given",
        )]));
    };
    print_variable_warnings();
    match load_process(args) {
        Ok(_) => {
            println!("{}: configuration is valid", file.display());
            ExitCode::from(EXIT_OK)
        }
        Err(errors) => config_error(&errors),
    }
}

/// `config print`: the effective configuration as YAML.
fn config_print(args: &ConfigArgs) -> ExitCode {
    print_variable_warnings();
    match load_process(args) {
        Ok((config, _)) => match config.to_yaml() {
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
    }
}

/// `run`: one cluster, or (with the tenants settings) management mode.
async fn run_command(args: &ConfigArgs) -> ExitCode {
    let (config, base) = match load_process(args) {
        Ok(loaded) => loaded,
        Err(errors) => return config_error(&errors),
    };
    let (kube_config, client) = match connect(&config, "info").await {
        Ok(connected) => connected,
        Err(message) => {
            error!("{message}");
            eprintln!("error: {message}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let started = match base {
        // Management mode: the tenants of the management cluster, each from `base`.
        Some(base) => Controller::start_management(&config, &kube_config, client, base).await,
        None => Controller::start(&config, &kube_config, client).await,
    };
    serve(started).await
}

/// `check`: one dry-run pass of every loop against one cluster.
async fn check_command(args: &ConfigArgs, timeout: &str, output: OutputFormat) -> ExitCode {
    let mut errors = Vec::new();
    let Some(timeout) = positive_duration("--timeout", parse_duration(timeout), &mut errors) else {
        return config_error(&ConfigErrors(errors));
    };
    match load_config(args) {
        Ok(config) if config.tenants.is_some() => {
            config_error(&ConfigErrors(vec![ConfigError::new(
                "--tenants-secret-selector",
                "check works on one cluster: point --kubeconfig at one tenant's kubeconfig and \
                 leave the tenants settings out",
            )]))
        }
        Ok(config) => check(config, timeout, output).await,
        Err(errors) => config_error(&errors),
    }
}

/// The message for clap's error about a value it parses itself (`--log-format`,
/// `--endpoint-reconciler-type`), naming the environment variable when the value came from
/// there, not from a flag `argv` never held; `None` for any other error.
pub fn env_value_error(
    err: &clap::Error,
    argv: impl IntoIterator<Item = std::ffi::OsString>,
) -> Option<String> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if err.kind() != ErrorKind::InvalidValue {
        return None;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return None;
    };
    let flag = arg.split(['[', ' ', '=']).next()?;
    let setting = crate::config::SETTINGS
        .iter()
        .find(|setting| setting.flag == flag)?;
    std::env::var_os(setting.env)?;
    let typed = argv.into_iter().any(|given| {
        let given = given.to_string_lossy();
        given == flag || given.starts_with(&format!("{flag}="))
    });
    (!typed).then(|| {
        err.render().to_string().replacen(
            &format!("'{arg}'"),
            &format!("{} (the variable of {flag})", setting.env),
            1,
        )
    })
}

/// The configuration `run` starts with and, in management mode, the base of every tenant's: a
/// file the tenants cannot use is refused now, not once per tenant, and `config validate` and
/// `config print` refuse what `run` refuses.
fn load_process(args: &ConfigArgs) -> Result<(Config, Option<TenantBase>), ConfigErrors> {
    let config = load_config(args)?;
    let base = TenantBase::load(args, &config)?;
    Ok((config, base))
}

/// [`Config::load`], with the environment checked too: a variable with the settings' prefix
/// that names no setting is an error when it is near one (surely meant), a warning otherwise
/// ([`variable_warnings`], which the caller reports in its own output format).
fn load_config(args: &ConfigArgs) -> Result<Config, ConfigErrors> {
    let names = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    let (mut errors, _warnings) = crate::config::unknown_variables(names);
    match Config::load(args) {
        Ok(config) if errors.is_empty() => Ok(config),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(more) => {
            errors.extend(more.0);
            Err(ConfigErrors(errors))
        }
    }
}

/// The variables with the settings' prefix that name no setting and are near none: ignored,
/// and said so once at start, as a log line where there is a log (so that a JSON log stays
/// one JSON object a line), else on stderr.
fn variable_warnings() -> Vec<String> {
    let names = std::env::vars_os().filter_map(|(name, _)| name.into_string().ok());
    crate::config::unknown_variables(names).1
}

fn print_variable_warnings() {
    for warning in variable_warnings() {
        eprintln!("warning: {warning}");
    }
}

fn sidecar_manifest(args: &crate::sidecar::ManifestArgs) -> ExitCode {
    let (manifest, notes) = match crate::sidecar::run_manifest(args) {
        Ok(generated) => generated,
        Err(err) => {
            eprintln!("error: {err}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    match &args.output {
        Some(path) => {
            if let Err(err) = crate::sidecar::write_atomically(path, &manifest) {
                eprintln!("error: {err}");
                return ExitCode::from(EXIT_CONFIG);
            }
            eprintln!("wrote {}", path.display());
        }
        None => print!("{manifest}"),
    }
    eprint!("{notes}");
    ExitCode::from(EXIT_OK)
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
        LogFormat::Text => builder
            .fmt_fields(crate::log_format::EscapedFields)
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_writer(crate::log_format::SanitizedJson(std::io::stderr))
            .try_init(),
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

/// Starts the log as configured (`default_filter` without RUST_LOG), then makes the client of
/// `--kubeconfig`; the error is the message saying why it cannot.
async fn connect(
    config: &Config,
    default_filter: &str,
) -> Result<(kube::Config, kube::Client), String> {
    init_logging(config.log_format, default_filter);
    for warning in variable_warnings() {
        warn!("{warning}");
    }
    let kube_config = kubeconfig::load(config.kubeconfig.as_deref())
        .await
        .map_err(|err| err.to_string())?;
    let client =
        crate::client::build(&kube_config, config.kubeconfig.as_deref()).map_err(|err| {
            format!(
                "cannot build a Kubernetes client for {}: {err} (check the kubeconfig's \
             certificates and credentials)",
                kube_config.cluster_url
            )
        })?;
    Ok((kube_config, client))
}

/// Runs the started controller until a signal stops it.
async fn serve(started: Result<Controller, StartError>) -> ExitCode {
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
    Api(String),
    #[error("timed out")]
    TimedOut,
}

/// Retries `GET /version` until it answers or `timeout` passes; returns the last error an
/// answer or a connection gave (an attempt cut by the deadline says less than the one before).
async fn wait_for_api(client: &kube::Client, timeout: Duration) -> Result<(), ApiWaitError> {
    use backon::Retryable;
    let deadline = tokio::time::Instant::now() + timeout;
    let last = std::sync::Mutex::new(None::<kube::Error>);
    let attempt = || async {
        match tokio::time::timeout_at(deadline, client.apiserver_version()).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(err)) => {
                let said = ApiWaitError::Api(crate::client::describe(&err));
                if let Ok(mut last) = last.lock() {
                    *last = Some(err);
                }
                Err(said)
            }
            Err(_) => Err(last
                .lock()
                .ok()
                .and_then(|last| last.as_ref().map(crate::client::describe))
                .map_or(ApiWaitError::TimedOut, ApiWaitError::Api)),
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
    let fail = |message: String| {
        eprintln!("error: {message}");
        ExitCode::from(EXIT_CONFIG)
    };
    let (kube_config, client) = match connect(&config, "warn").await {
        Ok(connected) => connected,
        Err(message) => return fail(message),
    };
    let server = kube_config.cluster_url.to_string();
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
                            "object": Sanitized::new(&drift.object).into_string(),
                            "action": drift.action.as_str(),
                            "message": Sanitized::new(&drift.message).into_string(),
                        })).collect::<Vec<_>>(),
                    }),
                    Err(err) => {
                        serde_json::json!({ "name": result.name, "error": Sanitized::of(err).into_string() })
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
                            // Names and text from the API or etcd: escaped and cut, as in the log.
                            out.push_str(&format!(
                                "  - {} [{}] {}: {}\n",
                                Sanitized::new(&drift.object),
                                drift.kind,
                                would(drift.action),
                                Sanitized::new(&drift.message)
                            ));
                        }
                    }
                    // An API's or etcd's text: escaped and cut, as in the log.
                    Err(err) => {
                        let err = Sanitized::of(err);
                        out.push_str(&format!("{}: ERROR: {err}\n", result.name));
                    }
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
        assert_eq!(cli.config.dry_run.as_deref(), Some("true"));
        assert_eq!(cli.config.leader_elect.as_deref(), Some("false"));
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
                    change: None,
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

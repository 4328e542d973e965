//! A tenant's kubeconfig, read from a Secret of the management cluster.
//!
//! Whoever may write Secrets in the tenants' namespace (a team, or a Cluster API, Kamaji or
//! HyperShift controller acting for one) writes these kubeconfigs, so they are untrusted input:
//! the controller uses only the material a kubeconfig carries inline, as Flux does with
//! kubeconfig Secrets (`fluxcd/pkg` `runtime/client/kubeconfig.go`). Refused, each naming its
//! field, in every cluster and user entry whether the current context uses it or not:
//!
//! - file paths (`certificate-authority`, `client-certificate`, `client-key`, `tokenFile`):
//!   they name files of the controller's own filesystem, such as its service-account token;
//! - `exec` credential plugins, unless the operator allows the command
//!   ([`CredentialPolicy`]); nothing in a Secret widens that list;
//! - `auth-provider` (its gcp `cmd-path` runs a program, its oidc refresh sends secrets to an
//!   issuer the kubeconfig names);
//! - `insecure-skip-tls-verify`, and servers that are not `https://`;
//! - `proxy-url` (this build has no proxy support; a proxy would also see where the controller
//!   connects).
//!
//! Messages name fields and never quote a value, a file or a plugin's output. An allowed plugin
//! runs under [`PLUGIN_SUBCOMMAND`], this program's own subcommand, which bounds its time and
//! output and keeps its stderr out of every message.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::config::{ExecInteractiveMode, KubeConfigOptions, Kubeconfig};

/// The largest kubeconfig read from a Secret. A whole Secret is at most 1 MiB in kube-apiserver;
/// real kubeconfigs (a CA bundle and a client certificate) are a few KiB.
pub const MAX_KUBECONFIG_BYTES: usize = 1024 * 1024;

/// The hidden subcommand that runs an allowed credential plugin for kube's client.
pub const PLUGIN_SUBCOMMAND: &str = "credential-plugin";

/// How long an allowed credential plugin may run before it is killed.
pub const PLUGIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The most a credential plugin may print (an `ExecCredential` is a few KiB).
pub const PLUGIN_MAX_OUTPUT: usize = 256 * 1024;

/// What the operator allows a tenant kubeconfig beyond inline material.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CredentialPolicy {
    /// Credential plugins tenants may name in `exec.command`: absolute paths. A kubeconfig
    /// names one by this path or by its file name alone (`aws`, `gke-gcloud-auth-plugin`, as
    /// the tools that write kubeconfigs do); either way this path runs, never a `PATH` lookup.
    pub plugins: Vec<PathBuf>,
    /// The program that runs allowed plugins under their bounds (this binary); `None` refuses
    /// every plugin.
    pub runner: Option<PathBuf>,
}

impl CredentialPolicy {
    /// The allowed plugin a kubeconfig's `exec.command` names, if any.
    fn plugin(&self, command: &str) -> Option<&Path> {
        let named = Path::new(command);
        if named.is_absolute() {
            return self
                .plugins
                .iter()
                .find(|allowed| allowed.as_path() == named)
                .map(PathBuf::as_path);
        }
        if command.contains('/') {
            return None;
        }
        let mut by_name = self
            .plugins
            .iter()
            .filter(|allowed| allowed.file_name().is_some_and(|name| name == command));
        match (by_name.next(), by_name.next()) {
            (Some(one), None) => Some(one.as_path()),
            _ => None,
        }
    }
}

/// One refused field of a tenant kubeconfig.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Its path in the kubeconfig, e.g. `users[admin].user.tokenFile`.
    pub field: String,
    /// Why, and what to write instead.
    pub reason: String,
}

/// Why a tenant's kubeconfig cannot be used. The messages start with where it came from.
#[derive(Debug, thiserror::Error)]
pub enum TenantKubeconfigError {
    #[error(
        "{source_name} is {size} bytes; a kubeconfig over {MAX_KUBECONFIG_BYTES} bytes is refused"
    )]
    TooLarge { source_name: String, size: usize },
    #[error("{source_name} is not text (a kubeconfig is YAML)")]
    NotText { source_name: String },
    #[error("{source_name} is not a kubeconfig: {cause}")]
    Parse { source_name: String, cause: String },
    #[error("{source_name} is refused: {}", list(.refusals))]
    Refused {
        source_name: String,
        refusals: Vec<Refusal>,
    },
    #[error("{source_name} is not usable: {cause} (check its current-context, cluster and user)")]
    Unusable { source_name: String, cause: String },
}

impl TenantKubeconfigError {
    /// The refused fields (empty for the other errors).
    pub fn refusals(&self) -> &[Refusal] {
        match self {
            TenantKubeconfigError::Refused { refusals, .. } => refusals,
            _ => &[],
        }
    }
}

fn list(refusals: &[Refusal]) -> String {
    refusals
        .iter()
        .map(|r| format!("{} {}", r.field, r.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Reads a tenant's kubeconfig (the bytes of its Secret's data key) under `policy`: refuses
/// what [the module](self) lists, and gives the client configuration of its current context.
/// Reads no file and runs nothing (an allowed plugin runs later, when the client authenticates).
pub async fn read(
    bytes: &[u8],
    source_name: &str,
    policy: &CredentialPolicy,
) -> Result<kube::Config, TenantKubeconfigError> {
    if bytes.len() > MAX_KUBECONFIG_BYTES {
        return Err(TenantKubeconfigError::TooLarge {
            source_name: source_name.to_owned(),
            size: bytes.len(),
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|_| TenantKubeconfigError::NotText {
        source_name: source_name.to_owned(),
    })?;
    let mut kubeconfig =
        Kubeconfig::from_yaml(text).map_err(|err| TenantKubeconfigError::Parse {
            source_name: source_name.to_owned(),
            cause: parse_cause(&err),
        })?;
    let refusals = check(&kubeconfig, policy);
    if !refusals.is_empty() {
        return Err(TenantKubeconfigError::Refused {
            source_name: source_name.to_owned(),
            refusals,
        });
    }
    run_plugins_bounded(&mut kubeconfig, policy);
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|err| TenantKubeconfigError::Unusable {
            source_name: source_name.to_owned(),
            cause: err.to_string(),
        })?;
    crate::kubeconfig::finish(config, source_name.to_owned()).map_err(|err| {
        TenantKubeconfigError::Unusable {
            source_name: source_name.to_owned(),
            cause: err.to_string(),
        }
    })
}

/// The YAML parser's first line: where and what, without quoting the document.
fn parse_cause(err: &kube::config::KubeconfigError) -> String {
    let cause = std::error::Error::source(err).map_or_else(|| err.to_string(), ToString::to_string);
    cause
        .lines()
        .next()
        .unwrap_or("invalid YAML")
        .trim()
        .to_owned()
}

/// Every refused field of `kubeconfig`, in document order.
pub fn check(kubeconfig: &Kubeconfig, policy: &CredentialPolicy) -> Vec<Refusal> {
    let mut refusals = Vec::new();
    let mut refuse = |field: String, reason: &str| {
        refusals.push(Refusal {
            field,
            reason: reason.to_owned(),
        });
    };
    check_clusters(kubeconfig, &mut refuse);
    check_users(kubeconfig, policy, &mut refuse);
    refusals
}

/// The clusters' refused fields: a server reached without TLS, a CA from a file, verification
/// off, a proxy.
fn check_clusters(kubeconfig: &Kubeconfig, refuse: &mut dyn FnMut(String, &str)) {
    for named in &kubeconfig.clusters {
        let Some(cluster) = &named.cluster else {
            continue;
        };
        let at = |key: &str| format!("clusters[{}].cluster.{key}", named.name);
        if let Some(server) = &cluster.server {
            let https = server
                .parse::<http::Uri>()
                .is_ok_and(|uri| uri.scheme_str() == Some("https") && uri.authority().is_some());
            if !https {
                refuse(
                    at("server"),
                    "must be an https:// URL: tenant credentials are sent over TLS only",
                );
            }
        }
        if cluster.certificate_authority.is_some() {
            refuse(
                at("certificate-authority"),
                "names a file on the controller's filesystem: put the CA bundle inline as \
                 certificate-authority-data",
            );
        }
        if cluster.insecure_skip_tls_verify == Some(true) {
            refuse(
                at("insecure-skip-tls-verify"),
                "turns off the server's verification: remove it and give the tenant API's CA as \
                 certificate-authority-data",
            );
        }
        if cluster.proxy_url.is_some() {
            refuse(
                at("proxy-url"),
                "is not supported for tenant clusters: the controller connects to the server \
                 directly; remove it",
            );
        }
    }
}

/// The users' refused fields: credentials from files, auth providers, plugins the operator
/// does not allow or that a tenant would steer.
fn check_users(
    kubeconfig: &Kubeconfig,
    policy: &CredentialPolicy,
    refuse: &mut dyn FnMut(String, &str),
) {
    for named in &kubeconfig.auth_infos {
        let Some(user) = &named.auth_info else {
            continue;
        };
        let at = |key: &str| format!("users[{}].user.{key}", named.name);
        for (present, key, inline) in [
            (user.token_file.is_some(), "tokenFile", "token"),
            (
                user.client_certificate.is_some(),
                "client-certificate",
                "client-certificate-data",
            ),
            (user.client_key.is_some(), "client-key", "client-key-data"),
        ] {
            if present {
                refuse(
                    at(key),
                    &format!(
                        "names a file on the controller's filesystem: put the credential inline \
                         as {inline}"
                    ),
                );
            }
        }
        if user.auth_provider.is_some() {
            refuse(
                at("auth-provider"),
                "is not supported for tenant kubeconfigs (auth providers run programs and send \
                 refresh tokens to issuers the kubeconfig names): use a token, client \
                 certificate data, or a credential plugin the operator allows",
            );
        }
        if let Some(exec) = &user.exec {
            let command = exec.command.as_deref().unwrap_or_default();
            if policy.runner.is_none() || policy.plugin(command).is_none() {
                refuse(
                    at("exec.command"),
                    "runs a program inside the controller: refused unless the operator allows \
                     that command (--tenants-credential-plugins, tenants.credentialPlugins)",
                );
            } else {
                if exec.env.as_ref().is_some_and(|env| !env.is_empty()) {
                    refuse(
                        at("exec.env"),
                        "cannot be set by a tenant kubeconfig (variables steer what a plugin \
                         reads and runs): set what the plugin needs on the controller's pod",
                    );
                }
                if exec.interactive_mode == Some(ExecInteractiveMode::Always) {
                    refuse(
                        at("exec.interactiveMode"),
                        "Always needs a terminal, which the controller does not have: use Never",
                    );
                }
            }
        }
    }
}

/// Makes kube run each (allowed) plugin through [`PLUGIN_SUBCOMMAND`]: the allowed path, never
/// a `PATH` lookup, under a deadline and an output cap, without a terminal.
fn run_plugins_bounded(kubeconfig: &mut Kubeconfig, policy: &CredentialPolicy) {
    let Some(runner) = &policy.runner else {
        return;
    };
    for named in &mut kubeconfig.auth_infos {
        let Some(exec) = named.auth_info.as_mut().and_then(|user| user.exec.as_mut()) else {
            continue;
        };
        let Some(plugin) = policy.plugin(exec.command.as_deref().unwrap_or_default()) else {
            continue;
        };
        let mut args = vec![
            PLUGIN_SUBCOMMAND.to_owned(),
            "--".to_owned(),
            plugin.display().to_string(),
        ];
        args.extend(exec.args.take().unwrap_or_default());
        exec.command = Some(runner.display().to_string());
        exec.args = Some(args);
        exec.interactive_mode = Some(ExecInteractiveMode::Never);
    }
}

/// Runs an allowed credential plugin for kube's client: stdin and stderr closed, stdout passed
/// on up to [`PLUGIN_MAX_OUTPUT`], killed after [`PLUGIN_TIMEOUT`]. On failure it prints one
/// line of its own (never the plugin's output, which may hold secrets or what the plugin read)
/// and exits 1.
pub async fn run_plugin(command: &[String]) -> std::process::ExitCode {
    use std::process::{ExitCode, Stdio};
    use tokio::io::AsyncReadExt;

    let fail = |message: String| {
        eprintln!("{message}");
        ExitCode::from(1)
    };
    let Some((program, args)) = command.split_first() else {
        return fail(format!("{PLUGIN_SUBCOMMAND}: no command given"));
    };
    let mut child = match tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
    {
        Ok(child) => child,
        Err(err) => return fail(format!("credential plugin {program} cannot start: {err}")),
    };
    let Some(mut stdout) = child.stdout.take() else {
        return fail(format!("credential plugin {program}: no output pipe"));
    };
    enum Outcome {
        Printed(Vec<u8>),
        TooLong,
        Failed(String),
    }
    let limit = u64::try_from(PLUGIN_MAX_OUTPUT).unwrap_or(u64::MAX) + 1;
    let run = async {
        let mut output = Vec::new();
        if let Err(err) = (&mut stdout).take(limit).read_to_end(&mut output).await {
            return Outcome::Failed(err.to_string());
        }
        if output.len() > PLUGIN_MAX_OUTPUT {
            return Outcome::TooLong;
        }
        match child.wait().await {
            Ok(status) if status.success() => Outcome::Printed(output),
            Ok(status) => Outcome::Failed(format!("failed ({status})")),
            Err(err) => Outcome::Failed(err.to_string()),
        }
    };
    let outcome = tokio::time::timeout(PLUGIN_TIMEOUT, run).await;
    if !matches!(outcome, Ok(Outcome::Printed(_) | Outcome::Failed(_))) {
        // Killed and reaped here, so nothing of it outlives this process.
        let _ = child.kill().await;
    }
    match outcome {
        Err(_) => fail(format!(
            "credential plugin {program} did not finish within {} s; killed",
            PLUGIN_TIMEOUT.as_secs()
        )),
        Ok(Outcome::TooLong) => fail(format!(
            "credential plugin {program} printed more than {PLUGIN_MAX_OUTPUT} bytes; killed"
        )),
        Ok(Outcome::Failed(why)) => fail(format!("credential plugin {program}: {why}")),
        Ok(Outcome::Printed(output)) => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            match out.write_all(&output).and_then(|()| out.flush()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(err) => fail(format!(
                    "{PLUGIN_SUBCOMMAND}: cannot pass the output on: {err}"
                )),
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const CA: &str = "LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUJkekNDQVIyZ0F3SUJBZ0lVRjgKLS0tLS1FTkQgQ0VSVElGSUNBVEUtLS0tLQo=";

    fn kubeconfig(cluster: &str, user: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\ncurrent-context: t\ncontexts:\n- name: t\n  context: \
             {{cluster: c, user: u}}\nclusters:\n- name: c\n  cluster:\n{cluster}users:\n- name: \
             u\n  user:\n{user}"
        )
    }

    fn refusals(text: &str, policy: &CredentialPolicy) -> Vec<String> {
        check(&Kubeconfig::from_yaml(text).unwrap(), policy)
            .into_iter()
            .map(|r| r.field)
            .collect()
    }

    fn allowing(paths: &[&str]) -> CredentialPolicy {
        CredentialPolicy {
            plugins: paths.iter().map(PathBuf::from).collect(),
            runner: Some(PathBuf::from("/bootstrap-controller")),
        }
    }

    #[test]
    fn inline_material_is_accepted() {
        let text = kubeconfig(
            &format!(
                "    server: https://192.0.2.10:6443\n    certificate-authority-data: {CA}\n    \
                 tls-server-name: api.example\n"
            ),
            "    token: abc\n    client-certificate-data: Zm9v\n    client-key-data: YmFy\n",
        );
        assert_eq!(
            refusals(&text, &CredentialPolicy::default()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn every_file_path_exec_provider_tls_skip_and_plain_http_is_refused_by_field() {
        let text = kubeconfig(
            "    server: http://192.0.2.10:8080\n    certificate-authority: /etc/ca.crt\n    \
             insecure-skip-tls-verify: true\n    proxy-url: http://192.0.2.99:3128\n",
            "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n    \
             client-certificate: /etc/c.crt\n    client-key: /etc/c.key\n    auth-provider:\n      \
             name: gcp\n      config: {cmd-path: /bin/sh}\n    exec:\n      apiVersion: \
             client.authentication.k8s.io/v1\n      command: /bin/sh\n      args: [-c, id]\n",
        );
        assert_eq!(
            refusals(&text, &CredentialPolicy::default()),
            [
                "clusters[c].cluster.server",
                "clusters[c].cluster.certificate-authority",
                "clusters[c].cluster.insecure-skip-tls-verify",
                "clusters[c].cluster.proxy-url",
                "users[u].user.tokenFile",
                "users[u].user.client-certificate",
                "users[u].user.client-key",
                "users[u].user.auth-provider",
                "users[u].user.exec.command",
            ]
        );
    }

    #[test]
    fn entries_the_context_does_not_use_are_checked_too() {
        let text = format!(
            "{}- name: other\n  user:\n    tokenFile: /etc/token\n",
            kubeconfig("    server: https://192.0.2.10:6443\n", "    token: abc\n")
        );
        assert_eq!(
            refusals(&text, &CredentialPolicy::default()),
            ["users[other].user.tokenFile"]
        );
    }

    #[test]
    fn a_plugin_runs_only_if_the_operator_allows_its_path_and_never_by_path_lookup() {
        let exec = |command: &str| {
            kubeconfig(
                "    server: https://192.0.2.10:6443\n",
                &format!(
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: \
                     {command}\n"
                ),
            )
        };
        let policy = allowing(&["/usr/local/bin/aws-iam-authenticator"]);
        for allowed in [
            "/usr/local/bin/aws-iam-authenticator",
            "aws-iam-authenticator",
        ] {
            assert!(refusals(&exec(allowed), &policy).is_empty(), "{allowed}");
        }
        for refused in [
            "/tmp/aws-iam-authenticator",
            "./aws-iam-authenticator",
            "bin/aws-iam-authenticator",
            "sh",
        ] {
            assert_eq!(
                refusals(&exec(refused), &policy),
                ["users[u].user.exec.command"],
                "{refused}"
            );
        }
        // Allowed, but without the program that runs plugins under their bounds: refused.
        let no_runner = CredentialPolicy {
            runner: None,
            ..policy.clone()
        };
        assert_eq!(
            refusals(&exec("aws-iam-authenticator"), &no_runner),
            ["users[u].user.exec.command"]
        );
        // Two allowed plugins with one file name: a bare name is ambiguous, refused.
        let twice = allowing(&["/a/aws-iam-authenticator", "/b/aws-iam-authenticator"]);
        assert_eq!(
            refusals(&exec("aws-iam-authenticator"), &twice),
            ["users[u].user.exec.command"]
        );
    }

    #[test]
    fn an_allowed_plugin_gets_no_environment_from_the_secret_and_no_terminal() {
        let text = kubeconfig(
            "    server: https://192.0.2.10:6443\n",
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n      \
             env: [{name: LD_PRELOAD, value: /tmp/x.so}]\n      interactiveMode: Always\n",
        );
        assert_eq!(
            refusals(&text, &allowing(&["/usr/bin/aws"])),
            [
                "users[u].user.exec.env",
                "users[u].user.exec.interactiveMode"
            ]
        );
    }

    #[tokio::test]
    async fn an_allowed_plugin_is_run_through_the_bounded_runner() {
        let text = kubeconfig(
            "    server: https://192.0.2.10:6443\n",
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: aws\n      \
             args: [eks, get-token]\n",
        );
        let config = read(text.as_bytes(), "test", &allowing(&["/usr/bin/aws"]))
            .await
            .unwrap();
        let exec = config.auth_info.exec.unwrap();
        assert_eq!(exec.command.as_deref(), Some("/bootstrap-controller"));
        assert_eq!(
            exec.args.unwrap(),
            [
                "credential-plugin",
                "--",
                "/usr/bin/aws",
                "eks",
                "get-token"
            ]
        );
        assert_eq!(exec.interactive_mode, Some(ExecInteractiveMode::Never));
    }

    #[tokio::test]
    async fn errors_name_fields_and_never_quote_values() {
        let text = kubeconfig(
            "    server: https://192.0.2.10:6443\n",
            "    tokenFile: /var/run/secrets/kubernetes.io/serviceaccount/token\n",
        );
        let err = read(
            text.as_bytes(),
            "Secret t/a key \"value\"",
            &CredentialPolicy::default(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("Secret t/a key \"value\" is refused: users[u].user.tokenFile"));
        assert!(!err.contains("/var/run"), "{err}");
    }

    #[tokio::test]
    async fn oversized_and_binary_kubeconfigs_are_refused_before_parsing() {
        let big = vec![b'#'; MAX_KUBECONFIG_BYTES + 1];
        let err = read(&big, "s", &CredentialPolicy::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, TenantKubeconfigError::TooLarge { .. }),
            "{err}"
        );
        let err = read(&[0xff, 0xfe, 0x00], "s", &CredentialPolicy::default())
            .await
            .unwrap_err();
        assert!(
            matches!(err, TenantKubeconfigError::NotText { .. }),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_alias_bomb_is_refused_quickly() {
        // "Billion laughs": each level repeats the previous ten times.
        let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
        for level in 1..10 {
            let prev = level - 1;
            text.push_str(&format!(
                "a{level}: &a{level} [*a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, *a{prev}, \
                 *a{prev}, *a{prev}, *a{prev}, *a{prev}]\n"
            ));
        }
        let started = std::time::Instant::now();
        let err = read(text.as_bytes(), "s", &CredentialPolicy::default()).await;
        assert!(err.is_err());
        // Not a timing assertion about speed: an expansion of 10^10 nodes would not end at all.
        assert!(started.elapsed() < Duration::from_secs(60));
    }
}

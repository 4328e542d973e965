//! End to end: tenant Secrets are untrusted input. The real binary runs in management mode
//! against a simulated management cluster where Secrets carry hostile kubeconfigs and fragments:
//! each is refused by its field, without a file read, a program run or a connection made, and
//! the healthy tenants are not affected. Allowed credential plugins run bounded, and what they
//! print stays out of every message.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use apiserver_sim::{
    FaultKind, FaultRule, Fleet, FleetConfig, TENANT_LABEL, Verb, kubeconfig_secret,
};
use common::{CONVERGE, ControllerProcess, eventually, free_port};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

const NAMESPACE: &str = "tenants";

/// `--tenants-etcd-allowed-cidrs` for the tests' etcds: loopback (localhost may resolve to ::1
/// as well as 127.0.0.1).
const LOOPBACK: &str = "127.0.0.0/8,::1/128";

/// Debian's etcd without TLS on free loopback ports, its data in a directory of its own.
struct PlainEtcd {
    child: std::process::Child,
    _data: tempfile::TempDir,
    port: u16,
}

impl PlainEtcd {
    async fn start() -> Result<PlainEtcd> {
        let data = tempfile::tempdir()?;
        let port = free_port()?.port();
        let peer = format!("http://127.0.0.1:{}", free_port()?.port());
        let url = format!("http://127.0.0.1:{port}");
        let child = std::process::Command::new("etcd")
            .arg("--name=plain")
            .arg(format!("--data-dir={}", data.path().join("data").display()))
            .arg(format!("--listen-client-urls={url}"))
            .arg(format!("--advertise-client-urls={url}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=plain={peer}"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .context("starting etcd (Debian: apt-get install etcd-server)")?;
        let etcd = PlainEtcd {
            child,
            _data: data,
            port,
        };
        eventually("etcd answers", CONVERGE, || async {
            Ok(etcd.stored("/health-check").await.is_ok().then_some(()))
        })
        .await?;
        Ok(etcd)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The key's value and revision, read directly.
    async fn stored(&self, key: &str) -> Result<Option<reconcilers::legacy_alloc::etcd::Stored>> {
        use reconcilers::legacy_alloc::etcd::{EtcdConfig, EtcdStore};
        let store = EtcdStore::new(EtcdConfig {
            servers: vec![self.url()],
            ..EtcdConfig::default()
        });
        Ok(store.get(key).await?)
    }
}

impl Drop for PlainEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn management_args(extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--tenants-secret-selector",
        &format!("{TENANT_LABEL}=true"),
        "--tenants-namespace",
        NAMESPACE,
        "--service-cluster-ip-range",
        "10.96.0.0/12",
        "--leader-elect=false",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

fn start_controller(fleet: &Fleet, extra: &[&str]) -> Result<ControllerProcess> {
    let args = management_args(extra);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ControllerProcess::start(fleet.management().kubeconfig_path(), &args)
}

async fn fleet(tenants: usize) -> Result<Fleet> {
    Ok(Fleet::start(FleetConfig {
        tenants,
        ..FleetConfig::default()
    })
    .await?)
}

/// A fleet of `tenants` whose own kubeconfig Secrets are deleted, so the test's are the only
/// ones, and a client of its management cluster.
async fn fleet_without_its_secrets(tenants: usize) -> Result<(Fleet, kube::Client)> {
    let fleet = fleet(tenants).await?;
    let management = fleet.management().client();
    let (secrets, _) = secrets_and_events(&management);
    for i in 0..tenants {
        secrets
            .delete(&Fleet::secret_name(i), &DeleteParams::default())
            .await?;
    }
    Ok((fleet, management))
}

/// The tenants' Secrets and the Events about them, in the management cluster.
fn secrets_and_events(management: &kube::Client) -> (Api<Secret>, Api<Event>) {
    (
        Api::namespaced(management.clone(), NAMESPACE),
        Api::namespaced(management.clone(), NAMESPACE),
    )
}

/// A kubeconfig for tenant `i` of `fleet` with a bearer token: the Secrets' usual content.
fn token_kubeconfig(fleet: &Fleet, i: usize) -> Result<String> {
    Ok(kubeconfig(&tenant_cluster(fleet, i)?, "    token: abc\n"))
}

/// Secret "zz-old" for tenant 0 with the fragment `old`, its tenant converged, then Secret
/// "aa-young" for tenant 1 with the fragment `young`, created later: creation times have a
/// resolution of one second, so "zz-old" is the older Secret though it sorts last by name.
async fn old_then_young(
    fleet: &Fleet,
    secrets: &Api<Secret>,
    old: &str,
    young: &str,
) -> Result<()> {
    create_secret(
        secrets,
        "zz-old",
        &token_kubeconfig(fleet, 0)?,
        Some(old),
        &[],
    )
    .await?;
    wait_converged(fleet, 0).await?;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    create_secret(
        secrets,
        "aa-young",
        &token_kubeconfig(fleet, 1)?,
        Some(young),
        &[],
    )
    .await
}

/// The etcd-claim tests' start: Debian's etcd, a fleet of `tenants` without their Secrets, and
/// what the tests read of the management cluster; [`ClaimTest::controller`] starts the
/// controller, allowed the loopback etcds and keeping its claim records in [`NAMESPACE`].
struct ClaimTest {
    etcd: PlainEtcd,
    fleet: Fleet,
    secrets: Api<Secret>,
    events: Api<Event>,
    records: Api<Lease>,
    args: Vec<String>,
}

impl ClaimTest {
    async fn start(tenants: usize, extra: &[&str]) -> Result<Self> {
        let etcd = PlainEtcd::start().await?;
        let (fleet, management) = fleet_without_its_secrets(tenants).await?;
        let (secrets, events) = secrets_and_events(&management);
        let mut args: Vec<String> = [
            "--tenants-etcd-allowed-cidrs",
            LOOPBACK,
            "--leader-elect-lease-namespace",
            NAMESPACE,
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        Ok(ClaimTest {
            etcd,
            fleet,
            secrets,
            events,
            records: Api::namespaced(management, NAMESPACE),
            args,
        })
    }

    /// The controller, started (again) with the same flags, once ready.
    async fn controller(&self) -> Result<ControllerProcess> {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let mut controller = start_controller(&self.fleet, &args)?;
        controller.wait_ready().await?;
        Ok(controller)
    }

    /// The claim records (Leases) in the management cluster.
    async fn claims(&self) -> Result<Vec<Lease>> {
        let selector = ListParams::default().labels("bootstrap-controller.io/etcd-claim=true");
        Ok(self.records.list(&selector).await?.items)
    }

    /// Secret "zz-old" for tenant 0 claiming `old`, then "aa-young" for tenant 1 claiming
    /// `young` ([`old_then_young`]).
    async fn old_then_young(&self, old: &str, young: &str) -> Result<()> {
        old_then_young(&self.fleet, &self.secrets, old, young).await
    }
}

/// A kubeconfig with one cluster and one user, `cluster` and `user` being their YAML bodies
/// (indented by four spaces).
fn kubeconfig(cluster: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\ncontexts:\n- name: t\n  context: \
         {{cluster: c, user: u}}\nclusters:\n- name: c\n  cluster:\n{cluster}users:\n- name: u\n  \
         user:\n{user}"
    )
}

/// Tenant `i`'s cluster section with its CA inline, as its own kubeconfig has it.
fn tenant_cluster(fleet: &Fleet, i: usize) -> Result<String> {
    let tenant = fleet.tenant(i).context("tenant")?;
    let ca = tenant.ca_pem().context("the fleet serves https")?;
    use base64::Engine;
    Ok(format!(
        "    server: {}\n    certificate-authority-data: {}\n",
        tenant.base_url(),
        base64::engine::general_purpose::STANDARD.encode(ca)
    ))
}

/// Creates a tenant Secret named `<name>-kubeconfig` through the API, as a user would.
async fn create_secret(
    secrets: &Api<Secret>,
    name: &str,
    kubeconfig: &str,
    fragment: Option<&str>,
    extra_data: &[(&str, &[u8])],
) -> Result<()> {
    let mut secret: Value = kubeconfig_secret(NAMESPACE, name, kubeconfig);
    if let Some(fragment) = fragment {
        secret["metadata"]["annotations"] = json!({"bootstrap-controller.io/config": fragment});
    }
    use base64::Engine;
    for (key, bytes) in extra_data {
        secret["data"][*key] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
    }
    secrets
        .create(&PostParams::default(), &serde_json::from_value(secret)?)
        .await?;
    Ok(())
}

/// The notes of the `TenantConfigInvalid` events, by Secret name.
async fn refusals(events: &Api<Event>) -> Result<BTreeMap<String, String>> {
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("TenantConfigInvalid"))
        .filter_map(|e| Some((e.regarding?.name?, e.note.unwrap_or_default())))
        .collect())
}

/// A TCP listener that counts the connections made to it and keeps what they sent.
struct Listener {
    port: u16,
    accepted: Arc<AtomicUsize>,
    received: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Listener {
    async fn start() -> Result<Self> {
        Self::start_on(0).await
    }

    /// On 127.0.0.1:`port` (0: a free one).
    async fn start_on(port: u16) -> Result<Self> {
        let socket = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        let port = socket.local_addr()?.port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (count, bytes) = (accepted.clone(), received.clone());
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = socket.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let bytes = bytes.clone();
                tokio::spawn(async move {
                    use tokio::io::AsyncReadExt;
                    let mut buffer = [0u8; 4096];
                    while let Ok(n) = stream.read(&mut buffer).await {
                        if n == 0 {
                            break;
                        }
                        if let Ok(mut all) = bytes.lock() {
                            all.extend_from_slice(&buffer[..n]);
                        }
                    }
                });
            }
        });
        Ok(Listener {
            port,
            accepted,
            received,
        })
    }
}

fn write_script(dir: &Path, name: &str, body: &str) -> Result<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n"))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
    Ok(path)
}

/// Whether the simulated tenant holds its bootstrap state (read through its backdoor).
fn converged(fleet: &Fleet, i: usize) -> bool {
    fleet.tenant(i).is_some_and(|tenant| {
        matches!(
            tenant.backdoor().get("services", "default", "kubernetes"),
            Ok(Some(_))
        )
    })
}

async fn wait_converged(fleet: &Fleet, i: usize) -> Result<()> {
    eventually(&format!("tenant {i} converged"), CONVERGE, || async {
        Ok(converged(fleet, i).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_kubeconfigs_and_fragments_are_refused_by_field_and_never_acted_on() -> Result<()> {
    let fleet = fleet(2).await?;
    let management = fleet.management().client();
    let (secrets, events) = secrets_and_events(&management);
    let dir = tempfile::tempdir()?;
    let listener = Listener::start().await?;
    // A credential of the controller's own, as its service-account token would be.
    let token = "controller-own-token-5b8e1c";
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, token)?;
    let marker = dir.path().join("ran");
    // Opening a FIFO for reading blocks until a writer comes: a refusal that opened it would
    // hang the tenant's load instead of answering.
    let fifo = dir.path().join("fifo");
    ensure!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()?
            .success(),
        "mkfifo"
    );
    let listen_http = format!("    server: http://127.0.0.1:{}\n", listener.port);
    let listen_https = format!("    server: https://127.0.0.1:{}\n", listener.port);
    let healthy = tenant_cluster(&fleet, 1)?;
    let marker_text = marker.display().to_string();
    let token_path = token_file.display().to_string();
    let fifo_path = fifo.display().to_string();
    let cases: Vec<(&str, String, Option<String>, &str)> = vec![
        (
            "token-file",
            kubeconfig(&listen_http, &format!("    tokenFile: {token_path}\n")),
            None,
            "users[u].user.tokenFile",
        ),
        (
            "token-file-tls",
            kubeconfig(&listen_https, &format!("    tokenFile: {token_path}\n")),
            None,
            "users[u].user.tokenFile",
        ),
        (
            "plain-http",
            kubeconfig(&listen_http, "    token: abc\n"),
            None,
            "clusters[c].cluster.server",
        ),
        (
            "exec",
            kubeconfig(
                &listen_https,
                &format!(
                    "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      \
                     command: /bin/sh\n      args: [-c, \"touch {marker_text}\"]\n"
                ),
            ),
            None,
            "users[u].user.exec.command",
        ),
        (
            "auth-provider",
            kubeconfig(
                &listen_https,
                &format!(
                    "    auth-provider:\n      name: gcp\n      config:\n        cmd-path: \
                     /bin/sh\n        cmd-args: \"-c 'touch {marker_text}'\"\n"
                ),
            ),
            None,
            "users[u].user.auth-provider",
        ),
        (
            "ca-file",
            kubeconfig(
                &format!("{listen_https}    certificate-authority: /dev/zero\n"),
                "    token: abc\n",
            ),
            None,
            "clusters[c].cluster.certificate-authority",
        ),
        (
            "client-key-file",
            kubeconfig(
                &listen_https,
                &format!("    client-certificate: {fifo_path}\n    client-key: {fifo_path}\n"),
            ),
            None,
            "users[u].user.client-certificate",
        ),
        (
            "skip-tls",
            kubeconfig(
                &format!("{listen_https}    insecure-skip-tls-verify: true\n"),
                "    token: abc\n",
            ),
            None,
            "clusters[c].cluster.insecure-skip-tls-verify",
        ),
        (
            "fragment-file",
            kubeconfig(&healthy, "    token: abc\n"),
            Some(format!(
                "etcdServers: https://127.0.0.1:{}\netcdCAFile: {fifo_path}\n",
                listener.port
            )),
            "bootstrap-controller.io/config: etcdCAFile",
        ),
        (
            "fragment-spin",
            kubeconfig(&healthy, "    token: abc\n"),
            Some("loops:\n  systemNamespaces:\n    interval: 1ms\n".to_owned()),
            "bootstrap-controller.io/config: loops.systemNamespaces.interval",
        ),
    ];
    for (name, kubeconfig, fragment, _) in &cases {
        create_secret(&secrets, name, kubeconfig, fragment.as_deref(), &[]).await?;
    }

    let mut controller = start_controller(&fleet, &[])?;
    controller.wait_ready().await?;
    // The tenants of the fleet's own Secrets are not affected.
    wait_converged(&fleet, 0).await?;
    wait_converged(&fleet, 1).await?;
    let found = eventually("every hostile Secret refused", CONVERGE, || async {
        let found = refusals(&events).await?;
        Ok((found.len() >= cases.len()).then_some(found))
    })
    .await?;
    for (name, _, _, field) in &cases {
        let secret = format!("{name}-kubeconfig");
        let note = found
            .get(&secret)
            .with_context(|| format!("no TenantConfigInvalid event for {secret}: {found:?}"))?;
        ensure!(
            note.contains(field),
            "{secret}: {note:?} does not name {field}"
        );
        ensure!(!note.contains(token), "{secret}: the note quotes the token");
    }
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    for (name, _, _, field) in &cases {
        let line = format!("[-]tenant {NAMESPACE}/{name}-kubeconfig not started: ");
        ensure!(
            readyz
                .lines()
                .any(|l| l.starts_with(&line) && l.contains(field)),
            "{line}...{field} missing in\n{readyz}"
        );
    }
    ensure!(!readyz.contains(token), "/readyz quotes the token");
    let (_, metrics) = controller.admin_get("/metrics").await?;
    let expected = format!("bootstrap_tenant_config_errors_total {}\n", cases.len());
    ensure!(
        metrics.contains(&expected),
        "{expected} missing in\n{metrics}"
    );
    ensure!(
        metrics.contains("bootstrap_tenants{state=\"running\"} 2"),
        "{metrics}"
    );

    // Nothing reached the listener (no token sent, no TLS handshake, no etcd connection),
    // nothing ran, the controller's own log holds no token either.
    ensure!(
        listener.accepted.load(Ordering::SeqCst) == 0,
        "the controller connected to the listener: {:?}",
        String::from_utf8_lossy(
            &listener
                .received
                .lock()
                .map(|b| b.clone())
                .unwrap_or_default()
        )
    );
    ensure!(!marker.exists(), "a program ran inside the controller");
    ensure!(
        !controller.log().contains(token),
        "the log quotes the token"
    );
    // Refused Secrets are reported once per version, not on every event: a label changes
    // none of what the tenant's configuration is read from.
    let patch = json!({"metadata": {"labels": {"touched": "yes"}}});
    secrets
        .patch(
            &format!("{}-kubeconfig", cases[0].0),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    // A Secret refused after it, reported, shows the controller has had the label's event.
    let (_, kubeconfig, fragment, _) = &cases[0];
    create_secret(&secrets, "late", kubeconfig, fragment.as_deref(), &[]).await?;
    eventually("the later Secret refused", CONVERGE, || async {
        Ok(refusals(&events)
            .await?
            .contains_key("late-kubeconfig")
            .then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, metrics) = controller.admin_get("/metrics").await?;
    let expected = format!("bootstrap_tenant_config_errors_total {}\n", cases.len() + 1);
    ensure!(metrics.contains(&expected), "reported again:\n{metrics}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allowed_credential_plugins_run_bounded_and_their_output_stays_private() -> Result<()> {
    let (fleet, management) = fleet_without_its_secrets(4).await?;
    let (secrets, events) = secrets_and_events(&management);
    let dir = tempfile::tempdir()?;
    let credential = r#"{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential","status":{"token":"from-the-plugin"}}"#;
    let good = write_script(dir.path(), "good-plugin", &format!("echo '{credential}'"))?;
    let pid_file = dir.path().join("hung.pid");
    let hung = write_script(
        dir.path(),
        "hung-plugin",
        &format!("echo $$ > {}\nexec sleep 600", pid_file.display()),
    )?;
    let leaky = write_script(
        dir.path(),
        "leaky-plugin",
        "echo LEAKED-SECRET-1f3a; echo LEAKED-SECRET-1f3a >&2; exit 1",
    )?;
    let allowed = [&good, &hung, &leaky]
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",");
    let exec = |command: &str| {
        format!(
            "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      command: \
             {command}\n"
        )
    };
    let mut controller =
        start_controller(&fleet, &["--tenants-credential-plugins", allowed.as_str()])?;
    controller.wait_ready().await?;

    // A plugin that never answers: its tenant waits, the manager does not.
    create_secret(
        &secrets,
        "hung",
        &kubeconfig(&tenant_cluster(&fleet, 1)?, &exec("hung-plugin")),
        None,
        &[],
    )
    .await?;
    eventually("the hung plugin started", CONVERGE, || async {
        Ok(pid_file.exists().then_some(()))
    })
    .await?;
    // Named by file name: the allowed path runs and its credential authenticates the tenant.
    create_secret(
        &secrets,
        "good",
        &kubeconfig(&tenant_cluster(&fleet, 0)?, &exec("good-plugin")),
        None,
        &[],
    )
    .await?;
    create_secret(&secrets, "token", &token_kubeconfig(&fleet, 2)?, None, &[]).await?;
    create_secret(
        &secrets,
        "leaky",
        &kubeconfig(
            &tenant_cluster(&fleet, 3)?,
            &exec(&leaky.display().to_string()),
        ),
        None,
        &[],
    )
    .await?;
    wait_converged(&fleet, 0).await?;
    wait_converged(&fleet, 2).await?;
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(
        readyz.contains(&format!(
            "[+]tenant {NAMESPACE}/hung-kubeconfig ok (starting)"
        )),
        "{readyz}"
    );
    let agent = fleet.tenant(0).context("tenant")?.requests();
    ensure!(
        agent
            .iter()
            .any(|r| r.user_agent.starts_with("bootstrap-controller/")),
        "the plugin's tenant was not reached"
    );

    let found = eventually("the leaky plugin's refusal", CONVERGE, || async {
        let found = refusals(&events).await?;
        Ok(found.contains_key("leaky-kubeconfig").then_some(found))
    })
    .await?;
    let note = &found["leaky-kubeconfig"];
    ensure!(note.contains("leaky-plugin"), "{note}");
    ensure!(
        !note.contains("LEAKED-SECRET"),
        "the event quotes the plugin: {note}"
    );

    // The hung plugin is killed at its deadline, and its tenant is reported.
    let pid: u32 = std::fs::read_to_string(&pid_file)?.trim().parse()?;
    let found = eventually(
        "the hung plugin's refusal",
        Duration::from_secs(90),
        || async {
            let found = refusals(&events).await?;
            Ok(found.contains_key("hung-kubeconfig").then_some(found))
        },
    )
    .await?;
    ensure!(
        found["hung-kubeconfig"].contains("did not finish within 30 s"),
        "{}",
        found["hung-kubeconfig"]
    );
    ensure!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "the hung plugin (pid {pid}) still runs"
    );
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(!readyz.contains("LEAKED-SECRET"), "{readyz}");
    ensure!(
        !controller.log().contains("LEAKED-SECRET"),
        "the log quotes the plugin"
    );
    ensure!(converged(&fleet, 0) && converged(&fleet, 2));
    Ok(())
}

/// Claims never recorded go by the Secrets' age; a recorded claim outlives its Secret deleted
/// and created again (another uid, a later creation), so the tenant refused for its keys stays
/// refused, also across a restart, and the returning tenant keeps them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_whose_etcd_keys_overlap_are_refused_the_younger_first() -> Result<()> {
    let test = ClaimTest::start(3, &[]).await?;
    let ClaimTest {
        fleet,
        secrets,
        events,
        ..
    } = &test;
    let mut controller = test.controller().await?;
    let url = test.etcd.url();
    // "zz-old" is older; "aa-young" sorts first by name but came later.
    let old = format!("etcdServers: {url}\netcdPrefix: /tenants/a\n");
    test.old_then_young(
        &old,
        &format!("etcdServers: [{url}/]\netcdPrefix: /tenants/a/b\n"),
    )
    .await?;
    // Credentials go to TLS servers only.
    create_secret(
        secrets,
        "plain-etcd",
        &token_kubeconfig(fleet, 2)?,
        Some("etcdServers: http://127.0.0.1:9\netcdPrefix: /tenants/c\n"),
        &[("etcd-client.crt", b"x"), ("etcd-client.key", b"y")],
    )
    .await?;
    let found = eventually("both refused", CONVERGE, || async {
        let found = refusals(events).await?;
        Ok((found.contains_key("aa-young-kubeconfig")
            && found.contains_key("plain-etcd-kubeconfig"))
        .then_some(found))
    })
    .await
    .with_context(|| controller.log())?;
    let young = &found["aa-young-kubeconfig"];
    ensure!(
        young.contains("etcdPrefix") && young.contains("tenants/zz-old-kubeconfig"),
        "{young}"
    );
    ensure!(
        found["plain-etcd-kubeconfig"].contains("etcdServers"),
        "{}",
        found["plain-etcd-kubeconfig"]
    );
    ensure!(!found.contains_key("zz-old-kubeconfig"), "{found:?}");
    ensure!(!converged(fleet, 1), "the younger tenant was written");
    eventually("the old tenant's claim recorded", CONVERGE, || async {
        Ok((test.claims().await?.len() == 1).then_some(()))
    })
    .await?;

    // The older one's Secret deleted: its claim holds, and the younger stays refused, also
    // for a controller started afresh.
    secrets
        .delete("zz-old-kubeconfig", &DeleteParams::default())
        .await?;
    eventually("the old tenant stopped", CONVERGE, || async {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        Ok((!readyz.contains(&format!("tenant {NAMESPACE}/zz-old-kubeconfig "))).then_some(()))
    })
    .await?;
    controller.terminate()?;
    let controller = test.controller().await?;
    let refused_line = format!("[-]tenant {NAMESPACE}/aa-young-kubeconfig not started: ");
    eventually("the younger tenant refused again", CONVERGE, || async {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        Ok(readyz
            .lines()
            .any(|l| l.starts_with(&refused_line) && l.contains("tenants/zz-old-kubeconfig"))
            .then_some(()))
    })
    .await
    .with_context(|| controller.log())?;
    // Several syncs of the manager's timer later, nothing has changed.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(readyz.contains(&refused_line), "{readyz}");
    ensure!(!converged(fleet, 1), "the younger tenant was written");
    ensure!(test.claims().await?.len() == 1, "the claim's record went");

    // Created again under its name (another uid): the old tenant runs with its keys.
    create_secret(
        secrets,
        "zz-old",
        &token_kubeconfig(fleet, 0)?,
        Some(&old),
        &[],
    )
    .await?;
    let readyz = eventually("the old tenant running again", CONVERGE, || async {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        Ok(runs(&readyz, "zz-old-kubeconfig").then_some(readyz))
    })
    .await
    .with_context(|| controller.log())?;
    ensure!(readyz.contains(&refused_line), "{readyz}");
    ensure!(!converged(fleet, 1), "the younger tenant was written");
    Ok(())
}

/// A Secret shed for the Secrets' budget (`--tenants-secrets-total-mib`) is held without its
/// annotation, so what its tenant claims of an etcd is not known: its claim's record is kept as
/// it was (not even counted unclaimed, which starts its deletion), and the younger tenant whose
/// prefix overlaps stays refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_secret_keeps_its_etcd_claim() -> Result<()> {
    const PAD: usize = 600 * 1024;
    let test = ClaimTest::start(3, &["--tenants-secrets-total-mib", "1"]).await?;
    let ClaimTest {
        fleet,
        secrets,
        events,
        ..
    } = &test;
    let controller = test.controller().await?;
    let url = test.etcd.url();
    test.old_then_young(
        &format!("etcdServers: {url}\netcdPrefix: /tenants/a\n"),
        &format!("etcdServers: {url}\netcdPrefix: /tenants/a/b\n"),
    )
    .await?;
    eventually("the old tenant's claim recorded", CONVERGE, || async {
        Ok((test.claims().await?.len() == 1).then_some(()))
    })
    .await
    .with_context(|| controller.log())?;
    let refused_line = format!("[-]tenant {NAMESPACE}/aa-young-kubeconfig not started: ");
    let padded = |i: usize| -> Result<String> {
        Ok(format!(
            "{}\n# {}\n",
            token_kubeconfig(fleet, i)?,
            "x".repeat(PAD)
        ))
    };
    // A third tenant takes 600 KiB of the 1 MiB, then the old one's Secret grows by as much.
    create_secret(secrets, "filler", &padded(2)?, None, &[]).await?;
    wait_converged(fleet, 2).await?;
    let mut grown = secrets.get("zz-old-kubeconfig").await?;
    let data = grown.data.get_or_insert_with(Default::default);
    data.insert(
        "value".to_owned(),
        k8s_openapi::ByteString(padded(0)?.into_bytes()),
    );
    secrets
        .replace("zz-old-kubeconfig", &PostParams::default(), &grown)
        .await?;
    eventually("the old tenant shed", CONVERGE, || async {
        let shed = events
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .any(|e| {
                e.reason.as_deref() == Some("TenantOverBudget")
                    && e.regarding.and_then(|r| r.name).as_deref() == Some("zz-old-kubeconfig")
            });
        Ok(shed.then_some(()))
    })
    .await
    .with_context(|| controller.log())?;
    // Several syncs of the manager's timer later, the claim is as it was.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let log = controller.log();
    ensure!(
        !log.contains("no tenant Secret makes this etcd claim any more"),
        "{log}"
    );
    ensure!(test.claims().await?.len() == 1, "the claim's record went");
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(
        readyz
            .lines()
            .any(|l| l.starts_with(&refused_line) && l.contains("tenants/zz-old-kubeconfig")),
        "{readyz}"
    );
    ensure!(!converged(fleet, 1), "the younger tenant was written");
    Ok(())
}

/// One etcd is one etcd however its URL is written: what decides is the cluster ID it answers
/// with. A tenant aiming at another's keys through another spelling of its etcd's address, set
/// to rebuild the bitmap under a range of its own, is refused and the bitmap stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_etcd_is_one_etcd_however_its_url_is_written() -> Result<()> {
    let test = ClaimTest::start(2, &[]).await?;
    let ClaimTest {
        etcd,
        fleet,
        secrets,
        events,
        ..
    } = &test;
    let controller = test.controller().await?;
    let loops = "loops:\n  nodePortRepair:\n    interval: 5s\n";
    create_secret(
        secrets,
        "first",
        &token_kubeconfig(fleet, 0)?,
        Some(&format!(
            "etcdServers: {}\netcdPrefix: /tenants/a\n{loops}",
            etcd.url()
        )),
        &[],
    )
    .await?;
    let key = "/tenants/a/ranges/servicenodeports";
    let written = eventually("the first tenant's bitmap", CONVERGE, || async {
        etcd.stored(key).await
    })
    .await
    .with_context(|| controller.log())?;
    eventually("the first tenant's claim recorded", CONVERGE, || async {
        Ok((test.claims().await?.len() == 1).then_some(()))
    })
    .await?;

    let port = etcd.port;
    let spellings = [
        (
            "localhost",
            format!("http://localhost:{port}"),
            "/tenants/a",
        ),
        ("short", format!("http://127.1:{port}"), "/tenants/a/b"),
        ("padded", format!("http://127.0.0.1:0{port}"), "/tenants"),
        ("decimal", format!("http://2130706433:{port}"), "/tenants/a"),
        (
            "mapped",
            format!("http://[::ffff:127.0.0.1]:{port}"),
            "/tenants/a",
        ),
    ];
    for (name, server, prefix) in &spellings {
        // Each would rebuild the first tenant's bitmap under a range of its own.
        let fragment = format!(
            "etcdServers: \"{server}\"\netcdPrefix: {prefix}\nserviceNodePortRange: \
             30000-30099\n{loops}    rebuildBitmapOnRangeChange: true\n"
        );
        create_secret(
            secrets,
            name,
            &token_kubeconfig(fleet, 1)?,
            Some(&fragment),
            &[],
        )
        .await?;
    }
    let found = eventually("every other spelling refused", CONVERGE, || async {
        let found = refusals(events).await?;
        Ok(spellings
            .iter()
            .all(|(name, ..)| found.contains_key(&format!("{name}-kubeconfig")))
            .then_some(found))
    })
    .await
    .with_context(|| controller.log())?;
    for (name, ..) in &spellings {
        let why = &found[&format!("{name}-kubeconfig")];
        ensure!(
            why.contains("tenants/first-kubeconfig") && why.contains("the same etcd"),
            "{name}: {why}"
        );
    }
    // The first tenant's passes went on meanwhile; its bitmap is as it wrote it.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let now = etcd.stored(key).await?;
    ensure!(
        now.as_ref().map(|s| s.mod_revision) == Some(written.mod_revision),
        "the first tenant's bitmap was rewritten: {now:?}"
    );
    ensure!(!converged(fleet, 1), "a refused tenant was written");
    Ok(())
}

/// A claim record whose write failed is written again on the manager's own timer, with no
/// event of the Secrets or the records to wake it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_claim_record_write_is_tried_again_on_a_timer() -> Result<()> {
    let test = ClaimTest::start(1, &[]).await?;
    let ClaimTest {
        etcd,
        fleet,
        secrets,
        ..
    } = &test;
    let controller = test.controller().await?;
    fleet.management().faults().inject(FaultRule::next(
        Some(Verb::Create),
        Some("leases.coordination.k8s.io"),
        1,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    create_secret(
        secrets,
        "recorded",
        &token_kubeconfig(fleet, 0)?,
        Some(&format!(
            "etcdServers: {}\netcdPrefix: /tenants/a\n",
            etcd.url()
        )),
        &[],
    )
    .await?;
    wait_converged(fleet, 0).await?;
    // The first write fails; the next comes after the retry delay (30 s), on the timer.
    eventually("the claim recorded", Duration::from_secs(90), || async {
        Ok((test.claims().await?.len() == 1).then_some(()))
    })
    .await
    .with_context(|| {
        format!(
            "{:?}",
            fleet
                .management()
                .requests()
                .into_iter()
                .filter(|r| r.resource == "leases")
                .map(|r| format!("{} {} {} {}", r.time, r.verb, r.name, r.status))
                .collect::<Vec<_>>()
        ) + "\n"
            + &controller.log()
    })?;
    ensure!(
        controller
            .log()
            .contains("cannot write an etcd-claim record"),
        "the first write did not fail:\n{}",
        controller.log()
    );
    Ok(())
}

/// Where a tenant's etcd may be is the operator's: without `--tenants-etcd-allowed-cidrs` no
/// annotation names one, and with it nothing outside is reached (an address, or a name that
/// resolves there); URLs carrying more than scheme, host and port are refused by the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_etcds_are_reached_only_inside_the_networks_the_operator_allows() -> Result<()> {
    let (fleet, management) = fleet_without_its_secrets(1).await?;
    let (secrets, events) = secrets_and_events(&management);
    let listener = Listener::start().await?;
    let at_listener = format!("http://127.0.0.1:{}", listener.port);
    let fragment = |server: &str| format!("etcdServers: \"{server}\"\netcdPrefix: /tenants/a\n");
    let kubeconfig = token_kubeconfig(&fleet, 0)?;

    let mut controller = start_controller(&fleet, &[])?;
    controller.wait_ready().await?;
    create_secret(
        &secrets,
        "no-networks",
        &kubeconfig,
        Some(&fragment(&at_listener)),
        &[],
    )
    .await?;
    let why = eventually("refused without allowed networks", CONVERGE, || async {
        Ok(refusals(&events).await?.remove("no-networks-kubeconfig"))
    })
    .await?;
    ensure!(
        why.contains("etcdServers") && why.contains("--tenants-etcd-allowed-cidrs"),
        "{why}"
    );
    controller.terminate()?;

    let mut controller =
        start_controller(&fleet, &["--tenants-etcd-allowed-cidrs", "192.0.2.0/24"])?;
    controller.wait_ready().await?;
    let cases = [
        ("outside", at_listener.clone(), "outside the networks"),
        (
            "outside-by-name",
            format!("http://localhost:{}", listener.port),
            "outside the networks",
        ),
        (
            "userinfo",
            "http://root:hunter2x@192.0.2.1:2379".to_owned(),
            "userinfo",
        ),
        ("path", "http://192.0.2.1:2379/v3".to_owned(), "path"),
        ("query", "http://192.0.2.1:2379?x=1".to_owned(), "query"),
        ("fragment", "http://192.0.2.1:2379#x".to_owned(), "fragment"),
    ];
    for (name, server, _) in &cases {
        create_secret(&secrets, name, &kubeconfig, Some(&fragment(server)), &[]).await?;
    }
    let found = eventually("every case refused", CONVERGE, || async {
        let found = refusals(&events).await?;
        Ok(cases
            .iter()
            .all(|(name, ..)| found.contains_key(&format!("{name}-kubeconfig")))
            .then_some(found))
    })
    .await
    .with_context(|| controller.log())?;
    for (name, _, named) in &cases {
        let why = &found[&format!("{name}-kubeconfig")];
        ensure!(
            why.contains("etcdServers") && why.contains(named),
            "{name}: {why}"
        );
        ensure!(
            !why.contains("hunter2x"),
            "{name}: the note quotes a password"
        );
    }
    ensure!(
        found["outside-kubeconfig"].contains("--tenants-etcd-allowed-cidrs"),
        "{}",
        found["outside-kubeconfig"]
    );
    ensure!(
        listener.accepted.load(Ordering::SeqCst) == 0,
        "the controller connected outside the allowed networks"
    );
    ensure!(
        !controller.log().contains("hunter2x"),
        "the log quotes a password"
    );
    Ok(())
}

/// Which tenant keeps overlapping etcd keys is not up to the Secrets' writers: a tenant that
/// runs with its claim recorded keeps it against an older Secret edited to claim the same keys,
/// and a restarted controller decides alike from the records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_secret_edited_to_claim_a_running_tenants_etcd_keys_is_refused() -> Result<()> {
    let test = ClaimTest::start(2, &[]).await?;
    let ClaimTest {
        fleet,
        secrets,
        events,
        ..
    } = &test;
    let mut controller = test.controller().await?;
    let etcd = test.etcd.url();
    test.old_then_young(
        &format!("etcdServers: {etcd}\netcdPrefix: /tenants/b\n"),
        &format!("etcdServers: {etcd}\netcdPrefix: /tenants/a\n"),
    )
    .await?;
    wait_converged(fleet, 1).await?;
    eventually("both claims recorded", CONVERGE, || async {
        let prefixes: Vec<String> = test
            .claims()
            .await?
            .into_iter()
            .filter_map(|lease| {
                lease
                    .metadata
                    .annotations?
                    .get("bootstrap-controller.io/etcd-prefix")
                    .cloned()
            })
            .collect();
        Ok((prefixes.len() == 2).then_some(()))
    })
    .await
    .with_context(|| controller.log())?;

    // The old Secret now names the young tenant's prefix.
    let patch = json!({"metadata": {"annotations": {
        "bootstrap-controller.io/config": format!("etcdServers: {etcd}\netcdPrefix: /tenants/a\n")
    }}});
    secrets
        .patch(
            "zz-old-kubeconfig",
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await?;
    let why = eventually("the edited old Secret refused", CONVERGE, || async {
        Ok(refusals(events).await?.remove("zz-old-kubeconfig"))
    })
    .await?;
    ensure!(
        why.contains("tenants/aa-young-kubeconfig, which has held them since"),
        "{why}"
    );
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(runs(&readyz, "aa-young-kubeconfig"), "{readyz}");
    let (_, metrics) = controller.admin_get("/metrics").await?;
    ensure!(
        !metrics.contains("bootstrap_tenant_stops_total{reason=\"refused\"} 1"),
        "the running tenant was stopped:\n{metrics}"
    );

    // A new process (the records are all it knows of the past) decides alike.
    controller.terminate()?;
    let controller = test.controller().await?;
    let readyz = eventually("the young tenant running again", CONVERGE, || async {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        Ok(runs(&readyz, "aa-young-kubeconfig").then_some(readyz))
    })
    .await?;
    ensure!(
        readyz.contains(&format!(
            "[-]tenant {NAMESPACE}/zz-old-kubeconfig not started"
        )),
        "{readyz}"
    );

    // The young tenant's Secret gone, its claim still holds its keys (for the grace period):
    // the old one stays refused and both records stay.
    secrets
        .delete("aa-young-kubeconfig", &DeleteParams::default())
        .await?;
    eventually("the young tenant stopped", CONVERGE, || async {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        Ok((!readyz.contains(&format!("tenant {NAMESPACE}/aa-young-kubeconfig "))).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(
        readyz.contains(&format!(
            "[-]tenant {NAMESPACE}/zz-old-kubeconfig not started"
        )),
        "{readyz}"
    );
    ensure!(test.claims().await?.len() == 2, "a record went");
    Ok(())
}

/// An etcd that cannot be asked is asked again every 30 s, and each failure may read otherwise:
/// the Secret version is reported once (one event, one count), while `/readyz?verbose` shows the
/// failure of the moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_that_cannot_be_asked_is_reported_once_a_version() -> Result<()> {
    let (fleet, management) = fleet_without_its_secrets(1).await?;
    let (secrets, events) = secrets_and_events(&management);
    let mut controller = start_controller(&fleet, &["--tenants-etcd-allowed-cidrs", LOOPBACK])?;
    controller.wait_ready().await?;
    // Nothing listens there yet: the connection is refused.
    let port = free_port()?.port();
    create_secret(
        &secrets,
        "unasked",
        &token_kubeconfig(&fleet, 0)?,
        Some(&format!(
            "etcdServers: http://127.0.0.1:{port}\netcdPrefix: /tenants/a\n"
        )),
        &[],
    )
    .await?;
    let refused_line = format!("[-]tenant {NAMESPACE}/unasked-kubeconfig not started: ");
    let failing = |what: &'static str| {
        let (controller, refused_line) = (&controller, &refused_line);
        eventually(what, Duration::from_secs(90), move || async move {
            let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
            Ok(readyz
                .lines()
                .find(|line| line.starts_with(refused_line.as_str()))
                .map(str::to_owned))
        })
    };
    let first = failing("the refused connection")
        .await
        .with_context(|| controller.log())?;
    ensure!(!first.contains("no answer within"), "{first}");
    // Then something listens and never answers: the next ask fails otherwise.
    let listener = Listener::start_on(port).await?;
    let silent = "the silent etcd's failure";
    let changed = eventually(silent, Duration::from_secs(120), || async {
        let line = failing(silent).await?;
        Ok((line != first).then_some(line))
    })
    .await;
    if let Err(err) = changed {
        let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
        return Err(err.context(format!("{readyz}\n{}", controller.log())));
    }
    ensure!(listener.accepted.load(Ordering::SeqCst) > 0, "never asked");
    let (_, metrics) = controller.admin_get("/metrics").await?;
    ensure!(
        metrics.contains("bootstrap_tenant_config_errors_total 1\n"),
        "{metrics}"
    );
    let reported = refusals(&events).await?;
    ensure!(
        reported
            .get("unasked-kubeconfig")
            .is_some_and(|note| note == &first[refused_line.len()..]),
        "{reported:?} against {first}"
    );
    // One event, never repeated: neither a second one nor a series on the first.
    let written: Vec<_> = (events.list(&Default::default()).await?.items)
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some("TenantConfigInvalid"))
        .filter(|e| {
            (e.regarding.as_ref()).and_then(|r| r.name.as_deref()) == Some("unasked-kubeconfig")
        })
        .collect();
    ensure!(
        written.len() == 1 && written[0].series.is_none(),
        "{written:?}"
    );
    controller.terminate()?;
    Ok(())
}

/// Whether `/readyz?verbose` shows the tenant of Secret `name` running (its loops passing or
/// not).
fn runs(readyz: &str, name: &str) -> bool {
    let tenant = format!("tenant {NAMESPACE}/{name} ");
    readyz.lines().any(|line| {
        line.strip_prefix("[+]")
            .or_else(|| line.strip_prefix("[-]"))
            .and_then(|rest| rest.strip_prefix(&tenant))
            .is_some_and(|state| state == "ok" || state.starts_with("failing: "))
    })
}

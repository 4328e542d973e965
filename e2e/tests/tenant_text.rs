//! Tenant text is data: what a tenant Secret's writer and a tenant's API server say reaches the
//! controller's log (the default text format), `/readyz?verbose` and the events on the Secrets
//! escaped, capped, and without a URL's userinfo.
//!
//! Three tenants of a simulated management cluster: one whose kubeconfig's cluster name holds a
//! newline, an ESC sequence and a bidi override (and a field the controller refuses, so the
//! name is quoted in the refusal); one whose server URL carries `user:password@`; one whose API
//! server (a TLS server on loopback, below) answers every request with a 500 Status whose
//! message forges a log line, colours the terminal and is a megabyte long.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Result, ensure};
use apiserver_sim::{Fleet, FleetConfig, TENANT_LABEL, kubeconfig_secret};
use common::{CONVERGE, ControllerProcess, eventually};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

const NAMESPACE: &str = "tenants";
/// The text a hostile tenant wants to appear at the start of a log line of its own.
const FORGED: &str = "FORGED level=ERROR";
/// The password in a server URL: it must never be seen again.
const PASSWORD: &str = "topsecret42";
const USER: &str = "leakyuser";
/// No line of the log or `/readyz?verbose` is longer: a field of a log line is capped at 4096
/// bytes and a piece of tenant text at 960, where the Status messages are a megabyte.
const MAX_LINE: usize = 16 * 1024;

/// The Status message of every answer of the hostile API.
fn hostile_message() -> String {
    format!(
        "injected\n{FORGED} msg=\"all tenants healthy\"\r\n\x1b[31mred\x1b[0m\u{9b}1m\u{202e}gnp.exe \
         https://{USER}:{PASSWORD}@192.0.2.7/ {}",
        "A".repeat(1024 * 1024)
    )
}

/// A TLS server on loopback answering every request with a 500 `Status` carrying `message`.
struct HostileApi {
    port: u16,
    ca_pem: String,
    answered: Arc<AtomicUsize>,
}

impl HostileApi {
    async fn start(message: String) -> Result<HostileApi> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        let ca_key = KeyPair::generate()?;
        let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_cert = ca_params.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse()?));
        let cert = params.signed_by(&key, &issuer)?;
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from(cert.der().to_vec())],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        )?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));

        let body = Arc::new(serde_json::to_vec(&json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "InternalError",
            "code": 500,
        }))?);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let answered = Arc::new(AtomicUsize::new(0));
        let count = answered.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let (acceptor, body, count) = (acceptor.clone(), body.clone(), count.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut head = Vec::new();
                    let mut buffer = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                        match tls.read(&mut buffer).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buffer[..n]),
                        }
                    }
                    let response = format!(
                        "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n\
                         Content-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    if tls.write_all(response.as_bytes()).await.is_ok()
                        && tls.write_all(&body).await.is_ok()
                    {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    let _ = tls.shutdown().await;
                });
            }
        });
        Ok(HostileApi {
            port,
            ca_pem: ca_cert.pem(),
            answered,
        })
    }
}

/// A kubeconfig whose one cluster is named `cluster_name`, with the YAML body `cluster`
/// (indented by four spaces) and a bearer token.
fn kubeconfig(cluster_name: &str, cluster: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\ncontexts:\n- name: t\n  context: \
         {{cluster: {cluster_name}, user: u}}\nclusters:\n- name: {cluster_name}\n  cluster:\n\
         {cluster}users:\n- name: u\n  user:\n    token: abc\n"
    )
}

async fn create_secret(secrets: &Api<Secret>, name: &str, kubeconfig: &str) -> Result<()> {
    let secret = kubeconfig_secret(NAMESPACE, name, kubeconfig);
    secrets
        .create(&PostParams::default(), &serde_json::from_value(secret)?)
        .await?;
    Ok(())
}

/// What every report must hold, whatever a tenant wrote: `what` is where `text` came from.
fn judge(what: &str, text: &str) -> Result<()> {
    ensure!(!text.contains('\x1b'), "{what} holds an ESC byte");
    ensure!(
        !text.contains(PASSWORD) && !text.contains(USER),
        "{what} holds a URL's userinfo"
    );
    ensure!(
        !text.contains('\u{202e}') && !text.contains('\r'),
        "{what} holds a bidi override or a carriage return"
    );
    for line in text.lines() {
        ensure!(
            !line.trim_start().starts_with(FORGED),
            "{what} has a forged line: {line:.300}"
        );
        ensure!(
            line.len() <= MAX_LINE,
            "{what} has a line of {} bytes: {line:.300}",
            line.len()
        );
        ensure!(
            !line.chars().any(char::is_control),
            "{what} has a control character in {line:.300}"
        );
    }
    // Wherever the forged text appears, it follows the newline it came with, escaped.
    for (at, _) in text.match_indices(FORGED) {
        ensure!(
            text[..at].ends_with("\\n"),
            "{what} quotes the forged text unescaped: {:.300}",
            &text[at.saturating_sub(100)..]
        );
    }
    Ok(())
}

/// The three tenants' Secrets in a management cluster, the hostile API, and the controller
/// (run with `extra` flags) keeping them.
struct Scenario {
    /// Held until the test ends: the management cluster.
    fleet: Fleet,
    api: HostileApi,
    events: Api<Event>,
    controller: ControllerProcess,
}

async fn scenario(extra: &[&str]) -> Result<Scenario> {
    let fleet = Fleet::start(FleetConfig::default()).await?;
    let management = fleet.management().client();
    let secrets: Api<Secret> = Api::namespaced(management.clone(), NAMESPACE);
    let events: Api<Event> = Api::namespaced(management.clone(), NAMESPACE);
    let api = HostileApi::start(hostile_message()).await?;
    use base64::Engine;
    let ca = base64::engine::general_purpose::STANDARD.encode(&api.ca_pem);

    // (a) A cluster name that forges a line, in a kubeconfig refused for a field of that cluster.
    let name = format!("\"c\\n{FORGED} forged=true \\e[31mred\\u202e\"");
    create_secret(
        &secrets,
        "forged-name",
        &kubeconfig(
            &name,
            "    server: https://192.0.2.8:6443\n    insecure-skip-tls-verify: true\n",
        ),
    )
    .await?;
    // (b) A server URL with a user and a password.
    create_secret(
        &secrets,
        "userinfo",
        &kubeconfig(
            "c",
            &format!(
                "    server: https://{USER}:{PASSWORD}@127.0.0.1:{}\n    \
                 certificate-authority-data: {ca}\n",
                api.port
            ),
        ),
    )
    .await?;
    // (c) An API server whose every answer is the hostile Status.
    create_secret(
        &secrets,
        "hostile-api",
        &kubeconfig(
            "c",
            &format!(
                "    server: https://127.0.0.1:{}\n    certificate-authority-data: {ca}\n",
                api.port
            ),
        ),
    )
    .await?;

    let selector = format!("{TENANT_LABEL}=true");
    let mut args = vec![
        "--tenants-secret-selector",
        &selector,
        "--tenants-namespace",
        NAMESPACE,
        "--service-cluster-ip-range",
        "10.96.0.0/12",
        "--leader-elect=false",
    ];
    args.extend(extra);
    let controller = ControllerProcess::start(fleet.management().kubeconfig_path(), &args)?;
    Ok(Scenario {
        fleet,
        api,
        events,
        controller,
    })
}

/// The notes of every event in the tenants' namespace.
async fn notes(events: &Api<Event>) -> Result<Vec<String>> {
    Ok(events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|event| event.note)
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_text_reaches_logs_readyz_and_events_escaped_capped_and_without_userinfo()
-> Result<()> {
    let Scenario {
        fleet: _fleet,
        api,
        events,
        controller,
    } = scenario(&[]).await?;

    // Every tenant has been reported: the hostile Status in /readyz, the refusal in its event
    // and the log, the server URL in the log.
    let readyz = eventually("the hostile API's error in /readyz", CONVERGE, || async {
        let (_, body) = controller.admin_get("/readyz?verbose").await?;
        Ok(body
            .lines()
            .any(|line| {
                line.starts_with("[-]tenant tenants/hostile-api-kubeconfig failing:")
                    && line.contains("500 InternalError: injected")
            })
            .then_some(body))
    })
    .await?;
    let note = eventually("the refusal of the forged name", CONVERGE, || async {
        Ok(events
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .find(|event| {
                event.reason.as_deref() == Some("TenantConfigInvalid")
                    && event.regarding.as_ref().and_then(|r| r.name.as_deref())
                        == Some("forged-name-kubeconfig")
            })
            .and_then(|event| event.note))
    })
    .await?;
    let log = eventually("the log's lines about every tenant", CONVERGE, || async {
        let log = controller.log();
        Ok((log.contains("tenant started")
            && log.contains("tenant=tenants/userinfo-kubeconfig")
            && log.contains("500 InternalError: injected")
            && log.contains("insecure-skip-tls-verify"))
        .then_some(log))
    })
    .await?;
    ensure!(
        api.answered.load(Ordering::SeqCst) > 0,
        "nothing asked the hostile API"
    );
    let (_, metrics) = controller.admin_get("/metrics").await?;
    judge("the log", &log)?;
    judge("/readyz?verbose", &readyz)?;
    judge("/metrics", &metrics)?;
    for note in &notes(&events).await? {
        judge("an event note", note)?;
        ensure!(note.len() <= 1024, "an event note of {} bytes", note.len());
    }

    // What was escaped is still there to read.
    ensure!(
        log.contains("server=https://***@127.0.0.1:"),
        "the log names the server without its userinfo"
    );
    ensure!(
        log.contains(&format!("500 InternalError: injected\\n{FORGED}")),
        "the log quotes the Status message escaped"
    );
    ensure!(
        note.contains(&format!(
            "clusters[c\\n{FORGED} forged=true \\u{{1b}}[31mred\\u{{202e}}].cluster.insecure-skip-tls-verify"
        )),
        "the refusal names the cluster, escaped: {note}"
    );
    ensure!(
        readyz.contains(&format!(
            "[-]tenant tenants/forged-name-kubeconfig not started: Secret \
             tenants/forged-name-kubeconfig key \"value\" is refused: clusters[c\\n{FORGED}"
        )),
        "{readyz:.2000}"
    );
    ensure!(
        readyz.contains(&format!(
            "500 InternalError: injected\\n{FORGED} msg=\"all tenants healthy\"\\r\\n\\u{{1b}}[31mred"
        )) && readyz.contains("more bytes cut]"),
        "/readyz quotes the Status message escaped and cut: {readyz:.2000}"
    );
    Ok(())
}

/// The JSON log format holds the same, each line still one JSON object.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_text_reaches_json_logs_escaped_capped_and_without_userinfo() -> Result<()> {
    let Scenario {
        fleet: _fleet,
        api,
        controller,
        ..
    } = scenario(&["--log-format", "json"]).await?;
    let log = eventually("the log's lines about every tenant", CONVERGE, || async {
        let log = controller.log();
        Ok((log.contains("tenant started")
            && log.contains("tenants/userinfo-kubeconfig")
            && log.contains("500 InternalError: injected")
            && log.contains("insecure-skip-tls-verify"))
        .then_some(log))
    })
    .await?;
    ensure!(
        api.answered.load(Ordering::SeqCst) > 0,
        "nothing asked the hostile API"
    );
    judge("the JSON log", &log)?;
    for line in log.lines() {
        let event: serde_json::Value = serde_json::from_str(line)
            .map_err(|err| anyhow::anyhow!("not a JSON line ({err}): {line:.300}"))?;
        let text = event.to_string();
        ensure!(
            !text.contains(['\u{9b}', '\u{202e}']),
            "a C1 or bidi character in {text:.300}"
        );
    }
    ensure!(
        log.contains("https://***@127.0.0.1:"),
        "the log names the server without its userinfo"
    );
    Ok(())
}

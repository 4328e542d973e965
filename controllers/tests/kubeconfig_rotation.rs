//! A kubeconfig's client certificate rotated on disk is used by the same client value without a
//! restart: a TLS server on loopback that requires client certificates (signed by a generated
//! CA) records which certificate each connection presented, and answers with `Connection:
//! close` so every request is a new connection.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A PEM certificate and key, and the certificate's DER (to recognise it on the server).
struct Pair {
    cert_pem: String,
    key_pem: String,
    der: Vec<u8>,
    key_der: Vec<u8>,
}

struct Pki {
    ca_pem: String,
    ca_der: Vec<u8>,
    server: Pair,
    a: Pair,
    b: Pair,
}

fn pki() -> Result<Pki> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "rotation test CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = ca_params.self_signed(&ca_key)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |cn: &str, usage: ExtendedKeyUsagePurpose| -> Result<Pair> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(vec!["localhost".to_owned()])?;
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse()?));
        params.distinguished_name.push(DnType::CommonName, cn);
        params.extended_key_usages = vec![usage];
        let cert = params.signed_by(&key, &issuer)?;
        Ok(Pair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    };
    Ok(Pki {
        ca_pem: ca.pem(),
        ca_der: ca.der().to_vec(),
        server: leaf("127.0.0.1", ExtendedKeyUsagePurpose::ServerAuth)?,
        a: leaf("controller-a", ExtendedKeyUsagePurpose::ClientAuth)?,
        b: leaf("controller-b", ExtendedKeyUsagePurpose::ClientAuth)?,
    })
}

/// Serves `/version` over TLS, requiring a client certificate signed by the CA; records which
/// of `a`/`b` each connection presented.
async fn serve(pki: &Pki) -> Result<(String, Arc<Mutex<Vec<&'static str>>>)> {
    serve_with(pki, false).await
}

/// [`serve`], keeping each connection open for more requests when `keep_alive`.
async fn serve_with(
    pki: &Pki,
    keep_alive: bool,
) -> Result<(String, Arc<Mutex<Vec<&'static str>>>)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from(pki.ca_der.clone()))?;
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(pki.server.key_der.clone()));
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![CertificateDer::from(pki.server.der.clone())], key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", listener.local_addr()?);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (a, b) = (pki.a.der.clone(), pki.b.der.clone());
    let record = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let Ok(mut tls) = acceptor.accept(tcp).await else {
                continue;
            };
            let peer = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.as_ref().to_vec());
            let who = match peer {
                Some(der) if der == a => "a",
                Some(der) if der == b => "b",
                _ => "other",
            };
            record.lock().unwrap().push(who);
            tokio::spawn(async move {
                loop {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let body = r#"{"major":"1","minor":"33","gitVersion":"v1.33.0","gitCommit":"x","gitTreeState":"clean","buildDate":"2025-01-01T00:00:00Z","goVersion":"go","compiler":"gc","platform":"linux/amd64"}"#;
                    let connection = if keep_alive { "keep-alive" } else { "close" };
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: {connection}\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if tls.write_all(response.as_bytes()).await.is_err() || !keep_alive {
                        let _ = tls.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    Ok((url, seen))
}

/// Replaces `path` as rotation tools do: write beside it, then rename over it.
fn replace(path: &Path, content: &str) -> Result<()> {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, content)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Requests until a new connection presented `want`; the client is the same value throughout.
async fn until_presented(
    client: &kube::Client,
    seen: &Mutex<Vec<&'static str>>,
    want: &str,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        client.apiserver_version().await.context("GET /version")?;
        if seen.lock().unwrap().last() == Some(&want) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!(
                "no connection presented certificate {want}: {:?}",
                seen.lock().unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn client_for(kubeconfig: &Path) -> Result<kube::Client> {
    let config = bootstrap_controller::kubeconfig::load(Some(kubeconfig)).await?;
    Ok(bootstrap_controller::client::build_checking(
        &config,
        Some(kubeconfig),
        Duration::from_millis(50),
    )?)
}

/// A kubeconfig for the server at `url`: `ca` is its cluster's certificate-authority line,
/// `user` its user's lines (each after the first indented by four spaces).
fn kubeconfig_yaml(url: &str, ca: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters:\n- name: c\n  cluster:\n    server: {url}\n    {ca}\nusers:\n- name: u\n  user:\n    {user}\ncontexts:\n- name: c\n  context: {{cluster: c, user: u}}\n"
    )
}

/// Writes `pki`'s CA and its pair `a` to `ca.crt`, `client.crt` and `client.key` in `dir`, and
/// a kubeconfig for `url` naming each file as `named` gives it (relative or absolute); returns
/// the kubeconfig's path.
fn files_of_pair_a(
    dir: &Path,
    pki: &Pki,
    url: &str,
    named: impl Fn(&str) -> String,
) -> Result<PathBuf> {
    std::fs::write(dir.join("ca.crt"), &pki.ca_pem)?;
    std::fs::write(dir.join("client.crt"), &pki.a.cert_pem)?;
    std::fs::write(dir.join("client.key"), &pki.a.key_pem)?;
    let kubeconfig = dir.join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        kubeconfig_yaml(
            url,
            &format!("certificate-authority: {}", named("ca.crt")),
            &format!(
                "client-certificate: {}\n    client-key: {}",
                named("client.crt"),
                named("client.key")
            ),
        ),
    )?;
    Ok(kubeconfig)
}

fn b64(text: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(text)
}

#[tokio::test]
async fn a_client_certificate_replaced_on_disk_is_used_by_new_connections() -> Result<()> {
    let pki = pki()?;
    let (url, seen) = serve(&pki).await?;
    let dir = tempfile::tempdir()?;
    let file = |name: &str| -> PathBuf { dir.path().join(name) };
    let kubeconfig = files_of_pair_a(dir.path(), &pki, &url, str::to_owned)?;
    let client = client_for(&kubeconfig).await?;
    until_presented(&client, &seen, "a").await?;

    // cert-manager or kubeadm renews the pair: same CA, another certificate and key.
    replace(&file("client.key"), &pki.b.key_pem)?;
    replace(&file("client.crt"), &pki.b.cert_pem)?;
    until_presented(&client, &seen, "b").await?;
    let seen = seen.lock().unwrap().clone();
    let first_b = seen.iter().position(|w| *w == "b").unwrap();
    assert!(
        seen[first_b..].iter().all(|w| *w == "b"),
        "after the switch every new connection presents the new certificate: {seen:?}"
    );
    Ok(())
}

/// A connection kept open (an h2 connection carries every request for as long as it lives) is
/// closed when the certificate is renewed, as client-go closes them: the next request connects
/// again and presents the new certificate.
#[tokio::test]
async fn a_renewed_certificate_closes_the_connections_made_before() -> Result<()> {
    let pki = pki()?;
    let (url, seen) = serve_with(&pki, true).await?;
    let dir = tempfile::tempdir()?;
    let file = |name: &str| -> PathBuf { dir.path().join(name) };
    let kubeconfig = files_of_pair_a(dir.path(), &pki, &url, str::to_owned)?;
    let client = client_for(&kubeconfig).await?;
    for _ in 0..3 {
        client.apiserver_version().await?;
    }
    assert_eq!(
        seen.lock().unwrap().clone(),
        ["a"],
        "one connection, kept open"
    );

    replace(&file("client.key"), &pki.b.key_pem)?;
    replace(&file("client.crt"), &pki.b.cert_pem)?;
    until_presented(&client, &seen, "b").await?;
    assert_eq!(seen.lock().unwrap().clone(), ["a", "b"]);
    Ok(())
}

/// The sidecar's kubeconfig embeds its certificate (`setup-node.sh` rewrites the whole file).
#[tokio::test]
async fn a_kubeconfig_rewritten_with_embedded_certificates_is_read_again() -> Result<()> {
    let pki = pki()?;
    let (url, seen) = serve(&pki).await?;
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    let write = |pair: &Pair| -> Result<()> {
        replace(
            &kubeconfig,
            &kubeconfig_yaml(
                &url,
                &format!("certificate-authority-data: {}", b64(&pki.ca_pem)),
                &format!(
                    "client-certificate-data: {}\n    client-key-data: {}",
                    b64(&pair.cert_pem),
                    b64(&pair.key_pem)
                ),
            ),
        )
    };
    write(&pki.a)?;
    let client = client_for(&kubeconfig).await?;
    until_presented(&client, &seen, "a").await?;
    write(&pki.b)?;
    until_presented(&client, &seen, "b").await?;
    Ok(())
}

/// A half-written certificate (a rotation caught midway) does not break the client: it keeps
/// the last good pair until the files are whole again.
#[tokio::test]
async fn a_broken_replacement_keeps_the_previous_certificate() -> Result<()> {
    let pki = pki()?;
    let (url, seen) = serve(&pki).await?;
    let dir = tempfile::tempdir()?;
    let file = |name: &str| -> PathBuf { dir.path().join(name) };
    let kubeconfig = files_of_pair_a(dir.path(), &pki, &url, |name| {
        file(name).display().to_string()
    })?;
    let client = client_for(&kubeconfig).await?;
    until_presented(&client, &seen, "a").await?;
    replace(
        &file("client.crt"),
        "-----BEGIN CERTIFICATE-----\ntruncated",
    )?;
    // Several checks pass while the file is broken; every request still succeeds with `a`.
    for _ in 0..10 {
        client.apiserver_version().await?;
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    assert!(
        seen.lock().unwrap().iter().all(|w| *w == "a"),
        "{:?}",
        seen.lock().unwrap()
    );
    replace(&file("client.key"), &pki.b.key_pem)?;
    replace(&file("client.crt"), &pki.b.cert_pem)?;
    until_presented(&client, &seen, "b").await?;
    Ok(())
}

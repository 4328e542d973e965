//! The generated CA, the serving certificate and the kubeconfig.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

use crate::SimError;

/// A CA and a serving certificate for loopback names, generated at startup.
pub struct Pki {
    pub ca_pem: String,
    pub server_config: Arc<rustls::ServerConfig>,
}

fn tls_err(e: impl std::fmt::Display) -> SimError {
    SimError::Tls(e.to_string())
}

pub fn generate(listen: &SocketAddr) -> Result<Pki, SimError> {
    let ca_key = KeyPair::generate().map_err(tls_err)?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(tls_err)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "apiserver-sim CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca_params.self_signed(&ca_key).map_err(tls_err)?;
    let issuer = Issuer::new(ca_params, ca_key);

    let server_key = KeyPair::generate().map_err(tls_err)?;
    let mut params =
        CertificateParams::new(vec!["localhost".to_string(), "kubernetes".to_string()])
            .map_err(tls_err)?;
    params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().map_err(tls_err)?));
    params
        .subject_alt_names
        .push(SanType::IpAddress("::1".parse().map_err(tls_err)?));
    let ip = listen.ip();
    if !ip.is_loopback() && !ip.is_unspecified() {
        params.subject_alt_names.push(SanType::IpAddress(ip));
    }
    params
        .distinguished_name
        .push(DnType::CommonName, "apiserver-sim");
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = params.signed_by(&server_key, &issuer).map_err(tls_err)?;

    let certs = vec![
        CertificateDer::from(server_cert.der().to_vec()),
        CertificateDer::from(ca_cert.der().to_vec()),
    ];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der()));
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(tls_err)?;
    // HTTP/1.1 only: every client in scope speaks it, and a dropped connection then affects
    // exactly one request.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Pki {
        ca_pem: ca_cert.pem(),
        server_config: Arc::new(config),
    })
}

/// The bearer token written into the kubeconfig (the simulator accepts any credentials).
pub const TOKEN: &str = "apiserver-sim-token";

/// Writes a kubeconfig for `server` (an `https://` or `http://` URL).
pub fn write_kubeconfig(path: &Path, server: &str, ca_pem: Option<&str>) -> Result<(), SimError> {
    let cluster = match ca_pem {
        Some(pem) => format!(
            "    server: {server}\n    certificate-authority-data: {}\n",
            base64::engine::general_purpose::STANDARD.encode(pem)
        ),
        None => format!("    server: {server}\n"),
    };
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: apiserver-sim\n  cluster:\n{cluster}users:\n- name: apiserver-sim\n  user:\n    token: {TOKEN}\ncontexts:\n- name: apiserver-sim\n  context:\n    cluster: apiserver-sim\n    user: apiserver-sim\n    namespace: default\ncurrent-context: apiserver-sim\npreferences: {{}}\n"
    );
    // Write-then-rename so a reader polling for the file never sees half of it.
    let tmp = path.with_extension("tmp-apiserver-sim");
    std::fs::write(&tmp, text).map_err(|e| SimError::Kubeconfig(path.to_path_buf(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| SimError::Kubeconfig(path.to_path_buf(), e))
}

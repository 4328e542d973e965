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

/// A CA and a serving certificate for loopback names, generated at startup. The certificate
/// names no port, so the simulators of a fleet share one (one key pair, not one per tenant).
#[derive(Clone)]
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
    let mut params = CertificateParams::new(vec![
        "localhost".to_string(),
        "kubernetes".to_string(),
        // The tenants of a fleet behind one shared listener, each told apart by its own name
        // under this domain (the SNI its clients send, from the kubeconfig's tls-server-name).
        format!("*.{FLEET_DOMAIN}"),
    ])
    .map_err(tls_err)?;
    params
        .subject_alt_names
        .push(SanType::IpAddress("127.0.0.1".parse().map_err(tls_err)?));
    params
        .subject_alt_names
        .push(SanType::IpAddress("::1".parse().map_err(tls_err)?));
    // The address tests advertise for "the apiserver behind this simulator" (TEST-NET-1), so
    // the serving-certificate check has an address the certificate holds.
    params
        .subject_alt_names
        .push(SanType::IpAddress("192.0.2.1".parse().map_err(tls_err)?));
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
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(go_like_provider()))
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(tls_err)?;
    // Go's TLS 1.3 server picks the suite by its own order, not the client's: kube-apiserver
    // serves a client that prefers AES-GCM with AES-128-GCM, where rustls by default would
    // follow the client to AES-256-GCM, a third more AES rounds on every byte of a LIST.
    config.ignore_client_order = true;
    // As kube-apiserver: h2 for the clients that offer it (one connection carries all of a
    // client's requests), HTTP/1.1 for the others.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Pki {
        ca_pem: ca_cert.pem(),
        server_config: Arc::new(config),
    })
}

/// ring's suites in the order Go's `crypto/tls` prefers them on a machine with AES hardware
/// (`defaultCipherSuitesTLS13`: AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305; TLS 1.2 likewise).
/// Go switches to ChaCha20 first for a client that prefers it; rustls has no hook for that, and
/// every client here (kube-rs, kubectl, Python) prefers AES-GCM.
fn go_like_provider() -> rustls::crypto::CryptoProvider {
    use rustls::CipherSuite::*;
    const GO_ORDER: [rustls::CipherSuite; 9] = [
        TLS13_AES_128_GCM_SHA256,
        TLS13_AES_256_GCM_SHA384,
        TLS13_CHACHA20_POLY1305_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
        TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
        TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
        TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
        TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
    ];
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|suite| {
        GO_ORDER
            .iter()
            .position(|&preferred| preferred == suite.suite())
            .unwrap_or(GO_ORDER.len())
    });
    provider
}

/// The domain under which the tenants of a fleet behind one shared listener have their server
/// names (`tenant-0.apiserver-sim.test`; `.test` is reserved for testing by RFC 2606).
pub const FLEET_DOMAIN: &str = "apiserver-sim.test";

/// The bearer token written into the kubeconfig (the simulator accepts any credentials).
pub const TOKEN: &str = "apiserver-sim-token";

/// A self-contained kubeconfig for `server` (an `https://` or `http://` URL): the CA inline, the
/// simulator's token, and `tls-server-name` when given (a tenant behind a shared listener).
pub fn kubeconfig_text(server: &str, ca_pem: Option<&str>, server_name: Option<&str>) -> String {
    let mut cluster = match ca_pem {
        Some(pem) => format!(
            "    server: {server}\n    certificate-authority-data: {}\n",
            base64::engine::general_purpose::STANDARD.encode(pem)
        ),
        None => format!("    server: {server}\n"),
    };
    if let Some(name) = server_name {
        cluster.push_str(&format!("    tls-server-name: {name}\n"));
    }
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: apiserver-sim\n  cluster:\n{cluster}users:\n- name: apiserver-sim\n  user:\n    token: {TOKEN}\ncontexts:\n- name: apiserver-sim\n  context:\n    cluster: apiserver-sim\n    user: apiserver-sim\n    namespace: default\ncurrent-context: apiserver-sim\npreferences: {{}}\n"
    )
}

/// Writes [`kubeconfig_text`] to `path`.
pub fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca_pem: Option<&str>,
    server_name: Option<&str>,
) -> Result<(), SimError> {
    let text = kubeconfig_text(server, ca_pem, server_name);
    // Write-then-rename so a reader polling for the file never sees half of it.
    let tmp = path.with_extension("tmp-apiserver-sim");
    std::fs::write(&tmp, text).map_err(|e| SimError::Kubeconfig(path.to_path_buf(), e))?;
    std::fs::rename(&tmp, path).map_err(|e| SimError::Kubeconfig(path.to_path_buf(), e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use rustls::pki_types::pem::PemObject;

    /// A kube-rs-like client (ring's default suites, AES-256-GCM first) against the simulator
    /// negotiates what a Go kube-apiserver would give it.
    #[test]
    fn clients_get_the_suite_a_go_server_would_choose() {
        let pki = generate(&"127.0.0.1:0".parse().unwrap()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).unwrap())
            .unwrap();
        let client_provider = rustls::crypto::ring::default_provider();
        assert_eq!(
            client_provider.cipher_suites[0].suite(),
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            "the premise: rustls clients list AES-256-GCM first"
        );
        let client_config = rustls::ClientConfig::builder_with_provider(Arc::new(client_provider))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut client =
            rustls::ClientConnection::new(Arc::new(client_config), "localhost".try_into().unwrap())
                .unwrap();
        let mut server = rustls::ServerConnection::new(pki.server_config.clone()).unwrap();
        for _ in 0..10 {
            if !client.is_handshaking() && !server.is_handshaking() {
                break;
            }
            let mut wire = Vec::new();
            while client.wants_write() {
                client.write_tls(&mut wire).unwrap();
            }
            server.read_tls(&mut wire.as_slice()).unwrap();
            server.process_new_packets().unwrap();
            let mut wire = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut wire).unwrap();
            }
            client.read_tls(&mut wire.as_slice()).unwrap();
            client.process_new_packets().unwrap();
        }
        assert!(!client.is_handshaking(), "the handshake did not complete");
        assert_eq!(
            client.negotiated_cipher_suite().map(|suite| suite.suite()),
            Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
        );
    }
}

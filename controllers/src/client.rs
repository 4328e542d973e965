//! The Kubernetes client, with a kubeconfig client certificate that follows its files.
//!
//! kube's client reads the client certificate, key and CA once, when it is built. kubeadm renews
//! certificates yearly (and `setup-node.sh` rewrites the sidecar's kubeconfig), cert-manager far
//! more often; a client built once would fail every request after the old certificate expires.
//! The loops' caches hold the client, so it must stay the same value: instead of rebuilding it,
//! its TLS configuration resolves the client certificate and verifies the server through a
//! [`Rotating`] that a background task refreshes when the kubeconfig file or the files it names
//! change (checked every [`CHECK_EVERY`]). Connections made after a refresh present the new
//! certificate; open ones (watches) keep the one they were made with until they end, as with
//! client-go.
//!
//! Used when the kubeconfig authenticates with a client certificate (`client-certificate`/
//! `client-key` files or their `-data`), over HTTPS, without a proxy or an exec plugin's
//! certificate. Everything else goes through kube's own builder: bearer token files and exec
//! credentials are refreshed by kube itself, and the in-cluster CA too.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock, Weak};
use std::time::{Duration, SystemTime};

use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube::client::ConfigExt;
use kube::client::retry::RetryPolicy;
use rustls::client::ResolvesClientCert;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use secrecy::ExposeSecret;
use tower::retry::RetryLayer;
use tower::{BoxError, ServiceBuilder};
use tracing::{info, warn};

/// How often the kubeconfig and the certificate files it names are checked for a change (one
/// `stat` each).
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// Why the client's TLS material could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TlsMaterialError {
    #[error("the kubeconfig's client certificate: {0}")]
    Certificate(String),
    #[error("the kubeconfig's client key: {0}")]
    Key(String),
    #[error("the kubeconfig's certificate-authority: {0}")]
    Authority(String),
}

/// A client for `config`. With a client certificate from a kubeconfig, the certificate, key and
/// CA are read again when `kubeconfig` (the file `config` came from; `None`: kube's inference)
/// or the files it names change; see the module documentation.
pub fn build(config: &kube::Config, kubeconfig: Option<&Path>) -> kube::Result<kube::Client> {
    build_checking(config, kubeconfig, CHECK_EVERY)
}

/// [`build`] with another check period (tests).
pub fn build_checking(
    config: &kube::Config,
    kubeconfig: Option<&Path>,
    check_every: Duration,
) -> kube::Result<kube::Client> {
    let rotatable = config.cluster_url.scheme_str() == Some("https")
        && config.proxy_url.is_none()
        && !config.accept_invalid_certs
        && config.auth_info.exec.is_none()
        && (config.auth_info.client_certificate.is_some()
            || config.auth_info.client_certificate_data.is_some());
    if !rotatable {
        let server = server_name(&config.cluster_url);
        return kube::client::ClientBuilder::try_from(config.clone()).map(|builder| {
            builder
                .with_layer(&naming_connection_errors(server))
                .build()
        });
    }
    let source = Source {
        explicit: kubeconfig.map(Path::to_path_buf),
        file: kubeconfig
            .map(Path::to_path_buf)
            .or_else(inferred_kubeconfig),
    };
    let material = Material::read(config).map_err(|err| tls_error(err.to_string()))?;
    let rotating = Arc::new(Rotating {
        provider: material.provider.clone(),
        current: RwLock::new(material),
    });
    let stamps = source.stamps(config);
    tokio::spawn(refresh(
        Arc::downgrade(&rotating),
        source,
        stamps,
        check_every,
    ));
    client_with(config, rotating)
}

fn tls_error(message: String) -> kube::Error {
    kube::Error::Service(message.into())
}

/// The kubeconfig file kube's inference reads, when it is one file: `$KUBECONFIG` naming one
/// path, else `~/.kube/config`.
fn inferred_kubeconfig() -> Option<PathBuf> {
    match std::env::var_os("KUBECONFIG") {
        Some(paths) => {
            let mut paths = std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty());
            let first = paths.next()?;
            paths.next().is_none().then_some(first)
        }
        None => std::env::home_dir().map(|home| home.join(".kube").join("config")),
    }
}

/// Where the configuration is read from again.
struct Source {
    /// What `--kubeconfig` said, to load the same way again.
    explicit: Option<PathBuf>,
    /// The kubeconfig file itself, watched for a rewrite (certificates embedded as `-data`).
    file: Option<PathBuf>,
}

/// A file's identity for change detection: modification time, length and inode. The inode
/// tells a file replaced by a rename (how kubeadm, cert-manager's kubelet volumes and
/// `setup-node.sh` rotate) even when the new file has the same length and, written within the
/// kernel's coarse timestamp tick, the same time.
type Stamp = Option<(SystemTime, u64, u64)>;

fn stamp(path: &Path) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len(), meta.ino()))
}

impl Source {
    /// The watched files and their stamps: the kubeconfig, the client certificate and key
    /// files, and every certificate-authority file it names.
    fn stamps(&self, config: &kube::Config) -> Vec<(PathBuf, Stamp)> {
        let mut files: Vec<PathBuf> = Vec::new();
        files.extend(self.file.clone());
        let auth = &config.auth_info;
        files.extend(auth.client_certificate.iter().map(PathBuf::from));
        files.extend(auth.client_key.iter().map(PathBuf::from));
        if let Some(kubeconfig) = self
            .file
            .as_ref()
            .and_then(|f| kube::config::Kubeconfig::read_from(f).ok())
        {
            files.extend(
                kubeconfig
                    .clusters
                    .iter()
                    .filter_map(|c| c.cluster.as_ref()?.certificate_authority.clone())
                    .map(PathBuf::from),
            );
        }
        files.sort();
        files.dedup();
        files
            .into_iter()
            .map(|f| {
                let s = stamp(&f);
                (f, s)
            })
            .collect()
    }
}

/// Checks the watched files every `every`; when one changed, reads the kubeconfig again and
/// swaps the material in. Ends with the client (the last `Arc` of `rotating`).
async fn refresh(
    rotating: Weak<Rotating>,
    source: Source,
    mut stamps: Vec<(PathBuf, Stamp)>,
    every: Duration,
) {
    let mut failing: Option<String> = None;
    loop {
        tokio::time::sleep(every).await;
        let Some(rotating) = rotating.upgrade() else {
            return;
        };
        if stamps.iter().all(|(path, was)| stamp(path) == *was) {
            continue;
        }
        let loaded = crate::kubeconfig::load(source.explicit.as_deref())
            .await
            .map_err(|err| err.to_string())
            .and_then(|config| {
                Material::read(&config)
                    .map(|material| (config, material))
                    .map_err(|err| err.to_string())
            });
        match loaded {
            Ok((config, material)) => {
                let files: Vec<String> = stamps
                    .iter()
                    .filter(|(path, was)| stamp(path) != *was)
                    .map(|(path, _)| path.display().to_string())
                    .collect();
                stamps = source.stamps(&config);
                if let Ok(mut current) = rotating.current.write() {
                    *current = material;
                }
                failing = None;
                info!(
                    changed = %files.join(", "),
                    "re-read the kubeconfig's client certificate, key and CA; new connections use them"
                );
            }
            // A half-written file (a rotation in progress) reads as broken: keep the last good
            // material and try again next check; warn once per distinct failure.
            Err(err) => {
                if failing.as_deref() != Some(err.as_str()) {
                    warn!(error = %err, "cannot re-read the kubeconfig's changed certificates; keeping the previous ones");
                    failing = Some(err);
                }
            }
        }
    }
}

/// What one read of the kubeconfig gives the TLS layer.
struct Material {
    provider: Arc<CryptoProvider>,
    key: Arc<CertifiedKey>,
    verifier: Arc<WebPkiServerVerifier>,
}

impl Material {
    fn read(config: &kube::Config) -> Result<Self, TlsMaterialError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let auth = &config.auth_info;
        let cert_pem = pem_bytes(
            auth.client_certificate_data.as_deref(),
            auth.client_certificate.as_deref(),
        )
        .map_err(TlsMaterialError::Certificate)?
        .ok_or_else(|| TlsMaterialError::Certificate("none given".to_owned()))?;
        let key_pem = pem_bytes(
            auth.client_key_data
                .as_ref()
                .map(|secret| secret.expose_secret()),
            auth.client_key.as_deref(),
        )
        .map_err(TlsMaterialError::Key)?
        .ok_or_else(|| {
            TlsMaterialError::Key("none given (client-key or client-key-data)".to_owned())
        })?;
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
            .collect::<Result<_, _>>()
            .map_err(|err| TlsMaterialError::Certificate(err.to_string()))?;
        if chain.is_empty() {
            return Err(TlsMaterialError::Certificate(
                "holds no PEM certificate".to_owned(),
            ));
        }
        let key = PrivateKeyDer::from_pem_slice(&key_pem)
            .map_err(|err| TlsMaterialError::Key(err.to_string()))?;
        let key = CertifiedKey::from_der(chain, key, &provider)
            .map_err(|err| TlsMaterialError::Key(err.to_string()))?;

        let mut roots = RootCertStore::empty();
        for der in config.root_cert.iter().flatten() {
            roots
                .add(CertificateDer::from(der.clone()))
                .map_err(|err| TlsMaterialError::Authority(err.to_string()))?;
        }
        if roots.is_empty() {
            return Err(TlsMaterialError::Authority(
                "none given; the client certificate is only re-read with a kubeconfig CA"
                    .to_owned(),
            ));
        }
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|err| TlsMaterialError::Authority(err.to_string()))?;
        Ok(Material {
            provider,
            key: Arc::new(key),
            verifier,
        })
    }
}

/// `-data` (base64) wins over the file, as in kube and client-go.
fn pem_bytes(data: Option<&str>, file: Option<&str>) -> Result<Option<Vec<u8>>, String> {
    use base64::Engine;
    match (data, file) {
        (Some(data), _) => base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|err| format!("its -data is not base64: {err}")),
        (None, Some(file)) => std::fs::read(file)
            .map(Some)
            .map_err(|err| format!("cannot read {file}: {err}")),
        (None, None) => Ok(None),
    }
}

/// The client certificate and the server verification of every new connection: the last
/// material read.
struct Rotating {
    provider: Arc<CryptoProvider>,
    current: RwLock<Material>,
}

impl fmt::Debug for Rotating {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Rotating")
    }
}

impl Rotating {
    fn key(&self) -> Option<Arc<CertifiedKey>> {
        self.current.read().ok().map(|m| m.key.clone())
    }

    fn verifier(&self) -> Result<Arc<WebPkiServerVerifier>, rustls::Error> {
        self.current
            .read()
            .map(|m| m.verifier.clone())
            .map_err(|_| rustls::Error::General("TLS material lock poisoned".to_owned()))
    }
}

impl ResolvesClientCert for Rotating {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        self.key()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl ServerCertVerifier for Rotating {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.verifier()?.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.verifier()?.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// kube's client stack (`ClientBuilder::try_from`) with a TLS configuration of our own: the
/// same timeouts, base URI, credentials, headers and retry of server errors.
fn client_with(config: &kube::Config, rotating: Arc<Rotating>) -> kube::Result<kube::Client> {
    let mut tls = rustls::ClientConfig::builder_with_provider(rotating.provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|err| tls_error(err.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(rotating.clone())
        .with_client_cert_resolver(rotating);
    // A resumed session carries the certificate of the handshake it resumes, so a new
    // connection would go on presenting the old certificate. Connections are pooled and long
    // lived (watches), so a full handshake each costs little.
    tls.resumption = rustls::client::Resumption::disabled();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let mut https = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = ServerName::try_from(name.clone())
            .map_err(|err| tls_error(format!("tls-server-name {name:?}: {err}")))?;
        https = https.with_server_name_resolver(FixedServerNameResolver::new(name));
    }
    let mut connector = TimeoutConnector::new(https.enable_http1().wrap_connector(http));
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .layer(naming_connection_errors(server_name(&config.cluster_url)))
        .map_err(BoxError::from)
        .service(client);
    Ok(kube::Client::new(service, config.default_namespace.clone()))
}

/// A request that did not reach the server, its server named and its causes spelled out.
/// hyper's own error reads `client error (Connect)`: what happened (refused, timed out, a
/// certificate refused) is only in its `source()` chain, which kube's error and a log line do
/// not show.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct TransportError {
    message: String,
    #[source]
    source: BoxError,
}

/// `scheme://host:port` of the cluster URL: what a connection is made to.
pub fn server_name(url: &http::Uri) -> String {
    match (url.scheme_str(), url.authority()) {
        (Some(scheme), Some(authority)) => format!("{scheme}://{authority}"),
        _ => url.to_string(),
    }
}

/// The layer that turns the HTTP client's transport errors into [`TransportError`]s naming
/// `server`; other errors (kube's own, the API's answers) pass as they are.
pub fn naming_connection_errors(
    server: String,
) -> tower::util::MapErrLayer<impl Fn(BoxError) -> BoxError + Clone> {
    tower::util::MapErrLayer::new(move |err: BoxError| explain(err, &server))
}

fn explain(err: BoxError, server: &str) -> BoxError {
    let Some(transport) = err.downcast_ref::<hyper_util::client::legacy::Error>() else {
        return err;
    };
    let message = if transport.is_connect() {
        format!("cannot connect to {server}: {}", root_cause(&*err))
    } else {
        format!("request to {server} failed: {}", error_chain(&*err))
    };
    Box::new(TransportError {
        message,
        source: err,
    })
}

/// The last error of `err`'s `source()` chain: the cause itself (`Connection refused (os error
/// 111)`), not the layers that passed it on.
pub fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut current = err;
    while let Some(source) = current.source() {
        current = source;
    }
    current.to_string()
}

/// Every message of `err`'s `source()` chain, joined by `: `; one already said by the error
/// before it (many errors repeat their source's) is left out.
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut current = err.source();
    while let Some(source) = current {
        let message = source.to_string();
        if !message.is_empty() && !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
        current = source.source();
    }
    text
}

/// An API error as a person reads it: kube's `ServiceError: ` prefix left out of a transport
/// failure, which [`TransportError`] already explains, and every other error with its causes.
pub fn describe(err: &kube::Error) -> String {
    match err {
        kube::Error::Service(inner) if inner.is::<TransportError>() => inner.to_string(),
        other => error_chain(other),
    }
}

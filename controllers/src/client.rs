//! The Kubernetes client, with a kubeconfig client certificate that follows its files.
//!
//! kube's client reads the client certificate, key and CA once, when it is built. kubeadm renews
//! certificates yearly (and `setup-node.sh` rewrites the sidecar's kubeconfig), cert-manager far
//! more often; a client built once would fail every request after the old certificate expires.
//! The loops' caches hold the client, so it must stay the same value: instead of rebuilding it,
//! its TLS configuration resolves the client certificate and verifies the server through a
//! [`Rotating`] that a background task refreshes when the kubeconfig file or the files it names
//! change (checked every [`CHECK_EVERY`]). A refresh closes the connections made before it, as
//! client-go's certificate rotation does (`transport/cert_rotation.go`): the next requests, and
//! the watches that restart, connect again with the new certificate.
//!
//! Every HTTPS client offers HTTP/2 by ALPN, so against kube-apiserver every list, watch and
//! write of one client shares one connection, as client-go's do (over HTTP/1.1 each open watch
//! holds a connection of its own). Through a proxy, or over plain HTTP, kube's own builder is
//! used. Bearer token files and exec credentials are refreshed by kube's auth layer, the
//! in-cluster CA by kube's TLS configuration.

use std::fmt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use futures::task::AtomicWaker;

use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_timeout::TimeoutConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
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
use tower::{BoxError, ServiceBuilder, ServiceExt};
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
    let https = config.cluster_url.scheme_str() == Some("https") && config.proxy_url.is_none();
    let rotatable = https
        && !config.accept_invalid_certs
        && config.auth_info.exec.is_none()
        && (config.auth_info.client_certificate.is_some()
            || config.auth_info.client_certificate_data.is_some());
    if !rotatable {
        let server = server_name(&config.cluster_url);
        return builder(config).map(|builder| {
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
    let retirement = Retirement::default();
    let rotating = Arc::new(Rotating {
        provider: material.provider.clone(),
        current: RwLock::new(material),
        retirement: retirement.clone(),
    });
    let stamps = source.stamps(config);
    tokio::spawn(refresh(
        Arc::downgrade(&rotating),
        source,
        stamps,
        check_every,
    ));
    // The process's own cluster keeps hyper's windows: it is one connection, not one per
    // tenant, and the cluster it reaches is the one the process runs on and trusts; its large
    // LISTs (every Service, every Node) arrive in fewer round trips.
    client_with(
        config,
        config.auth_layer()?,
        rotating_tls(rotating)?,
        retirement,
        None,
    )
    .map(kube::client::ClientBuilder::build)
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
                rotating.retirement.retire();
                failing = None;
                info!(
                    changed = %files.join(", "),
                    "re-read the kubeconfig's client certificate, key and CA; the connections made before are closed, new ones use them"
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
    retirement: Retirement,
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

/// The TLS configuration of a client whose certificate follows `rotating`.
fn rotating_tls(rotating: Arc<Rotating>) -> kube::Result<rustls::ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(rotating.provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|err| tls_error(err.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(rotating.clone())
        .with_client_cert_resolver(rotating);
    // A resumed session carries the certificate of the handshake it resumes, so a new
    // connection would go on presenting the old certificate. Connections are long lived
    // (watches, one h2 connection), so a full handshake each costs little.
    tls.resumption = rustls::client::Resumption::disabled();
    Ok(tls)
}

/// What a server may send on one connection ahead of what the client has read: bytes the
/// connection holds that no reader has taken yet, so that no bound of
/// [`crate::limits::Limits`] or pool counts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadAhead {
    /// HTTP/2's flow-control window for the whole connection: the most it holds unread.
    pub h2_connection_window: u32,
    /// HTTP/2's flow-control window for each stream (a response) of the connection.
    pub h2_stream_window: u32,
    /// HTTP/1.1's read buffer, for each connection.
    pub h1_buffer: usize,
}

impl ReadAhead {
    /// hyper's defaults let a server send 5 MiB on an HTTP/2 connection (2 MiB on one stream)
    /// before anything is read, and fill about 400 KiB of each HTTP/1.1 connection's buffer: a
    /// hostile tenant API holding a stream open and writing as fast as it can would hold that
    /// much of the process beside what the pools count, for each tenant. 512 KiB of connection
    /// window (256 KiB for one stream, so that one response cannot take it all) still lets a
    /// LIST page of 8 MiB (the largest a response may be) arrive within 32 stream windows; 64
    /// KiB of buffer is far beyond any header block kube-apiserver sends. h2
    /// also bounds what small frames cost beyond their payload by half the connection window
    /// (256 KiB here); a server that spends it is cut off as over a bound of
    /// [`crate::limits::Limits`].
    pub const TENANT: ReadAhead = ReadAhead {
        h2_connection_window: 512 * 1024,
        h2_stream_window: 256 * 1024,
        h1_buffer: 64 * 1024,
    };
}

/// kube's client stack (`ClientBuilder::try_from`) with a TLS configuration of our own and
/// HTTP/2 offered: the same timeouts, base URI, credentials, headers and retry of server errors.
/// Connections made before `retired` last moved are closed. Without `read_ahead`, hyper's
/// windows and buffers.
fn client_with(
    config: &kube::Config,
    auth: Option<kube::client::middleware::AuthLayer>,
    tls: rustls::ClientConfig,
    retired: Retirement,
    read_ahead: Option<ReadAhead>,
) -> kube::Result<kube::client::ClientBuilder<Stack>> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // HTTP/2 writes a request as several frames (HEADERS, then DATA): with Nagle's algorithm the
    // second waits for the server to acknowledge the first, which Linux delays by up to 40 ms.
    // Go's net package, and so client-go, turns Nagle off on every connection too.
    http.set_nodelay(true);
    let mut https = HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = ServerName::try_from(name.clone())
            .map_err(|err| tls_error(format!("tls-server-name {name:?}: {err}")))?;
        https = https.with_server_name_resolver(FixedServerNameResolver::new(name));
    }
    // ALPN offers h2 and http/1.1: kube-apiserver picks h2, and then every list, watch and
    // write of this client shares one connection, as client-go's do; a server without h2 (or
    // plain http) gets HTTP/1.1.
    let mut connector = TimeoutConnector::new(https.enable_all_versions().wrap_connector(http));
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let mut client = hyper_util::client::legacy::Client::builder(TokioExecutor::new());
    client
        .timer(TokioTimer::new())
        // A dead h2 connection (a silent network partition) is found by pings, as
        // client-go's ReadIdleTimeout (30 s) and PingTimeout (15 s) find it, rather than
        // by a watch that never ends.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .http2_keep_alive_timeout(Duration::from_secs(15))
        .http2_keep_alive_while_idle(true)
        // Over HTTP/1.1 each open watch holds a connection anyway; of the ones a finished
        // request leaves, keep one, and not for long.
        .pool_max_idle_per_host(1)
        .pool_idle_timeout(Duration::from_secs(30));
    if let Some(read_ahead) = read_ahead {
        client
            .http2_initial_connection_window_size(read_ahead.h2_connection_window)
            .http2_initial_stream_window_size(read_ahead.h2_stream_window)
            .http1_max_buf_size(read_ahead.h1_buffer);
    }
    let client: hyper_util::client::legacy::Client<_, kube::client::Body> =
        client.build(Retiring {
            inner: connector,
            retired,
        });
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(auth)
        .layer(config.extra_headers_layer()?)
        .layer(naming_connection_errors(server_name(&config.cluster_url)))
        .map_err(BoxError::from)
        .map_future(one_connection_first(&config.cluster_url))
        .service(client)
        .map_response(|response| {
            response.map(|body| {
                Box::new(http_body_util::BodyExt::map_err(body, BoxError::from))
                    as Box<kube::client::DynBody>
            })
        })
        .boxed();
    Ok(kube::client::ClientBuilder::new(
        service,
        config.default_namespace.clone(),
    ))
}

/// kube's client service, boxed as kube's own builder boxes it, so that callers add layers
/// to either stack alike.
pub type Stack = tower::util::BoxService<
    http::Request<kube::client::Body>,
    http::Response<Box<kube::client::DynBody>>,
    BoxError,
>;

/// The builder of a client for `config` without certificate files to follow (a tenant's
/// kubeconfig, read from its Secret): over HTTPS without a proxy, HTTP/2 offered as in
/// [`build`]; otherwise kube's own stack, whose connection errors the caller names with
/// [`naming_connection_errors`] (ours already does).
pub fn builder(config: &kube::Config) -> kube::Result<kube::client::ClientBuilder<Stack>> {
    builder_reading_ahead(config, None)
}

/// [`builder`], its connections holding at most `read_ahead` of what a server sent before it
/// is read (over HTTPS without a proxy; kube's own stack keeps hyper's defaults).
pub fn builder_reading_ahead(
    config: &kube::Config,
    read_ahead: Option<ReadAhead>,
) -> kube::Result<kube::client::ClientBuilder<Stack>> {
    if config.cluster_url.scheme_str() == Some("https") && config.proxy_url.is_none() {
        // The credentials before the TLS configuration, as kube's own builder: an exec plugin
        // that fails fails the build once, where reading the TLS configuration first would run
        // it (and wait out its deadline) again.
        let auth = config.auth_layer()?;
        let mut tls = config.rustls_client_config()?;
        // rustls keeps the tickets of 256 servers by default, its table allocated up front
        // (about 15 KiB, a tenant's largest allocation after its connection); this client
        // talks to one server, whose tickets one entry holds.
        tls.resumption = rustls::client::Resumption::in_memory_sessions(1);
        return client_with(config, auth, tls, Retirement::default(), read_ahead);
    }
    kube::client::ClientBuilder::try_from(config.clone())
}

/// Holds a new client's requests back until its first one is answered, then lets them all go.
///
/// Every loop of a cluster starts at once, and hyper learns that a server speaks HTTP/2 only
/// once a connection has negotiated it: each request sent before that dials a connection of
/// its own, so a client would open one a loop (and a process starting 10,000 tenants, tens of
/// thousands) before settling on the one it keeps. Sent one at a time until the first answer,
/// the others find that connection in hyper's pool. A failed request lets the next one try;
/// a server without HTTP/2 still gets its connections, once the first request has gone
/// through. hyper's response futures send nothing until polled, so holding the future back
/// holds the request back.
fn one_connection_first<F, T, E>(
    cluster_url: &http::Uri,
) -> impl Fn(F) -> futures::future::BoxFuture<'static, Result<T, E>> + Clone + use<F, T, E>
where
    F: std::future::Future<Output = Result<T, E>> + Send + 'static,
    T: Send + 'static,
{
    // A plain-http cluster (tests, a local proxy) gets no gate: h2 is negotiated by TLS only.
    let gated = cluster_url.scheme_str() == Some("https");
    let gate = Arc::new(tokio::sync::Semaphore::new(1));
    move |response: F| {
        let gate = gate.clone();
        Box::pin(async move {
            // Closed once a request was answered: every request goes at once from then on.
            let _turn = match gated {
                true => gate.acquire().await.ok(),
                false => None,
            };
            let answer = response.await;
            if answer.is_ok() {
                gate.close();
            }
            answer
        })
    }
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

/// Closes the connections made before the last [`Retirement::retire`]: each connection notes
/// the generation it was made in, and every connection alive is woken when it moves, so that an
/// idle one (an h2 connection between requests) closes at once rather than at its next use.
#[derive(Clone, Default)]
struct Retirement(Arc<RetirementState>);

#[derive(Default)]
struct RetirementState {
    generation: AtomicU64,
    alive: Mutex<Vec<Weak<AtomicWaker>>>,
}

impl Retirement {
    fn retire(&self) {
        self.0.generation.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut alive) = self.0.alive.lock() {
            alive.retain(|waker| match waker.upgrade() {
                Some(waker) => {
                    waker.wake();
                    true
                }
                None => false,
            });
        }
    }

    fn register(&self) -> (u64, Arc<AtomicWaker>) {
        let waker = Arc::new(AtomicWaker::new());
        if let Ok(mut alive) = self.0.alive.lock() {
            alive.retain(|waker| waker.strong_count() > 0);
            alive.push(Arc::downgrade(&waker));
        }
        (self.0.generation.load(Ordering::SeqCst), waker)
    }

    fn retired(&self, made: u64) -> bool {
        self.0.generation.load(Ordering::SeqCst) != made
    }
}

/// A connector whose connections close once retired.
#[derive(Clone)]
struct Retiring<C> {
    inner: C,
    retired: Retirement,
}

impl<C> tower::Service<http::Uri> for Retiring<C>
where
    C: tower::Service<http::Uri>,
    C::Future: Send + 'static,
{
    type Response = RetiringStream<C::Response>;
    type Error = C::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let connecting = self.inner.call(uri);
        let retired = self.retired.clone();
        Box::pin(async move {
            let inner = connecting.await?;
            let (made, waker) = retired.register();
            Ok(RetiringStream {
                inner,
                made,
                waker,
                retired,
            })
        })
    }
}

struct RetiringStream<T> {
    inner: T,
    made: u64,
    waker: Arc<AtomicWaker>,
    retired: Retirement,
}

impl<T> RetiringStream<T> {
    fn check(&self, cx: &Context<'_>) -> std::io::Result<()> {
        self.waker.register(cx.waker());
        if self.retired.retired(self.made) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "closed: the client certificate was renewed",
            ));
        }
        Ok(())
    }
}

impl<T: hyper::rt::Read + Unpin> hyper::rt::Read for RetiringStream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write + Unpin> hyper::rt::Write for RetiringStream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: hyper_util::client::legacy::connect::Connection>
    hyper_util::client::legacy::connect::Connection for RetiringStream<T>
{
    fn connected(&self) -> hyper_util::client::legacy::connect::Connected {
        self.inner.connected()
    }
}

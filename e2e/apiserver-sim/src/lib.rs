//! An in-memory Kubernetes API server for tests and the demo.
//!
//! It speaks the Kubernetes REST protocol (JSON only) for the resources bootstrap-controller
//! touches, over HTTPS with a generated CA, so `kube::Client` and `kubectl` exercise their real
//! TLS, discovery, list, watch and error paths. On top of what kube-apiserver does it offers a
//! [`Backdoor`] (write broken state directly), fault injection ([`Faults`]), a request log and
//! a readiness switch, also reachable over HTTP under `/sim/...` (see the crate README).
//!
//! ```no_run
//! # async fn demo() -> Result<(), apiserver_sim::SimError> {
//! use apiserver_sim::{Sim, SimConfig};
//! let sim = Sim::start(SimConfig::default()).await?;
//! let client = sim.client();
//! // ... drive the code under test with `client` or `sim.kubeconfig_path()` ...
//! sim.shutdown().await;
//! # Ok(()) }
//! ```

mod convert;
mod errors;
mod events;
mod faults;
mod fleet;
mod flood;
mod meta;
mod ops;
pub mod protobuf;
mod resources;
mod selectors;
mod server;
mod services;
mod ssa;
mod store;
mod table;
mod tls;

use std::net::SocketAddr;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde_json::Value;
use tokio::task::JoinHandle;

pub use faults::{FaultKind, FaultRule, Faults, RequestRecord, Trigger, Verb};
pub use fleet::{
    CLUSTER_NAME_LABEL, Fleet, FleetConfig, KUBECONFIG_SECRET_KEY, TENANT_LABEL, kubeconfig_secret,
};

use crate::ops::Shared;
use crate::server::Ctx;

/// Settings for [`Sim::start`]. `SimConfig::default()` is a sensible test setup.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Address to listen on. Default `127.0.0.1:0` (an ephemeral loopback port).
    pub listen: SocketAddr,
    /// Serve plain HTTP instead of HTTPS. Default `false`.
    pub plain_http: bool,
    /// Where to write the kubeconfig. `None` (default): a temporary file removed with the `Sim`.
    pub kubeconfig_path: Option<PathBuf>,
    /// Service ClusterIP ranges, at most one per IP family (like kube-apiserver's
    /// `--service-cluster-ip-range`). Default `10.96.0.0/12`, kubeadm's default.
    pub service_cluster_ip_ranges: Vec<IpNet>,
    /// NodePort range. Default `30000..=32767`, kube-apiserver's default.
    pub service_node_port_range: RangeInclusive<u16>,
    /// Whether Services get ClusterIPs, node ports and IPAddress objects allocated on create.
    /// `false` simulates a control plane without allocation. Default `true`.
    pub allocation: bool,
    /// How long a deleted namespace stays `Terminating` before it and its contents disappear.
    /// Default 500 ms.
    pub namespace_finalize_delay: Duration,
    /// How many watch events are retained. A watch (or a `continue` token) from an older
    /// resourceVersion gets `410 Gone`. Default 10,000; make it small to force relists.
    pub watch_window: usize,
    /// How often watches with `allowWatchBookmarks=true` get a BOOKMARK. Default 1 s
    /// (kube-apiserver: about a minute).
    pub bookmark_interval: Duration,
    /// Namespaces created at startup. Default none: the cluster starts empty, as the
    /// controller under test must create system namespaces itself.
    pub seed_namespaces: Vec<String>,
    /// Refuse API deletion of `default`, `kube-system` and `kube-public` with 403 "this
    /// namespace may not be deleted", as kube-apiserver's NamespaceLifecycle admission plugin
    /// (on by default) does. Default `false` for now, so tests can delete them through the API;
    /// the backdoor can always delete them (what an etcd restore or a disabled plugin allows).
    pub protect_system_namespaces: bool,
    /// Serve `networking.k8s.io/v1` (ServiceCIDR, IPAddress), as Kubernetes 1.33+ does. `false`
    /// simulates an older cluster: discovery of the group and its resources answer 404 (the
    /// simulator still allocates cluster IPs). Default `true`.
    pub serve_networking_v1: bool,
    /// Create the ServiceCIDR `kubernetes` from `service_cluster_ip_ranges` at start, as
    /// kube-apiserver 1.33+ does (only while `serve_networking_v1`). Default `false`: the
    /// in-process tests watch the service-cidr loop create it; the `apiserver-sim` binary turns
    /// it on unless `--no-default-service-cidr`.
    pub default_service_cidr: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            plain_http: false,
            kubeconfig_path: None,
            service_cluster_ip_ranges: vec![IpNet::V4(
                ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 96, 0, 0), 12).unwrap_or_default(),
            )],
            service_node_port_range: 30000..=32767,
            allocation: true,
            namespace_finalize_delay: Duration::from_millis(500),
            watch_window: 10_000,
            bookmark_interval: Duration::from_secs(1),
            seed_namespaces: Vec::new(),
            protect_system_namespaces: false,
            serve_networking_v1: true,
            default_service_cidr: false,
        }
    }
}

/// Why the simulator could not start or a control call failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, #[source] std::io::Error),
    #[error("TLS setup failed: {0}")]
    Tls(String),
    #[error("cannot write kubeconfig {0}: {1}")]
    Kubeconfig(PathBuf, #[source] std::io::Error),
    #[error("cannot build a client from the kubeconfig: {0}")]
    Client(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A backdoor call was rejected (unknown kind, missing name, ...).
    #[error("backdoor: {0}")]
    Backdoor(String),
}

/// A running simulator. Dropping it stops the server; [`Sim::shutdown`] also waits for it.
pub struct Sim {
    shared: Arc<Shared>,
    ctx: Arc<Ctx>,
    base_url: String,
    addr: SocketAddr,
    kubeconfig: PathBuf,
    ca_pem: Option<String>,
    /// `tls-server-name` of the kubeconfig: set behind a shared listener.
    server_name: Option<String>,
    client: kube::Client,
    task: Option<JoinHandle<()>>,
    _tempdir: Option<tempfile::TempDir>,
}

impl Sim {
    /// Starts serving and returns once a client built from the kubeconfig has been answered.
    pub async fn start(config: SimConfig) -> Result<Sim, SimError> {
        Self::start_with_pki(config, None).await
    }

    /// [`Sim::start`] serving with `pki` when given (a fleet's tenants share one) instead of
    /// generating a CA and certificate of its own. Ignored with `plain_http`.
    async fn start_with_pki(config: SimConfig, pki: Option<&tls::Pki>) -> Result<Sim, SimError> {
        Self::start_on(config, Serving::Own(pki)).await
    }

    async fn start_on(config: SimConfig, serving: Serving<'_>) -> Result<Sim, SimError> {
        let mut families = Vec::new();
        for r in &config.service_cluster_ip_ranges {
            let fam = r.addr().is_ipv4();
            if families.contains(&fam) {
                return Err(SimError::Config(format!(
                    "service_cluster_ip_ranges: at most one range per IP family, got {:?}",
                    config.service_cluster_ip_ranges
                )));
            }
            families.push(fam);
        }
        if config.service_node_port_range.is_empty() {
            return Err(SimError::Config(format!(
                "service_node_port_range {:?} is empty",
                config.service_node_port_range
            )));
        }
        let (listener, addr) = match &serving {
            Serving::Own(_) => {
                let listener = tokio::net::TcpListener::bind(config.listen)
                    .await
                    .map_err(|e| SimError::Bind(config.listen, e))?;
                let addr = listener
                    .local_addr()
                    .map_err(|e| SimError::Bind(config.listen, e))?;
                (Some(listener), addr)
            }
            Serving::Behind(behind, _) => (None, behind.addr),
        };
        let host = if addr.ip().is_unspecified() {
            "127.0.0.1".to_string()
        } else if addr.is_ipv6() {
            format!("[{}]", addr.ip())
        } else {
            addr.ip().to_string()
        };
        let address = format!("{host}:{}", addr.port());
        let (pki, base_url, server_name) = match &serving {
            Serving::Own(_) if config.plain_http => (None, format!("http://{address}"), None),
            Serving::Own(pki) => {
                let pki = match pki {
                    Some(p) => (*p).clone(),
                    None => tls::generate(&addr)?,
                };
                (Some(pki), format!("https://{address}"), None)
            }
            Serving::Behind(behind, name) => (
                Some(behind.pki.clone()),
                format!("https://{address}"),
                Some(name.clone()),
            ),
        };
        let (kubeconfig, tempdir) = match &config.kubeconfig_path {
            Some(p) => (p.clone(), None),
            None => {
                let dir = tempfile::Builder::new()
                    .prefix("apiserver-sim-")
                    .tempdir()
                    .map_err(|e| SimError::Kubeconfig(std::env::temp_dir(), e))?;
                (dir.path().join("kubeconfig"), Some(dir))
            }
        };
        let shared = Arc::new(Shared::new(
            config.allocation,
            config.service_cluster_ip_ranges.clone(),
            (
                *config.service_node_port_range.start(),
                *config.service_node_port_range.end(),
            ),
            config.watch_window,
            config.namespace_finalize_delay,
            config.bookmark_interval,
        ));
        shared.protect_system_namespaces.store(
            config.protect_system_namespaces,
            std::sync::atomic::Ordering::SeqCst,
        );
        shared.serve_networking_v1.store(
            config.serve_networking_v1,
            std::sync::atomic::Ordering::SeqCst,
        );
        if config.default_service_cidr
            && config.serve_networking_v1
            && !config.service_cluster_ip_ranges.is_empty()
        {
            shared
                .seed_default_service_cidr(&config.service_cluster_ip_ranges)
                .map_err(|e| SimError::Config(format!("default ServiceCIDR: {}", e.message)))?;
        }
        for ns in &config.seed_namespaces {
            shared
                .seed_namespace(ns)
                .map_err(|e| SimError::Config(format!("seed_namespaces: {ns:?}: {}", e.message)))?;
        }
        let ctx = Arc::new(Ctx::new(Arc::clone(&shared), address));
        let task = match (listener, &serving) {
            (Some(listener), _) => {
                let acceptor = pki
                    .as_ref()
                    .map(|p| tokio_rustls::TlsAcceptor::from(Arc::clone(&p.server_config)));
                Some(tokio::spawn(server::serve(
                    listener,
                    acceptor,
                    Arc::clone(&ctx),
                )))
            }
            (None, Serving::Behind(behind, name)) => {
                let mut routes = behind.routes.write().unwrap_or_else(|e| e.into_inner());
                if routes.contains_key(name) {
                    return Err(SimError::Config(format!(
                        "server name {name:?} is taken behind {}",
                        behind.addr
                    )));
                }
                routes.insert(name.clone(), Arc::clone(&ctx));
                None
            }
            (None, Serving::Own(_)) => None,
        };
        let ca_pem = pki.map(|p| p.ca_pem);
        tls::write_kubeconfig(
            &kubeconfig,
            &base_url,
            ca_pem.as_deref(),
            server_name.as_deref(),
        )?;
        let client = match client_from_kubeconfig(&kubeconfig).await {
            Ok(c) => c,
            Err(e) => {
                ctx.cancel.cancel();
                return Err(e);
            }
        };
        // Behind a shared listener the fleet checks the listener once: a request here would
        // leave this client a pooled connection (two descriptors of this process) per tenant.
        if matches!(serving, Serving::Own(_))
            && let Err(e) = client.apiserver_version().await
        {
            ctx.cancel.cancel();
            return Err(SimError::Client(format!("GET /version failed: {e}")));
        }
        ctx.requests.clear();
        Ok(Sim {
            shared,
            ctx,
            base_url,
            addr,
            kubeconfig,
            ca_pem,
            server_name,
            client,
            task,
            _tempdir: tempdir,
        })
    }

    /// A client built from the kubeconfig (so it goes through TLS verification with the CA).
    pub fn client(&self) -> kube::Client {
        self.client.clone()
    }

    /// A fresh client from the kubeconfig (own connection pool).
    pub async fn new_client(&self) -> Result<kube::Client, SimError> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// The `kube::Config` the kubeconfig yields, to build a client with other settings
    /// (e.g. `default_retry = false`: kube's default client retries 429/503/504 itself).
    pub async fn kube_config(&self) -> Result<kube::Config, SimError> {
        config_from_kubeconfig(&self.kubeconfig).await
    }

    /// The kubeconfig file (`kubectl --kubeconfig`, `KUBECONFIG=`).
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig
    }

    /// The kubeconfig's text: self-contained (server URL, the CA inline, the token the
    /// simulator accepts), what a Cluster API `<cluster>-kubeconfig` Secret holds.
    pub fn kubeconfig_yaml(&self) -> String {
        tls::kubeconfig_text(
            &self.base_url,
            self.ca_pem.as_deref(),
            self.server_name.as_deref(),
        )
    }

    /// The server name (SNI) that reaches this simulator behind a fleet's shared listener (its
    /// kubeconfig's `tls-server-name`); `None` for a simulator with a listener of its own.
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    /// `https://127.0.0.1:PORT` (or `http://` with `plain_http`). Behind a fleet's shared
    /// listener, that listener's.
    pub fn base_url(&self) -> &str {
        &self.base_url
    }

    /// The bound socket address (behind a fleet's shared listener, that listener's).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The generated CA certificate (PEM), `None` with `plain_http`.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// Direct access to stored objects, bypassing validation and allocation.
    pub fn backdoor(&self) -> Backdoor<'_> {
        Backdoor {
            shared: &self.shared,
        }
    }

    /// Fault injection rules.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// A snapshot of the request log (oldest first; the last 500,000). `/sim/...` calls are
    /// not logged.
    pub fn requests(&self) -> Vec<RequestRecord> {
        self.ctx.requests.snapshot()
    }

    /// Empties the request log.
    pub fn clear_requests(&self) {
        self.ctx.requests.clear();
    }

    /// How many logged requests have this verb (`"list"`, `"create"`, ...) and resource plural.
    pub fn request_count(&self, verb: &str, resource: &str) -> usize {
        self.ctx
            .requests
            .snapshot()
            .iter()
            .filter(|r| r.verb == verb && r.resource == resource)
            .count()
    }

    /// Sets what `/readyz` reports.
    pub fn set_ready(&self, ready: bool) {
        self.shared
            .ready
            .store(ready, std::sync::atomic::Ordering::SeqCst);
    }

    /// Serves `networking.k8s.io/v1` from now on, or stops serving it (see
    /// [`SimConfig::serve_networking_v1`]): a control plane upgraded or downgraded in place.
    pub fn set_serve_networking_v1(&self, served: bool) {
        self.shared
            .serve_networking_v1
            .store(served, std::sync::atomic::Ordering::SeqCst);
    }

    /// Ends every open watch stream cleanly, as an apiserver restart or a load balancer's idle
    /// timeout would; clients re-watch from their last resourceVersion.
    pub fn close_watches(&self) {
        self.ctx.close_watches();
    }

    /// Closes every open connection, abandoning in-flight requests and watches.
    pub fn drop_connections(&self) {
        self.ctx.drop_connections();
    }

    /// How many connections this simulator has served since it started (over TLS, those
    /// whose handshake completed): what a client dialled, however many it kept.
    pub fn connections_served(&self) -> usize {
        self.ctx
            .connections
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many watch streams on `resource` (a plural or `plural.group`) are open right now.
    /// Lets a test wait until the code under test is watching before it changes something.
    /// Unknown resources count 0.
    pub fn open_watches(&self, resource: &str) -> usize {
        resources::find_by_name(resource)
            .map(|i| self.ctx.open_watches[i].load(std::sync::atomic::Ordering::SeqCst))
            .unwrap_or(0)
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.shared.current_rv()
    }

    /// Stops accepting and closes every connection (watches end), then waits for the server.
    pub async fn shutdown(mut self) {
        self.ctx.cancel.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

/// Where a [`Sim`] takes its connections.
enum Serving<'a> {
    /// A listener of its own, on `SimConfig::listen`, with this CA and certificate (else its own).
    Own(Option<&'a tls::Pki>),
    /// A fleet's shared TLS listener, as the connections whose ClientHello names this server.
    Behind(&'a fleet::SharedListener, String),
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("base_url", &self.base_url)
            .field("kubeconfig", &self.kubeconfig)
            .finish_non_exhaustive()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        self.ctx.cancel.cancel();
    }
}

async fn config_from_kubeconfig(path: &Path) -> Result<kube::Config, SimError> {
    let kc = kube::config::Kubeconfig::read_from(path)
        .map_err(|e| SimError::Client(format!("reading {}: {e}", path.display())))?;
    kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| SimError::Client(e.to_string()))
}

async fn client_from_kubeconfig(path: &Path) -> Result<kube::Client, SimError> {
    let cfg = config_from_kubeconfig(path).await?;
    kube::Client::try_from(cfg).map_err(|e| SimError::Client(e.to_string()))
}

/// Writes and deletes stored objects directly: no validation, no allocation, no namespace
/// checks, no cascading. Each write still gets a new resourceVersion and a watch event, so
/// watchers (and informers of the code under test) see the change.
#[derive(Debug, Clone, Copy)]
pub struct Backdoor<'a> {
    shared: &'a Shared,
}

fn resource_index(resource: &str) -> Result<usize, SimError> {
    resources::find_by_name(resource).ok_or_else(|| {
        SimError::Backdoor(format!(
            "unknown resource {resource:?}; use a plural such as \"services\" or \"leases.coordination.k8s.io\""
        ))
    })
}

fn to_value(b: &[u8]) -> Result<Value, SimError> {
    serde_json::from_slice(b).map_err(|e| SimError::Backdoor(e.to_string()))
}

impl Backdoor<'_> {
    /// Stores `object` as given (resource chosen by `apiVersion` + `kind`; `metadata.name` and,
    /// for namespaced kinds, `metadata.namespace` required). Missing `uid`/`creationTimestamp`
    /// are filled in. Returns the stored object with its new resourceVersion.
    pub fn put(&self, object: Value) -> Result<Value, SimError> {
        let b = self
            .shared
            .backdoor_put(object)
            .map_err(|e| SimError::Backdoor(e.message))?;
        to_value(&b)
    }

    /// Deletes an object (DELETED event; nothing released, nothing cascaded). `resource` is a
    /// plural (`services`) or `plural.group`; `namespace` is `""` for cluster-scoped objects.
    /// Returns the deleted object, or `None` if it did not exist.
    pub fn delete(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, SimError> {
        let idx = resource_index(resource)?;
        match self
            .shared
            .backdoor_delete(convert::storage_idx(idx), namespace, name)
            .map_err(|e| SimError::Backdoor(e.message))?
        {
            Some(b) => to_value(&b).map(|v| Some(convert::from_storage(idx, v))),
            None => Ok(None),
        }
    }

    /// Deletes an object without a DELETED event: every watch misses the delete, as a client's
    /// watch does when it cannot decode the object, and a cache fed by it keeps the object until
    /// it lists again. Nothing released, nothing cascaded. Returns the deleted object, or `None`
    /// if it did not exist.
    pub fn delete_unseen(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, SimError> {
        let idx = resource_index(resource)?;
        self.shared
            .backdoor_delete_unseen(convert::storage_idx(idx), namespace, name)
            .map(|b| to_value(&b).map(|v| convert::from_storage(idx, v)))
            .transpose()
    }

    /// Reads an object (events.k8s.io Events are shown in that API's form).
    pub fn get(
        &self,
        resource: &str,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Value>, SimError> {
        let idx = resource_index(resource)?;
        match self.shared.get(convert::storage_idx(idx), namespace, name) {
            Ok(b) => to_value(&b).map(|v| Some(convert::from_storage(idx, v))),
            Err(_) => Ok(None),
        }
    }

    /// Every stored object of a resource, all namespaces, ordered by namespace and name.
    pub fn list(&self, resource: &str) -> Result<Vec<Value>, SimError> {
        let idx = resource_index(resource)?;
        let jsons: Vec<bytes::Bytes> = self.shared.read().objects[convert::storage_idx(idx)]
            .values()
            .map(|s| s.json.clone())
            .collect();
        jsons
            .iter()
            .map(|b| to_value(b).map(|v| convert::from_storage(idx, v)))
            .collect()
    }

    /// Node ports the allocator currently holds (the simulator's equivalent of the
    /// `servicenodeports` RangeAllocation, which the REST API does not expose).
    pub fn allocated_node_ports(&self) -> Vec<u16> {
        let mut v: Vec<u16> = self.shared.read().node_ports.iter().copied().collect();
        v.sort_unstable();
        v
    }
}

//! Many simulated clusters in one process: a management cluster that holds, for each tenant
//! cluster, a kubeconfig Secret shaped like Cluster API's `<cluster>-kubeconfig`.
//!
//! Each tenant is a full [`Sim`] with its own store, request log and faults; what they share is
//! one CA and serving certificate (it names no port), so a tenant costs no key generation and no
//! TLS configuration of its own. By default each tenant has a listener of its own; with
//! [`FleetConfig::shared_listener`] they are all behind one TLS listener, each told apart by the
//! server name (SNI) its kubeconfig's `tls-server-name` makes clients send, so a tenant costs
//! this process no descriptor at rest beyond the connections made to it.

use std::path::PathBuf;

use base64::Engine;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Value, json};

use crate::{Serving, Sim, SimConfig, SimError, server, tls};

/// Label every tenant kubeconfig Secret carries, value `"true"`
/// (`--tenants-secret-selector bootstrap-controller.io/tenant=true`).
pub const TENANT_LABEL: &str = "bootstrap-controller.io/tenant";
/// Cluster API's label naming the cluster a Secret belongs to.
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";
/// The data key holding the kubeconfig, as in Cluster API's kubeconfig Secrets.
pub const KUBECONFIG_SECRET_KEY: &str = "value";

/// How many tenants start at once: enough to hide each start's round trip, few enough that the
/// TLS handshakes of the start-up probes do not starve an already running controller.
const START_CONCURRENCY: usize = 16;

/// Settings for [`Fleet::start`].
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// How many tenant clusters. Default 0.
    pub tenants: usize,
    /// The management cluster. [`FleetConfig::namespace`] is added to its seed namespaces.
    pub management: SimConfig,
    /// Every tenant cluster. `listen` must have port 0 when there are several tenants, each with
    /// a listener of its own; `kubeconfig_path` is ignored (each tenant's goes to
    /// [`FleetConfig::kubeconfig_dir`]).
    pub tenant: SimConfig,
    /// Serve every tenant behind one TLS listener on `tenant.listen`, tenant `i` as
    /// `tenant-<i>.apiserver-sim.test` (its kubeconfig's `tls-server-name`), instead of one
    /// listener a tenant. Needs TLS (not `tenant.plain_http`). Default `false`.
    pub shared_listener: bool,
    /// Namespace of the tenant Secrets in the management cluster. Default `tenants`.
    pub namespace: String,
    /// Where `tenant-<i>.kubeconfig` files are written. `None` (default): a temporary directory
    /// removed with the fleet.
    pub kubeconfig_dir: Option<PathBuf>,
    /// Whether the management cluster gets one Secret per tenant at start. Default `true`;
    /// `false` lets a test create them itself ([`Fleet::tenant_secret`]).
    pub write_secrets: bool,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            tenants: 0,
            management: SimConfig::default(),
            tenant: SimConfig::default(),
            namespace: "tenants".into(),
            kubeconfig_dir: None,
            write_secrets: true,
            shared_listener: false,
        }
    }
}

/// A running management cluster and its tenant clusters.
pub struct Fleet {
    management: Sim,
    tenants: Vec<Sim>,
    namespace: String,
    shared_listener: Option<SharedListener>,
    _tempdir: Option<tempfile::TempDir>,
}

/// The one TLS listener of a fleet's tenants ([`FleetConfig::shared_listener`]).
pub(crate) struct SharedListener {
    pub(crate) addr: std::net::SocketAddr,
    pub(crate) pki: tls::Pki,
    pub(crate) routes: server::Routes,
    cancel: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl SharedListener {
    async fn bind(listen: std::net::SocketAddr, pki: tls::Pki) -> Result<Self, SimError> {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|e| SimError::Bind(listen, e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| SimError::Bind(listen, e))?;
        let routes = server::Routes::default();
        let cancel = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(server::serve_shared(
            listener,
            std::sync::Arc::clone(&pki.server_config),
            std::sync::Arc::clone(&routes),
            cancel.clone(),
        ));
        Ok(Self {
            addr,
            pki,
            routes,
            cancel,
            task,
        })
    }
}

/// A Cluster API style kubeconfig Secret for `cluster` in `namespace`: name
/// `<cluster>-kubeconfig`, labels [`CLUSTER_NAME_LABEL`]`=<cluster>` and
/// [`TENANT_LABEL`]`=true`, type `cluster.x-k8s.io/secret`, the kubeconfig base64-encoded under
/// [`KUBECONFIG_SECRET_KEY`].
pub fn kubeconfig_secret(namespace: &str, cluster: &str, kubeconfig: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": format!("{cluster}-kubeconfig"),
            "namespace": namespace,
            "labels": {
                CLUSTER_NAME_LABEL: cluster,
                TENANT_LABEL: "true",
            },
        },
        "type": "cluster.x-k8s.io/secret",
        "data": {
            KUBECONFIG_SECRET_KEY: base64::engine::general_purpose::STANDARD.encode(kubeconfig),
        },
    })
}

impl Drop for SharedListener {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

impl Fleet {
    /// Starts the management cluster and `config.tenants` tenant clusters, and (unless
    /// `write_secrets` is off) stores one kubeconfig Secret per tenant in the management
    /// cluster through the backdoor, so the management request log starts empty.
    pub async fn start(config: FleetConfig) -> Result<Fleet, SimError> {
        let FleetConfig {
            tenants,
            mut management,
            tenant,
            namespace,
            kubeconfig_dir,
            write_secrets,
            shared_listener,
        } = config;
        if shared_listener && tenant.plain_http {
            return Err(SimError::Config(
                "fleet: a shared listener tells tenants apart by TLS server name, so it needs \
                 TLS: turn off plain_http or shared_listener"
                    .into(),
            ));
        }
        if !shared_listener && tenants > 1 && tenant.listen.port() != 0 {
            return Err(SimError::Config(format!(
                "fleet: tenant listen address {} names a port, but {tenants} tenants cannot share it",
                tenant.listen
            )));
        }
        if !management.seed_namespaces.contains(&namespace) {
            management.seed_namespaces.push(namespace.clone());
        }
        let (dir, tempdir) = match kubeconfig_dir {
            Some(d) => {
                std::fs::create_dir_all(&d).map_err(|e| SimError::Kubeconfig(d.clone(), e))?;
                (d, None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("apiserver-sim-fleet-")
                    .tempdir()
                    .map_err(|e| SimError::Kubeconfig(std::env::temp_dir(), e))?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let pki = if tenant.plain_http {
            None
        } else {
            Some(tls::generate(&tenant.listen)?)
        };
        let management = Sim::start(management).await?;
        let shared = match (shared_listener, &pki) {
            (true, Some(pki)) => Some(SharedListener::bind(tenant.listen, pki.clone()).await?),
            _ => None,
        };
        let started: Result<Vec<Sim>, SimError> = futures::stream::iter(0..tenants)
            .map(|i| {
                let config = SimConfig {
                    kubeconfig_path: Some(dir.join(format!("{}.kubeconfig", Self::tenant_name(i)))),
                    ..tenant.clone()
                };
                let serving = match &shared {
                    Some(shared) => Serving::Behind(shared, Self::server_name(i)),
                    None => Serving::Own(pki.as_ref()),
                };
                Sim::start_on(config, serving)
            })
            .buffered(START_CONCURRENCY)
            .try_collect()
            .await;
        let fleet = Fleet {
            management,
            tenants: Vec::new(),
            namespace,
            shared_listener: shared,
            _tempdir: tempdir,
        };
        let fleet = match started {
            Ok(tenants) => Fleet { tenants, ..fleet },
            Err(e) => {
                fleet.shutdown().await;
                return Err(e);
            }
        };
        // Behind the shared listener no tenant was asked anything yet: one request to the first
        // and one to the last, each on a connection closed after it, show that the listener
        // answers and tells them apart.
        if fleet.shared_listener.is_some() {
            let mut answered = Ok(());
            for sim in [fleet.tenants.first(), fleet.tenants.last()]
                .into_iter()
                .flatten()
            {
                answered = match sim.new_client().await {
                    Ok(client) => client
                        .apiserver_version()
                        .await
                        .map(drop)
                        .map_err(|e| SimError::Client(format!("GET /version failed: {e}"))),
                    Err(e) => Err(e),
                };
                sim.clear_requests();
                if answered.is_err() {
                    break;
                }
            }
            if let Err(e) = answered {
                fleet.shutdown().await;
                return Err(e);
            }
        }
        if write_secrets {
            for i in 0..fleet.tenants.len() {
                if let Some(secret) = fleet.tenant_secret(i) {
                    fleet.management.backdoor().put(secret)?;
                }
            }
        }
        Ok(fleet)
    }

    /// `tenant-<i>`: the tenant's cluster name (its Secret's [`CLUSTER_NAME_LABEL`]).
    pub fn tenant_name(i: usize) -> String {
        format!("tenant-{i}")
    }

    /// `tenant-<i>.apiserver-sim.test`: tenant `i`'s server name behind a shared listener.
    pub fn server_name(i: usize) -> String {
        format!("{}.{}", Self::tenant_name(i), tls::FLEET_DOMAIN)
    }

    /// The shared listener's address ([`FleetConfig::shared_listener`]), `None` when each
    /// tenant has a listener of its own.
    pub fn shared_addr(&self) -> Option<std::net::SocketAddr> {
        self.shared_listener.as_ref().map(|s| s.addr)
    }

    /// `tenant-<i>-kubeconfig`: the name of tenant `i`'s Secret.
    pub fn secret_name(i: usize) -> String {
        format!("{}-kubeconfig", Self::tenant_name(i))
    }

    /// The management cluster.
    pub fn management(&self) -> &Sim {
        &self.management
    }

    /// Every tenant cluster, tenant `i` at index `i`.
    pub fn tenants(&self) -> &[Sim] {
        &self.tenants
    }

    /// Tenant `i`, `None` past the last.
    pub fn tenant(&self, i: usize) -> Option<&Sim> {
        self.tenants.get(i)
    }

    /// Namespace of the tenant Secrets in the management cluster.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Tenant `i`'s self-contained kubeconfig (what its Secret holds, decoded).
    pub fn tenant_kubeconfig(&self, i: usize) -> Option<String> {
        self.tenant(i).map(Sim::kubeconfig_yaml)
    }

    /// Tenant `i`'s Secret as stored at start ([`kubeconfig_secret`]), for a test to create,
    /// change (rotate) or delete itself.
    pub fn tenant_secret(&self, i: usize) -> Option<Value> {
        self.tenant_kubeconfig(i)
            .map(|k| kubeconfig_secret(&self.namespace, &Self::tenant_name(i), &k))
    }

    /// Stops every cluster and waits for their servers.
    pub async fn shutdown(self) {
        futures::future::join_all(self.tenants.into_iter().map(Sim::shutdown)).await;
        if let Some(mut shared) = self.shared_listener {
            shared.cancel.cancel();
            let _ = (&mut shared.task).await;
        }
        self.management.shutdown().await;
    }
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("management", &self.management)
            .field("tenants", &self.tenants.len())
            .field("namespace", &self.namespace)
            .field("shared_addr", &self.shared_addr())
            .finish_non_exhaustive()
    }
}

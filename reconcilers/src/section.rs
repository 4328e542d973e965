//! A loop's section of the configuration file (`loops.<key>`), and what it is given.
//!
//! Each loop module owns its section: a serde type with upstream's defaults, its validation, and
//! how the loop is built from it ([`LoopSection`]). The runtime keeps only the list of sections
//! (`bootstrap_controller::config::Loops`) and the settings every loop may read ([`Settings`]:
//! the flags that mirror kube-apiserver's).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use ipnet::IpNet;

use crate::alloc::PortRange;
use crate::budget::CacheBudget;
use crate::contract::Reconciler;
use crate::discovery::NetworkingDiscovery;
use crate::legacy_alloc::etcd::EtcdConfig;
use crate::metrics::MetricRegistry;
use crate::service_cache::record::ServiceCidrRecord;
use crate::service_cache::record::ServiceRecord;
use crate::watch_cache::WatchCache;

/// One invalid value: the field (flag or YAML path) and what is wrong with it, with the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl ConfigError {
    /// `message` is anything that displays: a sentence, or a typed error from a parser.
    pub fn new(field: impl Into<String>, message: impl std::fmt::Display) -> Self {
        ConfigError {
            field: field.into(),
            message: message.to_string(),
        }
    }
}

/// The settings outside `loops` that several loops read: kube-apiserver's flags, held once in the
/// effective configuration (its top-level keys, which this serialises to), and what belongs to
/// this replica and its cluster. Validated before any section sees them. The two flags only the
/// endpoints loop reads (`endpointReconcilerType`, `apiserverCount`) are held by its section.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Settings {
    /// `serviceClusterIPRange`, primary first. Empty when not set: no range is assumed
    /// (kube-apiserver's 10.0.0.0/24 is not kubeadm's, k3s' or a managed cluster's); the loops
    /// read it from the `kubernetes` ServiceCIDR.
    #[serde(
        rename = "serviceClusterIPRange",
        serialize_with = "serialize_cidrs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_ranges: Vec<IpNet>,
    /// `serviceNodePortRange`.
    #[serde(rename = "serviceNodePortRange")]
    pub node_port_range: PortRange,
    /// `advertiseAddress` as configured (loops that need one fall back to the default route).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<IpAddr>,
    /// `securePort`: the `kubernetes` Service's targetPort and the endpoints' port. `None` when
    /// the operator set none: the endpoints then use kube-apiserver's default (6443), and the
    /// Service keeps the targetPort it has (443 on many managed control planes), so that a
    /// default never rewrites it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secure_port: Option<u16>,
    /// `kubernetesServiceNodePort`: 0 for a ClusterIP `kubernetes` Service, a port for a
    /// NodePort one. `None` when the operator set none: a Service is created ClusterIP and an
    /// existing one keeps its type and node port (a kube-apiserver's
    /// `--kubernetes-service-node-port`), so that a default never rewrites it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes_service_node_port: Option<u16>,
    /// The `--etcd-*` settings (etcd mode when `etcdServers` is set); a tenant's also hold its
    /// client certificate, from its Secret, and its etcd's addresses and cluster as checked
    /// before it started (management mode).
    #[serde(flatten)]
    pub etcd: EtcdConfig,
    /// This replica: events' `reportingInstance`, membership Lease holder.
    #[serde(skip)]
    pub identity: String,
}

/// `a,b`, as the flag takes them.
fn serialize_cidrs<S: serde::Serializer>(
    cidrs: &[IpNet],
    serializer: S,
) -> Result<S::Ok, S::Error> {
    let text: Vec<String> = cidrs.iter().map(ToString::to_string).collect();
    serializer.serialize_str(&text.join(","))
}

/// Builds the kube configuration (the kubeconfig's) that the endpoints loop's readiness probe of
/// a full URL starts from.
pub type ConfigLoader = Arc<
    dyn Fn() -> BoxFuture<'static, Result<kube::Config, Box<dyn std::error::Error + Send + Sync>>>
        + Send
        + Sync,
>;

/// A namespaced name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl Settings {
    /// Who events say they come from: the controller, and this replica.
    pub fn reporter(&self) -> kube::runtime::events::Reporter {
        crate::events::reporter(&self.identity)
    }

    /// The endpoints' port: `securePort`, else kube-apiserver's default.
    pub fn endpoints_port(&self) -> u16 {
        self.secure_port.unwrap_or(DEFAULT_SECURE_PORT)
    }

    /// etcd mode's settings, when `etcdServers` is set.
    pub fn etcd(&self) -> Option<&EtcdConfig> {
        (!self.etcd.servers.is_empty()).then_some(&self.etcd)
    }
}

/// kube-apiserver's default `--secure-port`.
pub const DEFAULT_SECURE_PORT: u16 = 6443;

/// The controller's empty configuration, which its tests compare with this: kube-apiserver's
/// defaults (no range configured: read from the cluster; node ports 30000-32767, no `securePort`
/// (the endpoints on 6443, the Service's targetPort kept), no `kubernetesServiceNodePort` (the
/// Service's type and node port kept), no advertise address). No identity or etcd, which belong
/// to a replica.
impl Default for Settings {
    fn default() -> Self {
        Settings {
            service_ranges: Vec::new(),
            node_port_range: PortRange::default(),
            secure_port: None,
            kubernetes_service_node_port: None,
            advertise_address: None,
            identity: String::new(),
            etcd: EtcdConfig::default(),
        }
    }
}

/// Settings for the unit tests of the loops: the defaults and a fixed identity.
#[cfg(test)]
pub(crate) fn test_settings() -> Settings {
    Settings {
        identity: "test-replica".to_owned(),
        ..Settings::default()
    }
}

/// The fields `bad` is refused on, under `path`, after checking that the section's defaults
/// pass: the shape of every section's validation test.
#[cfg(test)]
pub(crate) fn refused_fields<S: LoopSection + Default>(path: &str, bad: &S) -> Vec<String> {
    let settings = test_settings();
    let mut errors = Vec::new();
    S::default().validate(path, &settings, &mut errors);
    assert_eq!(errors, [], "the defaults of {path} are valid");
    bad.validate(path, &settings, &mut errors);
    errors.into_iter().map(|error| error.field).collect()
}

/// What a loop is built with.
pub struct BuildContext<'a> {
    pub client: kube::Client,
    /// The cluster's metrics registry (the process's, or a tenant's); each loop registers under
    /// its own name.
    pub registry: &'a mut dyn MetricRegistry,
    pub settings: &'a Settings,
    /// The `kubernetes` Service (`loops.kubernetesService`, the section that names it): the
    /// endpoints loops write its Endpoints and EndpointSlice, and the repairs post their etcd
    /// bitmaps' events on it (the ClusterIP repair's range error also names its ClusterIP).
    pub kubernetes_service: ServiceName,
    /// What the cluster's caches may hold together (unlimited for the cluster of
    /// `--kubeconfig`; a tenant's own in management mode).
    pub budget: CacheBudget,
    /// Loads the kubeconfig again (a readiness probe of a full URL uses its CA and credentials).
    pub load_kubeconfig: ConfigLoader,
    /// The Service cache, made by the first loop that asks ([`BuildContext::services`]).
    services: Option<WatchCache<ServiceRecord>>,
    /// The ServiceCIDR cache, likewise ([`BuildContext::service_cidrs`]).
    service_cidrs: Option<WatchCache<ServiceCidrRecord>>,
    /// Discovery of networking.k8s.io/v1, likewise ([`BuildContext::discovery`]).
    discovery: Option<Arc<NetworkingDiscovery>>,
}

impl<'a> BuildContext<'a> {
    pub fn new(
        client: kube::Client,
        registry: &'a mut dyn MetricRegistry,
        settings: &'a Settings,
        kubernetes_service: ServiceName,
        budget: CacheBudget,
        load_kubeconfig: ConfigLoader,
    ) -> Self {
        BuildContext {
            client,
            registry,
            settings,
            kubernetes_service,
            budget,
            load_kubeconfig,
            services: None,
            service_cidrs: None,
            discovery: None,
        }
    }

    /// Discovery of networking.k8s.io/v1 every loop of this cluster shares, so that the
    /// cluster is asked once however many loops need the answer.
    pub fn discovery(&mut self) -> Arc<NetworkingDiscovery> {
        (self
            .discovery
            .get_or_insert_with(|| NetworkingDiscovery::new(self.client.clone())))
        .clone()
    }

    /// The Service cache every loop of this cluster that reads Services shares, so the process
    /// lists and watches Services once whichever of those loops are enabled and in whatever
    /// order they are built. A loop that reads every Service names its `page_size` (the first
    /// named is the cache's); one that reads a single Service passes `None` and names it
    /// ([`WatchCache::read_one`]). The first loop to subscribe to it feeds it.
    pub fn services(&mut self, page_size: impl Into<Option<u32>>) -> WatchCache<ServiceRecord> {
        shared(
            &mut self.services,
            &self.client,
            &self.budget,
            page_size.into(),
        )
    }

    /// The ServiceCIDR cache every loop of this cluster that reads ServiceCIDRs shares, as
    /// [`Self::services`].
    pub fn service_cidrs(
        &mut self,
        page_size: impl Into<Option<u32>>,
    ) -> WatchCache<ServiceCidrRecord> {
        shared(
            &mut self.service_cidrs,
            &self.client,
            &self.budget,
            page_size.into(),
        )
    }
}

/// The cache in `slot`, made on first use.
fn shared<T: crate::watch_cache::Cached>(
    slot: &mut Option<WatchCache<T>>,
    client: &kube::Client,
    budget: &CacheBudget,
    page_size: Option<u32>,
) -> WatchCache<T> {
    let cache = slot.get_or_insert_with(|| WatchCache::shared(client.clone(), budget));
    if let Some(page_size) = page_size {
        cache.read_every(page_size);
    }
    cache.clone()
}

/// Why a loop was not built. Unreachable after validation; reported, never a panic.
pub type BuildError = Box<dyn std::error::Error + Send + Sync>;

/// What every loop's section implements.
pub trait LoopSection: std::fmt::Debug + Send + Sync {
    /// A disabled loop is not built: no watches, no metrics, not part of `/readyz`.
    fn enabled(&self) -> bool;

    /// Push one [`ConfigError`] per problem; `path` is the section's YAML path, e.g.
    /// `loops.systemNamespaces`.
    fn validate(&self, path: &str, settings: &Settings, errors: &mut Vec<ConfigError>);

    /// The loop (or loops) of an enabled, validated section.
    fn build(&self, context: &mut BuildContext<'_>)
    -> Result<Vec<Arc<dyn Reconciler>>, BuildError>;
}

/// Every loop has an interval; zero would spin.
pub fn validate_interval(path: &str, interval: Duration, errors: &mut Vec<ConfigError>) {
    if interval.is_zero() {
        errors.push(ConfigError::new(
            format!("{path}.interval"),
            "must be greater than zero (e.g. 10s or 1m)",
        ));
    }
}

/// `loops.<loop>.pageSize`: a LIST page holds at least one object.
pub fn validate_page_size(path: &str, page_size: u32, errors: &mut Vec<ConfigError>) {
    if page_size == 0 {
        errors.push(ConfigError::new(
            format!("{path}.pageSize"),
            format!(
                "must be at least 1 (the default is {})",
                crate::watch_cache::DEFAULT_PAGE_SIZE
            ),
        ));
    }
}

/// A duration that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("is empty {DURATION_HINT}")]
    Empty,
    #[error("{0:?} is not a duration {DURATION_HINT}")]
    NotADuration(String),
    #[error("{0:?} is negative {DURATION_HINT}")]
    Negative(String),
    #[error(
        "{0:?} is longer than 8760h (365 days), more than any setting needs: give a shorter \
         duration (e.g. 10s, 1m, 24h)"
    )]
    TooLong(String),
}

/// The longest duration a setting takes: far beyond any interval, timeout or lease a cluster
/// needs, and short enough that a deadline (now plus it) and a Lease's `leaseDurationSeconds`
/// (an i32) always hold it.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

const DURATION_HINT: &str =
    "(expected a number with a unit: ms, s, m or h, e.g. 10s, 1m30s, 500ms)";

/// Parses durations such as `500ms`, `10s`, `1m`, `1m30s`, `2h` (jiff's friendly format, so
/// also `1.5s` or `1 minute`; ISO 8601 `PT10S` too).
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(DurationError::Empty);
    }
    let parsed: jiff::SignedDuration = trimmed
        .parse()
        .map_err(|_| DurationError::NotADuration(text.to_owned()))?;
    let duration =
        Duration::try_from(parsed).map_err(|_| DurationError::Negative(text.to_owned()))?;
    if duration > MAX_DURATION {
        return Err(DurationError::TooLong(text.to_owned()));
    }
    Ok(duration)
}

/// Formats a duration the way [`parse_duration`] reads it, e.g. `1m30s`, `500ms`.
pub fn format_duration(duration: Duration) -> String {
    use jiff::fmt::friendly::{Designator, Spacing, SpanPrinter};
    let duration = jiff::SignedDuration::try_from(duration).unwrap_or(jiff::SignedDuration::MAX);
    SpanPrinter::new()
        .designator(Designator::Compact)
        .spacing(Spacing::None)
        .duration_to_string(&duration)
}

/// Serde support for durations written like `10s`.
pub mod duration_format {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(duration: &Duration, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&super::format_duration(*duration))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(deserializer)?;
        super::parse_duration(&text).map_err(serde::de::Error::custom)
    }

    pub mod option {
        use std::time::Duration;

        use serde::{Deserialize, Deserializer};

        pub fn deserialize<'de, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Option<Duration>, D::Error> {
            let text = Option::<String>::deserialize(deserializer)?;
            text.map(|text| super::super::parse_duration(&text).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

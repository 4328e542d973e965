//! The `default/kubernetes` Service loop.
//!
//! Upstream (`pkg/controlplane/controller/kubernetesservice/controller.go`,
//! `UpdateKubernetesService`) creates the Service when it is missing and never touches it again, so
//! a changed `--secure-port`, node port or a hand edit stays broken until someone deletes the
//! Service (kubernetes/kubernetes#12289, #72338). This loop creates it the same way and, by
//! default, also repairs ports, type, selector, session affinity and its two labels. `clusterIP` is
//! immutable: a mismatch is only reported, unless the operator opted in to delete-and-recreate.
//!
//! The first half of the file is pure (desired object, drift); the second half is the loop.
//!
//! With two service ranges the Service stays `SingleStack` of the primary range's family, as
//! upstream keeps it: each apiserver advertises one address, so a second family's ClusterIP would
//! lead nowhere. A Service someone else made dual-stack is left so (only its primary IP is judged).
//!
//! Events on the Service: `KubernetesServiceCreated`, `KubernetesServiceRepaired`,
//! `ClusterIPMismatch` (Warning, once per distinct mismatch), `KubernetesServiceRecreated`
//! (Warning, opt-in only), `KubernetesServiceCreateRefused` and `KubernetesServiceRepairRefused`
//! (Warning, once per distinct refusal: the API answered 422 to the write). RBAC: `services` get/list/watch/create/update in the Service namespace
//! (plus delete for `recreateOnClusterIPMismatch`), `events.k8s.io` `events` create/patch.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::watch_cache::{WatchCache, watch_trigger};
use futures::future::BoxFuture;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Resource, ResourceExt};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::contract::{
    Action, LoopError, PassContext, PassReport, Reconciler, Trigger, drift, ignore_already_exists,
};

use crate::findings::ReportOnce;
use crate::metrics::{loop_registry, registered};
use crate::names::validate_dns1123_label;
use crate::section::{
    self, BuildContext, BuildError, LoopSection, Settings, duration_format, validate_interval,
};
use crate::service_range::{RangeError, ServiceRanges, validate_ranges};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "kubernetes-service";

/// What to do about drift of the repairable fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RepairPolicy {
    /// Rewrite ports, type, selector, session affinity and the two labels.
    #[default]
    Repair,
    /// Upstream's behaviour: create when missing, never update; drift is only reported.
    Off,
}

/// Configuration of the `kubernetes-service` loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesServiceConfig {
    pub namespace: String,
    pub name: String,
    /// The Service port (upstream hard-codes 443).
    pub port: i32,
    /// The apiservers' `--secure-port`: the Service's `targetPort`.
    pub target_port: i32,
    /// `--service-cluster-ip-range`: one CIDR, or two of different families (primary first).
    pub service_cidrs: Vec<IpNet>,
    /// `--kubernetes-service-node-port`: makes the Service a NodePort Service.
    pub node_port: Option<i32>,
    pub repair: RepairPolicy,
    /// Delete and recreate the Service when its clusterIP is not the desired one. Destructive:
    /// clients connected through the old IP break. Off unless explicitly enabled.
    pub recreate_on_cluster_ip_mismatch: bool,
    pub interval: Duration,
}

impl Default for KubernetesServiceConfig {
    fn default() -> Self {
        Self {
            namespace: "default".to_owned(),
            name: "kubernetes".to_owned(),
            port: 443,
            target_port: 6443,
            service_cidrs: Vec::new(),
            node_port: None,
            repair: RepairPolicy::Repair,
            recreate_on_cluster_ip_mismatch: false,
            interval: Duration::from_secs(10),
        }
    }
}

/// `loops.kubernetesService`: the `default/kubernetes` Service. Its clusterIP, targetPort and
/// node port come from `serviceClusterIPRange`, `securePort` and `kubernetesServiceNodePort`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
    /// Namespace of the Service (and of its Endpoints/EndpointSlices).
    pub namespace: String,
    /// Name of the Service (and of its Endpoints and primary EndpointSlice).
    pub name: String,
    /// The Service port (upstream hard-codes 443).
    pub port: u16,
    /// `repair`: fix ports, type, selector, sessionAffinity and labels; `off`: only create when
    /// missing and report drift (upstream's behaviour).
    pub repair: RepairPolicy,
    /// Delete and recreate the Service when its clusterIP is not the first IP of the primary
    /// range. Destructive (connections through the old IP break); off by default.
    #[serde(rename = "recreateOnClusterIPMismatch")]
    pub recreate_on_cluster_ip_mismatch: bool,
}

impl Default for Section {
    fn default() -> Self {
        let defaults = KubernetesServiceConfig::default();
        Section {
            enabled: true,
            interval: defaults.interval,
            namespace: defaults.namespace,
            name: defaults.name,
            port: 443,
            repair: defaults.repair,
            recreate_on_cluster_ip_mismatch: defaults.recreate_on_cluster_ip_mismatch,
        }
    }
}

impl Section {
    /// The loop's configuration: this section with the Service range, `securePort` and node port.
    pub fn loop_config(&self, settings: &Settings) -> KubernetesServiceConfig {
        KubernetesServiceConfig {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port: i32::from(self.port),
            target_port: i32::from(settings.secure_port),
            service_cidrs: settings.service_ranges.clone(),
            node_port: settings.kubernetes_service_node_port.map(i32::from),
            repair: self.repair,
            recreate_on_cluster_ip_mismatch: self.recreate_on_cluster_ip_mismatch,
            interval: self.interval,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<section::ConfigError>) {
        validate_interval(path, self.interval, errors);
        if let Err(why) = validate_dns1123_label(&self.namespace) {
            errors.push(section::ConfigError::new(
                format!("{path}.namespace"),
                format!("{why} (expected e.g. default)"),
            ));
        }
        if let Err(why) = validate_dns1123_label(&self.name) {
            errors.push(section::ConfigError::new(
                format!("{path}.name"),
                format!("{why} (expected e.g. kubernetes)"),
            ));
        }
        if self.port == 0 {
            errors.push(section::ConfigError::new(
                format!("{path}.port"),
                "must be a port between 1 and 65535 (upstream uses 443)",
            ));
        }
    }

    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let config = self.loop_config(context.settings);
        config.validate()?;
        Ok(vec![Arc::new(KubernetesServiceLoop::new(
            config,
            context.client.clone(),
            context.settings.reporter(),
            context.registry,
        ))])
    }
}

impl KubernetesServiceConfig {
    /// Fields are named as in the file's top level or the loop's section (`port`, `nodePort`).
    pub fn validate(&self) -> Result<(), section::ConfigError> {
        let err = |field: &str, message: String| Err(section::ConfigError::new(field, message));
        // None: read from the cluster's `kubernetes` ServiceCIDR.
        if let Err(problem) = validate_ranges(&self.service_cidrs) {
            return err("serviceClusterIPRange", problem.to_string());
        }
        if !(1..=65535).contains(&self.port) {
            return err("port", format!("{} is not a port (1-65535)", self.port));
        }
        if !(1..=65535).contains(&self.target_port) {
            return err(
                "securePort",
                format!("{} is not a port (1-65535)", self.target_port),
            );
        }
        if let Some(node_port) = self.node_port
            && !(1..=65535).contains(&node_port)
        {
            return err(
                "nodePort",
                format!(
                    "{node_port} is not a port (1-65535); leave it unset for a ClusterIP Service"
                ),
            );
        }
        if self.interval.is_zero() {
            return err("interval", "must be greater than zero".to_owned());
        }
        Ok(())
    }

    /// The desired cluster IP: the first usable address of the primary range (upstream's
    /// `ServiceIP`), or none while no range is known. The secondary range gets none: the
    /// Service is single-stack.
    pub fn cluster_ips(&self) -> Vec<IpAddr> {
        self.service_cidrs
            .first()
            .and_then(first_usable_ip)
            .into_iter()
            .collect()
    }

    pub fn object_ref(&self) -> String {
        format!("Service/{}/{}", self.namespace, self.name)
    }

    fn service_type(&self) -> &'static str {
        if self.node_port.is_some() {
            "NodePort"
        } else {
            "ClusterIP"
        }
    }

    fn ports(&self) -> Vec<ServicePort> {
        vec![ServicePort {
            name: Some("https".to_owned()),
            protocol: Some("TCP".to_owned()),
            port: self.port,
            target_port: Some(IntOrString::Int(self.target_port)),
            node_port: self.node_port,
            app_protocol: None,
        }]
    }
}

/// Upstream's `GetIndexedIP(range, 1)`: the network address plus one.
pub fn first_usable_ip(cidr: &IpNet) -> Option<IpAddr> {
    match cidr.network() {
        IpAddr::V4(net) => u32::from(net).checked_add(1).map(|n| IpAddr::V4(n.into())),
        IpAddr::V6(net) => u128::from(net).checked_add(1).map(|n| IpAddr::V6(n.into())),
    }
    .filter(|ip| cidr.contains(ip))
}

pub const PROVIDER_LABEL: (&str, &str) = ("provider", "kubernetes");
pub const COMPONENT_LABEL: (&str, &str) = ("component", "apiserver");

/// The Service to create when none exists.
pub fn desired_service(cfg: &KubernetesServiceConfig) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(cfg.name.clone()),
            namespace: Some(cfg.namespace.clone()),
            labels: Some(BTreeMap::from([
                (PROVIDER_LABEL.0.to_owned(), PROVIDER_LABEL.1.to_owned()),
                (COMPONENT_LABEL.0.to_owned(), COMPONENT_LABEL.1.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            ports: Some(cfg.ports()),
            selector: None,
            // As upstream: clusterIP and SingleStack, clusterIPs and ipFamilies left to the API.
            cluster_ip: cfg.cluster_ips().first().map(ToString::to_string),
            ip_family_policy: Some("SingleStack".to_owned()),
            session_affinity: Some("None".to_owned()),
            type_: Some(cfg.service_type().to_owned()),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// One way an existing Service differs from the desired one.
#[derive(Clone, Debug, PartialEq)]
pub enum ServiceDrift {
    Ports {
        found: Vec<ServicePort>,
    },
    Type {
        found: Option<String>,
    },
    Selector {
        found: BTreeMap<String, String>,
    },
    SessionAffinity {
        found: String,
    },
    Label {
        key: &'static str,
        found: Option<String>,
    },
    /// Immutable: reported, never repaired in place.
    ClusterIp {
        found: Vec<String>,
        want: Vec<String>,
    },
}

impl ServiceDrift {
    pub fn kind(&self) -> &'static str {
        match self {
            ServiceDrift::Ports { .. } => "service_ports",
            ServiceDrift::Type { .. } => "service_type",
            ServiceDrift::Selector { .. } => "service_selector",
            ServiceDrift::SessionAffinity { .. } => "service_session_affinity",
            ServiceDrift::Label { .. } => "service_labels",
            ServiceDrift::ClusterIp { .. } => "service_cluster_ip",
        }
    }

    pub fn repairable(&self) -> bool {
        !matches!(self, ServiceDrift::ClusterIp { .. })
    }
}

impl fmt::Display for ServiceDrift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceDrift::Ports { found } => write!(
                f,
                "ports are [{}]",
                found
                    .iter()
                    .map(describe_port)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            ServiceDrift::Type { found } => {
                write!(f, "type is {}", found.as_deref().unwrap_or("unset"))
            }
            ServiceDrift::Selector { found } => write!(f, "has selector {found:?}, want none"),
            ServiceDrift::SessionAffinity { found } => {
                write!(f, "sessionAffinity is {found}, want None")
            }
            ServiceDrift::Label { key, found } => write!(
                f,
                "label {key} is {}",
                found
                    .as_deref()
                    .map_or("missing".to_owned(), |v| format!("{v:?}"))
            ),
            ServiceDrift::ClusterIp { found, want } => write!(
                f,
                "clusterIPs are [{}], want [{}] (immutable)",
                found.join(", "),
                want.join(", ")
            ),
        }
    }
}

fn describe_port(port: &ServicePort) -> String {
    let target = match &port.target_port {
        Some(IntOrString::Int(n)) => n.to_string(),
        Some(IntOrString::String(s)) => s.clone(),
        None => "-".to_owned(),
    };
    let node = port
        .node_port
        .map(|n| format!(" nodePort {n}"))
        .unwrap_or_default();
    format!(
        "{} {}/{}->{}{}",
        port.name.as_deref().unwrap_or(""),
        port.protocol.as_deref().unwrap_or(""),
        port.port,
        target,
        node
    )
}

/// Every difference between `existing` and the desired Service.
pub fn service_drift(cfg: &KubernetesServiceConfig, existing: &Service) -> Vec<ServiceDrift> {
    let mut drift = Vec::new();
    let spec = existing.spec.clone().unwrap_or_default();

    let found_ports = spec.ports.clone().unwrap_or_default();
    if found_ports != cfg.ports() {
        drift.push(ServiceDrift::Ports { found: found_ports });
    }
    // The API defaults an unset type to ClusterIP.
    let found_type = spec.type_.clone().unwrap_or_else(|| "ClusterIP".to_owned());
    if found_type != cfg.service_type() {
        drift.push(ServiceDrift::Type {
            found: spec.type_.clone(),
        });
    }
    if let Some(selector) = spec.selector.as_ref().filter(|s| !s.is_empty()) {
        drift.push(ServiceDrift::Selector {
            found: selector.clone(),
        });
    }
    if let Some(affinity) = spec
        .session_affinity
        .as_ref()
        .filter(|a| a.as_str() != "None")
    {
        drift.push(ServiceDrift::SessionAffinity {
            found: affinity.clone(),
        });
    }
    for (key, value) in [PROVIDER_LABEL, COMPONENT_LABEL] {
        let found = existing.labels().get(key);
        if found.map(String::as_str) != Some(value) {
            drift.push(ServiceDrift::Label {
                key,
                found: found.cloned(),
            });
        }
    }

    let want: Vec<String> = cfg.cluster_ips().iter().map(ToString::to_string).collect();
    let found_ips: Vec<String> = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ips.clone(),
        (_, Some(ip)) => vec![ip.clone()],
        _ => Vec::new(),
    };
    // Only the primary IP is judged: a Service made dual-stack by someone else has a secondary
    // IP that is not ours to judge.
    let primary_ok = found_ips.first().and_then(|s| s.parse::<IpAddr>().ok())
        == cfg.cluster_ips().first().copied();
    // No range known (not configured, not told by the cluster): nothing to judge the IP by.
    if !want.is_empty() && !primary_ok {
        drift.push(ServiceDrift::ClusterIp {
            found: found_ips,
            want,
        });
    }
    drift
}

/// `existing` with every repairable field set to the desired value; everything else (clusterIPs,
/// ipFamilies, foreign labels and annotations, resourceVersion) kept.
pub fn repaired_service(cfg: &KubernetesServiceConfig, existing: &Service) -> Service {
    let mut repaired = existing.clone();
    repaired.metadata.managed_fields = None;
    let labels = repaired.metadata.labels.get_or_insert_with(BTreeMap::new);
    for (key, value) in [PROVIDER_LABEL, COMPONENT_LABEL] {
        labels.insert(key.to_owned(), value.to_owned());
    }
    let spec = repaired.spec.get_or_insert_with(ServiceSpec::default);
    spec.ports = Some(cfg.ports());
    spec.selector = None;
    spec.session_affinity = Some("None".to_owned());
    spec.session_affinity_config = None;
    let want_type = cfg.service_type();
    if spec.type_.as_deref().unwrap_or("ClusterIP") != want_type {
        spec.type_ = Some(want_type.to_owned());
        // Fields the API only allows on NodePort/LoadBalancer/ExternalName Services.
        if want_type == "ClusterIP" {
            spec.external_traffic_policy = None;
            spec.health_check_node_port = None;
            spec.allocate_load_balancer_node_ports = None;
            spec.load_balancer_class = None;
            spec.load_balancer_ip = None;
            spec.load_balancer_source_ranges = None;
        }
        if want_type == "NodePort" {
            spec.allocate_load_balancer_node_ports = None;
            spec.load_balancer_class = None;
            spec.load_balancer_ip = None;
            spec.load_balancer_source_ranges = None;
            spec.health_check_node_port = None;
        }
        spec.external_name = None;
    }
    repaired
}

// ------------------------------------------------------------------------------------------------
// The loop.

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// Metric handles of the `kubernetes-service` loop.
#[derive(Clone, Default)]
pub struct KubernetesServiceMetrics {
    repairs: Family<KindLabel, Counter>,
    refusals: Family<KindLabel, Counter>,
    cluster_ip_mismatch: Gauge,
}

impl KubernetesServiceMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let registry = loop_registry(registry, NAME);
        Self {
            repairs: registered(
                registry,
                "repairs",
                "Repairs made to the kubernetes Service, by kind of drift",
                Family::default(),
            ),
            refusals: registered(
                registry,
                "refusals",
                "Creations and repairs of the kubernetes Service the API refused (422), by kind of drift; each refusal counted once when it appears",
                Family::default(),
            ),
            cluster_ip_mismatch: registered(
                registry,
                "cluster_ip_mismatch",
                "1 while the kubernetes Service's clusterIP is not the first IP of the service range",
                Gauge::default(),
            ),
        }
    }

    pub fn repairs(&self, kind: &str) -> u64 {
        self.repairs
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .get()
    }

    pub fn refusals(&self, kind: &str) -> u64 {
        self.refusals
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .get()
    }

    pub fn cluster_ip_mismatch(&self) -> i64 {
        self.cluster_ip_mismatch.get()
    }
}

/// A write of the Service the API refused: the drift it was to repair and the API's message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Refusal {
    kinds: Vec<&'static str>,
    message: String,
}

/// Creates and repairs the `kubernetes` Service. Leader-only.
pub struct KubernetesServiceLoop {
    cfg: KubernetesServiceConfig,
    client: kube::Client,
    /// Events get a fresh recorder each: kube's Recorder folds events with the same reason into
    /// one series and keeps the first note, which would hide who joined or what was repaired.
    reporter: Reporter,
    metrics: KubernetesServiceMetrics,
    /// The last clusterIP mismatch warned about, so the warning event is not repeated every pass.
    last_mismatch: Mutex<Option<ServiceDrift>>,
    /// Writes the API refused, reported once each while the refusal lasts.
    refusals: ReportOnce<Refusal>,
    /// The Service, kept by the watch that is also this loop's trigger.
    cache: WatchCache<Service>,
    /// `serviceClusterIPRange`, or the `kubernetes` ServiceCIDR's ranges when it is not set.
    ranges: ServiceRanges,
}

impl KubernetesServiceLoop {
    /// `cfg` must have passed [`KubernetesServiceConfig::validate`].
    pub fn new(
        cfg: KubernetesServiceConfig,
        client: kube::Client,
        reporter: Reporter,
        registry: &mut Registry,
    ) -> Self {
        let cache = WatchCache::new(
            Api::namespaced(client.clone(), &cfg.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", cfg.name)),
        );
        let ranges = ServiceRanges::new(
            client.clone(),
            cfg.service_cidrs.clone(),
            section::ServiceName {
                namespace: cfg.namespace.clone(),
                name: cfg.name.clone(),
            },
        );
        Self {
            ranges,
            reporter,
            client,
            cfg,
            metrics: KubernetesServiceMetrics::register(registry),
            last_mismatch: Mutex::new(None),
            refusals: ReportOnce::new(),
            cache,
        }
    }

    pub fn metrics(&self) -> &KubernetesServiceMetrics {
        &self.metrics
    }

    async fn publish(&self, service: &Service, type_: EventType, reason: &str, note: String) {
        let reference = service.object_ref(&());
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = Recorder::new(self.client.clone(), self.reporter.clone())
            .publish(&event, &reference)
            .await
        {
            tracing::warn!(error = %err, reason, "could not publish event on the kubernetes Service");
        }
    }

    /// One pass, then the write the API refused in it (if any) reported once: a refusal stays
    /// until what the API objects to changes, so a warning on every pass would only repeat it.
    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let mut refused = None;
        let report = self.pass_writing(ctx, &mut refused).await?;
        for refusal in self.refusals.update(refused) {
            let create = refusal.kinds == ["service_missing"];
            let object = self.cfg.object_ref();
            tracing::warn!(
                service = %object,
                drift = %refusal.kinds.join(", "),
                error = %refusal.message,
                "the API refused to {} the kubernetes Service; reported once, retried every pass",
                if create { "create" } else { "repair" }
            );
            for kind in &refusal.kinds {
                self.metrics
                    .refusals
                    .get_or_create(&KindLabel {
                        kind: (*kind).to_owned(),
                    })
                    .inc();
            }
            let (reason, note) = if create {
                (
                    "KubernetesServiceCreateRefused",
                    format!("the API refused to create {object}: {}", refusal.message),
                )
            } else {
                (
                    "KubernetesServiceRepairRefused",
                    format!(
                        "the API refused to repair {}: {}",
                        refusal.kinds.join(", "),
                        refusal.message
                    ),
                )
            };
            self.publish(
                &desired_service(&self.cfg),
                EventType::Warning,
                reason,
                note,
            )
            .await;
        }
        Ok(report)
    }

    async fn pass_writing(
        &self,
        ctx: &PassContext,
        refused: &mut Option<Refusal>,
    ) -> Result<PassReport, LoopError> {
        // Without serviceClusterIPRange the range is the `kubernetes` ServiceCIDR's. Where the
        // cluster does not tell it (before 1.33), the ClusterIP is neither chosen nor checked.
        let mut unknown_range: Option<String> = None;
        let discovered;
        let cfg = match self.ranges.resolve().await {
            Ok(ranges) if self.ranges.configured().is_none() => {
                discovered = KubernetesServiceConfig {
                    service_cidrs: ranges,
                    ..self.cfg.clone()
                };
                &discovered
            }
            Ok(_) => &self.cfg,
            Err(RangeError::Api(err)) => return Err(err.into()),
            Err(err) => {
                unknown_range = Some(err.to_string());
                &self.cfg
            }
        };
        let api: Api<Service> = Api::namespaced(ctx.client.clone(), &cfg.namespace);
        let mut report = PassReport::default();
        let object = cfg.object_ref();

        let Some(existing) = self.cache.get(&api, &cfg.name).await? else {
            if let Some(why) = unknown_range {
                report.push(drift(
                    "service_missing",
                    object,
                    Action::Create,
                    format!("the Service does not exist; not created: {why}"),
                    false,
                ));
                return Ok(report);
            }
            let want = desired_service(cfg);
            let mut applied = false;
            if !ctx.dry_run {
                let created = match api.create(&PostParams::default(), &want).await {
                    // Its cluster IP taken or outside the range the apiserver serves: nothing
                    // this loop can change, so reported rather than failed.
                    Err(kube::Error::Api(status)) if status.code == 422 => {
                        *refused = Some(Refusal {
                            kinds: vec!["service_missing"],
                            message: status.message.clone(),
                        });
                        None
                    }
                    other => ignore_already_exists(other)?,
                };
                applied = created.is_some();
                if let Some(created) = &created {
                    tracing::info!(service = %object, "created the kubernetes Service");
                    self.metrics
                        .repairs
                        .get_or_create(&KindLabel {
                            kind: "service_missing".into(),
                        })
                        .inc();
                    self.publish(
                        created,
                        EventType::Normal,
                        "KubernetesServiceCreated",
                        format!("created {object}"),
                    )
                    .await;
                }
            }
            report.push(drift(
                "service_missing",
                object,
                Action::Create,
                match (&refused, applied) {
                    (Some(refusal), _) => format!(
                        "the Service does not exist; the API refused to create it: {}",
                        refusal.message
                    ),
                    (None, true) => "the Service does not exist; created it".to_owned(),
                    (None, false) => "the Service does not exist; would create it".to_owned(),
                },
                applied,
            ));
            return Ok(report);
        };

        let found = service_drift(cfg, &existing);
        let (repairable, immutable): (Vec<_>, Vec<_>) =
            found.into_iter().partition(ServiceDrift::repairable);

        if !repairable.is_empty() {
            let repair = cfg.repair == RepairPolicy::Repair;
            let mut applied = false;
            if repair && !ctx.dry_run {
                let replaced = api
                    .replace(
                        &cfg.name,
                        &PostParams::default(),
                        &repaired_service(cfg, &existing),
                    )
                    .await;
                match replaced {
                    Ok(_) => applied = true,
                    // Refused as invalid (a node port another Service holds, say): retrying the
                    // same write cannot help, so it is reported, not failed, and not a repair.
                    Err(kube::Error::Api(status)) if status.code == 422 => {
                        *refused = Some(Refusal {
                            kinds: repairable.iter().map(ServiceDrift::kind).collect(),
                            message: status.message.clone(),
                        });
                    }
                    Err(err) => return Err(err.into()),
                }
            }
            if applied {
                for d in &repairable {
                    self.metrics
                        .repairs
                        .get_or_create(&KindLabel {
                            kind: d.kind().to_owned(),
                        })
                        .inc();
                }
                let note = repairable
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ");
                tracing::warn!(service = %object, drift = %note, "repaired the kubernetes Service");
                self.publish(
                    &existing,
                    EventType::Normal,
                    "KubernetesServiceRepaired",
                    format!("repaired: {note}"),
                )
                .await;
            }
            for d in repairable {
                let message = match (repair, applied) {
                    (true, _) if refused.is_some() => format!(
                        "{d}; the API refused the repair: {}",
                        refused.as_ref().map_or("", |r| r.message.as_str())
                    ),
                    (true, true) => format!("{d}; repaired"),
                    (true, false) => format!("{d}; would repair"),
                    (false, _) => format!("{d}; not repaired (repair policy is off)"),
                };
                report.push(drift(
                    d.kind(),
                    object.clone(),
                    if repair {
                        Action::Update
                    } else {
                        Action::Report
                    },
                    message,
                    applied,
                ));
            }
        }

        let mismatch = immutable.into_iter().next();
        self.metrics
            .cluster_ip_mismatch
            .set(i64::from(mismatch.is_some()));
        let Some(mismatch) = mismatch else {
            if let Ok(mut last) = self.last_mismatch.lock() {
                *last = None;
            }
            return Ok(report);
        };

        if cfg.recreate_on_cluster_ip_mismatch {
            let mut applied = false;
            if !ctx.dry_run {
                api.delete(
                    &cfg.name,
                    &DeleteParams::default().preconditions(kube::api::Preconditions {
                        uid: existing.metadata.uid.clone(),
                        resource_version: existing.metadata.resource_version.clone(),
                    }),
                )
                .await?;
                let want = desired_service(cfg);
                // If the delete has not finished yet the create conflicts; the next pass creates.
                match ignore_already_exists(api.create(&PostParams::default(), &want).await) {
                    Ok(_) => applied = true,
                    Err(err) => {
                        tracing::warn!(error = %err, "recreating the kubernetes Service failed; retrying next pass")
                    }
                }
                self.metrics
                    .repairs
                    .get_or_create(&KindLabel {
                        kind: "service_cluster_ip".into(),
                    })
                    .inc();
                self.publish(&existing, EventType::Warning, "KubernetesServiceRecreated",
                    format!("{mismatch}; deleted and recreated the Service (recreateOnClusterIPMismatch)")).await;
            }
            report.push(drift(
                mismatch.kind(),
                object,
                Action::Delete,
                format!(
                    "{mismatch}; {} (recreateOnClusterIPMismatch)",
                    if applied {
                        "deleted and recreated the Service"
                    } else {
                        "would delete and recreate the Service"
                    }
                ),
                applied,
            ));
            return Ok(report);
        }

        let first_time = self
            .last_mismatch
            .lock()
            .map(|mut last| {
                let new = last.as_ref() != Some(&mismatch);
                *last = Some(mismatch.clone());
                new
            })
            .unwrap_or(true);
        if first_time {
            tracing::warn!(service = %object, drift = %mismatch, "the kubernetes Service has the wrong clusterIP");
            if !ctx.dry_run {
                self.publish(&existing, EventType::Warning, "ClusterIPMismatch",
                    format!("{mismatch}: delete the Service to have it recreated, or set recreateOnClusterIPMismatch")).await;
            }
        }
        report.push(drift(
            mismatch.kind(),
            object,
            Action::Report,
            format!("{mismatch}; reported only (delete the Service, or enable recreateOnClusterIPMismatch)"),
            false,
        ));
        Ok(report)
    }
}

impl Reconciler for KubernetesServiceLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.cfg.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        self.cache
            .take_events()
            .map(watch_trigger)
            .into_iter()
            .collect()
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn cfg() -> KubernetesServiceConfig {
        KubernetesServiceConfig {
            service_cidrs: vec!["10.96.0.0/12".parse().unwrap()],
            ..KubernetesServiceConfig::default()
        }
    }

    #[test]
    fn first_usable_ip_is_network_plus_one() {
        assert_eq!(
            first_usable_ip(&"10.96.0.0/12".parse().unwrap()),
            Some("10.96.0.1".parse().unwrap())
        );
        assert_eq!(
            first_usable_ip(&"10.96.3.7/12".parse().unwrap()),
            Some("10.96.0.1".parse().unwrap())
        );
        assert_eq!(
            first_usable_ip(&"fd00:10::/108".parse().unwrap()),
            Some("fd00:10::1".parse().unwrap())
        );
        assert_eq!(first_usable_ip(&"10.0.0.1/32".parse().unwrap()), None);
    }

    #[test]
    fn desired_service_matches_upstream_shape() {
        let json = serde_json::to_value(desired_service(&cfg())).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"component": "apiserver", "provider": "kubernetes"}
                },
                "spec": {
                    "clusterIP": "10.96.0.1",
                    "ipFamilyPolicy": "SingleStack",
                    "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}],
                    "sessionAffinity": "None",
                    "type": "ClusterIP"
                }
            })
        );
    }

    #[test]
    fn two_ranges_and_node_port_give_a_single_stack_node_port_service() {
        let c = KubernetesServiceConfig {
            service_cidrs: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            node_port: Some(30443),
            port: 8443,
            target_port: 6444,
            ..KubernetesServiceConfig::default()
        };
        c.validate().unwrap();
        let spec = desired_service(&c).spec.unwrap();
        assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
        assert_eq!(spec.cluster_ip.as_deref(), Some("10.96.0.1"));
        assert_eq!(
            spec.cluster_ips, None,
            "left to the API's defaulting, as upstream"
        );
        assert_eq!(spec.type_.as_deref(), Some("NodePort"));
        let port = &spec.ports.unwrap()[0];
        assert_eq!((port.port, port.node_port), (8443, Some(30443)));
        assert_eq!(port.target_port, Some(IntOrString::Int(6444)));
    }

    #[test]
    fn validation_names_fields() {
        let mut c = cfg();
        c.service_cidrs.push("10.0.0.0/24".parse().unwrap());
        assert_eq!(c.validate().unwrap_err().field, "serviceClusterIPRange");
        let c = KubernetesServiceConfig {
            service_cidrs: vec!["10.0.0.0/30".parse().unwrap()],
            ..cfg()
        };
        assert!(c.validate().unwrap_err().message.contains("fewer than 8"));
        let c = KubernetesServiceConfig {
            node_port: Some(0),
            ..cfg()
        };
        assert_eq!(c.validate().unwrap_err().field, "nodePort");
        let c = KubernetesServiceConfig {
            target_port: 70000,
            ..cfg()
        };
        assert_eq!(c.validate().unwrap_err().field, "securePort");
        assert!(
            KubernetesServiceConfig::default().validate().is_ok(),
            "no range: read from the cluster's ServiceCIDR"
        );
    }

    fn existing() -> Service {
        let mut s = desired_service(&cfg());
        // What the API adds on create.
        s.metadata.resource_version = Some("5".into());
        s.metadata.uid = Some("u".into());
        let spec = s.spec.as_mut().unwrap();
        spec.cluster_ips = Some(vec!["10.96.0.1".into()]);
        spec.ip_families = Some(vec!["IPv4".into()]);
        spec.internal_traffic_policy = Some("Cluster".into());
        s
    }

    #[test]
    fn freshly_created_service_has_no_drift() {
        assert!(service_drift(&cfg(), &existing()).is_empty());
        let mut unset = existing();
        unset.spec.as_mut().unwrap().type_ = None;
        unset.spec.as_mut().unwrap().session_affinity = None;
        unset.spec.as_mut().unwrap().selector = Some(BTreeMap::new());
        assert!(
            service_drift(&cfg(), &unset).is_empty(),
            "API defaults are not drift"
        );
    }

    #[test]
    fn every_repairable_drift_is_found_and_repaired() {
        let mut s = existing();
        s.metadata.labels = Some(BTreeMap::from([
            ("provider".into(), "someone".into()),
            ("team".into(), "x".into()),
        ]));
        let spec = s.spec.as_mut().unwrap();
        spec.ports.as_mut().unwrap()[0].target_port = Some(IntOrString::Int(1));
        spec.type_ = Some("NodePort".into());
        spec.external_traffic_policy = Some("Cluster".into());
        spec.selector = Some(BTreeMap::from([("app".into(), "x".into())]));
        spec.session_affinity = Some("ClientIP".into());
        let kinds: Vec<_> = service_drift(&cfg(), &s)
            .iter()
            .map(ServiceDrift::kind)
            .collect();
        assert_eq!(
            kinds,
            vec![
                "service_ports",
                "service_type",
                "service_selector",
                "service_session_affinity",
                "service_labels",
                "service_labels"
            ]
        );
        let repaired = repaired_service(&cfg(), &s);
        assert!(service_drift(&cfg(), &repaired).is_empty());
        assert_eq!(repaired.metadata.resource_version.as_deref(), Some("5"));
        assert_eq!(repaired.labels().get("team").map(String::as_str), Some("x"));
        let spec = repaired.spec.unwrap();
        assert_eq!(
            spec.external_traffic_policy, None,
            "ClusterIP Services may not carry it"
        );
        assert_eq!(
            spec.cluster_ips,
            Some(vec!["10.96.0.1".to_owned()]),
            "clusterIPs untouched"
        );
    }

    #[test]
    fn switching_to_node_port_sets_the_node_port() {
        let c = KubernetesServiceConfig {
            node_port: Some(30443),
            ..cfg()
        };
        let drift = service_drift(&c, &existing());
        assert_eq!(
            drift.iter().map(ServiceDrift::kind).collect::<Vec<_>>(),
            vec!["service_ports", "service_type"]
        );
        let repaired = repaired_service(&c, &existing());
        assert!(service_drift(&c, &repaired).is_empty());
    }

    #[test]
    fn cluster_ip_mismatch_is_reported_not_repaired() {
        let mut s = existing();
        s.spec.as_mut().unwrap().cluster_ip = Some("10.96.0.10".into());
        s.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.0.10".into()]);
        let drift = service_drift(&cfg(), &s);
        assert_eq!(drift.len(), 1);
        assert!(!drift[0].repairable());
        assert_eq!(
            drift[0].to_string(),
            "clusterIPs are [10.96.0.10], want [10.96.0.1] (immutable)"
        );
        let repaired = repaired_service(&cfg(), &s);
        assert_eq!(
            repaired.spec.unwrap().cluster_ip.as_deref(),
            Some("10.96.0.10")
        );
    }

    #[test]
    fn a_secondary_cluster_ip_is_not_ours_to_judge() {
        let dual = KubernetesServiceConfig {
            service_cidrs: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            ..cfg()
        };
        // Made dual-stack by someone else, with any secondary IP: only the primary is checked.
        let mut dual_by_hand = existing();
        dual_by_hand.spec.as_mut().unwrap().cluster_ips =
            Some(vec!["10.96.0.1".into(), "fd00::77".into()]);
        assert!(service_drift(&dual, &dual_by_hand).is_empty());
    }

    #[test]
    fn a_single_stack_service_is_never_upgraded_to_dual_stack() {
        let dual = KubernetesServiceConfig {
            service_cidrs: vec![
                "10.96.0.0/12".parse().unwrap(),
                "fd00::/108".parse().unwrap(),
            ],
            ..cfg()
        };
        let single = existing();
        assert!(service_drift(&dual, &single).is_empty());
        let spec = repaired_service(&dual, &single).spec.unwrap();
        assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
        assert_eq!(spec.cluster_ips, Some(vec!["10.96.0.1".to_owned()]));
    }
}

//! The `default/kubernetes` Service loop.
//!
//! Upstream (`pkg/controlplane/controller/kubernetesservice/controller.go`,
//! `UpdateKubernetesService`) creates the Service when it is missing and never touches it again, so
//! a changed `--secure-port`, node port or a hand edit stays broken until someone deletes the
//! Service (kubernetes/kubernetes#12289, #72338). This loop creates it the same way and, by
//! default, also repairs ports, type, selector, session affinity and its two labels. `clusterIP` is
//! immutable: a mismatch is only reported, unless the operator opted in to delete-and-recreate.
//!
//! The files: `section.rs` (the file's section, which is the loop's configuration), `plan.rs`
//! (what a pass does, pure, with the table of its cases), `apply.rs` (the writes, events and
//! metrics of a plan), `metrics.rs`; here the loop itself.
//!
//! With two service ranges the Service stays `SingleStack` of the primary range's family, as
//! upstream keeps it: each apiserver advertises one address, so a second family's ClusterIP would
//! lead nowhere. A Service someone else made dual-stack is left so (only its primary IP is judged).
//!
//! Events on the Service: `KubernetesServiceCreated`, `KubernetesServiceRepaired`,
//! `ClusterIPMismatch` (Warning, once per Service and mismatch), `KubernetesServiceRecreated`
//! (Warning, opt-in only), `KubernetesServiceCreateRefused` and `KubernetesServiceRepairRefused`
//! (Warning, once per distinct refusal: the API answered 422 to the write). RBAC: `services`
//! get/list/watch/create/update in the Service namespace (plus delete for
//! `recreateOnClusterIPMismatch`, which also lists `services` and `networking.k8s.io`
//! `ipaddresses` in every namespace to find another holder of the IP), `events.k8s.io`
//! `events` create/patch.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Service;
use kube::Resource;
use kube::api::Api;
use kube::runtime::events::{EventType, Reporter};

use crate::budget::CacheBudget;
use crate::contract::{LoopError, PassContext, PassReport, Reconciler, Trigger};
use crate::discovery::NetworkingDiscovery;
use crate::findings::ReportOnce;
use crate::metrics::MetricRegistry;
use crate::section::{ServiceName, Settings};
use crate::service_cache::record::{Name, ServiceRecord};
use crate::service_range::{RangeError, RangeLookup};
use crate::watch_cache::{WatchCache, Whole};

mod apply;
mod metrics;
mod plan;
mod section;

pub use metrics::KubernetesServiceMetrics;
pub use plan::{
    COMPONENT_LABEL, PROVIDER_LABEL, Plan, ServiceDrift, desired_service, plan, repaired_service,
    service_drift,
};
pub use section::{DEFAULT_INTERVAL, RepairPolicy, Section, cluster_ips};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "kubernetes-service";

/// A write of the Service the API refused: the drift it was to repair and the API's message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Refusal {
    kinds: Vec<&'static str>,
    message: String,
}

/// Creates and repairs the `kubernetes` Service. Leader-only.
pub struct KubernetesServiceLoop {
    section: Section,
    /// The top-level settings: `securePort`, `kubernetesServiceNodePort`, the configured range.
    settings: Settings,
    client: kube::Client,
    /// Who its events say they come from ([`crate::events::emit`] says why each gets a Recorder
    /// of its own).
    reporter: Reporter,
    metrics: KubernetesServiceMetrics,
    /// The clusterIP mismatch warned about (the Service's uid and the mismatch), so the warning
    /// event is not repeated every pass.
    mismatches: ReportOnce<String>,
    /// Writes the API refused, reported once each while the refusal lasts.
    refusals: ReportOnce<Refusal>,
    /// Every Service as a record, kept by the watch of Services the cluster's loops share (its
    /// changes trigger this loop), and the `kubernetes` Service whole, read again when its
    /// record's resourceVersion changes.
    services: WatchCache<ServiceRecord>,
    service: Whole<Service>,
    /// Another holder of the clusterIP a recreate wants, when it was found.
    holder: Mutex<Option<(tokio::time::Instant, String)>>,
    /// `serviceClusterIPRange`, or the `kubernetes` ServiceCIDR's ranges when it is not set.
    ranges: RangeLookup,
}

impl KubernetesServiceLoop {
    /// The loop of a validated `section`, with validated `settings` (events report as
    /// [`Settings::reporter`]), its caches its own and unlimited; its section builds it with
    /// the cluster's shared ones ([`Self::with_shared`]).
    pub fn new(
        section: Section,
        settings: &Settings,
        client: kube::Client,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        let services = WatchCache::shared(client.clone(), &CacheBudget::default());
        let discovery = NetworkingDiscovery::new(client.clone());
        Self::with_shared(section, settings, client, (services, discovery), registry)
    }

    /// [`Self::new`] with the Service cache the cluster's loops share (whichever subscribes
    /// first feeds it) and their discovery.
    pub fn with_shared(
        section: Section,
        settings: &Settings,
        client: kube::Client,
        (services, discovery): (WatchCache<ServiceRecord>, Arc<NetworkingDiscovery>),
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        services.read_one(
            Api::namespaced(client.clone(), &section.namespace),
            &section.name,
        );
        let ranges = RangeLookup::new(
            client.clone(),
            settings.service_ranges.clone(),
            ServiceName {
                namespace: section.namespace.clone(),
                name: section.name.clone(),
            },
            discovery,
            section.interval,
        );
        Self {
            ranges,
            reporter: settings.reporter(),
            client,
            section,
            settings: settings.clone(),
            metrics: KubernetesServiceMetrics::register(registry),
            mismatches: ReportOnce::new(),
            refusals: ReportOnce::new(),
            services,
            service: Whole::default(),
            holder: Mutex::new(None),
        }
    }

    pub fn metrics(&self) -> &KubernetesServiceMetrics {
        &self.metrics
    }

    async fn publish(&self, service: &Service, type_: EventType, reason: &str, note: String) {
        // Logged there; the repair stands without its event.
        let _ = crate::events::emit(
            &self.client,
            &self.reporter,
            &service.object_ref(&()),
            type_,
            reason,
            "Reconcile",
            &note,
        )
        .await;
    }

    /// One pass, then the write the API refused in it (if any) reported once: a refusal stays
    /// until what the API objects to changes, so a warning on every pass would only repeat it.
    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let (report, refused) = self.pass_writing(ctx).await?;
        for refusal in self.refusals.update(refused) {
            let create = refusal.kinds == ["service_missing"];
            let object = self.section.object_ref();
            tracing::warn!(
                service = %object,
                drift = %refusal.kinds.join(", "),
                error = %refusal.message,
                "the API refused to {} the kubernetes Service; reported once, retried every pass",
                if create { "create" } else { "repair" }
            );
            KubernetesServiceMetrics::count(&self.metrics.refusals, &refusal.kinds);
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
                &desired_service(&self.section, &self.settings, None),
                EventType::Warning,
                reason,
                note,
            )
            .await;
        }
        Ok(report)
    }

    /// The Service range in effect, the Service as the watch has it, its plan, and the plan
    /// applied.
    async fn pass_writing(
        &self,
        ctx: &PassContext,
    ) -> Result<(PassReport, Vec<Refusal>), LoopError> {
        // Without serviceClusterIPRange the range is the `kubernetes` ServiceCIDR's. Where the
        // cluster does not tell it (before 1.33), the ClusterIP is neither chosen nor checked.
        let mut unknown_range: Option<String> = None;
        let discovered;
        let settings = match self.ranges.resolve().await {
            Ok(ranges) if self.ranges.configured().is_none() => {
                discovered = Settings {
                    service_ranges: ranges,
                    ..self.settings.clone()
                };
                &discovered
            }
            Ok(_) => &self.settings,
            Err(RangeError::Api(err)) => return Err(err.into()),
            Err(err) => {
                unknown_range = Some(err.to_string());
                &self.settings
            }
        };
        let section = &self.section;
        let api: Api<Service> = Api::namespaced(ctx.client.clone(), &section.namespace);
        let key = (
            Name::from(section.namespace.as_str()),
            Name::from(section.name.as_str()),
        );
        let existing = (self.service)
            .get(&self.services, &key, &api, &section.name)
            .await?;
        self.apply(
            ctx,
            settings,
            plan(section, settings, existing, unknown_range),
        )
        .await
    }
}

impl Reconciler for KubernetesServiceLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.section.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        vec![self.services.subscribe()]
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

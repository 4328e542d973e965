//! The tenant manager's own metrics (each tenant's are in its own registry).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// Every state of [`Entry`], for the `bootstrap_tenants` gauge.
pub(super) const STATES: [&str; 5] = ["running", "starting", "invalid", "waiting", "elsewhere"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StateLabels {
    pub(super) state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ReasonLabels {
    pub(super) reason: &'static str,
}

/// The manager's own metrics (the tenants' are in their registries).
#[derive(Clone, Default)]
pub struct TenantMetrics {
    pub(super) tenants: Family<StateLabels, Gauge>,
    pub(super) config_errors: Counter,
    pub(super) starts: Counter,
    pub(super) stops: Family<ReasonLabels, Counter>,
    pub(super) replicas: Gauge,
    pub(super) fenced: Gauge,
}

impl TenantMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = TenantMetrics::default();
        registry.register(
            "tenants",
            "Tenant clusters known to this replica, by state (running here, starting: its Secret \
             is being read, invalid: its Secret cannot start it, waiting for a hand-over, \
             elsewhere: run by another replica)",
            metrics.tenants.clone(),
        );
        registry.register(
            "tenant_config_errors",
            "Tenant Secrets found unusable (bad kubeconfig or configuration fragment), counted \
             once per version of the Secret",
            metrics.config_errors.clone(),
        );
        registry.register(
            "tenant_starts",
            "Tenant runtimes started on this replica",
            metrics.starts.clone(),
        );
        registry.register(
            "tenant_stops",
            "Tenant runtimes stopped on this replica, by reason (deleted, changed, moved: \
             another replica owns it now, refused: its etcd keys overlap an older tenant's, \
             shutdown)",
            metrics.stops.clone(),
        );
        registry.register(
            "tenant_replicas",
            "Live replicas sharing the tenants, as this replica sees them (1 without sharing)",
            metrics.replicas.clone(),
        );
        registry.register(
            "tenant_fenced",
            "1 while this replica cannot prove its replica Lease is current: it runs no tenant",
            metrics.fenced.clone(),
        );
        for state in STATES {
            metrics.tenants.get_or_create(&StateLabels { state }).set(0);
        }
        metrics
    }
}

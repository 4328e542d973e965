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
    pub(super) secret_bytes: Gauge,
    pub(super) secret_limit_bytes: Gauge,
    pub(super) secrets_shed: Counter,
}

impl TenantMetrics {
    /// Registers the metrics; `secret_limit` is `--tenants-secrets-total-mib` in bytes.
    pub fn register(registry: &mut Registry, secret_limit: usize) -> Self {
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
            "Tenant Secrets found unusable (bad kubeconfig or configuration fragment, etcd \
             refused), counted once per version of the Secret and reason",
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
             another replica owns it now, refused: its etcd keys overlap another tenant's \
             that keeps them, shutdown)",
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
        registry.register(
            "tenant_secret_bytes",
            "Bytes the tenant Secrets' kubeconfigs, etcd certificates and configuration \
             annotations take in this replica",
            metrics.secret_bytes.clone(),
        );
        registry.register(
            "tenant_secret_limit_bytes",
            "The most bytes they may take together (--tenants-secrets-total-mib)",
            metrics.secret_limit_bytes.clone(),
        );
        registry.register(
            "tenant_secrets_shed",
            "Tenant Secrets held without their data, their tenant not run, as they would have \
             taken the Secrets over --tenants-secrets-total-mib; counted once when shed (again \
             if shed at another size)",
            metrics.secrets_shed.clone(),
        );
        metrics
            .secret_limit_bytes
            .set(i64::try_from(secret_limit).unwrap_or(i64::MAX));
        for state in STATES {
            metrics.tenants.get_or_create(&StateLabels { state }).set(0);
        }
        metrics
    }
}

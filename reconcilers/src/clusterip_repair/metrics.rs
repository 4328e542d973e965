//! The loop's metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;

use super::NAME;
use crate::metrics::{MetricRegistry, loop_registry, registered};

/// Counters mirroring upstream's `apiserver_clusterip_repair_*`, plus the deferrals.
#[derive(Clone, Debug, Default)]
pub struct RepairMetrics {
    /// `type` = leak | repair | outOfRange | duplicate | invalid, and rangeMismatch in etcd
    /// mode (upstream's `full` and `unknown` have no case here).
    pub ip_errors: Family<[(&'static str, &'static str); 1], Counter>,
    pub reconcile_errors: Counter,
    /// `reason` = stale_cache | verify_failed.
    pub deferred_deletes: Family<[(&'static str, &'static str); 1], Counter>,
}

impl RepairMetrics {
    pub fn register(registry: &mut dyn MetricRegistry) -> Self {
        let registry = loop_registry(registry, NAME);
        Self {
            ip_errors: registered(
                registry,
                "ip_errors",
                "Number of errors detected on cluster IPs by the repair loop, by type",
                Family::default(),
            ),
            reconcile_errors: registered(
                registry,
                "reconcile_errors",
                "Number of ClusterIP repair passes that failed",
                Counter::default(),
            ),
            deferred_deletes: registered(
                registry,
                "deferred_deletes",
                "Number of IPAddress deletes put off because a live read of the Service disagreed with the cache or failed, by reason",
                Family::default(),
            ),
        }
    }
}

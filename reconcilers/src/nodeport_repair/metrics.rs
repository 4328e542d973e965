//! The NodePort repair's metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::NAME;
use crate::metrics::{MetricRegistry, loop_registry, registered};

/// Counters mirroring upstream's `apiserver_nodeport_repair_port_errors_total`, counted once
/// per problem when it appears, and the problems present now.
#[derive(Clone, Debug, Default)]
pub struct NodePortMetrics {
    /// `type` = duplicate | outOfRange | repair (set in the bitmap, or the bitmap rebuilt under
    /// the configured range) | leak (released from it) | invalid (the stored bitmap cannot be
    /// used) | rangeMismatch (the bitmap is stored under another range: left alone).
    pub port_errors: Family<[(&'static str, &'static str); 1], Counter>,
    /// `type` as above: problems present after the last complete pass.
    pub current_problems: Family<[(&'static str, &'static str); 1], Gauge>,
}

impl NodePortMetrics {
    pub fn register(registry: &mut dyn MetricRegistry) -> Self {
        let registry = loop_registry(registry, NAME);
        Self {
            port_errors: registered(
                registry,
                "port_errors",
                "Number of node port problems found by the repair loop, counted when each appears, by type",
                Family::default(),
            ),
            current_problems: registered(
                registry,
                "problems",
                "Node port problems present after the last pass, by type",
                Family::default(),
            ),
        }
    }
}

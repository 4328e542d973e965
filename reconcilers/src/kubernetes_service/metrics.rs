//! The `kubernetes-service` loop's metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::NAME;
use crate::metrics::{MetricRegistry, loop_registry, registered};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    pub(super) kind: String,
}

/// Metric handles of the `kubernetes-service` loop.
#[derive(Clone, Default)]
pub struct KubernetesServiceMetrics {
    pub(super) repairs: Family<KindLabel, Counter>,
    pub(super) refusals: Family<KindLabel, Counter>,
    pub(super) cluster_ip_mismatch: Gauge,
}

impl KubernetesServiceMetrics {
    pub fn register(registry: &mut dyn MetricRegistry) -> Self {
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
        Self::counted(&self.repairs, kind).get()
    }

    pub fn refusals(&self, kind: &str) -> u64 {
        Self::counted(&self.refusals, kind).get()
    }

    pub fn cluster_ip_mismatch(&self) -> i64 {
        self.cluster_ip_mismatch.get()
    }
}

impl KubernetesServiceMetrics {
    /// Counts one repair or refusal of each kind.
    pub(super) fn count(family: &Family<KindLabel, Counter>, kinds: &[&str]) {
        for kind in kinds {
            Self::counted(family, kind).inc();
        }
    }

    fn counted(family: &Family<KindLabel, Counter>, kind: &str) -> Counter {
        family
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .clone()
    }
}

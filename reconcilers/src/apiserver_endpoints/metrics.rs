//! The `apiserver-endpoints` loop's metrics.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::NAME;
use super::members::MemberSet;
use crate::alloc::IpFamily;
use crate::metrics::{MetricRegistry, loop_registry, registered};

/// One label, e.g. `("kind", "endpoints_ports")`.
pub(super) type Label = [(&'static str, String); 1];

/// Metric handles of the `apiserver-endpoints` loop.
#[derive(Clone, Default)]
pub struct EndpointsMetrics {
    members: Family<Label, Gauge>,
    pub(super) changes: Family<Label, Counter>,
    pub(super) repairs: Family<Label, Counter>,
    pub(super) conflicting_writers: Counter,
}

impl EndpointsMetrics {
    pub fn register(registry: &mut dyn MetricRegistry) -> Self {
        let registry = loop_registry(registry, NAME);
        Self {
            members: registered(
                registry,
                "members",
                "Apiserver addresses listed in the kubernetes endpoints, by IP family",
                Family::default(),
            ),
            changes: registered(
                registry,
                "membership_changes",
                "Members that joined, left (withdrew) or expired (Lease ran out)",
                Family::default(),
            ),
            repairs: registered(
                registry,
                "repairs",
                "Repairs of the kubernetes Endpoints/EndpointSlices not explained by a membership change, by kind of drift",
                Family::default(),
            ),
            conflicting_writers: registered(
                registry,
                "conflicting_writers",
                "Other writers named (once per object and field manager) for objects this loop had to repair",
                Counter::default(),
            ),
        }
    }

    pub fn members(&self, family: IpFamily) -> i64 {
        let label = [("family", family.as_str().to_owned())];
        self.members.get_or_create(&label).get()
    }

    pub fn changes(&self, change: &str) -> u64 {
        self.changes
            .get_or_create(&[("change", change.to_owned())])
            .get()
    }

    pub fn repairs(&self, kind: &str) -> u64 {
        self.repairs
            .get_or_create(&[("kind", kind.to_owned())])
            .get()
    }

    pub(super) fn set_members(&self, members: &MemberSet) {
        for family in [IpFamily::V4, IpFamily::V6] {
            let count = i64::try_from(members.count(family)).unwrap_or(i64::MAX);
            let label = [("family", family.as_str().to_owned())];
            self.members.get_or_create(&label).set(count);
        }
    }
}

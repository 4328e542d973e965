//! The `apiserver-endpoints` loop's metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::NAME;
use super::members::MemberSet;
use crate::alloc::IpFamily;
use crate::metrics::{loop_registry, registered};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct FamilyLabel {
    pub(super) family: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ChangeLabel {
    pub(super) change: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    pub(super) kind: String,
}

/// Metric handles of the `apiserver-endpoints` loop.
#[derive(Clone, Default)]
pub struct EndpointsMetrics {
    members: Family<FamilyLabel, Gauge>,
    pub(super) changes: Family<ChangeLabel, Counter>,
    pub(super) repairs: Family<KindLabel, Counter>,
    pub(super) conflicting_writers: Counter,
}

impl EndpointsMetrics {
    pub fn register(registry: &mut Registry) -> Self {
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

    pub fn conflicting_writers(&self) -> u64 {
        self.conflicting_writers.get()
    }

    pub fn members(&self, family: IpFamily) -> i64 {
        self.members
            .get_or_create(&FamilyLabel {
                family: family.as_str().to_owned(),
            })
            .get()
    }

    pub fn changes(&self, change: &str) -> u64 {
        self.changes
            .get_or_create(&ChangeLabel {
                change: change.to_owned(),
            })
            .get()
    }

    pub fn repairs(&self, kind: &str) -> u64 {
        self.repairs
            .get_or_create(&KindLabel {
                kind: kind.to_owned(),
            })
            .get()
    }

    pub(super) fn set_members(&self, members: &MemberSet) {
        for family in [IpFamily::V4, IpFamily::V6] {
            let count = i64::try_from(members.count(family)).unwrap_or(i64::MAX);
            self.members
                .get_or_create(&FamilyLabel {
                    family: family.as_str().to_owned(),
                })
                .set(count);
        }
    }
}

//! What an audit pass reports, for clusters that do not serve IPAddress: upstream's legacy
//! bitmap `Repair` (`pkg/registry/core/service/ipallocator/controller/repair.go`), rebuilt from
//! the Services alone. Pure: no I/O. It can only report: the allocation state lives in etcd.

use crate::alloc::{AllocError, IpFamily, RangeAllocator, ServiceRange};
use crate::service_cache::record::ServiceRecord;

use super::plan::{
    ACTION_CLUSTERIP_ALLOCATION, ACTION_CLUSTERIP_VALIDATION, EventSpec, Finding, Regarding,
    Repair, SharedWith,
};

/// Decides an audit pass (no IPAddress API): rebuild each configured range's allocation from
/// all Services, as the legacy bitmap repair does, and report what it would have reported.
/// Nothing here is ever repaired: the allocation state lives in etcd, out of our reach.
pub fn decide_audit_mode<'a>(
    services: impl IntoIterator<Item = &'a ServiceRecord>,
    configured: &[ServiceRange],
) -> AuditDecision {
    let mut services: Vec<&ServiceRecord> = services.into_iter().collect();
    // Upstream's LIST order, etcd key order: the later of two holders gets the event.
    services.sort_unstable_by(|a, b| a.key_cmp(b));
    let mut allocators: Vec<RangeAllocator> = configured
        .iter()
        .copied()
        .map(RangeAllocator::new)
        .collect();
    let mut findings = Vec::new();
    for &svc in &services {
        for raw in svc.cluster_ips.iter() {
            let report = |kind, reason, action, note: String, error_type| Finding {
                kind,
                regarding: Regarding::service(svc),
                event: Some(EventSpec {
                    reason,
                    action,
                    note,
                }),
                error_type: Some(error_type),
                repair: Repair::None,
                shared_with: None,
            };
            let Some(ip) = raw.ip() else {
                findings.push(report(
                    "clusterip_not_valid",
                    "ClusterIPNotValid",
                    ACTION_CLUSTERIP_VALIDATION,
                    format!("Cluster IP {raw} is not a valid IP; please recreate service"),
                    "invalid",
                ));
                continue;
            };
            let family = IpFamily::of(ip);
            let Some(allocator) = allocators
                .iter_mut()
                .find(|alloc| alloc.range().family() == family)
            else {
                findings.push(report(
                    "clusterip_not_valid",
                    "ClusterIPNotValid",
                    ACTION_CLUSTERIP_VALIDATION,
                    format!(
                        "Cluster IP {ip}({family}) is of ip family that is no longer configured on cluster; please recreate service"
                    ),
                    "invalid",
                ));
                continue;
            };
            match allocator.allocate(ip) {
                Ok(()) => {}
                Err(AllocError::Allocated) => {
                    // The Service that allocated it: the first in key order listing it
                    // (duplicates are rare; no map of every IP's holder is kept for them).
                    let first = services.iter().find(|other| other.lists_ip(ip));
                    findings.push(Finding {
                        shared_with: first
                            .filter(|first| first.key_cmp(svc).is_ne())
                            .map(|first| SharedWith::of(ip, first)),
                        ..report(
                            "clusterip_already_allocated",
                            "ClusterIPAlreadyAllocated",
                            ACTION_CLUSTERIP_ALLOCATION,
                            format!(
                                "Cluster IP [{family}]:{ip} was assigned to multiple services; please recreate service"
                            ),
                            "duplicate",
                        )
                    })
                }
                Err(AllocError::NotInRange) => findings.push(report(
                    "clusterip_out_of_range",
                    "ClusterIPOutOfRange",
                    ACTION_CLUSTERIP_ALLOCATION,
                    format!(
                        "Cluster IP [{family}]:{ip} is not within the service CIDR {}; please recreate service",
                        allocator.range()
                    ),
                    "outOfRange",
                )),
            }
        }
    }
    AuditDecision {
        findings,
        usage: allocators
            .iter()
            .map(|alloc| RangeUsage {
                range: *alloc.range(),
                allocated: alloc.allocated(),
                free: alloc.free(),
            })
            .collect(),
    }
}

/// The outcome of an audit pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditDecision {
    pub findings: Vec<Finding>,
    pub usage: Vec<RangeUsage>,
}

/// How full one configured range is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RangeUsage {
    pub range: ServiceRange,
    pub allocated: u128,
    pub free: u128,
}

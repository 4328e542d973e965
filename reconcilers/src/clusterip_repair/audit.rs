//! What an audit pass reports, for clusters that do not serve IPAddress: upstream's legacy
//! bitmap `Repair` (`pkg/registry/core/service/ipallocator/controller/repair.go`), rebuilt from
//! the Services alone. Pure: no I/O. It can only report: the allocation state lives in etcd.

use std::collections::HashSet;
use std::net::IpAddr;

use crate::alloc::{IpFamily, ServiceRange};
use crate::service_cache::record::ServiceRecord;

use super::plan::{Finding, Problem, Regarding, Repair, SharedWith};

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
    // Each configured range with the cluster IPs allocated in it so far.
    let mut allocated: Vec<(ServiceRange, HashSet<IpAddr>)> = configured
        .iter()
        .map(|range| (*range, HashSet::new()))
        .collect();
    let mut findings = Vec::new();
    for &svc in &services {
        for raw in svc.cluster_ips.iter() {
            let report = |problem, note: String| Finding {
                problem,
                regarding: Regarding::service(svc),
                note,
                repair: Repair::None,
                shared_with: None,
            };
            let Some(ip) = raw.ip() else {
                findings.push(report(
                    Problem::NotValid,
                    format!("Cluster IP {raw} is not a valid IP; please recreate service"),
                ));
                continue;
            };
            let family = IpFamily::of(ip);
            let Some((range, taken)) = allocated
                .iter_mut()
                .find(|(range, _)| range.family() == family)
            else {
                findings.push(report(
                    Problem::NotValid,
                    format!(
                        "Cluster IP {ip}({family}) is of ip family that is no longer configured on cluster; please recreate service"
                    ),
                ));
                continue;
            };
            if !range.holds_service_ip(ip) {
                findings.push(report(
                    Problem::OutOfRange,
                    format!(
                        "Cluster IP [{family}]:{ip} is not within the service CIDR {range}; please recreate service"
                    ),
                ));
            } else if !taken.insert(ip) {
                // The Service that allocated it: the first in key order listing it
                // (duplicates are rare; no map of every IP's holder is kept for them).
                let first = services.iter().find(|other| other.lists_ip(ip));
                findings.push(Finding {
                    shared_with: first
                        .filter(|first| first.key_cmp(svc).is_ne())
                        .map(|first| SharedWith::of(ip, first)),
                    ..report(
                        Problem::AlreadyAllocated,
                        format!(
                            "Cluster IP [{family}]:{ip} was assigned to multiple services; please recreate service"
                        ),
                    )
                });
            }
        }
    }
    AuditDecision {
        findings,
        usage: allocated
            .iter()
            .map(|(range, taken)| RangeUsage {
                range: *range,
                allocated: taken.len() as u128,
                free: range.usable_size() - taken.len() as u128,
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::service_cache::record::{ClusterIp, Token};

    /// One Service per address, named by its order, so the first holder of each is known.
    fn decided(cidr: &str, ips: &[&str]) -> AuditDecision {
        let services: Vec<ServiceRecord> = (ips.iter().enumerate())
            .map(|(n, ip)| ServiceRecord {
                namespace: "default".into(),
                name: format!("s{n:02}").as_str().into(),
                uid: Token::new(&format!("u{n}")),
                resource_version: 1,
                cluster_ips: [ClusterIp::parse(ip)].into_iter().collect(),
                node_ports: Default::default(),
                health_check_node_port: 0,
                created: None,
            })
            .collect();
        decide_audit_mode(&services, &[ServiceRange::new(cidr.parse().unwrap())])
    }

    fn kinds(decision: &AuditDecision) -> Vec<&'static str> {
        decision
            .findings
            .iter()
            .map(|finding| finding.problem.drift_kind())
            .collect()
    }

    #[test]
    fn allocates_each_usable_address_once() {
        let usable: Vec<String> = (1..=6).map(|last| format!("10.0.0.{last}")).collect();
        let mut ips: Vec<&str> = usable.iter().map(String::as_str).collect();
        let full = decided("10.0.0.0/29", &ips);
        assert!(full.findings.is_empty(), "{:?}", full.findings);
        assert_eq!((full.usage[0].allocated, full.usage[0].free), (6, 0));
        // Network and broadcast addresses and what lies outside are out of range.
        ips.extend(["10.0.0.3", "10.0.0.0", "10.0.0.7", "10.0.0.8"]);
        let decision = decided("10.0.0.0/29", &ips);
        assert_eq!(
            kinds(&decision),
            [
                "clusterip_already_allocated",
                "clusterip_out_of_range",
                "clusterip_out_of_range",
                "clusterip_out_of_range",
            ]
        );
        assert_eq!(
            (decision.usage[0].allocated, decision.usage[0].free),
            (6, 0)
        );
    }

    #[test]
    fn huge_ipv6_ranges_accept_any_address() {
        let decision = decided(
            "fd00::/64",
            &["fd00::ffff:ffff:ffff:fffe", "fd00::1", "fd00::1"],
        );
        assert_eq!(
            kinds(&decision),
            ["clusterip_already_allocated"],
            "a duplicate is found in a huge range too"
        );
        assert_eq!(decision.usage[0].allocated, 2);
    }

    #[test]
    fn a_large_ipv4_range_ends_before_its_broadcast_address() {
        let decision = decided("10.96.0.0/12", &["10.111.255.254", "10.111.255.255"]);
        assert_eq!(kinds(&decision), ["clusterip_out_of_range"]);
        assert_eq!(decision.usage[0].allocated, 1);
    }
}

//! Which node ports the Services hold, and which of them are held twice or lie outside the
//! range: upstream's `collectServiceNodePorts` and the allocation half of its repair pass
//! (`pkg/registry/core/service/portallocator/controller/repair.go`). Pure: no I/O.

use std::collections::HashMap;

use fixedbitset::FixedBitSet;
use smallvec::SmallVec;

use crate::alloc::PortRange;
use crate::service_cache::record::{Protocol, ServiceRecord, ServiceRef};

/// The node ports one Service holds, as upstream collects them: each non-zero `nodePort`
/// whatever the Service's type; the same port with the same protocol twice counts twice (a
/// duplicate), with different protocols once; `healthCheckNodePort` counts unless the Service
/// already uses that port with a protocol other than TCP only.
pub fn collect_service_node_ports(service: &ServiceRecord) -> SmallVec<[i32; 4]> {
    let mut ports = SmallVec::new();
    // (port, protocols seen with it): a Service has a handful of ports, a scan beats a map.
    let mut seen: SmallVec<[(i32, SmallVec<[Protocol; 2]>); 4]> = SmallVec::new();
    for &(port, protocol) in &service.node_ports {
        if port == 0 {
            continue;
        }
        match seen.iter_mut().find(|(seen_port, _)| *seen_port == port) {
            None => {
                seen.push((port, SmallVec::from_slice(&[protocol])));
                ports.push(port);
            }
            Some((_, protocols)) if protocols.contains(&protocol) => ports.push(port),
            Some((_, protocols)) => protocols.push(protocol),
        }
    }
    let health = service.health_check_node_port;
    if health != 0 {
        let protocols = seen.iter().find(|(port, _)| *port == health);
        if protocols.is_none_or(|(_, protocols)| protocols.contains(&Protocol::Tcp)) {
            ports.push(health);
        }
    }
    ports
}

/// What is wrong with one node port of one Service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Problem {
    /// Another Service (earlier in etcd key order), or this one, holds the port already.
    AlreadyAllocated,
    /// The port lies outside the configured range.
    OutOfRange,
}

impl Problem {
    /// The event reason, upstream's.
    pub fn reason(self) -> &'static str {
        match self {
            Problem::AlreadyAllocated => "PortAlreadyAllocated",
            Problem::OutOfRange => "PortOutOfRange",
        }
    }

    /// The `type` label of the error counter, upstream's.
    pub fn error_type(self) -> &'static str {
        match self {
            Problem::AlreadyAllocated => "duplicate",
            Problem::OutOfRange => "outOfRange",
        }
    }

    /// The drift kind in `check` output and the drift metrics.
    pub fn drift_kind(self) -> &'static str {
        match self {
            Problem::AlreadyAllocated => "nodeport_duplicate",
            Problem::OutOfRange => "nodeport_out_of_range",
        }
    }
}

/// One problem with one port of one Service. Equal findings are the same condition: a Service
/// deleted and created again under the same name is another object (another uid), so its
/// problem is reported again.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Finding {
    pub problem: Problem,
    pub service: ServiceRef,
    pub port: i32,
}

impl Finding {
    /// The event note, upstream's wording.
    pub fn note(&self, range: PortRange) -> String {
        match self.problem {
            Problem::AlreadyAllocated => format!(
                "Port {} was assigned to multiple services; please recreate service",
                self.port
            ),
            Problem::OutOfRange => format!(
                "Port {} is not within the port range {range}; please recreate service",
                self.port
            ),
        }
    }
}

/// What one scan of the Services found.
#[derive(Debug)]
pub struct Scan {
    /// In etcd key order (`namespace/name` as bytes), as upstream's pass meets them.
    pub findings: Vec<Finding>,
    /// The ports inside the range that some Service holds, by offset in the range: the
    /// allocation bitmap as it should be.
    pub in_use: FixedBitSet,
    /// The Service that holds each offset of `in_use` (the first in etcd key order).
    pub owners: HashMap<usize, ServiceRef>,
}

/// Allocates every Service's node ports into an empty bitmap of `range`, in etcd key order, as
/// upstream's repair rebuilds its allocator: the first Service to hold a port owns it, every
/// later holder (or a second hold by the same Service) is a duplicate.
pub fn scan<'a>(services: impl IntoIterator<Item = &'a ServiceRecord>, range: PortRange) -> Scan {
    // Only Services that hold node ports need the list order; most hold none.
    let mut holders: Vec<&ServiceRecord> = services
        .into_iter()
        .filter(|service| !service.node_ports.is_empty() || service.health_check_node_port != 0)
        .collect();
    // Upstream's repair walks a LIST, in etcd key order (`namespace/name` as bytes).
    holders.sort_unstable_by(|a, b| a.key_cmp(b));

    let mut in_use = FixedBitSet::with_capacity(range.size());
    let mut owners = HashMap::new();
    let mut findings = Vec::new();
    for service in holders {
        for port in collect_service_node_ports(service) {
            let problem = match range.offset(port) {
                None => Problem::OutOfRange,
                Some(offset) if in_use.put(offset) => Problem::AlreadyAllocated,
                Some(offset) => {
                    owners.insert(offset, ServiceRef::of(service));
                    continue;
                }
            };
            findings.push(Finding {
                problem,
                service: ServiceRef::of(service),
                port,
            });
        }
    }
    Scan {
        findings,
        in_use,
        owners,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::service_cache::record::Token;

    fn service(
        namespace: &str,
        name: &str,
        ports: &[(i32, Protocol)],
        health: i32,
    ) -> ServiceRecord {
        ServiceRecord {
            namespace: namespace.into(),
            name: name.into(),
            uid: Token::new(&format!("uid-{namespace}-{name}")),
            resource_version: 1,
            cluster_ips: Default::default(),
            node_ports: ports.iter().copied().collect(),
            health_check_node_port: health,
            created: None,
        }
    }

    /// upstream's TestCollectServiceNodePorts, case by case.
    #[test]
    fn collects_node_ports_as_upstream() {
        use Protocol::{Tcp, Udp};
        /// Name, `spec.ports` as (nodePort, protocol), `healthCheckNodePort`, ports expected.
        type Case = (
            &'static str,
            &'static [(i32, Protocol)],
            i32,
            &'static [i32],
        );
        let cases: &[Case] = &[
            (
                "no duplicated nodePorts",
                &[(111, Tcp), (112, Udp), (113, Udp)],
                0,
                &[111, 112, 113],
            ),
            (
                "duplicated nodePort with TCP protocol",
                &[(111, Tcp), (111, Tcp), (112, Udp)],
                0,
                &[111, 111, 112],
            ),
            (
                "duplicated nodePort with UDP protocol",
                &[(111, Udp), (111, Udp), (112, Tcp)],
                0,
                &[111, 111, 112],
            ),
            (
                "duplicated nodePort with different protocol",
                &[(111, Tcp), (112, Tcp), (111, Udp)],
                0,
                &[111, 112],
            ),
            (
                "no duplicated port(with health check port)",
                &[(111, Tcp), (112, Udp)],
                113,
                &[111, 112, 113],
            ),
            (
                "nodePort has different protocol with duplicated health check port",
                &[(111, Udp), (112, Tcp)],
                111,
                &[111, 112],
            ),
            (
                "nodePort has same protocol as duplicated health check port",
                &[(111, Udp), (112, Tcp)],
                112,
                &[111, 112, 112],
            ),
        ];
        for (name, ports, health, expected) in cases {
            let mut got = collect_service_node_ports(&service("one", "one", ports, *health));
            got.sort_unstable();
            assert_eq!(got.as_slice(), *expected, "{name}");
        }
    }

    #[test]
    fn the_later_service_in_list_order_holds_the_duplicate() {
        let range = PortRange::default();
        // Given out of order: the scan sorts by etcd key.
        let services = [
            service("b", "web", &[(30080, Protocol::Tcp)], 0),
            service("a", "zeta", &[(30080, Protocol::Tcp)], 0),
            service("a", "alpha", &[(30081, Protocol::Tcp)], 0),
        ];
        let scan = scan(&services, range);
        assert_eq!(scan.findings.len(), 1);
        let finding = &scan.findings[0];
        assert_eq!(
            (
                finding.service.namespace.as_str(),
                finding.service.name.as_str()
            ),
            ("b", "web")
        );
        assert_eq!(finding.problem, Problem::AlreadyAllocated);
        assert_eq!(
            finding.note(range),
            "Port 30080 was assigned to multiple services; please recreate service"
        );
        assert_eq!(scan.in_use.count_ones(..), 2);
        assert!(scan.in_use.contains(80) && scan.in_use.contains(81));
    }

    /// The first holder is the Service whose etcd key comes first (upstream walks a LIST):
    /// `a-b/x` before `a/z`, although namespace "a" sorts before "a-b".
    #[test]
    fn the_duplicate_lands_on_the_later_etcd_key() {
        let services = [
            service("a", "z", &[(30080, Protocol::Tcp)], 0),
            service("a-b", "x", &[(30080, Protocol::Tcp)], 0),
        ];
        let mut reversed = services.clone();
        reversed.reverse();
        for order in [&services[..], &reversed[..]] {
            let scan = scan(order, PortRange::default());
            let got: Vec<_> = scan
                .findings
                .iter()
                .map(|f| {
                    (
                        f.service.namespace.as_str(),
                        f.service.name.as_str(),
                        f.problem,
                    )
                })
                .collect();
            assert_eq!(got, [("a", "z", Problem::AlreadyAllocated)]);
            assert_eq!(scan.owners[&80].namespace.as_str(), "a-b");
        }
    }

    #[test]
    fn every_type_counts_and_out_of_range_ports_are_reported() {
        let range = PortRange::new(30000, 30100).unwrap();
        let services = [
            // A nodePort left on a ClusterIP Service still counts (the record keeps no type).
            service("default", "leftover", &[(30001, Protocol::Tcp)], 0),
            service(
                "default",
                "lb",
                &[(30001, Protocol::Udp), (40000, Protocol::Tcp)],
                30002,
            ),
            service(
                "default",
                "hostile",
                &[(-5, Protocol::Tcp), (70000, Protocol::Other)],
                0,
            ),
        ];
        let scan = scan(&services, range);
        let got: Vec<_> = scan
            .findings
            .iter()
            .map(|f| (f.service.name.as_str(), f.port, f.problem))
            .collect();
        assert_eq!(
            got,
            vec![
                ("hostile", -5, Problem::OutOfRange),
                ("hostile", 70000, Problem::OutOfRange),
                ("lb", 40000, Problem::OutOfRange),
                // "lb" comes first in list order and owns the port, whatever the protocol.
                ("leftover", 30001, Problem::AlreadyAllocated),
            ]
        );
        assert_eq!(
            scan.findings[2].note(range),
            "Port 40000 is not within the port range 30000-30100; please recreate service"
        );
        assert!(scan.in_use.contains(1) && scan.in_use.contains(2));
        assert_eq!(scan.in_use.count_ones(..), 2);
    }

    #[test]
    fn a_port_twice_in_one_service_is_a_duplicate_of_itself() {
        let services = [service(
            "ns",
            "twice",
            &[(30500, Protocol::Tcp), (30500, Protocol::Tcp)],
            0,
        )];
        let scan = scan(&services, PortRange::default());
        assert_eq!(scan.findings.len(), 1);
        assert_eq!(scan.findings[0].problem, Problem::AlreadyAllocated);
    }
}

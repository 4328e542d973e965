//! The `kubernetes` Service's endpoints: who the apiservers are, and the Endpoints and
//! EndpointSlices that list them.
//!
//! Two loops share one configuration:
//! * [`ApiserverLeaseLoop`] (`apiserver-lease`, every instance, `lease` mode only): keeps this
//!   instance's membership Lease while its apiserver's `/readyz` answers 200, deletes it when the
//!   apiserver is not ready and on shutdown.
//! * [`ApiserverEndpointsLoop`] (`apiserver-endpoints`, leader only; on every instance in
//!   `master-count` mode, as upstream): computes the member set and writes the Endpoints and
//!   EndpointSlices from it.
//!
//! Pure logic lives in [`members`], [`desired`] and [`lease`]; [`probe`] holds the readiness and
//! DNS traits.
//!
//! Objects, as a user sees them:
//! * Membership Leases `<leaseNamespace>/apiserver-<address>` (IPv6 colons as dashes), label
//!   `bootstrap-controller.io/apiserver-endpoint=<service>`, annotations
//!   `bootstrap-controller.io/advertise-address` and `bootstrap-controller.io/secure-port`,
//!   `leaseDurationSeconds` = TTL, `renewTime` renewed every interval. `kubectl delete` of one
//!   removes that member at once (its sidecar re-creates it on its next renewal if its apiserver
//!   is ready).
//! * Endpoints `<ns>/<service>` (label `endpointslice.kubernetes.io/skip-mirror: "true"`, one
//!   subset, addresses sorted by string as upstream, port `https`/TCP/`securePort`); EndpointSlice
//!   `<ns>/<service>` for the primary family and `<ns>/<service>-ipv6` (or `-ipv4`) for the other
//!   family while it has members; both labelled `kubernetes.io/service-name=<service>`.
//! * Events (events.k8s.io/v1) on the Endpoints: `MemberJoined`, `MemberLeft`, `MemberExpired`,
//!   `EndpointsRepaired`, `StaticAddressResolutionFailed` and `InvalidMemberAddress` (Warning).
//!
//! RBAC the loops need: `coordination.k8s.io` `leases` get/list/watch/create/update/delete in the
//! Lease namespace; `endpoints` get/list/watch/create/update and `discovery.k8s.io`
//! `endpointslices` get/list/watch/create/update/delete in the Service namespace;
//! `events.k8s.io` `events` create/patch there; the non-resource URL `/readyz` get (when probed
//! through the kubeconfig's server); reading the leader-election Lease (already granted to the
//! election).

pub mod desired;
pub mod endpoints_loop;
pub mod lease;
pub mod lease_loop;
pub mod members;
pub mod modes;
pub mod probe;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::Reporter;
use prometheus_client::registry::Registry;

pub use desired::EndpointsTarget;
pub use endpoints_loop::{ApiserverEndpointsLoop, EndpointsMetrics};
pub use lease_loop::{ApiserverLeaseLoop, LeaseMetrics};
pub use members::{IpFamily, MemberSet};
pub use probe::{
    ApiserverReadyz, ConfigLoader, LazyUrlReadyz, NotReady, ReadinessProbe, Resolver,
    SystemResolver, default_route_address,
};

use crate::contract::Reconciler;

/// `--endpoint-reconciler-type`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EndpointsMode {
    /// Membership from per-instance Leases (default).
    #[default]
    Lease,
    /// Addresses from configuration: IPs and DNS names, re-resolved every interval.
    Static,
    /// Upstream's deprecated `master-count`: every instance adds itself and trims to the count.
    MasterCount,
    /// Leave the endpoints alone.
    None,
}

impl std::str::FromStr for EndpointsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lease" => Ok(EndpointsMode::Lease),
            "static" => Ok(EndpointsMode::Static),
            "master-count" => Ok(EndpointsMode::MasterCount),
            "none" => Ok(EndpointsMode::None),
            other => Err(format!(
                "unknown endpoint reconciler type {other:?}; use lease, static, master-count or none"
            )),
        }
    }
}

/// Configuration of both endpoint loops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiserverEndpointsConfig {
    pub mode: EndpointsMode,
    /// Service namespace/name, `--secure-port`, primary family.
    pub target: EndpointsTarget,
    /// This instance's apiserver address (`--advertise-address`). Required for `lease` and
    /// `master-count`.
    pub advertise_address: Option<IpAddr>,
    /// Pass interval of both loops (lease renewal, endpoints check, DNS re-resolution).
    pub interval: Duration,
    /// Namespace of the membership Leases.
    pub lease_namespace: String,
    /// How long a membership Lease stays valid without renewal.
    pub lease_ttl: Duration,
    /// `holderIdentity` of this instance's Lease (pod or host name).
    pub identity: String,
    /// `static` mode: IPs and/or DNS names.
    pub static_addresses: Vec<String>,
    /// `master-count` mode: `--apiserver-count`.
    pub apiserver_count: usize,
    /// The leader-election Lease (namespace, name) when leader election is on: at shutdown only
    /// its holder (`identity`) withdraws its own address directly, so a replica that lost
    /// leadership never writes next to the new leader.
    pub leader_lease: Option<(String, String)>,
}

impl Default for ApiserverEndpointsConfig {
    fn default() -> Self {
        Self {
            mode: EndpointsMode::Lease,
            target: EndpointsTarget::default(),
            advertise_address: None,
            interval: Duration::from_secs(10),
            lease_namespace: "kube-system".to_owned(),
            lease_ttl: Duration::from_secs(15),
            identity: String::new(),
            static_addresses: Vec::new(),
            apiserver_count: 1,
            leader_lease: None,
        }
    }
}

/// A configuration problem, naming the field (relative to the loop's section) and the fix.
pub use crate::kubernetes_service::ConfigError;

/// One entry of `static` mode's address list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StaticAddress {
    Ip(IpAddr),
    Name(String),
}

/// Why an entry of `static` mode's address list cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StaticAddressError {
    #[error("{ip} {why}")]
    UnusableIp { ip: IpAddr, why: &'static str },
    #[error(
        "{0:?} is neither an IP address nor a DNS name (no scheme, port or path: write apiserver.example.com, not https://apiserver.example.com:6443)"
    )]
    NotAnAddress(String),
}

impl StaticAddress {
    pub fn parse(text: &str) -> Result<Self, StaticAddressError> {
        let text = text.trim();
        if let Some(ip) = members::parse_ip(text) {
            if let Some(why) = members::endpoint_ip_problem(&ip) {
                return Err(StaticAddressError::UnusableIp { ip, why });
            }
            return Ok(StaticAddress::Ip(ip));
        }
        let name = text.strip_suffix('.').unwrap_or(text);
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        if name.is_empty() || name.len() > 253 || !name.split('.').all(label_ok) {
            return Err(StaticAddressError::NotAnAddress(text.to_owned()));
        }
        Ok(StaticAddress::Name(name.to_ascii_lowercase()))
    }
}

impl ApiserverEndpointsConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field, message: String| Err(ConfigError { field, message });
        if self.mode == EndpointsMode::None {
            return Ok(());
        }
        if !(1..=65535).contains(&self.target.port) {
            return err(
                "securePort",
                format!("{} is not a port (1-65535)", self.target.port),
            );
        }
        if self.interval.is_zero() {
            return err("interval", "must be greater than zero".to_owned());
        }
        if self.target.service_name.is_empty() || self.target.namespace.is_empty() {
            return err(
                "service",
                "namespace and name of the Service are required".to_owned(),
            );
        }
        match self.mode {
            EndpointsMode::Lease | EndpointsMode::MasterCount => {
                let Some(address) = self.advertise_address else {
                    return err(
                        "advertiseAddress",
                        format!(
                            "required in {} mode: the IP this instance's apiserver serves on (its --advertise-address)",
                            if self.mode == EndpointsMode::Lease {
                                "lease"
                            } else {
                                "master-count"
                            }
                        ),
                    );
                };
                if address.is_unspecified() || address.is_loopback() || address.is_multicast() {
                    return err(
                        "advertiseAddress",
                        format!(
                            "{address} cannot be reached by clients; give the apiserver's routable address"
                        ),
                    );
                }
                if let Some(primary) = self.target.primary_family
                    && self.mode == EndpointsMode::MasterCount
                    && IpFamily::of(&address) != primary
                {
                    return err(
                        "advertiseAddress",
                        format!(
                            "{address} is not of the primary family {primary} (upstream refuses this too)"
                        ),
                    );
                }
            }
            EndpointsMode::Static | EndpointsMode::None => {}
        }
        match self.mode {
            EndpointsMode::Lease => {
                if self.lease_namespace.is_empty() {
                    return err("lease.namespace", "must not be empty".to_owned());
                }
                if self.lease_ttl <= self.interval {
                    return err(
                        "lease.ttl",
                        format!(
                            "{:?} must be longer than interval {:?}, or members expire between renewals",
                            self.lease_ttl, self.interval
                        ),
                    );
                }
                if self.lease_ttl.as_secs() < 1 {
                    return err(
                        "lease.ttl",
                        "must be at least 1s (Lease durations are whole seconds)".to_owned(),
                    );
                }
            }
            EndpointsMode::Static => {
                if self.static_addresses.is_empty() {
                    return err(
                        "static.addresses",
                        "static mode needs at least one IP address or DNS name".to_owned(),
                    );
                }
                for (i, text) in self.static_addresses.iter().enumerate() {
                    if let Err(message) = StaticAddress::parse(text) {
                        return Err(ConfigError {
                            field: "static.addresses",
                            message: format!("entry {i}: {message}"),
                        });
                    }
                }
            }
            EndpointsMode::MasterCount => {
                if self.apiserver_count == 0 {
                    return err(
                        "apiserverCount",
                        "--apiserver-count should be a positive number, but value '0' provided"
                            .to_owned(),
                    );
                }
            }
            EndpointsMode::None => {}
        }
        Ok(())
    }

    pub fn static_entries(&self) -> Vec<StaticAddress> {
        self.static_addresses
            .iter()
            .filter_map(|t| StaticAddress::parse(t).ok())
            .collect()
    }
}

/// Everything the loops need from outside.
#[derive(Clone)]
pub struct EndpointsDeps {
    pub client: kube::Client,
    /// Whether the local apiserver is ready (`lease` and `master-count` modes).
    pub readiness: Arc<dyn ReadinessProbe>,
    /// Name resolution (`static` mode).
    pub resolver: Arc<dyn Resolver>,
    pub reporter: Reporter,
}

/// The loops for `cfg.mode`: `lease` gives the per-instance lease loop and the leader-only
/// endpoints loop; `static` and `master-count` give the endpoints loop; `none` gives nothing.
/// `cfg` must have passed [`ApiserverEndpointsConfig::validate`].
pub fn build_loops(
    cfg: &ApiserverEndpointsConfig,
    deps: EndpointsDeps,
    registry: &mut Registry,
) -> Vec<Box<dyn Reconciler>> {
    let mut loops: Vec<Box<dyn Reconciler>> = Vec::new();
    if cfg.mode == EndpointsMode::None {
        return loops;
    }
    if cfg.mode == EndpointsMode::Lease
        && let Some(lease_loop) = ApiserverLeaseLoop::new(cfg, deps.clone(), registry)
    {
        loops.push(Box::new(lease_loop));
    }
    loops.push(Box::new(ApiserverEndpointsLoop::new(cfg, deps, registry)));
    loops
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn lease_cfg() -> ApiserverEndpointsConfig {
        ApiserverEndpointsConfig {
            advertise_address: Some("10.0.0.1".parse().unwrap()),
            ..ApiserverEndpointsConfig::default()
        }
    }

    #[test]
    fn defaults_need_an_advertise_address() {
        let e = ApiserverEndpointsConfig::default().validate().unwrap_err();
        assert_eq!(e.field, "advertiseAddress");
        lease_cfg().validate().unwrap();
    }

    #[test]
    fn loopback_advertise_address_is_rejected() {
        let cfg = ApiserverEndpointsConfig {
            advertise_address: Some("127.0.0.1".parse().unwrap()),
            ..lease_cfg()
        };
        assert_eq!(cfg.validate().unwrap_err().field, "advertiseAddress");
    }

    #[test]
    fn ttl_must_exceed_interval() {
        let cfg = ApiserverEndpointsConfig {
            lease_ttl: Duration::from_secs(10),
            ..lease_cfg()
        };
        assert_eq!(cfg.validate().unwrap_err().field, "lease.ttl");
    }

    #[test]
    fn static_entries_are_ips_or_names() {
        assert_eq!(
            StaticAddress::parse("10.0.0.1"),
            Ok(StaticAddress::Ip("10.0.0.1".parse().unwrap()))
        );
        assert_eq!(
            StaticAddress::parse("LB.example.com."),
            Ok(StaticAddress::Name("lb.example.com".into()))
        );
        assert!(
            StaticAddress::parse("127.0.0.1")
                .unwrap_err()
                .to_string()
                .contains("loopback")
        );
        assert!(
            StaticAddress::parse("https://lb.example.com:6443")
                .unwrap_err()
                .to_string()
                .contains("no scheme")
        );
        let cfg = ApiserverEndpointsConfig {
            mode: EndpointsMode::Static,
            static_addresses: vec!["10.0.0.1".into(), "bad name".into()],
            ..ApiserverEndpointsConfig::default()
        };
        let e = cfg.validate().unwrap_err();
        assert_eq!(e.field, "static.addresses");
        assert!(e.message.starts_with("entry 1:"), "{e}");
        let empty = ApiserverEndpointsConfig {
            static_addresses: vec![],
            ..cfg
        };
        assert_eq!(empty.validate().unwrap_err().field, "static.addresses");
    }

    #[test]
    fn master_count_needs_a_positive_count() {
        let cfg = ApiserverEndpointsConfig {
            mode: EndpointsMode::MasterCount,
            apiserver_count: 0,
            ..lease_cfg()
        };
        assert_eq!(cfg.validate().unwrap_err().field, "apiserverCount");
    }

    #[test]
    fn none_mode_needs_nothing() {
        let cfg = ApiserverEndpointsConfig {
            mode: EndpointsMode::None,
            ..ApiserverEndpointsConfig::default()
        };
        cfg.validate().unwrap();
        assert_eq!(
            "master-count".parse::<EndpointsMode>(),
            Ok(EndpointsMode::MasterCount)
        );
        assert!("leases".parse::<EndpointsMode>().is_err());
    }
}

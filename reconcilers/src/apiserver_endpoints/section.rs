//! `loops.apiserverEndpoints`: the section of the configuration file, with the mode
//! (`endpointReconcilerType`) and `apiserverCount`, which is also the one configuration both
//! endpoint loops read, with the top-level settings (the Service range, `securePort`,
//! `advertiseAddress` and this replica's identity).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::members;
use super::objects::EndpointsTarget;
use super::probe::{
    ApiserverReadyz, LazyUrlReadyz, ProbedServer, ReadinessProbe, SystemResolver,
    default_route_address,
};
use super::shutdown::{OnShutdown, ShutdownGate};
use super::{ApiserverEndpointsLoop, ApiserverLeaseLoop, EndpointsDeps};
use crate::alloc::IpFamily;
use crate::contract::Reconciler;
use crate::names::validate_dns1123_label;
use crate::section::{
    self, BuildContext, BuildError, LoopSection, ServiceName, Settings, duration_format,
    format_duration, validate_interval,
};

/// Upstream's interval of the endpoint reconcilers (10 s), for both loops.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// Upstream's membership Lease TTL (`--endpoint-reconciler-type=lease`: 15 s).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(15);

/// Said once when the loops are built and no mode is named: they are then not built.
pub const ENDPOINTS_UNNAMED: &str = "the kubernetes endpoints are left alone: no endpoint \
     reconciler type is named; to keep them, set --endpoint-reconciler-type \
     (BOOTSTRAP_ENDPOINT_RECONCILER_TYPE, file key endpointReconcilerType) to lease, static or \
     master-count";

/// `loops.apiserverEndpoints`: the `kubernetes` Endpoints and EndpointSlices, with the mode
/// (`endpointReconcilerType`) and `apiserverCount`; the address is `advertiseAddress`, the port
/// `securePort`. The one configuration type of both loops: they are built from the section and
/// the settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    /// `endpointReconcilerType`. Like `apiserverCount` it is kube-apiserver's flag, so the file
    /// names it at the top level and `--endpoint-reconciler-type` sets it; the effective
    /// configuration prints both there. `None` when nothing names a mode: the loops are then not
    /// built, so a process started with nothing chosen never rewrites the cluster's endpoints.
    #[serde(skip)]
    pub mode: Option<EndpointsMode>,
    /// `apiserverCount` (`master-count` mode): a positive count.
    #[serde(skip)]
    pub apiserver_count: u32,
    pub enabled: bool,
    /// Lease renewal, endpoints check and DNS re-resolution interval.
    #[serde(with = "duration_format")]
    pub interval: Duration,
    /// `lease` mode: namespace of the per-apiserver membership Leases.
    pub lease_namespace: String,
    /// `lease` mode: how long a membership Lease stays valid without renewal; longer than
    /// `interval`.
    #[serde(rename = "leaseTTL", with = "duration_format")]
    pub lease_ttl: Duration,
    /// `lease` and `master-count` modes: the local apiserver's readiness URL. Empty: `/readyz` of
    /// the kubeconfig's server. A path (`/readyz?exclude=etcd`) is probed on that server; a full
    /// URL (`https://127.0.0.1:6443/readyz`) with the kubeconfig's CA and credentials.
    #[serde(rename = "readyzURL")]
    pub readyz_url: String,
    /// `static` mode: IP addresses and/or DNS names (re-resolved every interval, A and AAAA; a
    /// failed or empty answer keeps the last good addresses).
    pub static_addresses: Vec<String>,
    /// `lease` and `master-count` modes: on a graceful stop, `withdrawIfApiserverStopping`
    /// (probe the local apiserver's readiness; withdraw this instance only if it fails),
    /// `alwaysWithdraw` or `keep`.
    pub on_shutdown: OnShutdown,
    /// Readiness probes made at shutdown (`withdrawIfApiserverStopping`); every one must pass for
    /// the membership to be kept.
    pub shutdown_probes: u32,
    /// The time over which the shutdown probes are spread (first to last).
    #[serde(with = "duration_format")]
    pub shutdown_probe_window: Duration,
    /// `lease` and `master-count` modes: failed readiness probes in a row that withdraw this
    /// instance; after a failure below it the next probe comes within a second.
    pub readiness_failure_threshold: u32,
    /// `lease` mode: check, at start and every 10 minutes, that the local apiserver's serving
    /// certificate is valid for `advertiseAddress` (reported once when it is not).
    pub check_serving_certificate: bool,
    /// Write the `kubernetes` Endpoints as well as its EndpointSlice. `false`: slices only
    /// (Endpoints are deprecated since 1.33); an existing Endpoints is left as it is, reported.
    pub write_endpoints: bool,
    /// When a pass repairs an object another field manager wrote last, name that writer once
    /// (a Warning event `ConflictingWriter`, a log line, a metric).
    pub name_conflicting_writers: bool,
    /// `lease` mode: once another instance is seen renewing this address's Lease (several
    /// apiservers behind one VIP), never withdraw the address; it goes by Lease expiry.
    pub keep_shared_address: bool,
}

impl Default for Section {
    fn default() -> Self {
        Section {
            mode: None,
            apiserver_count: 1,
            enabled: true,
            interval: DEFAULT_INTERVAL,
            lease_namespace: "kube-system".to_owned(),
            lease_ttl: DEFAULT_LEASE_TTL,
            readyz_url: String::new(),
            static_addresses: Vec::new(),
            on_shutdown: OnShutdown::default(),
            shutdown_probes: 3,
            shutdown_probe_window: Duration::from_secs(2),
            readiness_failure_threshold: 3,
            check_serving_certificate: true,
            write_endpoints: true,
            name_conflicting_writers: true,
            keep_shared_address: true,
        }
    }
}

impl Section {
    /// The mode the loops follow: the one named, else `none`.
    pub fn endpoint_mode(&self) -> EndpointsMode {
        self.mode.unwrap_or(EndpointsMode::None)
    }

    /// `advertiseAddress`, else the default-route address of the primary range's family (what
    /// kube-apiserver does when `--advertise-address` is unset).
    pub fn advertise_address(&self, settings: &Settings) -> Option<IpAddr> {
        settings.advertise_address.or_else(|| {
            let primary = settings.service_ranges.first();
            default_route_address(primary.map_or(IpFamily::V4, IpFamily::of_net))
        })
    }

    /// The Service the endpoints serve: the `kubernetes` Service, with `securePort` and the
    /// primary range's family from `settings`. Public so the demo and tests build members that
    /// match the running controller.
    pub fn target(settings: &Settings, service: &ServiceName) -> EndpointsTarget {
        EndpointsTarget {
            namespace: service.namespace.clone(),
            service_name: service.name.clone(),
            port: i32::from(settings.endpoints_port()),
            primary_family: settings.service_ranges.first().map(IpFamily::of_net),
        }
    }

    /// `static` mode's entries (validation rejects any that does not parse).
    pub fn static_entries(&self) -> Vec<StaticAddress> {
        self.static_addresses
            .iter()
            .filter_map(|t| StaticAddress::parse(t).ok())
            .collect()
    }

    /// The checks of the readiness probing (`lease` and `master-count` modes).
    fn validate_probing(&self, path: &str, errors: &mut Vec<section::ConfigError>) {
        if !self.readyz_url.is_empty() {
            let url = self.readyz_url.as_str();
            let full = url.starts_with("http://") || url.starts_with("https://");
            if !full && !url.starts_with('/') {
                errors.push(section::ConfigError::new(
                    format!("{path}.readyzURL"),
                    format!(
                        "{url:?} is neither a path (/readyz) nor an http(s) URL \
                         (https://127.0.0.1:6443/readyz)"
                    ),
                ));
            }
        }
        if !(1..=MAX_SHUTDOWN_PROBES).contains(&self.shutdown_probes) {
            errors.push(section::ConfigError::new(
                format!("{path}.shutdownProbes"),
                format!(
                    "{} is not between 1 and {MAX_SHUTDOWN_PROBES} (default 3: enough to see a \
                     stopping apiserver fail its readiness, few enough to stop quickly)",
                    self.shutdown_probes
                ),
            ));
        }
        if !(1..=MAX_READINESS_FAILURE_THRESHOLD).contains(&self.readiness_failure_threshold) {
            errors.push(section::ConfigError::new(
                format!("{path}.readinessFailureThreshold"),
                format!(
                    "{} is not between 1 and {MAX_READINESS_FAILURE_THRESHOLD} (default 3: one \
                     slow /readyz never withdraws a member, one that keeps failing goes within \
                     seconds; 1 withdraws on the first failure)",
                    self.readiness_failure_threshold
                ),
            ));
        }
        if self.shutdown_probe_window > MAX_SHUTDOWN_PROBE_WINDOW {
            errors.push(section::ConfigError::new(
                format!("{path}.shutdownProbeWindow"),
                format!(
                    "{} is longer than {}: the probes must end well inside the pod's \
                     termination grace period and shutdownTimeout (default 2s)",
                    format_duration(self.shutdown_probe_window),
                    format_duration(MAX_SHUTDOWN_PROBE_WINDOW)
                ),
            ));
        }
    }
}

/// `--endpoint-reconciler-type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EndpointsMode {
    /// Membership from per-instance Leases.
    Lease,
    /// Addresses from configuration: IPs and DNS names, re-resolved every interval.
    Static,
    /// Upstream's deprecated `master-count`: every instance adds itself and trims to the count.
    MasterCount,
    /// Leave the endpoints alone.
    None,
}

impl EndpointsMode {
    /// The name `--endpoint-reconciler-type` takes.
    pub fn as_str(self) -> &'static str {
        match self {
            EndpointsMode::Lease => "lease",
            EndpointsMode::Static => "static",
            EndpointsMode::MasterCount => "master-count",
            EndpointsMode::None => "none",
        }
    }

    /// Every mode, in the order `--help` lists them.
    pub const ALL: [EndpointsMode; 4] = [
        EndpointsMode::Lease,
        EndpointsMode::Static,
        EndpointsMode::MasterCount,
        EndpointsMode::None,
    ];

    /// The mode `--endpoint-reconciler-type` names, if any.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|mode| mode.as_str() == name)
    }
}

/// Bounds of the shutdown probing: it delays the stop by about the window, inside the runner's
/// `shutdownTimeout` (default 30 s) and a pod's grace period (default 30 s).
const MAX_SHUTDOWN_PROBES: u32 = 10;
const MAX_SHUTDOWN_PROBE_WINDOW: Duration = Duration::from_secs(10);
/// Past this, a dead apiserver stays listed too long (each failure below the threshold is
/// re-probed within a second, plus the probe's own timeout of up to 5 s).
const MAX_READINESS_FAILURE_THRESHOLD: u32 = 10;

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    /// Every check of the section; the settings it reads (`advertiseAddress`, `securePort`, the
    /// ranges) and `apiserverCount` are checked where they are parsed.
    fn validate(&self, path: &str, settings: &Settings, errors: &mut Vec<section::ConfigError>) {
        validate_interval(path, self.interval, errors);
        let mode = self.endpoint_mode();
        let probes = matches!(mode, EndpointsMode::Lease | EndpointsMode::MasterCount);
        if self.enabled && probes && self.advertise_address(settings).is_none() {
            errors.push(section::ConfigError::new(
                "advertiseAddress",
                format!(
                    "not set and this host has no default route to take it from; endpoint \
                     reconciler {} needs the apiserver's address (--advertise-address)",
                    mode.as_str()
                ),
            ));
        }
        if mode == EndpointsMode::Lease {
            if let Err(why) = validate_dns1123_label(&self.lease_namespace) {
                errors.push(section::ConfigError::new(
                    format!("{path}.leaseNamespace"),
                    format!("{why} (expected e.g. kube-system)"),
                ));
            }
            if self.lease_ttl <= self.interval || self.lease_ttl < Duration::from_secs(1) {
                errors.push(section::ConfigError::new(
                    format!("{path}.leaseTTL"),
                    format!(
                        "{} must be at least 1s and longer than interval {}, or members expire \
                         between renewals (upstream: 15s with a 10s interval)",
                        format_duration(self.lease_ttl),
                        format_duration(self.interval)
                    ),
                ));
            }
        }
        if probes {
            self.validate_probing(path, errors);
        }
        if mode == EndpointsMode::Static {
            if self.static_addresses.is_empty() {
                errors.push(section::ConfigError::new(
                    format!("{path}.staticAddresses"),
                    "endpointReconcilerType static needs at least one IP address or DNS name",
                ));
            }
            for (index, entry) in self.static_addresses.iter().enumerate() {
                if let Err(why) = StaticAddress::parse(entry) {
                    errors.push(section::ConfigError::new(
                        format!("{path}.staticAddresses[{index}]"),
                        why,
                    ));
                }
            }
        }
    }

    /// The loops of the mode: `lease` gives `apiserver-lease`, on every replica, and
    /// `apiserver-endpoints`, on the leader; `static` gives `apiserver-endpoints`, and
    /// `master-count` gives it on every replica, as upstream; `none` gives nothing.
    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let settings = context.settings;
        let Some(mode) = self.mode else {
            tracing::info!("{ENDPOINTS_UNNAMED}");
            return Ok(Vec::new());
        };
        if mode == EndpointsMode::None {
            return Ok(Vec::new());
        }
        let address = self.advertise_address(settings);
        if matches!(mode, EndpointsMode::Lease | EndpointsMode::MasterCount) && address.is_none() {
            // Validation refuses this; reported, never a panic.
            return Err(format!(
                "advertiseAddress: not set and this host has no default route to take it from; \
                 endpoint reconciler {} needs the apiserver's address",
                mode.as_str()
            )
            .into());
        }
        if let Some(address) = address {
            tracing::info!(%address, mode = mode.as_str(), "apiserver endpoints: this instance's address");
        }
        // The local apiserver's readiness: `/readyz` (or the configured path) through the
        // client, or a full URL with the kubeconfig's CA and credentials.
        let url = self.readyz_url.as_str();
        let full_url = url.starts_with("http://") || url.starts_with("https://");
        let timeout = self.interval.min(Duration::from_secs(5));
        let readiness: Arc<dyn ReadinessProbe> = if full_url {
            Arc::new(LazyUrlReadyz::new(
                url,
                timeout,
                context.load_kubeconfig.clone(),
            ))
        } else {
            let path = if url.is_empty() { "/readyz" } else { url };
            Arc::new(ApiserverReadyz::new(context.client.clone(), path, timeout))
        };
        let deps = EndpointsDeps {
            client: context.client.clone(),
            shutdown: Arc::new(ShutdownGate::new(self, readiness.clone())),
            readiness,
            resolver: Arc::new(SystemResolver),
            reporter: context.settings.reporter(),
            service: context.kubernetes_service.clone(),
            budget: context.budget.clone(),
            probed: Some(ProbedServer {
                url: full_url.then(|| url.to_owned()),
                load: context.load_kubeconfig.clone(),
                checked: Arc::default(),
            }),
        };
        deps.shutdown.register(context.registry);
        let mut loops: Vec<Arc<dyn Reconciler>> = Vec::new();
        if mode == EndpointsMode::Lease
            && let Some(lease_loop) =
                ApiserverLeaseLoop::new(self, settings, deps.clone(), context.registry)
        {
            loops.push(Arc::new(lease_loop));
        }
        loops.push(Arc::new(ApiserverEndpointsLoop::new(
            self,
            settings,
            deps,
            context.registry,
        )));
        Ok(loops)
    }
}

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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const PATH: &str = "loops.apiserverEndpoints";

    /// An advertised address.
    fn settings() -> Settings {
        Settings {
            advertise_address: Some("192.0.2.1".parse().unwrap()),
            ..crate::section::test_settings()
        }
    }

    fn mode(mode: EndpointsMode) -> Section {
        Section {
            mode: Some(mode),
            ..Section::default()
        }
    }

    fn fields(section: &Section, settings: &Settings) -> Vec<String> {
        let mut errors = Vec::new();
        section.validate(PATH, settings, &mut errors);
        errors.into_iter().map(|error| error.field).collect()
    }

    #[test]
    fn the_defaults_with_an_address_are_valid() {
        assert_eq!(
            fields(&mode(EndpointsMode::Lease), &settings()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn ttl_must_exceed_interval() {
        let section = Section {
            lease_ttl: Duration::from_secs(10),
            ..mode(EndpointsMode::Lease)
        };
        assert_eq!(
            fields(&section, &settings()),
            ["loops.apiserverEndpoints.leaseTTL"]
        );
    }

    #[test]
    fn static_entries_are_ips_or_names() {
        assert_eq!(
            StaticAddress::parse("192.0.2.1"),
            Ok(StaticAddress::Ip("192.0.2.1".parse().unwrap()))
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
        let section = Section {
            static_addresses: vec!["192.0.2.1".into(), "bad name".into()],
            ..mode(EndpointsMode::Static)
        };
        assert_eq!(
            fields(&section, &settings()),
            ["loops.apiserverEndpoints.staticAddresses[1]"]
        );
        assert_eq!(
            section.static_entries(),
            [StaticAddress::Ip("192.0.2.1".parse().unwrap())]
        );
        let empty = Section {
            static_addresses: vec![],
            ..section
        };
        assert_eq!(
            fields(&empty, &settings()),
            ["loops.apiserverEndpoints.staticAddresses"]
        );
    }

    #[test]
    fn none_mode_needs_nothing() {
        let none = Settings {
            advertise_address: None,
            ..settings()
        };
        let section = Section {
            lease_ttl: Duration::from_secs(1),
            shutdown_probes: 0,
            ..mode(EndpointsMode::None)
        };
        assert_eq!(fields(&section, &none), Vec::<String>::new());
    }
}

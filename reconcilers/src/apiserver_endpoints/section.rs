//! `loops.apiserverEndpoints`: the section of the configuration file, and the one configuration
//! both endpoint loops are built from (with the top-level settings: the Service range,
//! `securePort`, `advertiseAddress`, `endpointReconcilerType`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::members;
use super::plan::EndpointsTarget;
use super::probe::{
    ApiserverReadyz, LazyUrlReadyz, ProbedServer, ReadinessProbe, SystemResolver,
    default_route_address,
};
use super::shutdown::{OnShutdown, ShutdownGate, ShutdownProbing};
use super::{EndpointsDeps, build_loops};
use crate::alloc::IpFamily;
use crate::contract::Reconciler;
use crate::names::validate_dns1123_label;
use crate::section::{
    self, BuildContext, BuildError, EndpointsMode, LoopSection, Settings, duration_format,
    format_duration, validate_interval,
};

/// Configuration of both endpoint loops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiserverEndpointsConfig {
    pub mode: EndpointsMode,
    /// Service namespace/name, `--secure-port`, primary family.
    pub target: EndpointsTarget,
    /// This instance's apiserver address (`--advertise-address`). Required for `lease` and
    /// `master-count`.
    pub advertise_address: Option<IpAddr>,
    /// `advertise_address` was taken from the default route, not configured (for messages).
    pub advertise_address_defaulted: bool,
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
    /// What a graceful stop does with this instance's membership (`lease` and `master-count`).
    pub shutdown: ShutdownProbing,
    /// Failed readiness probes in a row that withdraw this instance (`lease` and `master-count`).
    pub readiness_failure_threshold: u32,
    /// `lease` mode: check that the probed apiserver's serving certificate names the advertised
    /// address.
    pub check_serving_certificate: bool,
    /// Write the `kubernetes` Endpoints as well as its EndpointSlice (`false`: slices only).
    pub write_endpoints: bool,
    /// Name the other writer of an object a pass repairs (event, log, metric).
    pub name_conflicting_writers: bool,
    /// `lease` mode: an address another instance also renews is left to Lease expiry, never
    /// withdrawn by this one.
    pub keep_shared_address: bool,
}

impl Default for ApiserverEndpointsConfig {
    fn default() -> Self {
        Self {
            mode: EndpointsMode::Lease,
            target: EndpointsTarget::default(),
            advertise_address: None,
            advertise_address_defaulted: false,
            interval: Duration::from_secs(10),
            lease_namespace: "kube-system".to_owned(),
            lease_ttl: Duration::from_secs(15),
            identity: String::new(),
            static_addresses: Vec::new(),
            apiserver_count: 1,
            leader_lease: None,
            shutdown: ShutdownProbing::default(),
            readiness_failure_threshold: 3,
            check_serving_certificate: true,
            write_endpoints: true,
            name_conflicting_writers: true,
            keep_shared_address: true,
        }
    }
}

/// `loops.apiserverEndpoints`: the `kubernetes` Endpoints and EndpointSlices. The mode is
/// `endpointReconcilerType`; the address `advertiseAddress`, the port `securePort`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
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
        let defaults = ApiserverEndpointsConfig::default();
        Section {
            enabled: true,
            interval: defaults.interval,
            lease_namespace: defaults.lease_namespace,
            lease_ttl: defaults.lease_ttl,
            readyz_url: String::new(),
            static_addresses: Vec::new(),
            on_shutdown: defaults.shutdown.policy,
            shutdown_probes: defaults.shutdown.probes,
            shutdown_probe_window: defaults.shutdown.window,
            readiness_failure_threshold: defaults.readiness_failure_threshold,
            check_serving_certificate: defaults.check_serving_certificate,
            write_endpoints: defaults.write_endpoints,
            name_conflicting_writers: defaults.name_conflicting_writers,
            keep_shared_address: defaults.keep_shared_address,
        }
    }
}

impl Section {
    /// `advertiseAddress`, else the default-route address of the primary range's family (what
    /// kube-apiserver does when `--advertise-address` is unset).
    pub fn advertise_address(&self, settings: &Settings) -> Option<IpAddr> {
        settings
            .advertise_address
            .or_else(|| default_route_address(primary_family(settings).unwrap_or(IpFamily::V4)))
    }

    /// Both loops' configuration: this section with the mode, the `kubernetes` Service, the port
    /// and the primary family from `settings`. Public so the demo and tests build members that
    /// match the running controller.
    pub fn loop_config(&self, settings: &Settings) -> ApiserverEndpointsConfig {
        ApiserverEndpointsConfig {
            mode: settings.endpoint_mode,
            target: EndpointsTarget {
                namespace: settings.kubernetes_service.namespace.clone(),
                service_name: settings.kubernetes_service.name.clone(),
                port: i32::from(settings.secure_port),
                primary_family: primary_family(settings),
            },
            advertise_address: self.advertise_address(settings),
            advertise_address_defaulted: settings.advertise_address.is_none(),
            interval: self.interval,
            lease_namespace: self.lease_namespace.clone(),
            lease_ttl: self.lease_ttl,
            identity: settings.identity.clone(),
            static_addresses: self.static_addresses.clone(),
            apiserver_count: usize::try_from(settings.apiserver_count).unwrap_or(usize::MAX),
            leader_lease: settings.leader_lease.clone(),
            shutdown: ShutdownProbing {
                policy: self.on_shutdown,
                probes: self.shutdown_probes,
                window: self.shutdown_probe_window,
            },
            readiness_failure_threshold: self.readiness_failure_threshold,
            check_serving_certificate: self.check_serving_certificate,
            write_endpoints: self.write_endpoints,
            name_conflicting_writers: self.name_conflicting_writers,
            keep_shared_address: self.keep_shared_address,
        }
    }

    fn validate_fields(
        &self,
        path: &str,
        settings: &Settings,
        errors: &mut Vec<section::ConfigError>,
    ) {
        validate_interval(path, self.interval, errors);
        let mode = settings.endpoint_mode;
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
        if probes && !self.readyz_url.is_empty() {
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
        if probes && !(1..=MAX_SHUTDOWN_PROBES).contains(&self.shutdown_probes) {
            errors.push(section::ConfigError::new(
                format!("{path}.shutdownProbes"),
                format!(
                    "{} is not between 1 and {MAX_SHUTDOWN_PROBES} (default 3: enough to see a \
                     stopping apiserver fail its readiness, few enough to stop quickly)",
                    self.shutdown_probes
                ),
            ));
        }
        if probes
            && !(1..=MAX_READINESS_FAILURE_THRESHOLD).contains(&self.readiness_failure_threshold)
        {
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
        if probes && self.shutdown_probe_window > MAX_SHUTDOWN_PROBE_WINDOW {
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

    /// The local apiserver's readiness: `/readyz` (or the configured path) through the client,
    /// or a full URL with the kubeconfig's CA and credentials.
    fn readiness(&self, context: &BuildContext<'_>) -> Arc<dyn ReadinessProbe> {
        let timeout = self.interval.min(Duration::from_secs(5));
        let url = self.readyz_url.as_str();
        if url.starts_with("http://") || url.starts_with("https://") {
            Arc::new(LazyUrlReadyz::new(
                url,
                timeout,
                context.load_kubeconfig.clone(),
            ))
        } else {
            let path = if url.is_empty() { "/readyz" } else { url };
            Arc::new(ApiserverReadyz::new(context.client.clone(), path, timeout))
        }
    }
}

/// Bounds of the shutdown probing: it delays the stop by about the window, inside the runner's
/// `shutdownTimeout` (default 30 s) and a pod's grace period (default 30 s).
const MAX_SHUTDOWN_PROBES: u32 = 10;
const MAX_SHUTDOWN_PROBE_WINDOW: Duration = Duration::from_secs(10);
/// Past this, a dead apiserver stays listed too long (each failure below the threshold is
/// re-probed within a second, plus the probe's own timeout of up to 5 s).
const MAX_READINESS_FAILURE_THRESHOLD: u32 = 10;

fn primary_family(settings: &Settings) -> Option<IpFamily> {
    settings.service_ranges.first().map(|net| match net {
        ipnet::IpNet::V4(_) => IpFamily::V4,
        ipnet::IpNet::V6(_) => IpFamily::V6,
    })
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, settings: &Settings, errors: &mut Vec<section::ConfigError>) {
        let before = errors.len();
        self.validate_fields(path, settings, errors);
        // The loops' own validation (e.g. a loopback advertiseAddress) catches what the field
        // checks above do not; without this the loops would be skipped at start-up instead.
        if self.enabled
            && errors.len() == before
            && let Err(err) = self.loop_config(settings).validate()
        {
            let field = match err.field.as_str() {
                "advertiseAddress" | "securePort" | "apiserverCount" => err.field.clone(),
                "lease.namespace" => format!("{path}.leaseNamespace"),
                "lease.ttl" => format!("{path}.leaseTTL"),
                "static.addresses" => format!("{path}.staticAddresses"),
                "service" => "loops.kubernetesService.name".to_owned(),
                other => format!("{path}.{other}"),
            };
            errors.push(section::ConfigError::new(field, err.message));
        }
    }

    /// `apiserver-lease` on every replica and `apiserver-endpoints` on the leader (on every
    /// replica in master-count mode, as upstream), as [`build_loops`] says.
    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let config = self.loop_config(context.settings);
        config.validate()?;
        if let Some(address) = config.advertise_address {
            tracing::info!(%address, mode = config.mode.as_str(), "apiserver endpoints: this instance's address");
        }
        let readiness = self.readiness(context);
        let deps = EndpointsDeps {
            client: context.client.clone(),
            shutdown: Arc::new(ShutdownGate::new(config.shutdown, readiness.clone())),
            readiness,
            resolver: Arc::new(SystemResolver),
            reporter: context.settings.reporter(),
            probed: Some(ProbedServer {
                url: Some(self.readyz_url.clone())
                    .filter(|url| url.starts_with("http://") || url.starts_with("https://")),
                load: context.load_kubeconfig.clone(),
            }),
        };
        Ok(build_loops(&config, deps, context.registry)
            .into_iter()
            .map(Arc::from)
            .collect())
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

impl ApiserverEndpointsConfig {
    /// Fields are named relative to the loop's section (`lease.ttl`) or as in the file's top
    /// level (`advertiseAddress`); the section's validation maps them to YAML paths.
    pub fn validate(&self) -> Result<(), section::ConfigError> {
        let err = |field: &str, message: String| Err(section::ConfigError::new(field, message));
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
                    && IpFamily::of(address) != primary
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
                        return err("static.addresses", format!("entry {i}: {message}"));
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
    }
}

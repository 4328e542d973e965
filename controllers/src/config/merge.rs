//! Merging flags over the file over the defaults, and validating the result.

use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use reconcilers::alloc::{IpFamily, PortRange};
use reconcilers::apiserver_endpoints::EndpointsMode;
use reconcilers::legacy_alloc::etcd::{DEFAULT_PREFIX, EtcdConfig};
use reconcilers::names::{validate_dns1123_label, validate_dns1123_subdomain};
use reconcilers::section::{ConfigError, DurationError, Settings, format_duration};

use super::file::{locate, parse_file_all, read_text};
use super::settings::{ConfigArgs, FileConfig, Given, Source, check_name, items, valid};
use super::tenant::merge_tenants;
use super::values::{NotANumber, parse_service_cidrs};
use super::{Config, ConfigErrors, LeaderElection};

/// The `--etcd-*` settings, validated: servers are http(s) URLs, a client certificate comes with
/// its key, the files are readable, and nothing but the servers turns etcd mode on.
pub(super) fn merge_etcd(given: Given, errors: &mut Vec<ConfigError>) -> EtcdConfig {
    let servers_source = given.etcd_servers;
    let servers = servers_source.as_ref().map_or_else(Vec::new, |source| {
        items(source, errors, |server| {
            let url = server.parse::<http::Uri>().is_ok_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some()
            });
            if url {
                Ok(server.to_owned())
            } else {
                Err(format!(
                    "{server:?} is not an etcd URL (expected e.g. https://192.0.2.1:2379)"
                ))
            }
        })
    });
    let mut path = |source: Option<Source<PathBuf>>| {
        let source = source?;
        if servers_source.is_none() {
            errors.push(ConfigError::new(
                source.field,
                "is only used in etcd mode: set --etcd-servers too, or remove it",
            ));
        } else if let Err(err) = std::fs::File::open(&source.value) {
            errors.push(ConfigError::new(
                source.field,
                format!("cannot read {}: {err}", source.value.display()),
            ));
        }
        Some(source)
    };
    let ca_file = path(given.etcd_cafile);
    let cert_file = path(given.etcd_certfile);
    let key_file = path(given.etcd_keyfile);
    match (&cert_file, &key_file) {
        (Some(cert), None) => errors.push(ConfigError::new(
            cert.field,
            "needs --etcd-keyfile (etcdKeyFile) too: a client certificate goes with its key",
        )),
        (None, Some(key)) => errors.push(ConfigError::new(
            key.field,
            "needs --etcd-certfile (etcdCertFile) too: a client key goes with its certificate",
        )),
        _ => {}
    }
    let prefix = match given.etcd_prefix {
        Some(source) if !source.value.starts_with('/') => {
            errors.push(ConfigError::new(
                source.field,
                format!(
                    "{:?} must start with / (kube-apiserver's default is {DEFAULT_PREFIX})",
                    source.value
                ),
            ));
            source.value
        }
        Some(source) => source.value,
        None => DEFAULT_PREFIX.to_owned(),
    };
    EtcdConfig {
        servers,
        ca_file: ca_file.map(|source| source.value),
        cert_file: cert_file.map(|source| source.value),
        key_file: key_file.map(|source| source.value),
        prefix,
        inline_tls: None,
        pin: None,
    }
}

impl Config {
    /// Reads `--config` (if any), merges it with the flags and the defaults, and validates.
    pub fn load(args: &ConfigArgs) -> Result<Config, ConfigErrors> {
        match &args.config {
            Some(path) => Config::load_text(args, &read_text(path)?, Some(path)),
            None => Config::merge(args, FileConfig::default()),
        }
    }

    /// [`Config::load`] of `text` as the `--config` file (`path`, named in messages): every
    /// problem of the file and of the merged settings at once, each of the file's with the line
    /// of its key. A setting left out of the file because its value is wrong is not reported
    /// again by the checks that follow.
    pub fn load_text(
        args: &ConfigArgs,
        text: &str,
        path: Option<&Path>,
    ) -> Result<Config, ConfigErrors> {
        let (file, mut errors) = parse_file_all(text);
        if let Some(path) = path {
            for error in &mut errors {
                error.message = format!("{} (in {})", error.message, path.display());
            }
        }
        let reported: Vec<String> = errors.iter().map(|error| error.field.clone()).collect();
        let merged = file.map(|file| Config::merge(args, file));
        let config = match merged {
            Some(Ok(config)) => Some(config),
            Some(Err(more)) => {
                for mut error in more.0 {
                    let covered = reported.iter().any(|field| {
                        error
                            .field
                            .strip_prefix(field.as_str())
                            .is_some_and(|rest| {
                                rest.is_empty() || rest.starts_with('.') || rest.starts_with('[')
                            })
                    });
                    if covered {
                        continue;
                    }
                    let from_file = !error.field.starts_with('-')
                        && !error.field.starts_with(super::ENV_PREFIX)
                        && !error.message.starts_with("line ");
                    if from_file && let Some(line) = locate(text, &error.field) {
                        error.message = format!("line {line}: {}", error.message);
                    }
                    errors.push(error);
                }
                None
            }
            None => None,
        };
        match config {
            Some(config) if errors.is_empty() => Ok(config),
            _ => Err(ConfigErrors(errors)),
        }
    }

    /// Merges flags over a parsed file over defaults, and validates the result.
    pub fn merge(args: &ConfigArgs, file: FileConfig) -> Result<Config, ConfigErrors> {
        let mut errors = Vec::new();
        let mut given = Given::new(args, &file);

        let service_cluster_ip_range = given
            .service_cluster_ip_range
            .take()
            .and_then(|source| parsed(source, parse_service_cidrs, &mut errors))
            .unwrap_or_default();
        let service_node_port_range = given
            .service_node_port_range
            .take()
            .and_then(|source| parsed(source, |text| text.parse::<PortRange>(), &mut errors))
            .unwrap_or_default();

        let mut loops = file.loops.clone().unwrap_or_default();
        let advertise_address = merge_endpoints(
            &mut given,
            service_cluster_ip_range.first(),
            &mut loops.apiserver_endpoints,
            &mut errors,
        );
        let secure_port = given
            .secure_port
            .take()
            .and_then(|source| secure_port(source, &mut errors));
        let kubernetes_service_node_port =
            given
                .kubernetes_service_node_port
                .take()
                .and_then(|source| {
                    kubernetes_service_node_port(source, service_node_port_range, &mut errors)
                });
        let admin_addr = given
            .admin_addr
            .take()
            .map_or_else(default_admin_addr, |source| admin_addr(source, &mut errors));
        let shutdown_timeout = given
            .shutdown_timeout
            .take()
            .and_then(|source| positive_duration(source.field, source.value, &mut errors))
            .unwrap_or_else(default_shutdown_timeout);

        let identity_field = given
            .leader_elect_identity
            .as_ref()
            .map_or("--leader-elect-identity", |source| source.field);
        let leader_election = merge_leader_election(&mut given, &mut errors);

        let kubeconfig = given.kubeconfig.take().map(|source| source.value);
        let dry_run = valid(given.dry_run.take(), &mut errors).is_some_and(|source| source.value);
        let timer_only =
            valid(given.timer_only.take(), &mut errors).is_some_and(|source| source.value);
        let log_format = given
            .log_format
            .take()
            .map(|source| source.value)
            .unwrap_or_default();
        let tenants = merge_tenants(&mut given, args, &file, &mut errors);
        let etcd = merge_etcd(given, &mut errors);

        let mut config = Config {
            settings: Settings {
                service_ranges: service_cluster_ip_range,
                node_port_range: service_node_port_range,
                advertise_address,
                secure_port,
                kubernetes_service_node_port,
                etcd,
                identity: String::new(),
            },
            kubeconfig,
            dry_run,
            timer_only,
            admin_addr,
            log_format,
            shutdown_timeout,
            leader_election,
            tenants,
            loops,
        };
        config.settings.identity = config.identity();
        check_identity(&config.settings.identity, identity_field, &mut errors);
        // The loops' sections validate against the settings of the effective configuration.
        config.loops.validate(&config.settings, &mut errors);

        if errors.is_empty() {
            Ok(config)
        } else {
            Err(ConfigErrors(errors))
        }
    }

    /// The effective configuration as YAML, in the shape `--config` accepts.
    pub fn to_yaml(&self) -> Result<String, serde_saphyr::SerializeError> {
        serde_saphyr::to_string(self)
    }

    /// The leader election as this replica joins it (the single cluster's election, or the
    /// replica group of management mode): its identity is the effective one, never the empty
    /// "derive one" the configuration may hold.
    pub fn election(&self) -> LeaderElection {
        LeaderElection {
            identity: self.settings.identity.clone(),
            ..self.leader_election.clone()
        }
    }

    /// This instance's identity (leader-election holder, membership Lease holder, event
    /// reporter): the configured one, else one derived from the host name, the advertise address
    /// and the admin address (see [`derived_identity`]).
    ///
    /// The derived identity is computed once per process, from the first configuration merged
    /// (the process's own, before any tenant's), so every configuration agrees on it.
    fn identity(&self) -> String {
        if !self.leader_election.identity.is_empty() {
            return self.leader_election.identity.clone();
        }
        static DERIVED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        DERIVED
            .get_or_init(|| {
                derived_identity(
                    host_name().as_deref(),
                    self.settings.advertise_address,
                    self.admin_addr,
                )
            })
            .clone()
    }
}

/// The most an event's `reportingInstance` holds: this replica's identity names it in every
/// event, which the API refuses beyond it.
const MAX_IDENTITY_BYTES: usize = 128;

/// The effective identity (`field`'s, or the one derived when none is given) fits an event.
fn check_identity(identity: &str, field: &'static str, errors: &mut Vec<ConfigError>) {
    if identity.len() > MAX_IDENTITY_BYTES {
        errors.push(ConfigError::new(
            field,
            format!(
                "the identity {identity:?} is {} bytes long, more than the \
                 {MAX_IDENTITY_BYTES} an event's reportingInstance holds: set \
                 --leader-elect-identity (leaderElection.identity) to a shorter one (e.g. the \
                 pod name)",
                identity.len()
            ),
        ));
    }
}

/// `$POD_NAME`, else `$HOSTNAME`, else `/etc/hostname`: who this replica is, for humans.
pub fn host_name() -> Option<String> {
    std::env::var("POD_NAME")
        .ok()
        .filter(|name| !name.is_empty())
        .or_else(|| {
            std::env::var("HOSTNAME")
                .ok()
                .filter(|name| !name.is_empty())
        })
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|name| name.trim().to_owned())
                .filter(|name| !name.is_empty())
        })
}

/// `HOST_HASH`: the host name (for humans) and a stable hash of the advertise and admin
/// addresses. The same instance restarted (same host, same addresses) is the same identity, so
/// it never finds its own membership Lease "shared" with its previous life; two instances on one
/// host differ, since two processes cannot listen on one admin address, nor would they advertise
/// one address by design. The hash is the replica Leases' stable one, so builds agree.
pub fn derived_identity(
    host: Option<&str>,
    advertise_address: Option<IpAddr>,
    admin_addr: SocketAddr,
) -> String {
    let base = host.unwrap_or("bootstrap-controller");
    let advertise = advertise_address
        .map(|ip| ip.to_string())
        .unwrap_or_default();
    let suffix = crate::shards::hash_suffix(&format!("{advertise}\n{admin_addr}"));
    format!("{base}_{suffix}")
}

pub(super) fn default_admin_addr() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}

pub(super) fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}

/// The `--leader-elect-*` settings over their defaults, validated when leader election is on.
/// The defaults are valid, so an error names a setting that was given.
pub(super) fn merge_leader_election(
    given: &mut Given,
    errors: &mut Vec<ConfigError>,
) -> LeaderElection {
    let defaults = LeaderElection::default();
    let lease_name = given.leader_elect_lease_name.take();
    let lease_namespace = given.leader_elect_lease_namespace.take();
    // A duration that does not parse is reported here and left at its default, so the checks
    // below do not report it again.
    let lease_duration = valid(given.leader_elect_lease_duration.take(), errors);
    let renew_grace = valid(given.leader_elect_renew_grace.take(), errors);
    let enabled =
        valid(given.leader_elect.take(), errors).map_or(defaults.enabled, |source| source.value);
    let election = LeaderElection {
        enabled,
        lease_name: lease_name
            .as_ref()
            .map_or(defaults.lease_name, |source| source.value.clone()),
        lease_namespace: lease_namespace
            .as_ref()
            .map_or(defaults.lease_namespace, |source| source.value.clone()),
        identity: given
            .leader_elect_identity
            .take()
            .map_or(defaults.identity, |source| source.value),
        lease_duration: lease_duration
            .as_ref()
            .map_or(defaults.lease_duration, |source| source.value),
        renew_grace: renew_grace
            .as_ref()
            .map_or(defaults.renew_grace, |source| source.value),
    };
    if election.enabled {
        if let Some(source) = &lease_name {
            let example = "expected e.g. bootstrap-controller";
            check_name(source, validate_dns1123_subdomain, "Lease", example, errors);
        }
        if let Some(source) = &lease_namespace {
            let example = "expected e.g. kube-system";
            check_name(source, validate_dns1123_label, "namespace", example, errors);
        }
        check_lease_durations(
            &election,
            lease_duration.as_ref(),
            renew_grace.as_ref(),
            errors,
        );
    }
    election
}

/// The lease duration and the renew grace, together: a grace shorter than the duration.
fn check_lease_durations(
    election: &LeaderElection,
    lease_duration: Option<&Source<Duration>>,
    renew_grace: Option<&Source<Duration>>,
    errors: &mut Vec<ConfigError>,
) {
    // A Lease holds whole seconds (leaseDurationSeconds): a fraction would be dropped from what
    // the standbys wait, not from how long the leader leads.
    let refused = lease_duration.and_then(|source| {
        let why = match source.value {
            short if short.as_secs() < 2 => "must be at least 2s (e.g. 15s)",
            fraction if fraction.subsec_nanos() != 0 => {
                "must be whole seconds (e.g. 15s): a Lease holds whole seconds"
            }
            _ => return None,
        };
        Some(ConfigError::new(source.field, why))
    });
    if let Some(refused) = refused {
        errors.push(refused);
    } else if election.renew_grace.as_secs() < 1 || election.renew_grace >= election.lease_duration
    {
        match (renew_grace, lease_duration) {
            (Some(grace), _) => errors.push(ConfigError::new(
                grace.field,
                format!(
                    "must be at least 1s and shorter than the lease duration ({}) (e.g. 5s with \
                     a 15s lease)",
                    format_duration(election.lease_duration)
                ),
            )),
            // The default grace does not fit the given duration: the duration is what was set.
            (None, Some(duration)) => errors.push(ConfigError::new(
                duration.field,
                format!(
                    "must be longer than the renew grace ({}, its default) (e.g. 15s), or set \
                     a shorter renew grace",
                    format_duration(election.renew_grace)
                ),
            )),
            (None, None) => {}
        }
    }
}

/// `advertiseAddress`: an address the cluster can reach.
fn advertise_address(source: &Source<String>, errors: &mut Vec<ConfigError>) -> Option<IpAddr> {
    let text = source.value.trim();
    let message = match text.parse::<IpAddr>() {
        Ok(ip) if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() => format!(
            "{text:?} cannot be advertised to the cluster (use the apiserver's routable \
             address, e.g. 192.0.2.10)"
        ),
        Ok(ip) => return Some(ip),
        Err(_) => {
            format!("{text:?} is not an IP address (expected e.g. 192.0.2.10 or 2001:db8::10)")
        }
    };
    errors.push(ConfigError::new(source.field, message));
    None
}

/// `securePort`: 1-65535.
fn secure_port(
    source: Source<Result<u32, NotANumber>>,
    errors: &mut Vec<ConfigError>,
) -> Option<u16> {
    let message = match source.value {
        Ok(port @ 1..=65535) => return u16::try_from(port).ok(),
        Ok(port) => format!("{port} is not a valid port (expected 1-65535, e.g. 6443)"),
        Err(NotANumber(text)) => {
            format!("{text:?} is not a port number (expected 1-65535, e.g. 6443)")
        }
    };
    errors.push(ConfigError::new(source.field, message));
    None
}

/// The settings of the `kubernetes` endpoints outside `loops.apiserverEndpoints`: the advertise
/// address (returned), and the mode and `apiserverCount` (set in `endpoints`, the section that
/// holds them), with the address's family checked against the primary service range where
/// endpoints are written.
fn merge_endpoints(
    given: &mut Given,
    primary_range: Option<&ipnet::IpNet>,
    endpoints: &mut reconcilers::apiserver_endpoints::Section,
    errors: &mut Vec<ConfigError>,
) -> Option<IpAddr> {
    let address_source = given.advertise_address.take();
    let address = address_source
        .as_ref()
        .and_then(|source| advertise_address(source, errors));
    endpoints.mode = given
        .endpoint_reconciler_type
        .take()
        .map(|source| source.value);
    endpoints.apiserver_count = given
        .apiserver_count
        .take()
        .map_or(1, |source| apiserver_count(source, errors));
    if endpoints
        .mode
        .is_some_and(|mode| mode != EndpointsMode::None)
    {
        check_advertise_family(address_source.as_ref().zip(address), primary_range, errors);
    }
    address
}

/// A value parsed by `parse`, or `None` after its error, naming where it came from.
fn parsed<T, E: std::fmt::Display>(
    source: Source<String>,
    parse: impl FnOnce(&str) -> Result<T, E>,
    errors: &mut Vec<ConfigError>,
) -> Option<T> {
    parse(&source.value)
        .map_err(|err| errors.push(ConfigError::new(source.field, err.to_string())))
        .ok()
}

/// The public address (as given, and parsed) must be reachable over the primary service family
/// (upstream's validatePublicIPServiceClusterIPRangeIPFamilies), where endpoints are written.
fn check_advertise_family(
    address: Option<(&Source<String>, std::net::IpAddr)>,
    primary: Option<&ipnet::IpNet>,
    errors: &mut Vec<ConfigError>,
) {
    let (Some((source, address)), Some(primary)) = (address, primary) else {
        return;
    };
    if address.is_ipv4() == primary.addr().is_ipv4() {
        return;
    }
    errors.push(ConfigError::new(
        source.field,
        format!(
            "{address} is {} but the primary service range {primary} is {} (advertise an \
             address of the primary range's family, or list the other family's range first)",
            IpFamily::of(address),
            IpFamily::of_net(primary)
        ),
    ));
}

/// `kubernetesServiceNodePort`: 0 (a ClusterIP Service) or a port inside the node port range.
fn kubernetes_service_node_port(
    source: Source<Result<u32, NotANumber>>,
    range: PortRange,
    errors: &mut Vec<ConfigError>,
) -> Option<u16> {
    let message = match source.value {
        Ok(0) => return Some(0),
        Ok(port) => match u16::try_from(port) {
            Ok(port) if range.contains(port) => return Some(port),
            _ => format!(
                "{port} is outside the node port range {range} (use 0 for a ClusterIP Service, \
                 or a port inside --service-node-port-range)"
            ),
        },
        Err(NotANumber(text)) => format!(
            "{text:?} is not a port number (use 0 for a ClusterIP Service, or a port inside \
             {range})"
        ),
    };
    errors.push(ConfigError::new(source.field, message));
    None
}

/// `apiserverCount`: a positive count.
fn apiserver_count(source: Source<Result<i64, NotANumber>>, errors: &mut Vec<ConfigError>) -> u32 {
    let message = match source.value {
        Ok(count) if count > 0 => return u32::try_from(count).unwrap_or(u32::MAX),
        Ok(count) => format!(
            "should be a positive number, but {count} was given (e.g. 3 for three apiservers)"
        ),
        Err(NotANumber(text)) => {
            format!("{text:?} is not a number (expected a positive count, e.g. 3)")
        }
    };
    errors.push(ConfigError::new(source.field, message));
    1
}

/// `adminAddr`: an address and port to listen on.
fn admin_addr(source: Source<String>, errors: &mut Vec<ConfigError>) -> SocketAddr {
    source.value.trim().parse().unwrap_or_else(|_| {
        errors.push(ConfigError::new(
            source.field,
            format!(
                "{:?} is not an address:port (expected e.g. 0.0.0.0:8080 or [::]:8080)",
                source.value
            ),
        ));
        default_admin_addr()
    })
}

/// A duration above zero (`shutdownTimeout`, `check --timeout`), or `None` after its error,
/// naming `field`, is noted.
pub fn positive_duration(
    field: &'static str,
    value: Result<Duration, DurationError>,
    errors: &mut Vec<ConfigError>,
) -> Option<Duration> {
    let message = match value {
        Ok(duration) if !duration.is_zero() => return Some(duration),
        Ok(_) => "must be greater than zero (e.g. 30s)".to_owned(),
        Err(err) => err.to_string(),
    };
    errors.push(ConfigError::new(field, message));
    None
}

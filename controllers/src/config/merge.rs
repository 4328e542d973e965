//! Merging flags over the file over the defaults, and validating the result.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use reconcilers::alloc::IpFamily;
use reconcilers::names::{validate_dns1123_label, validate_dns1123_subdomain};
use reconcilers::section::{
    ConfigError, DurationError, EndpointsMode, ServiceName, Settings, format_duration,
};

use super::file::{locate, parse_file_all, read_text};
use super::settings::{ConfigArgs, FileConfig, Given, Source, TenantBudgetFile};
use super::tenant::{DEFAULT_TENANTS_KUBECONFIG_KEY, TENANT_CONFIG_ANNOTATION, TENANT_ETCD_KEYS};
use super::values::{NotABool, NotANumber, PortRange, parse_port_range, parse_service_cidrs};
use super::{
    Config, ConfigErrors, DEFAULT_TENANTS_CACHE_MAX_MIB, DEFAULT_TENANTS_CACHE_MAX_OBJECTS,
    DEFAULT_TENANTS_CACHE_TOTAL_MIB, LeaderElection, TenantBudget, Tenants,
};

/// The `--etcd-*` settings, validated: servers are http(s) URLs, a client certificate comes with
/// its key, the files are readable, and nothing but the servers turns etcd mode on.
pub(super) fn merge_etcd(
    given: Given,
    errors: &mut Vec<ConfigError>,
) -> reconcilers::legacy_alloc::etcd::EtcdConfig {
    let servers_source = given.etcd_servers;
    let mut servers = Vec::new();
    if let Some(source) = &servers_source {
        for server in source
            .value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            let valid = server.parse::<http::Uri>().is_ok_and(|uri| {
                matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some()
            });
            if valid {
                servers.push(server.to_owned());
            } else {
                errors.push(ConfigError::new(
                    source.field,
                    format!("{server:?} is not an etcd URL (expected e.g. https://192.0.2.1:2379)"),
                ));
            }
        }
    }
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
                    "{:?} must start with / (kube-apiserver's default is /registry)",
                    source.value
                ),
            ));
            source.value
        }
        Some(source) => source.value,
        None => "/registry".to_owned(),
    };
    reconcilers::legacy_alloc::etcd::EtcdConfig {
        servers,
        ca_file: ca_file.map(|source| source.value),
        cert_file: cert_file.map(|source| source.value),
        key_file: key_file.map(|source| source.value),
        prefix,
        inline_tls: None,
        pin: None,
    }
}

/// In management mode every tenant has its own etcd (servers and prefix in its annotation,
/// credentials in its Secret): one process-wide etcd would be shared by every tenant, each
/// repairing the others' bitmaps with its own cluster's Services.
pub(super) fn refuse_process_etcd(
    args: &ConfigArgs,
    file: &FileConfig,
    errors: &mut Vec<ConfigError>,
) {
    let set = [
        (args.etcd_servers.is_some(), "--etcd-servers"),
        (args.etcd_prefix.is_some(), "--etcd-prefix"),
        (args.etcd_cafile.is_some(), "--etcd-cafile"),
        (args.etcd_certfile.is_some(), "--etcd-certfile"),
        (args.etcd_keyfile.is_some(), "--etcd-keyfile"),
        (file.etcd_servers.is_some(), "etcdServers"),
        (file.etcd_prefix.is_some(), "etcdPrefix"),
        (file.etcd_cafile.is_some(), "etcdCAFile"),
        (file.etcd_certfile.is_some(), "etcdCertFile"),
        (file.etcd_keyfile.is_some(), "etcdKeyFile"),
    ];
    for (_, field) in set.into_iter().filter(|(given, _)| *given) {
        errors.push(ConfigError::new(
            field,
            format!(
                "is not used in management mode: each tenant's etcd is its own (etcdServers and \
                 etcdPrefix in its Secret's {TENANT_CONFIG_ANNOTATION} annotation, the client \
                 certificate in its data keys {}, {}, {}); remove it",
                TENANT_ETCD_KEYS.ca, TENANT_ETCD_KEYS.cert, TENANT_ETCD_KEYS.key
            ),
        ));
    }
}

impl Config {
    /// etcd mode's settings, when `--etcd-servers` is set.
    pub fn etcd(&self) -> Option<reconcilers::legacy_alloc::etcd::EtcdConfig> {
        (!self.etcd_servers.is_empty()).then(|| reconcilers::legacy_alloc::etcd::EtcdConfig {
            servers: self.etcd_servers.clone(),
            ca_file: self.etcd_ca_file.clone(),
            cert_file: self.etcd_cert_file.clone(),
            key_file: self.etcd_key_file.clone(),
            prefix: self.etcd_prefix.clone(),
            inline_tls: self.etcd_inline_tls.clone(),
            pin: self.etcd_pin.clone(),
        })
    }

    /// The endpoints' mode the loops follow: the one named, else `none`.
    pub fn endpoint_mode(&self) -> EndpointsMode {
        self.endpoint_reconciler_type.unwrap_or(EndpointsMode::None)
    }

    /// What the loops read outside their own sections.
    pub fn settings(&self) -> Settings {
        Settings {
            service_ranges: self.service_cluster_ip_range.clone(),
            node_port_range: self.service_node_port_range.base..=self.service_node_port_range.last,
            secure_port: self.secure_port,
            kubernetes_service_node_port: (self.kubernetes_service_node_port != 0)
                .then_some(self.kubernetes_service_node_port),
            advertise_address: self.advertise_address,
            endpoint_mode: self.endpoint_mode(),
            apiserver_count: self.apiserver_count,
            kubernetes_service: ServiceName {
                namespace: self.loops.kubernetes_service.namespace.clone(),
                name: self.loops.kubernetes_service.name.clone(),
            },
            identity: self.leader_identity(),
            leader_lease: self.leader_election.enabled.then(|| {
                (
                    self.leader_election.lease_namespace.clone(),
                    self.leader_election.lease_name.clone(),
                )
            }),
            etcd: self.etcd(),
            cache_budget: reconcilers::budget::CacheBudget::default(),
        }
    }

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

        let service_cluster_ip_range = match given.service_cluster_ip_range.take() {
            Some(source) => parse_service_cidrs(&source.value)
                .map_err(|message| errors.push(ConfigError::new(source.field, message)))
                .unwrap_or_default(),
            None => Vec::new(),
        };

        let service_node_port_range = match given.service_node_port_range.take() {
            Some(source) => parse_port_range(&source.value)
                .map_err(|err| errors.push(ConfigError::new(source.field, err.to_string())))
                .unwrap_or_default(),
            None => PortRange::default(),
        };

        let advertise_address_source = given.advertise_address.take();
        let advertise_address = advertise_address_source
            .as_ref()
            .and_then(|source| advertise_address(source, &mut errors));
        let secure_port = given
            .secure_port
            .take()
            .and_then(|source| secure_port(source, &mut errors));
        let kubernetes_service_node_port = given
            .kubernetes_service_node_port
            .take()
            .map_or(0, |source| {
                kubernetes_service_node_port(source, service_node_port_range, &mut errors)
            });
        let endpoint_reconciler_type = given
            .endpoint_reconciler_type
            .take()
            .map(|source| source.value);
        let apiserver_count = given
            .apiserver_count
            .take()
            .map_or(1, |source| apiserver_count(source, &mut errors));
        // The public address must be reachable over the primary service family (upstream's
        // validatePublicIPServiceClusterIPRangeIPFamilies), unless no endpoints are written.
        if let (Some(address), Some(primary), Some(source)) = (
            advertise_address,
            service_cluster_ip_range.first(),
            advertise_address_source.as_ref(),
        ) && endpoint_reconciler_type.is_some_and(|mode| mode != EndpointsMode::None)
            && address.is_ipv4() != primary.addr().is_ipv4()
        {
            errors.push(ConfigError::new(
                source.field,
                format!(
                    "{address} is {} but the primary service range {primary} is {} (advertise \
                     an address of the primary range's family, or list the other family's range \
                     first)",
                    IpFamily::of(address),
                    IpFamily::of_net(primary)
                ),
            ));
        }
        let admin_addr = given
            .admin_addr
            .take()
            .map_or_else(default_admin_addr, |source| admin_addr(source, &mut errors));
        let shutdown_timeout = given
            .shutdown_timeout
            .take()
            .map_or_else(default_shutdown_timeout, |source| {
                shutdown_timeout(source, &mut errors)
            });

        let leader_election = merge_leader_election(&mut given, &mut errors);

        let kubeconfig = given.kubeconfig.take().map(|source| source.value);
        let dry_run = boolean(given.dry_run.take(), false, &mut errors);
        let timer_only = boolean(given.timer_only.take(), false, &mut errors);
        let log_format = given
            .log_format
            .take()
            .map(|source| source.value)
            .unwrap_or_default();
        let budgets = file.tenants.as_ref().and_then(|t| t.cache_budgets.as_ref());
        let tenants = merge_tenants(&mut given, budgets, &mut errors);
        let etcd = merge_etcd(given, &mut errors);
        if tenants.is_some() {
            refuse_process_etcd(args, &file, &mut errors);
        }

        let config = Config {
            service_cluster_ip_range,
            service_node_port_range,
            advertise_address,
            secure_port,
            kubernetes_service_node_port,
            endpoint_reconciler_type,
            apiserver_count,
            kubeconfig,
            etcd_servers: etcd.servers,
            etcd_ca_file: etcd.ca_file,
            etcd_cert_file: etcd.cert_file,
            etcd_key_file: etcd.key_file,
            etcd_prefix: etcd.prefix,
            etcd_inline_tls: None,
            etcd_pin: None,
            dry_run,
            timer_only,
            admin_addr,
            log_format,
            shutdown_timeout,
            leader_election,
            tenants,
            loops: file.loops.clone().unwrap_or_default(),
        };
        // Sections validate against the settings of the effective configuration.
        config.loops.validate(&config.settings(), &mut errors);

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

    /// This instance's identity (leader-election holder, membership Lease holder, event
    /// reporter): the configured one, else one derived from the host name, the advertise address
    /// and the admin address (see [`derived_identity`]).
    ///
    /// The derived identity is computed once per process, from the first configuration asked
    /// (the process's own, before any tenant's), so every caller agrees on it.
    pub fn leader_identity(&self) -> String {
        if !self.leader_election.identity.is_empty() {
            return self.leader_election.identity.clone();
        }
        static DERIVED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        DERIVED
            .get_or_init(|| {
                derived_identity(
                    host_name().as_deref(),
                    self.advertise_address,
                    self.admin_addr,
                )
            })
            .clone()
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
    let mut duration = |source: Option<Source<Result<Duration, DurationError>>>| {
        let source = source?;
        match source.value {
            Ok(value) => Some(Source {
                value,
                field: source.field,
            }),
            Err(err) => {
                errors.push(ConfigError::new(source.field, err.to_string()));
                None
            }
        }
    };
    let lease_duration = duration(given.leader_elect_lease_duration.take());
    let renew_grace = duration(given.leader_elect_renew_grace.take());
    let enabled = boolean(given.leader_elect.take(), defaults.enabled, errors);
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
    if !election.enabled {
        return election;
    }
    if let Some(source) = &lease_name
        && let Err(why) = validate_dns1123_subdomain(&source.value)
    {
        errors.push(ConfigError::new(
            source.field,
            format!(
                "{:?} is not a valid Lease name: {why} (expected e.g. bootstrap-controller)",
                source.value
            ),
        ));
    }
    if let Some(source) = &lease_namespace
        && let Err(why) = validate_dns1123_label(&source.value)
    {
        errors.push(ConfigError::new(
            source.field,
            format!(
                "{:?} is not a valid namespace name: {why} (expected e.g. kube-system)",
                source.value
            ),
        ));
    }
    // A Lease holds whole seconds (leaseDurationSeconds).
    if let Some(source) = &lease_duration
        && source.value.as_secs() < 2
    {
        errors.push(ConfigError::new(
            source.field,
            "must be at least 2s (e.g. 15s)",
        ));
    } else if election.renew_grace.as_secs() < 1 || election.renew_grace >= election.lease_duration
    {
        match (&renew_grace, &lease_duration) {
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
    election
}

/// Management mode's settings: flags over the file's `tenants` section. `None` when no
/// selector is set (the one cluster of `--kubeconfig`).
pub(super) fn merge_tenants(
    given: &mut Given,
    budgets: Option<&BTreeMap<String, TenantBudgetFile>>,
    errors: &mut Vec<ConfigError>,
) -> Option<Tenants> {
    let namespace = given.tenants_namespace.take();
    let key = given.tenants_kubeconfig_key.take();
    let plugins = given.tenants_credential_plugins.take();
    let max_objects = given.tenants_cache_max_objects.take();
    let max_mib = given.tenants_cache_max_mib.take();
    let total_mib = given.tenants_cache_total_mib.take();
    let etcd_allowed = given.tenants_etcd_allowed_cidrs.take();
    let Some(selector) = given.tenants_secret_selector.take() else {
        let fields = [namespace, key, plugins, etcd_allowed]
            .into_iter()
            .flatten()
            .map(|source| source.field)
            .chain(
                [max_objects, max_mib, total_mib]
                    .into_iter()
                    .flatten()
                    .map(|s| s.field),
            )
            .chain(budgets.map(|_| "tenants.cacheBudgets"));
        for field in fields {
            errors.push(ConfigError::new(
                field,
                "only means something in management mode: set --tenants-secret-selector \
                 (tenants.secretSelector) too, or leave it out",
            ));
        }
        return None;
    };
    let cache_max_objects = positive(
        max_objects,
        DEFAULT_TENANTS_CACHE_MAX_OBJECTS,
        "50000",
        errors,
    );
    let cache_max_mib = positive(max_mib, DEFAULT_TENANTS_CACHE_MAX_MIB, "32", errors);
    let cache_total_mib = positive(total_mib, DEFAULT_TENANTS_CACHE_TOTAL_MIB, "96", errors);
    let cache_budgets = cache_budgets(budgets, cache_max_objects, cache_max_mib, errors);
    let selector_text = secret_selector(selector, errors);
    let namespace = namespace.and_then(|source| {
        match reconcilers::names::validate_dns1123_label(&source.value) {
            Ok(()) => Some(source.value),
            Err(why) => {
                errors.push(ConfigError::new(
                    source.field,
                    format!(
                        "{:?} is not a valid namespace name: {why} (e.g. tenants)",
                        source.value
                    ),
                ));
                None
            }
        }
    });
    let kubeconfig_key = key.map_or_else(
        || DEFAULT_TENANTS_KUBECONFIG_KEY.to_owned(),
        |source| kubeconfig_key(source, errors),
    );
    let credential_plugins =
        plugins.map_or_else(Vec::new, |source| credential_plugins(source, errors));
    let etcd_allowed_cidrs =
        etcd_allowed.map_or_else(Vec::new, |source| etcd_allowed_cidrs(source, errors));
    Some(Tenants {
        secret_selector: selector_text,
        namespace,
        kubeconfig_key,
        credential_plugins,
        cache_max_objects,
        cache_max_mib,
        cache_total_mib,
        cache_budgets,
        etcd_allowed_cidrs,
    })
}

/// Checks a label selector as `kubectl get -l` writes it (`k`, `!k`, `k=v`, `k==v`, `k!=v`,
/// `k in (a,b)`, `k notin (a,b)`, joined by commas), so a typo is a configuration error at
/// start rather than a refused list later.
pub(super) fn validate_label_selector(selector: &str) -> Result<(), String> {
    fn key(text: &str) -> Result<(), String> {
        let text = text.trim();
        let (prefix, name) = match text.split_once('/') {
            Some((prefix, name)) => (Some(prefix), name),
            None => (None, text),
        };
        if let Some(prefix) = prefix {
            reconcilers::names::validate_dns1123_subdomain(prefix)
                .map_err(|why| format!("label key {text:?}: prefix: {why}"))?;
        }
        value(name).and_then(|()| {
            if name.is_empty() {
                Err(format!("label key {text:?} has no name"))
            } else {
                Ok(())
            }
        })
    }
    fn value(text: &str) -> Result<(), String> {
        let text = text.trim();
        let valid = text.len() <= 63
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && text
                .chars()
                .next()
                .is_none_or(|c| c.is_ascii_alphanumeric())
            && text
                .chars()
                .last()
                .is_none_or(|c| c.is_ascii_alphanumeric());
        if valid {
            Ok(())
        } else {
            Err(format!(
                "{text:?} is not a label name or value (at most 63 letters, digits, '-', '_' or \
                 '.', starting and ending with a letter or digit)"
            ))
        }
    }
    // Commas separate requirements except inside a set's parentheses.
    let mut requirements = Vec::new();
    let (mut depth, mut start) = (0_i32, 0);
    for (at, c) in selector.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                requirements.push(&selector[start..at]);
                start = at + 1;
            }
            _ => {}
        }
        if depth < 0 {
            return Err("unbalanced parentheses".to_owned());
        }
    }
    if depth != 0 {
        return Err("unbalanced parentheses".to_owned());
    }
    requirements.push(&selector[start..]);
    for requirement in requirements {
        let requirement = requirement.trim();
        if requirement.is_empty() {
            return Err("an empty requirement (two commas in a row?)".to_owned());
        }
        if let Some(rest) = requirement.strip_prefix('!') {
            key(rest)?;
        } else if let Some((k, v)) = requirement
            .split_once("!=")
            .or_else(|| requirement.split_once("=="))
            .or_else(|| requirement.split_once('='))
        {
            key(k)?;
            value(v)?;
        } else if let Some((k, set)) = requirement
            .split_once(" notin ")
            .or_else(|| requirement.split_once(" in "))
        {
            key(k)?;
            let set = set.trim();
            let inner = set
                .strip_prefix('(')
                .and_then(|set| set.strip_suffix(')'))
                .ok_or_else(|| format!("{set:?}: a set is written (a,b)"))?;
            for item in inner.split(',') {
                value(item)?;
            }
        } else {
            key(requirement)?;
        }
    }
    Ok(())
}

/// A boolean setting: its value, or `default` when it was not given or (with its error noted)
/// is not a boolean.
fn boolean(
    source: Option<Source<Result<bool, NotABool>>>,
    default: bool,
    errors: &mut Vec<ConfigError>,
) -> bool {
    match source {
        Some(Source {
            value: Ok(value), ..
        }) => value,
        Some(Source {
            value: Err(err),
            field,
        }) => {
            errors.push(ConfigError::new(field, err));
            default
        }
        None => default,
    }
}

/// A positive whole number, or `default` when not given.
fn positive(
    source: Option<Source<Result<u32, NotANumber>>>,
    default: u32,
    example: &str,
    errors: &mut Vec<ConfigError>,
) -> u32 {
    let Some(source) = source else {
        return default;
    };
    let text = match source.value {
        Ok(value @ 1..) => return value,
        Ok(value) => value.to_string(),
        Err(NotANumber(text)) => format!("{text:?}"),
    };
    errors.push(ConfigError::new(
        source.field,
        format!("{text} is not a positive whole number (e.g. {example})"),
    ));
    default
}

/// `tenants.cacheBudgets`: the operator's raise per tenant, keyed by its Secret's namespace/name;
/// what a budget leaves out is the process's.
fn cache_budgets(
    budgets: Option<&BTreeMap<String, TenantBudgetFile>>,
    max_objects: u32,
    max_mib: u32,
    errors: &mut Vec<ConfigError>,
) -> BTreeMap<String, TenantBudget> {
    let mut cache_budgets = BTreeMap::new();
    for (key, budget) in budgets.into_iter().flatten() {
        let field = format!("tenants.cacheBudgets.{key}");
        let valid_key = key.split_once('/').is_some_and(|(namespace, name)| {
            validate_dns1123_label(namespace).is_ok() && validate_dns1123_subdomain(name).is_ok()
        });
        if !valid_key {
            errors.push(ConfigError::new(
                field.clone(),
                "is not a tenant: the key is its Secret's namespace/name (e.g. tenants/team-a)",
            ));
        }
        for (given, name) in [
            (budget.max_objects, "maxObjects"),
            (budget.max_mib, "maxMiB"),
        ] {
            if given == Some(0) {
                errors.push(ConfigError::new(
                    format!("{field}.{name}"),
                    "must be positive (leave it out for the process's budget)",
                ));
            }
        }
        cache_budgets.insert(
            key.clone(),
            TenantBudget {
                max_objects: budget.max_objects.unwrap_or(max_objects),
                max_mib: budget.max_mib.unwrap_or(max_mib),
            },
        );
    }
    cache_budgets
}

/// `tenants.secretSelector`: a label selector, trimmed.
fn secret_selector(selector: Source<String>, errors: &mut Vec<ConfigError>) -> String {
    let selector_text = selector.value.trim().to_owned();
    if selector_text.is_empty() {
        errors.push(ConfigError::new(
            selector.field,
            "must not be empty: a label selector every tenant kubeconfig Secret matches (e.g. \
             cluster.x-k8s.io/cluster-name)",
        ));
    } else if let Err(why) = validate_label_selector(&selector_text) {
        errors.push(ConfigError::new(
            selector.field,
            format!(
                "{selector_text:?} is not a label selector: {why} (e.g. \
                 cluster.x-k8s.io/cluster-name, or team=a,tier!=dev)"
            ),
        ));
    }
    selector_text
}

/// `tenants.kubeconfigKey`: a Secret data key.
fn kubeconfig_key(source: Source<String>, errors: &mut Vec<ConfigError>) -> String {
    let valid = !source.value.is_empty()
        && source.value.len() <= 253
        && source
            .value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if !valid {
        errors.push(ConfigError::new(
            source.field,
            format!(
                "{:?} is not a Secret data key (letters, digits, '-', '_' and '.'; \
                 e.g. value, admin.conf, kubeconfig, config)",
                source.value
            ),
        ));
    }
    source.value
}

/// `tenants.credentialPlugins`: absolute paths of the programs a tenant kubeconfig may run.
fn credential_plugins(source: Source<String>, errors: &mut Vec<ConfigError>) -> Vec<PathBuf> {
    let mut credential_plugins = Vec::new();
    for path in source
        .value
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        let directory = path.ends_with('/');
        let path = PathBuf::from(path);
        let plain = !directory
            && path.components().all(|c| {
                matches!(
                    c,
                    std::path::Component::RootDir | std::path::Component::Normal(_)
                )
            });
        if !path.is_absolute() || !plain || path.file_name().is_none() {
            errors.push(ConfigError::new(
                source.field,
                format!(
                    "{} is not an absolute path to a program (e.g. \
                     /usr/local/bin/aws-iam-authenticator): a plugin is allowed by the path \
                     that runs, never looked up in PATH",
                    path.display()
                ),
            ));
        } else if !credential_plugins.contains(&path) {
            credential_plugins.push(path);
        }
    }
    credential_plugins
}

/// `tenants.etcdAllowedCIDRs`: the networks a tenant's etcd may be in.
fn etcd_allowed_cidrs(source: Source<String>, errors: &mut Vec<ConfigError>) -> Vec<ipnet::IpNet> {
    let mut etcd_allowed_cidrs = Vec::new();
    for text in source
        .value
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
    {
        match text.parse::<ipnet::IpNet>() {
            Ok(net) if net.trunc() == net => etcd_allowed_cidrs.push(net),
            Ok(net) => errors.push(ConfigError::new(
                source.field,
                format!(
                    "{text} has host bits set: write the network, {}",
                    net.trunc()
                ),
            )),
            Err(_) => errors.push(ConfigError::new(
                source.field,
                format!("{text:?} is not a CIDR (e.g. 10.0.16.0/20 or fd00:10::/64)"),
            )),
        }
    }
    etcd_allowed_cidrs
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

/// `kubernetesServiceNodePort`: 0 (a ClusterIP Service) or a port inside the node port range.
fn kubernetes_service_node_port(
    source: Source<Result<u32, NotANumber>>,
    range: PortRange,
    errors: &mut Vec<ConfigError>,
) -> u16 {
    let message = match source.value {
        Ok(0) => return 0,
        Ok(port) => match u16::try_from(port) {
            Ok(port) if range.contains(port) => return port,
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
    0
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

/// `shutdownTimeout`: a duration above zero.
fn shutdown_timeout(
    source: Source<Result<Duration, DurationError>>,
    errors: &mut Vec<ConfigError>,
) -> Duration {
    match source.value {
        Ok(timeout) if !timeout.is_zero() => return timeout,
        Ok(_) => errors.push(ConfigError::new(
            source.field,
            "must be greater than zero (e.g. 30s)",
        )),
        Err(err) => errors.push(ConfigError::new(source.field, err.to_string())),
    }
    default_shutdown_timeout()
}

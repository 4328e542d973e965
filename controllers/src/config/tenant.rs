//! Management mode's settings and a tenant's configuration: its Secret's annotation (a YAML
//! fragment of the file, untrusted) merged over the file, with the keys and floors a fragment may
//! not cross.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use reconcilers::apiserver_endpoints::{EndpointsMode, StaticAddress};
use reconcilers::legacy_alloc::etcd::DEFAULT_PREFIX;
use reconcilers::names::{validate_dns1123_label, validate_dns1123_subdomain};
use reconcilers::section::{ConfigError, format_duration, parse_duration};

use super::file::{parse_file, read_text};
use super::settings::{ConfigArgs, FileConfig, Given, Source, check_name, items};
use super::values::{NotANumber, StringOrList};
use super::{
    Config, ConfigErrors, DEFAULT_TENANTS_CACHE_MAX_MIB, DEFAULT_TENANTS_CACHE_MAX_OBJECTS,
    DEFAULT_TENANTS_CACHE_TOTAL_MIB, DEFAULT_TENANTS_SECRETS_TOTAL_MIB, TenantBudget, Tenants,
};

/// The annotation on a tenant's Secret holding its YAML fragment of the configuration file.
pub const TENANT_CONFIG_ANNOTATION: &str = "bootstrap-controller.io/config";

/// Keys of the file that belong to the process, not to one tenant: refused in a fragment.
pub(super) const PROCESS_WIDE_KEYS: [&str; 6] = [
    "kubeconfig",
    "adminAddr",
    "logFormat",
    "shutdownTimeout",
    "leaderElection",
    "tenants",
];

/// Settings a fragment may not make, because they name files of the controller's filesystem.
pub(super) const FRAGMENT_FILE_KEYS: [&str; 3] = ["etcdCAFile", "etcdCertFile", "etcdKeyFile"];

/// The data keys of a tenant's Secret that hold its etcd client certificate (PEM), used with
/// `etcdServers` and `etcdPrefix` from its annotation.
pub struct TenantEtcdKeys {
    pub ca: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
}

pub const TENANT_ETCD_KEYS: TenantEtcdKeys = TenantEtcdKeys {
    ca: "etcd-ca.crt",
    cert: "etcd-client.crt",
    key: "etcd-client.key",
};

/// The least a fragment may set for a loop setting: every tenant shares this process's CPU and
/// connections, so no Secret may make its loops spin (a timer pass every millisecond, pages of
/// one object).
#[derive(Clone, Copy, Debug)]
pub(super) enum Floor {
    Duration(Duration),
    Count(u64),
}

/// Floors by field name, in every loop section of a fragment (see CONFIG.md).
pub(super) const FRAGMENT_FLOORS: [(&str, Floor); 4] = [
    ("interval", Floor::Duration(Duration::from_secs(5))),
    ("leaseTTL", Floor::Duration(Duration::from_secs(5))),
    (
        "shutdownProbeWindow",
        Floor::Duration(Duration::from_secs(1)),
    ),
    ("pageSize", Floor::Count(100)),
];

/// The fragment's loop settings below their floors.
pub(super) fn below_floors(fragment: &serde_json::Value) -> Vec<ConfigError> {
    let mut errors = Vec::new();
    let Some(loops) = fragment.get("loops").and_then(serde_json::Value::as_object) else {
        return errors;
    };
    for (section, fields) in loops {
        let Some(fields) = fields.as_object() else {
            continue;
        };
        for (field, floor) in FRAGMENT_FLOORS {
            let Some(value) = fields.get(field) else {
                continue;
            };
            // A value that does not parse is reported by the full validation.
            let (below, least) = match floor {
                Floor::Duration(least) => (
                    value
                        .as_str()
                        .and_then(|text| parse_duration(text).ok())
                        .is_some_and(|given| given < least),
                    format_duration(least),
                ),
                Floor::Count(least) => (
                    count_as_parsed(value).is_some_and(|given| given < least),
                    least.to_string(),
                ),
            };
            if below {
                errors.push(ConfigError::new(
                    format!("{TENANT_CONFIG_ANNOTATION}: loops.{section}.{field}"),
                    format!(
                        "is below {least}, the least a tenant may set (every tenant shares this \
                         process): set {least} or more, or leave it to the configuration file"
                    ),
                ));
            }
        }
    }
    errors
}

/// `value` read as the configuration's parser reads a count, which takes a quoted `"1"` too.
fn count_as_parsed(value: &serde_json::Value) -> Option<u64> {
    let text = serde_saphyr::to_string(value).ok()?;
    serde_saphyr::from_str::<u64>(&text).ok()
}

/// A tenant's `etcdPrefix` is a plain absolute key path (`/registry`, `/tenants/a`): no empty,
/// `.` or `..` segment, no trailing `/`, so the keys written under it are where they appear to
/// be. Whether it overlaps another tenant's prefix is checked against every tenant
/// (`tenants/`).
pub fn validate_tenant_etcd_prefix(prefix: &str) -> Result<(), String> {
    let Some(rest) = prefix.strip_prefix('/') else {
        return Err("must start with /".to_owned());
    };
    for segment in rest.split('/') {
        let plain = !segment.is_empty()
            && segment != "."
            && segment != ".."
            && segment
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if !plain {
            return Err(
                "must be a plain key path: segments of letters, digits, '-', '_' and '.', \
                 separated by single / with none at the end (e.g. /registry or /tenants/a)"
                    .to_owned(),
            );
        }
    }
    // Below a first segment (an apiserver's own prefix, e.g. /registry), kube-apiserver keeps
    // each resource under a key named after it (`/registry/services/specs/...`,
    // `/registry/ranges/...`, `/registry/networking.k8s.io/...`). A tenant prefix naming one
    // would put this tenant's bitmaps inside another cluster's objects.
    if let Some(segment) = rest
        .split('/')
        .skip(1)
        .find(|segment| RESOURCE_KEYS.contains(segment) || segment.ends_with(".k8s.io"))
    {
        return Err(format!(
            "names {segment:?}, where kube-apiserver keeps a resource's objects below its own \
             prefix: the bitmaps would be written inside another cluster's keys; give the \
             tenant apiserver's own --etcd-prefix (e.g. /registry or /tenants/a)"
        ));
    }
    Ok(())
}

/// The keys kube-apiserver keeps resources under, below its `--etcd-prefix` (the resources of
/// the core and built-in groups whose storage key is the resource's name).
const RESOURCE_KEYS: [&str; 38] = [
    "apiextensions.k8s.io",
    "apiregistration.k8s.io",
    "certificatesigningrequests",
    "clusterrolebindings",
    "clusterroles",
    "configmaps",
    "controllerrevisions",
    "controllers",
    "cronjobs",
    "csidrivers",
    "csinodes",
    "daemonsets",
    "deployments",
    "endpointslices",
    "events",
    "horizontalpodautoscalers",
    "ingress",
    "ipaddresses",
    "jobs",
    "leases",
    "limitranges",
    "minions",
    "namespaces",
    "persistentvolumeclaims",
    "persistentvolumes",
    "poddisruptionbudgets",
    "pods",
    "podtemplates",
    "priorityclasses",
    "ranges",
    "replicasets",
    "resourcequotas",
    "rolebindings",
    "roles",
    "secrets",
    "serviceaccounts",
    "services",
    "statefulsets",
];

/// What every tenant is made from: the flags and the file as it was read at start, which a
/// tenant's fragment is merged over (flags still win, as over the file), and management mode's
/// settings, which say where the tenants are and what they may use.
#[derive(Debug, Clone)]
pub struct TenantBase {
    args: ConfigArgs,
    file: serde_json::Value,
    /// The process's own, never a tenant's: a fragment may not set `tenants`.
    pub tenants: Tenants,
    /// The process's dry run, which a fragment may turn on for its tenant but never off: the
    /// operator's promise that nothing is written, kept by a process that fences no tenant.
    dry_run: bool,
}

impl TenantBase {
    /// The base of the tenants of `process` (merged from `args`), or `None` outside management
    /// mode. Reads `--config` again, as a tree the fragments merge into, and refuses a file that
    /// does not make a valid tenant configuration by itself: every tenant's starts from it.
    pub fn load(args: &ConfigArgs, process: &Config) -> Result<Option<TenantBase>, ConfigErrors> {
        let Some(tenants) = process.tenants.clone() else {
            return Ok(None);
        };
        let file = match &args.config {
            Some(path) => yaml_tree(&read_text(path)?)
                .map_err(|message| ConfigError::new("--config", message))?,
            None => serde_json::Value::Null,
        };
        // Flags that name the management cluster or management mode are not a tenant's.
        let args = ConfigArgs {
            tenants_secret_selector: None,
            tenants_namespace: None,
            tenants_kubeconfig_key: None,
            tenants_credential_plugins: None,
            tenants_cache_max_objects: None,
            tenants_cache_max_mib: None,
            tenants_cache_total_mib: None,
            tenants_secrets_total_mib: None,
            tenants_etcd_allowed_cidrs: None,
            kubeconfig: None,
            ..args.clone()
        };
        let base = TenantBase {
            args,
            file,
            tenants,
            dry_run: process.dry_run,
        };
        base.tenant(None)?;
        Ok(Some(base))
    }

    /// One tenant's configuration: `fragment` (the Secret's annotation, if any) over the file,
    /// over the defaults, with the flags winning. The endpoint reconciler defaults to `none`
    /// here: this process is not one of the tenant's apiservers, so it cannot hold a membership
    /// Lease for one; `static` (the tenant's load-balancer address) or `none` are the choices.
    pub fn tenant(&self, fragment: Option<&str>) -> Result<Config, ConfigErrors> {
        let fragment = match fragment {
            Some(text) => tenant_fragment(text)?,
            None => serde_json::Value::Null,
        };
        // A refusal names the annotation only for what the fragment sets; the rest is the
        // file's (or a flag's), and is named as the file names it.
        let named = |path: &str, pointer: &str| match fragment.pointer(pointer) {
            Some(_) => tenant_field(path),
            None => path.to_owned(),
        };
        let mode_field = named("endpointReconcilerType", "/endpointReconcilerType");
        let addresses_field = named(
            "loops.apiserverEndpoints.staticAddresses",
            "/loops/apiserverEndpoints/staticAddresses",
        );
        let mut config = self.merged(fragment)?;
        config.dry_run |= self.dry_run;
        self.check_tenant_etcd(&config)?;
        match config.loops.apiserver_endpoints.endpoint_mode() {
            EndpointsMode::Static => {
                check_static_addresses(&config, &addresses_field).map(|()| config)
            }
            EndpointsMode::None => Ok(config),
            other => Err(ConfigErrors(vec![ConfigError::new(
                mode_field,
                format!(
                    "{:?} makes this process one of the tenant's apiservers, which it is not: \
                     use static (with the tenant's load-balancer address under \
                     loops.apiserverEndpoints) or none",
                    other.as_str()
                ),
            )])),
        }
    }

    /// The fragment over the file, over the defaults (`none` endpoints), with the flags
    /// winning; the settings of the whole process are not the fragment's to set.
    fn merged(&self, fragment: serde_json::Value) -> Result<Config, ConfigErrors> {
        let mut merged = serde_json::json!({"endpointReconcilerType": "none"});
        deep_merge(&mut merged, self.file.clone());
        deep_merge(&mut merged, fragment);
        if let serde_json::Value::Object(map) = &mut merged {
            for key in PROCESS_WIDE_KEYS {
                map.remove(key);
            }
            // The process's identity, which names this replica in every tenant's events too.
            if let Some(identity) = self.file.pointer("/leaderElection/identity") {
                map.insert(
                    "leaderElection".to_owned(),
                    serde_json::json!({ "identity": identity }),
                );
            }
        }
        let text = serde_saphyr::to_string(&merged).map_err(|err| {
            ConfigError::new(
                tenant_field("(fragment)"),
                format!("cannot be merged: {err}"),
            )
        })?;
        let file = parse_file(&text)
            .map_err(|err| ConfigError::new(tenant_field(&err.field), err.message))?;
        Config::merge(&self.args, file).map_err(|errors| {
            ConfigErrors(
                errors
                    .0
                    .into_iter()
                    .map(|err| match err.field.starts_with("--") {
                        true => err,
                        false => ConfigError::new(tenant_field(&err.field), err.message),
                    })
                    .collect(),
            )
        })
    }

    /// A tenant's etcd: only where the operator allows one, at a URL of the plain form, under a
    /// prefix of its own.
    fn check_tenant_etcd(&self, config: &Config) -> Result<(), ConfigErrors> {
        if !config.settings.etcd.servers.is_empty() && self.tenants.etcd_allowed_cidrs.is_empty() {
            return Err(ConfigErrors(vec![ConfigError::new(
                tenant_field("etcdServers"),
                "is not allowed: the operator has not set --tenants-etcd-allowed-cidrs \
                 (tenants.etcdAllowedCIDRs), the networks a tenant's etcd may be in; set it, or \
                 remove etcdServers from the annotation",
            )]));
        }
        let refused: Vec<ConfigError> = config
            .settings
            .etcd
            .servers
            .iter()
            .filter_map(|server| {
                let why = tenant_etcd_url(server).err()?;
                // Userinfo may hold a password: the message names the host only.
                let shown = match server.rsplit_once('@') {
                    Some((_, host)) => format!("(userinfo)@{host}"),
                    None => server.clone(),
                };
                Some(ConfigError::new(
                    tenant_field("etcdServers"),
                    format!("{shown:?} {why}"),
                ))
            })
            .collect();
        if !refused.is_empty() {
            return Err(ConfigErrors(refused));
        }
        if !config.settings.etcd.servers.is_empty()
            && let Err(why) = validate_tenant_etcd_prefix(&config.settings.etcd.prefix)
        {
            return Err(ConfigErrors(vec![ConfigError::new(
                tenant_field("etcdPrefix"),
                format!("{:?} {why}", config.settings.etcd.prefix),
            )]));
        }
        Ok(())
    }
}

/// A tenant's static endpoints are IP addresses: a name would be resolved by this process, with
/// the management cluster's DNS, and what it answers written into the tenant's endpoints, where
/// the tenant's users read it.
fn check_static_addresses(config: &Config, field: &str) -> Result<(), ConfigErrors> {
    let refused: Vec<ConfigError> = config
        .loops
        .apiserver_endpoints
        .static_addresses
        .iter()
        .enumerate()
        .filter(|(_, entry)| matches!(StaticAddress::parse(entry), Ok(StaticAddress::Name(_))))
        .map(|(index, entry)| {
            ConfigError::new(
                format!("{field}[{index}]"),
                format!(
                    "{entry:?} is a DNS name, which this process would resolve with the \
                     management cluster's DNS and write what it answers into the tenant's \
                     endpoints: a tenant lists IP addresses only (its load balancer's, e.g. \
                     192.0.2.40)"
                ),
            )
        })
        .collect();
    match refused.is_empty() {
        true => Ok(()),
        false => Err(ConfigErrors(refused)),
    }
}

/// A field of a tenant's configuration, as its errors name it: under the Secret's annotation.
fn tenant_field(path: &str) -> String {
    format!("{TENANT_CONFIG_ANNOTATION}: {path}")
}

/// The tenant Secret's annotation, parsed: a mapping of file keys, without the keys a tenant
/// may not set (the whole process's, files) or values below their floors.
fn tenant_fragment(text: &str) -> Result<serde_json::Value, ConfigErrors> {
    let field = tenant_field;
    let fragment =
        yaml_tree(text).map_err(|message| ConfigError::new(field("(fragment)"), message))?;
    let serde_json::Value::Object(map) = &fragment else {
        if fragment.is_null() {
            return Ok(fragment);
        }
        return Err(ConfigErrors(vec![ConfigError::new(
            field("(fragment)"),
            "must be a YAML mapping of configuration file keys (e.g. \
             serviceClusterIPRange: 10.96.0.0/12)",
        )]));
    };
    let mut refused: Vec<ConfigError> = map
        .keys()
        .filter(|key| PROCESS_WIDE_KEYS.contains(&key.as_str()))
        .map(|key| {
            ConfigError::new(
                field(key),
                "is set for the whole process (flags or the --config file), not per \
                 tenant: remove it from the annotation",
            )
        })
        .collect();
    refused.extend(
        map.keys()
            .filter(|key| FRAGMENT_FILE_KEYS.contains(&key.as_str()))
            .map(|key| {
                ConfigError::new(
                    field(key),
                    format!(
                        "names a file, which a tenant may not: put the etcd client \
                         certificate in the Secret's data keys {}, {} and {}",
                        TENANT_ETCD_KEYS.ca, TENANT_ETCD_KEYS.cert, TENANT_ETCD_KEYS.key
                    ),
                )
            }),
    );
    refused.extend(below_floors(&fragment));
    if !refused.is_empty() {
        return Err(ConfigErrors(refused));
    }
    Ok(fragment)
}

/// A tenant's etcd server URL, parsed: its scheme, host (brackets removed) and port (the
/// scheme's default when left out). Only `http(s)://host[:port]` with nothing after the
/// authority but an optional `/`: userinfo, a path, a query or a fragment would be sent nowhere
/// and mean nothing to etcd, yet make one etcd look like another.
pub fn tenant_etcd_url(server: &str) -> Result<(String, String, u16), String> {
    let example = "write scheme://host:port only, e.g. https://192.0.2.10:2379";
    let unsent = [
        ('@', "userinfo (user@)"),
        ('?', "a query (?...)"),
        ('#', "a fragment (#...)"),
    ];
    if let Some((_, part)) = unsent.iter().find(|(mark, _)| server.contains(*mark)) {
        return Err(format!("has {part}, which etcd is never sent: {example}"));
    }
    let uri: http::Uri = server
        .parse()
        .map_err(|_| format!("is not a URL: {example}"))?;
    let scheme = match uri.scheme_str() {
        Some(scheme @ ("http" | "https")) => scheme.to_owned(),
        _ => return Err(format!("is not http:// or https://: {example}")),
    };
    if !matches!(uri.path(), "" | "/") {
        return Err(format!(
            "has a path ({}), which etcd is never sent: {example}",
            uri.path()
        ));
    }
    let host = uri
        .host()
        .filter(|host| !host.is_empty())
        .ok_or_else(|| format!("names no host: {example}"))?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = match uri.port_u16() {
        Some(port) => port,
        None if uri.port().is_some() => return Err(format!("has no valid port: {example}")),
        None if scheme == "https" => 443,
        None => 80,
    };
    Ok((scheme, host, port))
}

/// The etcd servers and prefix a tenant's fragment sets (`None` without `etcdServers`, or if it
/// does not parse: loading the tenant reports that), servers lower-cased without a trailing
/// `/`: whether a Secret claims etcd keys, and under which prefix, before its etcd is asked
/// which etcd it is. A prefix that is not a plain key path claims nothing (the tenant is
/// refused for it when it loads).
pub fn fragment_etcd(fragment: &str) -> Option<(Vec<String>, String)> {
    let tree = yaml_tree(fragment).ok()?;
    // Read as the file's parser reads it: a list or comma-separated text.
    let servers = serde_json::from_value::<StringOrList>(tree.get("etcdServers")?.clone()).ok()?;
    let servers: Vec<String> = String::from(servers)
        .split(',')
        .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    if servers.is_empty() {
        return None;
    }
    let prefix = tree
        .get("etcdPrefix")
        .and_then(serde_json::Value::as_str)
        .unwrap_or(DEFAULT_PREFIX)
        .to_owned();
    validate_tenant_etcd_prefix(&prefix).ok()?;
    Some((servers, prefix))
}

/// A YAML document as a tree (empty text is `null`).
pub(super) fn yaml_tree(text: &str) -> Result<serde_json::Value, String> {
    if text.trim().is_empty() {
        return Ok(serde_json::Value::Null);
    }
    serde_saphyr::from_str(text).map_err(|err| {
        let message = err.to_string();
        message
            .lines()
            .next()
            .unwrap_or("invalid YAML")
            .trim()
            .to_owned()
    })
}

/// Merges `over` into `base`: mappings key by key, anything else replaced.
pub(super) fn deep_merge(base: &mut serde_json::Value, over: serde_json::Value) {
    match (base, over) {
        (_, serde_json::Value::Null) => {}
        (serde_json::Value::Object(base), serde_json::Value::Object(over)) => {
            for (key, value) in over {
                deep_merge(base.entry(key).or_insert(serde_json::Value::Null), value);
            }
        }
        (base, over) => *base = over,
    }
}

/// The Secret data key Cluster API's `<cluster>-kubeconfig` Secrets use.
pub const DEFAULT_TENANTS_KUBECONFIG_KEY: &str = "value";

/// Management mode's settings: flags over the file's `tenants` section, and none of the
/// process's etcd settings. `None` when no selector is set (the one cluster of `--kubeconfig`).
pub(super) fn merge_tenants(
    given: &mut Given,
    args: &ConfigArgs,
    file: &FileConfig,
    errors: &mut Vec<ConfigError>,
) -> Option<Tenants> {
    let budgets = file.tenants.as_ref().and_then(|t| t.cache_budgets.as_ref());
    let namespace = given.tenants_namespace.take();
    let key = given.tenants_kubeconfig_key.take();
    let plugins = given.tenants_credential_plugins.take();
    let max_objects = given.tenants_cache_max_objects.take();
    let max_mib = given.tenants_cache_max_mib.take();
    let total_mib = given.tenants_cache_total_mib.take();
    let secrets_mib = given.tenants_secrets_total_mib.take();
    let etcd_allowed = given.tenants_etcd_allowed_cidrs.take();
    let Some(selector) = given.tenants_secret_selector.take() else {
        let fields = [namespace, key, plugins, etcd_allowed]
            .into_iter()
            .flatten()
            .map(|source| source.field)
            .chain(
                [max_objects, max_mib, total_mib, secrets_mib]
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
    // In management mode etcd is each tenant's, never the process's.
    refuse_process_etcd(args, file, errors);
    let cache_max_objects = positive(max_objects, DEFAULT_TENANTS_CACHE_MAX_OBJECTS, errors);
    let cache_max_mib = positive(max_mib, DEFAULT_TENANTS_CACHE_MAX_MIB, errors);
    let cache_total_mib = positive(total_mib, DEFAULT_TENANTS_CACHE_TOTAL_MIB, errors);
    let secrets_total_mib = positive(secrets_mib, DEFAULT_TENANTS_SECRETS_TOTAL_MIB, errors);
    let cache_budgets = cache_budgets(budgets, cache_max_objects, cache_max_mib, errors);
    let selector_text = secret_selector(selector, errors);
    let namespace = namespace
        .filter(|source| {
            check_name(
                source,
                validate_dns1123_label,
                "namespace",
                "e.g. tenants",
                errors,
            )
        })
        .map(|source| source.value);
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
        secrets_total_mib,
        cache_budgets,
        etcd_allowed_cidrs,
    })
}

/// In management mode every tenant has its own etcd (servers and prefix in its annotation,
/// credentials in its Secret): one process-wide etcd would be shared by every tenant, each
/// repairing the others' bitmaps with its own cluster's Services.
fn refuse_process_etcd(args: &ConfigArgs, file: &FileConfig, errors: &mut Vec<ConfigError>) {
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

/// A positive whole number, or `default` (the example an error gives) when not given.
fn positive(
    source: Option<Source<Result<u32, NotANumber>>>,
    default: u32,
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
        format!("{text} is not a positive whole number (e.g. {default})"),
    ));
    default
}

/// `tenants.cacheBudgets`: the operator's raise per tenant, keyed by its Secret's namespace/name;
/// what a budget leaves out is the process's.
fn cache_budgets(
    budgets: Option<&BTreeMap<String, TenantBudget>>,
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
                max_objects: budget.max_objects.or(Some(max_objects)),
                max_mib: budget.max_mib.or(Some(max_mib)),
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
    let paths = items(&source, errors, |path| {
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
            return Err(format!(
                "{} is not an absolute path to a program (e.g. \
                 /usr/local/bin/aws-iam-authenticator): a plugin is allowed by the path that \
                 runs, never looked up in PATH",
                path.display()
            ));
        }
        Ok(path)
    });
    let mut credential_plugins = Vec::new();
    for path in paths {
        if !credential_plugins.contains(&path) {
            credential_plugins.push(path);
        }
    }
    credential_plugins
}

/// `tenants.etcdAllowedCIDRs`: the networks a tenant's etcd may be in.
fn etcd_allowed_cidrs(source: Source<String>, errors: &mut Vec<ConfigError>) -> Vec<ipnet::IpNet> {
    items(&source, errors, |text| match text.parse::<ipnet::IpNet>() {
        Ok(net) if net.trunc() == net => Ok(net),
        Ok(net) => Err(format!(
            "{text} has host bits set: write the network, {}",
            net.trunc()
        )),
        Err(_) => Err(format!(
            "{text:?} is not a CIDR (e.g. 10.0.16.0/20 or fd00:10::/64)"
        )),
    })
}

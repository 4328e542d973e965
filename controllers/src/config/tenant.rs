//! Management mode's settings and a tenant's configuration: its Secret's annotation (a YAML
//! fragment of the file, untrusted) merged over the file, with the keys and floors a fragment may
//! not cross.

use std::time::Duration;

use ipnet::IpNet;
use reconcilers::section::{ConfigError, EndpointsMode, format_duration, parse_duration};

use super::file::parse_file;
use super::settings::ConfigArgs;
use super::{Config, ConfigErrors};

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
                    value.as_u64().is_some_and(|given| given < least),
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

/// What every tenant's configuration is made from: the flags and the file as it was read at
/// start. A tenant's fragment is merged over the file (flags still win, as over the file).
#[derive(Debug, Clone)]
pub struct TenantBase {
    args: ConfigArgs,
    file: serde_json::Value,
    /// `--tenants-etcd-allowed-cidrs`: where a tenant's etcd may be; none, no tenant etcd.
    etcd_allowed: Vec<IpNet>,
}

impl TenantBase {
    /// Reads `--config` again, as a tree the fragments merge into.
    pub fn load(args: &ConfigArgs) -> Result<TenantBase, ConfigErrors> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|err| {
                    ConfigError::new("--config", format!("cannot read {}: {err}", path.display()))
                })?;
                yaml_tree(&text).map_err(|message| ConfigError::new("--config", message))?
            }
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
            tenants_etcd_allowed_cidrs: None,
            kubeconfig: None,
            ..args.clone()
        };
        Ok(TenantBase {
            args,
            file,
            etcd_allowed: Vec::new(),
        })
    }

    /// The networks a tenant's etcd may be in (`--tenants-etcd-allowed-cidrs`).
    pub fn allowing_etcd_in(mut self, networks: Vec<IpNet>) -> TenantBase {
        self.etcd_allowed = networks;
        self
    }

    pub fn etcd_allowed(&self) -> &[IpNet] {
        &self.etcd_allowed
    }

    /// One tenant's configuration: `fragment` (the Secret's annotation, if any) over the file,
    /// over the defaults, with the flags winning. The endpoint reconciler defaults to `none`
    /// here: this process is not one of the tenant's apiservers, so it cannot hold a membership
    /// Lease for one; `static` (the tenant's load-balancer address) or `none` are the choices.
    pub fn tenant(&self, fragment: Option<&str>) -> Result<Config, ConfigErrors> {
        let field = |path: &str| format!("{TENANT_CONFIG_ANNOTATION}: {path}");
        let fragment = match fragment {
            Some(text) => {
                yaml_tree(text).map_err(|message| ConfigError::new(field("(fragment)"), message))?
            }
            None => serde_json::Value::Null,
        };
        match &fragment {
            serde_json::Value::Null => {}
            serde_json::Value::Object(map) => {
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
                                    TENANT_ETCD_KEYS.ca,
                                    TENANT_ETCD_KEYS.cert,
                                    TENANT_ETCD_KEYS.key
                                ),
                            )
                        }),
                );
                refused.extend(below_floors(&fragment));
                if !refused.is_empty() {
                    return Err(ConfigErrors(refused));
                }
            }
            _ => {
                return Err(ConfigErrors(vec![ConfigError::new(
                    field("(fragment)"),
                    "must be a YAML mapping of configuration file keys (e.g. \
                     serviceClusterIPRange: 10.96.0.0/12)",
                )]));
            }
        }
        let mut merged = serde_json::json!({"endpointReconcilerType": "none"});
        deep_merge(&mut merged, self.file.clone());
        deep_merge(&mut merged, fragment);
        if let serde_json::Value::Object(map) = &mut merged {
            for key in PROCESS_WIDE_KEYS {
                map.remove(key);
            }
        }
        let text = serde_saphyr::to_string(&merged).map_err(|err| {
            ConfigError::new(field("(fragment)"), format!("cannot be merged: {err}"))
        })?;
        let file =
            parse_file(&text).map_err(|err| ConfigError::new(field(&err.field), err.message))?;
        let config = Config::merge(&self.args, file).map_err(|errors| {
            ConfigErrors(
                errors
                    .0
                    .into_iter()
                    .map(|err| match err.field.starts_with("--") {
                        true => err,
                        false => ConfigError::new(field(&err.field), err.message),
                    })
                    .collect(),
            )
        })?;
        if !config.etcd_servers.is_empty() && self.etcd_allowed.is_empty() {
            return Err(ConfigErrors(vec![ConfigError::new(
                field("etcdServers"),
                "is not allowed: the operator has not set --tenants-etcd-allowed-cidrs \
                 (tenants.etcdAllowedCIDRs), the networks a tenant's etcd may be in; set it, or \
                 remove etcdServers from the annotation",
            )]));
        }
        let refused: Vec<ConfigError> = config
            .etcd_servers
            .iter()
            .filter_map(|server| {
                let why = tenant_etcd_url(server).err()?;
                // Userinfo may hold a password: the message names the host only.
                let shown = match server.rsplit_once('@') {
                    Some((_, host)) => format!("(userinfo)@{host}"),
                    None => server.clone(),
                };
                Some(ConfigError::new(
                    field("etcdServers"),
                    format!("{shown:?} {why}"),
                ))
            })
            .collect();
        if !refused.is_empty() {
            return Err(ConfigErrors(refused));
        }
        if !config.etcd_servers.is_empty()
            && let Err(why) = validate_tenant_etcd_prefix(&config.etcd_prefix)
        {
            return Err(ConfigErrors(vec![ConfigError::new(
                field("etcdPrefix"),
                format!("{:?} {why}", config.etcd_prefix),
            )]));
        }
        match config.endpoint_mode() {
            EndpointsMode::Static | EndpointsMode::None => Ok(config),
            other => Err(ConfigErrors(vec![ConfigError::new(
                field("endpointReconcilerType"),
                format!(
                    "{:?} makes this process one of the tenant's apiservers, which it is not: \
                     use static (with the tenant's load-balancer address under \
                     loops.apiserverEndpoints) or none",
                    other.as_str()
                ),
            )])),
        }
    }
}

/// A tenant's etcd server URL, parsed: its scheme, host (brackets removed) and port (the
/// scheme's default when left out). Only `http(s)://host[:port]` with nothing after the
/// authority but an optional `/`: userinfo, a path, a query or a fragment would be sent nowhere
/// and mean nothing to etcd, yet make one etcd look like another.
pub fn tenant_etcd_url(server: &str) -> Result<(String, String, u16), String> {
    let example = "write scheme://host:port only, e.g. https://192.0.2.10:2379";
    if server.contains('@') {
        return Err(format!(
            "has userinfo (user@), which etcd is never sent: {example}"
        ));
    }
    if server.contains('?') {
        return Err(format!(
            "has a query (?...), which etcd is never sent: {example}"
        ));
    }
    if server.contains('#') {
        return Err(format!(
            "has a fragment (#...), which etcd is never sent: {example}"
        ));
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
    let servers: Vec<String> = match tree.get("etcdServers")? {
        serde_json::Value::String(text) => text.split(',').map(str::to_owned).collect(),
        serde_json::Value::Array(list) => list
            .iter()
            .filter_map(|v| v.as_str().map(str::to_owned))
            .collect(),
        _ => return None,
    };
    let servers: Vec<String> = servers
        .iter()
        .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
        .filter(|s| !s.is_empty())
        .collect();
    if servers.is_empty() {
        return None;
    }
    let prefix = tree
        .get("etcdPrefix")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("/registry")
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

//! Configuration: flags (with environment variables), an optional YAML file, and defaults.
//!
//! Precedence is flags > file > defaults. Every value is validated before anything touches the
//! cluster, and every error names the field (the flag when the value came from a flag, the YAML
//! path when it came from the file) and says how to fix it.
//!
//! Each loop's section (`loops.<key>`) is owned by the loop's module in `reconcilers`
//! ([`LoopSection`]); [`Loops`] is the list of them.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;
use ipnet::IpNet;
use reconcilers::alloc::IpFamily;
use serde::{Deserialize, Serialize};

pub use reconcilers::names::{
    NameError, validate_dns1123_label, validate_dns1123_subdomain, validate_qualified_name,
};
pub use reconcilers::section::{
    ConfigError, DurationError, EndpointsMode, LoopSection, ServiceName, Settings, duration_format,
    format_duration, parse_duration,
};

/// Environment variable prefix shared by every flag.
pub const ENV_PREFIX: &str = "BOOTSTRAP_";

// ------------------------------------------------------------------------------------------------
// Flags
// ------------------------------------------------------------------------------------------------

/// Flags that configure the controller. Every flag has an environment variable
/// (`BOOTSTRAP_<FLAG_IN_UPPER_SNAKE_CASE>`). Values left unset fall back to the `--config` file,
/// then to the defaults shown.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ConfigArgs {
    /// YAML configuration file (loops, intervals, system namespaces, and every flag's setting).
    /// Flags override the file; the file overrides the defaults. [default: none]
    #[arg(long, env = "BOOTSTRAP_CONFIG", value_name = "FILE", global = true)]
    pub config: Option<PathBuf>,

    /// Service cluster IP range(s), as given to kube-apiserver: one CIDR, or two of different
    /// families separated by a comma (primary first). Each must hold at least 8 addresses.
    /// [default: none: read from the cluster's kubernetes ServiceCIDR (Kubernetes 1.33+); older
    /// clusters need it set for the ClusterIP repair]
    #[arg(
        long,
        env = "BOOTSTRAP_SERVICE_CLUSTER_IP_RANGE",
        value_name = "CIDR[,CIDR]",
        global = true
    )]
    pub service_cluster_ip_range: Option<String>,

    /// NodePort range, as given to kube-apiserver: `BASE-LAST`, both inclusive.
    /// [default: 30000-32767]
    #[arg(
        long,
        env = "BOOTSTRAP_SERVICE_NODE_PORT_RANGE",
        value_name = "BASE-LAST",
        global = true
    )]
    pub service_node_port_range: Option<String>,

    /// IP address this apiserver advertises to the cluster (its address in the `kubernetes`
    /// endpoints). Its family must match the primary service range's unless the endpoint
    /// reconciler is `none`. [default: the default-route address of the primary range's family,
    /// as kube-apiserver]
    #[arg(
        long,
        env = "BOOTSTRAP_ADVERTISE_ADDRESS",
        value_name = "IP",
        global = true
    )]
    pub advertise_address: Option<String>,

    /// The apiserver's secure port: the endpoints' port and the `kubernetes` Service's
    /// targetPort. [default: 6443]
    #[arg(
        long,
        env = "BOOTSTRAP_SECURE_PORT",
        value_name = "PORT",
        global = true
    )]
    pub secure_port: Option<String>,

    /// NodePort of the `kubernetes` Service; 0 keeps it of type ClusterIP. When set it must lie
    /// inside --service-node-port-range. [default: 0]
    #[arg(
        long,
        env = "BOOTSTRAP_KUBERNETES_SERVICE_NODE_PORT",
        value_name = "PORT",
        global = true
    )]
    pub kubernetes_service_node_port: Option<String>,

    /// How the `kubernetes` endpoints are maintained: `lease` (one Lease per apiserver),
    /// `static` (addresses from the configuration file), `master-count` (upstream's deprecated
    /// reconciler, with --apiserver-count) or `none` (the endpoints loop is off). [default: lease]
    #[arg(
        long,
        env = "BOOTSTRAP_ENDPOINT_RECONCILER_TYPE",
        value_name = "TYPE",
        value_parser = endpoint_reconciler_type_parser(),
        global = true
    )]
    pub endpoint_reconciler_type: Option<EndpointsMode>,

    /// Number of apiservers, used only by `--endpoint-reconciler-type=master-count`; must be
    /// positive. [default: 1]
    #[arg(
        long,
        env = "BOOTSTRAP_APISERVER_COUNT",
        value_name = "N",
        global = true
    )]
    pub apiserver_count: Option<String>,

    /// Kubeconfig file. [default: `$KUBECONFIG`, then `~/.kube/config`, then the in-cluster
    /// service account]
    #[arg(long, env = "BOOTSTRAP_KUBECONFIG", value_name = "FILE", global = true)]
    pub kubeconfig: Option<PathBuf>,

    /// The etcd of the apiserver, as its --etcd-servers: comma-separated URLs. Turns on etcd
    /// mode: the NodePort repair also repairs the allocation bitmap kube-apiserver keeps there.
    /// Without it the repairs work through the API only. [default: none]
    #[arg(
        long,
        env = "BOOTSTRAP_ETCD_SERVERS",
        value_name = "URL[,URL]",
        global = true
    )]
    pub etcd_servers: Option<String>,

    /// CA bundle that verifies the etcd servers' certificates (as kube-apiserver's). [default:
    /// none]
    #[arg(
        long,
        env = "BOOTSTRAP_ETCD_CAFILE",
        value_name = "FILE",
        global = true
    )]
    pub etcd_cafile: Option<PathBuf>,

    /// Client certificate for etcd (PEM); goes with --etcd-keyfile. [default: none]
    #[arg(
        long,
        env = "BOOTSTRAP_ETCD_CERTFILE",
        value_name = "FILE",
        global = true
    )]
    pub etcd_certfile: Option<PathBuf>,

    /// Client key for etcd (PEM); goes with --etcd-certfile. [default: none]
    #[arg(
        long,
        env = "BOOTSTRAP_ETCD_KEYFILE",
        value_name = "FILE",
        global = true
    )]
    pub etcd_keyfile: Option<PathBuf>,

    /// The apiserver's --etcd-prefix. [default: /registry]
    #[arg(
        long,
        env = "BOOTSTRAP_ETCD_PREFIX",
        value_name = "PREFIX",
        global = true
    )]
    pub etcd_prefix: Option<String>,

    /// Compute and report every write without making it (logs, metrics, `check`).
    /// `--dry-run` alone means true. [default: false]
    #[arg(
        long,
        env = "BOOTSTRAP_DRY_RUN",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        global = true
    )]
    pub dry_run: Option<bool>,

    /// Ignore watch triggers: every loop runs only at start and on its interval, as upstream.
    /// `--timer-only` alone means true. [default: false]
    #[arg(
        long,
        env = "BOOTSTRAP_TIMER_ONLY",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        global = true
    )]
    pub timer_only: Option<bool>,

    /// Address of the admin HTTP server (/livez, /readyz, /metrics). [default: 0.0.0.0:8080]
    #[arg(
        long,
        env = "BOOTSTRAP_ADMIN_ADDR",
        value_name = "ADDR:PORT",
        global = true
    )]
    pub admin_addr: Option<String>,

    /// Log format; the level comes from RUST_LOG (default `info`). [default: text]
    #[arg(
        long,
        env = "BOOTSTRAP_LOG_FORMAT",
        value_name = "FORMAT",
        global = true
    )]
    pub log_format: Option<LogFormat>,

    /// Elect a leader among replicas with a Lease; loops that write cluster-wide objects run only
    /// on the leader. `--leader-elect` alone means true. [default: true]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        global = true
    )]
    pub leader_elect: Option<bool>,

    /// Name of the leader-election Lease. [default: bootstrap-controller]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT_LEASE_NAME",
        value_name = "NAME",
        global = true
    )]
    pub leader_elect_lease_name: Option<String>,

    /// Namespace of the leader-election Lease. [default: kube-system]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT_LEASE_NAMESPACE",
        value_name = "NAMESPACE",
        global = true
    )]
    pub leader_elect_lease_namespace: Option<String>,

    /// This replica's identity in the leader-election Lease.
    /// [default: $POD_NAME, else the host name, plus a random suffix]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT_IDENTITY",
        value_name = "ID",
        global = true
    )]
    pub leader_elect_identity: Option<String>,

    /// How long a leader holds the Lease without renewing it (also the longest failover time),
    /// e.g. `15s`. [default: 15s]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT_LEASE_DURATION",
        value_name = "DURATION",
        global = true
    )]
    pub leader_elect_lease_duration: Option<String>,

    /// How long before the Lease expires the leader renews it, e.g. `5s`; must be shorter than
    /// the lease duration. [default: 5s]
    #[arg(
        long,
        env = "BOOTSTRAP_LEADER_ELECT_RENEW_GRACE",
        value_name = "DURATION",
        global = true
    )]
    pub leader_elect_renew_grace: Option<String>,

    /// Upper bound for graceful shutdown (finish running passes, run each loop's shutdown hook),
    /// e.g. `30s`. [default: 30s]
    #[arg(
        long,
        env = "BOOTSTRAP_SHUTDOWN_TIMEOUT",
        value_name = "DURATION",
        global = true
    )]
    pub shutdown_timeout: Option<String>,

    /// Management mode: keep the bootstrap state of every tenant cluster whose kubeconfig is in
    /// a Secret of this (management) cluster matching this label selector, e.g.
    /// `cluster.x-k8s.io/cluster-name`; left out, the one cluster of --kubeconfig is kept.
    /// [default: none]
    #[arg(
        long,
        env = "BOOTSTRAP_TENANTS_SECRET_SELECTOR",
        value_name = "SELECTOR",
        global = true
    )]
    pub tenants_secret_selector: Option<String>,

    /// Management mode: only Secrets in this namespace are tenants. [default: every namespace]
    #[arg(
        long,
        env = "BOOTSTRAP_TENANTS_NAMESPACE",
        value_name = "NAMESPACE",
        global = true
    )]
    pub tenants_namespace: Option<String>,

    /// Management mode: the Secret data key holding the tenant's kubeconfig: `value` (Cluster
    /// API), `admin.conf` (Kamaji), `kubeconfig` (HyperShift), `config` (vcluster).
    /// [default: value]
    #[arg(
        long,
        env = "BOOTSTRAP_TENANTS_KUBECONFIG_KEY",
        value_name = "KEY",
        global = true
    )]
    pub tenants_kubeconfig_key: Option<String>,

    /// Management mode: credential plugins (absolute paths, comma-separated) a tenant
    /// kubeconfig's `exec` may run, e.g. `/usr/local/bin/aws-iam-authenticator`. Any other exec
    /// entry is refused. [default: none]
    #[arg(
        long,
        env = "BOOTSTRAP_TENANTS_CREDENTIAL_PLUGINS",
        value_name = "PATHS",
        global = true
    )]
    pub tenants_credential_plugins: Option<String>,
}

/// clap's parser of `--endpoint-reconciler-type`, listing the modes in `--help`.
fn endpoint_reconciler_type_parser() -> impl clap::builder::TypedValueParser<Value = EndpointsMode>
{
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(EndpointsMode::ALL.map(EndpointsMode::as_str)).try_map(
        |name| {
            EndpointsMode::from_name(&name).ok_or_else(|| {
                // PossibleValuesParser lets only the listed names through.
                format!("{name:?} is not an endpoint reconciler type")
            })
        },
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

// ------------------------------------------------------------------------------------------------
// The effective configuration
// ------------------------------------------------------------------------------------------------

/// The effective configuration, after merging flags, file and defaults, and validated.
///
/// Serialises (`config print`) to the same YAML shape the `--config` file accepts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Config {
    /// Empty when not set: no range is assumed (kube-apiserver's 10.0.0.0/24 is not kubeadm's,
    /// k3s' or a managed cluster's); the loops read it from the `kubernetes` ServiceCIDR.
    #[serde(
        rename = "serviceClusterIPRange",
        serialize_with = "ser_cidrs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub service_cluster_ip_range: Vec<IpNet>,
    pub service_node_port_range: PortRange,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub advertise_address: Option<IpAddr>,
    pub secure_port: u16,
    pub kubernetes_service_node_port: u16,
    pub endpoint_reconciler_type: EndpointsMode,
    pub apiserver_count: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<PathBuf>,
    #[serde(rename = "etcdServers", skip_serializing_if = "Vec::is_empty")]
    pub etcd_servers: Vec<String>,
    #[serde(rename = "etcdCAFile", skip_serializing_if = "Option::is_none")]
    pub etcd_ca_file: Option<PathBuf>,
    #[serde(rename = "etcdCertFile", skip_serializing_if = "Option::is_none")]
    pub etcd_cert_file: Option<PathBuf>,
    #[serde(rename = "etcdKeyFile", skip_serializing_if = "Option::is_none")]
    pub etcd_key_file: Option<PathBuf>,
    #[serde(rename = "etcdPrefix")]
    pub etcd_prefix: String,
    /// A tenant's etcd client certificate, from its Secret (management mode); the files are
    /// not used then.
    #[serde(skip)]
    pub etcd_inline_tls: Option<reconcilers::legacy_alloc::etcd::InlineTls>,
    pub dry_run: bool,
    pub timer_only: bool,
    pub admin_addr: SocketAddr,
    pub log_format: LogFormat,
    #[serde(with = "duration_format")]
    pub shutdown_timeout: Duration,
    pub leader_election: LeaderElection,
    /// Management mode, when a Secret selector is set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenants: Option<Tenants>,
    pub loops: Loops,
}

/// Management mode: which Secrets of the management cluster are tenant clusters.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Tenants {
    pub secret_selector: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    pub kubeconfig_key: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub credential_plugins: Vec<PathBuf>,
}

/// The annotation on a tenant's Secret holding its YAML fragment of the configuration file.
pub const TENANT_CONFIG_ANNOTATION: &str = "bootstrap-controller.io/config";

/// Keys of the file that belong to the process, not to one tenant: refused in a fragment.
const PROCESS_WIDE_KEYS: [&str; 6] = [
    "kubeconfig",
    "adminAddr",
    "logFormat",
    "shutdownTimeout",
    "leaderElection",
    "tenants",
];

/// Settings a fragment may not make, because they name files of the controller's filesystem.
const FRAGMENT_FILE_KEYS: [&str; 3] = ["etcdCAFile", "etcdCertFile", "etcdKeyFile"];

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
enum Floor {
    Duration(Duration),
    Count(u64),
}

/// Floors by field name, in every loop section of a fragment (see CONFIG.md).
const FRAGMENT_FLOORS: [(&str, Floor); 4] = [
    ("interval", Floor::Duration(Duration::from_secs(5))),
    ("leaseTTL", Floor::Duration(Duration::from_secs(5))),
    (
        "shutdownProbeWindow",
        Floor::Duration(Duration::from_secs(1)),
    ),
    ("pageSize", Floor::Count(100)),
];

/// The fragment's loop settings below their floors.
fn below_floors(fragment: &serde_json::Value) -> Vec<ConfigError> {
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
/// (`tenants.rs`).
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
    Ok(())
}

/// What every tenant's configuration is made from: the flags and the file as it was read at
/// start. A tenant's fragment is merged over the file (flags still win, as over the file).
#[derive(Debug, Clone)]
pub struct TenantBase {
    args: ConfigArgs,
    file: serde_json::Value,
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
            kubeconfig: None,
            ..args.clone()
        };
        Ok(TenantBase { args, file })
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
        if !config.etcd_servers.is_empty()
            && let Err(why) = validate_tenant_etcd_prefix(&config.etcd_prefix)
        {
            return Err(ConfigErrors(vec![ConfigError::new(
                field("etcdPrefix"),
                format!("{:?} {why}", config.etcd_prefix),
            )]));
        }
        match config.endpoint_reconciler_type {
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

/// The etcd servers and prefix a tenant's fragment sets (`None` without `etcdServers`, or if it
/// does not parse: loading the tenant reports that), normalised for comparison with other
/// tenants': servers lower-cased without a trailing `/`. A prefix that is not a plain key path
/// claims nothing (the tenant is refused for it when it loads).
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
fn yaml_tree(text: &str) -> Result<serde_json::Value, String> {
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
fn deep_merge(base: &mut serde_json::Value, over: serde_json::Value) {
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

/// Inclusive port range, written `BASE-LAST` like kube-apiserver's `--service-node-port-range`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub base: u16,
    pub last: u16,
}

impl PortRange {
    pub fn contains(&self, port: u16) -> bool {
        (self.base..=self.last).contains(&port)
    }

    /// Number of ports in the range.
    pub fn size(&self) -> u32 {
        u32::from(self.last) - u32::from(self.base) + 1
    }
}

impl Default for PortRange {
    fn default() -> Self {
        PortRange {
            base: 30000,
            last: 32767,
        }
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.base, self.last)
    }
}

impl Serialize for PortRange {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// Leader election among replicas of this controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct LeaderElection {
    pub enabled: bool,
    pub lease_name: String,
    pub lease_namespace: String,
    /// Empty means: derive one at start (see `--leader-elect-identity`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub identity: String,
    #[serde(with = "duration_format")]
    pub lease_duration: Duration,
    #[serde(with = "duration_format")]
    pub renew_grace: Duration,
}

impl Default for LeaderElection {
    fn default() -> Self {
        LeaderElection {
            enabled: true,
            lease_name: "bootstrap-controller".to_owned(),
            lease_namespace: "kube-system".to_owned(),
            identity: String::new(),
            lease_duration: Duration::from_secs(15),
            renew_grace: Duration::from_secs(5),
        }
    }
}

/// The loops, in the order they are built: the one list a loop is added to. Each entry is the
/// section's key under `loops` in the file, its field here, and the section type its module owns
/// (which validates it and builds the loop). The ClusterIP repair comes before the NodePort
/// repair, which reads its Service cache.
macro_rules! loop_list {
    ($($key:literal => $field:ident: $section:ty,)+) => {
        /// One section per loop. Loops not listed in the file keep their defaults.
        #[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct Loops {
            $(#[serde(rename = $key)] pub $field: $section,)+
        }

        impl Loops {
            /// Every section with its key under `loops`, in build order.
            pub fn sections(&self) -> Vec<(&'static str, &dyn LoopSection)> {
                vec![$(($key, &self.$field as &dyn LoopSection),)+]
            }
        }
    };
}

loop_list! {
    "systemNamespaces" => system_namespaces: reconcilers::system_namespaces::Section,
    "kubernetesService" => kubernetes_service: reconcilers::kubernetes_service::Section,
    "apiserverEndpoints" => apiserver_endpoints: reconcilers::apiserver_endpoints::Section,
    "serviceCIDR" => service_cidr: reconcilers::service_cidr::Section,
    "clusterIPRepair" => cluster_ip_repair: reconcilers::clusterip_repair::Section,
    "nodePortRepair" => node_port_repair: reconcilers::nodeport_repair::Section,
}

impl Loops {
    fn validate(&self, settings: &Settings, errors: &mut Vec<ConfigError>) {
        for (key, section) in self.sections() {
            section.validate(&format!("loops.{key}"), settings, errors);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The file
// ------------------------------------------------------------------------------------------------

/// The `--config` file. Top-level scalars mirror the flags (a flag wins over its field); the
/// structured sections have no flags.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct FileConfig {
    #[serde(rename = "serviceClusterIPRange")]
    pub service_cluster_ip_range: Option<StringOrList>,
    pub service_node_port_range: Option<String>,
    pub advertise_address: Option<String>,
    pub secure_port: Option<u32>,
    pub kubernetes_service_node_port: Option<u32>,
    pub endpoint_reconciler_type: Option<EndpointsMode>,
    pub apiserver_count: Option<i64>,
    pub kubeconfig: Option<PathBuf>,
    pub etcd_servers: Option<StringOrList>,
    #[serde(rename = "etcdCAFile")]
    pub etcd_ca_file: Option<PathBuf>,
    pub etcd_cert_file: Option<PathBuf>,
    pub etcd_key_file: Option<PathBuf>,
    pub etcd_prefix: Option<String>,
    pub dry_run: Option<bool>,
    pub timer_only: Option<bool>,
    pub admin_addr: Option<String>,
    pub log_format: Option<LogFormat>,
    #[serde(default, with = "duration_format::option")]
    pub shutdown_timeout: Option<Duration>,
    pub leader_election: Option<LeaderElection>,
    pub tenants: Option<TenantsFile>,
    pub loops: Option<Loops>,
}

/// The file's `tenants` section (management mode); the flags `--tenants-*` win over it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TenantsFile {
    pub secret_selector: Option<String>,
    pub namespace: Option<String>,
    pub kubeconfig_key: Option<String>,
    pub credential_plugins: Option<StringOrList>,
}

/// `serviceClusterIPRange` may be written `"a,b"` (like the flag) or as a YAML list.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum StringOrList {
    One(String),
    List(Vec<String>),
}

impl StringOrList {
    fn joined(&self) -> String {
        match self {
            StringOrList::One(one) => one.clone(),
            StringOrList::List(list) => list.join(","),
        }
    }
}

/// Parses the YAML text of a configuration file. Errors name the field path.
pub fn parse_file(text: &str) -> Result<FileConfig, ConfigError> {
    let mut failed_path = None;
    let result = serde_saphyr::with_deserializer_from_str(text, |deserializer| {
        serde_path_to_error::deserialize(deserializer).map_err(|err| {
            failed_path = Some(err.path().to_string());
            err.into_inner()
        })
    });
    match result {
        Ok(file) => Ok(file),
        Err(err) => {
            let path = failed_path
                .filter(|path| path != ".")
                .unwrap_or_else(|| "(file)".to_owned());
            // The first line of serde-saphyr's message is the cause with its location; the rest
            // is a source snippet that is noise in a one-line error.
            let message = err.to_string();
            let first = message.lines().next().unwrap_or("invalid YAML").trim();
            Err(ConfigError::new(path, fix_hint_for_parse_error(first)))
        }
    }
}

fn fix_hint_for_parse_error(message: &str) -> String {
    let message = message.strip_prefix("error: ").unwrap_or(message);
    let hint = if message.contains("unknown field") {
        " (remove it or fix its spelling; `config print` shows every field)"
    } else if message.contains("expected mapping") {
        " (expected fields here, e.g. `name: kube-system` or `interval: 1m`)"
    } else if ["invalid u16", "invalid u32", "invalid u64", "invalid i64"]
        .iter()
        .any(|kind| message.contains(kind))
    {
        " (expected a whole number, e.g. 6443)"
    } else if message.contains("invalid bool") || message.contains("invalid boolean") {
        " (expected true or false)"
    } else {
        ""
    };
    format!("{message}{hint}")
}

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

/// Every problem found in a configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "invalid configuration: {one}"),
            many => {
                write!(f, "invalid configuration ({} problems):", many.len())?;
                for error in many {
                    write!(f, "\n  {error}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for ConfigErrors {}

impl From<ConfigError> for ConfigErrors {
    fn from(error: ConfigError) -> Self {
        ConfigErrors(vec![error])
    }
}

// ------------------------------------------------------------------------------------------------
// Merging and validation
// ------------------------------------------------------------------------------------------------

/// Where a value came from, so errors name the flag or the YAML field the user wrote.
struct Source<T> {
    value: T,
    field: &'static str,
}

/// The `--etcd-*` settings, validated: servers are http(s) URLs, a client certificate comes with
/// its key, the files are readable, and nothing but the servers turns etcd mode on.
fn merge_etcd(
    args: &ConfigArgs,
    file: &FileConfig,
    errors: &mut Vec<ConfigError>,
) -> reconcilers::legacy_alloc::etcd::EtcdConfig {
    let servers_source = pick(
        args.etcd_servers.clone(),
        "--etcd-servers",
        file.etcd_servers.as_ref().map(StringOrList::joined),
        "etcdServers",
    );
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
                    format!("{server:?} is not an etcd URL (expected e.g. https://10.0.0.1:2379)"),
                ));
            }
        }
    }
    let mut path = |flag: Option<&PathBuf>,
                    flag_name: &'static str,
                    field: Option<&PathBuf>,
                    field_name: &'static str| {
        let source = pick(flag.cloned(), flag_name, field.cloned(), field_name)?;
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
    let ca_file = path(
        args.etcd_cafile.as_ref(),
        "--etcd-cafile",
        file.etcd_ca_file.as_ref(),
        "etcdCAFile",
    );
    let cert_file = path(
        args.etcd_certfile.as_ref(),
        "--etcd-certfile",
        file.etcd_cert_file.as_ref(),
        "etcdCertFile",
    );
    let key_file = path(
        args.etcd_keyfile.as_ref(),
        "--etcd-keyfile",
        file.etcd_key_file.as_ref(),
        "etcdKeyFile",
    );
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
    let prefix = match pick(
        args.etcd_prefix.clone(),
        "--etcd-prefix",
        file.etcd_prefix.clone(),
        "etcdPrefix",
    ) {
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
    }
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
        (file.etcd_ca_file.is_some(), "etcdCAFile"),
        (file.etcd_cert_file.is_some(), "etcdCertFile"),
        (file.etcd_key_file.is_some(), "etcdKeyFile"),
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

fn pick<T>(
    flag: Option<T>,
    flag_name: &'static str,
    file: Option<T>,
    file_field: &'static str,
) -> Option<Source<T>> {
    match (flag, file) {
        (Some(value), _) => Some(Source {
            value,
            field: flag_name,
        }),
        (None, Some(value)) => Some(Source {
            value,
            field: file_field,
        }),
        (None, None) => None,
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
        })
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
            endpoint_mode: self.endpoint_reconciler_type,
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
        }
    }

    /// Reads `--config` (if any), merges it with the flags and the defaults, and validates.
    pub fn load(args: &ConfigArgs) -> Result<Config, ConfigErrors> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        Config::merge(args, file)
    }

    /// Merges flags over a parsed file over defaults, and validates the result.
    pub fn merge(args: &ConfigArgs, file: FileConfig) -> Result<Config, ConfigErrors> {
        let mut errors = Vec::new();

        let service_cluster_ip_range = match pick(
            args.service_cluster_ip_range.clone(),
            "--service-cluster-ip-range",
            file.service_cluster_ip_range
                .as_ref()
                .map(StringOrList::joined),
            "serviceClusterIPRange",
        ) {
            Some(source) => parse_service_cidrs(&source.value)
                .map_err(|message| errors.push(ConfigError::new(source.field, message)))
                .unwrap_or_default(),
            None => Vec::new(),
        };

        let service_node_port_range = match pick(
            args.service_node_port_range.clone(),
            "--service-node-port-range",
            file.service_node_port_range.clone(),
            "serviceNodePortRange",
        ) {
            Some(source) => parse_port_range(&source.value)
                .map_err(|err| errors.push(ConfigError::new(source.field, err.to_string())))
                .unwrap_or_default(),
            None => PortRange::default(),
        };

        let advertise_address_source = pick(
            args.advertise_address.clone(),
            "--advertise-address",
            file.advertise_address.clone(),
            "advertiseAddress",
        );
        let advertise_address = advertise_address_source.as_ref().and_then(|source| {
            let text = source.value.trim();
            match text.parse::<IpAddr>() {
                Ok(ip) if ip.is_unspecified() || ip.is_loopback() || ip.is_multicast() => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!(
                            "{text:?} cannot be advertised to the cluster (use the apiserver's \
                             routable address, e.g. 192.168.1.10)"
                        ),
                    ));
                    None
                }
                Ok(ip) => Some(ip),
                Err(_) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!(
                            "{text:?} is not an IP address (expected e.g. 192.168.1.10 or \
                             fd00::10)"
                        ),
                    ));
                    None
                }
            }
        });

        let secure_port = match pick(
            args.secure_port.as_deref().map(parse_u32),
            "--secure-port",
            file.secure_port.map(Ok),
            "securePort",
        ) {
            Some(source) => match source.value {
                Ok(port @ 1..=65535) => u16::try_from(port).unwrap_or(6443),
                Ok(port) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!("{port} is not a valid port (expected 1-65535, e.g. 6443)"),
                    ));
                    6443
                }
                Err(NotANumber(text)) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!("{text:?} is not a port number (expected 1-65535, e.g. 6443)"),
                    ));
                    6443
                }
            },
            None => 6443,
        };

        let node_port_source = pick(
            args.kubernetes_service_node_port.as_deref().map(parse_u32),
            "--kubernetes-service-node-port",
            file.kubernetes_service_node_port.map(Ok),
            "kubernetesServiceNodePort",
        );
        let kubernetes_service_node_port = match node_port_source {
            Some(source) => match source.value {
                Ok(0) => 0,
                Ok(port) => match u16::try_from(port) {
                    Ok(port) if service_node_port_range.contains(port) => port,
                    _ => {
                        errors.push(ConfigError::new(
                            source.field,
                            format!(
                                "{port} is outside the node port range {service_node_port_range} \
                                 (use 0 for a ClusterIP Service, or a port inside \
                                 --service-node-port-range)"
                            ),
                        ));
                        0
                    }
                },
                Err(text) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!(
                            "{text:?} is not a port number (use 0 for a ClusterIP Service, or a \
                             port inside {service_node_port_range})"
                        ),
                    ));
                    0
                }
            },
            None => 0,
        };

        let endpoint_reconciler_type = args
            .endpoint_reconciler_type
            .or(file.endpoint_reconciler_type)
            .unwrap_or_default();

        let apiserver_count = match pick(
            args.apiserver_count
                .as_deref()
                .map(|text| text.trim().parse::<i64>().map_err(|_| text.to_owned())),
            "--apiserver-count",
            file.apiserver_count.map(Ok),
            "apiserverCount",
        ) {
            Some(source) => match source.value {
                Ok(count) if count > 0 => u32::try_from(count).unwrap_or(u32::MAX),
                Ok(count) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!(
                            "should be a positive number, but {count} was given (e.g. 3 for \
                             three apiservers)"
                        ),
                    ));
                    1
                }
                Err(text) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!("{text:?} is not a number (expected a positive count, e.g. 3)"),
                    ));
                    1
                }
            },
            None => 1,
        };

        // The public address must be reachable over the primary service family (upstream's
        // validatePublicIPServiceClusterIPRangeIPFamilies), unless no endpoints are written.
        if let (Some(address), Some(primary), Some(source)) = (
            advertise_address,
            service_cluster_ip_range.first(),
            advertise_address_source.as_ref(),
        ) && endpoint_reconciler_type != EndpointsMode::None
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

        let admin_addr = match pick(
            args.admin_addr.clone(),
            "--admin-addr",
            file.admin_addr.clone(),
            "adminAddr",
        ) {
            Some(source) => match source.value.trim().parse::<SocketAddr>() {
                Ok(addr) => addr,
                Err(_) => {
                    errors.push(ConfigError::new(
                        source.field,
                        format!(
                            "{:?} is not an address:port (expected e.g. 0.0.0.0:8080 or \
                             [::]:8080)",
                            source.value
                        ),
                    ));
                    default_admin_addr()
                }
            },
            None => default_admin_addr(),
        };

        let shutdown_timeout = match pick(
            args.shutdown_timeout.as_deref().map(parse_duration),
            "--shutdown-timeout",
            file.shutdown_timeout.map(Ok),
            "shutdownTimeout",
        ) {
            Some(source) => match source.value {
                Ok(timeout) if !timeout.is_zero() => timeout,
                Ok(_) => {
                    errors.push(ConfigError::new(
                        source.field,
                        "must be greater than zero (e.g. 30s)",
                    ));
                    default_shutdown_timeout()
                }
                Err(err) => {
                    errors.push(ConfigError::new(source.field, err.to_string()));
                    default_shutdown_timeout()
                }
            },
            None => default_shutdown_timeout(),
        };

        let mut leader_election = file.leader_election.clone().unwrap_or_default();
        let file_has_leader_section = file.leader_election.is_some();
        let le_field = |flag: &'static str, field: &'static str, from_flag: bool| {
            if from_flag || !file_has_leader_section {
                flag
            } else {
                field
            }
        };
        if let Some(enabled) = args.leader_elect {
            leader_election.enabled = enabled;
        }
        if let Some(name) = &args.leader_elect_lease_name {
            leader_election.lease_name = name.clone();
        }
        if let Some(namespace) = &args.leader_elect_lease_namespace {
            leader_election.lease_namespace = namespace.clone();
        }
        if let Some(identity) = &args.leader_elect_identity {
            leader_election.identity = identity.clone();
        }
        let mut duration_from_flag = false;
        if let Some(text) = &args.leader_elect_lease_duration {
            duration_from_flag = true;
            match parse_duration(text) {
                Ok(duration) => leader_election.lease_duration = duration,
                Err(err) => errors.push(ConfigError::new(
                    "--leader-elect-lease-duration",
                    err.to_string(),
                )),
            }
        }
        let mut grace_from_flag = false;
        if let Some(text) = &args.leader_elect_renew_grace {
            grace_from_flag = true;
            match parse_duration(text) {
                Ok(duration) => leader_election.renew_grace = duration,
                Err(err) => errors.push(ConfigError::new(
                    "--leader-elect-renew-grace",
                    err.to_string(),
                )),
            }
        }
        if leader_election.enabled {
            if let Err(why) = validate_dns1123_subdomain(&leader_election.lease_name) {
                errors.push(ConfigError::new(
                    le_field(
                        "--leader-elect-lease-name",
                        "leaderElection.leaseName",
                        args.leader_elect_lease_name.is_some(),
                    ),
                    format!(
                        "{:?} is not a valid Lease name: {why} (expected e.g. \
                         bootstrap-controller)",
                        leader_election.lease_name
                    ),
                ));
            }
            if let Err(why) = validate_dns1123_label(&leader_election.lease_namespace) {
                errors.push(ConfigError::new(
                    le_field(
                        "--leader-elect-lease-namespace",
                        "leaderElection.leaseNamespace",
                        args.leader_elect_lease_namespace.is_some(),
                    ),
                    format!(
                        "{:?} is not a valid namespace name: {why} (expected e.g. kube-system)",
                        leader_election.lease_namespace
                    ),
                ));
            }
            // A Lease holds whole seconds (leaseDurationSeconds).
            if leader_election.lease_duration.as_secs() < 2 {
                errors.push(ConfigError::new(
                    le_field(
                        "--leader-elect-lease-duration",
                        "leaderElection.leaseDuration",
                        duration_from_flag,
                    ),
                    "must be at least 2s (e.g. 15s)",
                ));
            } else if leader_election.renew_grace.as_secs() < 1
                || leader_election.renew_grace >= leader_election.lease_duration
            {
                errors.push(ConfigError::new(
                    le_field(
                        "--leader-elect-renew-grace",
                        "leaderElection.renewGrace",
                        grace_from_flag,
                    ),
                    format!(
                        "must be at least 1s and shorter than the lease duration ({}) (e.g. 5s \
                         with a 15s lease)",
                        format_duration(leader_election.lease_duration)
                    ),
                ));
            }
        }

        let etcd = merge_etcd(args, &file, &mut errors);
        let tenants = merge_tenants(args, file.tenants.as_ref(), &mut errors);
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
            kubeconfig: args.kubeconfig.clone().or(file.kubeconfig.clone()),
            etcd_servers: etcd.servers,
            etcd_ca_file: etcd.ca_file,
            etcd_cert_file: etcd.cert_file,
            etcd_key_file: etcd.key_file,
            etcd_prefix: etcd.prefix,
            etcd_inline_tls: None,
            dry_run: args.dry_run.or(file.dry_run).unwrap_or(false),
            timer_only: args.timer_only.or(file.timer_only).unwrap_or(false),
            admin_addr,
            log_format: args.log_format.or(file.log_format).unwrap_or_default(),
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

    /// The leader-election identity to use: the configured one, else `$POD_NAME` or the host
    /// name plus a random suffix, so two processes on one host never share an identity.
    ///
    /// The derived identity is computed once per process, so every caller (leader election,
    /// membership Leases, event reporters) agrees on it.
    pub fn leader_identity(&self) -> String {
        if !self.leader_election.identity.is_empty() {
            return self.leader_election.identity.clone();
        }
        static DERIVED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        DERIVED.get_or_init(derive_identity).clone()
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

fn derive_identity() -> String {
    let base = host_name().unwrap_or_else(|| "bootstrap-controller".to_owned());
    let suffix: u32 = rand::random();
    format!("{base}_{suffix:08x}")
}

/// Management mode's settings: flags over the file's `tenants` section. `None` when no
/// selector is set (the one cluster of `--kubeconfig`).
fn merge_tenants(
    args: &ConfigArgs,
    file: Option<&TenantsFile>,
    errors: &mut Vec<ConfigError>,
) -> Option<Tenants> {
    let selector = pick(
        args.tenants_secret_selector.clone(),
        "--tenants-secret-selector",
        file.and_then(|f| f.secret_selector.clone()),
        "tenants.secretSelector",
    );
    let namespace = pick(
        args.tenants_namespace.clone(),
        "--tenants-namespace",
        file.and_then(|f| f.namespace.clone()),
        "tenants.namespace",
    );
    let key = pick(
        args.tenants_kubeconfig_key.clone(),
        "--tenants-kubeconfig-key",
        file.and_then(|f| f.kubeconfig_key.clone()),
        "tenants.kubeconfigKey",
    );
    let plugins = pick(
        args.tenants_credential_plugins.clone(),
        "--tenants-credential-plugins",
        file.and_then(|f| f.credential_plugins.as_ref().map(StringOrList::joined)),
        "tenants.credentialPlugins",
    );
    let Some(selector) = selector else {
        for source in [namespace, key, plugins].into_iter().flatten() {
            errors.push(ConfigError::new(
                source.field,
                "only means something in management mode: set --tenants-secret-selector                  (tenants.secretSelector) too, or leave it out",
            ));
        }
        return None;
    };
    let selector_text = selector.value.trim().to_owned();
    if selector_text.is_empty() {
        errors.push(ConfigError::new(
            selector.field,
            "must not be empty: a label selector every tenant kubeconfig Secret matches (e.g.              cluster.x-k8s.io/cluster-name)",
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
    let kubeconfig_key = match key {
        Some(source) => {
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
                        "{:?} is not a Secret data key (letters, digits, '-', '_' and '.';                          e.g. value, admin.conf, kubeconfig, config)",
                        source.value
                    ),
                ));
            }
            source.value
        }
        None => DEFAULT_TENANTS_KUBECONFIG_KEY.to_owned(),
    };
    let mut credential_plugins = Vec::new();
    if let Some(source) = plugins {
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
    }
    Some(Tenants {
        secret_selector: selector_text,
        namespace,
        kubeconfig_key,
        credential_plugins,
    })
}

/// Checks a label selector as `kubectl get -l` writes it (`k`, `!k`, `k=v`, `k==v`, `k!=v`,
/// `k in (a,b)`, `k notin (a,b)`, joined by commas), so a typo is a configuration error at
/// start rather than a refused list later.
fn validate_label_selector(selector: &str) -> Result<(), String> {
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

fn read_file(path: &Path) -> Result<FileConfig, ConfigErrors> {
    let text = std::fs::read_to_string(path).map_err(|err| {
        ConfigError::new(
            "--config",
            format!(
                "cannot read {}: {err} (check the path, or leave --config out to use the \
                 defaults)",
                path.display()
            ),
        )
    })?;
    parse_file(&text).map_err(|err| {
        ConfigErrors(vec![ConfigError::new(
            err.field,
            format!("{} (in {})", err.message, path.display()),
        )])
    })
}

fn default_admin_addr() -> SocketAddr {
    SocketAddr::from(([0, 0, 0, 0], 8080))
}

fn default_shutdown_timeout() -> Duration {
    Duration::from_secs(30)
}

/// `Err` holds the text that is no number, for the message.
fn parse_u32(text: &str) -> Result<u32, NotANumber> {
    text.trim()
        .parse::<u32>()
        .map_err(|_| NotANumber(text.to_owned()))
}

/// A flag's text that is not a number.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotANumber(pub String);

/// A flag's or field's value that does not parse; the message says what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValueError {
    #[error("{0:?} is not a port range {PORT_RANGE_HINT}")]
    NotAPortRange(String),
    #[error("{text:?} is inverted: {base} is above {last} {PORT_RANGE_HINT}")]
    InvertedPortRange { text: String, base: u16, last: u16 },
    #[error("{0:?} is not a port range of ports 1-65535 {PORT_RANGE_HINT}")]
    PortsOutOfRange(String),
    #[error(
        "is empty (expected one CIDR such as 10.96.0.0/12, or two of different families such as 10.96.0.0/12,fd00:10:96::/108)"
    )]
    NoCidr,
    #[error("{0:?} is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)")]
    NotACidr(String),
    #[error("{text:?} has host bits set (did you mean {network}?)")]
    HostBits { text: String, network: IpNet },
    /// Parsed, but not a usable set of service ranges: the message of
    /// [`reconcilers::service_range::RangeError`].
    #[error("{0}")]
    Ranges(String),
}

const PORT_RANGE_HINT: &str = "(expected BASE-LAST with BASE <= LAST, e.g. 30000-32767)";

/// Parses `--service-cluster-ip-range`: one CIDR, or two of different families, each holding at
/// least 8 addresses (kube-apiserver's rules, checked by
/// [`reconcilers::service_range::validate_ranges`]).
pub fn parse_service_cidrs(text: &str) -> Result<Vec<IpNet>, ValueError> {
    let parts: Vec<&str> = text.split(',').map(str::trim).collect();
    if parts.iter().all(|part| part.is_empty()) {
        return Err(ValueError::NoCidr);
    }
    let mut cidrs = Vec::with_capacity(parts.len());
    for part in parts {
        let cidr: IpNet = part
            .parse()
            .map_err(|_| ValueError::NotACidr(part.to_owned()))?;
        if cidr.trunc() != cidr {
            return Err(ValueError::HostBits {
                text: part.to_owned(),
                network: cidr.trunc(),
            });
        }
        cidrs.push(cidr);
    }
    reconcilers::service_range::validate_ranges(&cidrs)
        .map_err(|problem| ValueError::Ranges(problem.to_string()))?;
    Ok(cidrs)
}

/// Parses `BASE-LAST` (inclusive), e.g. `30000-32767`.
pub fn parse_port_range(text: &str) -> Result<PortRange, ValueError> {
    let Some((base, last)) = text.trim().split_once('-') else {
        return Err(ValueError::NotAPortRange(text.to_owned()));
    };
    let parse = |part: &str| part.trim().parse::<u16>().ok().filter(|port| *port > 0);
    match (parse(base), parse(last)) {
        (Some(base), Some(last)) if base <= last => Ok(PortRange { base, last }),
        (Some(base), Some(last)) => Err(ValueError::InvertedPortRange {
            text: text.to_owned(),
            base,
            last,
        }),
        _ => Err(ValueError::PortsOutOfRange(text.to_owned())),
    }
}

/// `a,b`, as the flag takes it.
pub fn format_cidrs(cidrs: &[IpNet]) -> String {
    cidrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

fn ser_cidrs<S: serde::Serializer>(cidrs: &[IpNet], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&format_cidrs(cidrs))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        let file = parse_file(text).map_err(ConfigErrors::from)?;
        Config::merge(&ConfigArgs::default(), file)
    }

    fn single_error(result: Result<Config, ConfigErrors>) -> ConfigError {
        let errors = result.expect_err("configuration should be rejected").0;
        assert_eq!(
            errors.len(),
            1,
            "expected exactly one error, got {errors:?}"
        );
        errors.into_iter().next().unwrap()
    }

    #[test]
    fn kubernetes_service_and_endpoints_sections() {
        let config = from_yaml(
            "advertiseAddress: 10.0.0.1\nloops:\n  kubernetesService:\n    port: 8443\n    repair: off\n    recreateOnClusterIPMismatch: true\n  apiserverEndpoints:\n    leaseTTL: 30s\n    readyzURL: https://127.0.0.1:6443/readyz\n",
        )
        .unwrap();
        assert_eq!(config.loops.kubernetes_service.port, 8443);
        assert_eq!(
            config.loops.kubernetes_service.repair,
            reconcilers::kubernetes_service::RepairPolicy::Off
        );
        assert!(
            config
                .loops
                .kubernetes_service
                .recreate_on_cluster_ip_mismatch
        );
        assert_eq!(
            config.loops.apiserver_endpoints.lease_ttl,
            Duration::from_secs(30)
        );

        let error = single_error(from_yaml(
            "advertiseAddress: 10.0.0.1\nloops:\n  apiserverEndpoints:\n    leaseTTL: 10s\n",
        ));
        assert_eq!(error.field, "loops.apiserverEndpoints.leaseTTL");

        let error = single_error(from_yaml(
            "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    staticAddresses: [10.0.0.1, \"https://lb:6443\"]\n",
        ));
        assert_eq!(error.field, "loops.apiserverEndpoints.staticAddresses[1]");

        let error = single_error(from_yaml("endpointReconcilerType: static\n"));
        assert_eq!(error.field, "loops.apiserverEndpoints.staticAddresses");

        // A valid static list is accepted and reaches the loop's configuration.
        let config = from_yaml(
            "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    staticAddresses: [192.0.2.1, lb.example.com]\n",
        )
        .expect("a valid static configuration");
        assert_eq!(
            config
                .loops
                .apiserver_endpoints
                .loop_config(&config.settings())
                .static_addresses,
            ["192.0.2.1", "lb.example.com"]
        );

        let error = single_error(from_yaml(
            "advertiseAddress: 10.0.0.1\nloops:\n  apiserverEndpoints:\n    readyzURL: localhost:6443\n",
        ));
        assert_eq!(error.field, "loops.apiserverEndpoints.readyzURL");

        let error = single_error(from_yaml(
            "loops:\n  kubernetesService:\n    name: Kubernetes\n",
        ));
        assert_eq!(error.field, "loops.kubernetesService.name");

        let error = single_error(from_yaml("advertiseAddress: 127.0.0.1\n"));
        assert_eq!(error.field, "advertiseAddress");
    }

    #[test]
    fn defaults_match_upstream() {
        let config = Config::merge(&ConfigArgs::default(), FileConfig::default()).unwrap();
        assert_eq!(
            config.service_node_port_range,
            PortRange {
                base: 30000,
                last: 32767
            }
        );
        assert_eq!(config.secure_port, 6443);
        assert_eq!(config.endpoint_reconciler_type, EndpointsMode::Lease);
        assert_eq!(config.admin_addr, "0.0.0.0:8080".parse().unwrap());
        assert_eq!(
            config.loops.system_namespaces.interval,
            Duration::from_secs(60)
        );
        assert_eq!(
            config.loops.kubernetes_service.interval,
            Duration::from_secs(10)
        );
        assert_eq!(
            config.loops.apiserver_endpoints.interval,
            Duration::from_secs(10)
        );
        assert_eq!(config.loops.service_cidr.interval, Duration::from_secs(10));
        assert_eq!(
            config.loops.cluster_ip_repair.interval,
            Duration::from_secs(180)
        );
        let names: Vec<_> = config
            .loops
            .system_namespaces
            .namespaces
            .iter()
            .map(|ns| ns.name.as_str())
            .collect();
        assert_eq!(
            names,
            ["kube-system", "kube-public", "kube-node-lease", "default"]
        );
        assert!(config.leader_election.enabled);
        assert!(!config.dry_run);
        assert_eq!(
            config.service_cluster_ip_range,
            [],
            "no range is assumed: it is read from the cluster"
        );
        assert!(config.settings().service_ranges.is_empty());
        let printed = config.to_yaml().unwrap();
        assert!(!printed.contains("serviceClusterIPRange"), "{printed}");
        let set = from_yaml("serviceClusterIPRange: 10.96.0.0/12\n").unwrap();
        assert_eq!(
            set.service_cluster_ip_range,
            ["10.96.0.0/12".parse().unwrap()]
        );
    }

    #[test]
    fn bad_cidr_names_field_and_fix() {
        let error = single_error(from_yaml("serviceClusterIPRange: 10.0.0.0/33\n"));
        assert_eq!(error.field, "serviceClusterIPRange");
        assert_eq!(
            error.to_string(),
            "serviceClusterIPRange: \"10.0.0.0/33\" is not a valid CIDR (expected e.g. \
             10.96.0.0/12 or fd00:10:96::/108)"
        );
    }

    #[test]
    fn bad_cidr_from_flag_names_flag() {
        let args = ConfigArgs {
            service_cluster_ip_range: Some("banana".to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--service-cluster-ip-range");
        assert!(error.message.contains("not a valid CIDR"), "{error}");
    }

    #[test]
    fn two_cidrs_of_one_family_rejected() {
        let error = single_error(from_yaml(
            "serviceClusterIPRange: 10.96.0.0/12,10.200.0.0/16\n",
        ));
        assert_eq!(error.field, "serviceClusterIPRange");
        assert!(error.message.contains("two IPv4 ranges"), "{error}");
        let error = single_error(from_yaml(
            "serviceClusterIPRange: [fd00::/108, fd01::/108]\n",
        ));
        assert!(error.message.contains("two IPv6 ranges"), "{error}");
    }

    #[test]
    fn dual_stack_and_small_ranges() {
        let config =
            from_yaml("serviceClusterIPRange: [10.96.0.0/12, fd00:10:96::/108]\n").unwrap();
        assert_eq!(config.service_cluster_ip_range.len(), 2);
        let error = single_error(from_yaml("serviceClusterIPRange: 10.0.0.0/30\n"));
        assert!(error.message.contains("fewer than 8"), "{error}");
        assert!(parse_service_cidrs("10.0.0.0/29").is_ok());
        assert!(
            parse_service_cidrs("10.0.0.1/24")
                .unwrap_err()
                .to_string()
                .contains("host bits")
        );
        assert!(parse_service_cidrs("10.0.0.0/24,fd00::/64,10.1.0.0/24").is_err());
    }

    #[test]
    fn inverted_port_range_rejected() {
        let error = single_error(from_yaml("serviceNodePortRange: 32767-30000\n"));
        assert_eq!(error.field, "serviceNodePortRange");
        assert!(error.message.contains("inverted"), "{error}");
        assert!(error.message.contains("e.g. 30000-32767"), "{error}");
        let args = ConfigArgs {
            service_node_port_range: Some("40000-30000".to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--service-node-port-range");
        assert_eq!(parse_port_range("30000-30000").unwrap().size(), 1);
        assert!(parse_port_range("0-10").is_err());
        assert!(parse_port_range("30000").is_err());
    }

    #[test]
    fn zero_interval_rejected() {
        let error = single_error(from_yaml("loops:\n  systemNamespaces:\n    interval: 0s\n"));
        assert_eq!(error.field, "loops.systemNamespaces.interval");
        assert!(error.message.contains("greater than zero"), "{error}");
        let error = single_error(from_yaml("loops:\n  clusterIPRepair:\n    interval: 0ms\n"));
        assert_eq!(error.field, "loops.clusterIPRepair.interval");
    }

    #[test]
    fn cluster_ip_repair_mode_and_grace_period() {
        let config =
            from_yaml("loops:\n  clusterIPRepair:\n    mode: audit\n    orphanGracePeriod: 2m\n")
                .expect("valid");
        assert_eq!(
            config.loops.cluster_ip_repair.mode,
            reconcilers::clusterip_repair::RepairMode::Audit
        );
        assert_eq!(
            config.loops.cluster_ip_repair.orphan_grace_period,
            Duration::from_secs(120)
        );
        assert_eq!(
            reconcilers::clusterip_repair::Section::default().mode,
            reconcilers::clusterip_repair::RepairMode::Auto
        );
        let error = single_error(from_yaml(
            "loops:\n  clusterIPRepair:\n    orphanGracePeriod: 1s\n",
        ));
        assert_eq!(error.field, "loops.clusterIPRepair.orphanGracePeriod");
        assert!(error.message.contains("60s"), "{error}");
        let error = single_error(from_yaml(
            "loops:\n  clusterIPRepair:\n    mode: sometimes\n",
        ));
        assert!(error.field.starts_with("loops.clusterIPRepair"), "{error}");
    }

    #[test]
    fn node_port_repair_page_size() {
        let config = from_yaml("loops:\n  nodePortRepair:\n    pageSize: 50\n").expect("valid");
        assert_eq!(config.loops.node_port_repair.page_size, 50);
        assert_eq!(
            config.loops.cluster_ip_repair.page_size, 500,
            "each repair has its own page size"
        );
        let error = single_error(from_yaml("loops:\n  nodePortRepair:\n    pageSize: 0\n"));
        assert_eq!(error.field, "loops.nodePortRepair.pageSize");
    }

    #[test]
    fn cluster_ip_repair_page_size() {
        assert_eq!(
            reconcilers::clusterip_repair::Section::default().page_size,
            500
        );
        let config = from_yaml("loops:\n  clusterIPRepair:\n    pageSize: 500\n").expect("valid");
        assert_eq!(config.loops.cluster_ip_repair.page_size, 500);
        let error = single_error(from_yaml("loops:\n  clusterIPRepair:\n    pageSize: 0\n"));
        assert_eq!(error.field, "loops.clusterIPRepair.pageSize");
        assert!(error.message.contains("at least 1"), "{error}");
        let error = single_error(from_yaml("loops:\n  clusterIPRepair:\n    pageSize: -1\n"));
        assert!(error.field.starts_with("loops.clusterIPRepair"), "{error}");
    }

    #[test]
    fn unparsable_interval_names_path() {
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    interval: soon\n",
        ));
        assert_eq!(error.field, "loops.systemNamespaces.interval");
        assert!(error.message.contains("e.g. 10s"), "{error}");
    }

    #[test]
    fn unknown_field_names_its_path() {
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    intervall: 1m\n",
        ));
        assert_eq!(error.field, "loops.systemNamespaces.intervall");
        assert!(
            error.message.contains("unknown field `intervall`"),
            "{error}"
        );
        assert!(error.message.contains("expected one of"), "{error}");
        let error = single_error(from_yaml("servicClusterIPRange: 10.0.0.0/24\n"));
        assert!(
            error
                .message
                .contains("unknown field `servicClusterIPRange`"),
            "{error}"
        );
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labls: {}\n",
        ));
        assert_eq!(error.field, "loops.systemNamespaces.namespaces[0].labls");
    }

    #[test]
    fn invalid_namespace_name_rejected() {
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: kube-system\n      - name: Kube_Public\n",
        ));
        assert_eq!(error.field, "loops.systemNamespaces.namespaces[1].name");
        assert!(error.message.contains("DNS-1123"), "{error}");
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n      - name: a\n",
        ));
        assert!(error.message.contains("listed twice"), "{error}");
    }

    #[test]
    fn invalid_labels_rejected() {
        let error = single_error(from_yaml(
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labels:\n          \"bad key!\": x\n",
        ));
        assert_eq!(error.field, "loops.systemNamespaces.namespaces[0].labels");
        let ok = from_yaml(
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labels:\n          example.com/team: core\n        annotations:\n          example.com/owner: \"Jane Doe <jane@example.com>\"\n",
        )
        .unwrap();
        assert_eq!(
            ok.loops.system_namespaces.namespaces[0].labels["example.com/team"],
            "core"
        );
    }

    #[test]
    fn etcd_settings_are_validated_and_name_the_field() {
        assert!(from_yaml("{}").unwrap().etcd().is_none());

        let config =
            from_yaml("etcdServers: https://10.0.0.1:2379,http://10.0.0.2:2379\n").unwrap();
        let etcd = config.etcd().unwrap();
        assert_eq!(etcd.servers.len(), 2);
        assert_eq!(etcd.prefix, "/registry");

        let args = ConfigArgs {
            etcd_servers: Some("10.0.0.1:2379".to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--etcd-servers");
        assert!(error.message.contains("https://10.0.0.1:2379"), "{error}");

        let error = single_error(from_yaml("etcdCAFile: /etc/kubernetes/pki/etcd/ca.crt\n"));
        assert_eq!(error.field, "etcdCAFile");
        assert!(error.message.contains("--etcd-servers"), "{error}");

        let dir = tempfile::tempdir().unwrap();
        let cert = dir.path().join("client.crt");
        std::fs::write(&cert, "pem").unwrap();
        let args = ConfigArgs {
            etcd_servers: Some("https://127.0.0.1:2379".to_owned()),
            etcd_certfile: Some(cert.clone()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--etcd-certfile");
        assert!(error.message.contains("--etcd-keyfile"), "{error}");

        let args = ConfigArgs {
            etcd_servers: Some("https://127.0.0.1:2379".to_owned()),
            etcd_certfile: Some(cert.clone()),
            etcd_keyfile: Some(dir.path().join("missing.key")),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--etcd-keyfile");
        assert!(error.message.contains("missing.key"), "{error}");

        let error = single_error(from_yaml(
            "etcdServers: [\"http://127.0.0.1:2379\"]\netcdPrefix: registry\n",
        ));
        assert_eq!(error.field, "etcdPrefix");
    }

    #[test]
    fn node_port_must_be_in_range() {
        let error = single_error(from_yaml("kubernetesServiceNodePort: 80\n"));
        assert_eq!(error.field, "kubernetesServiceNodePort");
        assert!(error.message.contains("30000-32767"), "{error}");
        let config = from_yaml("kubernetesServiceNodePort: 30443\n").unwrap();
        assert_eq!(config.kubernetes_service_node_port, 30443);
    }

    #[test]
    fn apiserver_count_and_advertise_address() {
        let error = single_error(from_yaml("apiserverCount: 0\n"));
        assert_eq!(error.field, "apiserverCount");
        let error = single_error(from_yaml(
            "serviceClusterIPRange: 10.96.0.0/12\nadvertiseAddress: fd00::1\n",
        ));
        assert_eq!(error.field, "advertiseAddress");
        assert!(error.message.contains("IPv6"), "{error}");
        let config =
            from_yaml("advertiseAddress: fd00::1\nendpointReconcilerType: none\n").unwrap();
        assert_eq!(config.advertise_address, Some("fd00::1".parse().unwrap()));
        let error = single_error(from_yaml("advertiseAddress: not-an-ip\n"));
        assert!(error.message.contains("not an IP"), "{error}");
    }

    #[test]
    fn all_errors_reported_at_once() {
        let errors = from_yaml(
            "serviceClusterIPRange: x\nserviceNodePortRange: 2-1\nloops:\n  systemNamespaces:\n    interval: 0s\n",
        )
        .unwrap_err();
        assert_eq!(errors.0.len(), 3, "{errors}");
        assert!(errors.to_string().contains("3 problems"));
    }

    #[test]
    fn tenants_settings_from_flags_and_file_are_validated() {
        let config = from_yaml(
            "tenants:\n  secretSelector: cluster.x-k8s.io/cluster-name\n  namespace: capi\n",
        )
        .unwrap();
        assert_eq!(
            config.tenants,
            Some(Tenants {
                secret_selector: "cluster.x-k8s.io/cluster-name".to_owned(),
                namespace: Some("capi".to_owned()),
                kubeconfig_key: "value".to_owned(),
                credential_plugins: Vec::new(),
            })
        );
        assert_eq!(from_yaml("{}\n").unwrap().tenants, None);
        for selector in [
            "a=b,c!=d",
            "!legacy",
            "tier in (a, b),env notin (dev)",
            "example.com/x==y",
        ] {
            let args = ConfigArgs {
                tenants_secret_selector: Some(selector.to_owned()),
                ..ConfigArgs::default()
            };
            assert!(
                Config::merge(&args, FileConfig::default()).is_ok(),
                "{selector}"
            );
        }
        for (selector, field) in [
            ("a=b,,c", "--tenants-secret-selector"),
            ("tier in a,b", "--tenants-secret-selector"),
            ("-bad-=x", "--tenants-secret-selector"),
            ("  ", "--tenants-secret-selector"),
        ] {
            let args = ConfigArgs {
                tenants_secret_selector: Some(selector.to_owned()),
                ..ConfigArgs::default()
            };
            let error = single_error(Config::merge(&args, FileConfig::default()));
            assert_eq!(error.field, field, "{selector}: {error}");
        }
        let args = ConfigArgs {
            tenants_namespace: Some("capi".to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--tenants-namespace");
        assert!(
            error.message.contains("--tenants-secret-selector"),
            "{error}"
        );
        let error = single_error(from_yaml(
            "tenants:\n  secretSelector: a=b\n  kubeconfigKey: \"admin conf\"\n",
        ));
        assert_eq!(error.field, "tenants.kubeconfigKey");
    }

    fn tenant_base(file: &str) -> TenantBase {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, file).unwrap();
        let args = ConfigArgs {
            config: Some(path),
            tenants_secret_selector: Some("a=b".to_owned()),
            ..ConfigArgs::default()
        };
        TenantBase::load(&args).unwrap()
    }

    #[test]
    fn a_tenant_fragment_merges_over_the_file_and_is_validated_as_the_file() {
        let base = tenant_base(
            "serviceClusterIPRange: 10.96.0.0/12\ntenants:\n  secretSelector: a=b\nloops:\n  systemNamespaces:\n    interval: 5s\n",
        );
        let defaults = base.tenant(None).unwrap();
        assert_eq!(defaults.endpoint_reconciler_type, EndpointsMode::None);
        assert_eq!(defaults.tenants, None, "a tenant is one cluster");
        assert_eq!(
            defaults.service_cluster_ip_range,
            vec!["10.96.0.0/12".parse::<IpNet>().unwrap()]
        );
        let tenant = base
            .tenant(Some(
                "serviceClusterIPRange: 10.100.0.0/16\nloops:\n  nodePortRepair:\n    enabled: false\n",
            ))
            .unwrap();
        assert_eq!(
            tenant.service_cluster_ip_range,
            vec!["10.100.0.0/16".parse::<IpNet>().unwrap()]
        );
        assert!(!tenant.loops.node_port_repair.enabled);
        // What the fragment leaves out comes from the file, key by key.
        assert_eq!(
            tenant.loops.system_namespaces.interval,
            Duration::from_secs(5)
        );

        let error = single_error(base.tenant(Some("serviceClusterIPRange: 10.0.0.0/33\n")));
        assert_eq!(
            error.field,
            "bootstrap-controller.io/config: serviceClusterIPRange"
        );
        let error = single_error(base.tenant(Some("loops:\n  nope: {}\n")));
        assert!(
            error
                .field
                .starts_with("bootstrap-controller.io/config: loops"),
            "{error}"
        );
        let error = single_error(base.tenant(Some("adminAddr: 127.0.0.1:1\n")));
        assert_eq!(error.field, "bootstrap-controller.io/config: adminAddr");
        let error = single_error(base.tenant(Some("endpointReconcilerType: lease\n")));
        assert_eq!(
            error.field,
            "bootstrap-controller.io/config: endpointReconcilerType"
        );
        let error = single_error(base.tenant(Some("- a\n- b\n")));
        assert_eq!(error.field, "bootstrap-controller.io/config: (fragment)");
        let error = single_error(base.tenant(Some("key: [unclosed\n")));
        assert_eq!(error.field, "bootstrap-controller.io/config: (fragment)");
    }

    #[test]
    fn credential_plugins_are_absolute_program_paths() {
        let config = from_yaml(
            "tenants:\n  secretSelector: a=b\n  credentialPlugins: [/usr/bin/aws, \
             /usr/local/bin/gke-gcloud-auth-plugin]\n",
        )
        .unwrap();
        assert_eq!(
            config.tenants.unwrap().credential_plugins,
            [
                PathBuf::from("/usr/bin/aws"),
                PathBuf::from("/usr/local/bin/gke-gcloud-auth-plugin")
            ]
        );
        for bad in ["aws", "./aws", "/usr/bin/../bin/aws", "/usr/bin/"] {
            let args = ConfigArgs {
                tenants_secret_selector: Some("a=b".to_owned()),
                tenants_credential_plugins: Some(bad.to_owned()),
                ..ConfigArgs::default()
            };
            let error = single_error(Config::merge(&args, FileConfig::default()));
            assert_eq!(
                error.field, "--tenants-credential-plugins",
                "{bad}: {error}"
            );
        }
        let args = ConfigArgs {
            tenants_credential_plugins: Some("/usr/bin/aws".to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--tenants-credential-plugins");
    }

    #[test]
    fn management_mode_refuses_the_process_wide_etcd_settings() {
        let args = ConfigArgs {
            tenants_secret_selector: Some("a=b".to_owned()),
            etcd_servers: Some("https://192.0.2.1:2379".to_owned()),
            etcd_prefix: Some("/registry".to_owned()),
            ..ConfigArgs::default()
        };
        let errors = Config::merge(&args, FileConfig::default()).unwrap_err().0;
        let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
        assert_eq!(fields, ["--etcd-servers", "--etcd-prefix"], "{errors:?}");
        assert!(
            errors[0].message.contains("etcd-client.crt"),
            "{}",
            errors[0]
        );
        let error = single_error(from_yaml(
            "tenants:\n  secretSelector: a=b\netcdServers: https://192.0.2.1:2379\n",
        ));
        assert_eq!(error.field, "etcdServers");
    }

    #[test]
    fn a_fragment_names_no_file_and_stays_above_the_floors() {
        let base = tenant_base("tenants:\n  secretSelector: a=b\n");
        for key in ["etcdCAFile", "etcdCertFile", "etcdKeyFile"] {
            let error = single_error(base.tenant(Some(&format!("{key}: /etc/passwd\n"))));
            assert_eq!(
                error.field,
                format!("bootstrap-controller.io/config: {key}")
            );
            assert!(error.message.contains("etcd-client.key"), "{error}");
        }
        for (fragment, field) in [
            (
                "loops:\n  systemNamespaces:\n    interval: 1ms\n",
                "loops.systemNamespaces.interval",
            ),
            (
                "loops:\n  nodePortRepair:\n    interval: 4s\n",
                "loops.nodePortRepair.interval",
            ),
            (
                "loops:\n  clusterIPRepair:\n    pageSize: 1\n",
                "loops.clusterIPRepair.pageSize",
            ),
            (
                "loops:\n  apiserverEndpoints:\n    leaseTTL: 100ms\n",
                "loops.apiserverEndpoints.leaseTTL",
            ),
        ] {
            let error = single_error(base.tenant(Some(fragment)));
            assert_eq!(
                error.field,
                format!("bootstrap-controller.io/config: {field}"),
                "{error}"
            );
        }
        // At the floor is allowed; the file itself is the operator's and has no floors.
        assert!(
            base.tenant(Some("loops:\n  systemNamespaces:\n    interval: 5s\n"))
                .is_ok()
        );
        let fast = tenant_base(
            "tenants:\n  secretSelector: a=b\nloops:\n  systemNamespaces:\n    interval: 1s\n",
        );
        assert!(fast.tenant(None).is_ok());
    }

    #[test]
    fn a_tenant_etcd_prefix_is_a_plain_key_path() {
        let base = tenant_base("tenants:\n  secretSelector: a=b\n");
        let tenant = base
            .tenant(Some(
                "etcdServers: https://192.0.2.1:2379\netcdPrefix: /tenants/a\n",
            ))
            .unwrap();
        assert_eq!(tenant.etcd_prefix, "/tenants/a");
        for prefix in ["registry", "/a//b", "/a/../b", "/a/", "/a b", "/"] {
            let error = single_error(base.tenant(Some(&format!(
                "etcdServers: https://192.0.2.1:2379\netcdPrefix: \"{prefix}\"\n"
            ))));
            assert_eq!(
                error.field, "bootstrap-controller.io/config: etcdPrefix",
                "{prefix}: {error}"
            );
        }
        assert_eq!(
            fragment_etcd("etcdServers: [HTTPS://192.0.2.1:2379/]\netcdPrefix: /t/a\n"),
            Some((vec!["https://192.0.2.1:2379".to_owned()], "/t/a".to_owned()))
        );
        assert_eq!(
            fragment_etcd("etcdServers: https://192.0.2.1:2379\n").map(|c| c.1),
            Some("/registry".to_owned())
        );
        assert_eq!(fragment_etcd("etcdPrefix: /t/a\n"), None);
        assert_eq!(
            fragment_etcd("etcdServers: https://192.0.2.1:2379\netcdPrefix: /t/../a\n"),
            None
        );
    }

    #[test]
    fn flags_override_file_override_defaults() {
        let file = parse_file(
            "serviceNodePortRange: 20000-20999\nsecurePort: 8443\nadminAddr: 127.0.0.1:9000\ndryRun: true\nloops:\n  systemNamespaces:\n    interval: 5s\n",
        )
        .unwrap();
        let args = ConfigArgs {
            secure_port: Some("9443".to_owned()),
            dry_run: Some(false),
            ..ConfigArgs::default()
        };
        let config = Config::merge(&args, file).unwrap();
        assert_eq!(config.secure_port, 9443, "flag wins over file");
        assert!(!config.dry_run, "flag wins over file");
        assert_eq!(
            config.service_node_port_range,
            PortRange {
                base: 20000,
                last: 20999
            }
        );
        assert_eq!(config.admin_addr, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(
            config.loops.system_namespaces.interval,
            Duration::from_secs(5)
        );
        // Sections the file leaves out keep their defaults, as do fields of a partial section.
        assert_eq!(
            config.loops.kubernetes_service.interval,
            Duration::from_secs(10)
        );
        assert_eq!(config.loops.system_namespaces.namespaces.len(), 4);
        assert_eq!(config.apiserver_count, 1);
    }

    #[test]
    fn leader_election_flags_override_file() {
        let file =
            parse_file("leaderElection:\n  enabled: true\n  leaseName: from-file\n").unwrap();
        let args = ConfigArgs {
            leader_elect: Some(false),
            ..ConfigArgs::default()
        };
        let config = Config::merge(&args, file).unwrap();
        assert!(!config.leader_election.enabled);
        assert_eq!(config.leader_election.lease_name, "from-file");
        assert_eq!(config.leader_election.lease_namespace, "kube-system");
        let error = single_error(
            parse_file("leaderElection:\n  leaseDuration: 5s\n  renewGrace: 5s\n")
                .map_err(ConfigErrors::from)
                .and_then(|file| Config::merge(&ConfigArgs::default(), file)),
        );
        assert_eq!(error.field, "leaderElection.renewGrace");
    }

    #[test]
    fn printed_config_parses_back_to_the_same() {
        let config = from_yaml(
            "serviceClusterIPRange: 10.96.0.0/12,fd00::/108\nadvertiseAddress: 10.1.2.3\nloops:\n  systemNamespaces:\n    interval: 1m30s\n    namespaces:\n      - name: extra\n        labels:\n          team: core\n",
        )
        .unwrap();
        let yaml = config.to_yaml().unwrap();
        let again = from_yaml(&yaml).unwrap();
        assert_eq!(config, again, "{yaml}");
    }

    #[test]
    fn durations_round_trip() {
        for (text, duration) in [
            ("500ms", Duration::from_millis(500)),
            ("10s", Duration::from_secs(10)),
            ("1m", Duration::from_secs(60)),
            ("1m30s", Duration::from_secs(90)),
            ("2h", Duration::from_secs(7200)),
        ] {
            assert_eq!(parse_duration(text).unwrap(), duration);
            assert_eq!(format_duration(duration), text);
        }
        assert_eq!(format_duration(Duration::ZERO), "0s");
        assert_eq!(format_duration(Duration::from_millis(61_500)), "1m1s500ms");
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("1 minute").unwrap(), Duration::from_secs(60));
        for bad in ["10", "", "-5s", "ten seconds", "5x"] {
            let err = parse_duration(bad).unwrap_err();
            assert!(err.to_string().contains("e.g. 10s"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn derived_identity_is_stable_within_the_process() {
        let config = Config::merge(&ConfigArgs::default(), FileConfig::default()).unwrap();
        assert_eq!(config.leader_identity(), config.leader_identity());
        let named = from_yaml("leaderElection:\n  identity: replica-a\n").unwrap();
        assert_eq!(named.leader_identity(), "replica-a");
    }

    #[test]
    fn dns1123() {
        assert!(validate_dns1123_label("kube-system").is_ok());
        assert!(validate_dns1123_label("-a").is_err());
        assert!(validate_dns1123_label(&"a".repeat(64)).is_err());
        assert!(validate_dns1123_subdomain("a.b-c").is_ok());
        assert!(validate_dns1123_subdomain("a..b").is_err());
    }
}

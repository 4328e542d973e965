//! The top-level settings: the one list each of them is written in.
//!
//! An entry gives a setting's help text (its doc comment, ending with `[default: ...]`), its
//! field, the flag's type, name, environment variable and value name, and its key in the
//! `--config` file. From the list follow:
//!
//! - [`ConfigArgs`], the flags (`--config` first, then every setting in list order, which is
//!   `--help`'s order);
//! - [`FileConfig`], the file (every entry with a file type, plus the nested blocks, whose
//!   shapes are written by hand below);
//! - [`Given`], each setting as the user gave it: the flag's value if set, else the file's,
//!   with the flag or the YAML key it came from, which `merge.rs` validates and defaults;
//! - [`SETTINGS`], the names, which the docs' flag table is checked against.
//!
//! Adding a setting: an entry here, a field of [`super::Config`], its validation in
//! `Config::merge`, and its row in CONFIG.md's flag table (tests fail without
//! them).
//!
//! An entry's file clause takes one of three forms:
//!
//! - `file "key": T` — the file's value has the flag's type (or converts into it with
//!   `From`, as a YAML list of CIDRs into the flag's comma-separated text);
//! - `file "key": T => Result<T, E> = parse` — the flag's text is parsed by `parse`, so that a
//!   bad flag value is an error naming the flag, while the file's typed value is taken as is;
//! - `file "block.key" in block.field` — the file's side is an optional field of a
//!   nested block (its type converts into the flag's as above); `=> Result<T, E> = parse`
//!   may follow, as for a top-level key.
//!
//! A file value read through a serde adapter names it last: `, with "duration_format::option"`.

use std::path::PathBuf;
use std::time::Duration;

use clap::ValueEnum;
use reconcilers::apiserver_endpoints::EndpointsMode;
use reconcilers::names::NameError;
use reconcilers::section::{ConfigError, DurationError, duration_format, parse_duration};
use serde::{Deserialize, Serialize};

use super::values::{NotANumber, StringOrList, parse_bool, parse_number};
use super::{Loops, TenantBudget};

/// One setting's names, as the docs name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Setting {
    /// The flag, with its dashes: `--secure-port`.
    pub flag: &'static str,
    pub env: &'static str,
    /// Its key in the file, dotted when it lives in a section: `leaderElection.leaseName`.
    pub file_key: &'static str,
}

/// Where a value came from, so errors name the flag, the environment variable or the YAML field
/// the user wrote.
pub(super) struct Source<T> {
    pub(super) value: T,
    pub(super) field: &'static str,
}

/// The flag's value if set (`flag_name` is the flag, or its variable when the value came from
/// the environment), else the file's, with the name of the one it came from.
pub(super) fn pick<T>(
    flag: Option<T>,
    flag_name: &'static str,
    file: Option<T>,
    file_field: &'static str,
) -> Option<Source<T>> {
    let (value, field) = match flag {
        Some(value) => (value, flag_name),
        None => (file?, file_field),
    };
    Some(Source { value, field })
}

/// A setting that parsed, or `None` when it was not given or (with its error noted) did not
/// parse: the caller falls back to its default.
pub(super) fn valid<T, E: std::fmt::Display>(
    source: Option<Source<Result<T, E>>>,
    errors: &mut Vec<ConfigError>,
) -> Option<Source<T>> {
    let Source { value, field } = source?;
    value
        .map(|value| Source { value, field })
        .map_err(|err| errors.push(ConfigError::new(field, err)))
        .ok()
}

/// A comma-separated list: the items `parse` takes, in order, and an error naming the setting
/// for each one it refuses (with the message it gives); empty items are skipped.
pub(super) fn items<T>(
    source: &Source<String>,
    errors: &mut Vec<ConfigError>,
    parse: impl Fn(&str) -> Result<T, String>,
) -> Vec<T> {
    source
        .value
        .split(',')
        .map(str::trim)
        .filter(|item| !item.is_empty())
        .filter_map(|item| {
            parse(item)
                .map_err(|message| errors.push(ConfigError::new(source.field, message)))
                .ok()
        })
        .collect()
}

/// Whether `source` is a name of `kind` as `validate` (the API's rule for it) takes it; if not,
/// its error, ending with `example`.
pub(super) fn check_name(
    source: &Source<String>,
    validate: fn(&str) -> Result<(), NameError>,
    kind: &str,
    example: &str,
    errors: &mut Vec<ConfigError>,
) -> bool {
    let Err(why) = validate(&source.value) else {
        return true;
    };
    errors.push(ConfigError::new(
        source.field,
        format!(
            "{:?} is not a valid {kind} name: {why} ({example})",
            source.value
        ),
    ));
    false
}

macro_rules! settings {
    (
        blocks {
            $($block:ident: $block_ty:ty = $block_key:literal,)+
        }
        $(
            $(#[$attr:meta])*
            $field:ident: $flag_ty:ty = $flag:literal, $env:literal, $value_name:literal;
            file $key:literal
                $(in $in_section:ident . $in_field:ident $(=> $in_raw:ty = $in_parse:path)?)?
                $(: $file_ty:ty $(=> $raw:ty = $parse:path)? $(, with $with:literal)?)?;
        )+
    ) => {
        /// Flags that configure the controller. Every flag has an environment variable
        /// (`BOOTSTRAP_<FLAG_IN_UPPER_SNAKE_CASE>`). Values left unset fall back to the
        /// `--config` file, then to the defaults shown.
        #[derive(Debug, Clone, Default, clap::Args)]
        pub struct ConfigArgs {
            /// YAML configuration file (loops, intervals, system namespaces, and every flag's
            /// setting). Flags override the file; the file overrides the defaults. [default:
            /// none]
            #[arg(long, env = "BOOTSTRAP_CONFIG", value_name = "FILE", global = true)]
            pub config: Option<PathBuf>,
            $(
                $(#[$attr])*
                #[arg(long = $flag, env = $env, value_name = $value_name, global = true)]
                pub $field: Option<$flag_ty>,
            )+
            /// The variables (`BOOTSTRAP_...`) the values above were read from, so an error
            /// names the variable the user set rather than a flag never typed.
            #[arg(skip)]
            pub from_env: std::collections::BTreeSet<&'static str>,
        }

        impl ConfigArgs {
            /// Notes which settings `matches` took from their environment variable.
            pub fn note_sources(&mut self, matches: &clap::ArgMatches) {
                $(
                    if matches.value_source(stringify!($field))
                        == Some(clap::parser::ValueSource::EnvVariable)
                    {
                        self.from_env.insert($env);
                    }
                )+
            }

            /// The name to blame for a setting's value: its variable when it came from the
            /// environment, else its flag.
            fn source_name(&self, flag: &'static str, env: &'static str) -> &'static str {
                if self.from_env.contains(env) { env } else { flag }
            }
        }

        impl ConfigArgs {
            /// The flags given (on the command line or as their environment variables).
            pub fn given_flags(&self) -> Vec<&'static str> {
                let mut given = Vec::new();
                if self.config.is_some() {
                    given.push("--config");
                }
                $(
                    if self.$field.is_some() {
                        given.push(concat!("--", $flag));
                    }
                )+
                given
            }
        }

        /// The `--config` file. Top-level scalars mirror the flags (a flag wins over its field);
        /// the nested blocks have no flags of their own but the `--leader-elect-*` and
        /// `--tenants-*` ones.
        #[derive(Debug, Clone, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct FileConfig {
            $($(
                #[serde(rename = $key)]
                $(#[serde(default, with = $with)])?
                pub $field: Option<$file_ty>,
            )?)+
            $(
                #[serde(rename = $block_key)]
                pub $block: Option<$block_ty>,
            )+
        }

        /// Each setting as given: the flag's value if set, else the file's (a top-level field or
        /// a section's), with where it came from; `None` when neither sets it.
        pub(super) struct Given {
            $($(
                pub(super) $field: Option<Source<settings!(@raw $flag_ty $(, $raw)?)>>,
            )?)+
            $($(
                pub(super) $field: Option<Source<settings!(@raw $flag_ty $(, $in_raw)?)>>,
            )?)+
        }

        impl Given {
            // Some settings' values are `Copy`, and every one is cloned the same way.
            #[allow(clippy::clone_on_copy, clippy::useless_conversion)]
            pub(super) fn new(args: &ConfigArgs, file: &FileConfig) -> Given {
                Given {
                    $($(
                        $field: pick(
                            settings!(@flag args.$field $(, $parse)?),
                            args.source_name(concat!("--", $flag), $env),
                            settings!(@file file.$field.clone() $(, $raw)?),
                            $key,
                        ),
                    )?)+
                    $($(
                        $field: pick(
                            settings!(@flag args.$field $(, $in_parse)?),
                            args.source_name(concat!("--", $flag), $env),
                            settings!(
                                @file file
                                    .$in_section
                                    .as_ref()
                                    .and_then(|section| section.$in_field.clone())
                                $(, $in_raw)?
                            ),
                            $key,
                        ),
                    )?)+
                }
            }
        }

        /// Every top-level setting's names, in `--help`'s order (`--config` aside).
        pub const SETTINGS: &[Setting] = &[
            $(Setting { flag: concat!("--", $flag), env: $env, file_key: $key },)+
        ];
    };

    // The type a setting is given as: the flag's, or the parsed result.
    (@raw $flag_ty:ty) => { $flag_ty };
    (@raw $flag_ty:ty, $raw:ty) => { $raw };
    // The flag's value in that type.
    (@flag $value:expr) => { $value.clone() };
    (@flag $value:expr, $parse:path) => { $value.as_deref().map($parse) };
    // The file's value in that type.
    (@file $value:expr) => { $value.map(Into::into) };
    (@file $value:expr, $raw:ty) => { $value.map(Ok) };
}

settings! {
    // The file's nested blocks: their fields are no top-level keys, and the entries whose
    // file side is one of them name it with `in`.
    blocks {
        leader_election: LeaderElectionFile = "leaderElection",
        tenants: TenantsFile = "tenants",
        loops: Loops = "loops",
    }

    /// Service cluster IP range(s), as given to kube-apiserver: one CIDR, or two of different
    /// families separated by a comma (primary first). Each must hold at least 8 addresses.
    /// [default: none: read from the cluster's kubernetes ServiceCIDR (Kubernetes 1.33+); older
    /// clusters need it set for the ClusterIP repair]
    service_cluster_ip_range: String = "service-cluster-ip-range",
        "BOOTSTRAP_SERVICE_CLUSTER_IP_RANGE", "CIDR[,CIDR]";
        file "serviceClusterIPRange": StringOrList;

    /// NodePort range, as given to kube-apiserver: `BASE-LAST`, both inclusive.
    /// [default: 30000-32767]
    service_node_port_range: String = "service-node-port-range",
        "BOOTSTRAP_SERVICE_NODE_PORT_RANGE", "BASE-LAST";
        file "serviceNodePortRange": String;

    /// IP address this apiserver advertises to the cluster (its address in the `kubernetes`
    /// endpoints). Its family must match the primary service range's unless the endpoint
    /// reconciler is `none` or unset. [default: the default-route address of the primary range's family,
    /// as kube-apiserver]
    advertise_address: String = "advertise-address", "BOOTSTRAP_ADVERTISE_ADDRESS", "IP";
        file "advertiseAddress": String;

    /// The apiserver's secure port: the endpoints' port and the `kubernetes` Service's
    /// targetPort. Unset, the endpoints use 6443 and the Service keeps the targetPort it has (so
    /// a managed cluster's 443 is never rewritten). [default: unset: endpoints on 6443, the
    /// Service's targetPort kept]
    secure_port: String = "secure-port", "BOOTSTRAP_SECURE_PORT", "PORT";
        file "securePort": u32 => Result<u32, NotANumber> = parse_number;

    /// NodePort of the `kubernetes` Service, inside --service-node-port-range; 0 makes it of type
    /// ClusterIP. Unset, a Service is created ClusterIP and an existing NodePort one keeps its
    /// type and node port (kube-apiserver's --kubernetes-service-node-port). [default: unset: a
    /// NodePort Service's type and node port kept]
    kubernetes_service_node_port: String = "kubernetes-service-node-port",
        "BOOTSTRAP_KUBERNETES_SERVICE_NODE_PORT", "PORT";
        file "kubernetesServiceNodePort": u32 => Result<u32, NotANumber> = parse_number;

    /// How the `kubernetes` endpoints are maintained: `lease` (one Lease per apiserver: a
    /// sidecar beside each kube-apiserver), `static` (addresses from the configuration file),
    /// `master-count` (upstream's deprecated reconciler, with --apiserver-count) or `none`.
    /// Unset, the endpoints loop is off: nothing is written unless a mode is named.
    /// [default: unset (the endpoints loop is off)]
    #[arg(value_parser = endpoint_reconciler_type_parser())]
    endpoint_reconciler_type: EndpointsMode = "endpoint-reconciler-type",
        "BOOTSTRAP_ENDPOINT_RECONCILER_TYPE", "TYPE";
        file "endpointReconcilerType": EndpointsMode;

    /// Number of apiservers, used only by `--endpoint-reconciler-type=master-count`; must be
    /// positive. [default: 1]
    apiserver_count: String = "apiserver-count", "BOOTSTRAP_APISERVER_COUNT", "N";
        file "apiserverCount": i64 => Result<i64, NotANumber> = parse_number;

    /// Kubeconfig file. [default: `$KUBECONFIG`, then `~/.kube/config`, then the in-cluster
    /// service account]
    kubeconfig: PathBuf = "kubeconfig", "BOOTSTRAP_KUBECONFIG", "FILE";
        file "kubeconfig": PathBuf;

    /// The etcd of the apiserver, as its --etcd-servers: comma-separated URLs. Turns on etcd
    /// mode: the NodePort repair also repairs the allocation bitmap kube-apiserver keeps there.
    /// Without it the repairs work through the API only. [default: none]
    etcd_servers: String = "etcd-servers", "BOOTSTRAP_ETCD_SERVERS", "URL[,URL]";
        file "etcdServers": StringOrList;

    /// CA bundle that verifies the etcd servers' certificates (as kube-apiserver's). [default:
    /// none]
    etcd_cafile: PathBuf = "etcd-cafile", "BOOTSTRAP_ETCD_CAFILE", "FILE";
        file "etcdCAFile": PathBuf;

    /// Client certificate for etcd (PEM); goes with --etcd-keyfile. [default: none]
    etcd_certfile: PathBuf = "etcd-certfile", "BOOTSTRAP_ETCD_CERTFILE", "FILE";
        file "etcdCertFile": PathBuf;

    /// Client key for etcd (PEM); goes with --etcd-certfile. [default: none]
    etcd_keyfile: PathBuf = "etcd-keyfile", "BOOTSTRAP_ETCD_KEYFILE", "FILE";
        file "etcdKeyFile": PathBuf;

    /// The apiserver's --etcd-prefix. [default: /registry]
    etcd_prefix: String = "etcd-prefix", "BOOTSTRAP_ETCD_PREFIX", "PREFIX";
        file "etcdPrefix": String;

    /// Compute and report every write without making it (logs, metrics, `check`). A dry run
    /// holds no Lease (it joins no leader election) and runs every loop's dry passes, so it
    /// never keeps a real replica from leading. `--dry-run` alone means true. [default: false]
    #[arg(num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    dry_run: String = "dry-run", "BOOTSTRAP_DRY_RUN", "BOOL";
        file "dryRun": bool => Result<bool, String> = parse_bool;

    /// Ignore watch triggers: every loop runs only at start and on its interval, as upstream.
    /// `--timer-only` alone means true. [default: false]
    #[arg(num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    timer_only: String = "timer-only", "BOOTSTRAP_TIMER_ONLY", "BOOL";
        file "timerOnly": bool => Result<bool, String> = parse_bool;

    /// Address of the admin HTTP server (/livez, /readyz, /metrics). [default: 0.0.0.0:8080]
    admin_addr: String = "admin-addr", "BOOTSTRAP_ADMIN_ADDR", "ADDR:PORT";
        file "adminAddr": String;

    /// Log format; the level comes from RUST_LOG (default `info`). [default: text]
    log_format: LogFormat = "log-format", "BOOTSTRAP_LOG_FORMAT", "FORMAT";
        file "logFormat": LogFormat;

    /// Elect a leader among replicas with a Lease; loops that write cluster-wide objects run only
    /// on the leader. `--leader-elect` alone means true. [default: true]
    #[arg(num_args = 0..=1, require_equals = true, default_missing_value = "true")]
    leader_elect: String = "leader-elect", "BOOTSTRAP_LEADER_ELECT", "BOOL";
        file "leaderElection.enabled" in leader_election.enabled
            => Result<bool, String> = parse_bool;

    /// Name of the leader-election Lease. [default: bootstrap-controller]
    leader_elect_lease_name: String = "leader-elect-lease-name",
        "BOOTSTRAP_LEADER_ELECT_LEASE_NAME", "NAME";
        file "leaderElection.leaseName" in leader_election.lease_name;

    /// Namespace of the leader-election Lease. [default: kube-system]
    leader_elect_lease_namespace: String = "leader-elect-lease-namespace",
        "BOOTSTRAP_LEADER_ELECT_LEASE_NAMESPACE", "NAMESPACE";
        file "leaderElection.leaseNamespace" in leader_election.lease_namespace;

    /// This instance's identity: the holder of the leader-election Lease and of its
    /// apiserver's membership Lease. The default stays the same across restarts of one instance.
    /// [default: $POD_NAME, else the host name, plus a hash of the advertise and admin
    /// addresses]
    leader_elect_identity: String = "leader-elect-identity",
        "BOOTSTRAP_LEADER_ELECT_IDENTITY", "ID";
        file "leaderElection.identity" in leader_election.identity;

    /// How long a leader holds the Lease without renewing it (also the longest failover time),
    /// e.g. `15s`. [default: 15s]
    leader_elect_lease_duration: String = "leader-elect-lease-duration",
        "BOOTSTRAP_LEADER_ELECT_LEASE_DURATION", "DURATION";
        file "leaderElection.leaseDuration" in leader_election.lease_duration
            => Result<Duration, DurationError> = parse_duration;

    /// How long before the Lease expires the leader renews it, e.g. `5s`; must be shorter than
    /// the lease duration. [default: 5s]
    leader_elect_renew_grace: String = "leader-elect-renew-grace",
        "BOOTSTRAP_LEADER_ELECT_RENEW_GRACE", "DURATION";
        file "leaderElection.renewGrace" in leader_election.renew_grace
            => Result<Duration, DurationError> = parse_duration;

    /// Upper bound for graceful shutdown (finish running passes, run each loop's shutdown hook),
    /// e.g. `30s`. [default: 30s]
    shutdown_timeout: String = "shutdown-timeout", "BOOTSTRAP_SHUTDOWN_TIMEOUT", "DURATION";
        file "shutdownTimeout": Duration => Result<Duration, DurationError> = parse_duration,
            with "duration_format::option";

    /// Management mode: keep the bootstrap state of every tenant cluster whose kubeconfig is in
    /// a Secret of this (management) cluster matching this label selector, e.g.
    /// `cluster.x-k8s.io/cluster-name`; left out, the one cluster of --kubeconfig is kept.
    /// [default: none]
    tenants_secret_selector: String = "tenants-secret-selector",
        "BOOTSTRAP_TENANTS_SECRET_SELECTOR", "SELECTOR";
        file "tenants.secretSelector" in tenants.secret_selector;

    /// Management mode: only Secrets in this namespace are tenants. [default: every namespace]
    tenants_namespace: String = "tenants-namespace", "BOOTSTRAP_TENANTS_NAMESPACE", "NAMESPACE";
        file "tenants.namespace" in tenants.namespace;

    /// Management mode: the Secret data key holding the tenant's kubeconfig: `value` (Cluster
    /// API), `admin.conf` (Kamaji), `kubeconfig` (HyperShift), `config` (vcluster).
    /// [default: value]
    tenants_kubeconfig_key: String = "tenants-kubeconfig-key",
        "BOOTSTRAP_TENANTS_KUBECONFIG_KEY", "KEY";
        file "tenants.kubeconfigKey" in tenants.kubeconfig_key;

    /// Management mode: credential plugins (absolute paths, comma-separated) a tenant
    /// kubeconfig's `exec` may run, e.g. `/usr/local/bin/aws-iam-authenticator`. Any other exec
    /// entry is refused. [default: none]
    tenants_credential_plugins: String = "tenants-credential-plugins",
        "BOOTSTRAP_TENANTS_CREDENTIAL_PLUGINS", "PATH[,PATH]";
        file "tenants.credentialPlugins" in tenants.credential_plugins;

    /// Management mode: the most objects one tenant's caches may hold together (its Services,
    /// IPAddresses, namespaces, ...). A tenant whose API would make them hold more is emptied
    /// and paused, alone; `tenants.cacheBudgets` raises it for one tenant. [default: 50000]
    tenants_cache_max_objects: String = "tenants-cache-max-objects",
        "BOOTSTRAP_TENANTS_CACHE_MAX_OBJECTS", "N";
        file "tenants.cacheMaxObjects" in tenants.cache_max_objects
            => Result<u32, NotANumber> = parse_number;

    /// Management mode: the most MiB one tenant's caches may hold together (estimated: a whole
    /// decoded object about five times its JSON size). Over it, as over
    /// --tenants-cache-max-objects. [default: 32]
    tenants_cache_max_mib: String = "tenants-cache-max-mib", "BOOTSTRAP_TENANTS_CACHE_MAX_MIB",
        "MIB";
        file "tenants.cacheMaxMiB" in tenants.cache_max_mib => Result<u32, NotANumber> = parse_number;

    /// Management mode: the most MiB every tenant's caches may hold together (estimated, as
    /// --tenants-cache-max-mib), however many tenants there are. Every tenant may hold its floor
    /// (1 MiB, or half its fair share when the tenants are many); one above it whose caches
    /// would take the total over the total less every floor is emptied and paused, alone.
    /// [default: 96]
    tenants_cache_total_mib: String = "tenants-cache-total-mib",
        "BOOTSTRAP_TENANTS_CACHE_TOTAL_MIB", "MIB";
        file "tenants.cacheTotalMiB" in tenants.cache_total_mib
            => Result<u32, NotANumber> = parse_number;

    /// Management mode: the most MiB the tenant Secrets' data (kubeconfig, etcd certificates)
    /// and configuration annotations may take in this process together. A Secret that would
    /// take them over it is held without them, its tenant not started (or stopped), alone,
    /// until others make room. [default: 8]
    tenants_secrets_total_mib: String = "tenants-secrets-total-mib",
        "BOOTSTRAP_TENANTS_SECRETS_TOTAL_MIB", "MIB";
        file "tenants.secretsTotalMiB" in tenants.secrets_total_mib
            => Result<u32, NotANumber> = parse_number;

    /// Management mode: the networks (CIDRs, comma-separated) a tenant's etcd may be in, e.g.
    /// `10.0.16.0/20`. A tenant's etcdServers must name addresses, or host names resolving only
    /// to addresses, inside them; without any, etcdServers in a tenant's annotation is refused.
    /// [default: none]
    tenants_etcd_allowed_cidrs: String = "tenants-etcd-allowed-cidrs",
        "BOOTSTRAP_TENANTS_ETCD_ALLOWED_CIDRS", "CIDR[,CIDR]";
        file "tenants.etcdAllowedCIDRs" in tenants.etcd_allowed_cidrs;

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

/// The file's `leaderElection` section; the flags `--leader-elect-*` win over it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LeaderElectionFile {
    pub enabled: Option<bool>,
    pub lease_name: Option<String>,
    pub lease_namespace: Option<String>,
    pub identity: Option<String>,
    #[serde(default, with = "duration_format::option")]
    pub lease_duration: Option<Duration>,
    #[serde(default, with = "duration_format::option")]
    pub renew_grace: Option<Duration>,
}

/// The file's `tenants` section (management mode); the flags `--tenants-*` win over it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TenantsFile {
    pub secret_selector: Option<String>,
    pub namespace: Option<String>,
    pub kubeconfig_key: Option<String>,
    pub credential_plugins: Option<StringOrList>,
    pub cache_max_objects: Option<u32>,
    #[serde(rename = "cacheMaxMiB")]
    pub cache_max_mib: Option<u32>,
    #[serde(rename = "cacheTotalMiB")]
    pub cache_total_mib: Option<u32>,
    #[serde(rename = "secretsTotalMiB")]
    pub secrets_total_mib: Option<u32>,
    /// Budgets the operator raises (or lowers) for single tenants, by `namespace/name` of their
    /// Secret; a tenant's own annotation cannot.
    pub cache_budgets: Option<std::collections::BTreeMap<String, TenantBudget>>,
    #[serde(rename = "etcdAllowedCIDRs")]
    pub etcd_allowed_cidrs: Option<StringOrList>,
}

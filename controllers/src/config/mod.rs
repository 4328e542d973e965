//! Configuration: flags (with environment variables), an optional YAML file, and defaults.
//!
//! Precedence is flags > file > defaults. Every value is validated before anything touches the
//! cluster, and every error names the field (the flag when the value came from a flag, the YAML
//! path when it came from the file) and says how to fix it.
//!
//! Each loop's section (`loops.<key>`) is owned by the loop's module in `reconcilers`
//! ([`LoopSection`]); [`Loops`] is the list of them.
//!
//! By concern, each file using only those listed before it: `values.rs` (value types and their
//! parsers), `settings.rs` (the one list of the top-level settings, from which the flags with
//! their environment variables, the file's fields and the flag-over-file pick follow, with the
//! reporting of a picked value or list item that does not parse),
//! `suggest.rs` (near misses of mistyped keys and variables), `file.rs` (the file's parser, which
//! reports every problem of a file with its line), `tenant.rs` (management mode, and a tenant's annotation fragment merged
//! over the file), `merge.rs` (flags over file over defaults, and validation); this module holds
//! the effective [`Config`], the list of loops and the error type.

mod file;
mod merge;
mod settings;
mod suggest;
mod tenant;
mod values;

pub use file::*;
pub use merge::*;
pub use settings::*;
pub use suggest::*;
pub use tenant::*;
pub use values::*;

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

pub use reconcilers::apiserver_endpoints::EndpointsMode;
pub use reconcilers::names::{
    NameError, validate_dns1123_label, validate_dns1123_subdomain, validate_qualified_name,
};
pub use reconcilers::section::{
    ConfigError, DurationError, LoopSection, ServiceName, Settings, duration_format,
    format_duration, parse_duration,
};

/// Environment variable prefix shared by every flag.
pub const ENV_PREFIX: &str = "BOOTSTRAP_";

// ------------------------------------------------------------------------------------------------
// The effective configuration
// ------------------------------------------------------------------------------------------------

/// The effective configuration, after merging flags, file and defaults, and validated.
///
/// Serialises (`config print`) to the same YAML shape the `--config` file accepts.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Config {
    /// kube-apiserver's flags the loops read (the service ranges, ports, the endpoints' mode,
    /// etcd), this replica's identity and its cluster's cache budget: the one value every
    /// loop's section is validated against and built with.
    #[serde(flatten)]
    pub settings: Settings,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubeconfig: Option<PathBuf>,
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
    #[serde(flatten, serialize_with = "serialize_loops")]
    pub loops: Loops,
}

/// `loops`, after the endpoints loop's two kube-apiserver flags, which its section holds and the
/// file names at the top level (`endpointReconcilerType`, `apiserverCount`).
fn serialize_loops<S: serde::Serializer>(loops: &Loops, serializer: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let endpoints = &loops.apiserver_endpoints;
    let mut map = serializer.serialize_map(None)?;
    if let Some(mode) = endpoints.mode {
        map.serialize_entry("endpointReconcilerType", &mode)?;
    }
    map.serialize_entry("apiserverCount", &endpoints.apiserver_count)?;
    map.serialize_entry("loops", loops)?;
    map.end()
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
    /// What one tenant's caches may hold.
    pub cache_max_objects: u32,
    #[serde(rename = "cacheMaxMiB")]
    pub cache_max_mib: u32,
    /// What every tenant's caches may hold together.
    #[serde(rename = "cacheTotalMiB")]
    pub cache_total_mib: u32,
    /// What the tenant Secrets' data and annotations may hold together.
    #[serde(rename = "secretsTotalMiB")]
    pub secrets_total_mib: u32,
    /// The operator's budgets for single tenants, by `namespace/name`.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub cache_budgets: BTreeMap<String, TenantBudget>,
    #[serde(
        rename = "etcdAllowedCIDRs",
        serialize_with = "ser_cidrs",
        skip_serializing_if = "Vec::is_empty"
    )]
    pub etcd_allowed_cidrs: Vec<IpNet>,
}

/// A budget the operator set for one tenant (`tenants.cacheBudgets`). In the file what it leaves
/// out is the process's; the merge sets both, so `config print` shows the budget in force.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct TenantBudget {
    pub max_objects: Option<u32>,
    #[serde(rename = "maxMiB")]
    pub max_mib: Option<u32>,
}

/// The default `--tenants-cache-max-objects`: see CONFIG.md for how it was sized.
pub const DEFAULT_TENANTS_CACHE_MAX_OBJECTS: u32 = 50_000;
/// The default `--tenants-cache-max-mib`.
pub const DEFAULT_TENANTS_CACHE_MAX_MIB: u32 = 32;
/// The default `--tenants-cache-total-mib`: see CONFIG.md for how it was sized.
pub const DEFAULT_TENANTS_CACHE_TOTAL_MIB: u32 = 96;
/// The default `--tenants-secrets-total-mib`: see CONFIG.md for how it was sized.
pub const DEFAULT_TENANTS_SECRETS_TOTAL_MIB: u32 = 8;
/// What one tenant's caches may hold whatever the others hold (the pool's floor).
pub const TENANT_CACHE_FLOOR_BYTES: usize = 1024 * 1024;

impl Tenants {
    /// The cache budget of the tenant of Secret `key` (`namespace/name`).
    pub fn cache_limits(&self, key: &str) -> reconcilers::budget::BudgetLimits {
        let budget = self.cache_budgets.get(key).copied().unwrap_or_default();
        let objects = budget.max_objects.unwrap_or(self.cache_max_objects);
        let mib = budget.max_mib.unwrap_or(self.cache_max_mib);
        reconcilers::budget::BudgetLimits {
            max_objects: usize::try_from(objects).unwrap_or(usize::MAX),
            max_bytes: usize::try_from(mib)
                .unwrap_or(usize::MAX)
                .saturating_mul(1024 * 1024),
        }
    }

    /// What every tenant's caches may hold together, in bytes.
    pub fn cache_total_bytes(&self) -> usize {
        mib(self.cache_total_mib)
    }

    /// What the tenant Secrets' data and annotations may hold together, in bytes.
    pub fn secrets_total_bytes(&self) -> usize {
        mib(self.secrets_total_mib)
    }
}

fn mib(mib: u32) -> usize {
    usize::try_from(mib)
        .unwrap_or(usize::MAX)
        .saturating_mul(1024 * 1024)
}

/// Leader election among replicas of this controller.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
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

#[cfg(test)]
mod tests;

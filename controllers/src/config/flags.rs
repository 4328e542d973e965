//! The flags, each with its environment variable (`BOOTSTRAP_<FLAG>`).

use std::path::PathBuf;

use clap::ValueEnum;
use reconcilers::section::EndpointsMode;
use serde::{Deserialize, Serialize};

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
pub(super) fn endpoint_reconciler_type_parser()
-> impl clap::builder::TypedValueParser<Value = EndpointsMode> {
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

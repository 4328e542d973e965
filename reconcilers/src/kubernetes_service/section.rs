//! `loops.kubernetesService`: the section of the configuration file, and the loop's
//! configuration made from it and the top-level settings (the Service range, `securePort`,
//! `kubernetesServiceNodePort`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::ServicePort;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};

use super::KubernetesServiceLoop;
use crate::contract::Reconciler;
use crate::names::validate_dns1123_label;
use crate::section::{
    self, BuildContext, BuildError, LoopSection, Settings, duration_format, validate_interval,
};
use crate::service_range::validate_ranges;

/// What to do about drift of the repairable fields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RepairPolicy {
    /// Rewrite ports, type, selector, session affinity and the two labels.
    #[default]
    Repair,
    /// Upstream's behaviour: create when missing, never update; drift is only reported.
    Off,
}

/// Configuration of the `kubernetes-service` loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesServiceConfig {
    pub namespace: String,
    pub name: String,
    /// The Service port (upstream hard-codes 443).
    pub port: i32,
    /// The apiservers' `--secure-port`: the Service's `targetPort`.
    pub target_port: i32,
    /// `--service-cluster-ip-range`: one CIDR, or two of different families (primary first).
    pub service_cidrs: Vec<IpNet>,
    /// `--kubernetes-service-node-port`: makes the Service a NodePort Service.
    pub node_port: Option<i32>,
    pub repair: RepairPolicy,
    /// Delete and recreate the Service when its clusterIP is not the desired one. Destructive:
    /// clients connected through the old IP break. Off unless explicitly enabled.
    pub recreate_on_cluster_ip_mismatch: bool,
    pub interval: Duration,
}

impl Default for KubernetesServiceConfig {
    fn default() -> Self {
        Self {
            namespace: "default".to_owned(),
            name: "kubernetes".to_owned(),
            port: 443,
            target_port: 6443,
            service_cidrs: Vec::new(),
            node_port: None,
            repair: RepairPolicy::Repair,
            recreate_on_cluster_ip_mismatch: false,
            interval: Duration::from_secs(10),
        }
    }
}

/// `loops.kubernetesService`: the `default/kubernetes` Service. Its clusterIP, targetPort and
/// node port come from `serviceClusterIPRange`, `securePort` and `kubernetesServiceNodePort`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
    /// Namespace of the Service (and of its Endpoints/EndpointSlices).
    pub namespace: String,
    /// Name of the Service (and of its Endpoints and primary EndpointSlice).
    pub name: String,
    /// The Service port (upstream hard-codes 443).
    pub port: u16,
    /// `repair`: fix ports, type, selector, sessionAffinity and labels; `off`: only create when
    /// missing and report drift (upstream's behaviour).
    pub repair: RepairPolicy,
    /// Delete and recreate the Service when its clusterIP is not the first IP of the primary
    /// range. Destructive (connections through the old IP break); off by default.
    #[serde(rename = "recreateOnClusterIPMismatch")]
    pub recreate_on_cluster_ip_mismatch: bool,
}

impl Default for Section {
    fn default() -> Self {
        let defaults = KubernetesServiceConfig::default();
        Section {
            enabled: true,
            interval: defaults.interval,
            namespace: defaults.namespace,
            name: defaults.name,
            port: 443,
            repair: defaults.repair,
            recreate_on_cluster_ip_mismatch: defaults.recreate_on_cluster_ip_mismatch,
        }
    }
}

impl Section {
    /// The loop's configuration: this section with the Service range, `securePort` and node port.
    pub fn loop_config(&self, settings: &Settings) -> KubernetesServiceConfig {
        KubernetesServiceConfig {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            port: i32::from(self.port),
            target_port: i32::from(settings.secure_port),
            service_cidrs: settings.service_ranges.clone(),
            node_port: settings.kubernetes_service_node_port.map(i32::from),
            repair: self.repair,
            recreate_on_cluster_ip_mismatch: self.recreate_on_cluster_ip_mismatch,
            interval: self.interval,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<section::ConfigError>) {
        validate_interval(path, self.interval, errors);
        if let Err(why) = validate_dns1123_label(&self.namespace) {
            errors.push(section::ConfigError::new(
                format!("{path}.namespace"),
                format!("{why} (expected e.g. default)"),
            ));
        }
        if let Err(why) = validate_dns1123_label(&self.name) {
            errors.push(section::ConfigError::new(
                format!("{path}.name"),
                format!("{why} (expected e.g. kubernetes)"),
            ));
        }
        if self.port == 0 {
            errors.push(section::ConfigError::new(
                format!("{path}.port"),
                "must be a port between 1 and 65535 (upstream uses 443)",
            ));
        }
    }

    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let config = self.loop_config(context.settings);
        config.validate()?;
        Ok(vec![Arc::new(KubernetesServiceLoop::new(
            config,
            context.client.clone(),
            context.settings.reporter(),
            context.registry,
        ))])
    }
}

impl KubernetesServiceConfig {
    /// Fields are named as in the file's top level or the loop's section (`port`, `nodePort`).
    pub fn validate(&self) -> Result<(), section::ConfigError> {
        let err = |field: &str, message: String| Err(section::ConfigError::new(field, message));
        // None: read from the cluster's `kubernetes` ServiceCIDR.
        if let Err(problem) = validate_ranges(&self.service_cidrs) {
            return err("serviceClusterIPRange", problem.to_string());
        }
        if !(1..=65535).contains(&self.port) {
            return err("port", format!("{} is not a port (1-65535)", self.port));
        }
        if !(1..=65535).contains(&self.target_port) {
            return err(
                "securePort",
                format!("{} is not a port (1-65535)", self.target_port),
            );
        }
        if let Some(node_port) = self.node_port
            && !(1..=65535).contains(&node_port)
        {
            return err(
                "nodePort",
                format!(
                    "{node_port} is not a port (1-65535); leave it unset for a ClusterIP Service"
                ),
            );
        }
        if self.interval.is_zero() {
            return err("interval", "must be greater than zero".to_owned());
        }
        Ok(())
    }

    /// The desired cluster IP: the first usable address of the primary range (upstream's
    /// `ServiceIP`), or none while no range is known. The secondary range gets none: the
    /// Service is single-stack.
    pub fn cluster_ips(&self) -> Vec<IpAddr> {
        self.service_cidrs
            .first()
            .and_then(first_usable_ip)
            .into_iter()
            .collect()
    }

    pub fn object_ref(&self) -> String {
        format!("Service/{}/{}", self.namespace, self.name)
    }

    pub(super) fn service_type(&self) -> &'static str {
        if self.node_port.is_some() {
            "NodePort"
        } else {
            "ClusterIP"
        }
    }

    pub(super) fn ports(&self) -> Vec<ServicePort> {
        vec![ServicePort {
            name: Some("https".to_owned()),
            protocol: Some("TCP".to_owned()),
            port: self.port,
            target_port: Some(IntOrString::Int(self.target_port)),
            node_port: self.node_port,
            app_protocol: None,
        }]
    }
}

/// Upstream's `GetIndexedIP(range, 1)`: the network address plus one.
pub fn first_usable_ip(cidr: &IpNet) -> Option<IpAddr> {
    match cidr.network() {
        IpAddr::V4(net) => u32::from(net).checked_add(1).map(|n| IpAddr::V4(n.into())),
        IpAddr::V6(net) => u128::from(net).checked_add(1).map(|n| IpAddr::V6(n.into())),
    }
    .filter(|ip| cidr.contains(ip))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn first_usable_ip_is_network_plus_one() {
        assert_eq!(
            first_usable_ip(&"10.96.0.0/12".parse().unwrap()),
            Some("10.96.0.1".parse().unwrap())
        );
        assert_eq!(
            first_usable_ip(&"10.96.3.7/12".parse().unwrap()),
            Some("10.96.0.1".parse().unwrap())
        );
        assert_eq!(
            first_usable_ip(&"fd00:10::/108".parse().unwrap()),
            Some("fd00:10::1".parse().unwrap())
        );
        assert_eq!(first_usable_ip(&"10.0.0.1/32".parse().unwrap()), None);
    }
}

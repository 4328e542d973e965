//! `loops.kubernetesService`: the section of the configuration file, which is also the loop's
//! configuration; the top-level settings give the rest of the Service (the Service range,
//! `securePort`, `kubernetesServiceNodePort`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Service, ServicePort};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use serde::{Deserialize, Serialize};

use super::KubernetesServiceLoop;
use crate::alloc::ServiceRange;
use crate::contract::Reconciler;
use crate::names::validate_dns1123_label;
use crate::section::{
    self, BuildContext, BuildError, DEFAULT_SECURE_PORT, LoopSection, ServiceName, Settings,
    duration_format, validate_interval,
};

/// Upstream's interval (`kubernetesservice`: every 10 s).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

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

/// `loops.kubernetesService`: the `default/kubernetes` Service. Its clusterIP, targetPort and
/// node port come from `serviceClusterIPRange`, `securePort` and `kubernetesServiceNodePort`.
/// The loop's one configuration type: the loop is built from the section and the settings.
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
    /// range, once nothing else holds that IP and a dry-run create shows the API takes it.
    /// Destructive (connections through the old IP break); off by default.
    #[serde(rename = "recreateOnClusterIPMismatch")]
    pub recreate_on_cluster_ip_mismatch: bool,
}

impl Default for Section {
    fn default() -> Self {
        Section {
            enabled: true,
            interval: DEFAULT_INTERVAL,
            namespace: "default".to_owned(),
            name: "kubernetes".to_owned(),
            port: 443,
            repair: RepairPolicy::Repair,
            recreate_on_cluster_ip_mismatch: false,
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
        let shared = (context.services(None), context.discovery());
        Ok(vec![Arc::new(KubernetesServiceLoop::with_shared(
            self.clone(),
            context.settings,
            context.client.clone(),
            shared,
            context.registry,
        ))])
    }
}

impl Section {
    /// The Service this section keeps, which the endpoints loops and the repairs read too.
    pub fn service(&self) -> ServiceName {
        ServiceName {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
        }
    }

    pub fn object_ref(&self) -> String {
        format!("Service/{}/{}", self.namespace, self.name)
    }
}

/// The desired cluster IP: the first usable address of the primary range (upstream's
/// `ServiceIP`), or none while no range is known. The secondary range gets none: the Service is
/// single-stack.
pub fn cluster_ips(settings: &Settings) -> Vec<IpAddr> {
    settings
        .service_ranges
        .first()
        .and_then(|net| ServiceRange::new(*net).first_usable())
        .into_iter()
        .collect()
}

/// The Service's type and node port. `kubernetesServiceNodePort` 0 makes it ClusterIP, a port
/// NodePort on that port. Unset, an existing NodePort Service keeps its type and node port
/// (kube-apiserver's `--kubernetes-service-node-port` makes one, and its clients use that port),
/// so that no default rewrites what the cluster chose; any other Service is ClusterIP.
pub(super) fn service_type(
    settings: &Settings,
    existing: Option<&Service>,
) -> (&'static str, Option<i32>) {
    match settings.kubernetes_service_node_port {
        Some(0) => ("ClusterIP", None),
        Some(port) => ("NodePort", Some(i32::from(port))),
        None => match existing
            .and_then(|service| service.spec.as_ref())
            .filter(|spec| spec.type_.as_deref() == Some("NodePort"))
        {
            Some(spec) => (
                "NodePort",
                (spec.ports.as_ref())
                    .and_then(|ports| ports.first())
                    .and_then(|port| port.node_port),
            ),
            None => ("ClusterIP", None),
        },
    }
}

/// The Service's one port: the section's port to `securePort`, on the node port if any
/// ([`service_type`]). Without
/// a configured `securePort` the targetPort is the one `existing` has (kube-apiserver's default
/// 6443 on a Service being created), so that no default rewrites what the cluster chose.
pub(super) fn ports(
    section: &Section,
    settings: &Settings,
    existing: Option<&Service>,
) -> Vec<ServicePort> {
    let kept = existing
        .and_then(|service| service.spec.as_ref())
        .and_then(|spec| spec.ports.as_ref())
        .and_then(|ports| ports.first())
        .and_then(|port| port.target_port.clone());
    let target_port = match settings.secure_port {
        Some(port) => IntOrString::Int(i32::from(port)),
        None => kept.unwrap_or(IntOrString::Int(i32::from(DEFAULT_SECURE_PORT))),
    };
    vec![ServicePort {
        name: Some("https".to_owned()),
        protocol: Some("TCP".to_owned()),
        port: i32::from(section.port),
        target_port: Some(target_port),
        node_port: service_type(settings, existing).1,
        app_protocol: None,
    }]
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_yaml_path() {
        let section = Section {
            interval: Duration::ZERO,
            name: "Kubernetes".to_owned(),
            port: 0,
            ..Section::default()
        };
        assert_eq!(
            crate::section::refused_fields("loops.kubernetesService", &section),
            [
                "loops.kubernetesService.interval",
                "loops.kubernetesService.name",
                "loops.kubernetesService.port"
            ]
        );
    }
}

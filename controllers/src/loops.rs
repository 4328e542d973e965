//! Builds the enabled loops from the effective configuration.
//!
//! One clearly separated block per loop: read its section of [`Config::loops`], build it with the
//! client and the metrics registry, push it. A loop that is disabled is not built at all (no
//! watches, no metrics, not part of `/readyz`).

use std::sync::Arc;

use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use tracing::{info, warn};

use crate::config::Config;

/// Every enabled loop, ready for the runner. `list_client`, when there is one, carries the large
/// LISTs of the ClusterIP repair ([`list_client`]).
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
    list_client: Option<&kube::Client>,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let mut loops: Vec<Arc<dyn Reconciler>> = Vec::new();

    // --- system namespaces -----------------------------------------------------------
    let section = &config.loops.system_namespaces;
    if section.enabled {
        use reconcilers::system_namespaces::{self, SystemNamespaces};
        let loop_config = system_namespaces::Config {
            namespaces: section
                .namespaces
                .iter()
                .map(|spec| system_namespaces::NamespaceSpec {
                    name: spec.name.clone(),
                    labels: spec.labels.clone(),
                    annotations: spec.annotations.clone(),
                })
                .collect(),
            interval: section.interval,
        };
        loops.push(Arc::new(SystemNamespaces::new(
            client.clone(),
            loop_config,
            registry,
        )));
    } else {
        info!("loop system-namespaces disabled by configuration");
    }

    // --- kubernetes Service ----------------------------------------------------------
    let section = &config.loops.kubernetes_service;
    if section.enabled {
        use reconcilers::kubernetes_service::{
            KubernetesServiceConfig, KubernetesServiceLoop, RepairPolicy,
        };
        let loop_config = KubernetesServiceConfig {
            namespace: section.namespace.clone(),
            name: section.name.clone(),
            port: i32::from(section.port),
            target_port: i32::from(config.secure_port),
            service_cidrs: config.service_cluster_ip_range.clone(),
            node_port: (config.kubernetes_service_node_port != 0)
                .then(|| i32::from(config.kubernetes_service_node_port)),
            repair: match section.repair {
                crate::config::ServiceRepairPolicy::Repair => RepairPolicy::Repair,
                crate::config::ServiceRepairPolicy::Off => RepairPolicy::Off,
            },
            recreate_on_cluster_ip_mismatch: section.recreate_on_cluster_ip_mismatch,
            interval: section.interval,
        };
        match loop_config.validate() {
            Ok(()) => loops.push(Arc::new(KubernetesServiceLoop::new(
                loop_config,
                client.clone(),
                event_reporter(config),
                registry,
            ))),
            // Unreachable after Config validation; never panic on it.
            Err(err) => warn!("loop kubernetes-service not built: {err}"),
        }
    } else {
        info!("loop kubernetes-service disabled by configuration");
    }

    // --- apiserver endpoints: apiserver-lease on every replica, apiserver-endpoints
    // on the leader (on every replica in master-count mode, as upstream) -------------------------
    let section = &config.loops.apiserver_endpoints;
    if section.enabled {
        use reconcilers::apiserver_endpoints::{
            self as endpoints, ApiserverReadyz, EndpointsDeps, LazyUrlReadyz, ReadinessProbe,
            SystemResolver,
        };
        let loop_config = apiserver_endpoints_config(config);
        let mode = loop_config.mode;
        let probe_timeout = section.interval.min(std::time::Duration::from_secs(5));
        let readiness: Arc<dyn ReadinessProbe> = if section.readyz_url.starts_with("http://")
            || section.readyz_url.starts_with("https://")
        {
            let kubeconfig = config.kubeconfig.clone();
            Arc::new(LazyUrlReadyz::new(
                section.readyz_url.clone(),
                probe_timeout,
                Arc::new(move || {
                    let kubeconfig = kubeconfig.clone();
                    Box::pin(async move { crate::cli::kube_config(kubeconfig.as_deref()).await })
                }),
            ))
        } else {
            let path = if section.readyz_url.is_empty() {
                "/readyz"
            } else {
                section.readyz_url.as_str()
            };
            Arc::new(ApiserverReadyz::new(client.clone(), path, probe_timeout))
        };
        match loop_config.validate() {
            Ok(()) => {
                if let Some(address) = loop_config.advertise_address {
                    info!(%address, mode = ?mode, "apiserver endpoints: this instance's address");
                }
                let deps = EndpointsDeps {
                    client: client.clone(),
                    readiness,
                    resolver: Arc::new(SystemResolver),
                    reporter: event_reporter(config),
                };
                for built in endpoints::build_loops(&loop_config, deps, registry) {
                    loops.push(Arc::from(built));
                }
            }
            // Config validation checks the same; never panic on it.
            Err(err) => warn!("loops apiserver-lease/apiserver-endpoints not built: {err}"),
        }
    } else {
        info!("loop apiserver-endpoints disabled by configuration");
    }

    // --- default ServiceCIDR ----------------------------------------------------------
    let section = &config.loops.service_cidr;
    if section.enabled {
        use reconcilers::service_cidr::{DefaultServiceCidr, ServiceCidrConfig};
        let loop_config = ServiceCidrConfig {
            cidrs: config.service_cluster_ip_range.clone(),
            interval: section.interval,
            reporting_instance: Some(config.leader_identity()),
        };
        match DefaultServiceCidr::new(client.clone(), loop_config) {
            Ok(built) => loops.push(Arc::new(built)),
            // Config validation checks the range; never panic on it.
            Err(err) => warn!("loop service-cidr not built: {err}"),
        }
    } else {
        info!("loop service-cidr disabled by configuration");
    }

    // --- ClusterIP repair -------------------------------------------------------------
    // Its Service cache, when it runs, is the NodePort repair's too: one watch of Services.
    let mut shared_services = None;
    let section = &config.loops.cluster_ip_repair;
    if section.enabled {
        use crate::config::ClusterIpRepairMode;
        use reconcilers::clusterip_repair::{ClusterIpRepair, ClusterIpRepairConfig, RepairMode};
        let loop_config = ClusterIpRepairConfig {
            interval: section.interval,
            orphan_grace: section.orphan_grace_period,
            mode: match section.mode {
                ClusterIpRepairMode::Auto => RepairMode::Auto,
                ClusterIpRepairMode::IpAddress => RepairMode::IpAddress,
                ClusterIpRepairMode::Audit => RepairMode::Audit,
            },
            service_ranges: config.service_cluster_ip_range.clone(),
            reporting_instance: Some(config.leader_identity()),
            page_size: section.page_size,
            etcd: config.etcd(),
            ..ClusterIpRepairConfig::default()
        };
        match ClusterIpRepair::new(client.clone(), loop_config, registry) {
            Ok(built) => {
                shared_services = Some(built.shared_services());
                loops.push(Arc::new(match list_client {
                    Some(list_client) => built.with_list_client(list_client.clone()),
                    None => built,
                }));
            }
            Err(err) => warn!("loop clusterip-repair not built: {err}"),
        }
    } else {
        info!("loop clusterip-repair disabled by configuration");
    }

    // --- NodePort repair ------------------------------------------------------------------------
    let section = &config.loops.node_port_repair;
    if section.enabled {
        use reconcilers::nodeport_repair::{NodePortRepair, NodePortRepairConfig, PortRange};
        let range = &config.service_node_port_range;
        match PortRange::new(range.base, range.last) {
            Ok(range) => {
                let loop_config = NodePortRepairConfig {
                    interval: section.interval,
                    range,
                    reporting_instance: Some(config.leader_identity()),
                    page_size: config.loops.cluster_ip_repair.page_size,
                    etcd: config.etcd(),
                };
                loops.push(Arc::new(NodePortRepair::new(
                    client.clone(),
                    loop_config,
                    shared_services,
                    registry,
                )));
            }
            // Config validation checks the range; never panic on it.
            Err(err) => warn!("loop nodeport-repair not built: {err}"),
        }
    } else {
        info!("loop nodeport-repair disabled by configuration");
    }

    loops
}

/// A client for the ClusterIP repair's LISTs that reads each response on the task that decodes
/// it ([`reconcilers::transport`]); `None`, and the repair lists through the main client, when
/// the loop is off or configured so (`loops.clusterIPRepair.listTransport: kubeClient`), when
/// the kubeconfig needs what only kube's client does (a proxy, an exec plugin), or when the
/// transport cannot be built.
pub fn list_client(config: &Config, kube_config: &kube::Config) -> Option<kube::Client> {
    use crate::config::ListTransport;
    let section = &config.loops.cluster_ip_repair;
    if !section.enabled || section.list_transport == ListTransport::KubeClient {
        return None;
    }
    match reconcilers::transport::in_task_client(kube_config) {
        Ok(Some(client)) => Some(client),
        Ok(None) => {
            info!(
                "the ClusterIP repair lists through kube's client (the kubeconfig uses a proxy or an exec plugin)"
            );
            None
        }
        Err(err) => {
            warn!(error = %err, "the ClusterIP repair lists through kube's client: its LIST transport could not be built");
            None
        }
    }
}

/// Who events say they come from: the controller, and this replica.
fn event_reporter(config: &Config) -> kube::runtime::events::Reporter {
    kube::runtime::events::Reporter {
        controller: "bootstrap-controller".to_owned(),
        instance: Some(config.leader_identity()),
    }
}

/// The endpoint loops' configuration from the effective configuration: mode from
/// `endpointReconcilerType`, Service from `loops.kubernetesService`, port from `securePort`,
/// primary family from the first service range. Public so `demo` and tests build members that
/// match the running controller.
pub fn apiserver_endpoints_config(
    config: &Config,
) -> reconcilers::apiserver_endpoints::ApiserverEndpointsConfig {
    use crate::config::EndpointReconcilerType;
    use reconcilers::apiserver_endpoints::{
        ApiserverEndpointsConfig, EndpointsMode, EndpointsTarget, IpFamily,
    };
    let section = &config.loops.apiserver_endpoints;
    let mode = match config.endpoint_reconciler_type {
        EndpointReconcilerType::Lease => EndpointsMode::Lease,
        EndpointReconcilerType::Static => EndpointsMode::Static,
        EndpointReconcilerType::MasterCount => EndpointsMode::MasterCount,
        EndpointReconcilerType::None => EndpointsMode::None,
    };
    let primary_family = config
        .service_cluster_ip_range
        .first()
        .map(|net| match net {
            ipnet::IpNet::V4(_) => IpFamily::V4,
            ipnet::IpNet::V6(_) => IpFamily::V6,
        });
    ApiserverEndpointsConfig {
        mode,
        target: EndpointsTarget {
            namespace: config.loops.kubernetes_service.namespace.clone(),
            service_name: config.loops.kubernetes_service.name.clone(),
            port: i32::from(config.secure_port),
            primary_family,
        },
        advertise_address: section.advertise_address(config),
        interval: section.interval,
        lease_namespace: section.lease_namespace.clone(),
        lease_ttl: section.lease_ttl,
        identity: config.leader_identity(),
        static_addresses: section.static_addresses.clone(),
        apiserver_count: usize::try_from(config.apiserver_count).unwrap_or(usize::MAX),
        leader_lease: config.leader_election.enabled.then(|| {
            (
                config.leader_election.lease_namespace.clone(),
                config.leader_election.lease_name.clone(),
            )
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::config::{ConfigArgs, ListTransport, parse_file};

    /// The repair gets its own LIST client unless the configuration or the kubeconfig says not
    /// to.
    #[tokio::test]
    async fn the_list_transport_is_used_unless_configured_off() {
        let mut config = Config::merge(&ConfigArgs::default(), parse_file("{}").unwrap()).unwrap();
        let kube_config = kube::Config::new("https://127.0.0.1:6443".parse().unwrap());
        assert!(list_client(&config, &kube_config).is_some());

        config.loops.cluster_ip_repair.list_transport = ListTransport::KubeClient;
        assert!(list_client(&config, &kube_config).is_none());

        config.loops.cluster_ip_repair.list_transport = ListTransport::Own;
        config.loops.cluster_ip_repair.enabled = false;
        assert!(list_client(&config, &kube_config).is_none());

        config.loops.cluster_ip_repair.enabled = true;
        let mut behind_proxy = kube_config.clone();
        behind_proxy.proxy_url = Some("http://proxy.example:3128".parse().unwrap());
        assert!(list_client(&config, &behind_proxy).is_none());
    }
}

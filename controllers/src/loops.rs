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

/// Every enabled loop, ready for the runner.
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
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
        let loop_config = config.apiserver_endpoints();
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
                    Box::pin(async move {
                        crate::kubeconfig::load(kubeconfig.as_deref())
                            .await
                            .map_err(Into::into)
                    })
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
                loops.push(Arc::new(built));
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

/// Who events say they come from: the controller, and this replica.
fn event_reporter(config: &Config) -> kube::runtime::events::Reporter {
    kube::runtime::events::Reporter {
        controller: "bootstrap-controller".to_owned(),
        instance: Some(config.leader_identity()),
    }
}

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

    // --- system namespaces (issue 3) -----------------------------------------------------------
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

    // Sections whose loops are not wired in yet: say so rather than silently doing nothing.
    // Each helper replaces its line with a block like the one above.
    for (name, enabled) in [
        // --- kubernetes Service (issue 4): config.loops.kubernetes_service
        (
            "kubernetes-service",
            config.loops.kubernetes_service.enabled,
        ),
        // --- apiserver endpoints (issue 4): config.loops.apiserver_endpoints
        (
            "apiserver-endpoints",
            config.loops.apiserver_endpoints.enabled,
        ),
        // --- default ServiceCIDR (issue 5): config.loops.service_cidr
        ("service-cidr", config.loops.service_cidr.enabled),
        // --- ClusterIP repair (issue 5): config.loops.cluster_ip_repair
        ("cluster-ip-repair", config.loops.cluster_ip_repair.enabled),
    ] {
        if enabled {
            warn!(
                "loop {name} is enabled in the configuration but not built into this binary yet; skipped"
            );
        }
    }

    loops
}

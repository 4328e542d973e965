//! Builds the enabled loops from the effective configuration: each section in [`Loops`] builds
//! its own loop (see [`reconcilers::section`]). A loop that is disabled is not built at all (no
//! watches, no metrics, not part of `/readyz`).
//!
//! [`Loops`]: crate::config::Loops

use std::sync::Arc;

use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::apiserver_endpoints::ConfigLoader;
use reconcilers::budget::{BudgetLimits, CacheBudget};
use reconcilers::section::{BuildContext, Settings};
use tracing::{info, warn};

use crate::config::Config;
use crate::metrics::RunnerMetrics;
use crate::runner::{Runner, RunnerOptions};

/// Every enabled loop of the one cluster of `--kubeconfig`, ready for the runner.
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let budget = CacheBudget::new(BudgetLimits::UNLIMITED, "", registry);
    build_cluster_loops(config, client, kubeconfig_loader(config), &budget, registry)
}

/// Reads `--kubeconfig` again when a loop needs the configuration (the apiserver probe).
pub fn kubeconfig_loader(config: &Config) -> ConfigLoader {
    let kubeconfig = config.kubeconfig.clone();
    Arc::new(move || {
        let kubeconfig = kubeconfig.clone();
        Box::pin(async move {
            crate::kubeconfig::load(kubeconfig.as_deref())
                .await
                .map_err(Into::into)
        })
    })
}

/// The runtime of one cluster: its loops, their runner and the runner's metrics in `registry`.
/// The single-cluster mode makes one (with an unlimited cache budget); management mode one per
/// tenant, each within its own budget.
pub fn build_runner(
    config: &Config,
    client: &kube::Client,
    load_kubeconfig: ConfigLoader,
    budget: &CacheBudget,
    registry: &mut Registry,
) -> Runner {
    let metrics = RunnerMetrics::register(registry);
    crate::metrics::register_etcd_mode(registry, !config.etcd_servers.is_empty());
    let loops = build_cluster_loops(config, client, load_kubeconfig, budget, registry);
    Runner::new(loops, client.clone(), runner_options(config), metrics)
}

/// How the runner drives the loops, from the configuration.
pub fn runner_options(config: &Config) -> RunnerOptions {
    RunnerOptions {
        dry_run: config.dry_run,
        timer_only: config.timer_only,
        shutdown_timeout: config.shutdown_timeout,
        ..RunnerOptions::default()
    }
}

/// Every enabled loop of one cluster: the one of `--kubeconfig`, or one tenant in management
/// mode (whose kubeconfig comes from its Secret, hence `load_kubeconfig`).
pub fn build_cluster_loops(
    config: &Config,
    client: &kube::Client,
    load_kubeconfig: ConfigLoader,
    budget: &CacheBudget,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let settings = Settings {
        cache_budget: budget.clone(),
        ..config.settings()
    };
    let mut context = BuildContext::new(client.clone(), registry, &settings, load_kubeconfig);
    let mut loops = Vec::new();
    for (key, section) in config.loops.sections() {
        if !section.enabled() {
            info!("loops.{key} disabled by configuration");
            continue;
        }
        match section.build(&mut context) {
            Ok(built) => loops.extend(built),
            // Configuration validation checks the same; never panic on it.
            Err(err) => warn!("loops.{key} not built: {err}"),
        }
    }
    loops
}

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
use reconcilers::metrics::MetricRegistry;
use reconcilers::section::{BuildContext, Settings};
use tracing::{info, warn};

use crate::config::Config;
use crate::metrics::RunnerMetrics;
use crate::runner::{Runner, RunnerOptions};

/// Said once at start when no endpoints mode is named: the endpoints loop is then not built.
pub const ENDPOINTS_UNNAMED: &str = "the kubernetes endpoints are left alone: no endpoint \
     reconciler type is named; to keep them, set --endpoint-reconciler-type \
     (BOOTSTRAP_ENDPOINT_RECONCILER_TYPE, file key endpointReconcilerType) to lease, static or \
     master-count";

/// Every enabled loop of the one cluster of `--kubeconfig`, ready for the runner.
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let budget = CacheBudget::new(BudgetLimits::UNLIMITED, "", None, registry);
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
    registry: &mut dyn MetricRegistry,
) -> Runner {
    let metrics = RunnerMetrics::register(registry);
    crate::metrics::register_etcd_mode(registry, !config.settings.etcd.servers.is_empty());
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
    registry: &mut dyn MetricRegistry,
) -> Vec<Arc<dyn Reconciler>> {
    let settings = Settings {
        cache_budget: budget.clone(),
        ..config.settings.clone()
    };
    let mut context = BuildContext::new(client.clone(), registry, &settings, load_kubeconfig);
    let mut loops = Vec::new();
    if config.loops.apiserver_endpoints.mode.is_none() && config.loops.apiserver_endpoints.enabled {
        info!("{ENDPOINTS_UNNAMED}");
    }
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::config::{ConfigArgs, EndpointsMode};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    /// The names of the loops `args` builds, and what building them logged at info.
    fn built(args: ConfigArgs) -> (Vec<&'static str>, String) {
        let config = Config::load(&args).unwrap();
        let kube_config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let client = kube::Client::try_from(kube_config).unwrap();
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || writer.clone())
            .finish();
        let loops = tracing::subscriber::with_default(subscriber, || {
            build_loops(&config, &client, &mut Registry::default())
        });
        let names = loops.iter().map(|built| built.name()).collect();
        let logged = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        (names, logged)
    }

    #[tokio::test]
    async fn with_no_endpoints_mode_named_the_endpoints_are_left_alone_and_that_is_said_once() {
        let (names, logged) = built(ConfigArgs::default());
        assert!(names.contains(&"system-namespaces"), "{names:?}");
        assert!(
            !names.iter().any(|name| name.starts_with("apiserver-")),
            "no endpoints loop without a mode named: {names:?}"
        );
        assert_eq!(
            logged.matches(ENDPOINTS_UNNAMED).count(),
            1,
            "one line naming the flag: {logged}"
        );
        assert!(logged.contains(" INFO "), "{logged}");
        assert!(ENDPOINTS_UNNAMED.contains("--endpoint-reconciler-type"));

        let (names, logged) = built(ConfigArgs {
            endpoint_reconciler_type: Some(EndpointsMode::Lease),
            advertise_address: Some("192.0.2.10".to_owned()),
            ..ConfigArgs::default()
        });
        assert!(names.contains(&"apiserver-lease"), "{names:?}");
        assert!(names.contains(&"apiserver-endpoints"), "{names:?}");
        assert!(!logged.contains(ENDPOINTS_UNNAMED), "{logged}");

        let (names, logged) = built(ConfigArgs {
            endpoint_reconciler_type: Some(EndpointsMode::None),
            ..ConfigArgs::default()
        });
        assert!(!names.iter().any(|name| name.starts_with("apiserver-")));
        assert!(!logged.contains(ENDPOINTS_UNNAMED), "named none: {logged}");
    }
}

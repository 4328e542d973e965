//! Builds the enabled loops from the effective configuration: each section in [`Loops`] builds
//! its own loop (see [`reconcilers::section`]). A loop that is disabled is not built at all (no
//! watches, no metrics, not part of `/readyz`).
//!
//! [`Loops`]: crate::config::Loops

use std::sync::Arc;

use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::section::BuildContext;
use tracing::{info, warn};

use crate::config::Config;

/// Every enabled loop, ready for the runner.
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let settings = config.settings();
    let kubeconfig = config.kubeconfig.clone();
    let mut context = BuildContext {
        client: client.clone(),
        registry,
        settings: &settings,
        load_kubeconfig: Arc::new(move || {
            let kubeconfig = kubeconfig.clone();
            Box::pin(async move {
                crate::kubeconfig::load(kubeconfig.as_deref())
                    .await
                    .map_err(Into::into)
            })
        }),
        services: None,
    };
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

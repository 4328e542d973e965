//! `loops.serviceCIDR`: the section of the configuration file, which is also the loop's
//! configuration; the ranges are the shared `serviceClusterIPRange`.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tracing::info;

use super::ServiceCidrLoop;
use crate::contract::Reconciler;
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval,
};

/// Upstream's interval (`defaultservicecidr`: every 10 s).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);

/// `loops.serviceCIDR`: the default ServiceCIDR `kubernetes`, from `serviceClusterIPRange`.
/// The loop's one configuration type: the loop is built from the section and the settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
}

impl Default for Section {
    fn default() -> Self {
        Section {
            enabled: true,
            interval: DEFAULT_INTERVAL,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<ConfigError>) {
        validate_interval(path, self.interval, errors);
    }

    /// Without `serviceClusterIPRange` there is nothing to create or check the default
    /// ServiceCIDR against (the other loops read the range from it): no loop, and a log line
    /// saying so. Inventing a range would create a ServiceCIDR the apiserver does not serve.
    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let shared = (context.service_cidrs(None), context.discovery());
        match ServiceCidrLoop::with_shared(
            context.client.clone(),
            self.clone(),
            context.settings,
            shared,
        ) {
            Some(built) => Ok(vec![Arc::new(built)]),
            None => {
                info!(
                    "loops.serviceCIDR not started: serviceClusterIPRange is not set, so there is \
                     no range to create or check the ServiceCIDR \"kubernetes\" with \
                     (kube-apiserver 1.33+ creates it from its own --service-cluster-ip-range)"
                );
                Ok(Vec::new())
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_yaml_path() {
        let section = Section {
            interval: Duration::ZERO,
            ..Section::default()
        };
        assert_eq!(
            crate::section::refused_fields("loops.serviceCIDR", &section),
            ["loops.serviceCIDR.interval"]
        );
        assert_eq!(Section::default().interval, Duration::from_secs(10));
    }
}

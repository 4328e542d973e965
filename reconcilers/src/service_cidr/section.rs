//! `loops.serviceCIDR`: the section of the configuration file, and the loop's configuration made
//! from it and the Service range.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};
use tracing::info;

use super::DefaultServiceCidr;
use crate::contract::Reconciler;
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval,
};
use crate::service_range::validate_ranges;

/// Configuration of the default ServiceCIDR loop (`loops.serviceCIDR`).
#[derive(Clone, Debug)]
pub struct ServiceCidrConfig {
    /// The API server's `--service-cluster-ip-range` value(s), primary first.
    pub cidrs: Vec<IpNet>,
    /// Upstream: 10 s.
    pub interval: Duration,
    /// `reportingInstance` of the events; `None` uses the host name.
    pub reporting_instance: Option<String>,
}

impl Default for ServiceCidrConfig {
    fn default() -> Self {
        Self {
            cidrs: Vec::new(),
            interval: Duration::from_secs(10),
            reporting_instance: None,
        }
    }
}

/// `loops.serviceCIDR`: the default ServiceCIDR `kubernetes`, from `serviceClusterIPRange`.
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
            interval: ServiceCidrConfig::default().interval,
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
        if context.settings.service_ranges.is_empty() {
            info!(
                "loops.serviceCIDR not started: serviceClusterIPRange is not set, so there is no \
                 range to create or check the ServiceCIDR \"kubernetes\" with (kube-apiserver \
                 1.33+ creates it from its own --service-cluster-ip-range)"
            );
            return Ok(Vec::new());
        }
        let config = ServiceCidrConfig {
            cidrs: context.settings.service_ranges.clone(),
            interval: self.interval,
            reporting_instance: Some(context.settings.identity.clone()),
        };
        Ok(vec![Arc::new(DefaultServiceCidr::new(
            context.client.clone(),
            config,
        )?)])
    }
}

impl ServiceCidrConfig {
    /// Errors name the field's YAML path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const RANGE: &str = "serviceClusterIPRange";
        if self.cidrs.is_empty() {
            return Err(ConfigError::new(
                RANGE,
                "set the API server's --service-cluster-ip-range value(s), primary first (e.g. \
                 [10.96.0.0/12])",
            ));
        }
        validate_ranges(&self.cidrs).map_err(|err| ConfigError::new(RANGE, err))?;
        if let Some(net) = self.cidrs.iter().find(|net| net.trunc() != **net) {
            return Err(ConfigError::new(
                RANGE,
                format!("{net} has host bits set; write it as {}", net.trunc()),
            ));
        }
        if self.interval.is_zero() {
            return Err(ConfigError::new(
                "loops.serviceCIDR.interval",
                "must be greater than zero (upstream uses 10s)",
            ));
        }
        Ok(())
    }

    pub(super) fn desired(&self) -> Vec<String> {
        self.cidrs.iter().map(ToString::to_string).collect()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[test]
    fn config_errors_name_the_field() {
        let err = ServiceCidrConfig::default().validate().unwrap_err();
        assert_eq!(err.field, "serviceClusterIPRange");
        assert!(err.to_string().starts_with("serviceClusterIPRange:"));
        let host_bits = ServiceCidrConfig {
            cidrs: nets(&["10.96.0.1/12"]),
            ..ServiceCidrConfig::default()
        };
        assert!(
            host_bits
                .validate()
                .unwrap_err()
                .message
                .contains("10.96.0.0/12")
        );
        let ok = ServiceCidrConfig {
            cidrs: nets(&["10.96.0.0/12", "fd00::/108"]),
            ..ServiceCidrConfig::default()
        };
        assert!(ok.validate().is_ok());
    }
}

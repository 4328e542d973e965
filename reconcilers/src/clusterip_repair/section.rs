//! The loop's file section, `loops.clusterIPRepair`, which is also the loop's configuration; the
//! top-level settings give the service ranges, the `kubernetes` Service and etcd mode.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ClusterIpRepairLoop;
use crate::contract::Reconciler;
use crate::section::{
    self, BuildContext, BuildError, LoopSection, Settings, duration_format, validate_interval,
    validate_page_size,
};
use crate::watch_cache;

/// Which repair to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RepairMode {
    /// IPAddress mode when discovery shows `networking.k8s.io/v1` IPAddress and ServiceCIDR,
    /// audit mode otherwise, until discovery, asked again each interval, shows them.
    #[default]
    Auto,
    /// Repair IPAddress objects (Kubernetes 1.33+).
    IpAddress,
    /// Only report duplicates, out-of-range and invalid cluster IPs of `serviceClusterIPRange`.
    Audit,
}

/// Upstream's interval (the repair runs every 3 minutes).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(180);

/// Upstream's grace for an IPAddress whose Service is missing: kube-apiserver writes the
/// IPAddress before the Service.
pub const DEFAULT_ORPHAN_GRACE_PERIOD: Duration = Duration::from_secs(60);

/// `loops.clusterIPRepair`: Services' cluster IPs against IPAddress objects (or audited against
/// `serviceClusterIPRange`), and the legacy bitmaps in etcd mode. The loop's one configuration
/// type: the loop is built from the section and the settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
    pub mode: RepairMode,
    /// How long an allocator-managed IPAddress whose Service does not exist is left alone
    /// before it is deleted as leaked (upstream: 60s; kube-apiserver writes the IPAddress before
    /// the Service).
    #[serde(with = "duration_format")]
    pub orphan_grace_period: Duration,
    /// Objects per LIST page when the caches (re)list Services, IPAddresses and ServiceCIDRs,
    /// and when a leak in an etcd bitmap is confirmed by a fresh list.
    pub page_size: u32,
    /// etcd mode: a legacy bitmap stored under another range than `serviceClusterIPRange` (or
    /// none) is rebuilt under it, dropping the IPs outside it. Off: it is reported and left
    /// alone. For an operator who changed kube-apiserver's `--service-cluster-ip-range` and
    /// wants the bitmap moved before kube-apiserver's restart does it.
    pub rebuild_bitmap_on_range_change: bool,
    /// etcd mode: how far apart the three sightings of a set bit no Service holds must be
    /// before it is released (upstream's passes are 3 minutes apart; this loop's may be closer).
    #[serde(with = "duration_format")]
    pub leak_sighting_spacing: Duration,
}

impl Default for Section {
    fn default() -> Self {
        Section {
            enabled: true,
            interval: DEFAULT_INTERVAL,
            mode: RepairMode::Auto,
            orphan_grace_period: DEFAULT_ORPHAN_GRACE_PERIOD,
            page_size: watch_cache::DEFAULT_PAGE_SIZE,
            rebuild_bitmap_on_range_change: false,
            leak_sighting_spacing: crate::legacy_alloc::repair::DEFAULT_SIGHTING_SPACING,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<section::ConfigError>) {
        validate_interval(path, self.interval, errors);
        if self.orphan_grace_period < Duration::from_secs(5) {
            errors.push(section::ConfigError::new(
                format!("{path}.orphanGracePeriod"),
                "must be at least 5s (upstream uses 60s; shorter risks deleting the IPAddress of \
                 a Service that is still being created)",
            ));
        }
        validate_page_size(path, self.page_size, errors);
    }

    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let services = context.services(self.page_size);
        let service_cidrs = context.service_cidrs(self.page_size);
        let built = ClusterIpRepairLoop::with_shared(
            context.client.clone(),
            self.clone(),
            context.settings,
            context.kubernetes_service.clone(),
            (services, service_cidrs, context.discovery()),
            context.registry,
        );
        Ok(vec![Arc::new(built)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_yaml_path() {
        let section = Section {
            interval: Duration::ZERO,
            orphan_grace_period: Duration::from_secs(4),
            page_size: 0,
            ..Section::default()
        };
        assert_eq!(
            crate::section::refused_fields("loops.clusterIPRepair", &section),
            [
                "loops.clusterIPRepair.interval",
                "loops.clusterIPRepair.orphanGracePeriod",
                "loops.clusterIPRepair.pageSize"
            ]
        );
        let mut errors = Vec::new();
        section.validate(
            "loops.clusterIPRepair",
            &crate::section::test_settings(),
            &mut errors,
        );
        assert!(
            errors[0]
                .to_string()
                .starts_with("loops.clusterIPRepair.interval:")
        );
    }
}

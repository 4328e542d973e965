//! The loop's file section, `loops.clusterIPRepair`, and the configuration it builds.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use super::ClusterIpRepair;
use crate::contract::Reconciler;
use crate::section::{
    self, BuildContext, BuildError, LoopSection, Settings, duration_format, validate_interval,
    validate_page_size,
};
use crate::service_cache::store;
use crate::service_range::validate_ranges;

/// Which repair to run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RepairMode {
    /// IPAddress mode when discovery shows `networking.k8s.io/v1` IPAddress and ServiceCIDR,
    /// audit mode otherwise.
    #[default]
    Auto,
    /// Repair IPAddress objects (Kubernetes 1.33+).
    IpAddress,
    /// Only report duplicates, out-of-range and invalid cluster IPs of `serviceClusterIPRange`.
    Audit,
}

/// Configuration of the ClusterIP repair loop (`loops.clusterIPRepair`).
#[derive(Clone, Debug)]
pub struct ClusterIpRepairConfig {
    /// Full pass interval (upstream: 3 minutes).
    pub interval: Duration,
    /// How long an IPAddress whose Service is missing is left alone (upstream: 60 s), because
    /// kube-apiserver writes the IPAddress before the Service.
    pub orphan_grace: Duration,
    pub mode: RepairMode,
    /// The service ranges the API server is configured with (`--service-cluster-ip-range`), in
    /// family order; empty: read from the `kubernetes` ServiceCIDR when needed
    /// ([`crate::service_range`]). Needed by audit mode and etcd mode's bitmaps; IPAddress mode
    /// judges against the ServiceCIDRs themselves.
    pub service_ranges: Vec<IpNet>,
    /// The `kubernetes` Service, whose ClusterIP the error names when the range is unknown.
    pub kubernetes_service: section::ServiceName,
    /// `reportingInstance` of the events; `None` uses the host name.
    pub reporting_instance: Option<String>,
    /// When a delete is deferred, look again after this long.
    pub deferral_retry: Duration,
    /// LIST page size of the caches' (re)lists.
    pub page_size: u32,
    /// etcd mode: also repair the legacy ClusterIP bitmaps of `service_ranges` in etcd, where
    /// the cluster serves no IPAddress API.
    pub etcd: Option<crate::legacy_alloc::etcd::EtcdConfig>,
    /// etcd mode: rebuild a bitmap stored under another range (or none) under
    /// `service_ranges`, instead of reporting it and leaving it alone.
    pub rebuild_bitmap_on_range_change: bool,
}

impl Default for ClusterIpRepairConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(180),
            orphan_grace: Duration::from_secs(60),
            mode: RepairMode::Auto,
            service_ranges: Vec::new(),
            kubernetes_service: section::ServiceName {
                namespace: "default".to_owned(),
                name: "kubernetes".to_owned(),
            },
            reporting_instance: None,
            deferral_retry: Duration::from_secs(10),
            page_size: store::DEFAULT_PAGE_SIZE,
            etcd: None,
            rebuild_bitmap_on_range_change: false,
        }
    }
}

/// `loops.clusterIPRepair`: Services' cluster IPs against IPAddress objects (or audited against
/// `serviceClusterIPRange`), and the legacy bitmaps in etcd mode.
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
}

impl Default for Section {
    fn default() -> Self {
        let defaults = ClusterIpRepairConfig::default();
        Section {
            enabled: true,
            interval: defaults.interval,
            mode: defaults.mode,
            orphan_grace_period: defaults.orphan_grace,
            page_size: defaults.page_size,
            rebuild_bitmap_on_range_change: defaults.rebuild_bitmap_on_range_change,
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
        let config = ClusterIpRepairConfig {
            interval: self.interval,
            orphan_grace: self.orphan_grace_period,
            mode: self.mode,
            service_ranges: context.settings.service_ranges.clone(),
            kubernetes_service: context.settings.kubernetes_service.clone(),
            reporting_instance: Some(context.settings.identity.clone()),
            page_size: self.page_size,
            etcd: context.settings.etcd.clone(),
            rebuild_bitmap_on_range_change: self.rebuild_bitmap_on_range_change,
            ..ClusterIpRepairConfig::default()
        };
        let services = context.services();
        let built = ClusterIpRepair::with_services(
            context.client.clone(),
            config,
            services,
            context.registry,
        )?;
        Ok(vec![Arc::new(built)])
    }
}

impl ClusterIpRepairConfig {
    /// Errors name the field's YAML path.
    pub fn validate(&self) -> Result<(), section::ConfigError> {
        let invalid = |field: &str, problem: &str| {
            Err(section::ConfigError::new(
                format!("loops.clusterIPRepair.{field}"),
                problem,
            ))
        };
        if self.interval.is_zero() {
            return invalid("interval", "must be greater than zero (upstream uses 3m)");
        }
        if self.page_size == 0 {
            return invalid(
                "pageSize",
                &format!(
                    "must be at least 1 (the default is {})",
                    store::DEFAULT_PAGE_SIZE
                ),
            );
        }
        validate_ranges(&self.service_ranges)
            .map_err(|err| section::ConfigError::new("serviceClusterIPRange", err))?;
        Ok(())
    }
}

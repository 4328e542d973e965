//! `loops.nodePortRepair`: the section of the configuration file, and the loop's configuration
//! made from it and the top-level settings (the node-port range, etcd).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::NodePortRepair;
use super::plan::PortRange;
use crate::contract::Reconciler;
use crate::legacy_alloc::etcd::EtcdConfig;
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, ServiceName, Settings, duration_format,
    validate_interval, validate_page_size,
};
use crate::service_cache::store;

#[derive(Clone, Debug)]
pub struct NodePortRepairConfig {
    /// Time between passes when no Service changes (upstream: 3 minutes).
    pub interval: Duration,
    pub range: PortRange,
    /// This replica's identity, for the events' `reportingInstance`.
    pub reporting_instance: Option<String>,
    /// LIST page size of the Service cache, when this loop keeps it itself.
    pub page_size: u32,
    /// etcd mode: repair the bitmap at `<prefix>/ranges/servicenodeports` too.
    pub etcd: Option<EtcdConfig>,
    /// etcd mode: rebuild a bitmap stored under another range (or none) under `range`, instead
    /// of reporting it and leaving it alone.
    pub rebuild_bitmap_on_range_change: bool,
    /// The `kubernetes` Service: a bitmap range mismatch is reported in an event about it.
    pub kubernetes_service: ServiceName,
}

impl Default for NodePortRepairConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(180),
            range: PortRange::default(),
            reporting_instance: None,
            page_size: store::DEFAULT_PAGE_SIZE,
            etcd: None,
            rebuild_bitmap_on_range_change: false,
            kubernetes_service: ServiceName {
                namespace: "default".to_owned(),
                name: "kubernetes".to_owned(),
            },
        }
    }
}

/// `loops.nodePortRepair`: node ports held twice or outside `serviceNodePortRange`, and the
/// legacy bitmap in etcd mode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
    /// Objects per LIST page when this loop lists Services itself: its own Service cache (when
    /// the ClusterIP repair is off; otherwise it reads that loop's), and the fresh list that
    /// confirms a leak in the etcd bitmap.
    pub page_size: u32,
    /// etcd mode: a bitmap stored under another range than `serviceNodePortRange` (or none) is
    /// rebuilt under `serviceNodePortRange`, dropping the ports outside it. Off: it is reported
    /// and left alone. For an operator who changed kube-apiserver's `--service-node-port-range`
    /// and wants the bitmap moved before kube-apiserver's restart does it.
    pub rebuild_bitmap_on_range_change: bool,
}

impl Default for Section {
    fn default() -> Self {
        let defaults = NodePortRepairConfig::default();
        Section {
            enabled: true,
            interval: defaults.interval,
            page_size: defaults.page_size,
            rebuild_bitmap_on_range_change: defaults.rebuild_bitmap_on_range_change,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<ConfigError>) {
        validate_interval(path, self.interval, errors);
        validate_page_size(path, self.page_size, errors);
    }

    /// Reads the Service cache of a loop built before it ([`BuildContext::services`]), when there
    /// is one.
    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let range = &context.settings.node_port_range;
        let config = NodePortRepairConfig {
            interval: self.interval,
            range: PortRange::new(*range.start(), *range.end())?,
            reporting_instance: Some(context.settings.identity.clone()),
            page_size: self.page_size,
            etcd: context.settings.etcd.clone(),
            rebuild_bitmap_on_range_change: self.rebuild_bitmap_on_range_change,
            kubernetes_service: context.settings.kubernetes_service.clone(),
        };
        Ok(vec![Arc::new(NodePortRepair::new(
            context.client.clone(),
            config,
            Some(context.services()),
            context.registry,
        ))])
    }
}

//! `loops.nodePortRepair`: the section of the configuration file, which is also the loop's
//! configuration; the top-level settings give the node-port range and etcd mode.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::NodePortRepairLoop;
use crate::contract::Reconciler;
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval, validate_page_size,
};
use crate::watch_cache;

/// Upstream's interval (the repair runs every 3 minutes).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(180);

/// `loops.nodePortRepair`: node ports held twice or outside `serviceNodePortRange`, and the
/// legacy bitmap in etcd mode. The loop's one configuration type: the loop is built from the
/// section and the settings.
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
        let services = context.services(self.page_size);
        Ok(vec![Arc::new(NodePortRepairLoop::new(
            context.client.clone(),
            self.clone(),
            context.settings,
            context.kubernetes_service.clone(),
            Some(services),
            context.registry,
        ))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_name_the_yaml_path() {
        let section = Section {
            interval: Duration::ZERO,
            page_size: 0,
            ..Section::default()
        };
        assert_eq!(
            crate::section::refused_fields("loops.nodePortRepair", &section),
            [
                "loops.nodePortRepair.interval",
                "loops.nodePortRepair.pageSize"
            ]
        );
        assert_eq!(Section::default().interval, Duration::from_secs(180));
        assert_eq!(
            Section::default().leak_sighting_spacing,
            Duration::from_secs(180)
        );
    }
}

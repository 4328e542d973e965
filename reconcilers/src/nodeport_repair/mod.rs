//! The NodePort repair loop (`nodeport-repair`).
//!
//! Upstream's repair (`pkg/registry/core/service/portallocator/controller/repair.go`) rebuilds
//! the NodePort allocation bitmap from every Service each 3 minutes and warns about ports held by
//! two Services or outside `--service-node-port-range`. This loop does the same from the Service
//! cache the process already keeps (one watch of Services, shared with the ClusterIP repair),
//! so a duplicate is reported as soon as the watch shows it and a quiet cluster costs nothing.
//!
//! The loop never changes a Service: upstream's own advice ("please recreate service") stands.
//! In etcd mode it also repairs the allocation bitmap kube-apiserver keeps at
//! `<prefix>/ranges/servicenodeports` as upstream does ([`crate::legacy_alloc`]): ports in use
//! are set at once, unused ones released only on their third sighting and when a fresh list of
//! the Services confirms them unused, and the key is written only by compare-and-swap. A watch
//! on the key wakes the loop when it changes. A bitmap stored under another range than
//! `serviceNodePortRange` is reported (a Warning event on the `kubernetes` Service naming both
//! ranges) and left alone, unless `rebuildBitmapOnRangeChange` is set. Each problem is reported
//! once when it appears (event, warning log, counter), not again on every pass while it
//! persists; `check` lists every current problem. A problem, and a bit about to be set, is first
//! confirmed by a live read of the Services it rests on: one the cache shows but that is gone
//! (a lost delete) is neither reported nor written for.

mod apply;
mod metrics;
pub mod plan;
mod section;

use std::time::Duration;

use futures::future::BoxFuture;
use kube::Client;
use smallvec::SmallVec;
use tracing::{debug, warn};

use crate::alloc::PortRange;
use crate::budget::CacheBudget;
use crate::contract::{Action, LoopError, PassContext, PassReport, Reconciler, Trigger, drift};
use crate::events::SeriesRecorder;
use crate::findings::ReportOnce;
use crate::legacy_alloc::etcd::{EtcdStore, RangeKey};
use crate::legacy_alloc::{BitmapRange, LegacyBitmap, Subject};
use crate::metrics::MetricRegistry;
use crate::section::{ServiceName, Settings};
use crate::service_cache::FreshList;
use crate::service_cache::live::Liveness;
use crate::service_cache::record::ServiceRecord;
use crate::watch_cache::WatchCache;
pub use metrics::NodePortMetrics;
pub use plan::{Finding, Problem};
pub use section::{DEFAULT_INTERVAL, Section};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "nodeport-repair";

/// Upstream's event action.
pub const EVENT_ACTION: &str = "PortAllocation";

/// The NodePort repair loop.
pub struct NodePortRepairLoop {
    section: Section,
    /// `serviceNodePortRange`.
    range: PortRange,
    /// The `kubernetes` Service: a bitmap range mismatch is reported in an event about it.
    kubernetes_service: ServiceName,
    services: WatchCache<ServiceRecord>,
    /// Kept for the loop's life, so a duplicate that clears and comes back is counted into its
    /// first event's series ([`crate::events::emit_in`]).
    recorder: SeriesRecorder,
    reported: ReportOnce<Finding>,
    metrics: NodePortMetrics,
    etcd: Option<LegacyBitmap<PortRange>>,
}

/// The node-port bitmap: a bit per port of the range, from its base.
impl BitmapRange for PortRange {
    type Item = i32;
    const SUBJECT: Subject = Subject {
        noun: "node port",
        kind_prefix: "nodeport",
        range_setting: "serviceNodePortRange",
        apiserver_flag: "--service-node-port-range",
        rebuild_setting: "loops.nodePortRepair.rebuildBitmapOnRangeChange",
        item_noun: "Port",
        event_action: EVENT_ACTION,
        item_reason: "Port",
        bitmap_name: "NodePort",
        create_if_missing: true,
    };

    fn parse(stored: &str) -> Option<Self> {
        PortRange::parse_any_form(stored).ok()
    }

    fn bits(&self) -> usize {
        self.size()
    }

    fn item(&self, bit: usize) -> Option<i32> {
        i32::try_from(usize::from(self.base()) + bit).ok()
    }

    fn bit(&self, port: i32) -> Option<usize> {
        self.offset(port)
    }

    fn held(service: &ServiceRecord) -> SmallVec<[i32; 4]> {
        plan::collect_service_node_ports(service)
    }
}

impl NodePortRepairLoop {
    /// Builds the loop of a validated `section` with validated `settings` (the node-port range,
    /// etcd mode, the identity events report) and the `kubernetes` Service (the legacy bitmap's
    /// events are posted on it). `services` is the Service cache another loop keeps
    /// (the ClusterIP repair's), or `None` for one of its own, unlimited. Its fresh LISTs count
    /// against the budget of that cache.
    pub fn new(
        client: Client,
        section: Section,
        settings: &Settings,
        kubernetes_service: ServiceName,
        services: Option<WatchCache<ServiceRecord>>,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        // Events name this controller (upstream's reasons, not its reporting controller), so
        // nobody mistakes them for kube-apiserver's own repair.
        let reporter = settings.reporter();
        let range = settings.node_port_range;
        let services = services.unwrap_or_else(|| {
            WatchCache::every(client.clone(), section.page_size, &CacheBudget::default())
        });
        let etcd = settings.etcd().map(|etcd| {
            LegacyBitmap::new(
                EtcdStore::new(etcd.clone()),
                etcd.key(RangeKey::NodePorts),
                range,
                FreshList {
                    page_size: section.page_size,
                    budget: services.budget().clone(),
                },
                section.rebuild_bitmap_on_range_change,
                section.leak_sighting_spacing,
            )
        });
        Self {
            recorder: SeriesRecorder::new(client.clone(), reporter),
            services,
            section,
            range,
            kubernetes_service,
            reported: ReportOnce::new(),
            metrics: NodePortMetrics::register(registry),
            etcd,
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        self.recorder.forget_idle();
        let scan = {
            let state = self.services.read();
            if !state.synced {
                return Err(LoopError::NotSynced(
                    "Service cache has not synced yet".to_owned(),
                ));
            }
            plan::scan(state.values(), self.range)
        };

        let new = self.reported.update(scan.findings.iter().cloned());
        let mut unpublished = None;
        // Findings a live read of their Services disproved (the cache was behind): neither
        // reported nor counted, and looked at again while the cache shows them.
        let mut disproved = std::collections::HashSet::new();
        for finding in &new {
            match self.verify(ctx, finding, &scan).await {
                Ok(Liveness::Holds) => {}
                Ok(Liveness::Disproved(why)) => {
                    debug!(
                        service = %format_args!("{}/{}", finding.service.namespace, finding.service.name),
                        port = finding.port,
                        reason = finding.problem.reason(),
                        %why,
                        "finding disproved by a live read; the Service cache is behind"
                    );
                    self.reported.forget(finding);
                    disproved.insert(finding);
                    continue;
                }
                Err(err) => {
                    // Reported by a later pass that can read the Services.
                    self.reported.forget(finding);
                    unpublished.get_or_insert(err);
                    continue;
                }
            }
            if !ctx.dry_run
                && let Err(err) = self.publish(finding).await
            {
                // Not reported yet (the namespace may still be being created): the next pass,
                // which the runner retries soon, reports it.
                self.reported.forget(finding);
                unpublished.get_or_insert(err);
                continue;
            }
            (self.metrics.port_errors)
                .get_or_create(&[("type", finding.problem.error_type())])
                .inc();
            warn!(
                service = %format_args!("{}/{}", finding.service.namespace, finding.service.name),
                port = finding.port,
                reason = finding.problem.reason(),
                "{}",
                finding.note(self.range)
            );
        }
        for problem in [Problem::AlreadyAllocated, Problem::OutOfRange] {
            let present = scan
                .findings
                .iter()
                .filter(|finding| finding.problem == problem && !disproved.contains(finding))
                .count();
            self.metrics
                .current_problems
                .get_or_create(&[("type", problem.error_type())])
                .set(i64::try_from(present).unwrap_or(i64::MAX));
        }

        let mut report = PassReport::default();
        for finding in scan.findings.iter().filter(|f| !disproved.contains(f)) {
            report.push(drift(
                finding.problem.drift_kind(),
                format!(
                    "Service/{}/{}",
                    finding.service.namespace, finding.service.name
                ),
                Action::Report,
                finding.note(self.range),
                false,
            ));
        }
        if let Some(etcd) = &self.etcd {
            self.repair_bitmap(ctx, etcd, &scan, &mut report).await?;
        }
        match unpublished {
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(report),
        }
    }
}

impl Reconciler for NodePortRepairLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.section.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        let mut triggers = vec![self.services.subscribe()];
        if let Some(etcd) = &self.etcd {
            triggers.push(etcd.watch());
        }
        triggers
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

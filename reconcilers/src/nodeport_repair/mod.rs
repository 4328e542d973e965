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
//! are set at once, unused ones released only on their third sighting with the Service cache
//! proven fresh, and the key is written only by compare-and-swap. A watch on the key wakes the
//! loop when it changes. Each problem is reported once when it appears (event, warning log,
//! counter), not again on every pass while it persists; `check` lists every current problem.

pub mod scan;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::warn;

use crate::clusterip_repair::model::ServiceRecord;
use crate::clusterip_repair::reflector::{self, Collection, SharedStore, reflect};
use crate::contract::{Action, LoopError, PassContext, PassReport, Reconciler, Trigger, drift};
use crate::findings::ReportOnce;
use crate::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use crate::legacy_alloc::etcd::{EtcdConfig, EtcdError, EtcdStore, RangeKey};
use crate::legacy_alloc::repair::{LeakTracker, plan};
pub use scan::{Finding, PortRange, Problem};

/// Upstream's event source for this repair.
pub const REPORTING_CONTROLLER: &str = "portallocator-repair-controller";
/// Upstream's event action.
pub const EVENT_ACTION: &str = "PortAllocation";

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
}

impl Default for NodePortRepairConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(180),
            range: PortRange::default(),
            reporting_instance: None,
            page_size: reflector::DEFAULT_PAGE_SIZE,
            etcd: None,
        }
    }
}

/// Counters mirroring upstream's `apiserver_nodeport_repair_port_errors_total`, counted once
/// per problem when it appears, and the problems present now.
#[derive(Clone, Debug, Default)]
pub struct NodePortMetrics {
    /// `type` = duplicate | outOfRange | repair (set in the bitmap) | leak (released from it) |
    /// invalid (the stored bitmap cannot be used).
    pub port_errors: Family<[(&'static str, &'static str); 1], Counter>,
    /// `type` as above: problems present after the last complete pass.
    pub current_problems: Family<[(&'static str, &'static str); 1], Gauge>,
}

impl NodePortMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = Self::default();
        registry.register(
            "nodeport_repair_port_errors",
            "Number of node port problems found by the repair loop, counted when each appears, by type",
            metrics.port_errors.clone(),
        );
        registry.register(
            "nodeport_repair_problems",
            "Node port problems present after the last pass, by type",
            metrics.current_problems.clone(),
        );
        metrics
    }
}

/// The NodePort repair loop.
pub struct NodePortRepair {
    client: Client,
    config: NodePortRepairConfig,
    services: Arc<SharedStore<ServiceRecord>>,
    recorder: Recorder,
    reported: ReportOnce<Finding>,
    metrics: NodePortMetrics,
    etcd: Option<EtcdBitmap>,
}

/// etcd mode's state: the key, and what earlier passes saw of it.
struct EtcdBitmap {
    store: EtcdStore,
    key: String,
    leaks: std::sync::Mutex<LeakTracker>,
    reported: ReportOnce<BitmapFinding>,
}

/// A finding about the stored bitmap, reported once while it lasts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum BitmapFinding {
    NotAllocated(i32),
    MayHaveLeaked(i32),
    Released(i32),
    ReleaseHeld(i32),
    RangeMismatch(String),
    Unusable(String),
}

/// How many times a pass reads, plans and writes the key again after a compare-and-swap lost
/// to another writer (kube-apiserver allocating), before it fails and the runner retries.
const WRITE_ATTEMPTS: usize = 3;

impl NodePortRepair {
    /// Builds the loop. `services` is the Service cache another loop keeps (the ClusterIP
    /// repair's), or `None` for one of its own.
    pub fn new(
        client: Client,
        config: NodePortRepairConfig,
        services: Option<Arc<SharedStore<ServiceRecord>>>,
        registry: &mut Registry,
    ) -> Self {
        let reporter = Reporter {
            controller: REPORTING_CONTROLLER.to_owned(),
            instance: config.reporting_instance.clone(),
        };
        let etcd = config.etcd.clone().map(|etcd| EtcdBitmap {
            key: etcd.key(RangeKey::NodePorts),
            store: EtcdStore::new(etcd),
            leaks: std::sync::Mutex::default(),
            reported: ReportOnce::new(),
        });
        Self {
            recorder: Recorder::new(client.clone(), reporter),
            client,
            services: services.unwrap_or_default(),
            config,
            reported: ReportOnce::new(),
            metrics: NodePortMetrics::register(registry),
            etcd,
        }
    }

    fn count(&self, error_type: &'static str) {
        self.metrics
            .port_errors
            .get_or_create(&[("type", error_type)])
            .inc();
    }

    /// Whether the Service cache is at least as new as the API's Services: read only when a
    /// pass has a port to release.
    async fn services_fresh(&self, client: &Client) -> bool {
        let api_version =
            match reflector::current_resource_version(client, reflector::SERVICES).await {
                Ok(Some(version)) => reflector::parse_resource_version(&version),
                Ok(None) => None,
                Err(err) => {
                    warn!(error = %err, "cannot read the API's Services resourceVersion");
                    None
                }
            };
        let Some(api_version) = api_version else {
            return false;
        };
        // Watch events may still be in flight: give the cache a moment to catch up.
        for _ in 0..20 {
            if self
                .services
                .store()
                .resource_version()
                .is_some_and(|cache| cache >= api_version)
            {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// etcd mode: reads the bitmap, plans it against the ports in use and writes the plan by
    /// compare-and-swap, again from the read when another writer came first.
    async fn repair_bitmap(
        &self,
        ctx: &PassContext,
        etcd: &EtcdBitmap,
        scan: &scan::Scan,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let range = self.config.range;
        let object = format!("etcd{}", etcd.key);
        let unavailable =
            |err: EtcdError| LoopError::Other(format!("etcd key {} unavailable: {err}", etcd.key));
        for _ in 0..WRITE_ATTEMPTS {
            let stored = etcd.store.get(&etcd.key).await.map_err(unavailable)?;
            let (value, mod_revision) = match stored {
                None => (None, None),
                Some(stored) => match RangeAllocation::decode(&stored.value) {
                    Ok(value) => (Some(value), Some(stored.mod_revision)),
                    Err(err) => {
                        let message = format!("{err}; nothing is written to it");
                        self.report_bitmap(etcd, vec![BitmapFinding::Unusable(message.clone())]);
                        report.push(drift(
                            "nodeport_bitmap_unusable",
                            object,
                            Action::Report,
                            message,
                            false,
                        ));
                        return Ok(());
                    }
                },
            };
            if let Some(value) = &value
                && !value.range.is_empty()
                && value.range != range.to_string()
            {
                let message = format!(
                    "the stored range {:?} is not the configured --service-node-port-range {range}; nothing is written (set the apiserver's range, or fix the flag)",
                    value.range
                );
                self.report_bitmap(
                    etcd,
                    vec![BitmapFinding::RangeMismatch(value.range.clone())],
                );
                report.push(drift(
                    "nodeport_range_mismatch",
                    object,
                    Action::Report,
                    message,
                    false,
                ));
                return Ok(());
            }
            let stored_bits = value
                .as_ref()
                .map(|value| bitmap_from_bytes(&value.data, range.size()))
                .unwrap_or_else(|| fixedbitset::FixedBitSet::with_capacity(range.size()));

            let mut plan = {
                let mut leaks = etcd.leaks.lock().unwrap_or_else(|p| p.into_inner());
                plan(
                    &stored_bits,
                    &scan.in_use,
                    &mut leaks,
                    false,
                    std::time::Instant::now(),
                    self.config.interval,
                )
            };
            if !plan.held.is_empty() && self.services_fresh(&ctx.client).await {
                let mut leaks = etcd.leaks.lock().unwrap_or_else(|p| p.into_inner());
                plan.release_held(&mut leaks);
            }

            let port =
                |offset: usize| i32::from(range.base()) + i32::try_from(offset).unwrap_or(i32::MAX);
            let write = value.is_none() || plan.changes(&stored_bits);
            let applied = write && !ctx.dry_run;
            // This attempt's drift, kept only if its write is not lost to another writer.
            let mut found = Vec::new();
            for &offset in &plan.not_allocated {
                let holder = scan.owners.get(&offset);
                let who = holder.map_or_else(String::new, |h| {
                    format!("Service/{}/{}", h.namespace, h.name)
                });
                found.push(drift(
                    "nodeport_not_allocated",
                    if who.is_empty() { object.clone() } else { who },
                    Action::Update,
                    format!("Port {} is not allocated; repairing", port(offset)),
                    applied,
                ));
            }
            for &offset in &plan.released {
                found.push(drift(
                    "nodeport_leaked",
                    object.clone(),
                    Action::Update,
                    format!(
                        "the node port {} appears to have leaked: cleaning up",
                        port(offset)
                    ),
                    applied,
                ));
            }
            for &offset in &plan.held {
                found.push(drift(
                    "nodeport_leak_held",
                    object.clone(),
                    Action::Report,
                    format!("the node port {} appears to have leaked, but the Service cache is not proven fresh: kept until it is", port(offset)),
                    false,
                ));
            }

            if applied {
                let bytes = bitmap_to_bytes(&plan.bitmap);
                let new_value = match &value {
                    Some(value) => value.with_data(bytes),
                    None => RangeAllocation::new(range.to_string(), bytes),
                };
                let written = etcd
                    .store
                    .compare_and_swap(&etcd.key, mod_revision, new_value.encode())
                    .await
                    .map_err(unavailable)?;
                if !written {
                    tracing::debug!(
                        key = etcd.key,
                        "the etcd key changed while the repair wrote it; reading it again"
                    );
                    continue;
                }
            }

            report.drift.extend(found);
            let mut findings = Vec::new();
            findings.extend(
                plan.not_allocated
                    .iter()
                    .map(|&o| BitmapFinding::NotAllocated(port(o))),
            );
            findings.extend(
                plan.flagged
                    .iter()
                    .map(|&o| BitmapFinding::MayHaveLeaked(port(o))),
            );
            findings.extend(
                plan.released
                    .iter()
                    .map(|&o| BitmapFinding::Released(port(o))),
            );
            findings.extend(
                plan.held
                    .iter()
                    .map(|&o| BitmapFinding::ReleaseHeld(port(o))),
            );
            let new = self.report_bitmap(etcd, findings);
            if !ctx.dry_run {
                for finding in new {
                    if let BitmapFinding::NotAllocated(port) = finding
                        && let Some(offset) = range.offset(port)
                        && let Some(holder) = scan.owners.get(&offset)
                    {
                        self.publish_about(
                            holder,
                            "PortNotAllocated",
                            format!("Port {port} is not allocated; repairing"),
                        )
                        .await;
                    }
                }
            }
            return Ok(());
        }
        Err(LoopError::Other(format!(
            "etcd key {} changed under every write ({WRITE_ATTEMPTS} compare-and-swap conflicts); retrying",
            etcd.key
        )))
    }

    /// Logs and counts the findings that are new; returns them.
    fn report_bitmap(&self, etcd: &EtcdBitmap, findings: Vec<BitmapFinding>) -> Vec<BitmapFinding> {
        let new = etcd.reported.update(findings);
        for finding in &new {
            match finding {
                BitmapFinding::NotAllocated(port) => {
                    self.count("repair");
                    warn!(
                        port,
                        key = etcd.key,
                        "the node port {port} is in use but not allocated; repairing"
                    );
                }
                BitmapFinding::MayHaveLeaked(port) => {
                    warn!(
                        port,
                        key = etcd.key,
                        "the node port {port} may have leaked: flagging for later clean up"
                    );
                }
                BitmapFinding::Released(port) => {
                    self.count("leak");
                    warn!(
                        port,
                        key = etcd.key,
                        "the node port {port} appears to have leaked: cleaning up"
                    );
                }
                BitmapFinding::ReleaseHeld(port) => {
                    warn!(
                        port,
                        key = etcd.key,
                        "the node port {port} appears to have leaked, but the Service cache is not proven fresh: keeping it until it is"
                    );
                }
                BitmapFinding::RangeMismatch(stored) => {
                    self.count("invalid");
                    warn!(key = etcd.key, stored, configured = %self.config.range, "the stored node port range differs from --service-node-port-range; the bitmap is left alone");
                }
                BitmapFinding::Unusable(why) => {
                    self.count("invalid");
                    warn!(
                        key = etcd.key,
                        "the stored node port bitmap cannot be used: {why}"
                    );
                }
            }
        }
        new
    }

    pub fn metrics(&self) -> &NodePortMetrics {
        &self.metrics
    }

    async fn publish(&self, finding: &Finding) {
        let holder = scan::Holder {
            namespace: finding.namespace.clone(),
            name: finding.name.clone(),
            uid: finding.uid.clone(),
        };
        self.publish_about(
            &holder,
            finding.problem.reason(),
            finding.note(self.config.range),
        )
        .await;
    }

    async fn publish_about(&self, holder: &scan::Holder, reason: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Service".to_owned()),
            namespace: Some(holder.namespace.to_string()),
            name: Some(holder.name.to_string()),
            uid: Some(holder.uid.to_string()).filter(|uid| !uid.is_empty()),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note),
            action: EVENT_ACTION.to_owned(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &reference).await {
            warn!(reason = event.reason, error = %err, "cannot publish event");
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let store = self.services.store();
        let scan = {
            let state = store.read();
            if !state.synced {
                return Err(LoopError::NotSynced(
                    "Service cache has not synced yet".to_owned(),
                ));
            }
            scan::scan(state.values(), self.config.range)
        };

        let new = self.reported.update(scan.findings.iter().cloned());
        for finding in &new {
            self.count(finding.problem.error_type());
            warn!(
                service = %format_args!("{}/{}", finding.namespace, finding.name),
                port = finding.port,
                reason = finding.problem.reason(),
                "{}",
                finding.note(self.config.range)
            );
            if !ctx.dry_run {
                self.publish(finding).await;
            }
        }
        for problem in [Problem::AlreadyAllocated, Problem::OutOfRange] {
            let present = scan
                .findings
                .iter()
                .filter(|finding| finding.problem == problem)
                .count();
            self.metrics
                .current_problems
                .get_or_create(&[("type", problem.error_type())])
                .set(i64::try_from(present).unwrap_or(i64::MAX));
        }

        let mut report = PassReport::default();
        for finding in &scan.findings {
            report.push(drift(
                finding.problem.drift_kind(),
                format!("Service/{}/{}", finding.namespace, finding.name),
                Action::Report,
                finding.note(self.config.range),
                false,
            ));
        }
        if let Some(etcd) = &self.etcd {
            self.repair_bitmap(ctx, etcd, &scan, &mut report).await?;
        }
        Ok(report)
    }
}

impl Reconciler for NodePortRepair {
    fn name(&self) -> &'static str {
        "nodeport-repair"
    }

    fn interval(&self) -> Duration {
        self.config.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        let client = self.client.clone();
        let collection = Collection::new(reflector::SERVICES).paged(self.config.page_size);
        let mut triggers = vec![
            self.services
                .subscribe(|store| reflect(client.clone(), client, collection, store)),
        ];
        if let Some(etcd) = &self.etcd {
            triggers.push(etcd.store.watch(etcd.key.clone()));
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

//! Loop: ClusterIP repair.
//!
//! Upstream (`pkg/registry/core/service/ipallocator/controller/repairip.go`) keeps every Service
//! cluster IP backed by an `networking.k8s.io/v1` IPAddress that names the Service, inside
//! kube-apiserver, on a 3-minute resync. We do the same from outside: caches of Services,
//! IPAddresses and ServiceCIDRs are kept by watches (which also wake the loop), a full pass runs
//! every interval, and [`decide`] says what is wrong with the exact upstream events.
//!
//! Safety beyond upstream: nothing is decided from an unsynced cache; every delete is
//! preconditioned on the IPAddress's uid and resourceVersion; and before a delete the parent
//! Service is read live, and the delete happens only if the live state agrees (otherwise it is
//! deferred and counted). IPAddresses managed by anyone but `ipallocator.k8s.io` are never
//! written.
//!
//! Where the API serves no IPAddress (older clusters, generic control planes; found by
//! discovery), the loop audits instead: it rebuilds each configured range's allocation from all
//! Services and reports duplicates, out-of-range and invalid IPs with the legacy repair's
//! reasons, without writing. In etcd mode it also repairs the legacy bitmaps there ([`legacy`]),
//! and only there: where the IPAddress API is served they are left alone
//! ([`ClusterIpRepair::keeps_legacy_bitmaps`] says why).

pub mod decide;
mod legacy;
pub mod model;

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::Retryable;
use futures::StreamExt;
use futures::future::BoxFuture;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::{ObjectReference, Service};
use k8s_openapi::api::networking::v1::{IPAddress, IPAddressSpec, ParentReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::alloc::{IpFamily, ServiceRange};
use crate::contract::{Action, Drift, LoopError, PassContext, PassReport, Reconciler, Trigger};
use crate::service_range::{DEFAULT_SERVICE_CIDR, ServiceRanges, validate_ranges};

use crate::service_cache::record::ServiceRecord;
use crate::service_cache::store::{self, SharedStore, Store, reflect};
use decide::{AuditDecision, Decision, DeleteGround, Finding, Regarding, Repair, ServiceOwner};
use model::{
    IPALLOCATOR_MANAGER, IpAddressRecord, LABEL_IP_FAMILY, LABEL_MANAGED_BY, ServiceCidrRecord,
};

use crate::metrics::{loop_registry, registered};
use crate::section::{
    self, BuildContext, BuildError, LoopSection, Settings, duration_format, validate_interval,
    validate_page_size,
};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "clusterip-repair";

/// Reporting controller of the events, as upstream.
pub const REPORTING_CONTROLLER: &str = "ipallocator-repair-controller";

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

/// Counters mirroring upstream's `apiserver_clusterip_repair_*`, plus the deferrals.
#[derive(Clone, Debug, Default)]
pub struct RepairMetrics {
    /// `type` = leak | repair | full | outOfRange | duplicate | unknown | invalid.
    pub ip_errors: Family<[(&'static str, &'static str); 1], Counter>,
    pub reconcile_errors: Counter,
    /// `reason` = stale_cache | verify_failed.
    pub deferred_deletes: Family<[(&'static str, &'static str); 1], Counter>,
}

impl RepairMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let registry = loop_registry(registry, NAME);
        Self {
            ip_errors: registered(
                registry,
                "ip_errors",
                "Number of errors detected on cluster IPs by the repair loop, by type",
                Family::default(),
            ),
            reconcile_errors: registered(
                registry,
                "reconcile_errors",
                "Number of ClusterIP repair passes that failed",
                Counter::default(),
            ),
            deferred_deletes: registered(
                registry,
                "deferred_deletes",
                "Number of IPAddress deletes put off because a live read of the Service disagreed with the cache or failed, by reason",
                Family::default(),
            ),
        }
    }
}

/// Wakes the loop at a chosen time (orphans leaving their grace period, deferred deletes).
#[derive(Debug, Default)]
struct Wakeup {
    at: Mutex<Option<tokio::time::Instant>>,
    changed: Notify,
}

impl Wakeup {
    fn schedule(&self, at: tokio::time::Instant) {
        let mut slot = self.at.lock().unwrap_or_else(|p| p.into_inner());
        if slot.is_none_or(|current| at < current) {
            *slot = Some(at);
            self.changed.notify_one();
        }
    }

    fn stream(self: Arc<Self>) -> Trigger {
        futures::stream::unfold(self, |wakeup| async move {
            loop {
                let at = *wakeup.at.lock().unwrap_or_else(|p| p.into_inner());
                match at {
                    Some(at) => {
                        tokio::select! {
                            () = tokio::time::sleep_until(at) => {
                                let mut slot = wakeup.at.lock().unwrap_or_else(|p| p.into_inner());
                                if *slot == Some(at) {
                                    *slot = None;
                                }
                                drop(slot);
                                return Some(((), wakeup));
                            }
                            () = wakeup.changed.notified() => {}
                        }
                    }
                    None => wakeup.changed.notified().await,
                }
            }
        })
        .boxed()
    }
}

/// etcd mode's bitmaps: built at the first pass that finds the cluster allocating with them,
/// from the configured range or the one read from the cluster. Their etcd watches wake the loop
/// from then on; where they are left alone, nothing watches them.
struct LegacySlot {
    etcd: crate::legacy_alloc::etcd::EtcdConfig,
    bitmaps: Arc<std::sync::OnceLock<legacy::LegacyIpBitmaps>>,
    built: Arc<Notify>,
}

impl LegacySlot {
    fn build(&self, config: &ClusterIpRepairConfig, ranges: Vec<IpNet>) {
        self.bitmaps.get_or_init(|| {
            let settings = legacy::BitmapSettings {
                etcd: &self.etcd,
                interval: config.interval,
                page_size: config.page_size,
                rebuild_on_range_change: config.rebuild_bitmap_on_range_change,
                kubernetes_service: &config.kubernetes_service,
            };
            legacy::LegacyIpBitmaps::new(&settings, &ranges)
        });
        self.built.notify_one();
    }

    async fn get_or_build(
        &self,
        config: &ClusterIpRepairConfig,
        ranges: &ServiceRanges,
    ) -> Result<&legacy::LegacyIpBitmaps, LoopError> {
        if self.bitmaps.get().is_none() {
            self.build(config, ranges.resolve().await?);
        }
        self.bitmaps
            .get()
            .ok_or_else(|| LoopError::Other("the etcd bitmaps were not built".to_owned()))
    }

    /// The bitmaps' etcd watches, once they are built.
    fn triggers(&self) -> Trigger {
        let (bitmaps, built) = (self.bitmaps.clone(), self.built.clone());
        futures::stream::once(async move {
            loop {
                if let Some(bitmaps) = bitmaps.get() {
                    return futures::stream::select_all(bitmaps.triggers());
                }
                built.notified().await;
            }
        })
        .flatten()
        .boxed()
    }
}

/// Which APIs the cluster serves, from discovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    IpAddressApi,
    NoIpAddressApi,
}

async fn discover(client: &Client) -> Result<Served, kube::Error> {
    match client
        .list_api_group_resources("networking.k8s.io/v1")
        .await
    {
        Ok(list) => {
            let serves = |name: &str| list.resources.iter().any(|r| r.name == name);
            Ok(if serves("ipaddresses") && serves("servicecidrs") {
                Served::IpAddressApi
            } else {
                Served::NoIpAddressApi
            })
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Served::NoIpAddressApi),
        Err(err) => Err(err),
    }
}

/// The ClusterIP repair loop (`clusterip-repair`).
pub struct ClusterIpRepair {
    client: Client,
    config: ClusterIpRepairConfig,
    metrics: RepairMetrics,
    services: Arc<Store<ServiceRecord>>,
    /// The Service cache's feed, shared with the NodePort repair ([`Self::shared_services`]).
    shared_services: Arc<SharedStore<ServiceRecord>>,
    ip_addresses: Arc<Store<IpAddressRecord>>,
    service_cidrs: Arc<Store<ServiceCidrRecord>>,
    /// What discovery found, once it answered.
    discovered: Mutex<Option<Served>>,
    /// Whether the legacy bitmaps left alone were logged.
    legacy_skip_logged: std::sync::atomic::AtomicBool,
    recorder: Recorder,
    wakeup: Arc<Wakeup>,
    /// etcd mode's bitmaps ([`legacy`]), built once the ranges are known.
    legacy: Option<LegacySlot>,
    /// The ranges audit mode and the bitmaps work with: configured, or read from the cluster.
    ranges: ServiceRanges,
    /// Findings this loop only reports (a duplicate or out-of-range cluster IP), as they stood
    /// after the last pass: each gets its event and count when it appears, not on every pass.
    reported: crate::findings::ReportOnce<ReportKey>,
}

/// A report-only finding: its kind, the object and the sentence.
type ReportKey = (&'static str, String, String);

fn report_key(finding: &Finding) -> Option<ReportKey> {
    matches!(finding.repair, decide::Repair::None)
        .then(|| (finding.kind, finding.regarding.object(), finding.summary()))
}

impl ClusterIpRepair {
    /// Builds the loop; registers its metrics in `registry` (give it the runtime's prefixed
    /// registry). The client feeds the caches; passes use the client of their context.
    pub fn new(
        client: Client,
        config: ClusterIpRepairConfig,
        registry: &mut Registry,
    ) -> Result<Self, section::ConfigError> {
        Self::with_services(client, config, Arc::default(), registry)
    }

    /// [`Self::new`] with a Service cache other loops may share (whichever subscribes first
    /// feeds it).
    pub fn with_services(
        client: Client,
        config: ClusterIpRepairConfig,
        shared_services: Arc<SharedStore<ServiceRecord>>,
        registry: &mut Registry,
    ) -> Result<Self, section::ConfigError> {
        config.validate()?;
        let reporter = match &config.reporting_instance {
            Some(instance) => Reporter {
                controller: REPORTING_CONTROLLER.to_owned(),
                instance: Some(instance.clone()),
            },
            None => Reporter::from(REPORTING_CONTROLLER),
        };
        let legacy = config.etcd.as_ref().map(|etcd| LegacySlot {
            etcd: etcd.clone(),
            bitmaps: Arc::default(),
            built: Arc::default(),
        });
        Ok(Self {
            legacy,
            ranges: ServiceRanges::new(
                client.clone(),
                config.service_ranges.clone(),
                config.kubernetes_service.clone(),
            ),
            reported: crate::findings::ReportOnce::new(),
            recorder: Recorder::new(client.clone(), reporter),
            client,
            config,
            metrics: RepairMetrics::register(registry),
            services: shared_services.store().clone(),
            shared_services,
            ip_addresses: Arc::default(),
            service_cidrs: Arc::default(),
            discovered: Mutex::new(None),
            legacy_skip_logged: std::sync::atomic::AtomicBool::new(false),
            wakeup: Arc::default(),
        })
    }

    /// The Service cache this loop keeps, for other loops that read Services: the process then
    /// watches Services once.
    pub fn shared_services(&self) -> Arc<SharedStore<ServiceRecord>> {
        self.shared_services.clone()
    }

    pub fn metrics(&self) -> &RepairMetrics {
        &self.metrics
    }

    /// Which repair runs: the configured mode, or discovery's answer.
    async fn served(&self, client: &Client) -> Result<Served, LoopError> {
        match self.config.mode {
            RepairMode::IpAddress => Ok(Served::IpAddressApi),
            RepairMode::Audit => Ok(Served::NoIpAddressApi),
            RepairMode::Auto => {
                let served = self.discovered(client).await?;
                Ok(served)
            }
        }
    }

    /// What the cluster serves, by discovery, asked once.
    async fn discovered(&self, client: &Client) -> Result<Served, LoopError> {
        if let Some(served) = *self.discovered.lock().unwrap_or_else(|p| p.into_inner()) {
            return Ok(served);
        }
        let served = discover(client).await?;
        info!(?served, "networking.k8s.io/v1 discovered");
        *self.discovered.lock().unwrap_or_else(|p| p.into_inner()) = Some(served);
        Ok(served)
    }

    /// etcd mode: whether kube-apiserver allocates cluster IPs with the legacy bitmaps, so that
    /// they are repaired. Only where the cluster serves no `networking.k8s.io/v1` IPAddress API
    /// (asked by discovery whatever `mode` says; `ipAddress` mode asserts it is served).
    ///
    /// Upstream (`pkg/registry/core/rest/storage_core.go`) runs the bitmap repair only while
    /// the `MultiCIDRServiceAllocator` gate is off; with it on, it runs `RepairIPAddress` and
    /// repairs no bitmap. With the gate on, the allocator (`ipallocator/cidrallocator.go`,
    /// `MetaAllocator`) still writes the bitmap for older apiservers of a mixed-version
    /// control plane while `DisableAllocatorDualWrite` is off, and neither reads nor writes it
    /// once that gate is on. By release (`pkg/features/kube_features.go`):
    /// `MultiCIDRServiceAllocator` beta and off in 1.31, on from 1.33, locked on from 1.34;
    /// `DisableAllocatorDualWrite` off until 1.33, on from 1.34, locked on from 1.35. The
    /// gates cannot be read from outside; the served API can: `networking.k8s.io/v1`
    /// IPAddress is served from 1.33, where the allocator gate is on by default, so where it
    /// is served kube-apiserver allocates by IPAddress objects, and the bitmap it may still
    /// dual-write (1.33, or 1.34 with dual write turned back on) is not what it allocates by:
    /// upstream repairs none there, and neither does this loop. Repairing it there would set
    /// bits nobody reads and send `ClusterIPNotAllocated` for every new Service.
    async fn keeps_legacy_bitmaps(&self, client: &Client) -> Result<bool, LoopError> {
        let served = match self.config.mode {
            RepairMode::IpAddress => Served::IpAddressApi,
            RepairMode::Auto | RepairMode::Audit => self.discovered(client).await?,
        };
        let keeps = served == Served::NoIpAddressApi;
        if !keeps
            && let Some(slot) = &self.legacy
            && !self
                .legacy_skip_logged
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            info!(
                keys = %format_args!(
                    "{}, {}",
                    slot.etcd.key(crate::legacy_alloc::etcd::RangeKey::ServiceIps),
                    slot.etcd.key(crate::legacy_alloc::etcd::RangeKey::SecondaryServiceIps)
                ),
                "the cluster serves the IPAddress API, by which kube-apiserver allocates cluster \
                 IPs: the legacy ClusterIP bitmaps in etcd are left alone"
            );
        }
        Ok(keeps)
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        match self.served(&ctx.client).await? {
            Served::NoIpAddressApi => self.audit_pass(ctx).await,
            Served::IpAddressApi => self.ipaddress_pass(ctx).await,
        }
    }

    async fn audit_pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        // An older cluster: nothing tells the range but the configuration, so without it the
        // repair refuses to run (the error names the setting) and the other loops go on.
        let ranges: Vec<ServiceRange> = self
            .ranges
            .resolve()
            .await?
            .into_iter()
            .map(ServiceRange::new)
            .collect();
        let audit = {
            let state = self.services.read();
            if !state.synced {
                return Err(LoopError::NotSynced(
                    "Service cache has not synced yet".to_owned(),
                ));
            }
            decide::decide_audit_mode(state.values(), &ranges)
        };
        let AuditDecision { findings, usage } = audit;
        for range in &usage {
            debug!(range = %range.range, allocated = %range.allocated, free = %range.free, "service range usage");
        }
        let mut report = PassReport::default();
        let appeared = self.appeared(&findings);
        let mut unpublished = None;
        for finding in findings {
            let key = report_key(&finding);
            if key.as_ref().is_none_or(|key| appeared.contains(key)) {
                if !ctx.dry_run
                    && let Err(err) = self.publish(&finding).await
                {
                    // Counted, logged and published on the next pass instead.
                    if let Some(key) = &key {
                        self.reported.forget(key);
                    }
                    unpublished.get_or_insert(err);
                    report.push(drift_of(&finding, Action::Report, false, None));
                    continue;
                }
                self.count(&finding);
            }
            report.push(drift_of(&finding, Action::Report, false, None));
        }
        match unpublished {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }

    /// The report-only findings of a complete pass that were not there after the last one.
    fn appeared(&self, findings: &[Finding]) -> std::collections::HashSet<ReportKey> {
        self.reported
            .update(findings.iter().filter_map(report_key))
            .into_iter()
            .collect()
    }

    fn count(&self, finding: &Finding) {
        if let Some(error_type) = finding.error_type {
            self.metrics
                .ip_errors
                .get_or_create(&[("type", error_type)])
                .inc();
        }
    }

    async fn ipaddress_pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let now = jiff::Timestamp::now();
        let decision = {
            let services = self.services.read();
            let ip_addresses = self.ip_addresses.read();
            let service_cidrs = self.service_cidrs.read();
            for (synced, what) in [
                (services.synced, "Service"),
                (ip_addresses.synced, "IPAddress"),
                (service_cidrs.synced, "ServiceCIDR"),
            ] {
                if !synced {
                    return Err(LoopError::NotSynced(format!(
                        "{what} cache has not synced yet"
                    )));
                }
            }
            let stand_in = match service_cidrs.contains_key(DEFAULT_SERVICE_CIDR) {
                true => None,
                false => Some(self.default_service_cidr_stand_in(ctx)?),
            };
            decide::decide_ipaddress_mode(
                services.values(),
                ip_addresses.values(),
                service_cidrs.values().chain(stand_in.as_ref()),
                now,
                self.config.orphan_grace,
            )
        };
        self.act(ctx, decision).await
    }

    /// Upstream's repair waits until the default ServiceCIDR exists (the service-cidr loop
    /// creates it). A dry run cannot wait for that write, so it judges against the ranges the
    /// service-cidr loop would create it with.
    fn default_service_cidr_stand_in(
        &self,
        ctx: &PassContext,
    ) -> Result<ServiceCidrRecord, LoopError> {
        if !ctx.dry_run || self.config.service_ranges.is_empty() {
            return Err(LoopError::NotSynced(format!(
                "waiting for the default ServiceCIDR {DEFAULT_SERVICE_CIDR:?} to exist"
            )));
        }
        Ok(ServiceCidrRecord {
            name: DEFAULT_SERVICE_CIDR.into(),
            resource_version: 0,
            cidrs: self.config.service_ranges.clone(),
            raw_cidrs: self
                .config
                .service_ranges
                .iter()
                .map(|net| net.to_string().into_boxed_str())
                .collect(),
            deleting: false,
        })
    }

    async fn act(&self, ctx: &PassContext, decision: Decision) -> Result<PassReport, LoopError> {
        if let Some(at) = decision.next_recheck {
            let wait = (at - jiff::Timestamp::now())
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wakeup
                .schedule(tokio::time::Instant::now() + wait + Duration::from_millis(50));
        }
        let mut report = PassReport::default();
        let mut first_error: Option<LoopError> = None;
        let appeared = self.appeared(&decision.findings);
        for finding in decision.findings {
            let report_only = report_key(&finding);
            if report_only
                .as_ref()
                .is_some_and(|key| !appeared.contains(key))
            {
                // Reported when it appeared; still there, still in `check`'s list.
                report.push(drift_of(&finding, Action::Report, false, None));
                continue;
            }
            if report_only.is_none() {
                self.count(&finding);
            }
            let outcome = if ctx.dry_run {
                Outcome::DryRun
            } else {
                match self.repair(ctx, &finding).await {
                    Ok(outcome) => outcome,
                    Err(err) => {
                        warn!(object = %finding.regarding.object(), error = %err, "repair failed");
                        first_error.get_or_insert(err);
                        Outcome::Failed
                    }
                }
            };
            let action = action_of(&finding.repair);
            match outcome {
                Outcome::Skip => continue,
                Outcome::Done => match self.publish(&finding).await {
                    Ok(()) => {
                        if report_only.is_some() {
                            self.count(&finding);
                        }
                        report.push(drift_of(&finding, action, action != Action::Report, None));
                    }
                    Err(err) => {
                        // A report-only finding is counted and published on the next pass
                        // instead (the runner retries a failed pass soon); a repair is done.
                        if let Some(key) = &report_only {
                            self.reported.forget(key);
                        }
                        first_error.get_or_insert(err);
                        report.push(drift_of(&finding, action, action != Action::Report, None));
                    }
                },
                Outcome::DryRun => {
                    if report_only.is_some() {
                        self.count(&finding);
                    }
                    report.push(drift_of(&finding, action, false, None));
                }
                Outcome::Deferred(why) => {
                    self.wakeup
                        .schedule(tokio::time::Instant::now() + self.config.deferral_retry);
                    report.push(drift_of(&finding, action, false, Some(why)));
                }
                Outcome::Failed => report.push(drift_of(
                    &finding,
                    action,
                    false,
                    Some("the write failed; retrying".to_owned()),
                )),
            }
        }
        match first_error {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }

    /// Carries out one repair. Deletes (and the delete of a recreate) happen only when a live
    /// read of the Services involved agrees with the cache: a watch may be behind.
    async fn repair(&self, ctx: &PassContext, finding: &Finding) -> Result<Outcome, LoopError> {
        let client = &ctx.client;
        let ip_api: Api<IPAddress> = Api::all(client.clone());
        match &finding.repair {
            Repair::None => Ok(Outcome::Done),
            Repair::Create { ip, owner } => create_ip_address(&ip_api, *ip, owner).await,
            Repair::Recreate {
                ip,
                owner,
                existing,
                dangling_parent,
            } => {
                let verdict = verify_recreate(client, *ip, owner, dangling_parent.as_ref()).await;
                if let Some(outcome) = self.deferral(verdict) {
                    return Ok(outcome);
                }
                if !delete_ip_address(&ip_api, &ip.to_string(), existing).await? {
                    return Ok(Outcome::Skip);
                }
                create_ip_address(&ip_api, *ip, owner).await
            }
            Repair::Delete {
                name,
                existing,
                ground,
            } => {
                let verdict = verify_delete(client, name, ground).await;
                if let Some(outcome) = self.deferral(verdict) {
                    return Ok(outcome);
                }
                if delete_ip_address(&ip_api, name, existing).await? {
                    Ok(Outcome::Done)
                } else {
                    Ok(Outcome::Skip)
                }
            }
        }
    }

    /// `None` when the live check confirmed the delete; otherwise the deferral outcome.
    fn deferral(&self, verdict: Verdict) -> Option<Outcome> {
        let (reason, why) = match verdict {
            Verdict::Confirmed => return None,
            Verdict::Contradicted(why) => ("stale_cache", why),
            Verdict::Unknown(why) => ("verify_failed", why),
        };
        self.metrics
            .deferred_deletes
            .get_or_create(&[("reason", reason)])
            .inc();
        info!(reason, %why, "IPAddress delete deferred");
        Some(Outcome::Deferred(format!("delete deferred: {why}")))
    }

    /// Publishes the finding's event. A failure is the caller's to retry: the finding must not
    /// be marked reported without its event (the namespace it goes into may not exist yet).
    async fn publish(&self, finding: &Finding) -> Result<(), LoopError> {
        let Some(event) = &finding.event else {
            return Ok(());
        };
        let reference = object_reference(&finding.regarding);
        let result = self
            .recorder
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: event.reason.to_owned(),
                    note: Some(event.note.clone()),
                    action: event.action.to_owned(),
                    secondary: None,
                },
                &reference,
            )
            .await;
        result.map_err(|err| {
            warn!(reason = event.reason, error = %err, "cannot publish event; retrying");
            LoopError::Api(err)
        })
    }
}

enum Outcome {
    Done,
    DryRun,
    /// Nothing to do after all (the cache was behind); not reported.
    Skip,
    Deferred(String),
    Failed,
}

enum Verdict {
    Confirmed,
    Contradicted(String),
    Unknown(String),
}

async fn live_service(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<Service>, kube::Error> {
    Api::<Service>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
}

fn service_lists(service: &Service, ip: IpAddr) -> bool {
    let spec = service.spec.as_ref();
    let listed = spec
        .and_then(|s| s.cluster_ips.as_ref())
        .into_iter()
        .flatten()
        .chain(spec.and_then(|s| s.cluster_ip.as_ref()));
    listed
        .filter_map(|text| crate::alloc::parse_ip_sloppy(text))
        .any(|listed| listed == ip)
}

async fn verify_delete(client: &Client, name: &str, ground: &DeleteGround) -> Verdict {
    let (namespace, parent) = match ground {
        DeleteGround::NotAService => return Verdict::Confirmed,
        DeleteGround::ParentGone { namespace, name }
        | DeleteGround::ParentDoesNotList { namespace, name } => (namespace, name),
    };
    let Ok(ip) = name.parse::<IpAddr>() else {
        // No Service can list a name that is no IP.
        return Verdict::Confirmed;
    };
    match live_service(client, namespace, parent).await {
        Ok(None) => Verdict::Confirmed,
        Ok(Some(service)) if !service_lists(&service, ip) => Verdict::Confirmed,
        Ok(Some(_)) => Verdict::Contradicted(format!(
            "Service {namespace}/{parent} exists and lists {ip}, but the Service cache did not show it"
        )),
        Err(err) => Verdict::Unknown(format!("cannot read Service {namespace}/{parent}: {err}")),
    }
}

async fn verify_recreate(
    client: &Client,
    ip: IpAddr,
    owner: &ServiceOwner,
    dangling_parent: Option<&ServiceOwner>,
) -> Verdict {
    match live_service(client, &owner.namespace, &owner.name).await {
        Ok(Some(service)) if service_lists(&service, ip) => {}
        Ok(_) => {
            return Verdict::Contradicted(format!(
                "Service {}/{} no longer lists {ip}",
                owner.namespace, owner.name
            ));
        }
        Err(err) => {
            return Verdict::Unknown(format!(
                "cannot read Service {}/{}: {err}",
                owner.namespace, owner.name
            ));
        }
    }
    let Some(parent) = dangling_parent else {
        return Verdict::Confirmed;
    };
    match live_service(client, &parent.namespace, &parent.name).await {
        Ok(Some(service)) if service_lists(&service, ip) => Verdict::Contradicted(format!(
            "Service {}/{} exists and lists {ip}, but the Service cache did not show it",
            parent.namespace, parent.name
        )),
        Ok(_) => Verdict::Confirmed,
        Err(err) => Verdict::Unknown(format!(
            "cannot read Service {}/{}: {err}",
            parent.namespace, parent.name
        )),
    }
}

/// Deletes the IPAddress if it is still the object the decision saw. `Ok(false)` when it is
/// gone or changed since (the next pass decides again).
/// Creates the IPAddress for `owner`. A 409 means the IPAddress cache was behind and it exists
/// already: skip, and let the next pass look again.
async fn create_ip_address(
    ip_api: &Api<IPAddress>,
    ip: IpAddr,
    owner: &ServiceOwner,
) -> Result<Outcome, LoopError> {
    match ip_api
        .create(&PostParams::default(), &new_ip_address(ip, owner))
        .await
    {
        Ok(_) => Ok(Outcome::Done),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Outcome::Skip),
        Err(err) => Err(err.into()),
    }
}

async fn delete_ip_address(
    api: &Api<IPAddress>,
    name: &str,
    existing: &model::ObjectVersion,
) -> Result<bool, LoopError> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(existing.uid.to_string()),
            resource_version: Some(existing.resource_version.to_string()),
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(err) => Err(err.into()),
    }
}

/// The IPAddress upstream's allocator writes for `ip` of `owner` (`newIPAddress`).
pub fn new_ip_address(ip: IpAddr, owner: &ServiceOwner) -> IPAddress {
    IPAddress {
        metadata: ObjectMeta {
            name: Some(ip.to_string()),
            labels: Some(BTreeMap::from([
                (
                    LABEL_IP_FAMILY.to_owned(),
                    IpFamily::of(ip).as_str().to_owned(),
                ),
                (LABEL_MANAGED_BY.to_owned(), IPALLOCATOR_MANAGER.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(IPAddressSpec {
            parent_ref: ParentReference {
                group: Some(String::new()),
                resource: "services".to_owned(),
                namespace: Some(owner.namespace.to_string()),
                name: owner.name.to_string(),
            },
        }),
    }
}

fn object_reference(regarding: &Regarding) -> ObjectReference {
    match regarding {
        Regarding::Service {
            namespace,
            name,
            uid,
        } => ObjectReference {
            api_version: Some("v1".to_owned()),
            kind: Some("Service".to_owned()),
            namespace: Some(namespace.to_string()),
            name: Some(name.to_string()),
            uid: Some(uid.to_string()).filter(|uid| !uid.is_empty()),
            ..ObjectReference::default()
        },
        Regarding::IpAddress { name, uid } => ObjectReference {
            api_version: Some("networking.k8s.io/v1".to_owned()),
            kind: Some("IPAddress".to_owned()),
            name: Some(name.to_string()),
            uid: Some(uid.to_string()).filter(|uid| !uid.is_empty()),
            ..ObjectReference::default()
        },
    }
}

fn action_of(repair: &Repair) -> Action {
    match repair {
        Repair::None => Action::Report,
        Repair::Create { .. } => Action::Create,
        Repair::Recreate { .. } => Action::Update,
        Repair::Delete { .. } => Action::Delete,
    }
}

fn drift_of(finding: &Finding, action: Action, applied: bool, note: Option<String>) -> Drift {
    let mut message = finding.summary();
    if let Some(note) = note {
        message.push_str(" (");
        message.push_str(&note);
        message.push(')');
    }
    crate::contract::drift(
        finding.kind,
        finding.regarding.object(),
        action,
        message,
        applied,
    )
}

impl Reconciler for ClusterIpRepair {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.config.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        let (client, page_size) = (self.client.clone(), self.config.page_size);
        let services = self
            .shared_services
            .subscribe(|store| reflect(client, page_size, store));
        let mut triggers = vec![services, self.wakeup.clone().stream()];
        if let Some(legacy) = &self.legacy {
            triggers.push(legacy.triggers());
        }
        if self.config.mode == RepairMode::Audit {
            return triggers;
        }
        // IPAddress and ServiceCIDR caches only where the API serves them.
        let client = self.client.clone();
        let mode = self.config.mode;
        let ip_store = self.ip_addresses.clone();
        let cidr_store = self.service_cidrs.clone();
        let gated = futures::stream::once(async move {
            let served = if mode == RepairMode::IpAddress {
                Served::IpAddressApi
            } else {
                let attempt = || discover(&client);
                let mut failure = crate::findings::RepeatedFailure::default();
                let discovered = attempt
                    .retry(crate::retry::backoff(
                        Duration::from_millis(500),
                        Duration::from_secs(30),
                    ))
                    .notify(|err, _| {
                        if failure.is_new(err) {
                            warn!(error = %err, "discovery of networking.k8s.io/v1 failed; retrying (the same failure again is logged at debug level)");
                        } else {
                            debug!(error = %err, "discovery of networking.k8s.io/v1 failed again");
                        }
                    })
                    .await;
                // The backoff never runs out, so an error cannot come back; audit is the safe
                // answer if it ever did.
                discovered.unwrap_or(Served::NoIpAddressApi)
            };
            match served {
                Served::IpAddressApi => futures::stream::select(
                    reflect(client.clone(), page_size, ip_store),
                    reflect(client, page_size, cidr_store),
                )
                .boxed(),
                Served::NoIpAddressApi => futures::stream::pending().boxed(),
            }
        })
        .flatten()
        .boxed();
        triggers.push(gated);
        triggers
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(async move {
            let mut result = self.pass(ctx).await;
            let legacy = match (&result, &self.legacy) {
                (Ok(_), Some(slot)) => match self.keeps_legacy_bitmaps(&ctx.client).await {
                    Ok(false) => None,
                    Ok(true) => match slot.get_or_build(&self.config, &self.ranges).await {
                        Ok(bitmaps) => Some(bitmaps),
                        Err(err) => {
                            result = Err(err);
                            None
                        }
                    },
                    Err(err) => {
                        result = Err(err);
                        None
                    }
                },
                _ => None,
            };
            if let (Ok(report), Some(legacy)) = (&mut result, legacy) {
                let count = |error_type: &'static str| {
                    self.metrics
                        .ip_errors
                        .get_or_create(&[("type", error_type)])
                        .inc();
                };
                if let Err(err) = legacy
                    .pass(ctx, &self.services, &self.recorder, &count, report)
                    .await
                {
                    result = Err(err);
                }
            }
            if let Err(err) = &result
                && !matches!(err, LoopError::NotSynced(_))
            {
                self.metrics.reconcile_errors.inc();
            }
            result
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn config_validation_names_the_field() {
        let config = ClusterIpRepairConfig {
            interval: Duration::ZERO,
            ..ClusterIpRepairConfig::default()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .starts_with("loops.clusterIPRepair.interval:")
        );
        let config = ClusterIpRepairConfig {
            service_ranges: vec![
                "10.0.0.0/24".parse().unwrap(),
                "10.1.0.0/24".parse().unwrap(),
            ],
            ..ClusterIpRepairConfig::default()
        };
        let message = config.validate().unwrap_err().to_string();
        assert!(
            message.contains("serviceClusterIPRange") && message.contains("two IPv4 ranges"),
            "{message}"
        );
        // No range: read from the cluster when a pass needs it.
        let config = ClusterIpRepairConfig {
            mode: RepairMode::Audit,
            ..ClusterIpRepairConfig::default()
        };
        assert!(config.validate().is_ok());
        assert!(
            validate_ranges(&["10.0.0.0/30".parse().unwrap()])
                .unwrap_err()
                .to_string()
                .contains("fewer than 8")
        );
        assert!(ClusterIpRepairConfig::default().validate().is_ok());
    }

    #[test]
    fn new_ip_address_matches_upstream_shape() {
        let owner = ServiceOwner {
            namespace: "d".into(),
            name: "s".into(),
        };
        let object =
            serde_json::to_value(new_ip_address("fd00::5".parse().unwrap(), &owner)).unwrap();
        assert_eq!(object["metadata"]["name"], "fd00::5");
        assert_eq!(
            object["metadata"]["labels"]["ipaddress.kubernetes.io/ip-family"],
            "IPv6"
        );
        assert_eq!(
            object["metadata"]["labels"]["ipaddress.kubernetes.io/managed-by"],
            "ipallocator.k8s.io"
        );
        assert_eq!(
            object["spec"]["parentRef"],
            serde_json::json!({"group": "", "resource": "services", "namespace": "d", "name": "s"})
        );
    }
}

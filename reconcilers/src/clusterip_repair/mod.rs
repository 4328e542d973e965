//! Loop: ClusterIP repair.
//!
//! Upstream (`pkg/registry/core/service/ipallocator/controller/repairip.go`) keeps every Service
//! cluster IP backed by an `networking.k8s.io/v1` IPAddress that names the Service, inside
//! kube-apiserver, on a 3-minute resync. We do the same from outside: caches of Services,
//! IPAddresses and ServiceCIDRs are kept by watches (which also wake the loop), a full pass runs
//! every interval, and [`plan`] says what is wrong with the exact upstream events.
//!
//! Safety beyond upstream: nothing is decided from an unsynced cache; every delete is
//! preconditioned on the IPAddress's uid and resourceVersion; and before any write or report the
//! Service it rests on is read live (`apply::verify`): a create needs the Service to exist as
//! the object the cache saw and to list the IP, a delete needs the parent to be gone or not to
//! list it, a report needs its Service. A finding the live read disproves (the cache was behind)
//! is neither written, reported nor counted; a deferred delete is counted as such. IPAddresses
//! managed by anyone but `ipallocator.k8s.io` are never written.
//!
//! Where the API serves no IPAddress (older clusters, generic control planes; found by
//! discovery, asked again each interval until it is served, so a control plane upgraded in place
//! gets the IPAddress repair without a restart), the loop audits instead: it rebuilds each
//! configured range's allocation from all Services and reports duplicates, out-of-range and
//! invalid IPs with the legacy repair's reasons, without writing. In etcd mode it also repairs the legacy bitmaps there ([`legacy`]),
//! and only there: where the IPAddress API is served they are left alone
//! ([`ClusterIpRepairLoop::keeps_legacy_bitmaps`] says why).

mod apply;
pub mod audit;
pub mod grace;
mod legacy;
pub mod metrics;
pub mod model;
pub mod plan;
pub mod section;

pub use metrics::RepairMetrics;
pub use section::{DEFAULT_INTERVAL, DEFAULT_ORPHAN_GRACE_PERIOD, RepairMode, Section};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::Retryable;
use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::runtime::events::EventType;
use kube::{Api, Client};
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use crate::alloc::ServiceRange;
use crate::budget::CacheBudget;
use crate::contract::{Drift, LoopError, PassContext, PassReport, Reconciler, Trigger, WakeAt};
use crate::discovery::{LastAnswer, NetworkingDiscovery};
use crate::events::SeriesRecorder;
use crate::metrics::MetricRegistry;
use crate::section::{ServiceName, Settings, format_duration};
use crate::service_cache::record::ServiceRecord;
use crate::service_range::{DEFAULT_SERVICE_CIDR, RangeLookup};
use crate::watch_cache::WatchCache;
pub use apply::new_ip_address;
use apply::{Outcome, Verdict, create_ip_address, delete_ip_address, drift_of, object_reference};
use audit::AuditDecision;
use model::{IpAddressRecord, ServiceCidrRecord};
use plan::{Finding, Problem, Repair};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "clusterip-repair";

/// When a delete is deferred, the loop looks again after this long.
const DEFERRAL_RETRY: Duration = Duration::from_secs(10);

/// Which APIs the cluster serves, from discovery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Served {
    IpAddressApi,
    NoIpAddressApi,
}

/// What discovery says the cluster serves, and the answer before: an answer is logged when it
/// is the first or differs from the one before; the API found served tells `found`, so that the
/// caches are fed without waiting out the gated trigger's interval.
struct Discovered {
    discovery: Arc<NetworkingDiscovery>,
    recheck: Duration,
    last: LastAnswer<Served>,
    /// Told when discovery first finds the IPAddress API served.
    found: Notify,
}

impl Discovered {
    async fn ask(&self) -> Result<Served, kube::Error> {
        let serves = (self.discovery)
            .serves(&["ipaddresses", "servicecidrs"], self.recheck)
            .await?;
        let served = if serves {
            Served::IpAddressApi
        } else {
            Served::NoIpAddressApi
        };
        if self.last.replace(served) != Some(served) {
            info!(?served, "networking.k8s.io/v1 discovered");
            if serves {
                self.found.notify_one();
            }
        }
        Ok(served)
    }
}

/// The ClusterIP repair loop (`clusterip-repair`).
pub struct ClusterIpRepairLoop {
    section: Section,
    metrics: RepairMetrics,
    /// Shared with the NodePort repair ([`Self::shared_services`]).
    services: WatchCache<ServiceRecord>,
    ip_addresses: WatchCache<IpAddressRecord>,
    service_cidrs: WatchCache<ServiceCidrRecord>,
    /// What discovery found, once it answered: "not served" is asked again after an interval
    /// (a control plane upgraded in place serves the IPAddress API from then on).
    discovered: Arc<Discovered>,
    /// Whether the legacy bitmaps left alone were logged.
    legacy_skip_logged: std::sync::atomic::AtomicBool,
    /// Kept for the loop's life, so a finding that clears and comes back is counted into its
    /// first event's series ([`crate::events::emit_in`]).
    recorder: SeriesRecorder,
    /// Wakes the loop when orphans leave their grace period and when deferred findings are
    /// looked at again.
    wakeup: WakeAt,
    /// When each IPAddress was first found deletable by its age, on this clock.
    first_deletable: Mutex<grace::FirstDeletable>,
    /// etcd mode's bitmaps ([`legacy`]), built once the ranges are known.
    legacy: Option<legacy::LegacyIpBitmaps>,
    /// The ranges audit mode and the bitmaps work with: configured, or read from the cluster.
    ranges: RangeLookup,
    /// The findings as they stood after the last pass: each is counted when it appears, not on
    /// every pass (a repair the API keeps refusing is found again on every pass), and one this
    /// loop only reports (a duplicate or out-of-range cluster IP) gets its event then.
    reported: crate::findings::ReportOnce<FindingKey>,
    /// The findings a live read could not confirm in the last pass that finished: one that
    /// stays so (an API answering the caches' watches but failing the reads) is logged and
    /// counted when it is first deferred, not every time it is looked at again.
    deferred: crate::findings::ReportOnce<FindingKey>,
}

/// A finding: its problem, the object and the sentence.
type FindingKey = (Problem, String, String);

fn finding_key(finding: &Finding) -> FindingKey {
    (
        finding.problem,
        finding.regarding.object(),
        finding.summary(),
    )
}

impl ClusterIpRepairLoop {
    /// Builds the loop of a validated `section` with validated `settings` (the service ranges,
    /// etcd mode, the identity events report) and the `kubernetes` Service (the legacy bitmap's
    /// events are posted on it, and a missing range's error names its ClusterIP); registers its
    /// metrics in `registry` (give it the runtime's prefixed registry). The client feeds the
    /// caches, its own and unlimited (its section builds it with the cluster's shared ones,
    /// [`Self::with_shared`]); passes use the client of their context.
    pub fn new(
        client: Client,
        section: Section,
        settings: &Settings,
        kubernetes_service: ServiceName,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        let budget = &CacheBudget::default();
        let services = WatchCache::every(client.clone(), section.page_size, budget);
        let service_cidrs = WatchCache::every(client.clone(), section.page_size, budget);
        let discovery = NetworkingDiscovery::new(client.clone());
        Self::with_shared(
            client,
            section,
            settings,
            kubernetes_service,
            (services, service_cidrs, discovery),
            registry,
        )
    }

    /// [`Self::new`] with the Service and ServiceCIDR caches other loops may share (whichever
    /// subscribes first feeds each) and their discovery. Its own IPAddress cache and the
    /// bitmaps' fresh LISTs count against the Service cache's budget (the cluster's).
    pub fn with_shared(
        client: Client,
        section: Section,
        settings: &Settings,
        kubernetes_service: ServiceName,
        (services, service_cidrs, discovery): (
            WatchCache<ServiceRecord>,
            WatchCache<ServiceCidrRecord>,
            Arc<NetworkingDiscovery>,
        ),
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        // Events name this controller (upstream's reasons, not its reporting controller), so
        // nobody mistakes them for kube-apiserver's own repair.
        let reporter = settings.reporter();
        let budget = services.budget().clone();
        let legacy = (settings.etcd()).map(|etcd| {
            legacy::LegacyIpBitmaps::new(etcd.clone(), kubernetes_service.clone(), budget.clone())
        });
        let discovered = Arc::new(Discovered {
            discovery: discovery.clone(),
            recheck: section.interval,
            last: LastAnswer::default(),
            found: Notify::new(),
        });
        Self {
            legacy,
            ranges: RangeLookup::new(
                client.clone(),
                settings.service_ranges.clone(),
                kubernetes_service,
                discovery,
                section.interval,
            ),
            reported: crate::findings::ReportOnce::new(),
            deferred: crate::findings::ReportOnce::new(),
            recorder: SeriesRecorder::new(client.clone(), reporter),
            ip_addresses: WatchCache::every(client.clone(), section.page_size, &budget),
            service_cidrs,
            section,
            metrics: RepairMetrics::register(registry),
            services,
            discovered,
            legacy_skip_logged: std::sync::atomic::AtomicBool::new(false),
            wakeup: WakeAt::default(),
            first_deletable: Mutex::default(),
        }
    }

    /// The Service cache this loop keeps, for other loops that read Services: the process then
    /// watches Services once.
    pub fn shared_services(&self) -> WatchCache<ServiceRecord> {
        self.services.clone()
    }

    /// The bytes the Service and IPAddress caches take
    /// ([`StoreState::allocated_bytes`](crate::watch_cache::StoreState::allocated_bytes)).
    pub fn cache_bytes(&self) -> (usize, usize) {
        (
            self.services.read().allocated_bytes(),
            self.ip_addresses.read().allocated_bytes(),
        )
    }

    pub fn metrics(&self) -> &RepairMetrics {
        &self.metrics
    }

    /// Which repair runs: the configured mode, or discovery's answer.
    async fn served(&self) -> Result<Served, LoopError> {
        match self.section.mode {
            RepairMode::IpAddress => Ok(Served::IpAddressApi),
            RepairMode::Audit => Ok(Served::NoIpAddressApi),
            RepairMode::Auto => Ok(self.discovered.ask().await?),
        }
    }

    /// etcd mode: whether kube-apiserver allocates cluster IPs with the legacy bitmaps, so that
    /// they are repaired. Only where the cluster serves no `networking.k8s.io/v1` IPAddress API
    /// (asked by discovery whatever `mode` says, again each interval until it is served;
    /// `ipAddress` mode asserts it is served).
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
    async fn keeps_legacy_bitmaps(&self) -> Result<bool, LoopError> {
        let served = match self.section.mode {
            RepairMode::IpAddress => Served::IpAddressApi,
            RepairMode::Auto | RepairMode::Audit => self.discovered.ask().await?,
        };
        let keeps = served == Served::NoIpAddressApi;
        if !keeps
            && let Some(legacy) = &self.legacy
            && !self
                .legacy_skip_logged
                .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            info!(
                keys = %format_args!(
                    "{}, {}",
                    legacy.etcd.key(crate::legacy_alloc::etcd::RangeKey::ServiceIps),
                    legacy.etcd.key(crate::legacy_alloc::etcd::RangeKey::SecondaryServiceIps)
                ),
                "the cluster serves the IPAddress API, by which kube-apiserver allocates cluster \
                 IPs: the legacy ClusterIP bitmaps in etcd are left alone"
            );
        }
        Ok(keeps)
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        match self.served().await? {
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
            audit::decide_audit_mode(state.values(), &ranges)
        };
        let AuditDecision { findings, usage } = audit;
        for range in &usage {
            debug!(range = %range.range, allocated = %range.allocated, free = %range.free, "service range usage");
        }
        self.act(ctx, Served::NoIpAddressApi, findings).await
    }

    /// The findings of a complete pass that were not there after the last one.
    fn appeared(&self, findings: &[Finding]) -> std::collections::HashSet<FindingKey> {
        self.reported
            .update(findings.iter().map(finding_key))
            .into_iter()
            .collect()
    }

    fn count(&self, finding: &Finding) {
        if let Some(error_type) = finding.problem.error_type() {
            self.metrics
                .ip_errors
                .get_or_create(&[("type", error_type)])
                .inc();
        }
    }

    async fn ipaddress_pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let now = jiff::Timestamp::now();
        let mut decision = {
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
            plan::decide_ipaddress_mode(
                services.values(),
                ip_addresses.values(),
                service_cidrs.values().chain(stand_in.as_ref()),
                now,
                self.section.orphan_grace_period,
            )
        };
        let held = grace::hold_until_seen_as_old(
            &mut decision,
            &mut self
                .first_deletable
                .lock()
                .unwrap_or_else(|poison| poison.into_inner()),
            now,
            tokio::time::Instant::now(),
            self.section.orphan_grace_period,
        );
        if let Some(at) = decision.next_recheck {
            let wait = (at - jiff::Timestamp::now())
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wakeup
                .schedule(tokio::time::Instant::now() + wait + Duration::from_millis(50));
        }
        let mut report = self
            .act(ctx, Served::IpAddressApi, decision.findings)
            .await?;
        // A run leaves these alone in this pass, neither checked live nor reported; a dry run
        // (`check`) says which leaks a run would hold back rather than leave them out of its
        // list or show them as deleted at once, each read live first as the others are. The
        // note names the grace, not the time left, so that the drift is the same on every pass
        // of `run --dry-run` and logged once.
        if ctx.dry_run {
            for held in held {
                let note = match apply::verify(&ctx.client, &held.finding).await {
                    Verdict::Confirmed => String::new(),
                    Verdict::Contradicted(why) => {
                        self.disproved(&held.finding, &why);
                        continue;
                    }
                    Verdict::Unknown(why) => format!("; not confirmed live: {why}"),
                };
                let note = format!(
                    "held: a run deletes it once this controller has seen it for {}{note}",
                    format_duration(held.grace),
                );
                report.push(drift_of(&held.finding, false, Some(note)));
            }
        }
        Ok(report)
    }

    /// Upstream's repair waits until the default ServiceCIDR exists (the service-cidr loop
    /// creates it). A dry run cannot wait for that write, so it judges against the ranges the
    /// service-cidr loop would create it with.
    fn default_service_cidr_stand_in(
        &self,
        ctx: &PassContext,
    ) -> Result<ServiceCidrRecord, LoopError> {
        let configured = match self.ranges.configured() {
            Some(configured) if ctx.dry_run => configured,
            _ => {
                return Err(LoopError::NotSynced(format!(
                    "waiting for the default ServiceCIDR {DEFAULT_SERVICE_CIDR:?} to exist"
                )));
            }
        };
        Ok(ServiceCidrRecord {
            name: DEFAULT_SERVICE_CIDR.into(),
            resource_version: 0,
            cidrs: configured.to_vec(),
            deleting: false,
        })
    }

    /// Verifies, repairs and reports the findings of a complete pass of the mode `served` says.
    async fn act(
        &self,
        ctx: &PassContext,
        served: Served,
        findings: Vec<Finding>,
    ) -> Result<PassReport, LoopError> {
        let mut report = PassReport::default();
        let mut first_error: Option<LoopError> = None;
        let appeared = self.appeared(&findings);
        let mut deferred = Vec::new();
        let mut findings = findings.into_iter();
        while let Some(finding) = findings.next() {
            // A cache emptied during the pass (its tenant paused over budget, a relist begun)
            // no longer holds what the findings were decided on: the rest wait for a pass on
            // synced caches, rather than each being checked live, deferred and kept in the
            // report against a client that may be failing every request. Those that appeared
            // in this pass are reported by that pass.
            if let Some(what) = self.unsynced(served) {
                self.forget_appeared(std::iter::once(finding).chain(findings), &appeared);
                return Err(LoopError::NotSynced(format!(
                    "{what} cache stopped being synced during the pass"
                )));
            }
            let key = finding_key(&finding);
            let new = appeared.contains(&key);
            let report_only = matches!(finding.repair, plan::Repair::None);
            if report_only && !new {
                // Reported when it appeared; still there, still in `check`'s list.
                report.push(drift_of(&finding, false, None));
                continue;
            }
            match apply::verify(&ctx.client, &finding).await {
                Verdict::Confirmed => {}
                Verdict::Contradicted(why) => {
                    self.disproved(&finding, &why);
                    continue;
                }
                Verdict::Unknown(why) => {
                    report.push(self.unconfirmed(served, &finding, &key, &why));
                    deferred.push(key);
                    continue;
                }
            }
            if !report_only && new {
                self.count(&finding);
            }
            let outcome = if ctx.dry_run {
                Outcome::DryRun
            } else {
                self.write(ctx, &finding, new, &mut first_error).await
            };
            match outcome {
                Outcome::Skip => continue,
                Outcome::Done => {
                    match self.publish(&finding).await {
                        Ok(()) if report_only => self.count(&finding),
                        Ok(()) => {}
                        Err(err) => {
                            // A report-only finding is counted and published on the next pass
                            // instead (the runner retries a failed pass soon); a repair is done.
                            if report_only {
                                self.reported.forget(&key);
                            }
                            first_error.get_or_insert(err);
                        }
                    }
                    report.push(drift_of(&finding, !report_only, None));
                }
                Outcome::DryRun => {
                    if report_only {
                        self.count(&finding);
                    }
                    report.push(drift_of(&finding, false, None));
                }
                Outcome::Failed => report.push(drift_of(
                    &finding,
                    false,
                    Some("the write failed; retrying".to_owned()),
                )),
            }
        }
        self.deferred.update(deferred);
        match first_error {
            Some(err) => Err(err),
            None => Ok(report),
        }
    }

    /// A confirmed finding's repair written. A write the API refuses is found again on every
    /// pass: it is warned about when the finding appears (`new`) and kept as the pass's error,
    /// which is the runner's to report.
    async fn write(
        &self,
        ctx: &PassContext,
        finding: &Finding,
        new: bool,
        first_error: &mut Option<LoopError>,
    ) -> Outcome {
        match self.repair(ctx, finding).await {
            Ok(outcome) => outcome,
            Err(err) => {
                if new {
                    warn!(object = %finding.regarding.object(), error = %err, "repair failed; retrying (logged at debug level while it fails)");
                } else {
                    debug!(object = %finding.regarding.object(), error = %err, "repair failed, again");
                }
                first_error.get_or_insert(err);
                Outcome::Failed
            }
        }
    }

    /// Forgets the findings of `rest` that appeared in this pass, so that the next pass, which
    /// acts on them, reports them.
    fn forget_appeared(
        &self,
        rest: impl Iterator<Item = Finding>,
        appeared: &std::collections::HashSet<FindingKey>,
    ) {
        for key in rest.map(|finding| finding_key(&finding)) {
            if appeared.contains(&key) {
                self.reported.forget(&key);
            }
        }
    }

    /// The first cache an IPAddress-mode pass decides on that is not synced, if any. None for
    /// an audit pass: its IPAddress and ServiceCIDR caches are never synced, and its findings
    /// are only reported, each after a live read of its Service.
    fn unsynced(&self, served: Served) -> Option<&'static str> {
        if served == Served::NoIpAddressApi {
            return None;
        }
        [
            (self.services.read().synced, "Service"),
            (self.ip_addresses.read().synced, "IPAddress"),
            (self.service_cidrs.read().synced, "ServiceCIDR"),
        ]
        .into_iter()
        .find_map(|(synced, what)| (!synced).then_some(what))
    }

    /// A finding the live read could not confirm: a report waits for a pass that can confirm
    /// it. An audit pass only reports, so it waits for the next pass on the interval; an
    /// IPAddress-mode finding is looked at again soon.
    fn unconfirmed(&self, served: Served, finding: &Finding, key: &FindingKey, why: &str) -> Drift {
        // Counted (and reported, for a report-only one) by the pass that confirms it.
        self.reported.forget(key);
        let again = self.deferred.is_present(key);
        if served == Served::NoIpAddressApi {
            if again {
                debug!(object = %finding.regarding.object(), %why, "cannot confirm a finding live, again");
            } else {
                info!(object = %finding.regarding.object(), %why, "cannot confirm a finding live; reported when a pass can");
            }
            return drift_of(finding, false, None);
        }
        self.wakeup
            .schedule(tokio::time::Instant::now() + DEFERRAL_RETRY);
        if again {
            debug!(object = %finding.regarding.object(), %why, "cannot confirm a finding live, again; deferred");
        } else {
            if finding.repair.deletes() {
                self.metrics
                    .deferred_deletes
                    .get_or_create(&[("reason", "verify_failed")])
                    .inc();
            }
            info!(object = %finding.regarding.object(), %why, "cannot confirm a finding live; deferred");
        }
        drift_of(finding, false, Some(format!("deferred: {why}")))
    }

    /// Carries out one repair of a finding [`apply::verify`] confirmed. The deletes are
    /// preconditioned on the IPAddress the decision saw; the creates fail if it exists.
    async fn repair(&self, ctx: &PassContext, finding: &Finding) -> Result<Outcome, LoopError> {
        let ip_api: Api<IPAddress> = Api::all(ctx.client.clone());
        match &finding.repair {
            Repair::None => Ok(Outcome::Done),
            Repair::Create { ip, owner } => create_ip_address(&ip_api, *ip, owner).await,
            Repair::Recreate {
                ip,
                owner,
                existing,
                ..
            } => {
                if !delete_ip_address(&ip_api, &ip.to_string(), existing).await? {
                    return Ok(Outcome::Skip);
                }
                create_ip_address(&ip_api, *ip, owner).await
            }
            Repair::Delete { name, existing, .. } => {
                if delete_ip_address(&ip_api, name, existing).await? {
                    Ok(Outcome::Done)
                } else {
                    Ok(Outcome::Skip)
                }
            }
        }
    }

    /// A finding a live read disproved: the cache was behind (a Service deleted, replaced or
    /// changed since it last heard). Nothing is written, reported or counted for it; the pass
    /// after the cache caught up decides again. Only the deferred deletes are counted, as the
    /// sign of a cache that disagrees with the API.
    fn disproved(&self, finding: &Finding, why: &str) {
        // Not reported: should it persist, the next pass checks it again.
        self.reported.forget(&finding_key(finding));
        if finding.repair.deletes() {
            self.metrics
                .deferred_deletes
                .get_or_create(&[("reason", "stale_cache")])
                .inc();
        }
        self.wakeup
            .schedule(tokio::time::Instant::now() + DEFERRAL_RETRY);
        debug!(object = %finding.regarding.object(), kind = finding.problem.drift_kind(), %why, "finding disproved by a live read; the cache is behind");
    }

    /// Publishes the finding's event. A failure is the caller's to retry: the finding must not
    /// be marked reported without its event (the namespace it goes into may not exist yet). An
    /// event into a namespace being deleted is dropped instead ([`crate::events`]).
    async fn publish(&self, finding: &Finding) -> Result<(), LoopError> {
        let Some((reason, action)) = finding.problem.event() else {
            return Ok(());
        };
        let reference = object_reference(&finding.regarding);
        crate::events::emit_in(
            &self.recorder,
            &reference,
            EventType::Warning,
            reason,
            action,
            &finding.note,
        )
        .await
        .map_err(LoopError::Api)
    }
}

impl Reconciler for ClusterIpRepairLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.section.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        let mut triggers = vec![self.services.subscribe(), self.wakeup.trigger()];
        if let Some(legacy) = &self.legacy {
            triggers.push(legacy.triggers());
        }
        if self.section.mode == RepairMode::Audit {
            return triggers;
        }
        // IPAddress and ServiceCIDR caches only where the API serves them: discovery is asked
        // again each interval until it is.
        let discovered = self.discovered.clone();
        let (mode, interval) = (self.section.mode, self.section.interval);
        let caches = futures::stream::select(
            self.ip_addresses.subscribe(),
            self.service_cidrs.subscribe(),
        );
        let gated = futures::stream::once(async move {
            if mode == RepairMode::IpAddress {
                return caches;
            }
            let attempt = || discovered.ask();
            let mut failure = crate::findings::RepeatedFailure::default();
            loop {
                let answer = attempt
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
                // The backoff never runs out, so an error cannot come back; audit, asked again
                // after an interval, is the safe answer if it ever did.
                if answer.unwrap_or(Served::NoIpAddressApi) == Served::IpAddressApi {
                    return caches;
                }
                tokio::select! {
                    () = tokio::time::sleep(interval) => {}
                    () = discovered.found.notified() => {}
                }
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
        self.recorder.forget_idle();
        Box::pin(async move {
            let mut result = self.pass(ctx).await;
            if let Ok(report) = &mut result
                && let Err(err) = self.repair_legacy_bitmaps(ctx, report).await
            {
                result = Err(err);
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
    use crate::service_cache::record::ServiceRef;

    #[test]
    fn new_ip_address_matches_upstream_shape() {
        let owner = ServiceRef {
            namespace: "d".into(),
            name: "s".into(),
            uid: "".into(),
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

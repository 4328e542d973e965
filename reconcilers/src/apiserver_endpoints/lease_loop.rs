//! `apiserver-lease`: this instance's membership Lease. Runs on every instance (no leadership):
//! each sidecar vouches only for its own apiserver.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::runtime::events::EventType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::apply::delete_if_uid;
use super::lease::{MEMBER_LABEL, OwnLease, observe};
use super::objects::service_family;
use super::probe::{FailureThreshold, ProbedServer, ReadinessProbe, Verdict};
use super::shutdown::ShutdownGate;
use super::{EndpointsDeps, Section, within};
use crate::alloc::IpFamily;
use crate::contract::{
    Action, LoopError, PassContext, PassReport, Reconciler, Trigger, WakeAt, drift,
};
use crate::lease;
use crate::section::Settings;

use crate::metrics::{MetricRegistry, loop_registry, registered};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "apiserver-lease";

/// How soon a readiness probe that failed below the threshold is repeated: a dead apiserver is
/// withdrawn within about `threshold - 1` seconds plus the probes' timeouts, not threshold
/// intervals.
const RECHECK: Duration = Duration::from_secs(1);

/// How often the serving certificate is checked against the advertised address: certificates
/// are rotated while the apiserver runs.
const CERTIFICATE_RECHECK: Duration = Duration::from_secs(600);

/// Metric handles of the `apiserver-lease` loop.
#[derive(Clone, Default)]
pub struct LeaseMetrics {
    ready: Gauge,
    renewals: Counter,
    certificate_lacks_address: Gauge,
}

impl LeaseMetrics {
    /// `address` labels the readiness gauge: instances sharing one address (a VIP) renew one
    /// Lease and count as one member, which alerts tell apart only by it.
    pub fn register(registry: &mut dyn MetricRegistry, address: IpAddr) -> Self {
        let registry = loop_registry(registry, NAME);
        let ready: Family<[(&'static str, String); 1], Gauge> = registered(
            registry,
            "apiserver_ready",
            "1 while the local apiserver's readiness check passes and this instance holds its membership Lease for the advertised address",
            Family::default(),
        );
        Self {
            ready: ready
                .get_or_create(&[("address", address.to_string())])
                .clone(),
            renewals: registered(
                registry,
                "renewals",
                "Writes of this instance's membership Lease (creations and renewals)",
                Counter::default(),
            ),
            certificate_lacks_address: registered(
                registry,
                "serving_certificate_lacks_address",
                "1 while the local apiserver's serving certificate is not valid for this \
                 instance's advertise address (in-cluster clients fail TLS)",
                Gauge::default(),
            ),
        }
    }

    pub fn ready(&self) -> i64 {
        self.ready.get()
    }
}

/// Keeps this instance's membership Lease while its apiserver is ready.
pub struct ApiserverLeaseLoop {
    own: OwnLease,
    /// Whether `own.address` was defaulted (for messages).
    address_defaulted: bool,
    /// The Service's IP family once learnt from the cluster (no range configured).
    service_family: std::sync::OnceLock<(IpFamily, String)>,
    /// The server the readiness probe asks: checked at the first pass to be this instance's
    /// apiserver, and its certificate now and then ([`CERTIFICATE_RECHECK`]).
    probed: Option<ProbedServer>,
    check_certificate: bool,
    /// When the certificate is next checked (whether it lacked the address at the last check is
    /// the metric's value).
    next_certificate_check: Mutex<Option<tokio::time::Instant>>,
    interval: Duration,
    readiness: Arc<dyn ReadinessProbe>,
    /// Failed probes in a row that withdraw this instance.
    failures: FailureThreshold,
    /// A probe again soon after a tolerated failure.
    recheck: WakeAt,
    shutdown: Arc<ShutdownGate>,
    metrics: LeaseMetrics,
    last_ready: Mutex<Option<bool>>,
    /// The Lease as this instance last wrote it: a renewal is then one PUT on top of it (its
    /// resourceVersion guards against anyone else's write), not a GET and a PUT.
    last_written: Mutex<Option<Lease>>,
    /// Who this loop's events say they come from.
    reporter: kube::runtime::events::Reporter,
}

impl ApiserverLeaseLoop {
    /// The loop of a validated `section` with validated `settings`; `None` when there is no
    /// advertise address (validation rejects that in `lease` mode).
    pub fn new(
        section: &Section,
        settings: &Settings,
        deps: EndpointsDeps,
        registry: &mut dyn MetricRegistry,
    ) -> Option<Self> {
        let address = section.advertise_address(settings)?;
        let holder = if settings.identity.is_empty() {
            address.to_string()
        } else {
            settings.identity.clone()
        };
        Some(Self {
            address_defaulted: settings.advertise_address.is_none(),
            service_family: std::sync::OnceLock::new(),
            probed: deps.probed.clone(),
            check_certificate: section.check_serving_certificate,
            next_certificate_check: Mutex::new(None),
            own: OwnLease {
                namespace: section.lease_namespace.clone(),
                target: Section::target(settings, &deps.service),
                address,
                holder,
                ttl: section.lease_ttl,
            },
            interval: section.interval,
            readiness: deps.readiness,
            failures: FailureThreshold::new(section.readiness_failure_threshold),
            recheck: WakeAt::default(),
            shutdown: deps.shutdown,
            metrics: LeaseMetrics::register(registry, address),
            last_ready: Mutex::new(None),
            last_written: Mutex::new(None),
            reporter: deps.reporter,
        })
    }

    pub fn metrics(&self) -> &LeaseMetrics {
        &self.metrics
    }

    fn note_readiness(&self, ready: &Result<(), super::probe::NotReady>) {
        let now = ready.is_ok();
        let before = self
            .last_ready
            .lock()
            .map(|mut last| last.replace(now))
            .unwrap_or(None);
        match (before, ready) {
            (Some(true) | None, Err(reason)) => tracing::warn!(
                address = %self.own.address,
                %reason,
                "local apiserver is not ready; withdrawing this instance from the kubernetes endpoints"
            ),
            (Some(false) | None, Ok(())) => tracing::info!(
                address = %self.own.address,
                "local apiserver is ready; this instance is a member of the kubernetes endpoints"
            ),
            _ => {}
        }
    }

    /// A failure below the threshold: the membership stays, and the next probe comes within a
    /// second (logged when a run of failures starts).
    fn note_tolerated(&self, verdict: &Verdict) {
        if let Verdict::Tolerated {
            failures: 1,
            reason,
        } = verdict
        {
            tracing::info!(
                address = %self.own.address,
                %reason,
                threshold = self.failures.threshold(),
                "local apiserver's readiness probe failed; keeping this instance's \
                 membership unless it fails readinessFailureThreshold times in a row"
            );
        }
        // An unproven failure is probed again soon too, so that it is judged one way or the
        // other within the threshold's seconds.
        let soon = matches!(
            verdict,
            Verdict::Tolerated { .. } | Verdict::Unproven { .. }
        );
        let at = tokio::time::Instant::now() + RECHECK.min(self.interval);
        self.recheck.set(soon.then_some(at));
    }

    /// Refuses an address of the other family than the Service's: in-cluster clients of an IPv6
    /// Service cannot use an IPv4 endpoint (the endpoints loop would leave it out). The family is
    /// the range's, else the Service's, read until it exists (a start-up cost only).
    async fn check_family(&self, ctx: &PassContext) -> Result<(), LoopError> {
        let (family, source) = match (self.own.target.primary_family, self.service_family.get()) {
            (Some(family), _) => (family, "serviceClusterIPRange".to_owned()),
            (None, Some(known)) => known.clone(),
            (None, None) => {
                let api: Api<Service> =
                    Api::namespaced(ctx.client.clone(), &self.own.target.namespace);
                let service = api.get_opt(&self.own.target.service_name).await?;
                let Some(known) = service.as_ref().and_then(service_family) else {
                    return Ok(());
                };
                let _ = self.service_family.set(known.clone());
                known
            }
        };
        let own = IpFamily::of(self.own.address);
        if own == family {
            return Ok(());
        }
        let defaulted = if self.address_defaulted {
            format!(
                " (taken from this host's {} default route: neither advertiseAddress nor \
                 serviceClusterIPRange is set)",
                own.as_str()
            )
        } else {
            String::new()
        };
        Err(LoopError::Invalid(format!(
            "advertiseAddress {}{defaulted} is {}, but the Service {}/{} is {} (from {source}): \
             in-cluster clients could not reach this apiserver at it; set advertiseAddress \
             (--advertise-address) to this apiserver's {} address",
            self.own.address,
            own.as_str(),
            self.own.target.namespace,
            self.own.target.service_name,
            family.as_str(),
            family.as_str()
        )))
    }

    /// Whether the local apiserver's serving certificate is valid for the advertised address,
    /// at the first pass and every [`CERTIFICATE_RECHECK`]: in-cluster clients reach it at that
    /// address through the `kubernetes` Service and check it. Reported once when it starts
    /// lacking, once when it holds again.
    async fn check_serving_certificate(&self) {
        let Some(probed) = self.probed.as_ref().filter(|_| self.check_certificate) else {
            return;
        };
        let now = tokio::time::Instant::now();
        match self.next_certificate_check.lock() {
            Ok(mut next) if next.is_none_or(|next| next <= now) => {
                *next = Some(now + CERTIFICATE_RECHECK);
            }
            _ => return,
        }
        let address = self.own.address;
        let lacks = match probed
            .certificate_holds(address, Duration::from_secs(3))
            .await
        {
            Ok(holds) => !holds,
            Err(why) => {
                tracing::debug!(%address, %why, "cannot check the local apiserver's serving certificate");
                return;
            }
        };
        let lacked = self.metrics.certificate_lacks_address.set(i64::from(lacks)) == 1;
        match (lacked, lacks) {
            (false, true) => tracing::warn!(
                %address,
                "the local apiserver's serving certificate is not valid for this instance's \
                 advertiseAddress {address}: in-cluster clients reach it there through the \
                 kubernetes Service and fail TLS; add {address} to the certificate's IP SANs \
                 (kubeadm: apiServer.certSANs) or advertise an address it holds"
            ),
            (true, false) => tracing::info!(
                %address,
                "the local apiserver's serving certificate is valid for advertiseAddress again"
            ),
            _ => {}
        }
    }

    /// Another instance renewing this address's Lease (a live Lease whose holder is not this
    /// one): the address is shared, which the [`ShutdownGate`] and a not-ready withdrawal
    /// respect. Said once: two sidecars given one address by mistake hide each other's failures.
    fn note_other_holder(&self, existing: Option<&Lease>) {
        let Some(lease) = existing else {
            return;
        };
        let Some(member) = observe(lease, self.own.ttl)
            .ok()
            .filter(|m| m.address == self.own.address)
        else {
            return;
        };
        let Some(holder) = member.holder.clone().filter(|h| *h != self.own.holder) else {
            return;
        };
        if member.expires <= Timestamp::now() {
            return;
        }
        if self.shutdown.note_shared(holder.clone()) {
            tracing::warn!(
                lease = %self.own.object_ref(),
                %holder,
                "another instance renews this address's membership Lease: the address is shared. \
                 Expected for a VIP in front of several apiservers (it stays listed while either \
                 renews it, and neither withdraws it when it stops); otherwise give each sidecar \
                 its own apiserver's address"
            );
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        if let Some(probed) = &self.probed {
            probed.warn_if_elsewhere(Some(self.own.address)).await;
        }
        self.check_serving_certificate().await;
        self.check_family(ctx).await?;
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &self.own.namespace);

        let verdict = self.failures.judge(self.readiness.check().await);
        self.note_tolerated(&verdict);
        let ready = verdict.result();
        let unproven = matches!(verdict, Verdict::Unproven { .. });
        if !unproven {
            self.note_readiness(&ready);
        }
        let cached = self.last_written.lock().ok().and_then(|mut c| c.take());
        if ready.is_ok()
            && !ctx.dry_run
            && let Some(cached) = cached
        {
            match self.renew(&api, &cached).await {
                Ok(report) => return Ok(report),
                // Changed or deleted by someone else since our write: read it and start over.
                Err(kube::Error::Api(status)) if status.code == 409 || status.code == 404 => {}
                Err(err) => return Err(err.into()),
            }
        }
        let existing = api.get_opt(&self.own.name()).await?;
        if let Some(existing) = &existing {
            self.check_ours(existing)?;
        }
        if unproven {
            // A live Lease an earlier process of this instance left is not withdrawn on a
            // failure before any probe passed; a stale one goes.
            if self.live(existing.as_ref()) {
                tracing::debug!(
                    "local apiserver not ready yet: not joining, and keeping the live membership \
                     Lease until a probe passes or readinessFailureThreshold fail"
                );
                return Ok(PassReport::default());
            }
            self.note_readiness(&ready);
        }

        // The Lease is this instance's own heartbeat, not cluster state that drifts: in dry-run
        // (and so in `check`, typically run from a workstation that is no member) what would be
        // written is logged, not reported, or every check would fail on the checker's own Lease.
        self.note_other_holder(existing.as_ref());
        match ready {
            Err(reason) => self.withdraw(ctx, &api, existing, &reason).await,
            Ok(()) => self.write_own(ctx, &api, existing).await,
        }
    }

    /// Renews this instance's Lease on top of `base` (this instance's last write of it, or the
    /// Lease as read), whose resourceVersion guards against anyone else's write since.
    async fn renew(&self, api: &Api<Lease>, base: &Lease) -> Result<PassReport, kube::Error> {
        let live = self.live(Some(base));
        let renewed = self.own.renewed(Some(base), Timestamp::now());
        let params = PostParams::default();
        self.written(api.replace(&self.own.name(), &params, &renewed).await?);
        let mut report = PassReport::default();
        if !live {
            report.push(self.expired_drift());
        }
        Ok(report)
    }

    /// Whether `lease` is this instance's, live by its own `renewTime`.
    fn live(&self, lease: Option<&Lease>) -> bool {
        (lease.and_then(|l| observe(l, self.own.ttl).ok()))
            .is_some_and(|m| m.expires > Timestamp::now() && m.address == self.own.address)
    }

    /// One event on this instance's membership Lease for each write of the pass, as every
    /// repair has; a refused event is logged, the write stands.
    async fn publish(&self, ctx: &PassContext, report: &PassReport) {
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("coordination.k8s.io/v1".to_owned()),
            kind: Some("Lease".to_owned()),
            namespace: Some(self.own.namespace.clone()),
            name: Some(self.own.name()),
            ..Default::default()
        };
        for drift in report.drift.iter().filter(|drift| drift.applied) {
            let (type_, reason) = match drift.kind {
                "member_lease_missing" => (EventType::Normal, "MemberLeaseCreated"),
                "member_lease_expired" => (EventType::Normal, "MemberLeaseRenewed"),
                _ => (EventType::Warning, "MemberLeaseWithdrawn"),
            };
            let _ = crate::events::emit(
                &ctx.client,
                &self.reporter,
                &reference,
                type_,
                reason,
                "Reconcile",
                &drift.message,
            )
            .await;
        }
    }

    fn expired_drift(&self) -> crate::Drift {
        drift(
            "member_lease_expired",
            self.own.object_ref(),
            Action::Update,
            "this instance's membership Lease had expired; renewed it",
            true,
        )
        .changed(
            format!("expired, for {}", self.own.address),
            format!("renewed for {}", self.own.address),
        )
    }

    /// Ours: it carries the member label, or (label removed by hand) our address annotation;
    /// renewing restores the label. Anything else with this name is someone else's object.
    fn check_ours(&self, existing: &Lease) -> Result<(), LoopError> {
        let labelled = existing
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(MEMBER_LABEL))
            == Some(&self.own.target.service_name);
        let our_address = existing
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(super::lease::ADDRESS_ANNOTATION))
            .and_then(|a| super::members::parse_ip(a))
            == Some(self.own.address);
        if labelled || our_address {
            return Ok(());
        }
        Err(LoopError::Invalid(format!(
            "{} exists but is not a membership Lease (no label {MEMBER_LABEL}={} and no {} \
             annotation for {}); refusing to overwrite it: delete or rename it",
            self.own.object_ref(),
            self.own.target.service_name,
            super::lease::ADDRESS_ANNOTATION,
            self.own.address
        )))
    }

    /// The local apiserver is not ready: this instance's Lease goes, unless another instance
    /// renews the same address.
    async fn withdraw(
        &self,
        ctx: &PassContext,
        api: &Api<Lease>,
        existing: Option<Lease>,
        reason: &super::probe::NotReady,
    ) -> Result<PassReport, LoopError> {
        let object = self.own.object_ref();
        let mut report = PassReport::default();
        self.metrics.ready.set(0);
        if let Some(holder) = self.shutdown.shared_with() {
            // A shared address: the other instance's apiserver still serves at it.
            tracing::debug!(lease = %object, %holder, %reason, "not withdrawing a shared address while another instance renews it");
            return Ok(report);
        }
        if ctx.dry_run {
            if existing.is_some() {
                tracing::info!(lease = %object, %reason, "dry-run: would delete this instance's membership Lease (apiserver not ready)");
            }
            return Ok(report);
        }
        if let Some(existing) = existing {
            let applied = delete_if_uid(api, &self.own.name(), existing.metadata.uid).await?;
            report.push(
                drift(
                    "member_lease_not_ready",
                    object,
                    Action::Delete,
                    format!(
                        "the local apiserver is not ready ({reason}); {} this instance's membership Lease",
                        if applied { "deleted" } else { "would delete" }
                    ),
                    applied,
                )
                .changed(
                    format!("listing {} (its apiserver not ready: {reason})", self.own.address),
                    "deleted",
                ),
            );
        }
        Ok(report)
    }

    /// The local apiserver is ready: this instance's Lease is created or renewed.
    async fn write_own(
        &self,
        ctx: &PassContext,
        api: &Api<Lease>,
        existing: Option<Lease>,
    ) -> Result<PassReport, LoopError> {
        let object = self.own.object_ref();
        let mut report = PassReport::default();
        if ctx.dry_run {
            if !self.live(existing.as_ref()) {
                tracing::info!(lease = %object, "dry-run: would write this instance's membership Lease (apiserver ready)");
            }
            return Ok(report);
        }
        if let Some(existing) = existing {
            return match self.renew(api, &existing).await {
                // Someone (kubectl, a restarted twin) wrote it since our read: renew on top of
                // their version once, instead of waiting a whole backoff.
                Err(err) if lease::is_conflict(&err) => {
                    Ok(self.renew(api, &api.get(&self.own.name()).await?).await?)
                }
                result => Ok(result?),
            };
        }
        let created = self.own.renewed(None, Timestamp::now());
        self.written(api.create(&PostParams::default(), &created).await?);
        tracing::info!(lease = %object, "created this instance's membership Lease");
        report.push(
            drift(
                "member_lease_missing",
                object,
                Action::Create,
                "the local apiserver is ready; created this instance's membership Lease",
                true,
            )
            .changed("absent", format!("listing {}", self.own.address)),
        );
        Ok(report)
    }

    /// One last renewal of this instance's Lease (compare-and-swap on the version read), within
    /// `bound`; a failure only means the Lease expires a little sooner, so it is logged, not
    /// returned.
    async fn renew_on_the_way_out(&self, api: &Api<Lease>, bound: Duration) {
        let work = async {
            let Some(existing) = api.get_opt(&self.own.name()).await? else {
                return Ok::<bool, kube::Error>(false);
            };
            let renewed = self.own.renewed(Some(&existing), Timestamp::now());
            api.replace(&self.own.name(), &PostParams::default(), &renewed)
                .await?;
            Ok(true)
        };
        match tokio::time::timeout(bound, work).await {
            Ok(Ok(true)) => {
                tracing::info!(lease = %self.own.object_ref(), "renewed this instance's membership Lease on the way out; it expires after its TTL unless this controller comes back")
            }
            Ok(Ok(false)) => {}
            Ok(Err(err)) => {
                tracing::warn!(lease = %self.own.object_ref(), error = %err, "could not renew the membership Lease on the way out; it expires after its TTL from the last renewal")
            }
            Err(_) => {
                tracing::warn!(lease = %self.own.object_ref(), "renewing the membership Lease on the way out timed out after {bound:?}")
            }
        }
    }

    /// This instance's Lease as just written: the next renewal goes on top of it.
    fn written(&self, lease: Lease) {
        if let Ok(mut cached) = self.last_written.lock() {
            *cached = Some(lease);
        }
        self.metrics.renewals.inc();
        self.metrics.ready.set(1);
    }
}

impl Reconciler for ApiserverLeaseLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.interval
    }

    fn needs_leadership(&self) -> bool {
        false
    }

    fn triggers(&self) -> Vec<Trigger> {
        vec![self.recheck.trigger()]
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(async move {
            let report = self.pass(ctx).await?;
            self.publish(ctx, &report).await;
            Ok(report)
        })
    }

    /// When the local apiserver is stopping too (see [`ShutdownGate`]), withdraw at once: delete
    /// the Lease so the leader drops this address on the Lease watch, bounded by 2 x interval like
    /// upstream's `RemoveEndpoints` on stop. Otherwise the Lease stays and expires on its TTL;
    /// when the apiserver answered ready to the shutdown probes (only this controller stops: a
    /// sidecar restarted or its static pod updated) it is renewed once more first, so the TTL
    /// counts from the stop rather than from the last periodic renewal, and a kubelet slow to
    /// start the new sidecar does not let the address drop out meanwhile.
    fn shutdown<'a>(&'a self, ctx: &'a PassContext) -> BoxFuture<'a, Result<(), LoopError>> {
        Box::pin(async move {
            self.metrics.ready.set(0);
            if ctx.dry_run {
                return Ok(());
            }
            let decision = self.shutdown.decide().await;
            let api: Api<Lease> = Api::namespaced(ctx.client.clone(), &self.own.namespace);
            let bound = self.interval * 2;
            if !decision.withdraw {
                if decision.apiserver_ready {
                    self.renew_on_the_way_out(&api, bound).await;
                }
                return Ok(());
            }
            let work = async {
                if let Some(existing) = api.get_opt(&self.own.name()).await? {
                    delete_if_uid(&api, &self.own.name(), existing.metadata.uid).await?;
                }
                Ok::<(), LoopError>(())
            };
            let what = format!("deleting {}", self.own.object_ref());
            within(bound, what, work).await?;
            tracing::info!(lease = %self.own.object_ref(), "deleted this instance's membership Lease");
            Ok(())
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn readiness_is_labelled_with_the_advertised_address() {
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = LeaseMetrics::register(&mut registry, "192.0.2.1".parse().unwrap());
        metrics.ready.set(1);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("apiserver_lease_apiserver_ready{address=\"192.0.2.1\"} 1\n"),
            "{text}"
        );
    }
}

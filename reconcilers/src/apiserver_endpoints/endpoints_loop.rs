//! `apiserver-endpoints`: writes Endpoints and EndpointSlices of the `kubernetes` Service from one
//! member set. Leader-only, except in `master-count` mode where, as upstream, every instance adds
//! itself.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, ObjectReference, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::lease::{MemberLease, Sightings, member_selector, membership};
use super::lease_trigger::lease_trigger;
use super::members::{EmptyStreak, MemberSet, MembershipChange, endpoint_ip_problem};
use super::modes::{master_count_members, note_static_outcomes, static_members};
use super::plan::{
    EndpointsTarget, SERVICE_NAME_LABEL, SliceWrite, desired_endpoints, desired_slices,
    endpoints_drift, listed_members, other_writers, plan_slices, repaired_endpoints, slice_members,
};
use super::probe::{FailureThreshold, ProbedServer, ReadinessProbe, Resolver, probed_elsewhere};
use super::shutdown::ShutdownGate;
use super::{EndpointsDeps, EndpointsMode, NAME, Section, StaticAddress};
use crate::alloc::IpFamily;
use crate::contract::{
    Action, Drift, LoopError, PassContext, PassReport, Reconciler, Trigger, WakeAt, drift,
    ignore_already_exists,
};
use crate::findings::ReportOnce;
use crate::section::Settings;
use crate::watch_cache::{WatchCache, watch_trigger};

pub use super::metrics::EndpointsMetrics;
use super::metrics::{ChangeLabel, KindLabel};

#[derive(Default)]
struct State {
    /// The member set as of the last pass (initialised from the Endpoints on the first one), to
    /// tell membership changes from hand edits.
    previous: Option<MemberSet>,
    /// `static` mode: last non-empty answer per name.
    last_good: BTreeMap<String, Vec<IpAddr>>,
    /// `static` mode: names whose last lookup failed (warned once per failure streak).
    failing: BTreeSet<String>,
    /// When this instance last ran a pass: a pass only runs on the leader, so this tells shutdown
    /// whether it is (recently) the writer.
    last_pass: Option<Instant>,
    /// Since when the passes have found no member, and whether that was warned about.
    empty: EmptyStreak,
    /// Members already warned about for advertising another port than the endpoints carry.
    warned_ports: BTreeSet<(IpAddr, i32)>,
    /// Members already warned about for an address the API server rejects.
    warned_invalid: BTreeSet<IpAddr>,
    /// Members already warned about for an address of the other family than the Service's.
    warned_family: BTreeSet<IpAddr>,
    /// Slices only: whether a leftover Endpoints object was reported.
    warned_endpoints_left: bool,
    /// Other writers already named, by object.
    named_writers: BTreeSet<(String, String)>,
    /// When each membership Lease was seen renewed (expiry on this clock).
    sightings: Sightings,
}

/// Writes the `kubernetes` Endpoints and EndpointSlices.
pub struct ApiserverEndpointsLoop {
    section: Section,
    /// The top-level settings: the mode, `apiserverCount`, this replica's identity and the
    /// leader-election Lease.
    settings: Settings,
    /// The Service the endpoints serve (from `settings`).
    target: EndpointsTarget,
    /// This instance's address: `advertiseAddress`, or the default route's.
    advertise_address: Option<IpAddr>,
    client: kube::Client,
    readiness: Arc<dyn ReadinessProbe>,
    /// `master-count` mode: failed probes in a row that take this instance out.
    failures: FailureThreshold,
    /// `master-count` mode: the server the readiness probe asks, checked once (then `None`) to
    /// be this instance's apiserver.
    probed: std::sync::Mutex<Option<ProbedServer>>,
    shutdown: Arc<ShutdownGate>,
    resolver: Arc<dyn Resolver>,
    /// Events get a fresh recorder each: kube's Recorder folds events with the same reason into
    /// one series and keeps the first note, which would hide who joined or what was repaired.
    reporter: Reporter,
    metrics: EndpointsMetrics,
    state: Mutex<State>,
    /// Earliest expiry among live membership Leases: a trigger fires then, so a dead member goes
    /// at TTL, not at TTL + interval.
    next_expiry: WakeAt,
    /// The objects each pass reads, kept by the watches that are also this loop's triggers.
    endpoints: WatchCache<Endpoints>,
    slices: WatchCache<EndpointSlice>,
    leases: WatchCache<MemberLease>,
    /// The Service the endpoints serve: its IP family is theirs.
    service: WatchCache<Service>,
    /// Unusable membership Leases, logged once each while they stay.
    lease_problems: ReportOnce<String>,
}

/// The member set of one pass, and what explains departures.
struct Computed {
    /// Members of the Service's family only.
    members: MemberSet,
    /// The Service's family: the endpoints' and their one slice's.
    family: IpFamily,
    /// Addresses whose Lease ran out (events say "expired" rather than "left").
    expired: BTreeSet<IpAddr>,
    /// Warnings to publish as events on the Endpoints.
    warnings: Vec<(String, String)>,
}

impl ApiserverEndpointsLoop {
    /// The loop of a validated `section` with validated `settings`.
    pub fn new(
        section: &Section,
        settings: &Settings,
        deps: EndpointsDeps,
        registry: &mut Registry,
    ) -> Self {
        let target = &Section::target(settings);
        let endpoints = WatchCache::new(
            Api::namespaced(deps.client.clone(), &target.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", target.service_name)),
            &settings.cache_budget,
        );
        let slices = WatchCache::new(
            Api::namespaced(deps.client.clone(), &target.namespace),
            watcher::Config::default().labels(&slice_selector(target)),
            &settings.cache_budget,
        );
        let leases = WatchCache::new(
            Api::namespaced(deps.client.clone(), &section.lease_namespace),
            watcher::Config::default().labels(&member_selector(&target.service_name)),
            &settings.cache_budget,
        );
        let service = WatchCache::new(
            Api::namespaced(deps.client.clone(), &target.namespace),
            watcher::Config::default().fields(&format!("metadata.name={}", target.service_name)),
            &settings.cache_budget,
        );
        Self {
            endpoints,
            slices,
            leases,
            service,
            lease_problems: ReportOnce::new(),
            section: section.clone(),
            settings: settings.clone(),
            target: target.clone(),
            advertise_address: section.advertise_address(settings),
            reporter: deps.reporter,
            client: deps.client,
            readiness: deps.readiness,
            failures: FailureThreshold::new(section.readiness_failure_threshold),
            probed: std::sync::Mutex::new(deps.probed.clone()),
            shutdown: deps.shutdown,
            resolver: deps.resolver,
            metrics: EndpointsMetrics::register(registry),
            state: Mutex::new(State::default()),
            next_expiry: WakeAt::default(),
        }
    }

    pub fn metrics(&self) -> &EndpointsMetrics {
        &self.metrics
    }

    fn target(&self) -> &EndpointsTarget {
        &self.target
    }

    fn endpoints_api(&self, ctx: &PassContext) -> Api<Endpoints> {
        Api::namespaced(ctx.client.clone(), &self.target().namespace)
    }

    fn slices_api(&self, ctx: &PassContext) -> Api<EndpointSlice> {
        Api::namespaced(ctx.client.clone(), &self.target().namespace)
    }

    async fn compute(
        &self,
        ctx: &PassContext,
        state: &mut State,
        listed: &MemberSet,
        exclude_own: bool,
    ) -> Result<Computed, LoopError> {
        let mut computed = Computed {
            members: MemberSet::new(),
            family: IpFamily::V4,
            expired: BTreeSet::new(),
            warnings: Vec::new(),
        };
        match self.settings.endpoint_mode {
            EndpointsMode::Lease => self.lease_mode_members(ctx, state, &mut computed).await?,
            EndpointsMode::Static => self.static_mode_members(state, &mut computed).await,
            EndpointsMode::MasterCount => {
                computed.members = self.master_count_mode_members(listed, exclude_own).await;
            }
            EndpointsMode::None => {}
        }
        if exclude_own && let Some(own) = self.advertise_address {
            computed.members.remove(&own);
        }
        self.leave_out_unusable(ctx, state, &mut computed).await?;
        Ok(computed)
    }

    /// `lease` mode: the members whose Lease is live, and when the next one runs out.
    async fn lease_mode_members(
        &self,
        ctx: &PassContext,
        state: &mut State,
        computed: &mut Computed,
    ) -> Result<(), LoopError> {
        let api: Api<MemberLease> =
            Api::namespaced(ctx.client.clone(), &self.section.lease_namespace);
        // A failed list is an error, never an empty membership.
        let leases = self.leases.list(&api).await?;
        let now = Timestamp::now();
        let judged = membership(
            leases.iter().map(|lease| &lease.0),
            now,
            self.section.lease_ttl,
            &mut state.sightings,
        );
        let problems = judged.problems.iter().map(ToString::to_string);
        for problem in self.lease_problems.update(problems) {
            tracing::warn!(%problem, "ignoring a membership Lease");
        }
        // One port for all members (the Endpoints have one subset): a member whose
        // sidecar says otherwise is misconfigured, and clients would miss it.
        for member in &judged.live {
            if let Some(port) = member.port.filter(|p| *p != self.target().port)
                && state.warned_ports.insert((member.address, port))
            {
                tracing::warn!(
                    member = %member.address,
                    advertised_port = port,
                    endpoints_port = self.target().port,
                    "a member advertises another secure port than the endpoints carry; \
                     give every instance the same securePort"
                );
            }
        }
        computed.expired = judged.expired.iter().map(|m| m.address).collect();
        let next = judged.live.iter().map(|m| m.expires).min();
        computed.members = judged.members;
        let wake = next.and_then(|t| {
            let left = now.duration_until(t);
            Duration::try_from(left)
                .ok()
                .map(|d| Instant::now() + d + Duration::from_millis(50))
        });
        self.next_expiry.set(wake);
        Ok(())
    }

    /// `static` mode: the configured addresses, names resolved (a name that stops resolving
    /// keeps its last good addresses).
    async fn static_mode_members(&self, state: &mut State, computed: &mut Computed) {
        let entries = self.section.static_entries();
        // All names at once, each bounded, so one slow resolver cannot stall the pass.
        let lookups = entries.iter().filter_map(|entry| match entry {
            StaticAddress::Name(name) => Some(async move {
                let answer =
                    tokio::time::timeout(self.section.interval, self.resolver.resolve(name))
                        .await
                        .map_err(|_| format!("lookup timed out after {:?}", self.section.interval))
                        .and_then(|r| r.map_err(|e| e.to_string()));
                (name.clone(), answer)
            }),
            StaticAddress::Ip(_) => None,
        });
        let answers: BTreeMap<_, _> = futures::future::join_all(lookups)
            .await
            .into_iter()
            .collect();
        let (members, outcomes) = static_members(&entries, &answers, &mut state.last_good);
        computed
            .warnings
            .extend(note_static_outcomes(outcomes, &mut state.failing));
        computed.members = members;
    }

    /// `master-count` mode: upstream's rule over the listed members and this instance's
    /// readiness.
    async fn master_count_mode_members(&self, listed: &MemberSet, exclude_own: bool) -> MemberSet {
        let probed = self.probed.lock().ok().and_then(|mut p| p.take());
        if let Some(probed) = probed
            && let Some(host) = probed.host().await
            && let Some(why) = probed_elsewhere(&host, self.advertise_address)
        {
            tracing::warn!("{why}");
        }
        let listed = listed.clone();
        let own = self.advertise_address;
        // Shutting down counts as not ready.
        let ready = !exclude_own
            && self
                .failures
                .judge(self.readiness.check().await)
                .result()
                .is_ok();
        match (own, ready) {
            (Some(own), true) => master_count_members(
                &listed,
                own,
                usize::try_from(self.settings.apiserver_count).unwrap_or(usize::MAX),
            ),
            (Some(own), false) => {
                tracing::debug!(
                    "local apiserver not ready or shutting down; not adding this instance"
                );
                let mut without = listed;
                without.remove(&own);
                without
            }
            (None, _) => listed,
        }
    }

    /// Leaves out the members of the other family than the Service's and the addresses the API
    /// server would reject, each warned about once.
    async fn leave_out_unusable(
        &self,
        ctx: &PassContext,
        state: &mut State,
        computed: &mut Computed,
    ) -> Result<(), LoopError> {
        // One family, the Service's, as upstream (`pkg/controlplane/reconcilers` lists the
        // addresses of the apiservers, which share the Service's family): clients of an IPv6
        // Service cannot use IPv4 endpoints. A member of the other family is a misconfigured
        // sidecar, left out and reported once.
        let (family, source) = match self.service_family(ctx).await? {
            Some(known) => known,
            None => (
                self.target().primary_family(&computed.members),
                "its members (no serviceClusterIPRange, and the Service does not exist yet)"
                    .to_owned(),
            ),
        };
        computed.family = family;
        let other: Vec<IpAddr> = computed
            .members
            .iter()
            .filter(|ip| IpFamily::of(**ip) != family)
            .copied()
            .collect();
        for ip in other {
            computed.members.remove(&ip);
            if state.warned_family.insert(ip) {
                let why = format!(
                    "left out {ip}: an {} address, but the {} Service is {} (from {source}); set \
                     that apiserver's advertiseAddress (--advertise-address) to its {} address",
                    IpFamily::of(ip).as_str(),
                    self.target().service_name,
                    family.as_str(),
                    family.as_str()
                );
                tracing::warn!(member = %ip, "{why}");
                computed
                    .warnings
                    .push(("MemberWrongFamily".to_owned(), why));
            }
        }
        state.warned_family.retain(|ip| IpFamily::of(*ip) != family);
        let rejected: Vec<(IpAddr, &'static str)> = computed
            .members
            .iter()
            .filter_map(|ip| endpoint_ip_problem(ip).map(|why| (*ip, why)))
            .collect();
        for (ip, why) in rejected {
            computed.members.remove(&ip);
            if state.warned_invalid.insert(ip) {
                tracing::warn!(member = %ip, reason = why, "leaving out a member the API server would reject as an endpoint address");
                computed.warnings.push((
                    "InvalidMemberAddress".to_owned(),
                    format!("left out {ip}: {why}"),
                ));
            }
        }
        Ok(())
    }

    /// Who the endpoints list now: the Endpoints' addresses, or with slices only, the slices'.
    async fn listed(
        &self,
        ctx: &PassContext,
        endpoints: Option<&Endpoints>,
    ) -> Result<MemberSet, LoopError> {
        if self.section.write_endpoints {
            return Ok(endpoints.map(listed_members).unwrap_or_default());
        }
        Ok(slice_members(
            &self.slices.list(&self.slices_api(ctx)).await?,
        ))
    }

    /// The `kubernetes` Service's IP family and where it was learnt: the primary service range
    /// when one is configured, else the Service's own (`ipFamilies`, or its clusterIP); `None`
    /// while neither is known.
    async fn service_family(
        &self,
        ctx: &PassContext,
    ) -> Result<Option<(IpFamily, String)>, LoopError> {
        if let Some(family) = self.target().primary_family {
            return Ok(Some((family, "serviceClusterIPRange".to_owned())));
        }
        let api: Api<Service> = Api::namespaced(ctx.client.clone(), &self.target().namespace);
        let Some(service) = self.service.get(&api, &self.target().service_name).await? else {
            return Ok(None);
        };
        let spec = service.spec.unwrap_or_default();
        let by_families = spec
            .ip_families
            .as_ref()
            .and_then(|families| families.first())
            .and_then(|family| match family.as_str() {
                "IPv4" => Some(IpFamily::V4),
                "IPv6" => Some(IpFamily::V6),
                _ => None,
            });
        let by_ip = spec
            .cluster_ip
            .as_deref()
            .and_then(super::members::parse_ip)
            .map(IpFamily::of);
        Ok(by_families.or(by_ip).map(|family| {
            let ip = spec.cluster_ip.unwrap_or_default();
            (family, format!("its clusterIP {ip}"))
        }))
    }

    async fn publish(
        &self,
        reference: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(crate::sanitize::sanitize(&note).into()),
            action: "Reconcile".to_owned(),
            secondary: None,
        };
        if let Err(err) = Recorder::new(self.client.clone(), self.reporter.clone())
            .publish(&event, reference)
            .await
        {
            tracing::warn!(error = %err, reason, "could not publish event on the kubernetes Endpoints");
        }
    }

    /// Bring Endpoints and slices to `members`. Returns the Endpoints as written or found (for
    /// event references) and the drift.
    async fn write_all(
        &self,
        ctx: &PassContext,
        members: &MemberSet,
        family: IpFamily,
        existing: Option<Endpoints>,
        report: &mut PassReport,
    ) -> Result<Option<Endpoints>, LoopError> {
        let target = &EndpointsTarget {
            primary_family: Some(family),
            ..self.target().clone()
        };
        let api = self.endpoints_api(ctx);
        let object = target.endpoints_ref();
        let found = if self.section.write_endpoints {
            endpoints_drift(target, members, existing.as_ref())
        } else {
            Vec::new()
        };
        let mut current = existing.clone();
        if !found.is_empty() {
            let applied = !ctx.dry_run;
            if applied {
                current = match &existing {
                    None => ignore_already_exists(
                        api.create(&PostParams::default(), &desired_endpoints(target, members))
                            .await,
                    )?,
                    Some(existing) => Some(
                        api.replace(
                            &target.service_name,
                            &PostParams::default(),
                            &repaired_endpoints(target, members, existing),
                        )
                        .await?,
                    ),
                };
            }
            for d in &found {
                report.push(
                    drift(
                        d.kind(),
                        object.clone(),
                        if existing.is_none() {
                            Action::Create
                        } else {
                            Action::Update
                        },
                        format!(
                            "{}; {}",
                            d.describe(target),
                            if applied { "repaired" } else { "would repair" }
                        ),
                        applied,
                    )
                    .changed(
                        d.describe(target),
                        format!("members {members}, port {}", target.port),
                    ),
                );
            }
        }

        let slices = self.slices_api(ctx);
        let mut existing_slices = self.slices.list(&slices).await?;
        // A desired slice whose label was removed by hand is invisible to the label selector:
        // one that seems missing is looked up by name before it is created.
        for want in desired_slices(target, members) {
            let name = want.metadata.name.unwrap_or_default();
            if !existing_slices
                .iter()
                .any(|s| s.metadata.name.as_deref() == Some(name.as_str()))
                && let Some(slice) = slices.get_opt(&name).await?
            {
                existing_slices.push(slice);
            }
        }
        for change in plan_slices(target, members, &existing_slices) {
            let slice_ref = target.slice_ref(&change.name);
            let applied = !ctx.dry_run;
            let action = match &change.write {
                SliceWrite::Create(_) => Action::Create,
                SliceWrite::Update(_) | SliceWrite::Recreate(_) => Action::Update,
                SliceWrite::Delete { .. } => Action::Delete,
            };
            if applied {
                let uid = |name: &str| {
                    existing_slices
                        .iter()
                        .find(|s| s.metadata.name.as_deref() == Some(name))
                        .and_then(|s| s.metadata.uid.clone())
                };
                let delete = |name: String| {
                    let params = DeleteParams::default().preconditions(Preconditions {
                        uid: uid(&name),
                        resource_version: None,
                    });
                    let slices = slices.clone();
                    async move {
                        match slices.delete(&name, &params).await {
                            Ok(_) => Ok(()),
                            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                            Err(err) => Err(err),
                        }
                    }
                };
                match &change.write {
                    SliceWrite::Create(slice) => {
                        ignore_already_exists(slices.create(&PostParams::default(), slice).await)?;
                    }
                    SliceWrite::Update(slice) => {
                        slices
                            .replace(&change.name, &PostParams::default(), slice)
                            .await?;
                    }
                    SliceWrite::Recreate(slice) => {
                        delete(change.name.clone()).await?;
                        ignore_already_exists(slices.create(&PostParams::default(), slice).await)?;
                    }
                    SliceWrite::Delete { name } => delete(name.clone()).await?,
                }
            }
            let became = match &change.write {
                SliceWrite::Delete { .. } => "deleted".to_owned(),
                _ => format!("members {members}, port {}", target.port),
            };
            for (kind, message) in change.drift {
                report.push(
                    drift(
                        kind,
                        slice_ref.clone(),
                        action,
                        format!(
                            "{message}; {}",
                            if applied { "repaired" } else { "would repair" }
                        ),
                        applied,
                    )
                    .changed(message, became.clone()),
                );
            }
        }
        Ok(current)
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let mut state = self.state.lock().await;
        state.last_pass = Some(Instant::now());
        let mut report = PassReport::default();
        let target = self.target().clone();
        let existing = self
            .endpoints
            .get(&self.endpoints_api(ctx), &target.service_name)
            .await?;
        if !self.section.write_endpoints && existing.is_some() && !state.warned_endpoints_left {
            state.warned_endpoints_left = true;
            tracing::warn!(
                endpoints = %target.endpoints_ref(),
                "writeEndpoints is false: this Endpoints object is no longer kept up to date; \
                 delete it once nothing reads it (kubectl -n {} delete endpoints {})",
                target.namespace,
                target.service_name
            );
        }
        let existing = existing.filter(|_| self.section.write_endpoints);
        let listed = self.listed(ctx, existing.as_ref()).await?;
        let computed = self.compute(ctx, &mut state, &listed, false).await?;
        let members = computed.members;
        let previous = state.previous.get_or_insert(listed).clone();

        if members.is_empty() {
            // Upstream refuses too (`doReconcile` in `pkg/controlplane/reconcilers/lease.go`): an
            // empty list would cut every in-cluster client off. Only the last member's own shutdown
            // may empty it.
            if state.empty.observe(Instant::now(), self.section.lease_ttl) {
                tracing::warn!(
                    endpoints = %target.endpoints_ref(),
                    waited = ?self.section.lease_ttl,
                    "no live apiserver members for a whole lease period; refusing to erase all \
                     endpoints of the kubernetes Service"
                );
            }
            let message = if previous.is_empty() {
                "no live apiserver members yet; nothing to write until one renews its Lease"
            } else {
                "no live apiserver members; refusing to erase all endpoints (kept as they are)"
            };
            report.push(drift(
                "no_members",
                target.endpoints_ref(),
                Action::Report,
                message,
                false,
            ));
            return Ok(report);
        }
        state.empty = EmptyStreak::default();

        // Who last wrote each object before this pass, when not this controller: named if this
        // pass has to repair it (two writers of one object fight).
        let writers = if self.section.name_conflicting_writers {
            let slices = self.slices.list(&self.slices_api(ctx)).await?;
            other_writers(&target, existing.as_ref(), &slices)
        } else {
            BTreeMap::new()
        };
        let written = self
            .write_all(ctx, &members, computed.family, existing, &mut report)
            .await?;
        if ctx.dry_run {
            return Ok(report);
        }
        self.metrics.set_members(&members);
        let change = previous.changes_to(&members);
        state.previous = Some(members.clone());
        drop(state);

        let reference = self.reference(written);
        for (reason, note) in computed.warnings {
            self.publish(&reference, EventType::Warning, &reason, note)
                .await;
        }
        self.announce(&reference, &change, &computed.expired).await;
        self.report_repairs(&reference, &report, &change, &writers)
            .await;
        Ok(report)
    }

    /// What events are about: the Endpoints as written or found, else (slices only, or none
    /// found) the object this loop keeps.
    fn reference(&self, written: Option<Endpoints>) -> ObjectReference {
        let target = self.target();
        let (api_version, kind) = if self.section.write_endpoints {
            ("v1", "Endpoints")
        } else {
            ("discovery.k8s.io/v1", "EndpointSlice")
        };
        written
            .map(|e| e.object_ref(&()))
            .unwrap_or_else(|| ObjectReference {
                api_version: Some(api_version.to_owned()),
                kind: Some(kind.to_owned()),
                name: Some(target.service_name.clone()),
                namespace: Some(target.namespace.clone()),
                ..ObjectReference::default()
            })
    }

    /// Counts and announces the members that joined, expired or left, one event each (or one
    /// for many).
    async fn announce(
        &self,
        reference: &ObjectReference,
        change: &MembershipChange,
        expired_leases: &BTreeSet<IpAddr>,
    ) {
        let (expired, left): (Vec<IpAddr>, Vec<IpAddr>) = change
            .left
            .iter()
            .partition(|ip| expired_leases.contains(*ip));
        let groups = [
            (
                "joined",
                "MemberJoined",
                "joined the endpoints",
                change.joined.clone(),
            ),
            (
                "expired",
                "MemberExpired",
                "was removed: its membership Lease expired",
                expired,
            ),
            ("left", "MemberLeft", "left the endpoints", left),
        ];
        for (label, reason, what, members) in groups {
            if members.is_empty() {
                continue;
            }
            self.metrics
                .changes
                .get_or_create(&ChangeLabel {
                    change: label.into(),
                })
                .inc_by(members.len() as u64);
            // One event per member, unless a pass changes many at once (a corrupted Endpoints
            // replaced, a first pass over a stale list): then one event says how many.
            if members.len() <= MEMBER_EVENTS_PER_PASS {
                for ip in &members {
                    tracing::info!(member = %ip, change = label, "apiserver {what}");
                    self.publish(
                        reference,
                        EventType::Normal,
                        reason,
                        format!("apiserver {ip} {what}"),
                    )
                    .await;
                }
            } else {
                let shown: Vec<String> = members
                    .iter()
                    .take(MEMBER_EVENTS_PER_PASS)
                    .map(ToString::to_string)
                    .collect();
                let note = format!(
                    "{} apiservers {what}: {} and {} more",
                    members.len(),
                    shown.join(", "),
                    members.len() - shown.len()
                );
                tracing::info!(change = label, count = members.len(), "{note}");
                self.publish(reference, EventType::Normal, reason, note)
                    .await;
            }
        }
    }

    /// Counts the repairs this pass made (writes no membership change explains), says them in one
    /// event, and names, once each, another writer of an object it had to repair.
    async fn report_repairs(
        &self,
        reference: &ObjectReference,
        report: &PassReport,
        change: &MembershipChange,
        writers: &BTreeMap<String, String>,
    ) {
        // Writes explained by a membership change are not repairs.
        let membership_kinds = [
            "endpoints_addresses",
            "endpointslice_endpoints",
            "endpointslice_missing",
            "endpointslice_stray",
            "endpointslice_address_type",
            "endpoints_subsets",
            "endpoints_missing",
        ];
        let repairs: Vec<&Drift> = report
            .drift
            .iter()
            .filter(|d| d.applied)
            .filter(|d| change.is_empty() || !membership_kinds.contains(&d.kind))
            .collect();
        if !repairs.is_empty() {
            for d in &repairs {
                self.metrics
                    .repairs
                    .get_or_create(&KindLabel {
                        kind: d.kind.to_owned(),
                    })
                    .inc();
            }
            let note = repairs
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("; ");
            tracing::warn!(repairs = %note, "repaired the kubernetes endpoints");
            let mut note = note;
            note.truncate(1000);
            self.publish(reference, EventType::Normal, "EndpointsRepaired", note)
                .await;
            let named: Vec<(String, String)> = repairs
                .iter()
                .filter_map(|d| {
                    let manager = writers.get(&d.object)?;
                    Some((d.object.clone(), manager.clone()))
                })
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            for (object, manager) in named {
                if !self
                    .state
                    .lock()
                    .await
                    .named_writers
                    .insert((object.clone(), manager.clone()))
                {
                    continue;
                }
                let why = format!(
                    "{object} was last written by {manager:?} (its field manager), not by this \
                     controller: two writers keep the kubernetes endpoints and undo each other. \
                     If it is kube-apiserver, start it with --endpoint-reconciler-type=none; \
                     otherwise stop the other writer or this loop"
                );
                tracing::warn!(%object, %manager, "{why}");
                self.metrics.conflicting_writers.inc();
                self.publish(reference, EventType::Warning, "ConflictingWriter", why)
                    .await;
            }
        }
    }

    /// Whether this instance is the writer and its address is to be withdrawn: the decision of
    /// the [`ShutdownGate`] is asked only of a writer, so a follower's hook costs no probing here.
    async fn withdraws(&self, ctx: &PassContext) -> bool {
        let recently_leading = self
            .state
            .lock()
            .await
            .last_pass
            .is_some_and(|at| at.elapsed() < self.section.interval * 2);
        let writer = match self.settings.endpoint_mode {
            EndpointsMode::Lease => {
                recently_leading
                    && tokio::time::timeout(self.section.interval * 2, self.holds_leadership(ctx))
                        .await
                        .unwrap_or(false)
            }
            EndpointsMode::MasterCount => true,
            EndpointsMode::Static | EndpointsMode::None => false,
        };
        writer && !ctx.dry_run && self.shutdown.decide().await.withdraw
    }

    /// Take this instance's address out at once (the caller checked [`Self::withdraws`]). An
    /// empty result is written: this is the one case where upstream empties the endpoints too
    /// (the last member leaving).
    async fn withdraw(&self, ctx: &PassContext) -> Result<(), LoopError> {
        let Some(own) = self.advertise_address else {
            return Ok(());
        };
        let mut state = self.state.lock().await;
        let existing = if self.section.write_endpoints {
            self.endpoints_api(ctx)
                .get_opt(&self.target().service_name)
                .await?
        } else {
            None
        };
        let listed = self.listed(ctx, existing.as_ref()).await?;
        if !listed.contains(&own) {
            return Ok(());
        }
        let computed = self.compute(ctx, &mut state, &listed, true).await?;
        let mut report = PassReport::default();
        self.write_all(
            ctx,
            &computed.members,
            computed.family,
            existing,
            &mut report,
        )
        .await?;
        self.metrics.set_members(&computed.members);
        state.previous = Some(computed.members.clone());
        tracing::info!(member = %own, remaining = %computed.members, "withdrew this instance from the kubernetes endpoints");
        Ok(())
    }

    /// Whether the leader-election Lease names this instance (true without leader election).
    /// Read live: the runner may have handed leadership over since our last pass.
    async fn holds_leadership(&self, ctx: &PassContext) -> bool {
        let Some((namespace, name)) = &self.settings.leader_lease else {
            return true;
        };
        let api: Api<Lease> = Api::namespaced(ctx.client.clone(), namespace);
        match api.get_opt(name).await {
            Ok(Some(lease)) => {
                lease.spec.and_then(|s| s.holder_identity).as_deref()
                    == Some(self.settings.identity.as_str())
            }
            Ok(None) => false,
            Err(err) => {
                tracing::warn!(error = %err, "cannot read the leader Lease at shutdown; leaving the withdrawal to the next leader");
                false
            }
        }
    }
}

impl Reconciler for ApiserverEndpointsLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.section.interval
    }

    fn needs_leadership(&self) -> bool {
        self.settings.endpoint_mode != EndpointsMode::MasterCount
    }

    fn triggers(&self) -> Vec<Trigger> {
        let mut triggers: Vec<Trigger> = [
            self.endpoints.take_events().map(watch_trigger),
            self.slices.take_events().map(watch_trigger),
            self.service.take_events().map(watch_trigger),
        ]
        .into_iter()
        .flatten()
        .collect();
        if self.settings.endpoint_mode == EndpointsMode::Lease {
            triggers.extend(
                self.leases
                    .take_events()
                    .map(|events| lease_trigger(events, self.section.lease_ttl)),
            );
            triggers.push(self.next_expiry.trigger());
        }
        triggers
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }

    fn shutdown<'a>(&'a self, ctx: &'a PassContext) -> BoxFuture<'a, Result<(), LoopError>> {
        Box::pin(async move {
            // The probing has its own bound (the window plus a probe timeout); the withdrawal
            // gets the same bound as upstream's `RemoveEndpoints`.
            if !self.withdraws(ctx).await {
                return Ok(());
            }
            let bound = self.section.interval * 2;
            match tokio::time::timeout(bound, self.withdraw(ctx)).await {
                Ok(result) => result,
                Err(_) => Err(LoopError::Other(format!(
                    "removing this instance from the kubernetes endpoints timed out after {bound:?}"
                ))),
            }
        })
    }
}

/// Above this many members changing in one pass (per kind of change), one event says how many
/// instead of one event each.
const MEMBER_EVENTS_PER_PASS: usize = 5;

/// The label selector of the `kubernetes` Service's EndpointSlices.
fn slice_selector(target: &EndpointsTarget) -> String {
    format!("{SERVICE_NAME_LABEL}={}", target.service_name)
}

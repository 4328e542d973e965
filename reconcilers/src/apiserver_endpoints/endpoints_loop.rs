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
use kube::api::Api;
use kube::runtime::events::Reporter;
use kube::runtime::watcher;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::lease::{MEMBER_LABEL, lease_trigger};
use super::objects::{EndpointsTarget, SERVICE_NAME_LABEL, service_family};
use super::plan::{Finding, Memory, Plan, Snapshot, Sources, listed, plan};
use super::probe::{FailureThreshold, ProbedServer, ReadinessProbe, Resolver, Verdict};
use super::shutdown::ShutdownGate;
use super::{EndpointsDeps, EndpointsMode, NAME, Section, StaticAddress, within};
use crate::alloc::IpFamily;
use crate::contract::{LoopError, PassContext, PassReport, Reconciler, Trigger, WakeAt};
use crate::findings::ReportOnce;
use crate::metrics::MetricRegistry;
use crate::section::Settings;
use crate::watch_cache::{Lenient, WatchCache, watch_trigger};

pub use super::metrics::EndpointsMetrics;

#[derive(Default)]
struct State {
    /// What the plan carries from one pass to the next.
    memory: Memory,
    /// When this instance last ran a pass: a pass only runs on the leader, so this tells shutdown
    /// whether it is (recently) the writer.
    last_pass: Option<Instant>,
}

/// Writes the `kubernetes` Endpoints and EndpointSlices.
pub struct ApiserverEndpointsLoop {
    section: Section,
    /// The Service the endpoints serve (from `settings`).
    pub(super) target: EndpointsTarget,
    /// This instance's address: `advertiseAddress`, or the default route's.
    advertise_address: Option<IpAddr>,
    pub(super) client: kube::Client,
    readiness: Arc<dyn ReadinessProbe>,
    /// `master-count` mode: failed probes in a row that take this instance out.
    failures: FailureThreshold,
    /// `master-count` mode: the server the readiness probe asks, checked once to be this
    /// instance's apiserver.
    probed: Option<ProbedServer>,
    shutdown: Arc<ShutdownGate>,
    resolver: Arc<dyn Resolver>,
    /// Who its events say they come from ([`crate::events::emit`] says why each gets a Recorder
    /// of its own).
    pub(super) reporter: Reporter,
    pub(super) metrics: EndpointsMetrics,
    state: Mutex<State>,
    /// Earliest expiry among live membership Leases: a trigger fires then, so a dead member goes
    /// at TTL, not at TTL + interval.
    next_expiry: WakeAt,
    /// The objects each pass reads, kept by the watches that are also this loop's triggers.
    endpoints: WatchCache<Lenient<Endpoints>>,
    slices: WatchCache<Lenient<EndpointSlice>>,
    leases: WatchCache<Lenient<Lease>>,
    /// The Service the endpoints serve: its IP family is theirs.
    service: WatchCache<Lenient<Service>>,
    /// Unusable membership Leases, logged once each while they stay.
    lease_problems: ReportOnce<String>,
    /// Other writers already named, by object.
    pub(super) named_writers: std::sync::Mutex<BTreeSet<(String, String)>>,
}

impl ApiserverEndpointsLoop {
    /// The loop of a validated `section` with validated `settings`.
    pub fn new(
        section: &Section,
        settings: &Settings,
        deps: EndpointsDeps,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        let target = &Section::target(settings, &deps.service);
        let (budget, here) = (&deps.budget, &target.namespace);
        let client = &deps.client;
        let named =
            || watcher::Config::default().fields(&format!("metadata.name={}", target.service_name));
        let slices = format!("{SERVICE_NAME_LABEL}={}", target.service_name);
        let leases = format!("{MEMBER_LABEL}={}", target.service_name);
        Self {
            endpoints: WatchCache::of(&Api::namespaced(client.clone(), here), named(), budget),
            slices: WatchCache::of(
                &Api::namespaced(client.clone(), here),
                watcher::Config::default().labels(&slices),
                budget,
            ),
            leases: WatchCache::of(
                &Api::namespaced(client.clone(), &section.lease_namespace),
                watcher::Config::default().labels(&leases),
                budget,
            ),
            service: WatchCache::of(&Api::namespaced(client.clone(), here), named(), budget),
            named_writers: std::sync::Mutex::default(),
            lease_problems: ReportOnce::new(),
            section: section.clone(),
            target: target.clone(),
            advertise_address: section.advertise_address(settings),
            reporter: deps.reporter,
            client: deps.client,
            readiness: deps.readiness,
            failures: FailureThreshold::new(section.readiness_failure_threshold),
            probed: deps.probed,
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

    /// What a pass reads: the Endpoints (from the cache, or `live` from the API), the slices,
    /// where the members come from (the membership Leases, the `static` names' answers, this
    /// instance's readiness) and the Service's family.
    async fn read(&self, ctx: &PassContext, live: bool) -> Result<Snapshot, LoopError> {
        let target = &self.target;
        let endpoints: Api<Endpoints> = Api::namespaced(ctx.client.clone(), &target.namespace);
        let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), &target.namespace);
        let found = match (live, self.section.write_endpoints) {
            (true, false) => None,
            (true, true) => endpoints.get_opt(&target.service_name).await?,
            (false, _) => self.endpoints.get(&endpoints, &target.service_name).await?,
        };
        let listed = self.slices.list(&slices).await?;
        // A slice whose label was removed by hand is invisible to the label selector: the one
        // the plan wants, named like the Service, is looked up by name when the list lacks it.
        let name = Some(target.service_name.as_str());
        let unlabelled = match listed.iter().any(|s| s.metadata.name.as_deref() == name) {
            true => None,
            false => slices.get_opt(&target.service_name).await?,
        };
        let sources = match self.section.endpoint_mode() {
            EndpointsMode::Lease => {
                let api = Api::namespaced(ctx.client.clone(), &self.section.lease_namespace);
                // A failed list is an error, never an empty membership.
                Sources::Leases(self.leases.list(&api).await?)
            }
            EndpointsMode::Static => Sources::Static(self.resolve_static().await),
            EndpointsMode::MasterCount => Sources::MasterCount {
                ready: self.ready(live).await,
            },
            EndpointsMode::None => Sources::None,
        };
        Ok(Snapshot {
            endpoints_left: !self.section.write_endpoints && found.is_some(),
            endpoints: found.filter(|_| self.section.write_endpoints),
            slices: listed,
            unlabelled,
            sources,
            service_family: self.service_family(ctx).await?,
            own: self.advertise_address,
            withdrawing: live,
        })
    }

    /// `static` mode: each name's answer, all names at once, each bounded, so one slow resolver
    /// cannot stall the pass.
    async fn resolve_static(&self) -> BTreeMap<String, Result<Vec<IpAddr>, String>> {
        let entries = self.section.static_entries();
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
        futures::future::join_all(lookups)
            .await
            .into_iter()
            .collect()
    }

    /// `master-count` mode: whether the local apiserver counts as ready (shutting down counts
    /// as not ready); `None` while it is [`Verdict::Unproven`].
    async fn ready(&self, withdrawing: bool) -> Option<bool> {
        if let Some(probed) = &self.probed {
            probed.warn_if_elsewhere(self.advertise_address).await;
        }
        if withdrawing {
            return Some(false);
        }
        let ready = match self.failures.judge(self.readiness.check().await) {
            Verdict::Unproven { .. } => None,
            verdict => Some(verdict.result().is_ok()),
        };
        if ready != Some(true) && self.advertise_address.is_some() {
            tracing::debug!("local apiserver not ready or shutting down; not adding this instance");
        }
        ready
    }

    /// The `kubernetes` Service's IP family and where it was learnt: the primary service range
    /// when one is configured, else the Service's own (`ipFamilies`, or its clusterIP); `None`
    /// while neither is known.
    async fn service_family(
        &self,
        ctx: &PassContext,
    ) -> Result<Option<(IpFamily, String)>, LoopError> {
        if let Some(family) = self.target.primary_family {
            return Ok(Some((family, "serviceClusterIPRange".to_owned())));
        }
        let api: Api<Service> = Api::namespaced(ctx.client.clone(), &self.target.namespace);
        let service = self.service.get(&api, &self.target.service_name).await?;
        Ok(service.as_ref().and_then(service_family))
    }

    /// What the plan found, said: its logs, the unusable Leases once each, and when the next
    /// membership Lease runs out (a trigger fires then).
    fn say(&self, plan: &Plan) {
        for problem in self
            .lease_problems
            .update(plan.lease_problems.iter().cloned())
        {
            tracing::warn!(%problem, "ignoring a membership Lease");
        }
        for finding in &plan.findings {
            let note = finding.note(&self.target);
            match finding {
                Finding::StaticResolves { .. } => tracing::info!("{note}"),
                _ => tracing::warn!("{note}"),
            }
        }
        if self.section.endpoint_mode() == EndpointsMode::Lease {
            let wake = plan.next_expiry.map(|t| t + Duration::from_millis(50));
            self.next_expiry.set(wake);
        }
    }

    /// A pass: read, plan, write; then, unless a dry run, the members' metric and the events.
    /// `withdrawing`: a graceful stop taking this instance's address out at once (the caller
    /// checked [`Self::withdraws`]), read live, written even when that leaves no member (the one
    /// case where upstream empties the endpoints too), and only while it is listed.
    async fn pass(&self, ctx: &PassContext, withdrawing: bool) -> Result<PassReport, LoopError> {
        let mut state = self.state.lock().await;
        if !withdrawing {
            // Leading again after a pause (another replica led): the members are judged against
            // what is listed now, not what this replica last wrote, or whatever changed meanwhile
            // would be announced a second time.
            if (state.last_pass).is_none_or(|at| at.elapsed() >= self.section.interval * 2) {
                state.memory.previous = None;
            }
            state.last_pass = Some(Instant::now());
        }
        let snapshot = self.read(ctx, withdrawing).await?;
        let listed = || listed(&self.section, snapshot.endpoints.as_ref(), &snapshot.slices);
        let own = self.advertise_address;
        if withdrawing && !own.is_some_and(|own| listed().contains(&own)) {
            return Ok(PassReport::default());
        }
        let now = Timestamp::now();
        let plan = plan(
            &snapshot,
            &mut state.memory,
            &self.section,
            &self.target,
            now,
            Instant::now(),
        );
        self.say(&plan);
        if !ctx.dry_run && !plan.findings.is_empty() {
            let found = self.reference(snapshot.endpoints.clone());
            self.publish_findings(&found, &plan).await;
        }
        let (written, report) = self.apply(ctx, &plan, snapshot.endpoints).await?;
        if ctx.dry_run || plan.refused.is_some() {
            return Ok(report);
        }
        self.metrics.set_members(&plan.members);
        state.memory.previous = Some(plan.members.clone());
        drop(state);
        if let Some(own) = own.filter(|_| withdrawing) {
            tracing::info!(member = %own, remaining = %plan.members, "withdrew this instance from the kubernetes endpoints");
        } else {
            (self.publish_notes(&self.reference(written), &plan, &report)).await;
        }
        Ok(report)
    }

    /// What events are about: the Endpoints as written or found, else (slices only, or none
    /// found) the object this loop keeps.
    fn reference(&self, written: Option<Endpoints>) -> ObjectReference {
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
                name: Some(self.target.service_name.clone()),
                namespace: Some(self.target.namespace.clone()),
                ..ObjectReference::default()
            })
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
        let writer = match self.section.endpoint_mode() {
            // The runner's election may have handed leadership over since the last pass.
            EndpointsMode::Lease => recently_leading && ctx.leads(),
            EndpointsMode::MasterCount => true,
            EndpointsMode::Static | EndpointsMode::None => false,
        };
        writer && !ctx.dry_run && self.shutdown.decide().await.withdraw
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
        self.section.endpoint_mode() != EndpointsMode::MasterCount
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
        if self.section.endpoint_mode() == EndpointsMode::Lease {
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
        Box::pin(self.pass(ctx, false))
    }

    fn shutdown<'a>(&'a self, ctx: &'a PassContext) -> BoxFuture<'a, Result<(), LoopError>> {
        Box::pin(async move {
            // The probing has its own bound (the window plus a probe timeout); the withdrawal
            // gets the same bound as upstream's `RemoveEndpoints`.
            if !self.withdraws(ctx).await {
                return Ok(());
            }
            let bound = self.section.interval * 2;
            let what = "removing this instance from the kubernetes endpoints".to_owned();
            within(bound, what, self.pass(ctx, true)).await.map(|_| ())
        })
    }
}

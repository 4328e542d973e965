//! The endpoints loop's [`Plan`] carried out: its writes (none in a dry run), the report built
//! from them, and the events and metrics that follow a pass that wrote.

use std::collections::BTreeSet;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::{Endpoints, ObjectReference};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use kube::runtime::events::EventType;

use super::ApiserverEndpointsLoop;
use super::members::MembershipChange;
use super::objects::{Op, Write};
use super::plan::Plan;
use crate::contract::{
    Action, Drift, LoopError, PassContext, PassReport, drift, ignore_already_exists,
};

/// Above this many members changing in one pass (per kind of change), one event says how many
/// instead of one event each.
const MEMBER_EVENTS_PER_PASS: usize = 5;

/// Writes explained by a membership change, which are not repairs.
const MEMBERSHIP_KINDS: [&str; 7] = [
    "endpoints_addresses",
    "endpointslice_endpoints",
    "endpointslice_missing",
    "endpointslice_stray",
    "endpointslice_address_type",
    "endpoints_subsets",
    "endpoints_missing",
];

/// The most (object, field manager) pairs remembered as named: a fight comes back to the same
/// few, and the bound keeps a cluster that names new ones without end from growing the set.
const MAX_NAMED_WRITERS: usize = 64;

impl ApiserverEndpointsLoop {
    /// Performs the plan's writes, unless the pass is a dry run; returns the Endpoints as
    /// written or found (what events are about) and one report line per drift (or why nothing
    /// is written).
    pub(super) async fn apply(
        &self,
        ctx: &PassContext,
        plan: &Plan,
        found: Option<Endpoints>,
    ) -> Result<(Option<Endpoints>, PassReport), LoopError> {
        let applied = !ctx.dry_run;
        let mut current = found;
        let mut report = PassReport::default();
        if let Some(message) = plan.refused {
            let object = self.target.endpoints_ref();
            report.push(drift("no_members", object, Action::Report, message, false));
        }
        for write in &plan.writes {
            if applied {
                current = self.write(ctx, write).await?.or(current);
            }
            for line in report_lines(plan, write, applied) {
                report.push(line);
            }
        }
        Ok((current, report))
    }

    /// One write; the Endpoints as written, when it wrote them.
    async fn write(
        &self,
        ctx: &PassContext,
        write: &Write,
    ) -> Result<Option<Endpoints>, LoopError> {
        let namespace = &self.target.namespace;
        let endpoints: Api<Endpoints> = Api::namespaced(ctx.client.clone(), namespace);
        let slices: Api<EndpointSlice> = Api::namespaced(ctx.client.clone(), namespace);
        let (params, name, uid) = (PostParams::default(), &write.name, write.uid.clone());
        match &write.op {
            Op::CreateEndpoints(object) => {
                return Ok(ignore_already_exists(
                    endpoints.create(&params, object).await,
                )?);
            }
            Op::ReplaceEndpoints(object) => {
                return Ok(Some(endpoints.replace(name, &params, object).await?));
            }
            Op::CreateSlice(slice) => {
                ignore_already_exists(slices.create(&params, slice).await)?;
            }
            Op::UpdateSlice(slice) => {
                slices.replace(name, &params, slice).await?;
            }
            Op::RecreateSlice(slice) => {
                delete_if_uid(&slices, name, uid).await?;
                ignore_already_exists(slices.create(&params, slice).await)?;
            }
            Op::DeleteSlice => {
                delete_if_uid(&slices, name, uid).await?;
            }
        }
        Ok(None)
    }

    /// Publishes the findings' warnings as events, whether the pass then writes, is refused or
    /// fails: each finding is in a plan once.
    pub(super) async fn publish_findings(&self, reference: &ObjectReference, plan: &Plan) {
        for finding in &plan.findings {
            if let Some(reason) = finding.reason() {
                let note = finding.note(&self.target);
                self.publish(reference, EventType::Warning, reason, note)
                    .await;
            }
        }
    }

    /// Publishes what a pass that wrote says, with its metrics: who joined, expired or left, the
    /// repairs (writes no membership change explains) in one event, and, once each, another
    /// writer of an object it had to repair.
    pub(super) async fn publish_notes(
        &self,
        reference: &ObjectReference,
        plan: &Plan,
        report: &PassReport,
    ) {
        self.announce(reference, &plan.change, &plan.expired).await;
        let repairs: Vec<&Drift> = (report.drift.iter())
            .filter(|d| d.applied)
            .filter(|d| plan.change.is_empty() || !MEMBERSHIP_KINDS.contains(&d.kind))
            .collect();
        if repairs.is_empty() {
            return;
        }
        for d in &repairs {
            let kind = [("kind", d.kind.to_owned())];
            self.metrics.repairs.get_or_create(&kind).inc();
        }
        let note = (repairs.iter())
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        tracing::warn!(repairs = %note, "repaired the kubernetes endpoints");
        let mut note = note;
        note.truncate(1000);
        self.publish(reference, EventType::Normal, "EndpointsRepaired", note)
            .await;
        let writers: BTreeSet<(String, String)> = (repairs.iter())
            .filter_map(|d| Some((d.object.clone(), plan.writers.get(&d.object)?.clone())))
            .filter(|pair| {
                self.named_writers.lock().is_ok_and(|mut named| {
                    // Managers' names come from the cluster: a tenant's API could send new ones
                    // without end. Past the bound the set starts afresh, so each further name
                    // is still named once, and one named long ago may be named again.
                    if named.len() >= MAX_NAMED_WRITERS && !named.contains(pair) {
                        named.clear();
                    }
                    named.insert(pair.clone())
                })
            })
            .collect();
        for (object, manager) in writers {
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

    /// Counts and announces the members that joined, expired or left, one event each (or one
    /// for many).
    async fn announce(
        &self,
        reference: &ObjectReference,
        change: &MembershipChange,
        expired_leases: &BTreeSet<IpAddr>,
    ) {
        let (expired, left): (Vec<IpAddr>, Vec<IpAddr>) =
            (change.left.iter()).partition(|ip| expired_leases.contains(*ip));
        let groups = [
            (
                "joined",
                "MemberJoined",
                "joined the endpoints",
                &change.joined,
            ),
            (
                "expired",
                "MemberExpired",
                "was removed: its membership Lease expired",
                &expired,
            ),
            ("left", "MemberLeft", "left the endpoints", &left),
        ];
        for (label, reason, what, members) in groups {
            if members.is_empty() {
                continue;
            }
            let count = members.len();
            let change = [("change", label.to_owned())];
            self.metrics
                .changes
                .get_or_create(&change)
                .inc_by(count as u64);
            // One event per member, unless a pass changes many at once (a corrupted Endpoints
            // replaced, a first pass over a stale list): then one event says how many.
            if count <= MEMBER_EVENTS_PER_PASS {
                for ip in members {
                    tracing::info!(member = %ip, change = label, "apiserver {what}");
                    let note = format!("apiserver {ip} {what}");
                    self.publish(reference, EventType::Normal, reason, note)
                        .await;
                }
                continue;
            }
            let shown: Vec<String> = (members.iter())
                .take(MEMBER_EVENTS_PER_PASS)
                .map(ToString::to_string)
                .collect();
            let note = format!(
                "{count} apiservers {what}: {} and {} more",
                shown.join(", "),
                count - shown.len()
            );
            tracing::info!(change = label, count, "{note}");
            self.publish(reference, EventType::Normal, reason, note)
                .await;
        }
    }

    async fn publish(
        &self,
        reference: &ObjectReference,
        type_: EventType,
        reason: &str,
        note: String,
    ) {
        // Logged there; the repair stands without its event.
        let _ = crate::events::emit(
            &self.client,
            &self.reporter,
            reference,
            type_,
            reason,
            "Reconcile",
            &note,
        )
        .await;
    }
}

/// Deletes `name` if it still is the object planned on (`uid`); gone already is done (false).
pub(super) async fn delete_if_uid<K>(
    api: &Api<K>,
    name: &str,
    uid: Option<String>,
) -> Result<bool, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = DeleteParams::default().preconditions(Preconditions {
        uid,
        resource_version: None,
    });
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(err) => Err(err),
    }
}

/// The report lines of one write: one per drift it repairs (or, in a dry run, would repair).
fn report_lines(plan: &Plan, write: &Write, applied: bool) -> Vec<Drift> {
    let done = if applied { "repaired" } else { "would repair" };
    let target = &plan.target;
    let slice = || target.slice_ref(&write.name);
    let (action, object) = match &write.op {
        Op::CreateEndpoints(_) => (Action::Create, target.endpoints_ref()),
        Op::ReplaceEndpoints(_) => (Action::Update, target.endpoints_ref()),
        Op::CreateSlice(_) => (Action::Create, slice()),
        Op::UpdateSlice(_) | Op::RecreateSlice(_) => (Action::Update, slice()),
        Op::DeleteSlice => (Action::Delete, slice()),
    };
    let became = match &write.op {
        Op::DeleteSlice => "deleted".to_owned(),
        _ => format!("members {}, port {}", plan.members, target.port),
    };
    (write.drift.iter())
        .map(|(kind, message)| {
            let line = format!("{message}; {done}");
            drift(kind, object.clone(), action, line, applied)
                .changed(message.clone(), became.clone())
        })
        .collect()
}

//! What this replica has seen of the replica Leases, and what follows from it: who is live,
//! whether this replica is fenced, the view to give the manager, and what to write next.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;
use reconcilers::lease::{self, at_least};
use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::view::{View, fenced_view_id, group_label, view_id};
use super::{FENCED_ANNOTATION, Left, REPLICA_LABEL, VIEW_ANNOTATION};
use crate::config::LeaderElection;

/// Another replica's Lease, as last seen.
#[derive(Debug)]
pub(super) struct Replica {
    pub(super) identity: String,
    /// Its `acquireTime` in microseconds: a replica that rejoins does so under a new one.
    pub(super) incarnation: Option<i64>,
    pub(super) ack: Option<u64>,
    pub(super) duration: Duration,
    /// Holder and renew time: a change is a sign of life.
    pub(super) record: (Option<String>, Option<Timestamp>),
    /// When `record` last changed, by this replica's clock.
    pub(super) changed_at: Instant,
    /// Its [`FENCED_ANNOTATION`]: when this replica first saw it, and the time its tenants have
    /// to stop from then.
    pub(super) fenced: Option<(Instant, Duration)>,
    /// Deleted, or its holder removed, without its owner's word: kept until it expires.
    pub(super) deleted: bool,
    pub(super) version: Option<String>,
    /// When to delete the Lease if it has not changed by then (see [`State::cleanup_after`]).
    pub(super) cleanup_at: Instant,
}

impl Replica {
    /// When the others may count it gone: expired, or its fenced annotation's time passed.
    pub(super) fn gone_at(&self) -> Instant {
        let expiry = self.changed_at + self.duration;
        self.fenced
            .map_or(expiry, |(seen, within)| expiry.min(seen + within))
    }

    pub(super) fn alive(&self, now: Instant) -> bool {
        now < self.gone_at()
    }
}

/// Why this replica is fenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// Its Lease has not been written yet.
    Joining,
    /// Its renewals have not succeeded for the fence span.
    Renewals,
    /// The manager has not acknowledged this view within the deadline.
    Unacknowledged(u64),
    /// The watch has not delivered this replica's own write back within the deadline.
    WatchStalled,
    Stopping,
}

#[derive(Debug)]
pub(super) struct Fence {
    /// The fenced view's id: the manager acknowledging it has stopped every tenant.
    pub(super) id: u64,
    pub(super) cause: Cause,
}

#[derive(Debug)]
pub(super) struct State {
    pub(super) identity: String,
    pub(super) name: String,
    pub(super) group_label: String,
    pub(super) duration: Duration,
    pub(super) renew_every: Duration,
    pub(super) fence_span: Duration,
    /// The time runtimes have to stop once their leadership is taken away: what is left of the
    /// Lease duration after the fence span.
    pub(super) grace: Duration,
    /// How long the manager has to acknowledge a view, and the watch to deliver a write back.
    pub(super) deadline: Duration,
    /// A Lease unchanged this long belongs to a replica that is gone for good (a replaced pod
    /// under a new name): deleting it keeps the group's Leases from piling up.
    pub(super) cleanup_after: Duration,
    pub(super) others: BTreeMap<String, Replica>,
    /// Whether the Lease is believed to exist (`None`: unknown, try creating it).
    pub(super) exists: Option<bool>,
    /// resourceVersion of this replica's last successful write.
    pub(super) written_version: Option<String>,
    /// resourceVersion of the write the watch must deliver back before this replica may call a
    /// view settled: the last one that changed what the Lease says (acknowledgement, fence,
    /// incarnation).
    pub(super) sync_version: Option<String>,
    /// resourceVersion of this replica's Lease as the watch last delivered it.
    pub(super) seen_version: Option<String>,
    /// When the last successful write was sent.
    pub(super) renewed_at: Option<Instant>,
    /// When the oldest write not yet delivered back by the watch was sent.
    pub(super) unseen_since: Option<Instant>,
    /// What the Lease says, as last written.
    pub(super) written: Content,
    /// The incarnation to write (the Lease's `acquireTime`).
    pub(super) acquired: Option<Timestamp>,
    /// Set while fenced; lifted once the cause is gone and the manager acknowledged it.
    pub(super) fence: Option<Fence>,
    /// Fences so far, making each fenced view's id new.
    pub(super) fences: u64,
    /// Views published and not acknowledged yet, oldest first, with when each was published.
    pub(super) unacknowledged: VecDeque<(u64, Instant)>,
    pub(super) stopping: bool,
}

/// What this replica's Lease says beyond its renew time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Content {
    pub(super) ack: Option<u64>,
    /// The [`FENCED_ANNOTATION`] in milliseconds.
    pub(super) fenced: Option<u64>,
    pub(super) acquired: Option<Timestamp>,
}

impl State {
    pub(super) fn new(election: &LeaderElection, name: String) -> Self {
        let duration = election.lease_duration;
        let mut fence_span = duration.saturating_sub(election.renew_grace);
        if fence_span.is_zero() {
            warn!(lease_duration = ?duration, renew_grace = ?election.renew_grace, "the renew grace is not shorter than the Lease; fencing at half the Lease");
            fence_span = duration / 2;
        }
        Self {
            identity: election.identity.clone(),
            name,
            group_label: group_label(&election.lease_name),
            duration,
            renew_every: (duration / 3)
                .min(fence_span / 2)
                .max(Duration::from_millis(50)),
            fence_span,
            grace: duration - fence_span,
            deadline: duration,
            cleanup_after: duration * 5,
            others: BTreeMap::new(),
            exists: None,
            written_version: None,
            sync_version: None,
            seen_version: None,
            renewed_at: None,
            unseen_since: None,
            written: Content::default(),
            acquired: None,
            fence: None,
            fences: 0,
            unacknowledged: VecDeque::new(),
            stopping: false,
        }
    }

    /// Why this replica must own nothing now, if it must.
    pub(super) fn cause(&self, now: Instant) -> Option<Cause> {
        if self.stopping {
            return Some(Cause::Stopping);
        }
        let Some(renewed_at) = self.renewed_at else {
            return Some(Cause::Joining);
        };
        if now >= renewed_at + self.fence_span {
            return Some(Cause::Renewals);
        }
        if let Some((id, since)) = self.unacknowledged.front()
            && now >= *since + self.deadline
        {
            return Some(Cause::Unacknowledged(*id));
        }
        if self
            .unseen_since
            .is_some_and(|since| now >= since + self.deadline)
        {
            return Some(Cause::WatchStalled);
        }
        None
    }

    /// Brings the fence up to date with the time and the manager's acknowledgement, and returns
    /// the view to give the manager (its acknowledgement deadline runs from its first time).
    pub(super) fn current(&mut self, now: Instant, ack: Option<u64>) -> View {
        if let Some(ack) = ack
            && let Some(last) = self.unacknowledged.iter().rposition(|(id, _)| *id == ack)
        {
            self.unacknowledged.drain(..=last);
        }
        self.others
            .retain(|_, replica| !replica.deleted || replica.alive(now));
        match (&self.fence, self.cause(now)) {
            (None, Some(cause)) => {
                self.report(cause);
                self.fences += 1;
                self.fence = Some(Fence {
                    id: fenced_view_id(&self.identity, self.fences),
                    cause,
                });
            }
            (Some(fence), None) if ack == Some(fence.id) => {
                if fence.cause == Cause::Joining {
                    debug!("joined the replica group");
                } else {
                    info!("no longer fenced; rejoining the replica group");
                }
                self.fence = None;
                self.acquired = next_incarnation(self.acquired);
            }
            _ => {}
        }
        let view = self.view(now);
        if ack == Some(view.id) {
            self.unacknowledged.clear();
        } else if self
            .unacknowledged
            .back()
            .is_none_or(|(id, _)| *id != view.id)
        {
            self.unacknowledged.push_back((view.id, now));
        }
        view
    }

    /// A fence is a finding: logged once, when it starts.
    pub(super) fn report(&self, cause: Cause) {
        match cause {
            Cause::Joining | Cause::Stopping => {}
            Cause::Renewals => warn!(
                fence_span = ?self.fence_span,
                "fenced: this replica's Lease could not be renewed in time; owning nothing until it is"
            ),
            Cause::Unacknowledged(view) => warn!(
                view,
                deadline = ?self.deadline,
                "fenced: the tenant manager has not acknowledged a view in time; owning nothing, and saying so in this replica's Lease, until it does"
            ),
            Cause::WatchStalled => warn!(
                deadline = ?self.deadline,
                "fenced: the replica Lease watch has not delivered this replica's own write back in time; owning nothing, and saying so in this replica's Lease, until it does"
            ),
        }
    }

    pub(super) fn view(&self, now: Instant) -> View {
        let joined = self.renewed_at.is_some() && !self.stopping;
        let live: Vec<&Replica> = self
            .others
            .values()
            .filter(|m| m.identity != self.identity && m.alive(now))
            .collect();
        let mut entries: BTreeMap<&str, Option<i64>> = live
            .iter()
            .map(|m| (m.identity.as_str(), m.incarnation))
            .collect();
        if joined {
            entries.insert(&self.identity, self.acquired.map(|t| t.as_microsecond()));
        }
        let replicas: Arc<[String]> = entries.keys().map(|m| (*m).to_owned()).collect();
        let (id, settled) = match &self.fence {
            Some(fence) => (fence.id, false),
            None => {
                let id = view_id(entries.iter().map(|(replica, at)| (*replica, *at)));
                let settled = joined
                    && self.written.ack == Some(id)
                    && self.written.fenced.is_none()
                    && self.written.acquired == self.acquired
                    && at_least(self.seen_version.as_deref(), self.sync_version.as_deref())
                    && live.iter().all(|m| m.ack == Some(id));
                (id, settled)
            }
        };
        View {
            id,
            replicas,
            me: self.identity.clone(),
            settled,
            fenced: self.fence.is_some(),
        }
    }

    /// Records a Lease the watch delivered.
    pub(super) fn observe(&mut self, lease: &Lease, now: Instant) {
        let Some(name) = lease.metadata.name.as_deref() else {
            return;
        };
        if name == self.name {
            self.seen_version
                .clone_from(&lease.metadata.resource_version);
            if at_least(
                self.seen_version.as_deref(),
                self.written_version.as_deref(),
            ) {
                self.unseen_since = None;
            }
            return;
        }
        let spec = lease.spec.as_ref();
        let Some(identity) = spec
            .and_then(|s| s.holder_identity.as_deref())
            .filter(|h| !h.is_empty())
        else {
            // Emptied without its owner's word: it may still run its tenants.
            self.deleted(name);
            return;
        };
        let record = lease::sign_of_life(lease);
        let duration = lease::duration(lease).unwrap_or(self.duration);
        let annotation = |key: &str| {
            lease
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .and_then(|v| v.parse::<u64>().ok())
        };
        let known = self.others.get(name);
        let (changed_at, cleanup_at) = match known {
            Some(known) if known.record == record => (known.changed_at, known.cleanup_at),
            _ => (now, now + duration.max(self.cleanup_after)),
        };
        // Counted from when this replica first saw it; never beyond the Lease's own expiry.
        let fenced = annotation(FENCED_ANNOTATION).map(|ms| {
            let seen = known.and_then(|k| k.fenced).map_or(now, |(seen, _)| seen);
            (seen, Duration::from_millis(ms).min(duration))
        });
        let replica = Replica {
            identity: identity.to_owned(),
            incarnation: spec
                .and_then(|s| s.acquire_time.as_ref())
                .map(|t| t.0.as_microsecond()),
            ack: annotation(VIEW_ANNOTATION),
            duration,
            record,
            changed_at,
            fenced,
            deleted: false,
            version: lease.metadata.resource_version.clone(),
            cleanup_at,
        };
        self.others.insert(name.to_owned(), replica);
    }

    /// Another replica's Lease went away, or lost its holder, without its owner's word: it
    /// counts as live until it would have expired (its owner may still run its tenants).
    pub(super) fn deleted(&mut self, name: &str) {
        if let Some(replica) = self.others.get_mut(name) {
            replica.deleted = true;
        }
    }

    pub(super) fn forget(&mut self, lease: &Lease) {
        let Some(name) = lease.metadata.name.as_deref() else {
            return;
        };
        if name != self.name {
            self.deleted(name);
            return;
        }
        // Older than this replica's last write: it was written again since.
        if !at_least(
            lease.metadata.resource_version.as_deref(),
            self.written_version.as_deref(),
        ) && self.written_version.is_some()
        {
            return;
        }
        if !self.stopping && self.exists == Some(true) {
            // The others keep counting this replica as live until it would have expired.
            warn!("this replica's Lease was deleted by someone else; writing it again");
        }
        self.seen_version = None;
        self.exists = Some(false);
    }

    /// A relist: the Leases now in the group replace what was known. This replica's own Lease
    /// missing from it proves nothing (the list may predate its last write); a renewal finds out.
    pub(super) fn relisted(&mut self, leases: &[Lease], now: Instant) {
        let names: BTreeSet<&str> = leases
            .iter()
            .filter_map(|l| l.metadata.name.as_deref())
            .collect();
        let missing: Vec<String> = self
            .others
            .keys()
            .filter(|name| !names.contains(name.as_str()))
            .cloned()
            .collect();
        for name in missing {
            self.deleted(&name);
        }
        for lease in leases {
            self.observe(lease, now);
        }
    }

    /// What the Lease should say, given the manager's acknowledgement.
    pub(super) fn content(&self, ack: Option<u64>) -> Content {
        let grace = u64::try_from(self.grace.as_millis()).unwrap_or(u64::MAX);
        Content {
            ack,
            // Once the manager acknowledged the fence, every runtime has stopped.
            fenced: self
                .fence
                .as_ref()
                .map(|fence| if ack == Some(fence.id) { 0 } else { grace }),
            acquired: self.acquired,
        }
    }

    /// When the next write is due, if nothing else asks for one sooner.
    pub(super) fn renewal_due(&self, ack: Option<u64>) -> Option<Instant> {
        if self.exists == Some(false) || self.written != self.content(ack) {
            return None;
        }
        self.renewed_at.map(|at| at + self.renew_every)
    }

    /// Records a successful write of `content`, sent at `sent`.
    pub(super) fn wrote(&mut self, lease: Lease, content: Content, sent: Instant) {
        // The incarnation as the API stores it, so that everyone hashes the same one.
        let acquired = lease
            .spec
            .as_ref()
            .and_then(|s| s.acquire_time.as_ref())
            .map(|t| t.0);
        let content = Content {
            acquired,
            ..content
        };
        if content != self.written || self.renewed_at.is_none() {
            self.sync_version
                .clone_from(&lease.metadata.resource_version);
        }
        self.written_version = lease.metadata.resource_version;
        self.exists = Some(true);
        self.renewed_at = Some(sent);
        self.unseen_since.get_or_insert(sent);
        self.acquired = acquired;
        self.written = content;
    }

    /// The earliest time the view changes with no event: a replica expiring or its fenced
    /// annotation's time passing, this replica's fence falling due, or a Lease to clean up.
    pub(super) fn next_change(&self, now: Instant) -> Option<Instant> {
        let own = [
            self.renewed_at.map(|at| at + self.fence_span),
            self.unacknowledged
                .front()
                .map(|(_, since)| *since + self.deadline),
            self.unseen_since.map(|since| since + self.deadline),
        ];
        self.others
            .values()
            .flat_map(|m| [Some(m.gone_at()), (!m.deleted).then_some(m.cleanup_at)])
            .chain(own)
            .flatten()
            .filter(|at| *at > now)
            .min()
    }

    /// The Leases due for deletion (name and the resourceVersion they must still have), each
    /// rescheduled in case the deletion fails.
    pub(super) fn due_for_cleanup(&mut self, now: Instant) -> Vec<(String, Option<String>)> {
        let mut due = Vec::new();
        for (name, replica) in &mut self.others {
            if !replica.deleted && replica.cleanup_at <= now {
                replica.cleanup_at = now + self.cleanup_after;
                due.push((name.clone(), replica.version.clone()));
            }
        }
        due
    }

    pub(super) fn desired(&self, content: &Content) -> Lease {
        let now = MicroTime(Timestamp::now());
        let mut annotations = BTreeMap::new();
        if let Some(id) = content.ack {
            annotations.insert(VIEW_ANNOTATION.to_owned(), id.to_string());
        }
        if let Some(ms) = content.fenced {
            annotations.insert(FENCED_ANNOTATION.to_owned(), ms.to_string());
        }
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(BTreeMap::from([(
                    REPLICA_LABEL.to_owned(),
                    self.group_label.clone(),
                )])),
                annotations: (!annotations.is_empty()).then_some(annotations),
                resource_version: self.written_version.clone(),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(self.identity.clone()),
                lease_duration_seconds: i32::try_from(
                    self.duration.as_secs() + u64::from(self.duration.subsec_nanos() > 0),
                )
                .ok()
                .map(|s| s.max(1)),
                acquire_time: Some(MicroTime(content.acquired.unwrap_or(now.0))),
                renew_time: Some(now),
                ..LeaseSpec::default()
            }),
        }
    }

    /// What a stop leaves to do: the Lease as last written, marked as owning nothing.
    pub(super) fn left(&self) -> Left {
        match (self.exists, &self.written_version) {
            (Some(false), _) => Left::Nothing,
            (Some(true), Some(_)) => {
                let content = Content {
                    fenced: Some(0),
                    ..self.written.clone()
                };
                Left::Release(Box::new(self.desired(&content)))
            }
            _ => Left::Delete,
        }
    }
}

/// A new incarnation: the time now in whole microseconds (what a Lease's `acquireTime` holds),
/// later than the last one even if the clock stepped back.
pub(super) fn next_incarnation(last: Option<Timestamp>) -> Option<Timestamp> {
    let now = Timestamp::now().as_microsecond();
    let micros = last.map_or(now, |last| now.max(last.as_microsecond().saturating_add(1)));
    Timestamp::from_microsecond(micros).ok()
}

//! Sharing tenants between replicas, coordinated through `coordination.k8s.io/v1` Leases: each
//! replica announces itself with its own Lease (labelled with the group), follows the others'
//! through one watch, and assigns every tenant to one live replica by rendezvous hashing.
//!
//! "Never two writers" rests on two rules:
//!
//! - Acknowledged views. A view is the set of live members, each with its incarnation (the
//!   `acquireTime` of its Lease, new whenever it joins or rejoins after a fence); its id is a
//!   hash of both. The manager stops the tenants it no longer owns, then acknowledges the id (an
//!   annotation on its Lease). A replica starts a tenant it newly owns only once every live
//!   member's Lease carries that id, so the previous owner has stopped it. This replica's own
//!   acknowledgement counts only once the watch has delivered it back: the watch is one ordered
//!   stream, so by then every other Lease is seen at least as recently as that write, and two
//!   replicas cannot each see the other agree with a different view. A rejoining replica's new
//!   incarnation makes every acknowledgement written before the others saw it rejoin worthless:
//!   by the time they acknowledge its view, they have seen its Lease current again and no longer
//!   count it gone on what they saw before.
//! - Fencing before anyone counts a replica gone. Liveness is judged like client-go's leader
//!   election: a Lease is live while it changed within its duration, by the observer's own clock
//!   (so clocks need not agree). A replica leaves the live set sooner only by its own word, the
//!   [`FENCED_ANNOTATION`]: its tenants have stopped within that many milliseconds of the
//!   annotation being seen (0 on a clean stop, which writes it before deleting the Lease). A
//!   Lease deleted or emptied without that word counts as live until its duration has passed
//!   since it last changed, as if it had merely stopped being renewed. A replica fences itself:
//!   when its renewals have not succeeded for `lease_duration - renew_grace` since one was sent
//!   (before its Lease can expire for anyone), when its manager has not acknowledged a view
//!   within the lease duration of being given it, or when the watch has not delivered one of its
//!   own writes back within the lease duration (it cannot follow the others); in the last two
//!   cases it then writes the annotation, so the others count it gone once the renew grace has
//!   passed after they see it. Fencing takes the leadership of every tenant runtime away at once,
//!   without waiting for the manager (which may be what is stuck); the renew grace is the time
//!   the runtimes have to stop after that, so it must exceed how long that takes (plus clock
//!   rate drift between replicas). A fenced replica owns nothing until its manager has
//!   acknowledged the fenced view (so it stopped every runtime) and the cause has cleared; then
//!   it rejoins under a new incarnation.
//!
//! At rest the only requests are this replica's renewals (every third of the Lease duration, or
//! half the time to the fence if that is shorter): no reads, no polling. A read happens only
//! after a lost compare-and-swap, and a Lease unchanged for five Lease durations (a replica
//! gone for good) is deleted by whichever survivor gets there first.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams, Preconditions};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

/// Label on every replica Lease; its value is the group.
pub const REPLICA_LABEL: &str = "bootstrap-controller.io/replica-of";
/// Annotation on a replica Lease: the view id its manager acknowledged.
pub const VIEW_ANNOTATION: &str = "bootstrap-controller.io/view";
/// Annotation on the Lease of a fenced replica, which owns nothing: its tenants have stopped
/// within this many milliseconds of the annotation being seen (0: they have stopped already).
pub const FENCED_ANNOTATION: &str = "bootstrap-controller.io/fenced";

/// Where the replica Leases live and how this replica keeps its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSettings {
    /// Namespace of the replica Leases.
    pub namespace: String,
    /// Leases are named `<group>-<identity>` and labelled `REPLICA_LABEL=<group>`.
    pub group: String,
    /// This replica.
    pub identity: String,
    /// Also the deadline for the manager to acknowledge a view, and for the watch to deliver
    /// this replica's own write back.
    pub lease_duration: Duration,
    /// How long before the others could judge this replica dead it stops owning anything.
    pub renew_grace: Duration,
}

/// Which replicas are live, as this replica sees them, and whether they all agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// Stable hash of the sorted live members and their incarnations; a fenced view has an id
    /// of its own (per fence), so acknowledging it says the manager saw that fence.
    pub id: u64,
    /// Sorted live identities, including this replica once its Lease is written.
    pub members: Arc<[String]>,
    pub me: String,
    /// Every live member's Lease acknowledges `id`.
    pub settled: bool,
    /// This replica cannot prove its own Lease is current, or its manager or watch is stuck: it
    /// owns nothing.
    pub fenced: bool,
}

impl View {
    /// No sharding (one replica): owns everything.
    pub fn single(me: &str) -> View {
        View {
            id: view_id([(me, None)]),
            members: Arc::from([me.to_owned()]),
            me: me.to_owned(),
            settled: true,
            fenced: false,
        }
    }

    /// The member with the highest rendezvous weight for `tenant` (ties to the greater name,
    /// which cannot happen between distinct members in practice but keeps the choice total).
    pub fn owner(&self, tenant: &str) -> Option<&str> {
        self.members
            .iter()
            .max_by_key(|member| (weight(member, tenant), member.as_str()))
            .map(String::as_str)
    }

    pub fn owns(&self, tenant: &str) -> bool {
        !self.fenced && self.owner(tenant) == Some(self.me.as_str())
    }
}

/// The leadership of this replica's tenant runtimes. It is handed out here so that fencing can
/// take it from every runtime at once, whatever the manager is doing (it may be what is stuck).
/// Cheap to clone; the default is never taken away (one replica, no sharing).
#[derive(Clone, Debug, Default)]
pub struct Leadership {
    grants: Arc<Mutex<Grants>>,
}

#[derive(Debug, Default)]
struct Grants {
    /// Fenced: new runtimes do not lead.
    revoked: bool,
    /// The runtimes leading now (ended or stopped ones are pruned as new ones come).
    leading: Vec<watch::Sender<bool>>,
}

impl Leadership {
    fn lock(&self) -> MutexGuard<'_, Grants> {
        self.grants.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A runtime's leadership: leading unless this replica is fenced now, and taken away for good
    /// if it is fenced later (the runtime must be started again to lead again). The caller keeps
    /// the sender to take it away itself when it stops the runtime.
    pub fn grant(&self) -> (watch::Sender<bool>, watch::Receiver<bool>) {
        let mut grants = self.lock();
        let (sender, receiver) = watch::channel(!grants.revoked);
        if !grants.revoked {
            grants
                .leading
                .retain(|leading| leading.receiver_count() > 0 && *leading.borrow());
            grants.leading.push(sender.clone());
        }
        (sender, receiver)
    }

    /// Fenced: takes the leadership of every runtime away; returns how many still led.
    fn revoke(&self) -> usize {
        let mut grants = self.lock();
        grants.revoked = true;
        grants
            .leading
            .drain(..)
            .filter(|leading| leading.receiver_count() > 0 && leading.send_replace(false))
            .count()
    }

    /// No longer fenced: runtimes granted from now on lead.
    fn restore(&self) {
        self.lock().revoked = false;
    }
}

/// 64-bit FNV-1a, with a final avalanche (splitmix64's) so that inputs differing only in their
/// last bytes still spread over the whole range. Spelled out because std's hashers are not
/// guaranteed stable across Rust versions, and replicas built by different toolchains must agree.
struct StableHasher(u64);

impl StableHasher {
    fn new() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Length-prefixed, so ("ab", "c") and ("a", "bc") hash differently.
    fn write_str(&mut self, text: &str) {
        self.write(&(text.len() as u64).to_le_bytes());
        self.write(text.as_bytes());
    }

    fn finish(&self) -> u64 {
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn weight(member: &str, tenant: &str) -> u64 {
    let mut hasher = StableHasher::new();
    hasher.write_str(member);
    hasher.write_str(tenant);
    hasher.finish()
}

/// Members sorted by identity, each with its incarnation (microseconds since the epoch). A
/// member without one hashes as its name alone; an incarnation follows its name behind a length
/// no string can have, so it cannot be taken for another member's name.
fn view_id<'a>(sorted_members: impl IntoIterator<Item = (&'a str, Option<i64>)>) -> u64 {
    let mut hasher = StableHasher::new();
    for (member, incarnation) in sorted_members {
        hasher.write_str(member);
        if let Some(incarnation) = incarnation {
            hasher.write(&u64::MAX.to_le_bytes());
            hasher.write(&incarnation.to_le_bytes());
        }
    }
    hasher.finish()
}

/// The id of this replica's `fence`th fenced view: no membership hashes like it.
fn fenced_view_id(identity: &str, fence: u64) -> u64 {
    let mut hasher = StableHasher::new();
    hasher.write_str("fenced");
    hasher.write_str(identity);
    hasher.write(&fence.to_le_bytes());
    hasher.finish()
}

fn hash_suffix(text: &str) -> String {
    let mut hasher = StableHasher::new();
    hasher.write_str(text);
    format!("{:08x}", hasher.finish() >> 32)
}

/// The Lease name of `identity` in `group`: a DNS-1123 subdomain (of lowercase alphanumerics and
/// dashes). When sanitizing changed or
/// shortened anything, a hash of the original is appended, so distinct identities keep distinct
/// Leases.
pub fn lease_name(group: &str, identity: &str) -> String {
    const MAX: usize = 253;
    let wanted = format!("{group}-{identity}");
    let mut name: String = wanted
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            // Dots would need alphanumerics on both sides; dashes only need them at the ends.
            c @ ('a'..='z' | '0'..='9' | '-') => c,
            _ => '-',
        })
        .collect();
    let trim = |name: &mut String| {
        let kept = name.trim_matches(|c: char| !c.is_ascii_alphanumeric());
        *name = kept.to_owned();
    };
    trim(&mut name);
    if name == wanted && name.len() <= MAX {
        return name;
    }
    let suffix = hash_suffix(&wanted);
    name.truncate(MAX - suffix.len() - 1);
    trim(&mut name);
    if name.is_empty() {
        suffix
    } else {
        format!("{name}-{suffix}")
    }
}

/// The group as a label value (at most 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both
/// ends), hashed like [`lease_name`] when it does not fit as it is.
pub fn group_label(group: &str) -> String {
    const MAX: usize = 63;
    let valid = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    let mut value: String = group
        .chars()
        .map(|c| if valid(c) { c } else { '-' })
        .collect();
    value = value
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned();
    if value == group && value.len() <= MAX {
        return value;
    }
    let suffix = hash_suffix(group);
    value.truncate(MAX - suffix.len() - 1);
    let value = value.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    if value.is_empty() {
        suffix
    } else {
        format!("{value}-{suffix}")
    }
}

/// Why writing this replica's Lease failed.
#[derive(Debug, thiserror::Error)]
enum WriteError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("the Lease write did not finish before {0:?}")]
    TimedOut(Duration),
    #[error("the Lease kept changing under the write")]
    Contended,
}

/// What a stop leaves to do with this replica's Lease.
#[derive(Debug)]
enum Left {
    /// It is gone already.
    Nothing,
    /// Its last write is unknown, so it cannot be marked: delete it (the others then wait for it
    /// to expire).
    Delete,
    /// Mark it as owning nothing (the hand-over), then delete it.
    Release(Box<Lease>),
}

/// Following the replicas: announcing this one, and publishing views.
///
/// The manager's side of the protocol, on every view it receives: stop the tenants it does not
/// [own](View::owns) (all of them when `fenced`), then [`ack`](Shards::ack) the view's id; start
/// the tenants it owns but does not run only when the view is `settled`, each runtime leading
/// through [`leadership`](Shards::leadership), and keep running those it ran before and still
/// owns. A view not acknowledged within the lease duration fences this replica. On shutdown:
/// cancel, stop every tenant, then [`stopped`](Shards::stopped).
///
/// The client's watch must not be cut by a short read timeout, or it would relist (read) at
/// every timeout; each write is bounded here instead.
pub struct Shards {
    pub views: watch::Receiver<View>,
    acks: watch::Sender<Option<u64>>,
    leadership: Leadership,
    task: JoinHandle<Left>,
    leases: Api<Lease>,
    name: String,
    release_timeout: Duration,
}

impl Shards {
    /// Starts announcing this replica and following the others. Never exits on API errors: it
    /// retries with backoff (and is fenced while its own Lease cannot be renewed).
    pub fn spawn(
        client: kube::Client,
        settings: ShardSettings,
        cancel: CancellationToken,
    ) -> Shards {
        let name = lease_name(&settings.group, &settings.identity);
        let mut state = State::new(&settings, name.clone());
        let view = state.current(Instant::now(), None);
        let leadership = Leadership::default();
        if view.fenced {
            leadership.revoke();
        }
        let (views, receiver) = watch::channel(view);
        let (acks, ack_receiver) = watch::channel(None);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
        let span = info_span!(
            "shards",
            group = %settings.group,
            identity = %settings.identity
        );
        let release_timeout = settings.renew_grace.max(Duration::from_secs(1));
        let following = Following {
            views,
            acks: ack_receiver,
            leadership: leadership.clone(),
        };
        let task =
            tokio::spawn(follow(client, settings, state, following, cancel).instrument(span));
        Shards {
            views: receiver,
            acks,
            leadership,
            task,
            leases,
            name,
            release_timeout,
        }
    }

    /// The caller has stopped every tenant it does not own under view `id`: publish the
    /// acknowledgement in this replica's Lease.
    pub fn ack(&self, id: u64) {
        self.acks.send_if_modified(|current| {
            let changed = *current != Some(id);
            *current = Some(id);
            changed
        });
    }

    /// Where the tenant runtimes get their leadership ([`Leadership::grant`]).
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// Waits for the task to end after cancel, then marks this replica's Lease as owning nothing
    /// and deletes it, so the others take over its tenants at once. Call it once this replica's
    /// tenants have stopped: the mark is the hand-over.
    pub async fn stopped(self) {
        let left = match self.task.await {
            Ok(left) => left,
            Err(err) => {
                warn!(error = %err, "the shard task failed; deleting its Lease anyway (the others take over once it expires)");
                Left::Delete
            }
        };
        match left {
            Left::Nothing => return,
            Left::Delete => {}
            Left::Release(lease) => {
                let params = PostParams::default();
                let release = self.leases.replace(&self.name, &params, &lease);
                match tokio::time::timeout(self.release_timeout, release).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(err)) if code(&err) == Some(404) => return,
                    Ok(Err(err)) => {
                        warn!(error = %err, lease = %self.name, "could not mark the replica Lease released; the others take over once it expires")
                    }
                    Err(_) => {
                        warn!(lease = %self.name, "marking the replica Lease released timed out; the others take over once it expires")
                    }
                }
            }
        }
        let params = DeleteParams::default();
        let delete = self.leases.delete(&self.name, &params);
        match tokio::time::timeout(self.release_timeout, delete).await {
            Ok(Ok(_)) => info!(lease = %self.name, "released the replica Lease"),
            Ok(Err(err)) if code(&err) == Some(404) => {}
            Ok(Err(err)) => {
                warn!(error = %err, lease = %self.name, "could not delete the replica Lease; the others delete it once it is stale")
            }
            Err(_) => {
                warn!(lease = %self.name, "deleting the replica Lease timed out; the others delete it once it is stale")
            }
        }
    }
}

/// Another replica's Lease, as last seen.
#[derive(Debug)]
struct Member {
    identity: String,
    /// Its `acquireTime` in microseconds: a replica that rejoins does so under a new one.
    incarnation: Option<i64>,
    ack: Option<u64>,
    duration: Duration,
    /// Holder and renew time: a change is a sign of life.
    record: (Option<String>, Option<Timestamp>),
    /// When `record` last changed, by this replica's clock.
    changed_at: Instant,
    /// Its [`FENCED_ANNOTATION`]: when this replica first saw it, and the time its tenants have
    /// to stop from then.
    fenced: Option<(Instant, Duration)>,
    /// Deleted, or its holder removed, without its owner's word: kept until it expires.
    deleted: bool,
    version: Option<String>,
    /// When to delete the Lease if it has not changed by then (see [`State::cleanup_after`]).
    cleanup_at: Instant,
}

impl Member {
    /// When the others may count it gone: expired, or its fenced annotation's time passed.
    fn gone_at(&self) -> Instant {
        let expiry = self.changed_at + self.duration;
        self.fenced
            .map_or(expiry, |(seen, within)| expiry.min(seen + within))
    }

    fn alive(&self, now: Instant) -> bool {
        now < self.gone_at()
    }
}

/// Why this replica is fenced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cause {
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
struct Fence {
    /// The fenced view's id: the manager acknowledging it has stopped every tenant.
    id: u64,
    cause: Cause,
}

#[derive(Debug)]
struct State {
    identity: String,
    name: String,
    group_label: String,
    duration: Duration,
    renew_every: Duration,
    fence_span: Duration,
    /// The time runtimes have to stop once their leadership is taken away: what is left of the
    /// Lease duration after the fence span.
    grace: Duration,
    /// How long the manager has to acknowledge a view, and the watch to deliver a write back.
    deadline: Duration,
    /// A Lease unchanged this long belongs to a replica that is gone for good (a replaced pod
    /// under a new name): deleting it keeps the group's Leases from piling up.
    cleanup_after: Duration,
    others: BTreeMap<String, Member>,
    /// Whether the Lease is believed to exist (`None`: unknown, try creating it).
    exists: Option<bool>,
    /// resourceVersion of this replica's last successful write.
    written_version: Option<String>,
    /// resourceVersion of the write the watch must deliver back before this replica may call a
    /// view settled: the last one that changed what the Lease says (acknowledgement, fence,
    /// incarnation).
    sync_version: Option<String>,
    /// resourceVersion of this replica's Lease as the watch last delivered it.
    seen_version: Option<String>,
    /// When the last successful write was sent.
    renewed_at: Option<Instant>,
    /// When the oldest write not yet delivered back by the watch was sent.
    unseen_since: Option<Instant>,
    /// What the Lease says, as last written.
    written: Content,
    /// The incarnation to write (the Lease's `acquireTime`).
    acquired: Option<Timestamp>,
    /// Set while fenced; lifted once the cause is gone and the manager acknowledged it.
    fence: Option<Fence>,
    /// Fences so far, making each fenced view's id new.
    fences: u64,
    /// Views published and not acknowledged yet, oldest first, with when each was published.
    unacknowledged: VecDeque<(u64, Instant)>,
    stopping: bool,
}

/// What this replica's Lease says beyond its renew time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Content {
    ack: Option<u64>,
    /// The [`FENCED_ANNOTATION`] in milliseconds.
    fenced: Option<u64>,
    acquired: Option<Timestamp>,
}

fn version(value: Option<&str>) -> Option<u64> {
    value.and_then(|v| v.parse().ok())
}

/// Whether resourceVersion `seen` is at least `wanted`. Opaque by contract, numbers in practice;
/// if either is not, only equality proves it.
fn at_least(seen: Option<&str>, wanted: Option<&str>) -> bool {
    match (version(seen), version(wanted)) {
        (Some(seen), Some(wanted)) => seen >= wanted,
        _ => seen.is_some() && seen == wanted,
    }
}

impl State {
    fn new(settings: &ShardSettings, name: String) -> Self {
        let duration = settings.lease_duration;
        let mut fence_span = duration.saturating_sub(settings.renew_grace);
        if fence_span.is_zero() {
            warn!(lease_duration = ?duration, renew_grace = ?settings.renew_grace, "the renew grace is not shorter than the Lease; fencing at half the Lease");
            fence_span = duration / 2;
        }
        Self {
            identity: settings.identity.clone(),
            name,
            group_label: group_label(&settings.group),
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
    fn cause(&self, now: Instant) -> Option<Cause> {
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
    fn current(&mut self, now: Instant, ack: Option<u64>) -> View {
        if let Some(ack) = ack
            && let Some(last) = self.unacknowledged.iter().rposition(|(id, _)| *id == ack)
        {
            self.unacknowledged.drain(..=last);
        }
        self.others
            .retain(|_, member| !member.deleted || member.alive(now));
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
    fn report(&self, cause: Cause) {
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

    fn view(&self, now: Instant) -> View {
        let joined = self.renewed_at.is_some() && !self.stopping;
        let live: Vec<&Member> = self
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
        let members: Arc<[String]> = entries.keys().map(|m| (*m).to_owned()).collect();
        let (id, settled) = match &self.fence {
            Some(fence) => (fence.id, false),
            None => {
                let id = view_id(entries.iter().map(|(member, at)| (*member, *at)));
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
            members,
            me: self.identity.clone(),
            settled,
            fenced: self.fence.is_some(),
        }
    }

    /// Records a Lease the watch delivered.
    fn observe(&mut self, lease: &Lease, now: Instant) {
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
        let record = (
            Some(identity.to_owned()),
            spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0),
        );
        let duration = spec
            .and_then(|s| s.lease_duration_seconds)
            .and_then(|d| u64::try_from(d).ok())
            .filter(|d| *d > 0)
            .map_or(self.duration, Duration::from_secs);
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
        let member = Member {
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
        self.others.insert(name.to_owned(), member);
    }

    /// Another replica's Lease went away, or lost its holder, without its owner's word: it
    /// counts as live until it would have expired (its owner may still run its tenants).
    fn deleted(&mut self, name: &str) {
        if let Some(member) = self.others.get_mut(name) {
            member.deleted = true;
        }
    }

    fn forget(&mut self, lease: &Lease) {
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
    fn relisted(&mut self, leases: &[Lease], now: Instant) {
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
    fn content(&self, ack: Option<u64>) -> Content {
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
    fn renewal_due(&self, ack: Option<u64>) -> Option<Instant> {
        if self.exists == Some(false) || self.written != self.content(ack) {
            return None;
        }
        self.renewed_at.map(|at| at + self.renew_every)
    }

    /// Records a successful write of `content`, sent at `sent`.
    fn wrote(&mut self, lease: Lease, content: Content, sent: Instant) {
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

    /// The earliest time the view changes with no event: a member expiring or its fenced
    /// annotation's time passing, this replica's fence falling due, or a Lease to clean up.
    fn next_change(&self, now: Instant) -> Option<Instant> {
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
    fn due_for_cleanup(&mut self, now: Instant) -> Vec<(String, Option<String>)> {
        let mut due = Vec::new();
        for (name, member) in &mut self.others {
            if !member.deleted && member.cleanup_at <= now {
                member.cleanup_at = now + self.cleanup_after;
                due.push((name.clone(), member.version.clone()));
            }
        }
        due
    }

    fn desired(&self, content: &Content) -> Lease {
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
    fn left(&self) -> Left {
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
fn next_incarnation(last: Option<Timestamp>) -> Option<Timestamp> {
    let now = Timestamp::now().as_microsecond();
    let micros = last.map_or(now, |last| now.max(last.as_microsecond().saturating_add(1)));
    Timestamp::from_microsecond(micros).ok()
}

fn code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Creates or replaces this replica's Lease by compare-and-swap; reads only after a lost swap.
async fn write(
    leases: &Api<Lease>,
    namespaces: &Api<Namespace>,
    state: &mut State,
    content: &Content,
) -> Result<Lease, WriteError> {
    let params = PostParams::default();
    // Each round fixes one obstacle: a missing namespace, an unknown or stale resourceVersion.
    for _ in 0..4 {
        let mut desired = state.desired(content);
        if state.exists != Some(true) {
            desired.metadata.resource_version = None;
            match leases.create(&params, &desired).await {
                Ok(lease) => return Ok(lease),
                Err(err) if code(&err) == Some(409) => state.exists = Some(true),
                Err(err) if code(&err) == Some(404) => {
                    let namespace = Namespace {
                        metadata: ObjectMeta {
                            name: leases_namespace(leases),
                            ..ObjectMeta::default()
                        },
                        ..Namespace::default()
                    };
                    if reconcilers::ignore_already_exists(
                        namespaces.create(&params, &namespace).await,
                    )?
                    .is_some()
                    {
                        info!("created the replica Leases' namespace");
                    }
                    continue;
                }
                Err(err) => return Err(err.into()),
            }
            state.written_version = None;
        }
        if state.written_version.is_none() {
            match leases.get_opt(&state.name).await? {
                Some(lease) => state.written_version = lease.metadata.resource_version,
                None => {
                    state.exists = Some(false);
                    continue;
                }
            }
            desired = state.desired(content);
        }
        match leases.replace(&state.name, &params, &desired).await {
            Ok(lease) => return Ok(lease),
            Err(err) if code(&err) == Some(409) => state.written_version = None,
            Err(err) if code(&err) == Some(404) => state.exists = Some(false),
            Err(err) => return Err(err.into()),
        }
    }
    Err(WriteError::Contended)
}

fn leases_namespace(leases: &Api<Lease>) -> Option<String> {
    leases.namespace().map(str::to_owned)
}

/// Deletes a Lease that stopped changing long ago, unless it changed since (the precondition):
/// every replica may try, and only one deletion can succeed.
async fn clean_up(leases: Api<Lease>, name: String, version: Option<String>, timeout: Duration) {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: version,
            uid: None,
        }),
        ..DeleteParams::default()
    };
    match tokio::time::timeout(timeout, leases.delete(&name, &params)).await {
        Ok(Ok(_)) => info!(lease = %name, "deleted the Lease of a replica gone for good"),
        Ok(Err(err)) if matches!(code(&err), Some(404 | 409)) => {}
        Ok(Err(err)) => {
            debug!(error = %err, lease = %name, "cannot delete a stale replica Lease; retrying later")
        }
        Err(_) => debug!(lease = %name, "deleting a stale replica Lease timed out; retrying later"),
    }
}

/// Gives the manager a view. A fenced one first takes the leadership of every tenant runtime
/// away; an unfenced one first lets new runtimes lead (the manager starts them on seeing it).
fn publish(sender: &watch::Sender<View>, leadership: &Leadership, view: View) {
    if view.fenced {
        let taken = leadership.revoke();
        if taken > 0 {
            info!(
                runtimes = taken,
                "took the leadership of this replica's tenant runtimes away"
            );
        }
    } else {
        leadership.restore();
    }
    sender.send_if_modified(|current| {
        if *current == view {
            return false;
        }
        if current.members != view.members {
            info!(members = ?view.members, view = view.id, "replica membership changed");
        } else if current.settled != view.settled || current.fenced != view.fenced {
            debug!(
                view = view.id,
                settled = view.settled,
                fenced = view.fenced,
                "view changed"
            );
        }
        *current = view;
        true
    });
}

/// The task's ends of what it shares with [`Shards`].
struct Following {
    views: watch::Sender<View>,
    acks: watch::Receiver<Option<u64>>,
    leadership: Leadership,
}

async fn follow(
    client: kube::Client,
    settings: ShardSettings,
    mut state: State,
    following: Following,
    cancel: CancellationToken,
) -> Left {
    let Following {
        views,
        mut acks,
        leadership,
    } = following;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut watch = watcher(
        leases.clone(),
        watcher::Config::default().labels(&format!("{REPLICA_LABEL}={}", state.group_label)),
    )
    .default_backoff()
    .boxed();
    let renew_every = state.renew_every;
    let backoff = || reconcilers::retry::backoff(Duration::from_millis(200), renew_every).build();
    let mut delays = backoff();
    let mut retry_at: Option<Instant> = None;
    let mut listing: Option<Vec<Lease>> = None;
    let mut write_failure = reconcilers::findings::RepeatedFailure::default();
    let mut watch_failure = reconcilers::findings::RepeatedFailure::default();
    let mut acks_open = true;
    info!(lease = %state.name, namespace = %settings.namespace, "joining the replica group");
    loop {
        let now = Instant::now();
        let ack = *acks.borrow();
        publish(&views, &leadership, state.current(now, ack));
        let write_at = retry_at.or_else(|| state.renewal_due(ack)).unwrap_or(now);
        let wake = state
            .next_change(now)
            .map_or(write_at, |at| at.min(write_at));
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            event = watch.next() => {
                let now = Instant::now();
                match event {
                    Some(Ok(watcher::Event::Init)) => listing = Some(Vec::new()),
                    Some(Ok(watcher::Event::InitApply(lease))) => {
                        listing.get_or_insert_with(Vec::new).push(lease);
                    }
                    Some(Ok(watcher::Event::InitDone)) => {
                        state.relisted(&listing.take().unwrap_or_default(), now);
                        watch_failure.succeeded();
                    }
                    Some(Ok(watcher::Event::Apply(lease))) => state.observe(&lease, now),
                    Some(Ok(watcher::Event::Delete(lease))) => state.forget(&lease),
                    Some(Err(err)) => {
                        if watch_failure.is_new(&err) {
                            warn!(error = %err, "the replica Lease watch failed; retrying with backoff");
                        } else {
                            debug!(error = %err, "the replica Lease watch failed again");
                        }
                    }
                    None => break,
                }
            }
            changed = acks.changed(), if acks_open => {
                // Closed: the Shards handle is gone; renewals go on with the last acknowledgement.
                acks_open = changed.is_ok();
            }
            _ = tokio::time::sleep_until(wake) => {
                let now = Instant::now();
                // A fence falling due together with a write is published before the write.
                publish(&views, &leadership, state.current(now, ack));
                for (name, version) in state.due_for_cleanup(now) {
                    // Detached, so that a slow API cannot hold up this replica's renewals.
                    tokio::spawn(
                        clean_up(leases.clone(), name, version, state.renew_every)
                            .in_current_span(),
                    );
                }
                if write_at > now {
                    continue;
                }
                retry_at = None;
                // The write may not outlast this replica's authority: kube's client retries 429
                // and 503 answers after their Retry-After, which could outlast the Lease.
                let deadline = match state.renewed_at {
                    Some(at) if state.fence.is_none() => at + state.fence_span,
                    _ => now + state.duration,
                };
                let content = state.content(ack);
                let sent = Instant::now();
                let result = tokio::time::timeout_at(
                    deadline,
                    write(&leases, &namespaces, &mut state, &content),
                )
                .await
                .unwrap_or_else(|_| Err(WriteError::TimedOut(deadline - sent)));
                match result {
                    Ok(lease) => {
                        state.wrote(lease, content, sent);
                        write_failure.succeeded();
                        delays = backoff();
                    }
                    Err(err) => {
                        let delay = delays.next().unwrap_or(state.renew_every);
                        if write_failure.is_new(&err) {
                            warn!(error = %err, retry_in = ?delay, "cannot write this replica's Lease; retrying (the same failure again is logged at debug level)");
                        } else {
                            debug!(error = %err, retry_in = ?delay, "cannot write this replica's Lease, again");
                        }
                        retry_at = Some(Instant::now() + delay);
                    }
                }
            }
        }
    }
    state.stopping = true;
    publish(
        &views,
        &leadership,
        state.current(Instant::now(), *acks.borrow()),
    );
    info!("left the replica group");
    state.left()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Computed independently of this code, from the FNV-1a and splitmix64 definitions.
    const PINNED_VIEW: u64 = 0x2c5b_7173_ce31_6e36;
    const PINNED_INCARNATION_VIEW: u64 = 0x8e01_65ff_aa58_3c07;
    const PINNED_WEIGHT: u64 = 0xbbf1_216c_4bc4_75aa;

    fn view(members: &[&str], me: &str) -> View {
        View {
            members: members.iter().map(|m| (*m).to_owned()).collect(),
            ..View::single(me)
        }
    }

    #[test]
    fn the_hash_is_stable_across_builds() {
        // Replicas built by different toolchains must agree on owners and view ids.
        assert_eq!(view_id([("a", None), ("b", None)]), PINNED_VIEW);
        assert_eq!(
            view_id([("a", Some(1_700_000_000_000_000)), ("b", None)]),
            PINNED_INCARNATION_VIEW
        );
        assert_eq!(weight("a", "ns/t"), PINNED_WEIGHT);
        let single = View::single("a");
        assert_eq!(single.id, view_id([("a", None)]));
        assert_eq!(weight("a", "t"), weight("a", "t"));
        assert_ne!(weight("ab", "c"), weight("a", "bc"));
        assert_ne!(fenced_view_id("a", 1), fenced_view_id("a", 2));
        let mut hasher = StableHasher::new();
        hasher.write(b"a");
        // FNV-1a of "a" is a well-known constant.
        assert_eq!(hasher.0, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn removing_a_member_moves_only_its_tenants() {
        let three = view(&["a", "b", "c"], "a");
        let two = view(&["a", "b"], "a");
        let mut moved = 0;
        for i in 0..1000 {
            let tenant = format!("ns/t{i}");
            let before = three.owner(&tenant).unwrap();
            let after = two.owner(&tenant).unwrap();
            if before != "c" {
                assert_eq!(before, after, "{tenant} moved though its owner stayed");
            } else {
                moved += 1;
            }
        }
        assert!((200..=470).contains(&moved), "c owned {moved} of 1000");
        assert_eq!(view(&[], "a").owner("x"), None);
        let fenced = View {
            fenced: true,
            ..View::single("a")
        };
        assert!(!fenced.owns("x") && View::single("a").owns("x"));
    }

    fn settings() -> ShardSettings {
        ShardSettings {
            namespace: "kube-system".into(),
            group: "g".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_grace: Duration::from_secs(5),
        }
    }

    fn lease(name: &str, holder: &str, renewed: i64, ack: Option<u64>, version: u64) -> Lease {
        Lease {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                resource_version: Some(version.to_string()),
                annotations: ack
                    .map(|id| BTreeMap::from([(VIEW_ANNOTATION.to_owned(), id.to_string())])),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                renew_time: Some(MicroTime(
                    Timestamp::from_second(1_700_000_000 + renewed).unwrap(),
                )),
                lease_duration_seconds: Some(15),
                ..LeaseSpec::default()
            }),
        }
    }

    fn fenced(mut lease: Lease, millis: &str) -> Lease {
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(FENCED_ANNOTATION.to_owned(), millis.to_owned());
        lease
    }

    /// A successful write of what the state wants, answered with `version`; returns the Lease
    /// for the watch to deliver back.
    fn write(state: &mut State, at: Instant, ack: Option<u64>, version: u64) -> Lease {
        let content = state.content(ack);
        let mut lease = state.desired(&content);
        lease.metadata.resource_version = Some(version.to_string());
        state.wrote(lease.clone(), content, at);
        lease
    }

    /// Joins as `follow` and a prompt manager do: the first write, the fenced view acknowledged,
    /// the rejoin written, the view acknowledged and written, and both seen back.
    fn join(state: &mut State, at: Instant) -> View {
        let first = state.current(at, None);
        assert!(first.fenced && !first.settled);
        write(state, at, Some(first.id), 1);
        let view = state.current(at, Some(first.id));
        assert!(
            !view.fenced,
            "joined once the manager acknowledged the fence"
        );
        write(state, at, Some(first.id), 2);
        let own = write(state, at, Some(view.id), 3);
        state.observe(&own, at);
        let view = state.current(at, Some(view.id));
        assert!(!view.fenced);
        view
    }

    fn at(t0: Instant, millis: u64) -> Instant {
        t0 + Duration::from_millis(millis)
    }

    #[tokio::test]
    async fn a_view_settles_once_every_live_lease_acknowledges_it_after_this_ones_own() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let view = state.current(t0, None);
        assert!(view.fenced && !view.settled && view.members.is_empty());

        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        let view = join(&mut state, t0);
        assert_eq!(&*view.members, ["me".to_owned(), "other".to_owned()]);
        assert!(!view.settled, "the other replica has not acknowledged it");

        state.observe(&lease("g-other", "other", 2, Some(view.id), 8), t0);
        assert!(state.current(t0, Some(view.id)).settled);
        // A renewal changing nothing else keeps the view settled while the watch lags.
        write(&mut state, t0, Some(view.id), 9);
        assert!(state.current(t0, Some(view.id)).settled);
        // A stale acknowledgement from the other replica unsettles it.
        state.observe(&lease("g-other", "other", 3, Some(1), 10), t0);
        assert!(!state.current(t0, Some(view.id)).settled);

        // This replica's own acknowledgement counts once seen back.
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let view = join(&mut state, t0);
        let next = write(&mut state, t0, Some(view.id), 4);
        assert!(state.current(t0, Some(view.id)).settled);
        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        let two = state.current(t0, Some(view.id));
        let own = write(&mut state, t0, Some(two.id), 6);
        state.observe(&lease("g-other", "other", 2, Some(two.id), 7), t0);
        state.observe(&next, t0);
        assert!(
            !state.current(t0, Some(two.id)).settled,
            "this replica's acknowledgement is not seen back yet"
        );
        state.observe(&own, t0);
        assert!(state.current(t0, Some(two.id)).settled);
    }

    #[tokio::test]
    async fn a_rejoining_member_makes_a_new_view() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let mut other = lease("g-other", "other", 1, None, 5);
        other.spec.as_mut().unwrap().acquire_time =
            Some(MicroTime(Timestamp::from_second(1).unwrap()));
        state.observe(&other, t0);
        let before = join(&mut state, t0);
        other.spec.as_mut().unwrap().acquire_time =
            Some(MicroTime(Timestamp::from_second(2).unwrap()));
        state.observe(&other, t0);
        let after = state.current(t0, Some(before.id));
        assert_eq!(before.members, after.members);
        assert_ne!(
            before.id, after.id,
            "an acknowledgement of the old incarnation is worthless"
        );
    }

    #[tokio::test]
    async fn members_expire_by_this_replicas_clock_and_fencing_comes_first() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        // Seen again unchanged (a relist): no sign of life.
        state.observe(&lease("g-other", "other", 1, None, 5), at(t0, 10_000));
        let renewed = at(t0, 5_000);
        let ack = Some(join(&mut state, renewed).id);
        assert_eq!(state.view(at(t0, 14_999)).members.len(), 2);
        assert_eq!(&*state.view(at(t0, 15_000)).members, ["me".to_owned()]);
        // Own renewals failing: fenced at lease duration less grace after the last one was sent,
        // before the others can see this replica's Lease expire.
        assert!(!state.current(at(renewed, 9_999), ack).fenced);
        assert_eq!(
            state.next_change(at(renewed, 9_999)),
            Some(at(renewed, 10_000))
        );
        let view = state.current(at(renewed, 10_000), ack);
        assert!(view.fenced && !view.owns("t"));
    }

    #[tokio::test]
    async fn a_view_left_unacknowledged_fences_this_replica_until_the_manager_acknowledges_the_fence()
     {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let ack = Some(join(&mut state, t0).id);
        // A replica joins; the manager is given the new view and never acknowledges it.
        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        let given = state.current(t0, ack);
        assert!(Some(given.id) != ack && !given.fenced);
        // Renewals go on and are seen back: only the missing acknowledgement fences.
        for (i, millis) in [4_000, 8_000, 12_000].into_iter().enumerate() {
            let i = i as u64;
            let own = write(&mut state, at(t0, millis), ack, 10 + 2 * i);
            state.observe(&own, at(t0, millis));
            state.observe(
                &lease("g-other", "other", 2 + i as i64, None, 11 + 2 * i),
                at(t0, millis),
            );
            assert!(!state.current(at(t0, millis), ack).fenced);
        }
        assert!(!state.current(at(t0, 14_999), ack).fenced);
        assert_eq!(state.next_change(at(t0, 14_999)), Some(at(t0, 15_000)));
        let fence = state.current(at(t0, 15_000), ack);
        assert!(fence.fenced && !fence.settled);
        assert_eq!(
            state.content(ack).fenced,
            Some(5_000),
            "the Lease says so, with the renew grace"
        );
        assert_eq!(state.renewal_due(ack), None, "written at once");
        write(&mut state, at(t0, 15_000), ack, 20);
        // The manager comes back and acknowledges the fence (it stopped every runtime): the
        // replica rejoins under a new incarnation.
        let incarnation = state.acquired;
        let back = state.current(at(t0, 16_000), Some(fence.id));
        assert!(!back.fenced && state.acquired > incarnation);
        assert_eq!(state.content(Some(fence.id)).fenced, None);
        assert_eq!(state.renewal_due(Some(fence.id)), None, "written at once");
    }

    #[tokio::test]
    async fn a_watch_that_does_not_deliver_this_replicas_writes_back_fences_it() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let ack = Some(join(&mut state, t0).id);
        let mut last = None;
        for (i, millis) in [4_000, 8_000, 12_000, 16_000].into_iter().enumerate() {
            last = Some(write(&mut state, at(t0, millis), ack, 10 + i as u64));
            assert!(!state.current(at(t0, millis), ack).fenced);
        }
        assert!(!state.current(at(t0, 18_999), ack).fenced);
        let fence = state.current(at(t0, 19_000), ack);
        assert!(fence.fenced);
        assert_eq!(state.content(ack).fenced, Some(5_000));
        // The manager acknowledges at once, but the watch must catch up first.
        assert!(state.current(at(t0, 19_000), Some(fence.id)).fenced);
        state.observe(&last.unwrap(), at(t0, 19_500));
        assert!(!state.current(at(t0, 19_500), Some(fence.id)).fenced);
    }

    #[tokio::test]
    async fn a_lease_gone_without_its_owners_word_counts_until_it_would_have_expired() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let members = |state: &State, millis| state.view(at(t0, millis)).members.len();
        // Deleted by hand.
        let deleted = lease("g-a", "a", 1, None, 5);
        state.observe(&deleted, t0);
        state.forget(&deleted);
        // Its holder removed by hand.
        let emptied = lease("g-b", "b", 1, None, 6);
        state.observe(&emptied, t0);
        let mut without_holder = emptied.clone();
        without_holder.spec.as_mut().unwrap().holder_identity = None;
        state.observe(&without_holder, at(t0, 1_000));
        // Gone while the watch was down: missing from the relist.
        let relisted = lease("g-c", "c", 1, None, 7);
        state.observe(&relisted, t0);
        state.relisted(&[], at(t0, 2_000));
        // One written back from a copy (the same renew time): no sign of life either.
        state.observe(&deleted, at(t0, 10_000));
        assert_eq!(members(&state, 14_999), 3);
        assert_eq!(state.next_change(at(t0, 2_000)), Some(at(t0, 15_000)));
        assert_eq!(members(&state, 15_000), 0);
        state.current(at(t0, 15_000), None);
        let left: Vec<&String> = state.others.keys().collect();
        assert_eq!(left, ["g-a"], "the deleted ones are dropped once expired");
        let cleanup: Vec<String> = state
            .due_for_cleanup(at(t0, 100_000))
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        assert_eq!(
            cleanup,
            ["g-a"],
            "only a Lease that still exists is deleted"
        );
    }

    #[tokio::test]
    async fn a_fenced_lease_counts_until_its_time_has_passed_from_when_it_was_seen() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let members = |state: &State, millis| state.view(at(t0, millis)).members.len();
        state.observe(&fenced(lease("g-a", "a", 1, None, 5), "2000"), t0);
        // Renewed, still fenced: counted from the first sight.
        state.observe(
            &fenced(lease("g-a", "a", 2, None, 6), "2000"),
            at(t0, 1_000),
        );
        assert_eq!(members(&state, 1_999), 1);
        assert_eq!(state.next_change(at(t0, 1_000)), Some(at(t0, 2_000)));
        assert_eq!(members(&state, 2_000), 0);
        // Its word withdrawn (it rejoins): live again.
        state.observe(&lease("g-a", "a", 3, None, 7), at(t0, 3_000));
        assert_eq!(members(&state, 3_000), 1);
        // A clean stop: 0, gone at once; its deletion then changes nothing.
        let released = fenced(lease("g-a", "a", 4, None, 8), "0");
        state.observe(&released, at(t0, 4_000));
        assert_eq!(members(&state, 4_000), 0);
        state.forget(&released);
        assert_eq!(members(&state, 4_000), 0);
        // Beyond the Lease's duration, or not a number: the Lease's expiry decides.
        state.observe(
            &fenced(lease("g-b", "b", 1, None, 9), &u64::MAX.to_string()),
            t0,
        );
        state.observe(&fenced(lease("g-c", "c", 1, None, 10), "soon"), t0);
        assert_eq!(members(&state, 14_999), 2);
        assert_eq!(members(&state, 15_000), 0);
    }

    #[tokio::test]
    async fn this_replicas_lease_deleted_by_hand_is_written_again_without_a_fence() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let ack = Some(join(&mut state, t0).id);
        let mut gone = state.desired(&state.content(ack));
        // A Delete of an older version is stale: this replica wrote it again since.
        gone.metadata.resource_version = Some("2".to_owned());
        state.forget(&gone);
        assert!(state.renewal_due(ack).is_some());
        gone.metadata.resource_version = Some("4".to_owned());
        state.forget(&gone);
        assert_eq!(state.renewal_due(ack), None, "written again at once");
        assert!(
            !state.current(t0, ack).fenced,
            "the others count it live meanwhile"
        );
    }

    #[test]
    fn fencing_takes_every_runtimes_leadership_for_good() {
        let leadership = Leadership::default();
        let (_running, running) = leadership.grant();
        let (stopped_sender, _stopped) = leadership.grant();
        // The manager stopped one runtime itself.
        stopped_sender.send_replace(false);
        assert!(*running.borrow());
        assert_eq!(leadership.revoke(), 1);
        assert!(!*running.borrow());
        let (_, while_fenced) = leadership.grant();
        assert!(!*while_fenced.borrow(), "no runtime leads while fenced");
        leadership.restore();
        assert!(!*running.borrow() && !*while_fenced.borrow());
        let (_, after) = leadership.grant();
        assert!(*after.borrow());
    }

    #[test]
    fn lease_names_are_dns_safe_and_distinct() {
        assert_eq!(lease_name("bc", "pod-0"), "bc-pod-0");
        let upper = lease_name("bc", "Pod_0");
        assert!(upper.starts_with("bc-pod-0-"), "{upper}");
        assert_ne!(upper, lease_name("bc", "pod-0"));
        assert_ne!(lease_name("bc", "Pod_0"), lease_name("bc", "Pod:0"));
        assert!(lease_name("bc", "a.-b").starts_with("bc-a--b-"));
        let long = lease_name("bc", &"x".repeat(400));
        assert!(long.len() <= 253, "{}", long.len());
        assert!(long.chars().last().unwrap().is_ascii_alphanumeric());
        assert_eq!(group_label("bootstrap-controller"), "bootstrap-controller");
        assert!(group_label(&"g".repeat(100)).len() <= 63);
    }
}

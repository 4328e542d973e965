//! Sharing tenants between replicas, coordinated through `coordination.k8s.io/v1` Leases: each
//! replica announces itself with its own Lease (labelled with the group), follows the others'
//! through one watch, and assigns every tenant to one live replica by rendezvous hashing.
//!
//! "Never two writers" rests on two rules:
//!
//! - Acknowledged views. A membership change gives a new view id. The manager stops the tenants
//!   it no longer owns, then acknowledges the id (an annotation on its Lease). A replica starts a
//!   tenant it newly owns only once every live member's Lease carries that id, so the previous
//!   owner has stopped it. This replica's own acknowledgement counts only once the watch has
//!   delivered it back: the watch is one ordered stream, so by then every other Lease is seen at
//!   least as recently as that write, and two replicas cannot each see the other agree with a
//!   different view.
//! - Fencing. Liveness is judged like client-go's leader election: a Lease is live while it
//!   changed within its duration, by the observer's own clock (so clocks need not agree). A
//!   replica whose own renewals have not succeeded for `lease_duration - renew_grace` since one
//!   was sent publishes `fenced` and owns nothing, before any other replica can judge it dead.
//!   The renew grace is the time the manager has to stop its tenants once fenced, so it must
//!   exceed how long stopping them takes (plus clock rate drift between replicas).
//!
//! At rest the only requests are this replica's renewals (every third of the Lease duration, or
//! half the time to the fence if that is shorter): no reads, no polling. A read happens only
//! after a lost compare-and-swap, and a Lease unchanged for five Lease durations (a replica
//! gone for good) is deleted by whichever survivor gets there first.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
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

/// Where the replica Leases live and how this replica keeps its own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardSettings {
    /// Namespace of the replica Leases.
    pub namespace: String,
    /// Leases are named `<group>-<identity>` and labelled `REPLICA_LABEL=<group>`.
    pub group: String,
    /// This replica.
    pub identity: String,
    pub lease_duration: Duration,
    /// How long before the others could judge this replica dead it stops owning anything.
    pub renew_grace: Duration,
}

/// Which replicas are live, as this replica sees them, and whether they all agree.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct View {
    /// Stable hash of the sorted live member identities.
    pub id: u64,
    /// Sorted live identities, including this replica once its Lease is written.
    pub members: Arc<[String]>,
    pub me: String,
    /// Every live member's Lease acknowledges `id`.
    pub settled: bool,
    /// This replica cannot prove its own Lease is current: it owns nothing.
    pub fenced: bool,
}

impl View {
    /// No sharding (one replica): owns everything.
    pub fn single(me: &str) -> View {
        View::new(vec![me.to_owned()], me, true, false)
    }

    fn new(members: Vec<String>, me: &str, settled: bool, fenced: bool) -> View {
        View {
            id: view_id(&members),
            members: Arc::from(members),
            me: me.to_owned(),
            settled,
            fenced,
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

fn view_id(sorted_members: &[String]) -> u64 {
    let mut hasher = StableHasher::new();
    for member in sorted_members {
        hasher.write_str(member);
    }
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

/// Following the replicas: announcing this one, and publishing views.
///
/// The manager's side of the protocol, on every view it receives: stop the tenants it does not
/// [own](View::owns) (all of them when `fenced`), then [`ack`](Shards::ack) the view's id; start
/// the tenants it owns but does not run only when the view is `settled`, and keep running those
/// it ran before and still owns. On shutdown: cancel, stop every tenant, then
/// [`stopped`](Shards::stopped).
///
/// The client's watch must not be cut by a short read timeout, or it would relist (read) at
/// every timeout; each write is bounded here instead.
pub struct Shards {
    pub views: watch::Receiver<View>,
    acks: watch::Sender<Option<u64>>,
    task: JoinHandle<bool>,
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
        let now = Instant::now();
        let state = State::new(&settings, name.clone());
        let (views, receiver) = watch::channel(state.view(now));
        let (acks, ack_receiver) = watch::channel(None);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &settings.namespace);
        let span = info_span!(
            "shards",
            group = %settings.group,
            identity = %settings.identity
        );
        let release_timeout = settings.renew_grace.max(Duration::from_secs(1));
        let task = tokio::spawn(
            follow(client, settings, state, views, ack_receiver, cancel).instrument(span),
        );
        Shards {
            views: receiver,
            acks,
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

    /// Waits for the task to end after cancel, then deletes this replica's Lease so the others
    /// take over its tenants at once. Call it once this replica's tenants have stopped: the
    /// deletion is the hand-over.
    pub async fn stopped(self) {
        let written = match self.task.await {
            Ok(written) => written,
            Err(err) => {
                warn!(error = %err, "the shard task failed; releasing its Lease anyway");
                true
            }
        };
        if !written {
            return;
        }
        let params = DeleteParams::default();
        let delete = self.leases.delete(&self.name, &params);
        match tokio::time::timeout(self.release_timeout, delete).await {
            Ok(Ok(_)) => info!(lease = %self.name, "released the replica Lease"),
            Ok(Err(kube::Error::Api(status))) if status.code == 404 => {}
            Ok(Err(err)) => {
                warn!(error = %err, lease = %self.name, "could not release the replica Lease; it expires on its own")
            }
            Err(_) => {
                warn!(lease = %self.name, "releasing the replica Lease timed out; it expires on its own")
            }
        }
    }
}

/// Another replica's Lease, as last seen.
#[derive(Debug)]
struct Member {
    identity: String,
    ack: Option<u64>,
    duration: Duration,
    /// Holder and renew time: a change is a sign of life.
    record: (Option<String>, Option<Timestamp>),
    /// When `record` last changed, by this replica's clock.
    changed_at: Instant,
    version: Option<String>,
    /// When to delete the Lease if it has not changed by then (see [`State::cleanup_after`]).
    cleanup_at: Instant,
}

impl Member {
    fn alive(&self, now: Instant) -> bool {
        now < self.changed_at + self.duration
    }
}

#[derive(Debug)]
struct State {
    identity: String,
    name: String,
    group_label: String,
    duration: Duration,
    renew_every: Duration,
    fence_span: Duration,
    /// A Lease unchanged this long belongs to a replica that is gone for good (a replaced pod
    /// under a new name): deleting it keeps the group's Leases from piling up.
    cleanup_after: Duration,
    others: BTreeMap<String, Member>,
    /// Whether the Lease is believed to exist (`None`: unknown, try creating it).
    exists: Option<bool>,
    /// resourceVersion of this replica's last successful write.
    written_version: Option<String>,
    /// resourceVersion of the write the watch must deliver back before this replica may call a
    /// view settled: the last one that changed the acknowledgement or ended a fence.
    sync_version: Option<String>,
    /// resourceVersion of this replica's Lease as the watch last delivered it.
    seen_version: Option<String>,
    /// When the last successful write was sent.
    renewed_at: Option<Instant>,
    written_ack: Option<u64>,
    acquired: Option<Timestamp>,
    stopping: bool,
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
            cleanup_after: duration * 5,
            others: BTreeMap::new(),
            exists: None,
            written_version: None,
            sync_version: None,
            seen_version: None,
            renewed_at: None,
            written_ack: None,
            acquired: None,
            stopping: false,
        }
    }

    fn fenced(&self, now: Instant) -> bool {
        self.stopping || self.renewed_at.is_none_or(|at| now >= at + self.fence_span)
    }

    fn view(&self, now: Instant) -> View {
        let fenced = self.fenced(now);
        let joined = self.renewed_at.is_some() && !self.stopping;
        let live: Vec<&Member> = self
            .others
            .values()
            .filter(|m| m.identity != self.identity && m.alive(now))
            .collect();
        let mut members: BTreeSet<&str> = live.iter().map(|m| m.identity.as_str()).collect();
        if joined {
            members.insert(&self.identity);
        }
        let members: Vec<String> = members.into_iter().map(str::to_owned).collect();
        let id = view_id(&members);
        let settled = joined
            && !fenced
            && self.written_ack == Some(id)
            && at_least(self.seen_version.as_deref(), self.sync_version.as_deref())
            && live.iter().all(|m| m.ack == Some(id));
        View::new(members, &self.identity, settled, fenced)
    }

    /// Records a Lease the watch delivered.
    fn observe(&mut self, lease: &Lease, now: Instant) {
        let Some(name) = lease.metadata.name.as_deref() else {
            return;
        };
        if name == self.name {
            self.seen_version
                .clone_from(&lease.metadata.resource_version);
            return;
        }
        let spec = lease.spec.as_ref();
        let Some(identity) = spec
            .and_then(|s| s.holder_identity.as_deref())
            .filter(|h| !h.is_empty())
        else {
            self.others.remove(name);
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
        let ack = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(VIEW_ANNOTATION))
            .and_then(|v| v.parse().ok());
        let (changed_at, cleanup_at) = match self.others.get(name) {
            Some(known) if known.record == record => (known.changed_at, known.cleanup_at),
            _ => (now, now + duration.max(self.cleanup_after)),
        };
        self.others.insert(
            name.to_owned(),
            Member {
                identity: identity.to_owned(),
                ack,
                duration,
                record,
                changed_at,
                version: lease.metadata.resource_version.clone(),
                cleanup_at,
            },
        );
    }

    fn forget(&mut self, lease: &Lease) {
        let Some(name) = lease.metadata.name.as_deref() else {
            return;
        };
        if name == self.name {
            if !self.stopping && self.renewed_at.is_some() {
                // The others may already be taking over: own nothing until it is written again.
                warn!(
                    "this replica's Lease was deleted by someone else; fenced until it is recreated"
                );
            }
            self.seen_version = None;
            self.exists = Some(false);
            self.renewed_at = None;
            return;
        }
        self.others.remove(name);
    }

    /// A relist: the Leases now in the group replace what was known.
    fn relisted(&mut self, leases: &[Lease], now: Instant) {
        let names: BTreeSet<&str> = leases
            .iter()
            .filter_map(|l| l.metadata.name.as_deref())
            .collect();
        self.others.retain(|name, _| names.contains(name.as_str()));
        for lease in leases {
            self.observe(lease, now);
        }
    }

    /// When the next write is due, if nothing else asks for one sooner.
    fn renewal_due(&self, ack: Option<u64>) -> Option<Instant> {
        match self.renewed_at {
            Some(at) if self.written_ack == ack => Some(at + self.renew_every),
            _ => None,
        }
    }

    /// The earliest time the view changes with no event: a member expiring, or this replica
    /// becoming fenced.
    fn next_change(&self, now: Instant) -> Option<Instant> {
        let fence = self
            .renewed_at
            .map(|at| at + self.fence_span)
            .filter(|at| *at > now);
        self.others
            .values()
            .flat_map(|m| [m.changed_at + m.duration, m.cleanup_at])
            .filter(|at| *at > now)
            .chain(fence)
            .min()
    }

    /// The Leases due for deletion (name and the resourceVersion they must still have), each
    /// rescheduled in case the deletion fails.
    fn due_for_cleanup(&mut self, now: Instant) -> Vec<(String, Option<String>)> {
        let mut due = Vec::new();
        for (name, member) in &mut self.others {
            if member.cleanup_at <= now {
                member.cleanup_at = now + self.cleanup_after;
                due.push((name.clone(), member.version.clone()));
            }
        }
        due
    }

    fn desired(&self, ack: Option<u64>) -> Lease {
        let now = MicroTime(Timestamp::now());
        Lease {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(BTreeMap::from([(
                    REPLICA_LABEL.to_owned(),
                    self.group_label.clone(),
                )])),
                annotations: ack
                    .map(|id| BTreeMap::from([(VIEW_ANNOTATION.to_owned(), id.to_string())])),
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
                acquire_time: Some(MicroTime(self.acquired.unwrap_or(now.0))),
                renew_time: Some(now),
                ..LeaseSpec::default()
            }),
        }
    }
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
    ack: Option<u64>,
) -> Result<Lease, WriteError> {
    let params = PostParams::default();
    // Each round fixes one obstacle: a missing namespace, an unknown or stale resourceVersion.
    for _ in 0..4 {
        let mut desired = state.desired(ack);
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
            desired = state.desired(ack);
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

fn publish(sender: &watch::Sender<View>, view: View) {
    sender.send_if_modified(|current| {
        if *current == view {
            return false;
        }
        if current.fenced != view.fenced {
            if view.fenced {
                warn!("fenced: cannot prove this replica's Lease is current; owning nothing");
            } else {
                info!("no longer fenced");
            }
        }
        if current.members != view.members {
            info!(members = ?view.members, view = view.id, "replica membership changed");
        } else if current.settled != view.settled {
            debug!(
                view = view.id,
                settled = view.settled,
                "view settlement changed"
            );
        }
        *current = view;
        true
    });
}

async fn follow(
    client: kube::Client,
    settings: ShardSettings,
    mut state: State,
    views: watch::Sender<View>,
    mut acks: watch::Receiver<Option<u64>>,
    cancel: CancellationToken,
) -> bool {
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
        publish(&views, state.view(now));
        let ack = *acks.borrow();
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
                publish(&views, state.view(now));
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
                let was_fenced = state.fenced(now);
                // The write may not outlast this replica's authority: kube's client retries 429
                // and 503 answers after their Retry-After, which could outlast the Lease.
                let deadline = match state.renewed_at {
                    Some(at) if !was_fenced => at + state.fence_span,
                    _ => now + state.duration,
                };
                let sent = Instant::now();
                let result = tokio::time::timeout_at(
                    deadline,
                    write(&leases, &namespaces, &mut state, ack),
                )
                .await
                .unwrap_or_else(|_| Err(WriteError::TimedOut(deadline - sent)));
                match result {
                    Ok(lease) => {
                        if was_fenced || state.written_ack != ack {
                            state.sync_version.clone_from(&lease.metadata.resource_version);
                        }
                        state.written_version = lease.metadata.resource_version;
                        state.exists = Some(true);
                        state.renewed_at = Some(sent);
                        state.written_ack = ack;
                        state.acquired = lease
                            .spec
                            .and_then(|s| s.acquire_time)
                            .map(|t| t.0);
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
    publish(&views, state.view(Instant::now()));
    info!("left the replica group");
    state.exists != Some(false)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Computed independently of this code, from the FNV-1a and splitmix64 definitions.
    const PINNED_VIEW: u64 = 0x2c5b_7173_ce31_6e36;
    const PINNED_WEIGHT: u64 = 0xbbf1_216c_4bc4_75aa;

    fn view(members: &[&str], me: &str) -> View {
        View::new(
            members.iter().map(|m| (*m).to_owned()).collect(),
            me,
            true,
            false,
        )
    }

    #[test]
    fn the_hash_is_stable_across_builds() {
        // Replicas built by different toolchains must agree on owners and view ids.
        assert_eq!(view_id(&["a".to_owned(), "b".to_owned()]), PINNED_VIEW);
        assert_eq!(weight("a", "ns/t"), PINNED_WEIGHT);
        let single = View::single("a");
        assert_eq!(single.id, view_id(&["a".to_owned()]));
        assert_eq!(weight("a", "t"), weight("a", "t"));
        assert_ne!(weight("ab", "c"), weight("a", "bc"));
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

    /// What `follow` records after a successful write.
    fn written(state: &mut State, at: Instant, ack: Option<u64>, version: u64, sync: bool) {
        state.renewed_at = Some(at);
        state.written_ack = ack;
        state.written_version = Some(version.to_string());
        if sync {
            state.sync_version = Some(version.to_string());
        }
    }

    #[tokio::test]
    async fn a_view_settles_once_every_live_lease_acknowledges_it_after_this_ones_own() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        let view = state.view(t0);
        assert!(view.fenced && !view.settled && view.members.is_empty());

        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        written(&mut state, t0, None, 6, true);
        let view = state.view(t0);
        assert_eq!(&*view.members, ["me".to_owned(), "other".to_owned()]);
        assert!(!view.fenced && !view.settled);

        written(&mut state, t0, Some(view.id), 7, true);
        state.observe(&lease("g-other", "other", 2, Some(view.id), 8), t0);
        assert!(
            !state.view(t0).settled,
            "this replica's acknowledgement is not seen back yet"
        );
        state.observe(&lease("g-me", "me", 0, Some(view.id), 7), t0);
        assert!(state.view(t0).settled);

        // A renewal changing nothing else keeps the view settled while the watch lags.
        written(&mut state, t0, Some(view.id), 9, false);
        assert!(state.view(t0).settled);
        // A stale acknowledgement from the other replica unsettles it.
        state.observe(&lease("g-other", "other", 3, Some(1), 10), t0);
        assert!(!state.view(t0).settled);
    }

    #[tokio::test]
    async fn members_expire_by_this_replicas_clock_and_fencing_comes_first() {
        let t0 = Instant::now();
        let mut state = State::new(&settings(), lease_name("g", "me"));
        state.observe(&lease("g-other", "other", 1, None, 5), t0);
        // Seen again unchanged (a relist): no sign of life.
        state.observe(
            &lease("g-other", "other", 1, None, 5),
            t0 + Duration::from_secs(10),
        );
        let renewed = t0 + Duration::from_secs(5);
        written(&mut state, renewed, None, 6, true);
        let at = |s: u64| t0 + Duration::from_millis(s);
        assert_eq!(state.view(at(14_999)).members.len(), 2);
        assert_eq!(&*state.view(at(15_000)).members, ["me".to_owned()]);
        // Own renewals failing: fenced at lease duration less grace after the last one was sent,
        // before the others can see this replica's Lease expire.
        assert!(!state.view(renewed + Duration::from_millis(9_999)).fenced);
        assert!(state.view(renewed + Duration::from_secs(10)).fenced);
        assert_eq!(
            state.next_change(renewed),
            Some(renewed + Duration::from_secs(10))
        );
        assert!(!state.view(renewed + Duration::from_secs(10)).owns("t"));
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

//! Sharing tenants between replicas, coordinated through `coordination.k8s.io/v1` Leases: each
//! replica announces itself with its own Lease (labelled with the group), follows the others'
//! through one watch, and assigns every tenant to one live replica by rendezvous hashing.
//!
//! "Never two writers" rests on two rules:
//!
//! - Acknowledged views. A view is the set of live replicas, each with its incarnation (the
//!   `acquireTime` of its Lease, new whenever it joins or rejoins after a fence); its id is a
//!   hash of both. The manager stops the tenants it no longer owns, then acknowledges the id (an
//!   annotation on its Lease). A replica starts a tenant it newly owns only once every live
//!   replica's Lease carries that id, so the previous owner has stopped it. This replica's own
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

//!
//! By file: `view.rs` (the view and rendezvous hashing, the runtimes' leadership, Lease names),
//! `state.rs` (what this replica has seen of the others' Leases and what follows: liveness,
//! fences, the view), `write.rs` (writing and deleting Leases by compare-and-swap); this module
//! runs the protocol.

mod state;
mod view;
mod write;

use std::time::Duration;

use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::LeaderElection;
use state::State;
pub(crate) use view::hash_suffix;
pub use view::{Leadership, View, group_label, lease_name};
use write::{WriteError, clean_up, code, write};

/// Label on every replica Lease; its value is the group.
pub const REPLICA_LABEL: &str = "bootstrap-controller.io/replica-of";
/// Annotation on a replica Lease: the view id its manager acknowledged.
pub const VIEW_ANNOTATION: &str = "bootstrap-controller.io/view";
/// Annotation on the Lease of a fenced replica, which owns nothing: its tenants have stopped
/// within this many milliseconds of the annotation being seen (0: they have stopped already).
pub const FENCED_ANNOTATION: &str = "bootstrap-controller.io/fenced";

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
    ///
    /// The replica Leases live in the election's namespace, named `<group>-<identity>` and
    /// labelled `REPLICA_LABEL=<group>`, the group being the election's Lease name. The Lease
    /// duration is also the deadline for the manager to acknowledge a view, and for the watch to
    /// deliver this replica's own write back; the renew grace is how long before the others
    /// could judge this replica dead it stops owning anything.
    pub fn spawn(
        client: kube::Client,
        election: LeaderElection,
        cancel: CancellationToken,
    ) -> Shards {
        let name = lease_name(&election.lease_name, &election.identity);
        let mut state = State::new(&election, name.clone());
        let view = state.current(Instant::now(), None);
        let leadership = Leadership::default();
        if view.fenced {
            leadership.revoke();
        }
        let (views, receiver) = watch::channel(view);
        let (acks, ack_receiver) = watch::channel(None);
        let leases: Api<Lease> = Api::namespaced(client.clone(), &election.lease_namespace);
        let span = info_span!(
            "shards",
            group = %election.lease_name,
            identity = %election.identity
        );
        let release_timeout = election.renew_grace.max(Duration::from_secs(1));
        let following = Following {
            views,
            acks: ack_receiver,
            leadership: leadership.clone(),
        };
        let task =
            tokio::spawn(follow(client, election, state, following, cancel).instrument(span));
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
        if current.replicas != view.replicas {
            info!(replicas = ?view.replicas, view = view.id, "replica membership changed");
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
    election: LeaderElection,
    mut state: State,
    following: Following,
    cancel: CancellationToken,
) -> Left {
    let Following {
        views,
        mut acks,
        leadership,
    } = following;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &election.lease_namespace);
    let namespaces = reconcilers::lease::LeaseNamespaces::new(
        client.clone(),
        reconcilers::events::reporter(&election.identity),
        "replica-group",
    );
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
    info!(lease = %state.name, namespace = %election.lease_namespace, "joining the replica group");
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
                let Some(event) = event else { break };
                watched(&mut state, &mut listing, &mut watch_failure, event);
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
                let result = renew(&leases, &namespaces, &mut state, ack).await;
                match result {
                    Ok(()) => {
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

/// One event of the replica Lease watch: a relist is taken whole once it is complete.
fn watched(
    state: &mut State,
    listing: &mut Option<Vec<Lease>>,
    failure: &mut reconcilers::findings::RepeatedFailure,
    event: Result<watcher::Event<Lease>, watcher::Error>,
) {
    let now = Instant::now();
    match event {
        Ok(watcher::Event::Init) => *listing = Some(Vec::new()),
        Ok(watcher::Event::InitApply(lease)) => {
            listing.get_or_insert_with(Vec::new).push(lease);
        }
        Ok(watcher::Event::InitDone) => {
            state.relisted(&listing.take().unwrap_or_default(), now);
            failure.succeeded();
        }
        Ok(watcher::Event::Apply(lease)) => state.observe(&lease, now),
        Ok(watcher::Event::Delete(lease)) => state.forget(&lease),
        Err(err) => {
            if failure.is_new(&err) {
                warn!(error = %err, "the replica Lease watch failed; retrying with backoff");
            } else {
                debug!(error = %err, "the replica Lease watch failed again");
            }
        }
    }
}

/// Writes this replica's Lease (with the view acknowledged, `ack`), within its authority.
async fn renew(
    leases: &Api<Lease>,
    namespaces: &reconcilers::lease::LeaseNamespaces,
    state: &mut State,
    ack: Option<u64>,
) -> Result<(), WriteError> {
    let now = Instant::now();
    // The write may not outlast this replica's authority: kube's client retries 429 and 503
    // answers after their Retry-After, which could outlast the Lease.
    let deadline = match state.renewed_at {
        Some(at) if state.fence.is_none() => at + state.fence_span,
        _ => now + state.duration,
    };
    let content = state.content(ack);
    let sent = Instant::now();
    let lease = tokio::time::timeout_at(deadline, write(leases, namespaces, state, &content))
        .await
        .unwrap_or_else(|_| Err(WriteError::TimedOut(deadline - sent)))?;
    state.wrote(lease, content, sent);
    Ok(())
}

#[cfg(test)]
mod tests;

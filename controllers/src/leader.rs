//! Leader election among replicas, with a `coordination.k8s.io/v1` Lease, as client-go's
//! leaderelection does it, with two differences that keep a quiet cluster quiet: every replica
//! learns the Lease from a watch instead of reading it before each step, and the leader renews
//! with one compare-and-swap write (the resourceVersion it last wrote or saw), no read. A
//! standby only writes when the Lease has gone unchanged for its whole duration, by its own
//! clock (so clocks need not agree), and a lost race is a conflict, never two leaders.
//!
//! The result is a `watch::Receiver<bool>` the runner gates leader-only loops on. The election
//! task never ends the process: when the API is unavailable it keeps retrying, and it steps down
//! (publishes `false`) as soon as a renewal fails, because another replica may take the Lease
//! once it expires. A renewal that succeeds again proves nobody else took it in between.
//!
//! Why not kube-lease-manager: it reads the Lease after every renewal and polls it while a
//! standby waits, so three idle replicas sent a Lease GET every few seconds; this election sends
//! no read at rest (`e2e/tests/quiet_at_rest.rs`), only the leader's renewal writes.

use std::time::Duration;

use backon::BackoffBuilder;
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use reconcilers::lease::{self, Liveness};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::LeaderElection;
use crate::health::{CheckState, Health};

/// Name of the leader-election check in `/readyz`.
pub const READYZ_CHECK: &str = "leader-election";

/// Leadership metrics: whether this replica leads, and how often that changed.
#[derive(Clone, Default)]
pub struct LeaderMetrics {
    is_leader: Gauge,
    transitions: Counter,
}

impl LeaderMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = LeaderMetrics::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader-election Lease (always 1 with election off)",
            metrics.is_leader.clone(),
        );
        registry.register(
            "leader_transitions",
            "Times this replica gained or lost leadership",
            metrics.transitions.clone(),
        );
        metrics
    }
}

/// Leadership without election: every loop runs ungated. `leads` is what the `leader` gauge
/// reports: true with election off, false for a dry run. A dry run's passes write nothing, so
/// they need no leader to keep two writers apart, and it joins no election: taking the Lease
/// would make the real replicas wait for a process that repairs nothing.
pub fn without_election(metrics: &LeaderMetrics, leads: bool) -> watch::Receiver<bool> {
    metrics.is_leader.set(i64::from(leads));
    // Dropping the sender is fine: the runner treats a closed channel as "no more changes".
    let (_sender, receiver) = watch::channel(true);
    receiver
}

/// A client for the election whose requests time out, so a hung API cannot keep this replica
/// believing it leads after its Lease expired: renewals start a renew grace before expiry, and
/// connecting plus answering must fit in it.
/// `kubeconfig` is the file `config` came from (see [`crate::client::build`]).
pub fn election_client(
    config: &kube::Config,
    kubeconfig: Option<&std::path::Path>,
    renew_grace: Duration,
) -> kube::Result<kube::Client> {
    let timeout = (renew_grace / 2).max(Duration::from_millis(500));
    let mut config = config.clone();
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    crate::client::build(&config, kubeconfig)
}

/// The clients the election uses: writes must time out (see [`election_client`]), while the
/// watch must not, or an idle watch would be cut at every read timeout.
#[derive(Clone)]
pub struct ElectionClients {
    pub watch: kube::Client,
    pub write: kube::Client,
}

impl From<kube::Client> for ElectionClients {
    fn from(client: kube::Client) -> Self {
        Self {
            watch: client.clone(),
            write: client,
        }
    }
}

/// Starts the election. The task runs until `cancel` fires, then releases the Lease (bounded by
/// the renew grace) so another replica can take over at once. `settings.identity` is the
/// holder this replica writes: the effective configuration's, never empty.
///
/// `health` gets a `leader-election` readiness check: failing until the replica has joined the
/// election and while it cannot reach the API, so a replica that cannot reach the API is never a
/// "ready standby".
pub fn spawn(
    clients: ElectionClients,
    settings: LeaderElection,
    metrics: LeaderMetrics,
    health: Health,
    cancel: CancellationToken,
) -> (watch::Receiver<bool>, JoinHandle<()>) {
    let (sender, receiver) = watch::channel(false);
    metrics.is_leader.set(0);
    health.set_check(
        READYZ_CHECK,
        CheckState::Failing("not joined the election yet".to_owned()),
    );
    let span = info_span!(
        "leader_election",
        lease = %format!("{}/{}", settings.lease_namespace, settings.lease_name),
        identity = %settings.identity
    );
    let task =
        tokio::spawn(elect(clients, settings, metrics, health, sender, cancel).instrument(span));
    (receiver, task)
}

fn publish(sender: &watch::Sender<bool>, metrics: &LeaderMetrics, health: &Health, leader: bool) {
    health.set_leading(leader);
    let changed = sender.send_if_modified(|current| {
        let changed = *current != leader;
        *current = leader;
        changed
    });
    if changed {
        metrics.is_leader.set(i64::from(leader));
        metrics.transitions.inc();
        if leader {
            info!("became the leader");
        } else {
            info!("no longer the leader");
        }
    }
}

fn role(leader: bool) -> String {
    if leader { "leader" } else { "standby" }.to_owned()
}

/// What the election knows of the Lease, and what it does next.
#[derive(Debug)]
struct Election {
    identity: String,
    duration: Duration,
    renew_grace: Duration,
    /// The Lease as last seen (watch, write answer or read); `None` while it does not exist.
    lease: Option<Lease>,
    /// Whether `lease` is known: the watch has listed, or a write or read told.
    known: bool,
    /// When the holder or renew time last changed, by this replica's clock: a standby takes
    /// over only after a whole lease duration without change.
    liveness: Liveness,
    /// When this replica's last successful write (as holder) was sent.
    renewed_at: Option<Instant>,
    /// The renew times (in the Lease's microseconds) of this process's last writes, sent or
    /// answered: a Lease naming this identity is this process's only with one of them. The
    /// identity is stable across restarts, so a Lease naming it may be a previous life's (or a
    /// duplicate's, given the same identity by mistake), which is taken over only as any other
    /// holder's: after a whole duration without change.
    written: std::collections::VecDeque<i64>,
    leading: bool,
}

/// How many of this process's renew times [`Election::written`] keeps: a write whose answer was
/// lost (a timeout) may still have landed, and the next ones are sent before it is seen.
const WRITTEN_KEPT: usize = 4;

/// The election's next write.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Create,
    /// Take over a Lease without a live holder.
    Acquire,
    /// Renew (or take back) the Lease this replica holds.
    Renew,
    Wait(Instant),
    /// Nothing is known yet: wait for the watch.
    Observe,
}

impl Election {
    fn new(settings: &LeaderElection, now: Instant) -> Self {
        Self {
            identity: settings.identity.clone(),
            duration: settings.lease_duration,
            renew_grace: settings.renew_grace,
            lease: None,
            known: false,
            liveness: Liveness::new(now),
            renewed_at: None,
            written: std::collections::VecDeque::new(),
            leading: false,
        }
    }

    /// Whether the Lease names this identity with a renewal this process wrote.
    fn holds(&self) -> bool {
        let renewed = self
            .lease
            .as_ref()
            .and_then(|l| l.spec.as_ref())
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0.as_microsecond());
        self.holder() == Some(self.identity.as_str())
            && renewed.is_some_and(|at| self.written.contains(&at))
    }

    /// Notes a write about to be sent, so its answer (or its echo in the watch) is known as this
    /// process's.
    fn sending(&mut self, lease: &Lease) {
        if let Some(at) = lease.spec.as_ref().and_then(|s| s.renew_time.as_ref()) {
            if self.written.len() == WRITTEN_KEPT {
                self.written.pop_front();
            }
            self.written.push_back(at.0.as_microsecond());
        }
    }

    fn holder(&self) -> Option<&str> {
        self.lease
            .as_ref()
            .and_then(|l| l.spec.as_ref())
            .and_then(|s| s.holder_identity.as_deref())
            .filter(|h| !h.is_empty())
    }

    /// Records a Lease seen through the watch, a write's answer or a read. An answer older than
    /// what is known (by resourceVersion) is ignored.
    fn observe(&mut self, lease: Option<Lease>, now: Instant) {
        let version = |l: &Lease| {
            l.metadata
                .resource_version
                .as_deref()
                .and_then(|v| v.parse::<u64>().ok())
        };
        if let (Some(new), Some(old)) = (&lease, &self.lease)
            && let (Some(new), Some(old)) = (version(new), version(old))
            && new < old
        {
            return;
        }
        self.liveness.observe(lease.as_ref(), now);
        self.lease = lease;
        self.known = true;
    }

    fn next_step(&self, now: Instant) -> Step {
        if !self.known {
            return Step::Observe;
        }
        let Some(lease) = &self.lease else {
            return Step::Create;
        };
        match self.holder() {
            Some(_) if self.holds() => match self.renewed_at {
                Some(at) if self.leading => {
                    let due = at + self.duration.saturating_sub(self.renew_grace);
                    if due > now {
                        Step::Wait(due)
                    } else {
                        Step::Renew
                    }
                }
                _ => Step::Renew,
            },
            None => Step::Acquire,
            Some(_) => {
                let duration = lease::duration(lease).unwrap_or(self.duration);
                let expires = self.liveness.expires(duration);
                if expires > now {
                    Step::Wait(expires)
                } else {
                    Step::Acquire
                }
            }
        }
    }

    /// The Lease to write for `step`: this replica as holder, renewed now (in whole
    /// microseconds, as the API stores it, so the answer is recognised as this write).
    fn desired(&self, step: &Step) -> Lease {
        let now = Timestamp::now();
        let now = MicroTime(Timestamp::from_microsecond(now.as_microsecond()).unwrap_or(now));
        let mut lease = self.lease.clone().unwrap_or_default();
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if *step != Step::Renew || spec.acquire_time.is_none() {
            spec.acquire_time = Some(now.clone());
        }
        if matches!(step, Step::Acquire) {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = i32::try_from(self.duration.as_secs()).ok();
        lease.metadata.managed_fields = None;
        lease
    }
}

async fn elect(
    clients: ElectionClients,
    settings: LeaderElection,
    metrics: LeaderMetrics,
    health: Health,
    sender: watch::Sender<bool>,
    cancel: CancellationToken,
) {
    if !join(&clients.write, &settings, &health, &cancel).await {
        return;
    }
    let mut watch = watcher(
        Api::<Lease>::namespaced(clients.watch.clone(), &settings.lease_namespace),
        watcher::Config::default().fields(&format!("metadata.name={}", settings.lease_name)),
    )
    .default_backoff()
    .boxed();
    let mut elector = Elector {
        leases: Api::namespaced(clients.write.clone(), &settings.lease_namespace),
        election: Election::new(&settings, Instant::now()),
        delays: backoff(&settings),
        settings,
        metrics,
        health,
        sender,
        listing: None,
        failing: false,
        failing_transiently: false,
        watch_failure: reconcilers::findings::RepeatedFailure::default(),
        retry_at: None,
    };
    loop {
        let step = elector.election.next_step(Instant::now());
        let wake = match (&step, elector.retry_at) {
            (_, Some(at)) => Some(at),
            (Step::Wait(at), None) => Some(*at),
            (Step::Observe, None) => None,
            _ => Some(Instant::now()),
        };
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            _ = sleep_until(wake) => {
                elector.retry_at = None;
                if !matches!(step, Step::Wait(_) | Step::Observe) {
                    elector.take_step(step).await;
                }
            }
            event = watch.next() => match event {
                Some(event) => elector.on_event(event),
                None => break,
            },
        }
    }
    elector.step_down_on_exit().await;
}

fn backoff(settings: &LeaderElection) -> backon::ExponentialBackoff {
    reconcilers::retry::backoff(
        Duration::from_millis(500),
        settings.renew_grace.max(Duration::from_secs(1)),
    )
    .build()
}

/// Waits until the Lease's namespace exists (on a fresh control plane kube-system may not yet,
/// and the loop that creates it runs only on the leader); false when cancelled first.
async fn join(
    client: &kube::Client,
    settings: &LeaderElection,
    health: &Health,
    cancel: &CancellationToken,
) -> bool {
    let mut delays = backoff(settings);
    let mut failure = reconcilers::findings::RepeatedFailure::default();
    // A fresh cluster's `kube-system` exists; a namespace of the operator's choosing may not.
    let namespaces = lease::LeaseNamespaces::new(
        client.clone(),
        reconcilers::events::reporter(&settings.identity),
        "leader-election",
    );
    while let Err(err) = namespaces.ensure(&settings.lease_namespace).await {
        let delay = delays.next().unwrap_or(settings.renew_grace);
        health.set_check(
            READYZ_CHECK,
            CheckState::Failing(format!(
                "cannot reach the API to join the election: {}",
                crate::client::describe(&err)
            )),
        );
        if failure.is_new(&err) {
            warn!(error = %err, retry_in = ?delay, namespace = %settings.lease_namespace, "cannot ensure the leader-election Lease's namespace exists; retrying (the same failure again is logged at debug level)");
        } else {
            debug!(error = %err, retry_in = ?delay, "cannot ensure the leader-election Lease's namespace exists, again");
        }
        tokio::select! {
            _ = cancel.cancelled() => return false,
            _ = tokio::time::sleep(delay) => {}
        }
    }
    info!("joined leader election");
    health.set_check(
        READYZ_CHECK,
        CheckState::Failing("joined; waiting to learn which replica leads".to_owned()),
    );
    true
}

/// One replica's part in the election: what it knows of the Lease, and what it tells the
/// loops, the metrics and `/readyz`.
struct Elector {
    settings: LeaderElection,
    metrics: LeaderMetrics,
    health: Health,
    sender: watch::Sender<bool>,
    leases: Api<Lease>,
    election: Election,
    /// Filled by a listing watch; turned into the known state at its end.
    listing: Option<Option<Lease>>,
    /// Whether the last write failed for another reason than a lost race.
    failing: bool,
    /// Whether that failure may pass by itself (no answer, a timeout, 404, 429, 5xx) rather
    /// than be a refusal (400, 401, 403, 422) that only a successful write can show is over.
    failing_transiently: bool,
    /// The Lease watch's failures, each warned about once.
    watch_failure: reconcilers::findings::RepeatedFailure,
    delays: backon::ExponentialBackoff,
    retry_at: Option<Instant>,
}

impl Elector {
    /// Creates or renews the Lease as `step` says, and learns from the answer.
    async fn take_step(&mut self, step: Step) {
        let sent = Instant::now();
        let desired = self.election.desired(&step);
        self.election.sending(&desired);
        let params = PostParams::default();
        let settings = &self.settings;
        let leases = &self.leases;
        let write = async {
            match step {
                Step::Create => {
                    let mut desired = desired;
                    desired.metadata = ObjectMeta {
                        name: Some(settings.lease_name.clone()),
                        namespace: Some(settings.lease_namespace.clone()),
                        ..ObjectMeta::default()
                    };
                    leases.create(&params, &desired).await
                }
                _ => {
                    leases
                        .replace(&settings.lease_name, &params, &desired)
                        .await
                }
            }
        };
        // A leader's authority ends before its Lease could expire on a standby's clock,
        // whatever the renewal is doing: kube's client retries 429 and 503 answers after
        // their Retry-After, which could outlast the Lease.
        let authority_ends = self
            .election
            .renewed_at
            .filter(|_| self.election.leading)
            .map(|at| at + leadership_span(settings));
        let written = match authority_ends {
            Some(deadline) => tokio::time::timeout_at(deadline, write)
                .await
                .unwrap_or_else(|_| {
                    Err(kube::Error::Service(
                        "the renewal did not succeed before the Lease could expire".into(),
                    ))
                }),
            None => write.await,
        };
        match written {
            Ok(lease) => self.written(lease, sent),
            Err(err) => self.refused(err).await,
        }
    }

    fn written(&mut self, lease: Lease, sent: Instant) {
        self.election.observe(Some(lease), sent);
        self.election.renewed_at = Some(sent);
        self.election.leading = true;
        if self.failing {
            info!("leader election reaches the API again");
        }
        self.failing = false;
        self.delays = backoff(&self.settings);
        self.publish(true);
        self.health
            .set_check(READYZ_CHECK, CheckState::Passing(role(true)));
    }

    async fn refused(&mut self, err: kube::Error) {
        // Whoever wrote first leads; learn who (a read, only after a lost race).
        let raced = lease::is_conflict(&err);
        if self.election.leading {
            warn!(error = %err, "cannot renew the leader-election Lease; stepping down");
        } else if !raced && !self.failing {
            warn!(error = %err, "leader election cannot reach the API; retrying");
        }
        self.step_down();
        if raced {
            match self.leases.get_opt(&self.settings.lease_name).await {
                Ok(lease) => self.election.observe(lease, Instant::now()),
                Err(err) => debug!(error = %err, "cannot read the Lease after a lost race"),
            }
            self.health
                .set_check(READYZ_CHECK, CheckState::Passing(role(false)));
        } else {
            self.failing = true;
            // A 404 is the Lease deleted under a renewal: another replica may create it at
            // once, which is no refusal of this one.
            self.failing_transiently =
                !matches!(lease::status_code(&err), Some(400 | 401 | 403 | 422));
            self.health.set_check(
                READYZ_CHECK,
                CheckState::Failing(format!(
                    "cannot renew or observe the Lease: {}",
                    crate::client::describe(&err)
                )),
            );
            let delay = self.delays.next().unwrap_or(self.settings.renew_grace);
            self.retry_at = Some(Instant::now() + delay);
        }
    }

    fn on_event(&mut self, event: Result<watcher::Event<Lease>, watcher::Error>) {
        let now = Instant::now();
        match event {
            Ok(watcher::Event::Init) => self.listing = Some(None),
            Ok(watcher::Event::InitApply(lease)) => self.listing = Some(Some(lease)),
            Ok(watcher::Event::InitDone) => {
                self.election.observe(self.listing.take().flatten(), now);
            }
            // A watch that delivers is working: its next failure is news. A list alone is
            // not, as the watch after it may fail alike.
            Ok(watcher::Event::Apply(lease)) => {
                self.watch_failure.succeeded();
                self.election.observe(Some(lease), now);
            }
            Ok(watcher::Event::Delete(_)) => {
                self.watch_failure.succeeded();
                self.election.observe(None, now);
            }
            Err(err) => {
                if self.watch_failure.is_new(&err) {
                    warn!(error = %err, "cannot watch the leader-election Lease; retrying with backoff (the same failure again is logged at debug level)");
                } else {
                    debug!(error = %err, "leader-election Lease watch failed again");
                }
                // Until the watch has told who leads, its failure is the reason this replica
                // is neither leader nor standby.
                if !self.election.known {
                    self.health.set_check(
                        READYZ_CHECK,
                        CheckState::Failing(format!("cannot watch the Lease: {err}")),
                    );
                }
                return;
            }
        }
        // A failed write that left this replica a standby of a live leader is over when it was
        // the API's unavailability: the watch reaches the API, and there is nothing to write
        // until that leader's Lease expires. A refusal stays until a write succeeds.
        let standby =
            !self.election.leading && matches!(self.election.next_step(now), Step::Wait(_));
        if self.failing && self.failing_transiently && standby {
            info!("leader election reaches the API again");
            self.failing = false;
            self.delays = backoff(&self.settings);
        }
        if self.election.leading && !self.election.holds() {
            warn!(holder = ?self.election.holder(), "another replica holds the leader-election Lease; stepping down");
            self.step_down();
            self.health
                .set_check(READYZ_CHECK, CheckState::Passing(role(false)));
        } else if !self.failing && self.election.known && self.election.holder().is_some() {
            // A Lease without a holder is about to be taken: not yet a standby, nor a
            // leader, until this replica's write answers.
            self.health.set_check(
                READYZ_CHECK,
                CheckState::Passing(role(self.election.leading)),
            );
        }
    }

    fn publish(&self, leader: bool) {
        publish(&self.sender, &self.metrics, &self.health, leader);
    }

    fn step_down(&mut self) {
        self.election.leading = false;
        self.election.renewed_at = None;
        self.publish(false);
    }

    /// On the way out: no longer the leader, and a leader hands the Lease over at once (a
    /// Lease without a holder is free to take).
    async fn step_down_on_exit(self) {
        let was_leading = self.election.leading;
        self.publish(false);
        if !was_leading {
            return;
        }
        let mut released = self.election.desired(&Step::Renew);
        if let Some(spec) = released.spec.as_mut() {
            spec.holder_identity = None;
            spec.lease_duration_seconds = Some(1);
        }
        let params = PostParams::default();
        let release = self
            .leases
            .replace(&self.settings.lease_name, &params, &released);
        let grace = self.settings.renew_grace.max(Duration::from_secs(1));
        match tokio::time::timeout(grace, release).await {
            Ok(Ok(_)) => info!("released the leader-election Lease"),
            Ok(Err(err)) => {
                warn!(error = %err, "could not release the Lease; it expires on its own")
            }
            Err(_) => warn!("releasing the Lease timed out; it expires on its own"),
        }
    }
}

/// How long after its last successful renewal was sent a leader may go on leading: the lease
/// duration less half the renew grace, a margin for the standbys' clocks (which count the
/// duration from when they saw the renewal, later) running a little fast.
fn leadership_span(settings: &LeaderElection) -> Duration {
    settings
        .lease_duration
        .saturating_sub(settings.renew_grace / 2)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn settings() -> LeaderElection {
        LeaderElection {
            enabled: true,
            lease_name: "l".into(),
            lease_namespace: "kube-system".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(15),
            renew_grace: Duration::from_secs(5),
        }
    }

    fn lease(holder: Option<&str>, version: u64) -> Lease {
        Lease {
            metadata: ObjectMeta {
                resource_version: Some(version.to_string()),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(str::to_owned),
                renew_time: Some(MicroTime(
                    Timestamp::from_second(1_700_000_000 + i64::try_from(version).unwrap())
                        .unwrap(),
                )),
                lease_duration_seconds: Some(15),
                ..LeaseSpec::default()
            }),
        }
    }

    #[tokio::test]
    async fn a_standby_waits_a_whole_duration_without_change_before_taking_over() {
        let t0 = Instant::now();
        let mut e = Election::new(&settings(), t0);
        assert_eq!(e.next_step(t0), Step::Observe);
        e.observe(None, t0);
        assert_eq!(e.next_step(t0), Step::Create);

        e.observe(Some(lease(Some("other"), 1)), t0);
        assert_eq!(e.next_step(t0), Step::Wait(t0 + Duration::from_secs(15)));
        // A renewal seen later moves the deadline; a stale answer does not.
        let t1 = t0 + Duration::from_secs(10);
        e.observe(Some(lease(Some("other"), 2)), t1);
        e.observe(Some(lease(Some("other"), 1)), t1 + Duration::from_secs(1));
        assert_eq!(e.next_step(t0), Step::Wait(t1 + Duration::from_secs(15)));
        // The same record seen again (a relist) is no renewal.
        e.observe(Some(lease(Some("other"), 2)), t1 + Duration::from_secs(5));
        assert_eq!(e.next_step(t0), Step::Wait(t1 + Duration::from_secs(15)));
        assert_eq!(e.next_step(t1 + Duration::from_secs(15)), Step::Acquire);
        // Released: free to take at once.
        e.observe(Some(lease(None, 3)), t1);
        assert_eq!(e.next_step(t0), Step::Acquire);
        let taken = e.desired(&Step::Acquire);
        let spec = taken.spec.unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some("me"));
        assert_eq!(spec.lease_transitions, Some(1));
        assert_eq!(
            taken.metadata.resource_version.as_deref(),
            Some("3"),
            "written by CAS"
        );
    }

    #[tokio::test]
    async fn the_leader_renews_a_grace_before_expiry_and_takes_back_its_own_lease() {
        let t0 = Instant::now();
        let mut e = Election::new(&settings(), t0);
        e.observe(None, t0);
        let created = e.desired(&Step::Create);
        e.sending(&created);
        let mut answer = created.clone();
        answer.metadata.resource_version = Some("7".into());
        e.observe(Some(answer), t0);
        e.leading = true;
        e.renewed_at = Some(t0);
        assert_eq!(e.next_step(t0), Step::Wait(t0 + Duration::from_secs(10)));
        assert_eq!(e.next_step(t0 + Duration::from_secs(10)), Step::Renew);
        let renewal = e.desired(&Step::Renew);
        assert_eq!(renewal.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(renewal.spec.unwrap().lease_transitions, None);
        // A renewal that failed (its answer lost) leaves this process's own write in place: it
        // is taken back at once.
        e.leading = false;
        e.renewed_at = None;
        assert_eq!(e.next_step(t0), Step::Renew);
    }

    /// The identity is stable across restarts: a Lease naming it that this process did not
    /// write is a previous life's (or a duplicate's), which may still be leading. It is taken
    /// over only as another holder's would be, after a whole duration without change.
    #[tokio::test]
    async fn a_lease_naming_this_identity_from_another_process_is_not_taken_at_once() {
        let t0 = Instant::now();
        let mut e = Election::new(&settings(), t0);
        e.observe(Some(lease(Some("me"), 7)), t0);
        assert!(!e.holds());
        assert_eq!(e.next_step(t0), Step::Wait(t0 + Duration::from_secs(15)));
        // Still renewed by the other process: the deadline moves.
        let t1 = t0 + Duration::from_secs(5);
        e.observe(Some(lease(Some("me"), 8)), t1);
        assert_eq!(e.next_step(t1), Step::Wait(t1 + Duration::from_secs(15)));
        let later = t1 + Duration::from_secs(15);
        assert_eq!(e.next_step(later), Step::Acquire);
        let taken = e.desired(&Step::Acquire);
        assert_eq!(
            taken.spec.as_ref().unwrap().lease_transitions,
            Some(1),
            "a takeover, counted as one"
        );
        e.sending(&taken);
        e.observe(Some(taken), later);
        assert!(e.holds());

        // A duplicate under the same identity writes over it: not this process's renewal any
        // more, so a leader would step down rather than renew over it.
        e.observe(Some(lease(Some("me"), 1_000)), later);
        assert!(!e.holds());
    }
}

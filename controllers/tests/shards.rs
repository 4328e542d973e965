//! Sharing tenants between replicas over Leases, against the API simulator. Every replica here
//! runs a stand-in manager that follows the protocol (stop what it no longer owns, acknowledge,
//! start what it newly owns only once settled) with stand-in tenant runtimes that lead through the
//! replica's [`Leadership`] and write until their leadership is taken away. What they write is
//! recorded in one shared map that panics when a tenant would get a second writer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Trigger, Verb};
use bootstrap_controller::config::LeaderElection;
use bootstrap_controller::shards::{self, Shards, View};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::DeleteParams;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const NAMESPACE: &str = "kube-system";
const GROUP: &str = "bootstrap-controller";
const AGENT: &str = "shards-test/";

fn settings(identity: &str, lease_duration: Duration, renew_grace: Duration) -> LeaderElection {
    LeaderElection {
        enabled: true,
        lease_name: GROUP.to_owned(),
        lease_namespace: NAMESPACE.to_owned(),
        identity: identity.to_owned(),
        lease_duration,
        renew_grace,
    }
}

fn short(identity: &str) -> LeaderElection {
    // Fenced 1 s after the last renewal, judged dead 3 s after it was seen: a 2 s margin for a
    // loaded test machine to let each replica's runtimes stop in time. The manager has 3 s to
    // acknowledge a view.
    settings(identity, Duration::from_secs(3), Duration::from_secs(2))
}

fn long(identity: &str) -> LeaderElection {
    settings(identity, Duration::from_secs(300), Duration::from_secs(10))
}

/// How long a stand-in runtime goes on writing once its leadership is gone: well within the
/// renew grace, as a real runtime's abandoned pass must be.
const STOP_DELAY: Duration = Duration::from_millis(500);

/// A client whose requests the simulator can tell apart (request log, faults) by User-Agent.
async fn kube_config(sim: &Sim, identity: &str) -> anyhow::Result<kube::Config> {
    let mut config = sim.kube_config().await?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(&format!("{AGENT}{identity}"))?,
    ));
    Ok(config)
}

/// Which replica runs which tenant, across all replicas, plus the order things happened in.
#[derive(Clone, Default)]
struct Claims {
    inner: Arc<Mutex<ClaimState>>,
}

#[derive(Default)]
struct ClaimState {
    running: HashMap<String, String>,
    events: Vec<String>,
    violation: Option<String>,
}

impl Claims {
    fn lock(&self) -> MutexGuard<'_, ClaimState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn claim(&self, tenant: &str, replica: &str) {
        let mut state = self.lock();
        if let Some(other) = state.running.get(tenant)
            && other != replica
        {
            let message = format!("{tenant} started by {replica} while {other} still runs it");
            state.violation = Some(message.clone());
            drop(state);
            panic!("{message}");
        }
        state.running.insert(tenant.to_owned(), replica.to_owned());
        state.events.push(format!("{replica} starts {tenant}"));
    }

    fn release(&self, tenant: &str, replica: &str) {
        let mut state = self.lock();
        if state.running.get(tenant).is_some_and(|r| r == replica) {
            state.running.remove(tenant);
            state.events.push(format!("{replica} stops {tenant}"));
        }
    }

    /// A replica that died writes nothing any more.
    fn died(&self, replica: &str) {
        let mut state = self.lock();
        state.running.retain(|_, r| r != replica);
        state.events.push(format!("{replica} died"));
    }

    fn note(&self, event: String) {
        self.lock().events.push(event);
    }

    fn events(&self) -> Vec<String> {
        self.lock().events.clone()
    }

    fn running(&self) -> HashMap<String, String> {
        self.lock().running.clone()
    }

    fn check(&self) {
        if let Some(violation) = &self.lock().violation {
            panic!("two writers: {violation}");
        }
    }
}

/// The simulator, the two-writer detector and the tenants the replicas share.
struct Group {
    sim: Sim,
    claims: Claims,
    tenants: Arc<[String]>,
}

impl Group {
    async fn start() -> anyhow::Result<Group> {
        Ok(Group {
            sim: Sim::start(SimConfig::default()).await?,
            claims: Claims::default(),
            tenants: (0..200)
                .map(|i| format!("tenant-{}/kubeconfig-{i}", i % 7))
                .collect(),
        })
    }

    async fn replica(&self, settings: LeaderElection) -> anyhow::Result<Replica> {
        let client = kube::Client::try_from(kube_config(&self.sim, &settings.identity).await?)?;
        Ok(Replica::start(
            client,
            settings,
            &self.claims,
            &self.tenants,
        ))
    }

    /// Starts replicas and waits until they have settled and split the tenants.
    async fn settled<const N: usize>(
        &self,
        identities: [&str; N],
        settings: fn(&str) -> LeaderElection,
    ) -> anyhow::Result<[Replica; N]> {
        let mut replicas = Vec::with_capacity(N);
        for identity in identities {
            replicas.push(self.replica(settings(identity)).await?);
        }
        let replicas: [Replica; N] = replicas
            .try_into()
            .map_err(|_| anyhow::anyhow!("{N} replicas"))?;
        self.converge(&replicas.each_ref(), "the replicas settle")
            .await;
        Ok(replicas)
    }

    /// Waits until exactly `replicas` have settled on one view and each tenant runs on its
    /// owner, failing at once on a second writer.
    async fn converge(&self, replicas: &[&Replica], what: &str) {
        eventually(what, &self.claims, || {
            converged(replicas, &self.claims, &self.tenants)
        })
        .await;
    }

    /// A replica on a runtime of its own, so that it can die: its tasks vanish mid-flight,
    /// without releasing anything, as when a process is killed.
    async fn process(&self, identity: &str) -> anyhow::Result<(Replica, Process)> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let config = kube_config(&self.sim, identity).await?;
        let (claims, tenants) = (self.claims.clone(), Arc::clone(&self.tenants));
        let settings = short(identity);
        let replica = runtime
            .spawn(async move {
                let client = kube::Client::try_from(config)?;
                anyhow::Ok(Replica::start(client, settings, &claims, &tenants))
            })
            .await??;
        Ok((replica, Process { runtime }))
    }

    /// Who runs what now, and how far the events go, before a disturbance.
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            running: self.claims.running(),
            events: self.claims.events().len(),
        }
    }

    /// Whether `replica` stopped each tenant it ran at `snapshot` before another replica
    /// started it.
    fn handed_over(&self, snapshot: &Snapshot, replica: &str) -> bool {
        let events = self.claims.events();
        let events = events.get(snapshot.events..).unwrap_or_default();
        let position = |wanted: &dyn Fn(&String) -> bool| events.iter().position(wanted);
        snapshot
            .running
            .iter()
            .filter(|(_, owner)| *owner == replica)
            .all(|(tenant, _)| {
                let stopped = position(&|e| *e == format!("{replica} stops {tenant}"));
                let started = position(&|e| {
                    e.ends_with(&format!(" starts {tenant}"))
                        && !e.starts_with(&format!("{replica} "))
                });
                stopped.is_some() && started.is_some() && stopped < started
            })
    }

    /// From now on, every request of `identity` (of `verb` only, if given) fails.
    fn fail(&self, identity: &str, verb: Option<Verb>) {
        self.sim.faults().inject(FaultRule {
            verb,
            resource: None,
            user_agent: Some(format!("{AGENT}{identity}")),
            fault: FaultKind::Error {
                code: 500,
                retry_after_seconds: None,
            },
            trigger: Trigger::Probability(1.0),
        });
    }

    /// a and b, and c on a runtime of its own (so that it can be killed), settled.
    async fn settled_with_process(&self) -> anyhow::Result<([Replica; 3], Process)> {
        let [a, b] = self.settled(["a", "b"], short).await?;
        let (c, c_process) = self.process("c").await?;
        self.converge(&[&a, &b, &c], "a, b and c settle").await;
        Ok(([a, b, c], c_process))
    }

    fn lease_requests(&self, identity: &str) -> Vec<apiserver_sim::RequestRecord> {
        let agent = format!("{AGENT}{identity}");
        self.sim
            .requests()
            .into_iter()
            .filter(|r| r.user_agent == agent && r.resource == "leases")
            .collect()
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.sim.client(), NAMESPACE)
    }

    /// Cleanly stops every replica, then the simulator.
    async fn finish(self, replicas: impl IntoIterator<Item = Replica>) -> anyhow::Result<()> {
        for replica in replicas {
            replica.stop().await?;
        }
        self.claims.check();
        self.sim.shutdown().await;
        Ok(())
    }
}

/// See [`Group::snapshot`].
struct Snapshot {
    running: HashMap<String, String>,
    events: usize,
}

struct Replica {
    identity: String,
    cancel: CancellationToken,
    views: watch::Receiver<View>,
    /// While true, the manager handles no view (it is stuck); the runtimes go on.
    hung: watch::Sender<bool>,
    manager: JoinHandle<Shards>,
}

impl Replica {
    fn start(
        client: kube::Client,
        settings: LeaderElection,
        claims: &Claims,
        tenants: &Arc<[String]>,
    ) -> Replica {
        let cancel = CancellationToken::new();
        let identity = settings.identity.clone();
        let shards = Shards::spawn(client, settings, cancel.clone());
        let views = shards.views.clone();
        let (hung, hang) = watch::channel(false);
        let manager = tokio::spawn(
            Manager {
                me: identity.clone(),
                claims: claims.clone(),
                tenants: Arc::clone(tenants),
                running: HashMap::new(),
            }
            .run(shards, hang, cancel.clone()),
        );
        Replica {
            identity,
            cancel,
            views,
            hung,
            manager,
        }
    }

    fn view(&self) -> View {
        self.views.borrow().clone()
    }

    fn lease_name(&self) -> String {
        shards::lease_name(GROUP, &self.identity)
    }

    /// A clean stop: the manager stops its tenants, then the Lease is released.
    async fn stop(self) -> anyhow::Result<()> {
        self.hung.send_replace(false);
        self.cancel.cancel();
        let shards = self.manager.await?;
        shards.stopped().await;
        Ok(())
    }
}

/// A stand-in tenant runtime: it writes while it leads and stops [`STOP_DELAY`] after its
/// leadership is taken away, by its manager or by fencing.
struct Runtime {
    leading: watch::Sender<bool>,
    task: JoinHandle<()>,
}

/// What the real manager does with views: stop what is no longer owned, acknowledge, and start
/// what is newly owned only once every live replica acknowledged the same view.
struct Manager {
    me: String,
    claims: Claims,
    tenants: Arc<[String]>,
    running: HashMap<String, Runtime>,
}

impl Manager {
    async fn run(
        mut self,
        shards: Shards,
        mut hang: watch::Receiver<bool>,
        cancel: CancellationToken,
    ) -> Shards {
        let mut views = shards.views.clone();
        let mut fenced = false;
        loop {
            if *hang.borrow_and_update() {
                self.claims.note(format!("{}'s manager hangs", self.me));
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = hang.wait_for(|hung| !*hung) => {}
                }
            }
            let view = views.borrow_and_update().clone();
            if view.fenced && !fenced {
                self.claims.note(format!("{} fenced", self.me));
            }
            fenced = view.fenced;
            let lost = self
                .running
                .keys()
                .filter(|tenant| !view.owns(tenant))
                .cloned()
                .collect();
            self.stop(lost).await;
            shards.ack(view.id);
            if view.settled {
                for tenant in self.tenants.iter() {
                    if view.owns(tenant) && !self.running.contains_key(tenant) {
                        let runtime = self.runtime(tenant, &shards);
                        self.running.insert(tenant.clone(), runtime);
                    }
                }
            }
            tokio::select! {
                _ = cancel.cancelled() => break,
                changed = views.changed() => if changed.is_err() { break },
                changed = hang.changed() => if changed.is_err() { break },
            }
        }
        let all = self.running.keys().cloned().collect();
        self.stop(all).await;
        shards
    }

    fn runtime(&self, tenant: &str, shards: &Shards) -> Runtime {
        let (leading, mut leadership) = shards.leadership().grant();
        // Granted while fenced: it never leads, so it never writes.
        let leads = *leadership.borrow_and_update();
        if leads {
            self.claims.claim(tenant, &self.me);
        }
        let (claims, tenant, me) = (self.claims.clone(), tenant.to_owned(), self.me.clone());
        let task = tokio::spawn(async move {
            if leads {
                let _ = leadership.wait_for(|leading| !*leading).await;
                tokio::time::sleep(STOP_DELAY).await;
                claims.release(&tenant, &me);
            }
        });
        Runtime { leading, task }
    }

    /// Takes the runtimes' leadership away and waits until they have stopped writing.
    async fn stop(&mut self, tenants: Vec<String>) {
        let mut stopping = Vec::new();
        for tenant in tenants {
            if let Some(runtime) = self.running.remove(&tenant) {
                runtime.leading.send_replace(false);
                stopping.push(runtime.task);
            }
        }
        futures::future::join_all(stopping).await;
    }
}

/// Polls `condition` with a generous deadline, failing at once on a second writer.
async fn eventually(what: &str, claims: &Claims, mut condition: impl FnMut() -> bool) {
    let holds = || {
        claims.check();
        std::future::ready(condition())
    };
    if let Err(err) = test_support::eventually(what, Duration::from_secs(60), holds).await {
        panic!("{err}");
    }
}

/// Every replica settled on one view of exactly these replicas, and each tenant runs on its
/// owner under that view.
fn converged(replicas: &[&Replica], claims: &Claims, tenants: &[String]) -> bool {
    let views: Vec<View> = replicas.iter().map(|r| r.view()).collect();
    let Some(first) = views.first() else {
        return false;
    };
    let mut identities: Vec<&str> = replicas.iter().map(|r| r.identity.as_str()).collect();
    identities.sort_unstable();
    let running = claims.running();
    views
        .iter()
        .all(|v| v.settled && !v.fenced && v.id == first.id)
        && first.replicas.iter().map(String::as_str).eq(identities)
        && running.len() == tenants.len()
        && tenants
            .iter()
            .all(|t| running.get(t).map(String::as_str) == first.owner(t))
}

struct Process {
    runtime: tokio::runtime::Runtime,
}

impl Process {
    async fn kill(self, claims: &Claims, identity: &str) -> anyhow::Result<()> {
        // Wait for the runtime to stop, so that nothing of the replica runs after this.
        let runtime = self.runtime;
        tokio::task::spawn_blocking(move || runtime.shutdown_timeout(Duration::from_secs(10)))
            .await?;
        claims.died(identity);
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_settles_and_owns_every_tenant() -> anyhow::Result<()> {
    // No namespaces at all: the replica must create its Lease's namespace.
    let group = Group::start().await?;
    let [a] = group.settled(["a"], short).await?;
    let view = a.view();
    assert_eq!(&*view.replicas, ["a".to_owned()]);
    assert!(group.tenants.iter().all(|t| view.owns(t)));

    let lease = group.leases().get(&a.lease_name()).await?;
    assert_eq!(
        lease
            .metadata
            .labels
            .unwrap_or_default()
            .get(shards::REPLICA_LABEL),
        Some(&GROUP.to_owned())
    );
    let annotations = lease.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get(shards::VIEW_ANNOTATION),
        Some(&view.id.to_string()),
        "the Lease carries the acknowledged view"
    );
    assert_eq!(annotations.get(shards::FENCED_ANNOTATION), None);

    let name = a.lease_name();
    a.stop().await?;
    assert!(group.claims.running().is_empty(), "a stopped its tenants");
    assert!(
        group.leases().get_opt(&name).await?.is_none(),
        "a clean stop deletes the Lease"
    );
    group.finish([]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_split_the_tenants_evenly() -> anyhow::Result<()> {
    let group = Group::start().await?;
    let replicas = group.settled(["a", "b", "c"], short).await?;
    for tenant in group.tenants.iter() {
        let owners = replicas.iter().filter(|r| r.view().owns(tenant)).count();
        assert_eq!(owners, 1, "{tenant} has {owners} owners");
    }
    let running = group.claims.running();
    for replica in &replicas {
        let count = running.values().filter(|r| **r == replica.identity).count();
        // 200 / 3 is about 67; a sound hash stays far from these bounds.
        assert!(
            (30..=110).contains(&count),
            "{} runs {count} of 200 tenants",
            replica.identity
        );
    }
    group.finish(replicas).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_replica_starts_tenants_only_after_their_old_owners_stopped() -> anyhow::Result<()>
{
    let group = Group::start().await?;
    let [a, b] = group.settled(["a", "b"], short).await?;
    let before = group.claims.running();

    let c = group.replica(short("c")).await?;
    group.converge(&[&a, &b, &c], "a, b and c settle").await;
    let after = group.claims.running();
    let moved: Vec<&String> = group
        .tenants
        .iter()
        .filter(|t| before.get(*t) != after.get(*t))
        .collect();
    assert!(!moved.is_empty(), "c took over some tenants");
    let events = group.claims.events();
    for tenant in moved {
        assert_eq!(after.get(tenant).map(String::as_str), Some("c"), "{tenant}");
        let old = before.get(tenant).map(String::as_str).unwrap_or_default();
        let stopped = events
            .iter()
            .position(|e| *e == format!("{old} stops {tenant}"));
        let started = events
            .iter()
            .position(|e| *e == format!("c starts {tenant}"));
        assert!(
            stopped.is_some() && stopped < started,
            "{tenant}: {old} must stop it before c starts it"
        );
    }
    group.finish([a, b, c]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_replicas_tenants_are_taken_over_once_its_lease_expires() -> anyhow::Result<()> {
    let group = Group::start().await?;
    let ([a, b, c], c_process) = group.settled_with_process().await?;

    c_process.kill(&group.claims, "c").await?;
    let died = Instant::now();
    group
        .converge(&[&a, &b], "a and b take over c's tenants")
        .await;
    // The survivors waited for the Lease to lapse: c renewed every half second until it died,
    // and its Lease lasts 3 s, so no take-over can come sooner than this.
    assert!(
        died.elapsed() >= Duration::from_millis(1500),
        "took over after {:?}, before c's Lease expired",
        died.elapsed()
    );
    // Much later (five Lease durations), a survivor deletes the dead replica's Lease, so that
    // replicas replaced under new names do not leave Leases piling up.
    let name = c.lease_name();
    let deleted = || {
        group
            .sim
            .requests()
            .iter()
            .any(|r| r.verb == "delete" && r.name == name && r.status == 200)
    };
    eventually(
        "the dead replica's Lease is deleted",
        &group.claims,
        deleted,
    )
    .await;
    assert!(group.leases().get_opt(&name).await?.is_none());
    assert!(
        converged(&[&a, &b], &group.claims, &group.tenants),
        "deleting a dead Lease changes nothing"
    );
    group.finish([a, b]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_clean_stop_hands_over_without_waiting_for_the_lease_to_expire() -> anyhow::Result<()> {
    let group = Group::start().await?;
    // Leases far longer than the wait below: only a released Lease can hand over in time.
    let [a, b, c] = group.settled(["a", "b", "c"], long).await?;

    group.sim.clear_requests();
    c.stop().await?;
    group
        .converge(&[&a, &b], "a and b take over c's tenants")
        .await;
    // c said it owns nothing (an update, since its Lease's content is not in the request log),
    // then deleted its Lease.
    let verbs: Vec<(String, u16)> = group
        .lease_requests("c")
        .into_iter()
        .map(|r| (r.verb, r.status))
        .collect();
    assert_eq!(
        verbs,
        [("update".to_owned(), 200), ("delete".to_owned(), 200)],
        "c released its Lease"
    );
    group.finish([a, b]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_cut_off_from_the_api_is_fenced_before_the_others_take_its_tenants()
-> anyhow::Result<()> {
    let group = Group::start().await?;
    let [a, b, c] = group.settled(["a", "b", "c"], short).await?;
    let before = group.snapshot();

    // Every request of c fails; its open watch goes on, so it still sees the others.
    group.fail("c", None);
    group
        .converge(&[&a, &b], "a and b take over c's tenants")
        .await;
    assert!(c.view().fenced, "c is fenced while it cannot renew");
    let events = group.claims.events();
    let fenced = events.iter().position(|e| e == "c fenced");
    let taken = events.iter().position(|e| {
        before.running.iter().any(|(tenant, replica)| {
            replica == "c"
                && (*e == format!("a starts {tenant}") || *e == format!("b starts {tenant}"))
        })
    });
    assert!(
        fenced.is_some() && taken.is_some() && fenced < taken,
        "c must be fenced (at {fenced:?}) before its tenants move (at {taken:?})"
    );
    assert!(group.handed_over(&before, "c"));
    assert!(!c.manager.is_finished(), "c keeps trying");

    group.sim.faults().clear();
    group
        .converge(&[&a, &b, &c], "c rejoins once it reaches the API")
        .await;
    group.finish([a, b, c]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_manager_hangs_is_fenced_and_counted_gone_so_the_others_go_on()
-> anyhow::Result<()> {
    let group = Group::start().await?;
    let [a, b, c] = group.settled(["a", "b", "c"], short).await?;
    let before = group.snapshot();

    // c's manager stops handling views; its runtimes go on writing, its Lease is renewed.
    c.hung.send_replace(true);
    // A replica joins, so every view changes, and c's manager acknowledges none of them.
    let d = group.replica(short("d")).await?;
    group
        .converge(&[&a, &b, &d], "a, b and d share every tenant while c hangs")
        .await;
    // c fenced itself: its runtimes lost their leadership (without its manager) and stopped
    // before anyone took their tenants (or the detector would have failed), and its Lease says
    // so with its renew grace.
    assert!(c.view().fenced);
    assert!(group.handed_over(&before, "c"));
    let lease = group.leases().get(&c.lease_name()).await?;
    let annotations = lease.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations
            .get(shards::FENCED_ANNOTATION)
            .map(String::as_str),
        Some("2000")
    );

    // Its manager back, c acknowledges the fence and rejoins.
    c.hung.send_replace(false);
    group
        .converge(&[&a, &b, &c, &d], "c rejoins once its manager is back")
        .await;
    group.finish([a, b, c, d]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_watch_stalls_is_fenced_and_counted_gone_so_the_others_go_on()
-> anyhow::Result<()> {
    let group = Group::start().await?;
    let [a, b, c] = group.settled(["a", "b", "c"], short).await?;
    let before = group.snapshot();

    // c cannot watch or list any more (its writes go through): it cannot see anyone join.
    group.fail("c", Some(Verb::Watch));
    group.fail("c", Some(Verb::List));
    group.sim.close_watches();
    let d = group.replica(short("d")).await?;
    group
        .converge(
            &[&a, &b, &d],
            "a, b and d share every tenant while c is blind",
        )
        .await;
    assert!(c.view().fenced);
    assert!(group.handed_over(&before, "c"));

    group.sim.faults().clear();
    group
        .converge(&[&a, &b, &c, &d], "c rejoins once it can watch again")
        .await;
    group.finish([a, b, c, d]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_lease_deleted_by_hand_does_not_move_its_tenants() -> anyhow::Result<()> {
    // Renewed every 2 s and fenced 4 s after the last renewal: c can take a second to write its
    // Lease again without being fenced.
    let lease_duration = Duration::from_secs(6);
    let medium =
        |identity: &str| settings(identity, Duration::from_secs(6), Duration::from_secs(2));
    let group = Group::start().await?;
    let [a, b, c] = group.settled(["a", "b", "c"], medium).await?;
    let before = group.claims.running();
    let incarnation = |lease: Lease| lease.spec.and_then(|s| s.acquire_time);
    let name = c.lease_name();
    let acquired = incarnation(group.leases().get(&name).await?);

    // c's runtimes take STOP_DELAY to stop once fenced, and writing its Lease again takes it a
    // second: had the others counted it gone on the deletion, they would start its tenants
    // while it still runs them.
    group.sim.faults().inject(FaultRule {
        verb: Some(Verb::Create),
        resource: Some("leases".to_owned()),
        user_agent: Some(format!("{AGENT}c")),
        fault: FaultKind::Latency { millis: 1000 },
        trigger: Trigger::Probability(1.0),
    });
    group.sim.clear_requests();
    group
        .leases()
        .delete(&name, &DeleteParams::default())
        .await?;
    let written_again = || {
        group
            .lease_requests("c")
            .iter()
            .any(|r| r.verb == "create" && r.status == 201)
    };
    eventually("c writes its Lease again", &group.claims, written_again).await;
    // A whole Lease duration after the deletion: had c been gone, its Lease would have expired.
    let quiet = Instant::now() + lease_duration;
    eventually("a Lease duration passes", &group.claims, || {
        Instant::now() >= quiet
    })
    .await;
    group
        .converge(&[&a, &b, &c], "a, b and c keep their tenants")
        .await;
    assert_eq!(group.claims.running(), before, "no tenant moved");
    assert_eq!(
        incarnation(group.leases().get(&name).await?),
        acquired,
        "c wrote its Lease again under the same incarnation"
    );
    group.finish([a, b, c]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_rest_the_replicas_only_renew_their_leases() -> anyhow::Result<()> {
    let group = Group::start().await?;
    let replicas = group.settled(["a", "b", "c"], short).await?;

    group.sim.clear_requests();
    // Several renewal periods (half a second each).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let requests: Vec<apiserver_sim::RequestRecord> = group
        .sim
        .requests()
        .into_iter()
        .filter(|r| r.user_agent.starts_with(AGENT))
        .collect();
    let unexpected: Vec<String> = requests
        .iter()
        .filter(|r| !(r.verb == "update" && r.resource == "leases") && r.verb != "watch")
        .map(|r| format!("{} {} {} ({})", r.verb, r.resource, r.name, r.user_agent))
        .collect();
    assert!(
        unexpected.is_empty(),
        "at rest only renewals: {unexpected:?}"
    );
    for replica in &replicas {
        assert!(
            !group.lease_requests(&replica.identity).is_empty(),
            "{} renews its Lease",
            replica.identity
        );
    }
    group.finish(replicas).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_restarted_under_its_name_takes_its_tenants_back() -> anyhow::Result<()> {
    let group = Group::start().await?;
    // The first c is only killed: it stays bound until then.
    let ([a, b, _first_c], c_process) = group.settled_with_process().await?;
    let before = group.claims.running();

    // A pod of a StatefulSet comes back under its name while its Lease is still there: it takes
    // over its old Lease (dropping its predecessor's acknowledgement) and gets its tenants back.
    c_process.kill(&group.claims, "c").await?;
    group.sim.clear_requests();
    let c = group.replica(short("c")).await?;
    group
        .converge(&[&a, &b, &c], "the restarted c settles with a and b")
        .await;
    assert_eq!(
        group.claims.running(),
        before,
        "every tenant is back on its owner"
    );
    let name = c.lease_name();
    let c_requests: Vec<(String, u16)> = group
        .lease_requests("c")
        .into_iter()
        // A create names its object in the body only.
        .filter(|r| r.name == name || r.verb == "create")
        .map(|r| (r.verb, r.status))
        .collect();
    let took_over = [("create", 409), ("get", 200), ("update", 200)];
    assert!(
        c_requests.len() >= 3
            && c_requests.iter().zip(took_over).all(
                |((verb, status), (want_verb, want_status))| {
                    verb == want_verb && *status == want_status
                }
            ),
        "the restarted c takes over its Lease: {c_requests:?}"
    );
    group.finish([a, b, c]).await
}

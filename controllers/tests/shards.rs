//! Sharing tenants between replicas over Leases, against the API simulator. Every replica here
//! runs a stand-in manager that follows the protocol (stop what it no longer owns, acknowledge,
//! start what it newly owns only once settled) and records what it runs in one shared map that
//! panics when a tenant would get a second writer.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Trigger};
use bootstrap_controller::shards::{self, ShardSettings, Shards, View};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const NAMESPACE: &str = "kube-system";
const GROUP: &str = "bootstrap-controller";
const AGENT: &str = "shards-test/";

fn settings(identity: &str, lease_duration: Duration, renew_grace: Duration) -> ShardSettings {
    ShardSettings {
        namespace: NAMESPACE.to_owned(),
        group: GROUP.to_owned(),
        identity: identity.to_owned(),
        lease_duration,
        renew_grace,
    }
}

fn short(identity: &str) -> ShardSettings {
    // Fenced 1 s after the last renewal, judged dead 3 s after it was seen: a 2 s margin for a
    // loaded test machine to let each manager stop its tenants in time.
    settings(identity, Duration::from_secs(3), Duration::from_secs(2))
}

fn tenants() -> Arc<[String]> {
    (0..200)
        .map(|i| format!("tenant-{}/kubeconfig-{i}", i % 7))
        .collect()
}

/// A client whose requests the simulator can tell apart (request log, faults) by User-Agent.
async fn kube_config(sim: &Sim, identity: &str) -> anyhow::Result<kube::Config> {
    let mut config = sim.kube_config().await?;
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_str(&format!("{AGENT}{identity}"))?,
    ));
    Ok(config)
}

async fn client(sim: &Sim, identity: &str) -> anyhow::Result<kube::Client> {
    Ok(kube::Client::try_from(kube_config(sim, identity).await?)?)
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

struct Replica {
    identity: String,
    cancel: CancellationToken,
    views: watch::Receiver<View>,
    manager: JoinHandle<Shards>,
}

impl Replica {
    fn start(
        client: kube::Client,
        settings: ShardSettings,
        claims: &Claims,
        tenants: &Arc<[String]>,
    ) -> Replica {
        let cancel = CancellationToken::new();
        let identity = settings.identity.clone();
        let shards = Shards::spawn(client, settings, cancel.clone());
        let views = shards.views.clone();
        let manager = tokio::spawn(manage(
            shards,
            identity.clone(),
            claims.clone(),
            Arc::clone(tenants),
            cancel.clone(),
        ));
        Replica {
            identity,
            cancel,
            views,
            manager,
        }
    }

    fn view(&self) -> View {
        self.views.borrow().clone()
    }

    /// A clean stop: the manager stops its tenants, then the Lease is released.
    async fn stop(self) -> anyhow::Result<()> {
        self.cancel.cancel();
        let shards = self.manager.await?;
        shards.stopped().await;
        Ok(())
    }
}

/// What the real manager does with views: stop what is no longer owned, acknowledge, and start
/// what is newly owned only once every live replica acknowledged the same view.
async fn manage(
    shards: Shards,
    me: String,
    claims: Claims,
    tenants: Arc<[String]>,
    cancel: CancellationToken,
) -> Shards {
    let mut views = shards.views.clone();
    let mut running: HashSet<String> = HashSet::new();
    let mut fenced = false;
    loop {
        let view = views.borrow_and_update().clone();
        if view.fenced && !fenced {
            claims.note(format!("{me} fenced"));
        }
        fenced = view.fenced;
        running.retain(|tenant| {
            let owned = view.owns(tenant);
            if !owned {
                claims.release(tenant, &me);
            }
            owned
        });
        shards.ack(view.id);
        if view.settled {
            for tenant in tenants.iter() {
                if view.owns(tenant) && running.insert(tenant.clone()) {
                    claims.claim(tenant, &me);
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => break,
            changed = views.changed() => if changed.is_err() { break },
        }
    }
    for tenant in &running {
        claims.release(tenant, &me);
    }
    shards
}

/// Polls `condition` with a generous deadline, failing at once on a second writer.
async fn eventually(what: &str, claims: &Claims, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        claims.check();
        if condition() {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every replica settled on one view of exactly these members, and each tenant runs on its
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
        && first.members.iter().map(String::as_str).eq(identities)
        && running.len() == tenants.len()
        && tenants
            .iter()
            .all(|t| running.get(t).map(String::as_str) == first.owner(t))
}

fn shard_requests(sim: &Sim) -> Vec<apiserver_sim::RequestRecord> {
    sim.requests()
        .into_iter()
        .filter(|r| r.user_agent.starts_with(AGENT))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_replica_settles_and_owns_every_tenant() -> anyhow::Result<()> {
    // No namespaces at all: the replica must create its Lease's namespace.
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let a = Replica::start(client(&sim, "a").await?, short("a"), &claims, &tenants);
    eventually("a settles and runs everything", &claims, || {
        converged(&[&a], &claims, &tenants)
    })
    .await;
    let view = a.view();
    assert_eq!(&*view.members, ["a".to_owned()]);
    assert!(tenants.iter().all(|t| view.owns(t)));

    let leases: Api<Lease> = Api::namespaced(sim.client(), NAMESPACE);
    let name = shards::lease_name(GROUP, "a");
    let lease = leases.get(&name).await?;
    assert_eq!(
        lease
            .metadata
            .labels
            .unwrap_or_default()
            .get(shards::REPLICA_LABEL),
        Some(&GROUP.to_owned())
    );
    assert_eq!(
        lease
            .metadata
            .annotations
            .unwrap_or_default()
            .get(shards::VIEW_ANNOTATION),
        Some(&view.id.to_string()),
        "the Lease carries the acknowledged view"
    );

    a.stop().await?;
    assert!(claims.running().is_empty(), "a stopped its tenants");
    assert!(
        leases.get_opt(&name).await?.is_none(),
        "a clean stop deletes the Lease"
    );
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_split_the_tenants_evenly() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let mut replicas = Vec::new();
    for identity in ["a", "b", "c"] {
        replicas.push(Replica::start(
            client(&sim, identity).await?,
            short(identity),
            &claims,
            &tenants,
        ));
    }
    let all: Vec<&Replica> = replicas.iter().collect();
    eventually("three replicas settle", &claims, || {
        converged(&all, &claims, &tenants)
    })
    .await;
    for tenant in tenants.iter() {
        let owners = replicas.iter().filter(|r| r.view().owns(tenant)).count();
        assert_eq!(owners, 1, "{tenant} has {owners} owners");
    }
    let running = claims.running();
    for replica in &replicas {
        let count = running.values().filter(|r| **r == replica.identity).count();
        // 200 / 3 is about 67; a sound hash stays far from these bounds.
        assert!(
            (30..=110).contains(&count),
            "{} runs {count} of 200 tenants",
            replica.identity
        );
    }
    for replica in replicas {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_replica_starts_tenants_only_after_their_old_owners_stopped() -> anyhow::Result<()>
{
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let a = Replica::start(client(&sim, "a").await?, short("a"), &claims, &tenants);
    let b = Replica::start(client(&sim, "b").await?, short("b"), &claims, &tenants);
    eventually("a and b settle", &claims, || {
        converged(&[&a, &b], &claims, &tenants)
    })
    .await;
    let before = claims.running();

    let c = Replica::start(client(&sim, "c").await?, short("c"), &claims, &tenants);
    eventually("a, b and c settle", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;
    let after = claims.running();
    let moved: Vec<&String> = tenants
        .iter()
        .filter(|t| before.get(*t) != after.get(*t))
        .collect();
    assert!(!moved.is_empty(), "c took over some tenants");
    let events = claims.events();
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
    for replica in [a, b, c] {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

/// A replica on a runtime of its own, so that it can die: its tasks vanish mid-flight, without
/// releasing anything, as when a process is killed.
struct Process {
    runtime: tokio::runtime::Runtime,
}

impl Process {
    async fn start(
        sim: &Sim,
        identity: &str,
        claims: &Claims,
        tenants: &Arc<[String]>,
    ) -> anyhow::Result<(Replica, Process)> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let config = kube_config(sim, identity).await?;
        let (claims, tenants) = (claims.clone(), Arc::clone(tenants));
        let settings = short(identity);
        let replica = runtime
            .spawn(async move {
                let client = kube::Client::try_from(config)?;
                anyhow::Ok(Replica::start(client, settings, &claims, &tenants))
            })
            .await??;
        Ok((replica, Process { runtime }))
    }

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
async fn a_dead_replicas_tenants_are_taken_over_once_its_lease_expires() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let a = Replica::start(client(&sim, "a").await?, short("a"), &claims, &tenants);
    let b = Replica::start(client(&sim, "b").await?, short("b"), &claims, &tenants);
    let (c, c_process) = Process::start(&sim, "c", &claims, &tenants).await?;
    eventually("a, b and c settle", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;

    c_process.kill(&claims, "c").await?;
    let died = Instant::now();
    eventually("a and b take over c's tenants", &claims, || {
        converged(&[&a, &b], &claims, &tenants)
    })
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
    let name = shards::lease_name(GROUP, "c");
    let deleted = || {
        shard_requests(&sim)
            .iter()
            .any(|r| r.verb == "delete" && r.name == name && r.status == 200)
    };
    eventually("the dead replica's Lease is deleted", &claims, deleted).await;
    let leases: Api<Lease> = Api::namespaced(sim.client(), NAMESPACE);
    assert!(leases.get_opt(&name).await?.is_none());
    assert!(
        converged(&[&a, &b], &claims, &tenants),
        "deleting a dead Lease changes nothing"
    );
    for replica in [a, b] {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_clean_stop_hands_over_without_waiting_for_the_lease_to_expire() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    // Leases far longer than the wait below: only a released Lease can hand over in time.
    let long = |identity| settings(identity, Duration::from_secs(300), Duration::from_secs(10));
    let a = Replica::start(client(&sim, "a").await?, long("a"), &claims, &tenants);
    let b = Replica::start(client(&sim, "b").await?, long("b"), &claims, &tenants);
    let c = Replica::start(client(&sim, "c").await?, long("c"), &claims, &tenants);
    eventually("a, b and c settle", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;

    c.stop().await?;
    eventually("a and b take over c's tenants", &claims, || {
        converged(&[&a, &b], &claims, &tenants)
    })
    .await;
    let name = shards::lease_name(GROUP, "c");
    assert!(
        shard_requests(&sim)
            .iter()
            .any(|r| r.verb == "delete" && r.resource == "leases" && r.name == name),
        "c deleted its Lease"
    );
    for replica in [a, b] {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_cut_off_from_the_api_is_fenced_before_the_others_take_its_tenants()
-> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let a = Replica::start(client(&sim, "a").await?, short("a"), &claims, &tenants);
    let b = Replica::start(client(&sim, "b").await?, short("b"), &claims, &tenants);
    let c = Replica::start(client(&sim, "c").await?, short("c"), &claims, &tenants);
    eventually("a, b and c settle", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;
    let before = claims.running();

    // Every request of c fails; its open watch goes on, so it still sees the others.
    sim.faults().inject(FaultRule {
        verb: None,
        resource: None,
        user_agent: Some(format!("{AGENT}c")),
        fault: FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
        trigger: Trigger::Probability(1.0),
    });
    eventually("a and b take over c's tenants", &claims, || {
        converged(&[&a, &b], &claims, &tenants)
    })
    .await;
    assert!(c.view().fenced, "c is fenced while it cannot renew");
    let events = claims.events();
    let fenced = events.iter().position(|e| e == "c fenced");
    let taken = events.iter().position(|e| {
        before.iter().any(|(tenant, replica)| {
            replica == "c"
                && (*e == format!("a starts {tenant}") || *e == format!("b starts {tenant}"))
        })
    });
    assert!(
        fenced.is_some() && taken.is_some() && fenced < taken,
        "c must be fenced (at {fenced:?}) before its tenants move (at {taken:?})"
    );
    assert!(!c.manager.is_finished(), "c keeps trying");

    sim.faults().clear();
    eventually("c rejoins once it reaches the API", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;
    for replica in [a, b, c] {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_rest_the_replicas_only_renew_their_leases() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let mut replicas = Vec::new();
    for identity in ["a", "b", "c"] {
        replicas.push(Replica::start(
            client(&sim, identity).await?,
            short(identity),
            &claims,
            &tenants,
        ));
    }
    let all: Vec<&Replica> = replicas.iter().collect();
    eventually("three replicas settle", &claims, || {
        converged(&all, &claims, &tenants)
    })
    .await;

    sim.clear_requests();
    // Several renewal periods (half a second each).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let requests = shard_requests(&sim);
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
        let agent = format!("{AGENT}{}", replica.identity);
        assert!(
            requests
                .iter()
                .any(|r| r.user_agent == agent && r.verb == "update"),
            "{} renews its Lease",
            replica.identity
        );
    }
    for replica in replicas {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_restarted_under_its_name_takes_its_tenants_back() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let claims = Claims::default();
    let tenants = tenants();
    let a = Replica::start(client(&sim, "a").await?, short("a"), &claims, &tenants);
    let b = Replica::start(client(&sim, "b").await?, short("b"), &claims, &tenants);
    let (c, c_process) = Process::start(&sim, "c", &claims, &tenants).await?;
    eventually("a, b and c settle", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;
    let before = claims.running();

    // A pod of a StatefulSet comes back under its name while its Lease is still there: it takes
    // over its old Lease (dropping its predecessor's acknowledgement) and gets its tenants back.
    c_process.kill(&claims, "c").await?;
    sim.clear_requests();
    let c = Replica::start(client(&sim, "c").await?, short("c"), &claims, &tenants);
    eventually("the restarted c settles with a and b", &claims, || {
        converged(&[&a, &b, &c], &claims, &tenants)
    })
    .await;
    assert_eq!(
        claims.running(),
        before,
        "every tenant is back on its owner"
    );
    let name = shards::lease_name(GROUP, "c");
    let c_requests: Vec<(String, u16)> = shard_requests(&sim)
        .into_iter()
        // A create names its object in the body only.
        .filter(|r| {
            r.user_agent == format!("{AGENT}c")
                && r.resource == "leases"
                && (r.name == name || r.verb == "create")
        })
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
    for replica in [a, b, c] {
        replica.stop().await?;
    }
    sim.shutdown().await;
    Ok(())
}

//! Management mode: one process keeps the bootstrap state of many tenant clusters.
//!
//! Each Secret of the management cluster that matches the selector is one tenant: its kubeconfig
//! (under the configured data key) reaches the tenant's API, and its annotation
//! [`TENANT_CONFIG_ANNOTATION`] (a YAML fragment of the configuration file) holds the tenant's
//! own settings. Every tenant gets the runtime the single-cluster mode runs (the loops of
//! [`crate::runner::build_runner`], driven by a [`Runner`]) with its own client and its own metrics
//! registry labelled `tenant`, so a tenant that is down, slow or hostile only occupies its own
//! tasks and connections.
//!
//! A tenant Secret is untrusted input (see docs/security.md): its kubeconfig is read by
//! [`crate::tenant_kubeconfig`] (inline material only), its fragment within floors
//! ([`TenantBase::tenant`]), its etcd credentials from its own data keys; loading happens in a
//! task of its own under [`LOAD_TIMEOUT`], so a huge Secret or a hung credential plugin costs
//! that tenant only, never the manager. A Secret naming an etcd waits until that etcd, reached
//! only inside the networks the operator allows, has said which etcd it is (`etcd.rs`) and the
//! claim on its keys is decided (`records.rs`); its loops then reach that etcd only.
//!
//! Replicas share the tenants through [`crate::shards`]: a tenant starts only on the replica
//! that owns it in a settled view, and a replica stops the tenants it lost before it
//! acknowledges a view, so a tenant never has two writers. Nothing is stopped on partial
//! information: until the first complete list of Secrets, and while a re-list is under way, the
//! tenants last known keep running.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Secret;
use kube::Resource;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use prometheus_client::registry::Registry;
use reconcilers::legacy_alloc::etcd::EtcdPin;
use reconcilers::metrics::TenantRegistry;
use reconcilers::sanitize::Sanitized;
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::{LeaderElection, TenantBase};
use crate::etcd_claims::{self, RECORD_LABEL, Record};
use crate::health::{CheckState, Health};
use crate::metrics::tenant_registry;
use crate::shards::{Leadership, View};
use crate::tenant_kubeconfig::{self, CredentialPolicy};
use reconcilers::budget::CacheBudget;

mod directory;
mod etcd;
mod listed;
mod load;
mod metrics;
mod records;
mod spec;

pub use directory::Directory;
use directory::Entry;
use etcd::{AskOutcome, EtcdState};
use listed::{Listed, Seen};
use load::{Loaded, load};
pub use metrics::TenantMetrics;
use metrics::{ReasonLabels, STATES, StateLabels};
use spec::{Spec, room_for_shed};

/// The longest a tenant's configuration and client may take to load: past it the Secret is
/// reported and the tenant not started. Reading a Secret takes milliseconds; an allowed
/// credential plugin may take up to its own deadline, which this covers.
pub const LOAD_TIMEOUT: Duration =
    Duration::from_secs(tenant_kubeconfig::PLUGIN_TIMEOUT.as_secs() + 10);

/// How often the manager syncs without an event: retries of record writes and of etcds that
/// did not answer, and the end of claims' grace, are seen at least this often.
const TIMER: Duration = Duration::from_secs(5);

/// Tenant Secrets per LIST page: a Secret may hold up to 1 MiB, so a page may hold up to
/// 10 MiB (about 14 MiB as JSON, base64 inflating the data), read at once.
const SECRET_PAGE_SIZE: u32 = 10;

/// How long without an error the Secret watch has resumed after: kube-runtime's default backoff
/// pauses at most 30 s, jittered up to twice that, between attempts.
const SECRETS_QUIET: Duration = Duration::from_secs(120);

/// The least time between two re-lists of the tenant Secrets made to hold again a Secret shed
/// for the Secrets' budget once others made room: a re-list reads every Secret, and a writer
/// deleting and creating Secrets must not make the manager list them without pause.
const RELIST_SPACING: Duration = Duration::from_secs(60);

/// A sync looks at every tenant, and every event asks for one: with thousands of Secrets
/// loading at once, a sync per event would make the fleet's start-up quadratic. After a sync,
/// the next waits this many times as long as that one took, so the manager spends at most a
/// fifth of its time syncing; a small fleet's syncs take microseconds and wait as little.
const SYNC_SPACING: u32 = 4;

/// Name of the readiness check that the Secrets of the management cluster are known.
pub const READYZ_CHECK: &str = "tenant-secrets";

/// Name of a tenant's readiness check that its caches are within their budget; present once
/// they went over it.
pub const BUDGET_CHECK: &str = "cache-budget";

/// Where the tenants are and how each is configured.
#[derive(Clone, Debug)]
pub struct TenantSettings {
    /// Which Secrets are tenants, and what each tenant's configuration is made from.
    pub base: TenantBase,
    /// The replica group as this replica joins it: its identity is the events'
    /// `reportingInstance`, and the etcd-claim records ([`crate::etcd_claims`]) are kept in its
    /// namespace, their names starting with its Lease name.
    pub election: LeaderElection,
    /// What a tenant kubeconfig may use beyond inline material.
    pub credentials: CredentialPolicy,
    /// What all tenants share.
    pub pools: Pools,
    /// A dry run writes no etcd-claim record: it holds no Lease of any kind.
    pub dry_run: bool,
}

/// What every tenant takes from, so that many hostile tenants together cost no more than one
/// total: their caches' bytes, and their responses' bytes in flight.
#[derive(Clone, Debug)]
pub struct Pools {
    pub caches: reconcilers::budget::CachePool,
    pub responses: reconcilers::budget::BytePool,
}

impl Pools {
    /// The pools, caches' total `cache_total_bytes`, with their metrics in `registry`.
    pub fn new(cache_total_bytes: usize, registry: &mut Registry) -> Self {
        let pools = Pools {
            caches: reconcilers::budget::CachePool::new(
                cache_total_bytes,
                crate::config::TENANT_CACHE_FLOOR_BYTES,
                "--tenants-cache-total-mib (tenants.cacheTotalMiB in the configuration file)",
                registry,
            ),
            responses: reconcilers::budget::BytePool::new(
                crate::limits::TENANTS_RESPONSE_POOL_BYTES,
                crate::limits::TENANTS_RESPONSE_FLOOR_BYTES,
            ),
        };
        registry.register(
            "response_pool_bytes",
            "Bytes the responses of every tenant's client hold at once (bodies being read, watch \
             events not yet complete)",
            pools.responses.gauge(),
        );
        pools
    }
}

/// A tenant whose loops run here.
struct Running {
    spec: Spec,
    /// The runtime's leadership: every loop of a tenant is leader-only, and taking it away
    /// abandons running passes at once (a pass hung on a slow API must not outlive the stop).
    leading: watch::Sender<bool>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    health: Health,
    registry: Arc<Registry>,
}

impl Running {
    fn entry(&self) -> Entry {
        Entry::Running {
            health: self.health.clone(),
            registry: self.registry.clone(),
        }
    }
}

/// How tenants are shared with other replicas: the views to follow, how to acknowledge one, and
/// where each runtime's leadership comes from (a fenced replica takes it from every runtime at
/// once, even while this manager is stuck).
pub struct Ownership {
    pub views: watch::Receiver<View>,
    pub ack: Box<dyn Fn(u64) + Send + Sync>,
    pub leadership: Leadership,
}

impl Ownership {
    /// One replica running every tenant.
    pub fn single(identity: &str) -> Ownership {
        let (sender, views) = watch::channel(View::single(identity));
        // The view never changes; the receiver keeps the last value after the sender is gone.
        drop(sender);
        Ownership {
            views,
            ack: Box::new(|_| {}),
            leadership: Leadership::default(),
        }
    }
}

/// The manager: follows the tenant Secrets and the ownership views, starts and stops tenant
/// runtimes. Ends after `cancel`, once every tenant it ran has stopped.
pub fn spawn(
    client: kube::Client,
    settings: TenantSettings,
    ownership: Ownership,
    health: Health,
    metrics: TenantMetrics,
    directory: Directory,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    health.set_check(
        READYZ_CHECK,
        CheckState::Failing("the tenant Secrets have not been listed yet".to_owned()),
    );
    let reporter = Reporter {
        controller: "bootstrap-controller".to_owned(),
        instance: Some(settings.election.identity.clone()),
    };
    let manager = Manager {
        reporter,
        client,
        settings: Arc::new(settings),
        health,
        metrics,
        directory,
        running: HashMap::new(),
        loads: JoinSet::new(),
        loading: HashMap::new(),
        loaded: HashMap::new(),
        invalid: HashMap::new(),
        etcds: HashMap::new(),
        asks: JoinSet::new(),
        records: Listed::default(),
        unclaimed: HashMap::new(),
        recording: HashMap::new(),
        record_errors: Arc::default(),
        conflicts: HashMap::new(),
        acked: None,
        leadership: ownership.leadership.clone(),
        secrets_failed_at: None,
    };
    tokio::spawn(
        manager
            .run(ownership, cancel)
            .instrument(info_span!("tenants")),
    )
}

/// What a load task ends with: the tenant, the Secret version it read, and the outcome.
type LoadOutcome = (String, Spec, Result<Loaded, Sanitized>);

/// A load under way.
struct Loading {
    spec: Spec,
    id: tokio::task::Id,
    abort: AbortHandle,
}

struct Manager {
    client: kube::Client,
    /// A fresh Recorder per event: kube's Recorder folds events with the same reason about the
    /// same object into one series that keeps the first note, which would hide a new reason.
    reporter: Reporter,
    settings: Arc<TenantSettings>,
    health: Health,
    metrics: TenantMetrics,
    directory: Directory,
    running: HashMap<String, Running>,
    /// Secrets being loaded, each in a task of its own (never awaited by the manager).
    loads: JoinSet<LoadOutcome>,
    loading: HashMap<String, Loading>,
    /// Loads finished, waiting for the next sync to start their runtime.
    loaded: HashMap<String, (Spec, Result<Loaded, Sanitized>)>,
    /// Secrets that could not start a runtime, with why; reported once per version.
    invalid: HashMap<String, (Spec, Sanitized)>,
    /// What is known of each Secret's etcd, asked once per version (again while it fails).
    etcds: HashMap<String, (Spec, EtcdState)>,
    /// The etcds being asked, each in a task of its own (never awaited by the manager).
    asks: JoinSet<AskOutcome>,
    /// The etcd-claim records by name, once listed completely.
    records: Listed<Record>,
    /// Records no Secret makes any more, by name, with when this replica first saw them so.
    unclaimed: HashMap<String, Instant>,
    /// Records being written or deleted, by name, with when: retried after [`RECORD_RETRY`].
    recording: HashMap<String, Instant>,
    /// The last error writing a record, logged once.
    record_errors: Arc<records::RecordErrors>,
    /// Tenants refused for their etcd (keys another tenant keeps, or an etcd that could not be
    /// asked) or shed for the Secrets' budget, reported once per version and reason; `None`:
    /// its etcd did not answer, reported once per version whatever the failure said.
    conflicts: HashMap<String, (Spec, Option<Sanitized>)>,
    /// The last view acknowledged.
    acked: Option<u64>,
    leadership: Leadership,
    /// When the Secret watch last failed, while `/readyz` says so.
    secrets_failed_at: Option<Instant>,
}

impl Manager {
    async fn run(mut self, ownership: Ownership, cancel: CancellationToken) {
        let Ownership { mut views, ack, .. } = ownership;
        let tenants = &self.settings.base.tenants;
        let api: Api<Secret> = match &tenants.namespace {
            Some(namespace) => Api::namespaced(self.client.clone(), namespace),
            None => Api::all(self.client.clone()),
        };
        // A Secret may hold up to 1 MiB: small pages, not kube's 500, bound what one page of a
        // LIST makes this process hold.
        let config = watcher::Config::default()
            .labels(&tenants.secret_selector)
            .page_size(SECRET_PAGE_SIZE);
        let mut events = watcher(api.clone(), config.clone())
            .default_backoff()
            .boxed();
        let records_api: Api<Lease> =
            Api::namespaced(self.client.clone(), &self.settings.election.lease_namespace);
        let records_config = watcher::Config::default().labels(&format!("{RECORD_LABEL}=true"));
        let mut record_events = watcher(records_api, records_config)
            .default_backoff()
            .boxed();
        // Only complete lists are acted on.
        let mut secrets = Listed::<Spec>::budgeted(tenants.secrets_total_bytes());
        let mut relisted = Instant::now();
        let mut views_open = true;
        // Failed record writes and etcds that did not answer are tried again on this timer,
        // not only when an event comes.
        let mut timer = tokio::time::interval(TIMER);
        timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When the next sync may run (see SYNC_SPACING), and whether an event asked for one.
        let mut next_sync = tokio::time::Instant::now();
        let mut wanted = false;
        loop {
            if wanted && tokio::time::Instant::now() >= next_sync {
                wanted = false;
                let held = secrets.held().0;
                if let Some(secrets) = &secrets.complete {
                    let view = views.borrow().clone();
                    let began = tokio::time::Instant::now();
                    self.sync(secrets, &view, ack.as_ref()).await;
                    self.metrics
                        .secret_bytes
                        .set(i64::try_from(held).unwrap_or(i64::MAX));
                    let ended = tokio::time::Instant::now();
                    next_sync = ended + (ended - began) * SYNC_SPACING;
                }
            }
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep_until(next_sync), if wanted => continue,
                event = events.next() => {
                    let Some(event) = event else { break };
                    self.secret_seen(&mut secrets, event);
                }
                event = record_events.next() => {
                    let Some(event) = event else { break };
                    self.record_seen(event);
                }
                changed = views.changed(), if views_open => {
                    if changed.is_err() {
                        views_open = false;
                    }
                }
                Some(done) = self.loads.join_next_with_id(), if !self.loads.is_empty() => {
                    self.finished(done);
                }
                Some(done) = self.asks.join_next(), if !self.asks.is_empty() => {
                    self.asked(done);
                }
                _ = timer.tick() => {
                    if self.secrets_failed_at.is_some_and(|at| at.elapsed() > SECRETS_QUIET) {
                        self.secrets_watched();
                    }
                    // A shed Secret's data is not kept, so only a list can bring it back.
                    if relisted.elapsed() >= RELIST_SPACING
                        && !secrets.listing()
                        && room_for_shed(&secrets)
                    {
                        info!("the tenant Secrets' budget has room for a Secret held without its data; listing them again");
                        events = watcher(api.clone(), config.clone()).default_backoff().boxed();
                        relisted = Instant::now();
                    }
                }
            }
            wanted = true;
        }
        self.loads.abort_all();
        self.asks.abort_all();
        let all: Vec<String> = self.running.keys().cloned().collect();
        self.stop(all, "shutdown").await;
        self.directory.replace(BTreeMap::new());
    }

    /// A tenant Secret watched: listed, changed, or the watch failed (the running tenants go on).
    fn secret_seen(
        &mut self,
        secrets: &mut Listed<Spec>,
        event: Result<watcher::Event<Secret>, watcher::Error>,
    ) {
        let key = self.settings.base.tenants.kubeconfig_key.clone();
        let seen = secrets.apply(
            event,
            |secret| Spec::of(secret, &key),
            |secret| Spec::of(secret, &key).map(|(name, _)| name),
        );
        match seen {
            Seen::Listed(tenants) => {
                info!(tenants, "tenant Secrets listed");
                self.secrets_watched();
            }
            Seen::Failed { message, new } => {
                if new {
                    warn!(error = %message, "cannot watch the tenant Secrets; retrying (running tenants go on)");
                }
                self.secrets_failed_at = Some(Instant::now());
                self.health.set_check(
                    READYZ_CHECK,
                    CheckState::Failing(format!("cannot watch the tenant Secrets: {message}")),
                );
            }
            Seen::Changed => {
                if self.secrets_failed_at.is_some() {
                    self.secrets_watched();
                }
            }
        }
    }

    /// The Secret watch works again. kube's watcher resumes a failed watch from the version it
    /// had, without a list and so without an event while nothing changes: a watch that has not
    /// failed for [`SECRETS_QUIET`], longer than its longest pause between attempts, has resumed.
    fn secrets_watched(&mut self) {
        self.secrets_failed_at = None;
        self.health
            .set_check(READYZ_CHECK, CheckState::Passing(String::new()));
    }

    /// An etcd-claim record watched.
    fn record_seen(&mut self, event: Result<watcher::Event<Lease>, watcher::Error>) {
        let group = self.settings.election.lease_name.clone();
        let seen = self.records.apply(
            event,
            |lease| etcd_claims::parse(&group, lease).map(|record| (record.name.clone(), record)),
            |lease| lease.metadata.name.clone(),
        );
        match seen {
            Seen::Listed(records) => debug!(records, "etcd-claim records listed"),
            Seen::Failed { message, new: true } => warn!(
                error = %message,
                namespace = %self.settings.election.lease_namespace,
                "cannot watch the etcd-claim records (Leases labelled {RECORD_LABEL}); tenants whose etcd keys overlap wait for them"
            ),
            Seen::Failed { .. } | Seen::Changed => {}
        }
    }

    /// A load ended: keep its result for the next sync, if it is still the load wanted.
    fn finished(&mut self, done: Result<(tokio::task::Id, LoadOutcome), tokio::task::JoinError>) {
        match done {
            Ok((id, (key, spec, result))) => {
                if self.loading.get(&key).is_some_and(|l| l.id == id) {
                    self.loading.remove(&key);
                    self.loaded.insert(key, (spec, result));
                }
            }
            // Aborted: nothing was wanted of it any more. Panicked: the Secret is reported.
            Err(err) => {
                let id = err.id();
                let Some(key) = self
                    .loading
                    .iter()
                    .find(|(_, l)| l.id == id)
                    .map(|(key, _)| key.clone())
                else {
                    return;
                };
                if let Some(loading) = self.loading.remove(&key) {
                    warn!(tenant = %key, error = %err, "loading a tenant failed abnormally");
                    self.loaded.insert(
                        key,
                        (
                            loading.spec,
                            Err(Sanitized::new("loading it failed abnormally")),
                        ),
                    );
                }
            }
        }
    }

    /// Makes the running tenants those this replica owns: stops the ones deleted, changed,
    /// owned elsewhere now or refused for their etcd keys, acknowledges the view, then (once the
    /// view is settled) starts the ones it owns that are not running, loading each first.
    async fn sync(
        &mut self,
        secrets: &BTreeMap<String, Spec>,
        view: &View,
        ack: &(dyn Fn(u64) + Send + Sync),
    ) {
        let decision = self.etcd_conflicts(secrets);
        self.stop_unwanted(secrets, view, &decision.refused).await;
        if self.acked != Some(view.id) {
            ack(view.id);
            self.acked = Some(view.id);
        }
        self.forget_unwanted(secrets, view);
        let entries: BTreeMap<String, Entry> = secrets
            .iter()
            .map(|(key, spec)| (key.clone(), self.entry(key, spec, view, &decision)))
            .collect();
        self.publish(view, entries);
        if !self.settings.dry_run {
            self.keep_records(secrets);
        }
    }

    /// Stops the running tenants whose Secret is deleted or changed, that another replica owns
    /// now, or that are refused for their etcd keys.
    async fn stop_unwanted(
        &mut self,
        secrets: &BTreeMap<String, Spec>,
        view: &View,
        refused_keys: &HashMap<String, String>,
    ) {
        let mut deleted = Vec::new();
        let mut changed = Vec::new();
        let mut moved = Vec::new();
        let mut refused = Vec::new();
        for (key, running) in &self.running {
            match secrets.get(key) {
                None => deleted.push(key.clone()),
                Some(spec) if *spec != running.spec => changed.push(key.clone()),
                Some(_) if !view.owns(key) => moved.push(key.clone()),
                Some(_) if refused_keys.contains_key(key) => refused.push(key.clone()),
                Some(_) => {}
            }
        }
        self.stop(deleted, "deleted").await;
        self.stop(changed, "changed").await;
        self.stop(moved, "moved").await;
        self.stop(refused, "refused").await;
    }

    /// Drops what is known of Secrets no longer wanted here; their loads end now (they never
    /// touched the tenant).
    fn forget_unwanted(&mut self, secrets: &BTreeMap<String, Spec>, view: &View) {
        let wanted = |key: &str, spec: &Spec| secrets.get(key) == Some(spec) && view.owns(key);
        self.loading.retain(|key, loading| {
            let keep = wanted(key, &loading.spec);
            if !keep {
                loading.abort.abort();
            }
            keep
        });
        self.loaded.retain(|key, (spec, _)| wanted(key, spec));
        self.invalid
            .retain(|key, (spec, _)| secrets.get(key) == Some(spec));
        self.conflicts
            .retain(|key, (spec, _)| secrets.get(key) == Some(spec));
    }

    /// Where one tenant stands, starting, loading or refusing it when this replica owns it.
    fn entry(
        &mut self,
        key: &str,
        spec: &Spec,
        view: &View,
        decision: &etcd_claims::Decision,
    ) -> Entry {
        if let Some(running) = self.running.get(key) {
            return running.entry();
        }
        if !view.owns(key) {
            return Entry::Elsewhere(view.owner(key).unwrap_or("none").to_owned());
        }
        if let Some(wanted) = spec.shed {
            let reason = self.over_secrets_budget(wanted);
            let finding = (spec.clone(), Some(reason.clone()));
            if self.conflicts.get(key) != Some(&finding) {
                warn!(tenant = %key, "{reason}");
                self.metrics.secrets_shed.inc();
                self.secret_events(spec)("TenantOverBudget", "StartTenant", reason.to_string());
                self.conflicts.insert(key.to_owned(), finding);
            }
            return Entry::Invalid(reason);
        }
        if let Some((_, reason)) = self.invalid.get(key) {
            return Entry::Invalid(reason.clone());
        }
        let failure = self
            .etcds
            .get(key)
            .and_then(|(_, state)| state.failure())
            .cloned();
        let refused = decision.refused.get(key);
        if let Some(reason) = refused.or(failure.as_ref().map(|failure| &failure.reason)) {
            // It names etcd prefixes and servers the tenants' annotations wrote.
            let reason = Sanitized::new(reason);
            // An etcd that does not answer is asked again every `ASK_RETRY`, and each failure
            // may read otherwise (a refused connection, then no answer): one report a version.
            let unanswered = refused.is_none() && failure.is_some_and(|f| f.unanswered);
            let finding = (spec.clone(), (!unanswered).then(|| reason.clone()));
            if self.conflicts.get(key) != Some(&finding) {
                self.refuse(key, spec, &reason);
                self.conflicts.insert(key.to_owned(), finding);
            }
            return Entry::Invalid(reason);
        }
        // Refused no longer: the same refusal coming back is reported again.
        self.conflicts.remove(key);
        if !view.settled {
            return Entry::Waiting("the hand-over");
        }
        if decision.undecided.iter().any(|undecided| undecided == key) {
            return Entry::Waiting("its etcd's answer and the decision on its etcd keys");
        }
        let loaded = self.loaded.remove(key);
        if self.loaded.is_empty() {
            // Its table grew to hold every load of a fleet's start, entries the size of a
            // tenant's whole configuration; kept, it would be a few KiB a tenant for good.
            self.loaded.shrink_to_fit();
        }
        match loaded {
            Some((_, Ok(loaded))) => {
                let running = self.start(key, spec, loaded);
                let entry = running.entry();
                self.running.insert(key.to_owned(), running);
                entry
            }
            Some((_, Err(reason))) => {
                self.refuse(key, spec, &reason);
                self.invalid
                    .insert(key.to_owned(), (spec.clone(), reason.clone()));
                Entry::Invalid(reason)
            }
            None => {
                if !self.loading.contains_key(key) {
                    let pin = match self.etcds.get(key) {
                        Some((_, EtcdState::Known(asked))) => Some(asked.pin.clone()),
                        _ => None,
                    };
                    self.load(key, spec, pin);
                }
                Entry::Starting
            }
        }
    }

    /// The tenants' states, to the metrics and to the admin server's directory.
    fn publish(&self, view: &View, entries: BTreeMap<String, Entry>) {
        self.metrics
            .replicas
            .set(i64::try_from(view.replicas.len()).unwrap_or(i64::MAX));
        self.metrics.fenced.set(i64::from(view.fenced));
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for entry in entries.values() {
            *counts.entry(entry.state()).or_default() += 1;
        }
        for state in STATES {
            self.metrics
                .tenants
                .get_or_create(&StateLabels { state })
                .set(counts.get(state).copied().unwrap_or(0));
        }
        self.directory.replace(entries);
    }

    /// Starts loading a tenant's Secret in a task of its own, bounded by [`LOAD_TIMEOUT`].
    fn load(&mut self, key: &str, spec: &Spec, etcd_pin: Option<EtcdPin>) {
        let settings = self.settings.clone();
        let (task_key, task_spec) = (key.to_owned(), spec.clone());
        let abort = self.loads.spawn(
            async move {
                // Every reason quotes what the Secret's writer wrote (names, values, the
                // kubeconfig parser's view of it), so it is sanitized once, here.
                let result = match tokio::time::timeout(
                    LOAD_TIMEOUT,
                    load(&settings, &task_key, &task_spec, etcd_pin),
                )
                .await
                {
                    Ok(result) => result.map_err(|reason| Sanitized::new(&reason)),
                    Err(_) => Err(Sanitized::of(format_args!(
                        "loading its kubeconfig and configuration took more than {} s (a \
                         credential plugin that does not answer?)",
                        LOAD_TIMEOUT.as_secs()
                    ))),
                };
                (task_key, task_spec, result)
            }
            .instrument(info_span!("tenant", tenant = %key)),
        );
        self.loading.insert(
            key.to_owned(),
            Loading {
                spec: spec.clone(),
                id: abort.id(),
                abort,
            },
        );
    }

    /// Why a Secret shed for the Secrets' budget does not start its tenant.
    fn over_secrets_budget(&self, wanted: usize) -> Sanitized {
        let tenants = &self.settings.base.tenants;
        Sanitized::of(format_args!(
            "its kubeconfig, etcd certificates and configuration annotation ({wanted} bytes) \
             would take the tenant Secrets this process holds over --tenants-secrets-total-mib \
             ({} MiB; tenants.secretsTotalMiB): not kept, and the tenant not run. It is \
             started once other Secrets make room (deleted or smaller), or once the budget is \
             raised",
            tenants.secrets_total_mib
        ))
    }

    /// A Secret that cannot start its tenant: a log line, the counter, and a Warning event on
    /// the Secret (published in a task of its own: the management API's latency is not the
    /// manager's).
    fn refuse(&self, key: &str, spec: &Spec, reason: &Sanitized) {
        warn!(tenant = %key, "{reason}");
        self.metrics.config_errors.inc();
        // A sanitized reason fits a note (at most 1 KiB).
        self.secret_events(spec)("TenantConfigInvalid", "StartTenant", reason.to_string());
    }

    /// Publishes a Warning event (reason, action, note) on the tenant's Secret, in a task of its
    /// own: the management API's latency is not the caller's, and a failure is only logged.
    fn secret_events(&self, spec: &Spec) -> impl Fn(&'static str, &'static str, String) + use<> {
        let (client, reporter) = (self.client.clone(), self.reporter.clone());
        let reference = secret_ref(spec);
        move |reason, action, note| {
            let event = Event {
                type_: EventType::Warning,
                reason: reason.to_owned(),
                note: Some(note),
                action: action.to_owned(),
                secondary: None,
            };
            let recorder = Recorder::new(client.clone(), reporter.clone());
            let reference = reference.clone();
            tokio::spawn(async move {
                if let Err(err) = recorder.publish(&event, &reference).await {
                    debug!(error = %err, "cannot publish the {reason} event");
                }
            });
        }
    }

    /// What happens when a tenant's caches would go over their budget: its client pauses as for
    /// a broken bound (every request fails at once until the pause ends, so its loops neither
    /// read nor write on what they no longer hold), `/readyz` says so, and the Secret gets one
    /// Warning event until its caches list within their budget again (`reported`, which the
    /// recovery clears; a breach repeats after each pause while the tenant is too large, and the
    /// event would only repeat too).
    fn over_budget(
        &self,
        key: &str,
        spec: &Spec,
        limits: crate::limits::LimitLayer,
        health: Health,
        reported: Arc<std::sync::atomic::AtomicBool>,
    ) -> reconcilers::budget::BreachHook {
        let warn_on_secret = self.secret_events(spec);
        let key = key.to_owned();
        Arc::new(move |breach: &reconcilers::budget::Breach| {
            let message = breach.to_string();
            let pause = limits.breach(crate::limits::LimitError::OverBudget(message.clone()));
            health.set_check(
                BUDGET_CHECK,
                CheckState::Failing(format!(
                    "over its cache budget, paused (the last pause {} s): {message}",
                    pause.as_secs()
                )),
            );
            if !reported.swap(true, std::sync::atomic::Ordering::AcqRel) {
                warn!(tenant = %key, pause_s = pause.as_secs(), "{message}; the tenant is paused");
                // The breach names tenant objects' kinds: sanitized, it fits a note.
                let note = reconcilers::sanitize::sanitize(&message).into_string();
                warn_on_secret("TenantOverBudget", "CacheTenant", note);
            }
            pause
        })
    }

    /// What the tenant's client does when the tenant's API breaks a bound of
    /// [`crate::limits::Limits`] (a response, a list, a watch or a connection beyond its bound,
    /// or the pool every tenant's responses share): besides the log line and the pause, one
    /// Warning event on its Secret when it starts to, so that whoever owns the Secret sees why
    /// its cluster is not kept. A cache budget's breach has its own event.
    fn api_over_limit(&self, key: &str, spec: &Spec) -> crate::limits::BreachNotice {
        let warn_on_secret = self.secret_events(spec);
        let key = key.to_owned();
        Arc::new(move |cause: &crate::limits::LimitError, pause: Duration| {
            if matches!(cause, crate::limits::LimitError::OverBudget(_)) {
                return;
            }
            let message = format!(
                "the tenant's API server broke a bound: {cause}; nothing is asked of it for {} s \
                 (longer each time it does again)",
                pause.as_secs()
            );
            warn!(tenant = %key, "{message}");
            let note = reconcilers::sanitize::sanitize(&message).into_string();
            warn_on_secret("TenantAPIOverLimit", "ReadTenant", note);
        })
    }

    /// Starts one tenant's runtime from what its load gave. Nothing here reaches the tenant's
    /// API, so a tenant that is down costs no time here; its loops retry on their own.
    fn start(&self, key: &str, spec: &Spec, loaded: Loaded) -> Running {
        let Loaded {
            config,
            kube_config,
            client,
            limits,
        } = loaded;
        let mut metrics = TenantRegistry::new();
        let load_kubeconfig: reconcilers::apiserver_endpoints::ConfigLoader = {
            let kube_config = kube_config.clone();
            Arc::new(move || {
                let kube_config = kube_config.clone();
                Box::pin(async move { Ok(kube_config) })
            })
        };
        let budget = CacheBudget::new(
            self.settings.base.tenants.cache_limits(key),
            format!(
                "--tenants-cache-max-objects / --tenants-cache-max-mib, or for this tenant \
                 tenants.cacheBudgets.{key:?} in the configuration file"
            ),
            Some(self.settings.pools.caches.clone()),
            &mut metrics,
        );
        let runner =
            crate::runner::build_runner(&config, &client, load_kubeconfig, &budget, &mut metrics);
        let health = runner.health();
        limits.on_breach(self.api_over_limit(key, spec));
        let over_budget_reported = Arc::new(std::sync::atomic::AtomicBool::new(false));
        budget.on_breach(self.over_budget(
            key,
            spec,
            limits,
            health.clone(),
            over_budget_reported.clone(),
        ));
        budget.on_recovery({
            let health = health.clone();
            Arc::new(move || {
                over_budget_reported.store(false, std::sync::atomic::Ordering::Release);
                health.set_check(
                    BUDGET_CHECK,
                    CheckState::Passing("its caches listed within their budget again".to_owned()),
                );
            })
        });
        let cancel = CancellationToken::new();
        let (leading, leadership) = self.leadership.grant();
        let task = tokio::spawn(
            runner
                .run(leadership, cancel.clone())
                .instrument(info_span!("tenant", tenant = %key)),
        );
        info!(tenant = %key, server = %Sanitized::of(&kube_config.cluster_url), "tenant started");
        self.metrics.starts.inc();
        Running {
            spec: spec.clone(),
            leading,
            cancel,
            task,
            health,
            registry: Arc::new(tenant_registry(Sanitized::new(key).into_string(), metrics)),
        }
    }

    /// Stops tenants and waits until each runtime has ended: running passes are abandoned (their
    /// leadership taken away) rather than awaited, so a stop is quick even when a tenant's API
    /// hangs, and only then may another replica start them.
    async fn stop(&mut self, keys: Vec<String>, reason: &'static str) {
        if keys.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut stopping = Vec::with_capacity(keys.len());
        for key in &keys {
            if let Some(running) = self.running.remove(key) {
                let _ = running.leading.send(false);
                running.cancel.cancel();
                stopping.push(running.task);
            }
        }
        let count = stopping.len();
        for joined in futures::future::join_all(stopping).await {
            if let Err(err) = joined {
                warn!(error = %err, "a tenant runtime ended abnormally");
            }
        }
        self.metrics
            .stops
            .get_or_create(&ReasonLabels { reason })
            .inc_by(u64::try_from(count).unwrap_or(u64::MAX));
        info!(tenants = ?keys, reason, took = ?started.elapsed(), "tenants stopped");
    }
}

/// The reference of a tenant's Secret, for its events.
fn secret_ref(spec: &Spec) -> k8s_openapi::api::core::v1::ObjectReference {
    let mut secret = Secret::default();
    secret.metadata.namespace = Some(spec.namespace.clone());
    secret.metadata.name = Some(spec.name.clone());
    secret.metadata.uid = Some(spec.uid.clone()).filter(|uid| !uid.is_empty());
    secret.object_ref(&())
}

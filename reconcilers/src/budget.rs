//! What one cluster's caches may hold, and the watch that keeps a cache within it.
//!
//! Every cache of a cluster (the Services the repairs share, the namespaces, the `kubernetes`
//! endpoints, ...) is fed by [`watch`]: the list+watch of [`crate::list_watch`] (kube-runtime's
//! watcher and its default backoff, with a body reader that holds nothing between events), plus
//! the things below.
//!
//! - **A budget.** A cluster's caches together hold at most [`BudgetLimits`] objects and
//!   bytes. A tenant API that lists or streams objects without end (or a tenant far larger than
//!   its budget) would otherwise grow the one process every tenant shares until it is killed.
//!   The cache whose event would go over the budget drops everything it holds, says so
//!   ([`CacheError::OverBudget`]), and its watch starts again only after a pause that the
//!   budget's owner decides (management mode pauses the tenant's whole client, see
//!   `controllers/src/limits.rs`), and every other cache of the cluster drops its contents too.
//!   Bytes are estimated: a whole decoded object about five times its JSON size, a projected
//!   record's own size.
//! - **No silent loss.** A watch event that cannot be decoded would, were it dropped and the
//!   watch gone on, leave a cache without that object's update or delete for good, and loops
//!   would decide on an object that is gone. Here such an event ends the watch: the cache is not
//!   current ([`CacheError::Lost`]) until a new list has it again, retried with backoff.
//!
//! - **A pool.** The budgets of many clusters may share a [`CachePool`]: the most bytes all of
//!   their caches hold together, whatever the number of clusters. A cache whose event would take
//!   the pool over its total breaches as over its own budget (the cluster that grows is the one
//!   paused), unless its cluster holds no more than the pool's floor: a small cluster is never
//!   paused by what large ones hold. Every cluster's floor is kept for it: a cluster above its
//!   floor may grow only while the pool holds at most the total less every cluster's floor, so
//!   the clusters within their floors can fill them without taking the pool over its total. The
//!   floor is at most half a fair share (the total over twice the number of clusters), so
//!   however many clusters there are, at least half the total is left to those above their
//!   floor. For a given set of clusters the pool so holds at most its total, beside the events
//!   being counted when they breach (each is counted, then dropped with its cache). A cluster
//!   added later has its floor kept from then on, but what the others hold is not taken back:
//!   until they shrink, the pool may hold up to the later clusters' floors more.
//!
//! The cluster of `--kubeconfig` has an unlimited budget: its caches are not counted.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::runtime::watcher;
use kube::{Api, Resource};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;

use crate::list_watch::{ListWatch, ListWatchError};
use crate::metrics::MetricRegistry;

/// The most a cluster's caches may hold together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetLimits {
    pub max_objects: usize,
    pub max_bytes: usize,
}

impl BudgetLimits {
    pub const UNLIMITED: BudgetLimits = BudgetLimits {
        max_objects: usize::MAX,
        max_bytes: usize::MAX,
    };
}

/// A cache that would have gone over its cluster's budget, or its budget's pool.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{} would hold more than {limit} {unit}{} (at {resource}); the {} is {hint}",
    if *pooled { "the caches of every cluster together" } else { "the caches" },
    if *pooled { ", the total less the floor kept for every cluster" } else { "" },
    if *pooled { "total" } else { "budget" }
)]
pub struct Breach {
    /// The kind whose cache went over, e.g. `Service`.
    pub resource: String,
    /// `objects` or `bytes`.
    pub unit: &'static str,
    /// The budget's limit, or for the pool its total less the floor kept for every cluster.
    pub limit: usize,
    /// Where the limit is set, for the operator: the setting that raises it.
    pub hint: String,
    /// Whether the limit is the pool's (every cluster's caches together), not the cluster's.
    pub pooled: bool,
}

/// The most bytes the caches of many clusters hold together; clones share it.
#[derive(Clone, Debug)]
pub struct CachePool {
    bytes: BytePool,
    /// Named in every pool [`Breach`]: the setting that raises the total.
    hint: String,
    breaches: Counter,
}

impl PartialEq for CachePool {
    /// Two pools are equal when their limits are (what a configuration compares).
    fn eq(&self, other: &Self) -> bool {
        let limits = |pool: &CachePool| (pool.bytes.0.max_bytes, pool.bytes.0.floor);
        limits(self) == limits(other)
    }
}

impl Eq for CachePool {}

impl CachePool {
    /// A pool of `max_bytes`, of which each cluster may hold `floor` whatever the others hold;
    /// `hint` names the setting that raises `max_bytes`. Its metrics (`cache_pool_bytes`,
    /// `cache_pool_limit_bytes`, `cache_pool_over_total`) go to `registry`.
    pub fn new(
        max_bytes: usize,
        floor: usize,
        hint: impl Into<String>,
        registry: &mut Registry,
    ) -> Self {
        let pool = Self::unregistered(max_bytes, floor, hint.into());
        registry.register(
            "cache_pool_bytes",
            "Estimated bytes the caches of every tenant hold together",
            pool.bytes.gauge(),
        );
        let limit = Gauge::<i64>::default();
        limit.set(i64::try_from(max_bytes).unwrap_or(i64::MAX));
        registry.register(
            "cache_pool_limit_bytes",
            "The most bytes the caches of every tenant hold together (--tenants-cache-total-mib)",
            limit,
        );
        registry.register(
            "cache_pool_over",
            "Pauses of a tenant because its caches' growth would have taken every tenant's \
             caches together over their total (one a breach)",
            pool.breaches.clone(),
        );
        pool
    }

    fn unregistered(max_bytes: usize, floor: usize, hint: String) -> Self {
        CachePool {
            bytes: BytePool::new(max_bytes, floor),
            hint,
            breaches: Counter::default(),
        }
    }
}

/// The bytes that many sharers hold together (every tenant's caches, every tenant client's
/// responses): at most `max_bytes`, of which each sharer may hold `floor` whatever the others
/// hold (see [`pool_bounds`]); clones share it.
#[derive(Clone, Debug)]
pub struct BytePool(Arc<PoolCounts>);

#[derive(Debug)]
struct PoolCounts {
    max_bytes: usize,
    /// What a sharer may hold however full the pool is, at most half its fair share.
    floor: usize,
    /// The [`PoolShare`]s alive: the fair share is the total over their number.
    sharers: AtomicUsize,
    bytes: Count,
}

impl BytePool {
    pub fn new(max_bytes: usize, floor: usize) -> Self {
        BytePool(Arc::new(PoolCounts {
            max_bytes,
            floor,
            sharers: AtomicUsize::new(0),
            bytes: Count::default(),
        }))
    }

    /// The gauge of the bytes held, for a registry.
    pub fn gauge(&self) -> Count {
        self.0.bytes.clone()
    }

    /// One more sharer, taking a share of the pool while the returned [`PoolShare`] lives.
    pub fn join(&self) -> PoolShare {
        self.0.sharers.fetch_add(1, Ordering::AcqRel);
        PoolShare(self.clone())
    }

    /// What one sharer may hold however full the pool is, and what the sharers above it may
    /// take the pool to: see [`pool_bounds`].
    pub fn bounds(&self) -> (usize, usize) {
        pool_bounds(
            self.0.max_bytes,
            self.0.floor,
            self.0.sharers.load(Ordering::Acquire),
        )
    }

    /// The bytes every sharer holds now.
    pub fn held(&self) -> usize {
        count_of(&self.0.bytes)
    }
}

/// One sharer's place in a [`BytePool`], from [`BytePool::join`] until it is dropped.
#[derive(Debug)]
pub struct PoolShare(BytePool);

impl PoolShare {
    /// Moves this sharer's count from `before` to `after` bytes, the sharer holding
    /// `sharer_now` in all; when it grew above its floor with the pool over what the sharers
    /// above their floors may take, that limit.
    pub fn moved(&self, before: usize, after: usize, sharer_now: usize) -> Result<(), usize> {
        let pool = &self.0;
        let now = move_count(&pool.0.bytes, before, after);
        let (floor, above_floors) = pool.bounds();
        if after > before && now > above_floors && sharer_now > floor {
            return Err(above_floors);
        }
        Ok(())
    }
}

impl Drop for PoolShare {
    fn drop(&mut self) {
        let PoolShare(pool) = self;
        pool.0.sharers.fetch_sub(1, Ordering::AcqRel);
    }
}

/// For a pool of `total` bytes shared by `sharers`: what one sharer may hold however full the
/// pool is (`floor`, or half a fair share of the total when that is less), and the most the pool
/// may hold when a sharer above that grows (the total less every sharer's floor). The sharers
/// within their floors hold at most the floors' sum, which is kept out of what the others may
/// take, so all together hold at most `total`; the floors' sum is at most half the total, so the
/// sharers above their floor always have the other half.
pub fn pool_bounds(total: usize, floor: usize, sharers: usize) -> (usize, usize) {
    let sharers = sharers.max(1);
    let floor = floor.min(total / sharers.saturating_mul(2));
    (floor, total - sharers * floor)
}

/// A count of objects or bytes held, which is also its own gauge: what a registry exposes is
/// the count the limits are checked against.
pub type Count = Gauge<u64, AtomicU64>;

/// Moves `count` by `after - before`; the count now.
pub fn move_count(count: &Count, before: usize, after: usize) -> usize {
    // usize and u64 are the same size on every target this builds for.
    let (before, after) = (before as u64, after as u64);
    let now = if after >= before {
        count.inc_by(after - before) + (after - before)
    } else {
        count.dec_by(before - after) - (before - after)
    };
    now as usize
}

/// What `count` holds now.
pub fn count_of(count: &Count) -> usize {
    count.get() as usize
}

/// Decides the pause after a breach (and reports it); returns how long the cache waits before
/// it lists again.
pub type BreachHook = Arc<dyn Fn(&Breach) -> Duration + Send + Sync>;

/// Told when a cache that went over its budget has listed within it again.
pub type RecoveryHook = Arc<dyn Fn() + Send + Sync>;

/// The pause when nothing else decides it.
const DEFAULT_PAUSE: Duration = Duration::from_secs(30);

/// One cluster's budget, shared by its caches; clones share it.
#[derive(Clone)]
pub struct CacheBudget(Arc<Shared>);

struct Shared {
    limits: BudgetLimits,
    /// What this budget's bytes are counted in too, with other clusters' budgets, and this
    /// cluster's share of it.
    pool: Option<(CachePool, PoolShare)>,
    /// Named in every [`Breach`]: the setting that raises the limits.
    hint: String,
    hook: Mutex<Option<BreachHook>>,
    recovery: Mutex<Option<RecoveryHook>>,
    /// The last breach and the end of its pause: every cache of the cluster drops what it holds
    /// and stops watching until then, not only the one that went over.
    pause: tokio::sync::watch::Sender<Option<(tokio::time::Instant, Breach)>>,
    metrics: CacheMetrics,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

/// The objects and bytes the caches hold are counted in these gauges themselves.
#[derive(Clone, Default)]
struct CacheMetrics {
    objects: Count,
    bytes: Count,
    over_budget: Family<ResourceLabels, Counter>,
    lost: Family<ResourceLabels, Counter>,
}

impl Default for CacheBudget {
    /// Unlimited and unregistered: for tests and one-off passes.
    fn default() -> Self {
        Self::unregistered(BudgetLimits::UNLIMITED, String::new(), None)
    }
}

impl Debug for CacheBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheBudget")
            .field("limits", &self.0.limits)
            .field("held", &self.held())
            .finish()
    }
}

impl CacheBudget {
    /// A budget with its metrics in `registry` (`cache_events_lost_total`, and where it is
    /// limited `cache_objects`, `cache_bytes`, `cache_over_budget_total`). `hint` names the
    /// setting that raises `limits`. With a `pool`, its bytes count in the pool's total too.
    pub fn new(
        limits: BudgetLimits,
        hint: impl Into<String>,
        pool: Option<CachePool>,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        let budget = Self::unregistered(limits, hint.into(), pool);
        let metrics = &budget.0.metrics;
        registry.register(
            "cache_events_lost",
            "Watch events that could not be decoded; each makes its cache list again",
            metrics.lost.clone(),
        );
        // An unlimited budget counts nothing: no figures that would only ever read zero.
        if budget.is_limited() {
            registry.register(
                "cache_objects",
                "Objects the caches of this cluster hold",
                metrics.objects.clone(),
            );
            registry.register(
                "cache_bytes",
                "Estimated bytes the caches of this cluster hold",
                metrics.bytes.clone(),
            );
            registry.register(
                "cache_over_budget",
                "Caches emptied because they would have gone over the cluster's cache budget",
                metrics.over_budget.clone(),
            );
        }
        budget
    }

    fn unregistered(limits: BudgetLimits, hint: String, pool: Option<CachePool>) -> Self {
        CacheBudget(Arc::new(Shared {
            limits,
            pool: pool.map(|pool| {
                let sharer = pool.bytes.join();
                (pool, sharer)
            }),
            hint,
            hook: Mutex::new(None),
            recovery: Mutex::new(None),
            pause: tokio::sync::watch::Sender::new(None),
            metrics: CacheMetrics::default(),
        }))
    }

    /// What the caches hold now: objects and estimated bytes.
    pub fn held(&self) -> (usize, usize) {
        let metrics = &self.0.metrics;
        (count_of(&metrics.objects), count_of(&metrics.bytes))
    }

    /// The most objects the caches may hold together.
    pub fn max_objects(&self) -> usize {
        self.0.limits.max_objects
    }

    /// The setting that raises the limits, for a message naming them.
    pub fn hint(&self) -> &str {
        &self.0.hint
    }

    fn is_limited(&self) -> bool {
        self.0.limits != BudgetLimits::UNLIMITED || self.0.pool.is_some()
    }

    /// Who decides the pause after a breach (and reports it).
    pub fn on_breach(&self, hook: BreachHook) {
        *self.0.hook.lock().unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    /// Who is told when a cache that went over the budget has listed within it again.
    pub fn on_recovery(&self, hook: RecoveryHook) {
        *self
            .0
            .recovery
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(hook);
    }

    fn recovered(&self) {
        let hook = self
            .0
            .recovery
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    fn breached(&self, breach: &Breach) -> Duration {
        self.0
            .metrics
            .over_budget
            .get_or_create(&ResourceLabels {
                resource: breach.resource.clone(),
            })
            .inc();
        if breach.pooled
            && let Some((pool, _)) = &self.0.pool
        {
            pool.breaches.inc();
        }
        let hook = self
            .0
            .hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let pause = hook.map_or(DEFAULT_PAUSE, |hook| hook(breach));
        self.0
            .pause
            .send_replace(Some((tokio::time::Instant::now() + pause, breach.clone())));
        pause
    }

    fn lost(&self, resource: &str) {
        self.0
            .metrics
            .lost
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .inc();
    }

    /// Moves one cache's count from `before` to `after` (objects, bytes); the breach when the
    /// totals go over, the budget's or (for a cluster holding more than the pool's floor) the
    /// pool's: the total less the floors kept for every cluster.
    fn charge(
        &self,
        before: (usize, usize),
        after: (usize, usize),
        resource: &str,
    ) -> Result<(), Breach> {
        let objects_now = move_count(&self.0.metrics.objects, before.0, after.0);
        let bytes_now = move_count(&self.0.metrics.bytes, before.1, after.1);
        let pooled = (self.0.pool.as_ref())
            .map(|(pool, sharer)| (pool, sharer.moved(before.1, after.1, bytes_now)));
        let limits = self.0.limits;
        let breach = |unit, limit, hint: &str, pooled| Breach {
            resource: resource.to_owned(),
            unit,
            limit,
            hint: hint.to_owned(),
            pooled,
        };
        if after.0 > before.0 && objects_now > limits.max_objects {
            return Err(breach("objects", limits.max_objects, &self.0.hint, false));
        }
        if after.1 > before.1 && bytes_now > limits.max_bytes {
            return Err(breach("bytes", limits.max_bytes, &self.0.hint, false));
        }
        if let Some((pool, Err(above_floors))) = pooled {
            return Err(breach("bytes", above_floors, &pool.hint, true));
        }
        Ok(())
    }
}

/// What one cache holds, as its budget counts it: each object's key (a hash of namespace and
/// name) and weight, for the objects listed and, during a relist, those of the list under way
/// (a cache holds both until the list completes).
struct Account {
    budget: CacheBudget,
    resource: String,
    held: Tally,
    listing: Option<Tally>,
}

/// Objects by key with their weights, and the weights' sum, kept as they change (an event
/// costs the same whatever the cache holds).
#[derive(Default)]
struct Tally {
    weights: HashMap<u64, usize>,
    bytes: usize,
}

impl Tally {
    fn insert(&mut self, key: u64, weight: usize) {
        let before = self.weights.insert(key, weight).unwrap_or(0);
        self.bytes = self.bytes.saturating_sub(before).saturating_add(weight);
    }

    fn remove(&mut self, key: u64) {
        let before = self.weights.remove(&key).unwrap_or(0);
        self.bytes = self.bytes.saturating_sub(before);
    }
}

impl Account {
    fn new(budget: CacheBudget, resource: String) -> Self {
        Account {
            budget,
            resource,
            held: Tally::default(),
            listing: None,
        }
    }

    fn key<K: Resource>(object: &K) -> u64 {
        let meta = object.meta();
        foldhash::quality::FixedState::with_seed(0)
            .hash_one((meta.namespace.as_deref(), meta.name.as_deref()))
    }

    /// Counts `event`; the breach when the cluster's caches go over their budget with it.
    fn apply<K: Resource>(
        &mut self,
        event: &watcher::Event<K>,
        weight: impl Fn(&K) -> usize,
    ) -> Result<(), Breach> {
        let before = self.totals();
        match event {
            watcher::Event::Init => self.listing = Some(Tally::default()),
            watcher::Event::InitApply(object) => self
                .listing
                .get_or_insert_with(Tally::default)
                .insert(Self::key(object), weight(object)),
            watcher::Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    self.held = listed;
                }
            }
            watcher::Event::Apply(object) => self.held.insert(Self::key(object), weight(object)),
            watcher::Event::Delete(object) => self.held.remove(Self::key(object)),
        }
        (self.budget).charge(before, self.totals(), &self.resource)
    }

    /// The objects and bytes the cache holds, as the budget was charged for them.
    fn totals(&self) -> (usize, usize) {
        [Some(&self.held), self.listing.as_ref()]
            .into_iter()
            .flatten()
            .fold((0, 0), |(objects, bytes), tally| {
                (objects + tally.weights.len(), bytes + tally.bytes)
            })
    }

    /// Gives back everything: the cache has dropped its contents.
    fn release(&mut self) {
        let before = self.totals();
        self.held = Tally::default();
        self.listing = None;
        // Releasing never breaches.
        let _ = (self.budget).charge(before, (0, 0), &self.resource);
    }
}

impl Drop for Account {
    fn drop(&mut self) {
        self.release();
    }
}

/// Why a cache's watch yielded no event.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The list or the watch failed; it is retried with backoff.
    #[error(transparent)]
    Watch(ListWatchError),
    /// The cache dropped its contents: they would have gone over the cluster's budget. It lists
    /// again after a pause.
    #[error("{0}; the cache was emptied and lists again after a pause")]
    OverBudget(Breach),
    /// An event could not be decoded and was lost: the cache is not current until a new list
    /// has the object again.
    #[error("a watch event of {resource} could not be decoded; the cache lists again")]
    Lost {
        resource: String,
        #[source]
        source: serde_json::Error,
    },
}

/// What a cache's watch yields.
pub type CacheEvent<K> = Result<watcher::Event<K>, CacheError>;

struct WatchState<K> {
    list_watch: ListWatch<K>,
    /// The kind watched, e.g. `Service`.
    resource: String,
    account: Option<Account>,
    budget: CacheBudget,
    weight: fn(&K) -> usize,
    /// How long to wait before listing again: the pause after a breach.
    delay: Duration,
    /// Whether this cache went over the budget and has not listed within it since.
    over: bool,
    /// The cluster's pauses (another cache's breach empties this one too).
    pauses: tokio::sync::watch::Receiver<Option<(tokio::time::Instant, Breach)>>,
}

/// The watch that feeds one cache: a [`ListWatch`] (with its backoff) within `budget`, each
/// object weighing `weight(object)` bytes, listing again (after the list+watch's pause) on an
/// event it cannot decode. A cache applies each `Ok` event; on [`CacheError::OverBudget`] it
/// drops its contents and on [`CacheError::Lost`] it is not current until the next `InitDone`.
pub fn watch<K>(
    api: Api<K>,
    config: watcher::Config,
    budget: &CacheBudget,
    weight: fn(&K) -> usize,
) -> BoxStream<'static, CacheEvent<K>>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    let resource = K::kind(&K::DynamicType::default()).into_owned();
    let state = WatchState {
        list_watch: ListWatch::new(api, config),
        account: budget
            .is_limited()
            .then(|| Account::new(budget.clone(), resource.clone())),
        resource,
        budget: budget.clone(),
        weight,
        delay: Duration::ZERO,
        over: false,
        pauses: budget.0.pause.subscribe(),
    };
    futures::stream::unfold(state, |mut state| async move {
        let item = state.next().await;
        Some((item, state))
    })
    .boxed()
}

impl<K> WatchState<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    async fn next(&mut self) -> CacheEvent<K> {
        loop {
            let delay = std::mem::take(&mut self.delay);
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let limited = self.account.is_some();
            let item = tokio::select! {
                biased;
                Ok(()) = self.pauses.changed(), if limited => {
                    let pause = self.pauses.borrow_and_update().clone();
                    match pause {
                        Some((until, breach)) if until > tokio::time::Instant::now() => {
                            if let Some(account) = &mut self.account {
                                account.release();
                            }
                            self.list_watch.restart();
                            self.over = true;
                            self.delay =
                                until.saturating_duration_since(tokio::time::Instant::now());
                            return Err(CacheError::OverBudget(breach));
                        }
                        _ => continue,
                    }
                }
                item = self.list_watch.next() => item,
            };
            return match item {
                Ok(event) => {
                    if let Some(account) = &mut self.account
                        && let Err(breach) = account.apply(&event, self.weight)
                    {
                        account.release();
                        self.list_watch.restart();
                        self.over = true;
                        self.delay = self.budget.breached(&breach);
                        // This cache's own pause: not a second breach to react to.
                        self.pauses.borrow_and_update();
                        return Err(CacheError::OverBudget(breach));
                    }
                    if self.over && matches!(event, watcher::Event::InitDone) {
                        self.over = false;
                        self.budget.recovered();
                    }
                    Ok(event)
                }
                // The list+watch lists again after its backoff's pause.
                Err(ListWatchError::Undecodable(source)) => {
                    self.budget.lost(&self.resource);
                    Err(CacheError::Lost {
                        resource: self.resource.clone(),
                        source,
                    })
                }
                Err(err) => Err(CacheError::Watch(err)),
            };
        }
    }
}

/// The weight of a whole decoded object: five times its JSON size, plus its cache entry. A
/// decoded k8s-openapi object takes about that much (a 500-byte Service 2.6 KiB; `cargo bench
/// -p bootstrap-reconcilers --bench cache_weight`): every optional field is a slot, every
/// string its own allocation.
pub fn object_weight<K: serde::Serialize>(object: &K) -> usize {
    5 * json_size(object) + 200
}

/// An object's JSON size, without writing it anywhere.
fn json_size<K: serde::Serialize>(object: &K) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut count = Count(0);
    // Serializing an API object cannot fail; were it to, the object counts as small.
    let _ = serde_json::to_writer(&mut count, object);
    count.0
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Namespace;

    fn namespace(name: &str) -> Namespace {
        serde_json::from_value(serde_json::json!({"metadata": {"name": name}})).unwrap()
    }

    fn new_account(max_objects: usize, max_bytes: usize) -> (CacheBudget, Account) {
        let budget = CacheBudget::unregistered(
            BudgetLimits {
                max_objects,
                max_bytes,
            },
            "--hint".to_owned(),
            None,
        );
        let account = Account::new(budget.clone(), "Namespace".to_owned());
        (budget, account)
    }

    #[test]
    fn a_cache_is_counted_by_what_it_holds_and_a_relist_counts_both_lists() {
        let (budget, mut account) = new_account(10, usize::MAX);
        let weight = |_: &Namespace| 100;
        for event in [
            watcher::Event::Init,
            watcher::Event::InitApply(namespace("a")),
            watcher::Event::InitApply(namespace("b")),
            watcher::Event::InitDone,
            watcher::Event::Apply(namespace("b")),
            watcher::Event::Apply(namespace("c")),
            watcher::Event::Delete(namespace("a")),
        ] {
            account.apply(&event, weight).unwrap();
        }
        assert_eq!(budget.held(), (2, 200));
        // A relist: the old contents stay until it completes.
        account.apply(&watcher::Event::Init, weight).unwrap();
        account
            .apply(&watcher::Event::InitApply(namespace("x")), weight)
            .unwrap();
        assert_eq!(budget.held(), (3, 300));
        account.apply(&watcher::Event::InitDone, weight).unwrap();
        assert_eq!(budget.held(), (1, 100));
        drop(account);
        assert_eq!(budget.held(), (0, 0), "a cache gone gives back all it held");
    }

    /// A projected record's weight counts what it keeps of the object: Services with a huge
    /// uid go over a budget that holds thousands of ordinary ones, and what one was charged is
    /// what its delete gives back.
    #[test]
    fn a_record_holding_large_text_is_charged_for_it() {
        use crate::service_cache::record::{ServiceObject, ServiceRecord};
        use crate::watch_cache::Cached;
        let service = |name: &str, uid: &str| -> ServiceObject {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "d", "uid": uid},
                "spec": {"clusterIP": "10.96.1.2", "clusterIPs": ["10.96.1.2"]},
            }))
            .unwrap()
        };
        let (budget, mut account) = new_account(usize::MAX - 1, 4 << 20);
        let weight = ServiceRecord::weight;
        for i in 0..1_000 {
            let event = watcher::Event::Apply(service(
                &format!("s{i}"),
                "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f",
            ));
            account.apply(&event, weight).unwrap();
        }
        let ordinary = budget.held().1;
        let large = service("large", &"u".repeat(1 << 20));
        account
            .apply(&watcher::Event::Apply(large.clone()), weight)
            .unwrap();
        assert!(budget.held().1 >= ordinary + (1 << 20));
        account
            .apply(&watcher::Event::Delete(large), weight)
            .unwrap();
        assert_eq!(budget.held().1, ordinary);

        let breach = (0..4)
            .find_map(|i| {
                let event = watcher::Event::Apply(service(&format!("u{i}"), &"u".repeat(1 << 20)));
                account.apply(&event, weight).err()
            })
            .unwrap();
        assert_eq!(breach.unit, "bytes");
    }

    #[test]
    fn the_event_that_goes_over_names_the_budget_and_its_setting() {
        let (budget, mut account) = new_account(2, usize::MAX);
        let weight = |_: &Namespace| 1;
        account
            .apply(&watcher::Event::Apply(namespace("a")), weight)
            .unwrap();
        account
            .apply(&watcher::Event::Apply(namespace("b")), weight)
            .unwrap();
        let breach = account
            .apply(&watcher::Event::Apply(namespace("c")), weight)
            .unwrap_err();
        assert_eq!((breach.unit, breach.limit), ("objects", 2));
        assert!(breach.to_string().contains("--hint"), "{breach}");
        account.release();
        assert_eq!(budget.held(), (0, 0));

        let (_, mut account) = new_account(usize::MAX - 1, 1024);
        let err = account
            .apply(&watcher::Event::Apply(namespace("big")), |_| 2048)
            .unwrap_err();
        assert_eq!(err.unit, "bytes");
    }

    #[test]
    fn caches_of_one_cluster_share_the_budget() {
        let (budget, mut first) = new_account(3, usize::MAX);
        let mut second = Account::new(budget.clone(), "Service".to_owned());
        let weight = |_: &Namespace| 1;
        for name in ["a", "b"] {
            first
                .apply(&watcher::Event::Apply(namespace(name)), weight)
                .unwrap();
        }
        second
            .apply(&watcher::Event::Apply(namespace("c")), weight)
            .unwrap();
        let breach = second
            .apply(&watcher::Event::Apply(namespace("d")), weight)
            .unwrap_err();
        assert_eq!(breach.resource, "Service");
    }

    fn pooled_account(pool: &CachePool, max_bytes: usize) -> (CacheBudget, Account) {
        let budget = CacheBudget::unregistered(
            BudgetLimits {
                max_objects: usize::MAX,
                max_bytes,
            },
            "--own".to_owned(),
            Some(pool.clone()),
        );
        let account = Account::new(budget.clone(), "Service".to_owned());
        (budget, account)
    }

    #[test]
    fn the_floors_are_kept_out_of_what_the_clusters_above_them_may_take() {
        // Few clusters: the floor as given, the rest of the total for those above it.
        assert_eq!(pool_bounds(1000, 100, 3), (100, 700));
        // Many: half a fair share each, so the floors take at most half the total.
        assert_eq!(pool_bounds(1000, 100, 40), (12, 520));
        assert_eq!(pool_bounds(1000, 100, 5000), (0, 1000));
        // No sharers yet counts as one.
        assert_eq!(pool_bounds(1000, 100, 0), (100, 900));
        for sharers in [1, 2, 5, 10, 48, 49, 96, 97, 300, 1000, 100_000] {
            let (floor, above) = pool_bounds(96 << 20, 1 << 20, sharers);
            assert!(sharers * floor <= (96 << 20) / 2, "{sharers}");
            assert_eq!(above + sharers * floor, 96 << 20, "{sharers}");
        }
    }

    /// However many clusters there are, and however many of them grow without end, the pool
    /// holds at most its total (beside the one event that breaches), and the clusters that stay
    /// within their floor are never paused.
    #[test]
    fn any_number_of_clusters_growing_without_end_stays_within_the_total() {
        const TOTAL: usize = 10_000;
        const EVENT: usize = 10;
        for clusters in [3, 10, 40, 100, 400] {
            for hostile_share in [1, 2, 4] {
                let pool = CachePool::unregistered(TOTAL, 1_000, "--total".to_owned());
                let accounts: Vec<_> = (0..clusters)
                    .map(|_| pooled_account(&pool, usize::MAX).1)
                    .collect();
                let floor = pool.bytes.bounds().0;
                let hostile = (clusters / hostile_share).max(1);
                let (mut hostile, mut small): (Vec<_>, Vec<_>) = accounts
                    .into_iter()
                    .enumerate()
                    .partition(|(n, _)| *n < hostile);
                let mut most = 0;
                let mut breaches = 0;
                // The hostile clusters grow until each has breached once (and been emptied,
                // as a paused tenant's caches are), then grow again to just short of a breach
                // and stay; the small ones then fill their floors.
                for round in 0..2 {
                    for (n, account) in &mut hostile {
                        for event in 0.. {
                            let name = format!("{n}-{round}-{event}");
                            let applied =
                                account.apply(&watcher::Event::Apply(namespace(&name)), |_| EVENT);
                            most = most.max(pool.bytes.held());
                            if applied.is_err() {
                                breaches += 1;
                                if round == 0 {
                                    account.release();
                                } else {
                                    // Holding as much as it can, short of the breach.
                                    let event = watcher::Event::Delete(namespace(&name));
                                    account.apply(&event, |_| EVENT).unwrap();
                                }
                                break;
                            }
                        }
                    }
                }
                for (n, account) in &mut small {
                    for event in 0..floor / EVENT {
                        let name = format!("{n}-{event}");
                        account
                            .apply(&watcher::Event::Apply(namespace(&name)), |_| EVENT)
                            .unwrap_or_else(|breach| {
                                panic!("a cluster within its floor of {floor} bytes: {breach}")
                            });
                        most = most.max(pool.bytes.held());
                    }
                }
                let case = format!("{clusters} clusters, 1 in {hostile_share} hostile");
                assert!(breaches >= hostile.len(), "{case}: {breaches} breaches");
                // The one event of the last breach is still counted: the cache drops it.
                assert!(most <= TOTAL + EVENT, "{case}: {most} bytes held");
                assert!(most > TOTAL / 2, "{case}: the pool was not filled ({most})");
            }
        }
    }

    #[test]
    fn the_cluster_that_takes_the_pool_over_its_total_breaches_naming_the_total() {
        // Three clusters with a floor of 100 each: those above it may fill the pool to 700.
        let pool = CachePool::unregistered(1000, 100, "--total".to_owned());
        let (large, mut large_account) = pooled_account(&pool, 800);
        let (small, mut small_account) = pooled_account(&pool, 800);
        let (grower, mut grower_account) = pooled_account(&pool, 800);
        let fill = |account: &mut Account, names: std::ops::Range<usize>, weight: usize| {
            names
                .map(|n| {
                    let event = watcher::Event::Apply(namespace(&n.to_string()));
                    account.apply(&event, |_| weight)
                })
                .collect::<Result<Vec<()>, Breach>>()
        };
        fill(&mut large_account, 0..10, 50).unwrap();
        fill(&mut grower_account, 0..2, 50).unwrap();
        assert_eq!(pool.bytes.held(), 600);
        // Over what the others may take, but within the floor kept for it: a small cluster is
        // never paused by the others.
        fill(&mut small_account, 0..2, 50).unwrap();
        assert_eq!((small.held().1, pool.bytes.held()), (100, 700));
        // Above its floor with the pool over the total less the floors: the cluster that
        // grows breaches, naming the total.
        let breach = fill(&mut grower_account, 2..3, 50).unwrap_err();
        assert!(breach.pooled);
        assert_eq!((breach.unit, breach.limit), ("bytes", 700));
        let text = breach.to_string();
        assert!(
            text.contains("more than 700 bytes, the total less the floor kept for every cluster")
                && text.contains("--total"),
            "{text}"
        );
        grower_account.release();
        assert_eq!((grower.held().1, pool.bytes.held()), (0, 600));
        // Its own budget comes first, named as such.
        let own = fill(&mut large_account, 10..11, 400).unwrap_err();
        assert!(!own.pooled && own.to_string().contains("--own"), "{own}");
        drop(large_account);
        assert_eq!((large.held().1, pool.bytes.held()), (0, 100));
        drop((large, grower, grower_account));
        assert_eq!(
            pool.bytes.bounds(),
            (100, 900),
            "clusters gone give back their shares"
        );
    }

    #[test]
    fn a_whole_object_weighs_five_times_its_json() {
        let object = namespace("kube-public");
        let json = serde_json::to_vec(&object).unwrap().len();
        assert_eq!(json_size(&object), json);
        assert_eq!(object_weight(&object), 5 * json + 200);
    }
}

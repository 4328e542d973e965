//! The one watch cache: a list+watch ([`budget::watch`]) kept in a store of what the
//! loops read, either each object whole ([`Lenient`]) or projected to a compact record as it
//! arrives ([`Cached`]; at 100,000 Services the records take a fraction of the memory the
//! objects would). One stream keeps the store, reports its failures and is the trigger of the
//! loops that read it, so a pass at rest reads the cache and sends nothing.
//!
//! A (re)list is written into the store as its objects come, so while it runs the cache is *not
//! synced* and passes refuse to decide on it; it is synced again when the watch says the list
//! is complete, and the objects the list did not return are dropped then. A failed or partial
//! list, an event lost or a cache over its budget therefore never leads to a decision. Writes
//! made from a cached object carry its resourceVersion, so a cache that lags by a moment costs a
//! conflict and a retry, never a lost update.
//!
//! Several loops may share one cache (the ClusterIP and NodePort repairs both read Services):
//! the first to [`WatchCache::subscribe`] drives the watch, the others are woken after each change
//! it applied, so the process lists and watches a collection once.
//!
//! A whole object is decoded as a Go client decodes it ([`Lenient`]): a `null` where k8s-openapi
//! wants a value (kube-apiserver stores a status condition's `lastTransitionTime: null` as given)
//! reads as the field left out, so one such object never costs the watch its events.

use std::fmt::Debug;
use std::hash::BuildHasher;
use std::hash::Hash;
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock, RwLockReadGuard};

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::api::ListParams;
use kube::runtime::watcher;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use crate::Trigger;
use crate::budget::{self, CacheBudget, CacheError, CacheEvent};

/// What a [`WatchCache`] keeps of each object: the object itself ([`Lenient`]) or a record
/// projected from it.
pub trait Cached: Clone + Debug + Send + Sync + 'static {
    /// The API object the record is projected from.
    type Object: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + 'static;
    /// Unique key within the collection.
    type Key: Hash + Eq + Debug + Send + Sync + 'static;
    fn project(object: &Self::Object) -> Self;
    fn key(&self) -> Self::Key;
    /// What one object costs its cache's budget: by default its entry and its slot in the
    /// index, twice (a vector and a table grow by doubling), plus the names it holds and what
    /// its record keeps on the heap ([`Self::heap_bytes`]). The object is projected here as the
    /// cache projects it: a record holds far less than its object (a Service's status, labels
    /// and annotations are dropped), so weighing the object would over-charge every cluster,
    /// while a record holding untrusted text must be charged for it.
    fn weight(object: &Self::Object) -> usize {
        let meta = object.meta();
        let names = meta.name.as_ref().map_or(0, String::len)
            + meta.namespace.as_ref().map_or(0, String::len);
        (2 * (std::mem::size_of::<Entry<Self>>() + INDEX_SLOT))
            .saturating_add(names)
            .saturating_add(Self::project(object).heap_bytes())
    }
    /// The bytes the record keeps on the heap besides its name and namespace (which
    /// [`Self::weight`] counts from the object): boxed text, lists that do not fit inside the
    /// record. An object's fields are the tenant's API's to choose, so text of any length or
    /// lists of any size are counted as held; what the record keeps inline counts nothing.
    fn heap_bytes(&self) -> usize {
        0
    }
    /// The object's resourceVersion, where the record keeps it as a number ([`Whole`] compares
    /// it with the object it keeps).
    fn resource_version(&self) -> Option<u64> {
        None
    }
}

/// One cached object: the record, its key's hash (so the index never recomputes keys when it
/// grows) and the list generation that last saw it (for dropping what a relist did not return).
/// Half a hash is kept: with the generation it fills the 8 bytes a whole one would take alone.
#[derive(Debug)]
struct Entry<T> {
    value: T,
    hash: u32,
    generation: u32,
}

impl<T> Entry<T> {
    /// The kept half in both halves of the hash the index reads: hashbrown takes a slot from the
    /// low bits and a tag from the top ones, and both vary.
    fn hash(&self) -> u64 {
        spread(self.hash)
    }
}

fn spread(half: u32) -> u64 {
    (u64::from(half) << 32) | u64::from(half)
}

/// What one position costs the index: the position and hashbrown's control byte.
const INDEX_SLOT: usize = std::mem::size_of::<usize>() + 1;

/// The cached collection and whether it is complete.
///
/// The records sit side by side in one vector and a hash table of positions finds them by key:
/// a table of whole records would keep up to half its slots empty (a million Services take a
/// table of two million slots) and each record's key next to it, so a slot of a few bytes per
/// empty place and no copy of the key is what keeps a cache of a million Services small.
#[derive(Debug)]
pub struct StoreState<T: Cached> {
    entries: Vec<Entry<T>>,
    /// Positions in `entries`, by the hash of their key.
    index: hashbrown::HashTable<usize>,
    hasher: foldhash::quality::RandomState,
    generation: u32,
    /// Whether the contents are one complete list plus the watch events after it; false during
    /// a (re)list and after an event was lost or the budget breached.
    pub synced: bool,
    /// The watch failed and has delivered nothing since: it resumes from the last
    /// resourceVersion seen, so nothing is missed, but until it delivers again the cache is not
    /// proven current ([`WatchCache::current`]).
    interrupted: bool,
}

impl<T: Cached> Default for StoreState<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
            index: hashbrown::HashTable::new(),
            hasher: foldhash::quality::RandomState::default(),
            generation: 0,
            synced: false,
            interrupted: false,
        }
    }
}

impl<T: Cached> StoreState<T> {
    pub fn values(&self) -> impl Iterator<Item = &T> + Clone {
        self.entries.iter().map(|entry| &entry.value)
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&T>
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.position(key).map(|at| &self.entries[at].value)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.position(key).is_some()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes the cache's vector and table take (not text a record keeps on the heap).
    pub fn allocated_bytes(&self) -> usize {
        // hashbrown fills 7/8 of its power-of-two slots.
        let slots = match self.index.capacity() {
            0 => 0,
            capacity => (capacity.saturating_mul(8) / 7).next_power_of_two(),
        };
        self.entries.capacity() * std::mem::size_of::<Entry<T>>() + slots * INDEX_SLOT
    }

    /// The half of a key's hash an [`Entry`] keeps.
    fn half_hash<Q: Hash + ?Sized>(&self, key: &Q) -> u32 {
        (self.hasher.hash_one(key) >> 32) as u32
    }

    /// Where `entries` holds the object of `key`. A key and what it borrows as hash alike (the
    /// contract of `Borrow`), so one hash finds both.
    fn position<Q>(&self, key: &Q) -> Option<usize>
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        use std::borrow::Borrow;
        let hash = self.half_hash(key);
        let entries = &self.entries;
        self.index
            .find(spread(hash), |&at| {
                entries[at].hash == hash && entries[at].value.key().borrow() == key
            })
            .copied()
    }

    /// Adds `value`, or replaces the object of the same key.
    fn upsert(&mut self, value: T) {
        let key = value.key();
        let hash = self.half_hash(&key);
        let entry = Entry {
            value,
            hash,
            generation: self.generation,
        };
        let Self { entries, index, .. } = self;
        match index.find(spread(hash), |&at| {
            entries[at].hash == hash && entries[at].value.key() == key
        }) {
            Some(&at) => entries[at] = entry,
            None => {
                index.insert_unique(spread(hash), entries.len(), |&at| entries[at].hash());
                entries.push(entry);
            }
        }
    }

    /// Drops the object of `key`, if held: the last entry moves into its place.
    fn remove(&mut self, key: &T::Key) {
        let hash = self.half_hash(key);
        let Self { entries, index, .. } = self;
        let Ok(found) = index.find_entry(spread(hash), |&at| {
            entries[at].hash == hash && entries[at].value.key() == *key
        }) else {
            return;
        };
        let (at, _) = found.remove();
        entries.swap_remove(at);
        if let Some(moved) = entries.get(at) {
            let last = entries.len();
            if let Some(slot) = index.find_mut(moved.hash(), |&held| held == last) {
                *slot = at;
            }
        }
    }

    /// Keeps the objects the current list generation saw, packed tight: a relist is complete.
    fn keep_listed(&mut self) {
        let generation = self.generation;
        let before = self.entries.len();
        self.entries.retain(|entry| entry.generation == generation);
        if self.entries.len() != before {
            self.index.clear();
            let entries = &self.entries;
            for (at, entry) in entries.iter().enumerate() {
                self.index
                    .insert_unique(entry.hash(), at, |&at| entries[at].hash());
            }
        }
        self.entries.shrink_to_fit();
        let entries = &self.entries;
        self.index.shrink_to_fit(|&at| entries[at].hash());
    }

    /// Drops everything, giving the memory back.
    fn clear(&mut self) {
        self.entries = Vec::new();
        self.index = hashbrown::HashTable::new();
    }

    /// Applies one watcher event; says whether readers should look again.
    fn apply(&mut self, event: &watcher::Event<T::Object>) -> bool {
        match event {
            watcher::Event::Init => {
                self.synced = false;
                self.generation = self.generation.wrapping_add(1);
                false
            }
            watcher::Event::InitApply(object) => {
                self.upsert(T::project(object));
                false
            }
            watcher::Event::InitDone => {
                self.keep_listed();
                self.synced = true;
                true
            }
            watcher::Event::Apply(object) => {
                self.upsert(T::project(object));
                true
            }
            watcher::Event::Delete(object) => {
                self.remove(&T::project(object).key());
                true
            }
        }
    }
}

/// The event stream that fills a [`WatchCache`], each event after the cache applied it.
pub type WatchEvents<K> = BoxStream<'static, CacheEvent<K>>;

/// LIST page size of the caches of every object of a kind: client-go's.
pub const DEFAULT_PAGE_SIZE: u32 = 500;

/// A cache of one watch's objects, kept as `T`; clones share it.
#[derive(Clone)]
pub struct WatchCache<T: Cached> {
    state: Arc<RwLock<StoreState<T>>>,
    /// The watch's selectors, for reads while the cache is not synced.
    selection: ListParams,
    /// Handed once to the loop that drives the watch.
    events: Arc<Mutex<Option<WatchEvents<T::Object>>>>,
    /// Counts the changes the watch applied; subscribers other than the first wait on it.
    changes: tokio::sync::watch::Sender<u64>,
    /// What a cache shared by several loops ([`Self::shared`]) watches, settled when its watch
    /// starts.
    scope: Arc<Scope<T::Object>>,
    /// The budget of the cluster's caches, which this one counts against: the loops' other
    /// reads of every object (a fresh LIST) count against it too.
    budget: CacheBudget,
}

/// What the loops sharing a cache read: every object of the kind (in pages of the first size
/// named), or only the one object they name, so that a cache no loop reads whole does not hold
/// (nor weigh on the budget with) every object of the kind.
struct Scope<K> {
    page_size: OnceLock<u32>,
    named: Mutex<Named<K>>,
}

enum Named<K> {
    Nothing,
    /// The API (namespace) and name of the one object named.
    One(Box<Api<K>>, String),
    /// A loop reads every object, or loops named different objects: the cache keeps every
    /// object.
    Every,
}

impl<K> Default for Scope<K> {
    fn default() -> Self {
        Self {
            page_size: OnceLock::new(),
            named: Mutex::new(Named::Nothing),
        }
    }
}

impl<K: Resource + Clone> Scope<K> {
    /// The one object to watch, unless a loop reads every object (or none is named).
    fn one(&self) -> Option<(Api<K>, String)> {
        match &*self.named() {
            Named::One(api, name) => Some((Api::clone(api), name.clone())),
            Named::Nothing | Named::Every => None,
        }
    }

    fn named(&self) -> std::sync::MutexGuard<'_, Named<K>> {
        self.named.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<T: Cached> WatchCache<T> {
    /// A cache of what `config` selects, within `budget`. Nothing is cached until the stream of
    /// [`Self::take_events`] or [`Self::subscribe`] is polled.
    pub fn new(api: Api<T::Object>, config: watcher::Config, budget: &CacheBudget) -> Self {
        let watch = budget::watch(api, config.clone(), budget, T::weight);
        Self::with_watch(watch, &config, Arc::default(), budget.clone())
    }

    fn with_watch(
        watch: WatchEvents<T::Object>,
        config: &watcher::Config,
        scope: Arc<Scope<T::Object>>,
        budget: CacheBudget,
    ) -> Self {
        let selection = ListParams {
            label_selector: config.label_selector.clone(),
            field_selector: config.field_selector.clone(),
            ..ListParams::default()
        };
        let state = Arc::new(RwLock::new(StoreState::default()));
        let changes = tokio::sync::watch::Sender::new(0);
        let events = keep(watch, state.clone(), changes.clone());
        Self {
            state,
            selection,
            events: Arc::new(Mutex::new(Some(events))),
            changes,
            scope,
            budget,
        }
    }

    /// The budget of the cluster's caches this cache counts against.
    pub fn budget(&self) -> &CacheBudget {
        &self.budget
    }

    /// A cache of every object of the kind, listed in pages of `page_size`.
    pub fn every(client: kube::Client, page_size: u32, budget: &CacheBudget) -> Self {
        let cache = Self::shared(client, budget);
        cache.read_every(page_size);
        cache
    }

    /// A cache several loops share, whatever the order they are built in: it watches every
    /// object of the kind when one of them reads every object ([`Self::read_every`], listed in
    /// pages of the first size named), else the one object they name ([`Self::read_one`]).
    /// Settled when the watch starts.
    pub fn shared(client: kube::Client, budget: &CacheBudget) -> Self {
        let scope: Arc<Scope<T::Object>> = Arc::default();
        let (settled, watched) = (scope.clone(), budget.clone());
        let watch = futures::stream::once(async move {
            let size = *settled.page_size.get_or_init(|| DEFAULT_PAGE_SIZE);
            match settled.one() {
                Some((api, name)) => {
                    let config =
                        watcher::Config::default().fields(&format!("metadata.name={name}"));
                    budget::watch(api, config, &watched, T::weight)
                }
                None => {
                    let config = watcher::Config::default().page_size(size);
                    budget::watch(Api::all(client), config, &watched, T::weight)
                }
            }
        })
        .flatten()
        .boxed();
        Self::with_watch(watch, &watcher::Config::default(), scope, budget.clone())
    }

    /// A loop reads every object, listing in pages of `page_size` unless a size was named
    /// already (or the watch started).
    pub fn read_every(&self, page_size: u32) {
        let _ = self.scope.page_size.set(page_size);
        *self.scope.named() = Named::Every;
    }

    /// A loop reads only the object `name` of `api` (its namespace, for a namespaced kind).
    pub fn read_one(&self, api: Api<T::Object>, name: &str) {
        let mut named = self.scope.named();
        *named = match &*named {
            Named::Nothing => Named::One(Box::new(api), name.to_owned()),
            Named::One(held, held_name)
                if held_name == name && held.namespace() == api.namespace() =>
            {
                Named::One(Box::new(api), name.to_owned())
            }
            Named::One(..) | Named::Every => Named::Every,
        };
    }

    /// The stream that fills the cache, for the loop that drives it; `None` after the first
    /// call (or [`Self::subscribe`]).
    pub fn take_events(&self) -> Option<WatchEvents<T::Object>> {
        self.events
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// A trigger for one loop reading the cache: the first one's drives the watch
    /// ([`watch_trigger`]); the others' yield after each change it applied.
    pub fn subscribe(&self) -> Trigger {
        if let Some(events) = self.take_events() {
            return watch_trigger(events);
        }
        let mut changes = self.changes.subscribe();
        changes.mark_unchanged();
        futures::stream::unfold(changes, |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        })
        .boxed()
    }

    /// Read access for one synchronous decision. Never hold it across an `.await`.
    pub fn read(&self) -> RwLockReadGuard<'_, StoreState<T>> {
        // A writer that panicked left a consistent map (every mutation is a single insert,
        // remove or retain), so reading on is safe.
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cached collection, if it is synced and its watch has not failed since it last
    /// delivered.
    pub fn current(&self) -> Option<RwLockReadGuard<'_, StoreState<T>>> {
        Some(self.read()).filter(|state| state.synced && !state.interrupted)
    }
}

/// Applies each event of `events` to `state` and reports the failures, each streak once: an
/// event lost or the budget breached (not synced until a list completes), a list that keeps
/// failing. Counts each change a reader should see in `changes`.
fn keep<T: Cached>(
    events: WatchEvents<T::Object>,
    state: Arc<RwLock<StoreState<T>>>,
    changes: tokio::sync::watch::Sender<u64>,
) -> WatchEvents<T::Object> {
    let kind = <T::Object as Resource>::kind(&()).into_owned();
    let mut failure = crate::findings::RepeatedFailure::default();
    events
        .inspect(move |event| {
            let mut state = state.write().unwrap_or_else(PoisonError::into_inner);
            state.interrupted = matches!(event, Err(CacheError::Watch(_)));
            let changed = match event {
                Ok(event) => {
                    if matches!(event, watcher::Event::InitDone) {
                        failure.succeeded();
                    }
                    state.apply(event)
                }
                Err(err @ (CacheError::OverBudget(_) | CacheError::Lost { .. })) => {
                    if matches!(err, CacheError::OverBudget(_)) {
                        // What it held went back to the budget.
                        state.clear();
                    }
                    state.synced = false;
                    if failure.is_new(err) {
                        warn!(%kind, error = %err, "the cache is not current until a list completes");
                    }
                    true
                }
                // A resumed watch starts from the last resourceVersion seen: nothing is missed.
                Err(err) if state.synced => {
                    debug!(%kind, error = %err, "watch failed; resuming");
                    false
                }
                Err(err) => {
                    // An outage fails every retry the same way: warned once per kind of failure.
                    if failure.is_new(err) {
                        warn!(%kind, error = %err, "list failed; the cache stays unsynced until a list completes");
                    } else {
                        debug!(%kind, error = %err, "list failed again");
                    }
                    false
                }
            };
            if changed {
                changes.send_modify(|count| *count = count.wrapping_add(1));
            }
        })
        .boxed()
}

/// A watch as a trigger: one item per change (and one per completed relist, lost event or
/// breach, after which a pass reads the API instead); failures are retried by the watch itself.
pub fn watch_trigger<K, S>(stream: S) -> Trigger
where
    K: Send + 'static,
    S: futures::Stream<Item = CacheEvent<K>> + Send + 'static,
{
    stream
        .filter_map(|event| async move {
            match event {
                Ok(
                    watcher::Event::Apply(_) | watcher::Event::Delete(_) | watcher::Event::InitDone,
                ) => Some(()),
                Ok(watcher::Event::Init | watcher::Event::InitApply(_)) => None,
                Err(CacheError::OverBudget(_) | CacheError::Lost { .. }) => Some(()),
                Err(_) => None,
            }
        })
        .boxed()
}

/// A typed object kept whole ([`Lenient`], [`Whole`]): what its typed `Api`, its lenient
/// decoding and a cache shared across tasks need.
pub trait WholeObject:
    Resource<DynamicType = ()>
    + Clone
    + DeserializeOwned
    + serde::Serialize
    + Debug
    + Send
    + Sync
    + 'static
{
}

impl<K> WholeObject for K where
    K: Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + serde::Serialize
        + Debug
        + Send
        + Sync
        + 'static
{
}

impl<K: WholeObject> Cached for Lenient<K> {
    type Object = Lenient<K>;
    /// Namespace (none for a cluster-scoped object) and name.
    type Key = (Option<String>, String);
    fn project(object: &Self) -> Self {
        object.clone()
    }
    fn key(&self) -> Self::Key {
        let meta = self.0.meta();
        (
            meta.namespace.clone(),
            meta.name.clone().unwrap_or_default(),
        )
    }
    fn weight(object: &Self) -> usize {
        budget::object_weight(object)
    }
}

impl<K: WholeObject> WatchCache<Lenient<K>> {
    /// A cache of the whole objects of `api` that `config` selects, decoded leniently.
    pub fn of(api: &Api<K>, config: watcher::Config, budget: &CacheBudget) -> Self {
        Self::new(lenient(api), config, budget)
    }

    /// The named object among those the watch selects: from the cache when it is synced, else
    /// from a LIST with the watch's selectors (no permission beyond the watch's).
    pub async fn get(&self, api: &Api<K>, name: &str) -> Result<Option<K>, kube::Error> {
        if let Some(state) = self.current() {
            let key = (api.namespace().map(str::to_owned), name.to_owned());
            return Ok(state.get(&key).map(|object| object.0.clone()));
        }
        Ok(self
            .list_live(api)
            .await?
            .find(|object| object.meta().name.as_deref() == Some(name)))
    }

    /// The named object: from the cache when it is current, else one GET of that name, so a loop
    /// that reads a few named objects of a large collection never lists it. A GET needs the `get`
    /// verb and applies no selector: for a cache of the whole collection.
    pub async fn get_named(&self, api: &Api<K>, name: &str) -> Result<Option<K>, kube::Error> {
        if let Some(state) = self.current() {
            let key = (api.namespace().map(str::to_owned), name.to_owned());
            return Ok(state.get(&key).map(|object| object.0.clone()));
        }
        Ok(lenient(api).get_opt(name).await?.map(|object| object.0))
    }

    /// Every object the watch selects: from the cache when it is synced, else from a LIST with
    /// the watch's selectors. A failed list is an error, never an empty answer.
    pub async fn list(&self, api: &Api<K>) -> Result<Vec<K>, kube::Error> {
        if let Some(state) = self.current() {
            return Ok(state.values().map(|object| object.0.clone()).collect());
        }
        Ok(self.list_live(api).await?.collect())
    }

    async fn list_live(&self, api: &Api<K>) -> Result<impl Iterator<Item = K>, kube::Error> {
        let listed = lenient(api).list(&self.selection).await?;
        Ok(listed.items.into_iter().map(|object| object.0))
    }
}

/// One object of a cache of records, kept whole for the loop that writes it: read again (a LIST
/// of its name, so no permission beyond the watch's) only when the record cache is not current
/// or holds a resourceVersion other than the kept one's. The loop shares the record cache's
/// watch, and a pass at rest reads the kept object and sends nothing.
#[derive(Debug, Default)]
pub struct Whole<K> {
    held: Mutex<Option<K>>,
}

impl<K: WholeObject> Whole<K> {
    /// The object `name` of `api`, which `cache` holds under `key`: none when the current cache
    /// holds no such key.
    pub async fn get<T: Cached>(
        &self,
        cache: &WatchCache<T>,
        key: &T::Key,
        api: &Api<K>,
        name: &str,
    ) -> Result<Option<K>, kube::Error> {
        if let Some(kept) = self.kept(cache, key) {
            return Ok(kept);
        }
        let selection = ListParams::default().fields(&format!("metadata.name={name}"));
        let found = lenient(api)
            .list(&selection)
            .await?
            .items
            .into_iter()
            .map(|object| object.0)
            .find(|object| object.meta().name.as_deref() == Some(name));
        *self.lock() = found.clone();
        Ok(found)
    }

    /// Keeps the object a write of the loop's answered with: once the watch brings that write,
    /// the next pass reads it from here rather than listing it again.
    pub fn written(&self, object: K) {
        *self.lock() = Some(object);
    }

    /// What the current cache says without a request: `Some(None)` for an object it does not
    /// hold, the kept object when the cache holds its resourceVersion.
    fn kept<T: Cached>(&self, cache: &WatchCache<T>, key: &T::Key) -> Option<Option<K>> {
        let state = cache.current()?;
        let Some(record) = state.get(key) else {
            *self.lock() = None;
            return Some(None);
        };
        let version = record.resource_version()?;
        let held = self.lock();
        let kept = held.as_ref()?;
        let kept_version = kept
            .meta()
            .resource_version
            .as_deref()?
            .parse::<u64>()
            .ok()?;
        (kept_version == version).then(|| Some(kept.clone()))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<K>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// An object decoded as a Go client decodes it: `null` anywhere in an object reads as the field
/// left out (k8s-openapi refuses a `null` where it wants a value; Go's decoder takes the zero
/// value), and a condition's `lastTransitionTime`, which k8s-openapi requires, as Go's zero time
/// when it is left out. A Lease's `renewTime` or `acquireTime` that jiff cannot read reads as
/// jiff's latest time: jiff ends at 9999-12-30T22:00:00Z, the API takes up to
/// 9999-12-31T23:59:59Z, and one such Lease would otherwise fail every list of its namespace's
/// Leases (the membership judges it a renewal in the future). Unknown fields are ignored, as
/// k8s-openapi does anyway.
#[derive(Clone, Debug)]
pub struct Lenient<K>(pub K);

impl<K: Resource> Resource for Lenient<K> {
    type DynamicType = K::DynamicType;
    // Its API is made with `Api::all_with` / `Api::namespaced_with` from the typed one's.
    type Scope = kube::core::DynamicResourceScope;

    fn kind(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
        K::version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> std::borrow::Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        self.0.meta()
    }
    fn meta_mut(&mut self) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        self.0.meta_mut()
    }
}

impl<'de, K> serde::Deserialize<'de> for Lenient<K>
where
    K: Resource<DynamicType = ()> + DeserializeOwned,
{
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut value = serde_json::Value::deserialize(deserializer)?;
        drop_nulls(&mut value);
        if K::group(&()) == Lease::group(&()) && K::kind(&()) == Lease::kind(&()) {
            clamp_lease_times(&mut value);
        }
        serde_json::from_value(value)
            .map(Lenient)
            .map_err(D::Error::custom)
    }
}

impl<K: serde::Serialize> serde::Serialize for Lenient<K> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(serializer)
    }
}

/// Go's zero `metav1.Time`, which it marshals as `null`.
const GO_ZERO_TIME: &str = "0001-01-01T00:00:00Z";

/// Removes every `null` member of every object in `value`; gives each condition without a
/// `lastTransitionTime` Go's zero time.
fn drop_nulls(value: &mut serde_json::Value) {
    match value {
        serde_json::Value::Object(members) => {
            members.retain(|_, member| !member.is_null());
            members.values_mut().for_each(drop_nulls);
            if let Some(serde_json::Value::Array(conditions)) = members.get_mut("conditions") {
                for condition in conditions.iter_mut().filter_map(|c| c.as_object_mut()) {
                    condition
                        .entry("lastTransitionTime")
                        .or_insert_with(|| GO_ZERO_TIME.into());
                }
            }
        }
        serde_json::Value::Array(items) => items.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// Sets a Lease's `renewTime` and `acquireTime` that jiff cannot read to jiff's latest time.
fn clamp_lease_times(lease: &mut serde_json::Value) {
    let Some(spec) = lease.get_mut("spec").and_then(|spec| spec.as_object_mut()) else {
        return;
    };
    for key in ["renewTime", "acquireTime"] {
        let unreadable = spec
            .get(key)
            .and_then(|time| time.as_str())
            .is_some_and(|text| text.parse::<Timestamp>().is_err());
        if unreadable {
            let latest = Timestamp::MAX.strftime("%Y-%m-%dT%H:%M:%S%.6fZ");
            spec.insert(key.to_owned(), latest.to_string().into());
        }
    }
}

/// The API of `api`'s objects, decoded leniently.
fn lenient<K>(api: &Api<K>) -> Api<Lenient<K>>
where
    K: Resource + Clone,
    K::DynamicType: Default,
{
    let dynamic = K::DynamicType::default();
    let client = kube::Client::from(api.clone());
    match api.namespace() {
        Some(namespace) => Api::namespaced_with(client, namespace, &dynamic),
        None => Api::all_with(client, &dynamic),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::service_cache::record::{Name, ServiceRecord};
    use k8s_openapi::api::core::v1::Service;

    /// kube-apiserver stores a status condition without `lastTransitionTime` as `null`;
    /// k8s-openapi refuses it, the cache reads it.
    #[test]
    fn a_null_where_k8s_openapi_wants_a_value_reads_as_left_out() {
        let served = serde_json::json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "kubernetes", "namespace": "default", "labels": null},
            "spec": {"clusterIP": "10.96.0.1", "ports": [{"port": 443, "name": null}]},
            "status": {"conditions": [{
                "type": "StatusPatched", "status": "True", "reason": "E2E", "message": "m",
                "lastTransitionTime": null,
            }]},
            "fieldFromANewerVersion": {"x": 1},
        });
        assert!(serde_json::from_value::<Service>(served.clone()).is_err());
        let read: Lenient<Service> = serde_json::from_value(served).unwrap();
        let condition = &read.0.status.unwrap().conditions.unwrap()[0];
        assert_eq!(condition.type_, "StatusPatched");
        assert_eq!(read.0.spec.unwrap().ports.unwrap()[0].port, 443);
    }

    fn service(name: &str, ip: &str) -> crate::service_cache::record::ServiceObject {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "d"},
            "spec": {"clusterIP": ip, "clusterIPs": [ip]},
        }))
        .unwrap()
    }

    fn names(state: &StoreState<ServiceRecord>) -> Vec<String> {
        let mut names: Vec<String> = state.values().map(|s| s.name.to_string()).collect();
        names.sort();
        names
    }

    /// A delete moves the last record into the place it frees, and a relist packs what it kept:
    /// every record stays found by its key, none found after its delete.
    #[test]
    fn every_record_stays_found_by_its_key_after_deletes_and_relists() {
        let name = |i: usize| format!("s{i}");
        let ip = |i: usize| format!("192.0.2.{i}");
        let mut state = StoreState::<ServiceRecord>::default();
        state.apply(&watcher::Event::Init);
        for i in 0..60 {
            state.apply(&watcher::Event::InitApply(service(&name(i), &ip(i))));
        }
        state.apply(&watcher::Event::InitDone);
        for i in (0..60).step_by(3) {
            state.apply(&watcher::Event::Delete(service(&name(i), &ip(i))));
        }
        // A relist without the multiples of 5.
        state.apply(&watcher::Event::Init);
        for i in (0..60usize).filter(|i| !i.is_multiple_of(5)) {
            state.apply(&watcher::Event::InitApply(service(&name(i), &ip(i))));
        }
        state.apply(&watcher::Event::InitDone);
        for i in (0..60).step_by(7) {
            state.apply(&watcher::Event::Delete(service(&name(i), &ip(i))));
        }
        let kept = |i: usize| !i.is_multiple_of(5) && !i.is_multiple_of(7);
        for i in 0..60 {
            let key = (Name::from("d"), Name::from(name(i).as_str()));
            let found = state.get(&key);
            assert_eq!(found.is_some(), kept(i), "{}", name(i));
            if let Some(svc) = found {
                assert!(svc.lists_ip(ip(i).parse().unwrap()), "{svc:?}");
            }
        }
        assert_eq!(state.len(), (0..60).filter(|&i| kept(i)).count());
        assert_eq!(state.values().count(), state.len());
    }

    /// A relist is not synced until it is complete, and then holds exactly what it listed plus
    /// the events after it; a relist that never completes never looks synced.
    #[test]
    fn a_relist_replaces_the_contents_only_when_complete() {
        let mut state = StoreState::<ServiceRecord>::default();
        assert!(!state.synced);
        assert!(!state.apply(&watcher::Event::Init));
        assert!(!state.apply(&watcher::Event::InitApply(service("a", "192.0.2.1"))));
        assert!(!state.apply(&watcher::Event::InitApply(service("b", "192.0.2.2"))));
        assert!(!state.synced, "a list in progress");
        assert!(state.apply(&watcher::Event::InitDone));
        assert!(state.synced);
        assert!(state.apply(&watcher::Event::Apply(service("c", "192.0.2.3"))));
        assert!(state.apply(&watcher::Event::Delete(service("a", "192.0.2.1"))));
        assert_eq!(names(&state), ["b", "c"]);

        // A relist that fails half-way (the watcher starts over with Init) and one that
        // completes without "b".
        state.apply(&watcher::Event::Init);
        state.apply(&watcher::Event::InitApply(service("c", "192.0.2.3")));
        assert!(!state.synced);
        state.apply(&watcher::Event::Init);
        state.apply(&watcher::Event::InitApply(service("c", "192.0.2.9")));
        state.apply(&watcher::Event::InitApply(service("d", "192.0.2.4")));
        assert!(!state.synced);
        state.apply(&watcher::Event::InitDone);
        assert!(state.synced);
        assert_eq!(names(&state), ["c", "d"]);
        assert!(
            state
                .get(&("d".into(), "c".into()))
                .unwrap()
                .lists_ip("192.0.2.9".parse().unwrap())
        );
    }
}

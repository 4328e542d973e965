//! The repairs' caches: kube-runtime's watcher, with each object projected to its compact record
//! as it arrives (the full object is dropped at once; at 100,000 Services the records take a
//! fraction of the memory the objects would).
//!
//! A (re)list is written into the live map as its objects come, so while it runs the store says
//! it is *not synced* and passes refuse to decide; it is synced again when the watcher says the
//! list is complete, and the objects the list did not return are dropped then. A failed or
//! partial list therefore never leads to a decision.

use std::collections::HashMap;
use std::fmt::Debug;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use futures::StreamExt;
use futures::stream::BoxStream;
use kube::api::{Api, ListParams};
use kube::runtime::watcher;
use serde::de::DeserializeOwned;
use tracing::{debug, warn};

use super::record::{Name, ServiceObject, ServiceRecord};
use crate::budget::{self, CacheBudget, CacheError};

/// A record kept in a [`Store`]: the projection of one API object.
pub trait Cached: Clone + Debug + Send + Sync + 'static {
    /// The API object the record is projected from.
    type Object: kube::Resource<DynamicType = ()>
        + Clone
        + DeserializeOwned
        + Debug
        + Send
        + 'static;
    /// Unique key within the collection.
    type Key: std::hash::Hash + Eq + Debug + Send + Sync + 'static;
    fn project(object: &Self::Object) -> Self;
    fn cache_key(&self) -> Self::Key;
}

impl Cached for ServiceRecord {
    type Object = ServiceObject;
    type Key = (Name, Name);
    fn project(object: &ServiceObject) -> Self {
        ServiceRecord::from(object)
    }
    fn cache_key(&self) -> Self::Key {
        (self.namespace.clone(), self.name.clone())
    }
}

/// The cached collection and whether it is complete.
#[derive(Debug)]
pub struct StoreState<T: Cached> {
    /// Each object with the list generation that last saw it (for dropping what a relist did
    /// not return).
    objects: HashMap<T::Key, (T, u32)>,
    generation: u32,
    /// Whether the contents are one complete list plus the watch events after it; false during
    /// a (re)list.
    pub synced: bool,
}

impl<T: Cached> StoreState<T> {
    pub fn values(&self) -> impl Iterator<Item = &T> + Clone {
        self.objects.values().map(|(value, _)| value)
    }

    pub fn get<Q>(&self, key: &Q) -> Option<&T>
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.objects.get(key).map(|(value, _)| value)
    }

    pub fn contains_key<Q>(&self, key: &Q) -> bool
    where
        T::Key: std::borrow::Borrow<Q>,
        Q: std::hash::Hash + Eq + ?Sized,
    {
        self.objects.contains_key(key)
    }

    pub fn len(&self) -> usize {
        self.objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.objects.is_empty()
    }

    /// Applies one watcher event; says whether readers should look again.
    fn apply(&mut self, event: watcher::Event<T::Object>) -> bool {
        match event {
            watcher::Event::Init => {
                self.synced = false;
                self.generation = self.generation.wrapping_add(1);
                false
            }
            watcher::Event::InitApply(object) => {
                let record = T::project(&object);
                self.objects
                    .insert(record.cache_key(), (record, self.generation));
                false
            }
            watcher::Event::InitDone => {
                let generation = self.generation;
                self.objects.retain(|_, (_, seen)| *seen == generation);
                self.objects.shrink_to_fit();
                self.synced = true;
                true
            }
            watcher::Event::Apply(object) => {
                let record = T::project(&object);
                self.objects
                    .insert(record.cache_key(), (record, self.generation));
                true
            }
            watcher::Event::Delete(object) => {
                self.objects.remove(&T::project(&object).cache_key());
                true
            }
        }
    }

    /// Drops everything (the cache went over its budget): not synced until a list completes.
    fn drop_all(&mut self) {
        self.objects = HashMap::new();
        self.synced = false;
    }
}

/// A cache shared between its [`reflect`] stream (the writer) and the passes (readers).
#[derive(Debug)]
pub struct Store<T: Cached> {
    state: RwLock<StoreState<T>>,
    /// What the cluster's caches may hold; [`reflect`] keeps this one within it.
    budget: CacheBudget,
}

impl<T: Cached> Default for Store<T> {
    fn default() -> Self {
        Self::within(CacheBudget::default())
    }
}

impl<T: Cached> Store<T> {
    /// An empty store whose contents count against `budget`.
    pub fn within(budget: CacheBudget) -> Self {
        Self {
            state: RwLock::new(StoreState {
                objects: HashMap::new(),
                generation: 0,
                synced: false,
            }),
            budget,
        }
    }

    /// Read access for one synchronous decision. Never hold it across an `.await`.
    pub fn read(&self) -> RwLockReadGuard<'_, StoreState<T>> {
        // A writer that panicked left a consistent map (every mutation is a single insert,
        // remove or retain), so reading on is safe.
        self.state
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, StoreState<T>> {
        self.state
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn is_synced(&self) -> bool {
        self.read().synced
    }

    pub fn len(&self) -> usize {
        self.read().objects.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A store that several loops read and one reflector keeps, so the process lists and watches a
/// collection once however many loops need it (the ClusterIP and NodePort repairs both read
/// Services).
#[derive(Debug)]
pub struct SharedStore<T: Cached> {
    store: Arc<Store<T>>,
    /// Counts the changes the reflector applied; readers other than the first wait on it.
    changes: tokio::sync::watch::Sender<u64>,
    fed: std::sync::atomic::AtomicBool,
}

impl<T: Cached> Default for SharedStore<T> {
    fn default() -> Self {
        Self::within(CacheBudget::default())
    }
}

impl<T: Cached> SharedStore<T> {
    /// An empty shared store whose contents count against `budget`.
    pub fn within(budget: CacheBudget) -> Self {
        Self {
            store: Arc::new(Store::within(budget)),
            changes: tokio::sync::watch::Sender::new(0),
            fed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn store(&self) -> &Arc<Store<T>> {
        &self.store
    }

    /// A trigger stream for one reader. The first reader's is `reflector(store)`, the stream that
    /// keeps the store, which also wakes the other readers after each change it applied; the
    /// others' yield after each such change.
    pub fn subscribe(
        &self,
        reflector: impl FnOnce(Arc<Store<T>>) -> BoxStream<'static, ()>,
    ) -> BoxStream<'static, ()> {
        if !self.fed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let changes = self.changes.clone();
            return reflector(self.store.clone())
                .inspect(move |()| changes.send_modify(|count| *count = count.wrapping_add(1)))
                .boxed();
        }
        let mut changes = self.changes.subscribe();
        changes.mark_unchanged();
        futures::stream::unfold(changes, |mut changes| async move {
            changes.changed().await.ok()?;
            Some(((), changes))
        })
        .boxed()
    }
}

/// LIST page size of the caches' (re)lists: client-go's.
pub const DEFAULT_PAGE_SIZE: u32 = 500;

/// Keeps `store` by a kube-runtime watcher of every `T::Object` (retrying with its default
/// backoff) within the store's budget; yields after each change that completes a list or
/// follows it.
pub fn reflect<T: Cached>(
    client: kube::Client,
    page_size: u32,
    store: Arc<Store<T>>,
) -> BoxStream<'static, ()> {
    let api: Api<T::Object> = Api::all(client);
    let config = watcher::Config::default().page_size(page_size);
    let mut failure = crate::findings::RepeatedFailure::default();
    budget::watch(api, config, &store.budget, record_weight::<T>)
        .filter_map(move |event| {
            let kind = <T::Object as kube::Resource>::kind(&());
            let changed = match event {
                Ok(event) => {
                    let changed = store.write().apply(event);
                    if changed {
                        failure.succeeded();
                    }
                    changed
                }
                Err(err @ (CacheError::OverBudget(_) | CacheError::Lost { .. })) => {
                    match &err {
                        CacheError::OverBudget(_) => store.write().drop_all(),
                        _ => store.write().synced = false,
                    }
                    // Reported once until a list completes again.
                    if failure.is_new(&err) {
                        warn!(%kind, error = %err, "the cache is not current until a list completes");
                    }
                    true
                }
                Err(err) if store.is_synced() => {
                    debug!(%kind, error = %err, "watch failed; resuming");
                    false
                }
                Err(err) => {
                    // Warned once per kind of failure while a list keeps failing (an outage fails
                    // every retry the same way).
                    if failure.is_new(&err) {
                        warn!(%kind, error = %err, "list failed; the cache stays unsynced until a list completes");
                    } else {
                        debug!(%kind, error = %err, "list failed again");
                    }
                    false
                }
            };
            futures::future::ready(changed.then_some(()))
        })
        .boxed()
}

/// What one record costs its cache: the record, its key and the map's bookkeeping, plus the
/// names it holds.
fn record_weight<T: Cached>(object: &T::Object) -> usize {
    let meta = kube::Resource::meta(object);
    let names =
        meta.name.as_ref().map_or(0, String::len) + meta.namespace.as_ref().map_or(0, String::len);
    2 * std::mem::size_of::<(T::Key, (T, u32))>() + names
}

/// Lists every `T::Object` now, page by page, as records: a read as fresh as the API's, for
/// a decision no cache may take alone (releasing a leaked bit of a bitmap in etcd). Any failing
/// page fails the whole list.
pub async fn list_fresh<T: Cached>(
    client: &kube::Client,
    page_size: u32,
) -> Result<Vec<T>, kube::Error> {
    let api: Api<T::Object> = Api::all(client.clone());
    let mut records = Vec::new();
    let mut params = ListParams::default().limit(page_size);
    loop {
        let page = api.list(&params).await?;
        records.extend(page.items.iter().map(T::project));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(records),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn service(name: &str, ip: &str) -> ServiceObject {
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

    /// A relist is not synced until it is complete, and then holds exactly what it listed plus
    /// the events after it; a relist that never completes never looks synced.
    #[test]
    fn a_relist_replaces_the_contents_only_when_complete() {
        let store = Store::<ServiceRecord>::default();
        let mut state = store.write();
        assert!(!state.synced);
        assert!(!state.apply(watcher::Event::Init));
        assert!(!state.apply(watcher::Event::InitApply(service("a", "192.0.2.1"))));
        assert!(!state.apply(watcher::Event::InitApply(service("b", "192.0.2.2"))));
        assert!(!state.synced, "a list in progress");
        assert!(state.apply(watcher::Event::InitDone));
        assert!(state.synced);
        assert!(state.apply(watcher::Event::Apply(service("c", "192.0.2.3"))));
        assert!(state.apply(watcher::Event::Delete(service("a", "192.0.2.1"))));
        assert_eq!(names(&state), ["b", "c"]);

        // A relist that fails half-way (the watcher starts over with Init) and one that
        // completes without "b".
        state.apply(watcher::Event::Init);
        state.apply(watcher::Event::InitApply(service("c", "192.0.2.3")));
        assert!(!state.synced);
        state.apply(watcher::Event::Init);
        state.apply(watcher::Event::InitApply(service("c", "192.0.2.9")));
        state.apply(watcher::Event::InitApply(service("d", "192.0.2.4")));
        assert!(!state.synced);
        state.apply(watcher::Event::InitDone);
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

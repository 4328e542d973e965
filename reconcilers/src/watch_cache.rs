//! Objects a loop reads on every pass, kept current by a watch, so a pass at rest reads the cache
//! and sends nothing.
//!
//! The watch that feeds the cache is the loop's trigger: the runner polls it continuously, so the
//! cache stays current between passes. A pass uses the cache only while it is proven current (the
//! watch has listed and not failed since); otherwise, and when the loop is driven without its
//! triggers (a one-off pass in a test), it reads the API as before. Writes made from a cached
//! object carry its resourceVersion, so a cache that lags by a moment costs a conflict and a
//! retry, never a lost update.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use kube::api::ListParams;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::watcher;
use kube::{Api, Resource};
use serde::de::DeserializeOwned;

use crate::Trigger;
use crate::budget::{self, CacheBudget, CacheError, CacheEvent};

/// A cache of one watch's objects; clones share it.
#[derive(Clone)]
pub struct WatchCache<K: Resource + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    store: Store<K>,
    current: Arc<AtomicBool>,
    /// The watch's selectors, for reads while the cache is not current.
    selection: ListParams,
    /// Handed once to the loop's trigger, which the runner polls.
    events: Arc<Mutex<Option<WatchEvents<K>>>>,
}

/// The event stream that fills a [`WatchCache`]: a loop turns it into its trigger.
pub type WatchEvents<K> = futures::stream::BoxStream<'static, CacheEvent<K>>;

impl<K> WatchCache<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
{
    /// A cache of what `config` selects, within `budget`. Nothing is cached until
    /// [`Self::take_events`]'s stream is polled.
    pub fn new(api: Api<K>, config: watcher::Config, budget: &CacheBudget) -> Self
    where
        K: serde::Serialize,
    {
        let selection = ListParams {
            label_selector: config.label_selector.clone(),
            field_selector: config.field_selector.clone(),
            ..ListParams::default()
        };
        let (store, mut writer) = reflector::store();
        let current = Arc::new(AtomicBool::new(false));
        let flag = current.clone();
        let (mut listed, mut relisting) = (false, false);
        let mut failure = crate::findings::RepeatedFailure::default();
        let kind = K::kind(&K::DynamicType::default()).into_owned();
        let events = budget::watch(api, config, budget, budget::object_weight::<K>)
            .inspect(move |event| {
                match event {
                    Ok(event) => {
                        writer.apply_watcher_event(event);
                        match event {
                            // A relist is under way: changes may be missing until it completes.
                            watcher::Event::Init => relisting = true,
                            watcher::Event::InitDone => {
                                (listed, relisting) = (true, false);
                                failure.succeeded();
                            }
                            // A resumed watch starts from the last resourceVersion seen, so its
                            // events after a failure complete the cache again.
                            _ => {}
                        }
                    }
                    Err(err @ (CacheError::OverBudget(_) | CacheError::Lost { .. })) => {
                        if matches!(err, CacheError::OverBudget(_)) {
                            // An empty list empties the store: what it held goes back.
                            writer.apply_watcher_event(&watcher::Event::Init);
                            writer.apply_watcher_event(&watcher::Event::InitDone);
                        }
                        // Not current until a new list completes.
                        listed = false;
                        if failure.is_new(err) {
                            tracing::warn!(%kind, error = %err, "the cache is not current until a list completes");
                        }
                    }
                    Err(CacheError::Watch(_)) => {
                        flag.store(false, Ordering::Release);
                        return;
                    }
                }
                flag.store(listed && !relisting, Ordering::Release);
            })
            .boxed();
        Self {
            store,
            current,
            selection,
            events: Arc::new(Mutex::new(Some(events))),
        }
    }

    /// The stream that fills the cache, for the loop to make its trigger of; `None` after the
    /// first call.
    pub fn take_events(&self) -> Option<WatchEvents<K>> {
        self.events
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }

    /// The cached objects, if the cache is proven current.
    pub fn current(&self) -> Option<&Store<K>> {
        self.current.load(Ordering::Acquire).then_some(&self.store)
    }
}

impl<K> WatchCache<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    /// The named object among those the watch selects: from the cache when it is current, else
    /// from a LIST with the watch's selectors (no permission beyond the watch's).
    pub async fn get(&self, api: &Api<K>, name: &str) -> Result<Option<K>, kube::Error> {
        match self.current() {
            Some(store) => {
                let key = match api.namespace() {
                    Some(namespace) => ObjectRef::new(name).within(namespace),
                    None => ObjectRef::new(name),
                };
                Ok(store.get(&key).map(|object| K::clone(&object)))
            }
            None => Ok(api
                .list(&self.selection)
                .await?
                .items
                .into_iter()
                .find(|object| object.meta().name.as_deref() == Some(name))),
        }
    }

    /// Every object the watch selects: from the cache when it is current, else from a LIST with
    /// the watch's selectors. A failed list is an error, never an empty answer.
    pub async fn list(&self, api: &Api<K>) -> Result<Vec<K>, kube::Error> {
        match self.current() {
            Some(store) => Ok(store
                .state()
                .iter()
                .map(|object| K::clone(object))
                .collect()),
            None => Ok(api.list(&self.selection).await?.items),
        }
    }
}

/// A watch as a trigger: one item per change (and one per completed relist); failures are
/// retried by the watch itself.
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
                // The cache emptied or lost an event: a pass then reads the API instead.
                Err(CacheError::OverBudget(_) | CacheError::Lost { .. }) => Some(()),
                Err(err) => {
                    tracing::debug!(error = %err, "watch failed; retrying with backoff");
                    None
                }
            }
        })
        .boxed()
}

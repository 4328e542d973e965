//! Objects a loop reads on every pass, kept current by a watch, so a pass at rest reads the cache
//! and sends nothing.
//!
//! The watch that feeds the cache is the loop's trigger: the runner polls it continuously, so the
//! cache stays current between passes. A pass uses the cache only while it is proven current (the
//! watch has listed and not failed since); otherwise, and when the loop is driven without its
//! triggers (a one-off pass in a test), it reads the API as before. Writes made from a cached
//! object carry its resourceVersion, so a cache that lags by a moment costs a conflict and a
//! retry, never a lost update.
//!
//! The cache decodes what a Go client decodes ([`Lenient`]): a `null` where k8s-openapi wants a
//! value (kube-apiserver stores a status condition's `lastTransitionTime: null` as given) reads
//! as the field left out, so one such object never costs the watch its events.

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
    store: Store<Lenient<K>>,
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
        let events = budget::watch(lenient(&api), config, budget, budget::object_weight)
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
            .map(|event| event.map(unwrap_event))
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
    pub fn current(&self) -> Option<&Store<Lenient<K>>> {
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
                Ok(store.get(&key).map(|object| K::clone(&object.0)))
            }
            None => Ok(lenient(api)
                .list(&self.selection)
                .await?
                .items
                .into_iter()
                .map(|object| object.0)
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
                .map(|object| K::clone(&object.0))
                .collect()),
            None => Ok(lenient(api)
                .list(&self.selection)
                .await?
                .items
                .into_iter()
                .map(|object| object.0)
                .collect()),
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

/// An object decoded as a Go client decodes it: `null` anywhere in an object reads as the field
/// left out (k8s-openapi refuses a `null` where it wants a value; Go's decoder takes the zero
/// value), and a condition's `lastTransitionTime`, which k8s-openapi requires, as Go's zero time
/// when it is left out. Unknown fields are ignored, as k8s-openapi does anyway.
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

impl<'de, K: DeserializeOwned> serde::Deserialize<'de> for Lenient<K> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut value = serde_json::Value::deserialize(deserializer)?;
        drop_nulls(&mut value);
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

fn unwrap_event<K>(event: watcher::Event<Lenient<K>>) -> watcher::Event<K> {
    match event {
        watcher::Event::Apply(object) => watcher::Event::Apply(object.0),
        watcher::Event::Delete(object) => watcher::Event::Delete(object.0),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(object) => watcher::Event::InitApply(object.0),
        watcher::Event::InitDone => watcher::Event::InitDone,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
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
}

//! A watched collection the manager acts on only once it is listed completely: the tenant
//! Secrets and the etcd-claim records. A re-list builds the next set aside and replaces the last
//! one when it is done, so a sync never decides on half a list.

use std::collections::BTreeMap;

use kube::runtime::watcher;
use reconcilers::sanitize::Sanitized;

pub(super) struct Listed<V> {
    /// The last complete list, with the changes watched since.
    pub(super) complete: Option<BTreeMap<String, V>>,
    /// A re-list under way.
    next: Option<BTreeMap<String, V>>,
    /// The watch's last error, so that it is reported once while it repeats.
    error: Option<String>,
}

/// What one watch event did to the collection.
pub(super) enum Seen {
    /// A list completed, of this many entries.
    Listed(usize),
    /// The watch failed; `new` when the error differs from the last one.
    Failed {
        message: String,
        new: bool,
    },
    Changed,
}

impl<V> Default for Listed<V> {
    fn default() -> Self {
        Self {
            complete: None,
            next: None,
            error: None,
        }
    }
}

impl<V> Listed<V> {
    /// Applies one event. `entry` reads an object's name and value (`None` for one that is not
    /// an entry), `name` the name of a deleted object.
    pub(super) fn apply<K>(
        &mut self,
        event: Result<watcher::Event<K>, watcher::Error>,
        entry: impl Fn(&K) -> Option<(String, V)>,
        name: impl Fn(&K) -> Option<String>,
    ) -> Seen {
        match event {
            Ok(watcher::Event::Init) => self.next = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(object)) => {
                if let (Some(next), Some((name, value))) = (self.next.as_mut(), entry(&object)) {
                    next.insert(name, value);
                }
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(next) = self.next.take() {
                    self.complete = Some(next);
                }
                self.error = None;
                return Seen::Listed(self.complete.as_ref().map_or(0, BTreeMap::len));
            }
            Ok(watcher::Event::Apply(object)) => {
                if let (Some(known), Some((name, value))) = (self.complete.as_mut(), entry(&object))
                {
                    known.insert(name, value);
                }
            }
            Ok(watcher::Event::Delete(object)) => {
                if let (Some(known), Some(name)) = (self.complete.as_mut(), name(&object)) {
                    known.remove(&name);
                }
            }
            Err(err) => {
                let message = Sanitized::of(&err).into_string();
                let new = self.error.as_deref() != Some(message.as_str());
                self.error = Some(message.clone());
                return Seen::Failed { message, new };
            }
        }
        Seen::Changed
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(pair: &(String, u32)) -> Option<(String, u32)> {
        Some(pair.clone())
    }

    fn name(pair: &(String, u32)) -> Option<String> {
        Some(pair.0.clone())
    }

    #[test]
    fn only_a_complete_list_replaces_the_last_and_errors_are_new_once() {
        let mut listed = Listed::default();
        let item = |n: &str, v| (n.to_owned(), v);
        listed.apply(Ok(watcher::Event::Init), entry, name);
        listed.apply(Ok(watcher::Event::InitApply(item("a", 1))), entry, name);
        assert!(listed.complete.is_none(), "half a list is not acted on");
        assert!(matches!(
            listed.apply(Ok(watcher::Event::InitDone), entry, name),
            Seen::Listed(1)
        ));
        listed.apply(Ok(watcher::Event::Init), entry, name);
        listed.apply(Ok(watcher::Event::InitApply(item("b", 2))), entry, name);
        assert_eq!(listed.complete.as_ref().unwrap().len(), 1);
        assert!(listed.complete.as_ref().unwrap().contains_key("a"));
        listed.apply(Ok(watcher::Event::InitDone), entry, name);
        assert!(listed.complete.as_ref().unwrap().contains_key("b"));
        listed.apply(Ok(watcher::Event::Delete(item("b", 2))), entry, name);
        assert!(listed.complete.as_ref().unwrap().is_empty());
        let failed = || Err(watcher::Error::NoResourceVersion);
        assert!(matches!(
            listed.apply(failed(), entry, name),
            Seen::Failed { new: true, .. }
        ));
        assert!(matches!(
            listed.apply(failed(), entry, name),
            Seen::Failed { new: false, .. }
        ));
    }
}

//! A watched collection the manager acts on only once it is listed completely: the tenant
//! Secrets and the etcd-claim records. A re-list builds the next set aside and replaces the last
//! one when it is done, so a sync never decides on half a list.
//!
//! What its entries hold may have a budget ([`Listed::budgeted`]): an entry that would take the
//! collection over it is kept shed ([`Held::shed`]), alone, and the others keep theirs. A re-list
//! keeps room for what the last list held, so the same entries stay held.

use std::collections::{BTreeMap, HashMap};

use kube::runtime::watcher;
use reconcilers::sanitize::Sanitized;

/// An entry that holds bytes its object's writer chose.
pub(super) trait Held: Sized {
    /// The bytes it holds.
    fn held(&self) -> usize;
    /// The entry without what it holds (so [`Held::held`] is 0), remembering how much it was.
    fn shed(self) -> Self;
}

pub(super) struct Listed<V> {
    /// The last complete list, with the changes watched since.
    pub(super) complete: Option<BTreeMap<String, V>>,
    /// A re-list under way.
    next: Option<BTreeMap<String, V>>,
    /// The watch's last error, so that it is reported once while it repeats.
    error: Option<String>,
    /// The most bytes the entries may hold together, if any.
    limit: Option<usize>,
    /// What the entries of `complete` hold.
    held: usize,
    /// What the entries of `next` hold.
    next_held: usize,
    /// During a re-list, the room kept for the entries `complete` held, by name, until the list
    /// brings each (and its total).
    kept: HashMap<String, usize>,
    kept_total: usize,
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
            limit: None,
            held: 0,
            next_held: 0,
            kept: HashMap::new(),
            kept_total: 0,
        }
    }
}

impl<V: Held + PartialEq + Clone> Listed<V> {
    /// A collection whose entries may hold at most `limit` bytes together.
    pub(super) fn budgeted(limit: usize) -> Self {
        Self {
            limit: Some(limit),
            ..Self::default()
        }
    }

    /// Whether a list is under way.
    pub(super) fn listing(&self) -> bool {
        self.next.is_some()
    }

    /// What the entries of the last complete list hold, and the most they may.
    pub(super) fn held(&self) -> (usize, Option<usize>) {
        (self.held, self.limit)
    }

    /// Applies one event. `entry` reads an object's name and value (`None` for one that is not
    /// an entry), `name` the name of a deleted object.
    pub(super) fn apply<K>(
        &mut self,
        event: Result<watcher::Event<K>, watcher::Error>,
        entry: impl Fn(&K) -> Option<(String, V)>,
        name: impl Fn(&K) -> Option<String>,
    ) -> Seen {
        match event {
            Ok(watcher::Event::Init) => {
                self.next = Some(BTreeMap::new());
                self.next_held = 0;
                self.kept = self
                    .complete
                    .iter()
                    .flatten()
                    .map(|(name, value)| (name.clone(), value.held()))
                    .filter(|(_, held)| *held > 0)
                    .collect();
                self.kept_total = self.kept.values().sum();
            }
            Ok(watcher::Event::InitApply(object)) => {
                if self.next.is_some()
                    && let Some((name, value)) = entry(&object)
                {
                    if let Some(kept) = self.kept.remove(&name) {
                        self.kept_total -= kept;
                    }
                    let room = self.room(self.next_held + self.kept_total);
                    let value = self
                        .known(&name, value)
                        .unwrap_or_else(|value| fit(value, room));
                    self.next_held += value.held();
                    // A name listed twice counts once.
                    if let Some(next) = self.next.as_mut()
                        && let Some(replaced) = next.insert(name, value)
                    {
                        self.next_held -= replaced.held();
                    }
                }
            }
            Ok(watcher::Event::InitDone) => {
                if let Some(next) = self.next.take() {
                    self.complete = Some(next);
                    self.held = self.next_held;
                }
                self.kept = HashMap::new();
                self.kept_total = 0;
                self.error = None;
                return Seen::Listed(self.complete.as_ref().map_or(0, BTreeMap::len));
            }
            Ok(watcher::Event::Apply(object)) => {
                if self.complete.is_some()
                    && let Some((name, value)) = entry(&object)
                {
                    let before = self.held_by(&name);
                    let room = self.room(self.held - before);
                    let value = self
                        .known(&name, value)
                        .unwrap_or_else(|value| fit(value, room));
                    self.held = self.held - before + value.held();
                    if let Some(known) = self.complete.as_mut() {
                        known.insert(name, value);
                    }
                }
            }
            Ok(watcher::Event::Delete(object)) => {
                if let (Some(known), Some(name)) = (self.complete.as_mut(), name(&object))
                    && let Some(gone) = known.remove(&name)
                {
                    self.held -= gone.held();
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

    /// The entry the last list holds for `name`, if `value` is the same: kept rather than
    /// `value`, so that what the entry holds (shared with whoever took a copy of it) is held
    /// once, not again by each list.
    fn known(&self, name: &str, value: V) -> Result<V, V> {
        match self.complete.as_ref().and_then(|known| known.get(name)) {
            Some(known) if *known == value => Ok(known.clone()),
            _ => Err(value),
        }
    }

    fn held_by(&self, name: &str) -> usize {
        self.complete
            .as_ref()
            .and_then(|known| known.get(name))
            .map_or(0, Held::held)
    }

    /// The bytes an entry may hold beside `others`.
    fn room(&self, others: usize) -> usize {
        self.limit
            .map_or(usize::MAX, |limit| limit.saturating_sub(others))
    }
}

/// `value` as it is if what it holds fits in `room`, else shed.
fn fit<V: Held>(value: V, room: usize) -> V {
    if value.held() > room {
        value.shed()
    } else {
        value
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A test entry: its name, and the bytes it holds (or held, once shed); `data` stands for
    /// what it holds, compared by value like a Secret's bytes.
    #[derive(Clone, Debug, PartialEq)]
    struct Item {
        name: String,
        bytes: usize,
        shed: bool,
        data: std::sync::Arc<usize>,
    }

    impl Held for Item {
        fn held(&self) -> usize {
            if self.shed { 0 } else { self.bytes }
        }
        fn shed(self) -> Self {
            Item { shed: true, ..self }
        }
    }

    fn item(name: &str, bytes: usize) -> Item {
        Item {
            name: name.to_owned(),
            bytes,
            shed: false,
            data: std::sync::Arc::new(bytes),
        }
    }

    fn entry(item: &Item) -> Option<(String, Item)> {
        Some((item.name.clone(), item.clone()))
    }

    fn name(item: &Item) -> Option<String> {
        Some(item.name.clone())
    }

    fn list(listed: &mut Listed<Item>, items: &[Item]) {
        listed.apply(Ok(watcher::Event::Init), entry, name);
        for i in items {
            listed.apply(Ok(watcher::Event::InitApply(i.clone())), entry, name);
        }
        listed.apply(Ok(watcher::Event::InitDone), entry, name);
    }

    fn shed(listed: &Listed<Item>) -> Vec<&str> {
        let known = listed.complete.as_ref().unwrap();
        known
            .values()
            .filter(|i| i.shed)
            .map(|i| i.name.as_str())
            .collect()
    }

    #[test]
    fn only_a_complete_list_replaces_the_last_and_errors_are_new_once() {
        let mut listed = Listed::default();
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
        assert_eq!(listed.held(), (0, None));
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

    /// The entry that would take the total over the budget is shed, alone; it is held again
    /// once it fits, and a re-list keeps what was held held, whatever order the list brings.
    #[test]
    fn an_entry_over_the_budget_is_shed_alone_and_a_relist_keeps_the_held_ones() {
        let mut listed = Listed::budgeted(10);
        list(&mut listed, &[item("a", 4), item("b", 4), item("c", 4)]);
        assert_eq!(shed(&listed), ["c"]);
        assert_eq!(listed.held(), (8, Some(10)));

        // Growing, an entry that was held is the one shed; shrinking, it is held again.
        listed.apply(Ok(watcher::Event::Apply(item("b", 7))), entry, name);
        assert_eq!(shed(&listed), ["b", "c"]);
        assert_eq!(listed.held().0, 4);
        listed.apply(Ok(watcher::Event::Apply(item("c", 6))), entry, name);
        assert_eq!(shed(&listed), ["b"]);
        assert_eq!(listed.held().0, 10);

        // A re-list in another order: the room of a and c is kept for them, so b stays shed
        // although it comes first.
        list(&mut listed, &[item("b", 4), item("c", 6), item("a", 4)]);
        assert_eq!(shed(&listed), ["b"]);
        assert_eq!(listed.held().0, 10);

        // Deleted, an entry makes room that the next re-list gives to the shed one.
        listed.apply(Ok(watcher::Event::Delete(item("c", 6))), entry, name);
        assert_eq!(listed.held().0, 4);
        list(&mut listed, &[item("a", 4), item("b", 4)]);
        assert_eq!(shed(&listed), Vec::<&str>::new());
        assert_eq!(listed.held().0, 8);

        // An entry listed or watched again unchanged is the one held already, not a copy.
        let held_a = |listed: &Listed<Item>| listed.complete.as_ref().unwrap()["a"].data.clone();
        let before = held_a(&listed);
        list(&mut listed, &[item("a", 4), item("b", 4)]);
        listed.apply(Ok(watcher::Event::Apply(item("a", 4))), entry, name);
        assert!(std::sync::Arc::ptr_eq(&before, &held_a(&listed)));
        assert!(!listed.listing());

        // One entry larger than the whole budget is never held.
        listed.apply(Ok(watcher::Event::Apply(item("d", 11))), entry, name);
        assert_eq!(shed(&listed), ["d"]);
        assert_eq!(listed.held().0, 8);
    }
}

//! Findings reported once: when a condition appears, not again on every pass while it persists,
//! and again if it clears and comes back.
//!
//! A loop keys each finding (for example `("PortAlreadyAllocated", "default/web", 30080)`) and,
//! after every *complete* pass, hands the whole set it found to [`ReportOnce::update`], which
//! returns the findings that are new since the previous complete pass. Only those get an event,
//! a log line at warn level and a metric increment. A pass that could not see everything (a
//! failed or partial list) must not call `update`: it would forget findings it merely did not
//! look at, and report them again on the next pass.

use std::collections::HashSet;
use std::hash::Hash;
use std::sync::Mutex;

/// The set of findings reported so far and still present.
#[derive(Debug)]
pub struct ReportOnce<K> {
    present: Mutex<HashSet<K>>,
}

impl<K> Default for ReportOnce<K> {
    fn default() -> Self {
        Self {
            present: Mutex::new(HashSet::new()),
        }
    }
}

impl<K: Eq + Hash + Clone> ReportOnce<K> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the findings of a complete pass and returns those that were not present after the
    /// previous one, in the order given (duplicates in `current` are returned once). Findings
    /// absent from `current` are forgotten, so they are new again if they return.
    pub fn update(&self, current: impl IntoIterator<Item = K>) -> Vec<K> {
        let mut present = self.present.lock().unwrap_or_else(|p| p.into_inner());
        let mut next = HashSet::with_capacity(present.len());
        let mut new = Vec::new();
        for finding in current {
            if next.insert(finding.clone()) && !present.contains(&finding) {
                new.push(finding);
            }
        }
        *present = next;
        new
    }

    /// Whether `finding` was present after the last complete pass.
    pub fn is_present(&self, finding: &K) -> bool {
        self.present
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(finding)
    }

    /// How many findings are present now (for a gauge).
    pub fn len(&self) -> usize {
        self.present.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_finding_is_new_once_while_it_persists() {
        let once = ReportOnce::new();
        assert_eq!(once.update(["a", "b"]), vec!["a", "b"]);
        for _ in 0..100 {
            assert!(once.update(["a", "b"]).is_empty());
        }
        assert_eq!(once.len(), 2);
    }

    #[test]
    fn a_finding_that_clears_and_returns_is_new_again() {
        let once = ReportOnce::new();
        assert_eq!(once.update(["a"]), vec!["a"]);
        assert!(once.update(Vec::<&str>::new()).is_empty());
        assert!(!once.is_present(&"a"));
        assert_eq!(once.update(["a"]), vec!["a"]);
    }

    #[test]
    fn duplicates_within_a_pass_count_once() {
        let once = ReportOnce::new();
        assert_eq!(once.update(["a", "a", "b", "a"]), vec!["a", "b"]);
        assert_eq!(once.update(["b", "c"]), vec!["c"]);
        assert!(!once.is_present(&"a"));
        assert!(!once.is_empty());
    }
}

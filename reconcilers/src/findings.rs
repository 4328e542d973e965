//! Findings reported once: when a condition appears, not again on every pass while it persists,
//! and again if it clears and comes back; and failures that repeat while they last
//! ([`RepeatedFailure`]), warned about once.
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
use std::sync::atomic::{AtomicU64, Ordering};

/// The set of findings reported so far and still present.
#[derive(Debug)]
pub struct ReportOnce<K> {
    present: Mutex<HashSet<K>>,
    /// How many new findings [`ReportOnce::update`] has returned in all.
    reported: AtomicU64,
}

impl<K> Default for ReportOnce<K> {
    fn default() -> Self {
        Self {
            present: Mutex::new(HashSet::new()),
            reported: AtomicU64::new(0),
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
        self.reported.fetch_add(new.len() as u64, Ordering::Relaxed);
        new
    }

    /// How many new findings [`ReportOnce::update`] has returned in all: whether a pass
    /// reported anything new, for one who reads it before and after.
    pub fn reported(&self) -> u64 {
        self.reported.load(Ordering::Relaxed)
    }

    /// Forgets `finding`, so the next complete pass that finds it returns it as new: for a
    /// finding whose report could not be written (its event refused while the namespace it goes
    /// into is still being created, say), which must not be lost.
    pub fn forget(&self, finding: &K) {
        self.present
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(finding);
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

/// A failure that repeats while it lasts (an outage fails every retry the same way): warned about
/// when it first appears or changes, logged at debug while it repeats, new again after a success.
///
/// It keeps a hash of the failure's message, not the message: an error may quote what a server
/// sent (a Status message of megabytes), and it is kept for as long as the failure lasts.
#[derive(Debug, Default)]
pub struct RepeatedFailure {
    last: Option<u64>,
}

impl RepeatedFailure {
    /// Whether `error` should be warned about: it differs from the failure seen last.
    pub fn is_new(&mut self, error: &impl std::fmt::Display) -> bool {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::hash::DefaultHasher::new();
        error.to_string().hash(&mut hasher);
        let message = Some(hasher.finish());
        if self.last == message {
            return false;
        }
        self.last = message;
        true
    }

    /// A success: the next failure is new, whatever it is.
    pub fn succeeded(&mut self) {
        self.last = None;
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
    fn a_forgotten_finding_is_new_again_while_the_others_stay_reported() {
        let once = ReportOnce::new();
        assert_eq!(once.update(["a", "b"]), vec!["a", "b"]);
        once.forget(&"a");
        assert_eq!(once.update(["a", "b"]), vec!["a"]);
        assert!(once.update(["a", "b"]).is_empty());
    }

    #[test]
    fn a_repeated_failure_is_new_when_it_appears_changes_or_follows_a_success() {
        let mut failure = RepeatedFailure::default();
        assert!(failure.is_new(&"connection refused"));
        assert!(!failure.is_new(&"connection refused"));
        assert!(failure.is_new(&"403 Forbidden"));
        assert!(!failure.is_new(&"403 Forbidden"));
        failure.succeeded();
        assert!(failure.is_new(&"403 Forbidden"));
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

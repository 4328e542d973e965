//! What `/readyz` reports: one status per loop (kept by the runner's loop tasks) and the checks
//! that are not loops (leader election, the tenant Secrets), with kube-apiserver's
//! `/readyz?verbose` lines.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// What `/readyz` reports about one loop.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoopStatus {
    pub needs_leadership: bool,
    /// Had a successful pass (stays true afterwards, as upstream's post-start hooks).
    pub succeeded: bool,
    /// Waiting for leadership: a standby replica is ready without running the loop.
    pub standby: bool,
    pub passes: u64,
    pub consecutive_failures: u32,
    pub last_error: Option<String>,
}

impl LoopStatus {
    /// `leading`: whether this replica currently leads. A leader-only loop is a ready standby
    /// only on a replica that does not lead; on the leader it must have succeeded.
    pub fn is_ready(&self, leading: bool) -> bool {
        self.succeeded || (self.needs_leadership && self.standby && !leading)
    }
}

/// Shared, per-loop readiness. Cheap to clone.
#[derive(Clone, Default)]
pub struct Health {
    loops: Arc<Mutex<BTreeMap<&'static str, LoopStatus>>>,
    /// Checks that are not loops (leader election).
    checks: Arc<Mutex<BTreeMap<&'static str, CheckState>>>,
    /// Set by leader election; without election no loop ever waits, so it does not matter.
    leading: Arc<std::sync::atomic::AtomicBool>,
}

/// A readiness check that is not a loop, with the words `/readyz` shows for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckState {
    Passing(String),
    Failing(String),
}

/// The AND over every loop, with one line per loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    /// `[+]name ok` / `[-]name failed: reason`, like kube-apiserver's `/readyz?verbose`.
    pub lines: Vec<String>,
}

impl Health {
    /// Changes one loop's status (the runner's loop tasks report each pass here).
    pub(crate) fn update(&self, name: &'static str, change: impl FnOnce(&mut LoopStatus)) {
        let mut loops = self
            .loops
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        change(loops.entry(name).or_default());
    }

    pub fn status(&self, name: &str) -> Option<LoopStatus> {
        let loops = self
            .loops
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        loops.get(name).cloned()
    }

    /// Records whether this replica leads (before the leader channel announces it, so
    /// `/readyz` never shows a new leader's loops as ready standbys).
    pub fn set_leading(&self, leading: bool) {
        self.leading
            .store(leading, std::sync::atomic::Ordering::SeqCst);
    }

    /// Sets a non-loop readiness check, e.g. `leader-election`.
    pub fn set_check(&self, name: &'static str, state: CheckState) {
        let mut checks = self
            .checks
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        checks.insert(name, state);
    }

    pub fn readiness(&self) -> Readiness {
        let leading = self.leading.load(std::sync::atomic::Ordering::SeqCst);
        let mut ready = true;
        let mut lines = Vec::new();
        {
            let checks = self
                .checks
                .lock()
                .unwrap_or_else(|poison| poison.into_inner());
            for (name, state) in checks.iter() {
                lines.push(match state {
                    CheckState::Passing(detail) if detail.is_empty() => format!("[+]{name} ok"),
                    CheckState::Passing(detail) => format!("[+]{name} ok ({detail})"),
                    CheckState::Failing(reason) => {
                        ready = false;
                        format!("[-]{name} failed: {reason}")
                    }
                });
            }
        }
        let loops = self
            .loops
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for (name, status) in loops.iter() {
            let line = if status.succeeded {
                match (&status.last_error, status.consecutive_failures) {
                    (Some(err), failures) if failures > 0 => {
                        format!("[+]{name} ok (last {failures} passes failed: {err})")
                    }
                    _ => format!("[+]{name} ok"),
                }
            } else if status.is_ready(leading) {
                format!("[+]{name} ok (standby: not the leader)")
            } else {
                ready = false;
                match &status.last_error {
                    Some(err) => format!("[-]{name} failed: no successful pass yet: {err}"),
                    None => format!("[-]{name} failed: first pass not finished"),
                }
            };
            lines.push(line);
        }
        Readiness { ready, lines }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_loop_is_ready_only_on_a_replica_that_does_not_lead() {
        let standby = LoopStatus {
            needs_leadership: true,
            standby: true,
            ..LoopStatus::default()
        };
        assert!(standby.is_ready(false));
        assert!(
            !standby.is_ready(true),
            "the leader must run its loops first"
        );
        let done = LoopStatus {
            succeeded: true,
            ..standby.clone()
        };
        assert!(done.is_ready(true));
    }
}

//! What this replica knows of each tenant, as `/readyz` and `/metrics` read it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::registry::Registry;
use reconcilers::sanitize::Sanitized;

use crate::health::Health;

/// What this replica knows of one tenant, for `/readyz` and `/metrics`.
#[derive(Clone)]
pub(super) enum Entry {
    Running {
        health: Health,
        registry: Arc<Registry>,
    },
    /// Its Secret is being read (kubeconfig, configuration, client) in a task of its own.
    Starting,
    /// Its Secret cannot start a runtime; the reason names what to fix.
    Invalid(Sanitized),
    /// Owned here, waiting: for the replicas to agree on who owns what (a hand-over), or for
    /// its etcd's answer and the decision on its etcd keys. Says which.
    Waiting(&'static str),
    /// Another replica owns it.
    Elsewhere(String),
}

impl Entry {
    pub(super) fn state(&self) -> &'static str {
        match self {
            Entry::Running { .. } => "running",
            Entry::Starting => "starting",
            Entry::Invalid(_) => "invalid",
            Entry::Waiting(_) => "waiting",
            Entry::Elsewhere(_) => "elsewhere",
        }
    }
}

/// The tenants as `/readyz` and `/metrics` see them; cheap to clone.
#[derive(Clone, Default)]
pub struct Directory {
    entries: Arc<Mutex<BTreeMap<String, Entry>>>,
}

impl Directory {
    pub(super) fn replace(&self, entries: BTreeMap<String, Entry>) {
        *self.entries.lock().unwrap_or_else(|p| p.into_inner()) = entries;
    }

    fn snapshot(&self) -> BTreeMap<String, Entry> {
        self.entries
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// One line per tenant, `/readyz?verbose` style. A tenant never fails the process's
    /// readiness (restarting this process would not heal it); the lines say which fail.
    pub fn readyz_lines(&self) -> Vec<String> {
        self.snapshot()
            .into_iter()
            .map(|(key, entry)| match entry {
                Entry::Running { health, .. } => {
                    let readiness = health.readiness();
                    if readiness.ready {
                        format!("[+]tenant {key} ok")
                    } else {
                        let failing: Vec<String> = readiness
                            .lines
                            .iter()
                            .filter_map(|line| line.strip_prefix("[-]"))
                            .map(str::to_owned)
                            .collect();
                        format!("[-]tenant {key} failing: {}", failing.join("; "))
                    }
                }
                Entry::Starting => format!("[+]tenant {key} ok (starting)"),
                Entry::Invalid(reason) => format!("[-]tenant {key} not started: {reason}"),
                Entry::Waiting(what) => format!("[+]tenant {key} ok (waiting for {what})"),
                Entry::Elsewhere(owner) => format!(
                    "[+]tenant {key} ok (run by replica {})",
                    Sanitized::new(&owner)
                ),
            })
            .collect()
    }

    /// The registries of the tenants running here, each labelled with its tenant.
    pub fn registries(&self) -> Vec<Arc<Registry>> {
        self.snapshot()
            .into_values()
            .filter_map(|entry| match entry {
                Entry::Running { registry, .. } => Some(registry),
                _ => None,
            })
            .collect()
    }

    /// Which tenants run here (tests, logs).
    pub fn running(&self) -> Vec<String> {
        self.snapshot()
            .into_iter()
            .filter(|(_, entry)| matches!(entry, Entry::Running { .. }))
            .map(|(key, _)| key)
            .collect()
    }
}

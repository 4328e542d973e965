//! Loop: system namespaces.
//!
//! Upstream (`pkg/controlplane/controller/systemnamespaces`) creates a fixed list of namespaces
//! once a minute and never does anything else. We keep its semantics (create when missing,
//! `AlreadyExists` is success, a `Terminating` namespace counts as present, never delete or rename)
//! but also wake on the namespace watch, so a deleted namespace is back as soon as it is gone,
//! and we let operators declare extra namespaces with labels and annotations.
//!
//! The files: `section.rs` (the configuration), `plan.rs` (what each namespace needs, pure, with
//! the table of its cases), `apply.rs` (the writes); here the loop: the namespace cache and a
//! pass over the declared namespaces.

use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::events::Reporter;
use kube::runtime::watcher;
use kube::{Api, Client};
use prometheus_client::metrics::gauge::Gauge;

use crate::budget::CacheBudget;
use crate::contract::{Action, LoopError, PassContext, PassReport, Reconciler, Trigger};
use crate::metrics::{MetricRegistry, loop_registry, registered};
use crate::watch_cache::{Lenient, WatchCache, watch_trigger};

mod apply;
mod plan;
mod section;

pub use plan::{NamespaceNeed, assess};
pub use section::{DEFAULT_INTERVAL, NamespaceSpec, Section, UPSTREAM_NAMESPACES};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "system-namespaces";

/// Where events about cluster-scoped objects, namespaces among them, are written.
const EVENTS_NAMESPACE: &str = "default";

pub struct SystemNamespacesLoop {
    config: Section,
    api: Api<Namespace>,
    /// Every namespace, kept by a watch that is also the loop's trigger; a pass reads only the
    /// declared names from it.
    cache: WatchCache<Lenient<Namespace>>,
    missing: Gauge,
    /// Namespaces reported stuck terminating: warned about once when each gets stuck.
    stuck: crate::findings::ReportOnce<String>,
    client: Client,
    /// Who the repairs' events come from.
    reporter: Reporter,
}

impl SystemNamespacesLoop {
    pub fn new(
        client: Client,
        config: Section,
        budget: &CacheBudget,
        reporter: Reporter,
        registry: &mut dyn MetricRegistry,
    ) -> Self {
        let api: Api<Namespace> = Api::all(client.clone());
        let cache = WatchCache::of(&api, watcher::Config::default(), budget);
        let missing = registered(
            loop_registry(registry, NAME),
            "missing",
            "Declared system namespaces absent at the end of the last pass (dry-run: before it)",
            Gauge::default(),
        );
        Self {
            config,
            api,
            cache,
            missing,
            stuck: crate::findings::ReportOnce::new(),
            client,
            reporter,
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let mut found_by_spec = Vec::with_capacity(self.config.namespaces.len());
        let mut first_error = None;
        // The namespaces that failed, by their place in the configuration.
        let mut failed = Vec::new();
        let mut unread = false;
        let mut still_missing = 0;
        let mut stuck = std::collections::BTreeMap::new();
        let now = jiff::Timestamp::now();
        // `default` first: the events of the other namespaces' repairs are written into it, so
        // on a cluster that lacks it they would otherwise be lost.
        let mut order: Vec<usize> = (0..self.config.namespaces.len()).collect();
        order.sort_by_key(|&at| self.config.namespaces[at].name != EVENTS_NAMESPACE);
        for at in order {
            let spec = &self.config.namespaces[at];
            // Only the declared names are read (from the cache while it is current, else one GET
            // each): a cluster of thousands of namespaces is never listed by a pass.
            let existing = match self.cache.get_named(&self.api, &spec.name).await {
                Ok(existing) => existing,
                Err(err) => {
                    unread = true;
                    // The runner warns about the pass's error, naming each namespace, once.
                    tracing::debug!(namespace = %spec.name, error = %err,
                        "unable to read required system namespace");
                    failed.push(at);
                    first_error.get_or_insert(err);
                    continue;
                }
            };
            let need = assess(spec, existing.as_ref(), now);
            if let Some(note) = need.stuck_note(&spec.name) {
                stuck.insert(format!("Namespace/{}", spec.name), note);
            }
            match self.apply(ctx, spec, need).await {
                Ok(Some(found)) => {
                    if found.action == Action::Create && !found.applied {
                        still_missing += 1;
                    }
                    found_by_spec.push((at, found));
                }
                Ok(None) => {}
                Err(err) => {
                    still_missing += usize::from(existing.is_none());
                    tracing::debug!(namespace = %spec.name, error = %err,
                        "unable to reconcile required system namespace");
                    failed.push(at);
                    first_error.get_or_insert(err);
                }
            }
        }
        // Reported in the configured order, whatever order the writes took.
        found_by_spec.sort_by_key(|(at, _)| *at);
        let mut report = PassReport::default();
        for (_, found) in found_by_spec {
            report.push(found);
        }
        // A namespace not read this pass may be missing or stuck: the gauge keeps its last
        // value, and a stuck one forgotten would be warned about again.
        if !unread {
            self.missing
                .set(i64::try_from(still_missing).unwrap_or(i64::MAX));
            for object in self.stuck.update(stuck.keys().cloned()) {
                tracing::warn!(%object, "{}", stuck.get(&object).map(String::as_str).unwrap_or_default());
            }
        }
        match first_error {
            // Every namespace was tried; the runner retries the pass with backoff.
            Some(err) => {
                failed.sort_unstable();
                let names: Vec<&str> = failed
                    .iter()
                    .map(|&at| self.config.namespaces[at].name.as_str())
                    .collect();
                Err(naming(&names, err))
            }
            None => Ok(report),
        }
    }
}

/// A failed pass's error: the first failure, its text naming every namespace that failed. It
/// stays the same kind of error, so it is counted under the same category (a 403 stays
/// `forbidden`).
fn naming(failed: &[&str], first: kube::Error) -> LoopError {
    let names = format!("namespaces {}", failed.join(", "));
    LoopError::Api(match first {
        kube::Error::Api(mut status) => {
            status.message = format!("{names}: {}", status.message);
            kube::Error::Api(status)
        }
        other => kube::Error::Service(format!("{names}: {other}").into()),
    })
}

impl Reconciler for SystemNamespacesLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.config.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        let declared: std::collections::HashSet<String> = self
            .config
            .namespaces
            .iter()
            .map(|spec| spec.name.clone())
            .collect();
        // A change to a namespace nobody declared needs no pass; a completed (re)list, a lost
        // event or a breached budget still wakes one.
        let events = self.cache.take_events().map(|events| {
            events.filter(move |event| {
                let undeclared = match event {
                    Ok(watcher::Event::Apply(namespace) | watcher::Event::Delete(namespace)) => {
                        !declared.contains(namespace.0.metadata.name.as_deref().unwrap_or_default())
                    }
                    _ => false,
                };
                futures::future::ready(!undeclared)
            })
        });
        events.map(watch_trigger).into_iter().collect()
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

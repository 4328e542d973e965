//! Management mode: one process keeps the bootstrap state of many tenant clusters.
//!
//! Each Secret of the management cluster that matches the selector is one tenant: its kubeconfig
//! (under the configured data key) reaches the tenant's API, and its annotation
//! [`TENANT_CONFIG_ANNOTATION`] (a YAML fragment of the configuration file) holds the tenant's
//! own settings. Every tenant gets the runtime the single-cluster mode runs (the loops of
//! [`crate::loops::build_runner`], driven by a [`Runner`]) with its own client and its own metrics
//! registry labelled `tenant`, so a tenant that is down, slow or hostile only occupies its own
//! tasks and connections.
//!
//! Replicas share the tenants through [`crate::shards`]: a tenant starts only on the replica
//! that owns it in a settled view, and a replica stops the tenants it lost before it
//! acknowledges a view, so a tenant never has two writers. Nothing is stopped on partial
//! information: until the first complete list of Secrets, and while a re-list is under way, the
//! tenants last known keep running.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use kube::Resource;
use kube::api::Api;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::config::{TENANT_CONFIG_ANNOTATION, TenantBase};
use crate::metrics::METRICS_PREFIX;
use crate::runner::{CheckState, Health};
use crate::shards::View;

/// Name of the readiness check that the Secrets of the management cluster are known.
pub const READYZ_CHECK: &str = "tenant-secrets";

/// Where the tenants are and how each is configured.
#[derive(Clone, Debug)]
pub struct TenantSettings {
    pub selector: String,
    pub namespace: Option<String>,
    pub kubeconfig_key: String,
    pub base: TenantBase,
    /// This replica: the events' `reportingInstance`.
    pub identity: String,
}

/// What the runtime of a tenant is made from: any change restarts the tenant.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Spec {
    namespace: String,
    name: String,
    uid: String,
    kubeconfig: Option<Vec<u8>>,
    fragment: Option<String>,
}

impl Spec {
    fn of(secret: &Secret, key: &str) -> Option<(String, Spec)> {
        let namespace = secret.metadata.namespace.clone()?;
        let name = secret.metadata.name.clone()?;
        let spec = Spec {
            uid: secret.metadata.uid.clone().unwrap_or_default(),
            kubeconfig: secret
                .data
                .as_ref()
                .and_then(|data| data.get(key))
                .map(|bytes| bytes.0.clone()),
            fragment: secret
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TENANT_CONFIG_ANNOTATION))
                .cloned(),
            namespace,
            name,
        };
        Some((format!("{}/{}", spec.namespace, spec.name), spec))
    }
}

/// A tenant whose loops run here.
struct Running {
    spec: Spec,
    /// The runtime's leadership: every loop of a tenant is leader-only, and taking it away
    /// abandons running passes at once (a pass hung on a slow API must not outlive the stop).
    leading: watch::Sender<bool>,
    cancel: CancellationToken,
    task: JoinHandle<()>,
    health: Health,
    registry: Arc<Registry>,
}

/// What this replica knows of one tenant, for `/readyz` and `/metrics`.
#[derive(Clone)]
enum Entry {
    Running {
        health: Health,
        registry: Arc<Registry>,
    },
    /// Its Secret cannot start a runtime; the reason names what to fix.
    Invalid(String),
    /// Owned here, waiting for the replicas to agree on who owns what (a hand-over).
    Waiting,
    /// Another replica owns it.
    Elsewhere(String),
}

impl Entry {
    fn state(&self) -> &'static str {
        match self {
            Entry::Running { .. } => "running",
            Entry::Invalid(_) => "invalid",
            Entry::Waiting => "waiting",
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
    fn replace(&self, entries: BTreeMap<String, Entry>) {
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
                Entry::Invalid(reason) => format!("[-]tenant {key} not started: {reason}"),
                Entry::Waiting => format!("[+]tenant {key} ok (waiting for the hand-over)"),
                Entry::Elsewhere(owner) => format!("[+]tenant {key} ok (run by replica {owner})"),
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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// The manager's own metrics (the tenants' are in their registries).
#[derive(Clone, Default)]
pub struct TenantMetrics {
    tenants: Family<StateLabels, Gauge>,
    config_errors: Counter,
    starts: Counter,
    stops: Family<ReasonLabels, Counter>,
    replicas: Gauge,
    fenced: Gauge,
}

impl TenantMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = TenantMetrics::default();
        registry.register(
            "tenants",
            "Tenant clusters known to this replica, by state (running here, invalid: its Secret \
             cannot start it, waiting for a hand-over, elsewhere: run by another replica)",
            metrics.tenants.clone(),
        );
        registry.register(
            "tenant_config_errors",
            "Tenant Secrets found unusable (bad kubeconfig or configuration fragment), counted \
             once per version of the Secret",
            metrics.config_errors.clone(),
        );
        registry.register(
            "tenant_starts",
            "Tenant runtimes started on this replica",
            metrics.starts.clone(),
        );
        registry.register(
            "tenant_stops",
            "Tenant runtimes stopped on this replica, by reason (deleted, changed, moved: \
             another replica owns it now, shutdown)",
            metrics.stops.clone(),
        );
        registry.register(
            "tenant_replicas",
            "Live replicas sharing the tenants, as this replica sees them (1 without sharing)",
            metrics.replicas.clone(),
        );
        registry.register(
            "tenant_fenced",
            "1 while this replica cannot prove its replica Lease is current: it runs no tenant",
            metrics.fenced.clone(),
        );
        for state in ["running", "invalid", "waiting", "elsewhere"] {
            metrics.tenants.get_or_create(&StateLabels { state }).set(0);
        }
        metrics
    }
}

/// How tenants are shared with other replicas: the views to follow and how to acknowledge one.
pub struct Ownership {
    pub views: watch::Receiver<View>,
    pub ack: Box<dyn Fn(u64) + Send + Sync>,
}

impl Ownership {
    /// One replica running every tenant.
    pub fn single(identity: &str) -> Ownership {
        let (sender, views) = watch::channel(View::single(identity));
        // The view never changes; the receiver keeps the last value after the sender is gone.
        drop(sender);
        Ownership {
            views,
            ack: Box::new(|_| {}),
        }
    }
}

/// The manager: follows the tenant Secrets and the ownership views, starts and stops tenant
/// runtimes. Ends after `cancel`, once every tenant it ran has stopped.
pub fn spawn(
    client: kube::Client,
    settings: TenantSettings,
    ownership: Ownership,
    health: Health,
    metrics: TenantMetrics,
    directory: Directory,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    health.set_check(
        READYZ_CHECK,
        CheckState::Failing("the tenant Secrets have not been listed yet".to_owned()),
    );
    let reporter = Reporter {
        controller: "bootstrap-controller".to_owned(),
        instance: Some(settings.identity.clone()),
    };
    let manager = Manager {
        reporter,
        client,
        settings,
        health,
        metrics,
        directory,
        running: HashMap::new(),
        invalid: HashMap::new(),
        acked: None,
    };
    tokio::spawn(
        manager
            .run(ownership, cancel)
            .instrument(info_span!("tenants")),
    )
}

struct Manager {
    client: kube::Client,
    /// A fresh Recorder per event: kube's Recorder folds events with the same reason about the
    /// same object into one series that keeps the first note, which would hide a new reason.
    reporter: Reporter,
    settings: TenantSettings,
    health: Health,
    metrics: TenantMetrics,
    directory: Directory,
    running: HashMap<String, Running>,
    /// Secrets that could not start a runtime, with why; reported once per version.
    invalid: HashMap<String, (Spec, String)>,
    /// The last view acknowledged.
    acked: Option<u64>,
}

impl Manager {
    async fn run(mut self, ownership: Ownership, cancel: CancellationToken) {
        let Ownership { mut views, ack } = ownership;
        let api: Api<Secret> = match &self.settings.namespace {
            Some(namespace) => Api::namespaced(self.client.clone(), namespace),
            None => Api::all(self.client.clone()),
        };
        let config = watcher::Config::default().labels(&self.settings.selector);
        let mut events = watcher(api, config).default_backoff().boxed();
        // Only complete lists are acted on: a re-list builds the next set aside.
        let mut secrets: Option<BTreeMap<String, Spec>> = None;
        let mut relist: Option<BTreeMap<String, Spec>> = None;
        let mut last_error: Option<String> = None;
        let mut views_open = true;
        loop {
            tokio::select! {
                () = cancel.cancelled() => break,
                event = events.next() => {
                    let Some(event) = event else { break };
                    let key = self.settings.kubeconfig_key.clone();
                    match event {
                        Ok(watcher::Event::Init) => relist = Some(BTreeMap::new()),
                        Ok(watcher::Event::InitApply(secret)) => {
                            if let (Some(next), Some((name, spec))) =
                                (relist.as_mut(), Spec::of(&secret, &key))
                            {
                                next.insert(name, spec);
                            }
                        }
                        Ok(watcher::Event::InitDone) => {
                            if let Some(next) = relist.take() {
                                info!(tenants = next.len(), "tenant Secrets listed");
                                secrets = Some(next);
                            }
                            last_error = None;
                            self.health.set_check(READYZ_CHECK, CheckState::Passing(String::new()));
                        }
                        Ok(watcher::Event::Apply(secret)) => {
                            if let (Some(known), Some((name, spec))) =
                                (secrets.as_mut(), Spec::of(&secret, &key))
                            {
                                known.insert(name, spec);
                            }
                        }
                        Ok(watcher::Event::Delete(secret)) => {
                            if let (Some(known), Some((name, _))) =
                                (secrets.as_mut(), Spec::of(&secret, &key))
                            {
                                known.remove(&name);
                            }
                        }
                        Err(err) => {
                            let message = err.to_string();
                            if last_error.as_deref() != Some(message.as_str()) {
                                warn!(error = %message, "cannot watch the tenant Secrets; retrying (running tenants go on)");
                            }
                            self.health.set_check(
                                READYZ_CHECK,
                                CheckState::Failing(format!("cannot watch the tenant Secrets: {message}")),
                            );
                            last_error = Some(message);
                        }
                    }
                }
                changed = views.changed(), if views_open => {
                    if changed.is_err() {
                        views_open = false;
                    }
                }
            }
            if let Some(secrets) = &secrets {
                let view = views.borrow().clone();
                self.sync(secrets, &view, ack.as_ref()).await;
            }
        }
        let all: Vec<String> = self.running.keys().cloned().collect();
        self.stop(all, "shutdown").await;
        self.directory.replace(BTreeMap::new());
    }

    /// Makes the running tenants those this replica owns: stops the ones deleted, changed or
    /// owned elsewhere now, acknowledges the view, then (once the view is settled) starts the
    /// ones it owns that are not running.
    async fn sync(
        &mut self,
        secrets: &BTreeMap<String, Spec>,
        view: &View,
        ack: &(dyn Fn(u64) + Send + Sync),
    ) {
        let mut deleted = Vec::new();
        let mut changed = Vec::new();
        let mut moved = Vec::new();
        for (key, running) in &self.running {
            match secrets.get(key) {
                None => deleted.push(key.clone()),
                Some(spec) if *spec != running.spec => changed.push(key.clone()),
                Some(_) if !view.owns(key) => moved.push(key.clone()),
                Some(_) => {}
            }
        }
        self.stop(deleted, "deleted").await;
        self.stop(changed, "changed").await;
        self.stop(moved, "moved").await;
        if self.acked != Some(view.id) {
            ack(view.id);
            self.acked = Some(view.id);
        }
        self.invalid
            .retain(|key, (spec, _)| secrets.get(key) == Some(spec));

        let mut entries = BTreeMap::new();
        for (key, spec) in secrets {
            if let Some(running) = self.running.get(key) {
                entries.insert(
                    key.clone(),
                    Entry::Running {
                        health: running.health.clone(),
                        registry: running.registry.clone(),
                    },
                );
                continue;
            }
            if !view.owns(key) {
                let owner = view.owner(key).unwrap_or("none").to_owned();
                entries.insert(key.clone(), Entry::Elsewhere(owner));
                continue;
            }
            if let Some((_, reason)) = self.invalid.get(key) {
                entries.insert(key.clone(), Entry::Invalid(reason.clone()));
                continue;
            }
            if !view.settled {
                entries.insert(key.clone(), Entry::Waiting);
                continue;
            }
            match self.start(key, spec).await {
                Ok(running) => {
                    entries.insert(
                        key.clone(),
                        Entry::Running {
                            health: running.health.clone(),
                            registry: running.registry.clone(),
                        },
                    );
                    self.running.insert(key.clone(), running);
                }
                Err(reason) => {
                    warn!(tenant = %key, "{reason}");
                    self.metrics.config_errors.inc();
                    self.report_invalid(spec, &reason).await;
                    entries.insert(key.clone(), Entry::Invalid(reason.clone()));
                    self.invalid.insert(key.clone(), (spec.clone(), reason));
                }
            }
        }
        self.metrics
            .replicas
            .set(i64::try_from(view.members.len()).unwrap_or(i64::MAX));
        self.metrics.fenced.set(i64::from(view.fenced));
        let mut counts: BTreeMap<&str, i64> = BTreeMap::new();
        for entry in entries.values() {
            *counts.entry(entry.state()).or_default() += 1;
        }
        for state in ["running", "invalid", "waiting", "elsewhere"] {
            self.metrics
                .tenants
                .get_or_create(&StateLabels { state })
                .set(counts.get(state).copied().unwrap_or(0));
        }
        self.directory.replace(entries);
    }

    /// Builds and starts one tenant's runtime. Nothing here reaches the tenant's API, so a
    /// tenant that is down costs no time here; its loops retry on their own.
    async fn start(&self, key: &str, spec: &Spec) -> Result<Running, String> {
        let config = self
            .settings
            .base
            .tenant(spec.fragment.as_deref())
            .map_err(|errors| format!("configuration: {errors}"))?;
        let source = format!("Secret {key} key {:?}", self.settings.kubeconfig_key);
        let bytes = spec.kubeconfig.as_ref().ok_or_else(|| {
            format!(
                "{source} is missing (the kubeconfig must be under that data key; set \
                 --tenants-kubeconfig-key for another)"
            )
        })?;
        let text = std::str::from_utf8(bytes)
            .map_err(|_| format!("{source} is not text (a kubeconfig is YAML)"))?;
        let kube_config = crate::kubeconfig::from_text(text, &source).await?;
        let client = kube::Client::try_from(kube_config.clone())
            .map_err(|err| format!("{source}: cannot build a client: {err}"))?;
        let mut registry = Registry::with_prefix_and_labels(
            METRICS_PREFIX,
            [(
                std::borrow::Cow::Borrowed("tenant"),
                std::borrow::Cow::Owned(key.to_owned()),
            )]
            .into_iter(),
        );
        let load_kubeconfig: reconcilers::apiserver_endpoints::ConfigLoader = {
            let kube_config = kube_config.clone();
            Arc::new(move || {
                let kube_config = kube_config.clone();
                Box::pin(async move { Ok(kube_config) })
            })
        };
        let runner = crate::loops::build_runner(&config, &client, load_kubeconfig, &mut registry);
        let health = runner.health();
        let cancel = CancellationToken::new();
        let (leading, leadership) = watch::channel(true);
        let task = tokio::spawn(
            runner
                .run(leadership, cancel.clone())
                .instrument(info_span!("tenant", tenant = %key)),
        );
        info!(tenant = %key, server = %kube_config.cluster_url, "tenant started");
        self.metrics.starts.inc();
        Ok(Running {
            spec: spec.clone(),
            leading,
            cancel,
            task,
            health,
            registry: Arc::new(registry),
        })
    }

    /// Stops tenants and waits until each runtime has ended: running passes are abandoned (their
    /// leadership taken away) rather than awaited, so a stop is quick even when a tenant's API
    /// hangs, and only then may another replica start them.
    async fn stop(&mut self, keys: Vec<String>, reason: &'static str) {
        if keys.is_empty() {
            return;
        }
        let started = Instant::now();
        let mut stopping = Vec::with_capacity(keys.len());
        for key in &keys {
            if let Some(running) = self.running.remove(key) {
                let _ = running.leading.send(false);
                running.cancel.cancel();
                stopping.push(running.task);
            }
        }
        let count = stopping.len();
        for joined in futures::future::join_all(stopping).await {
            if let Err(err) = joined {
                warn!(error = %err, "a tenant runtime ended abnormally");
            }
        }
        self.metrics
            .stops
            .get_or_create(&ReasonLabels { reason })
            .inc_by(u64::try_from(count).unwrap_or(u64::MAX));
        info!(tenants = ?keys, reason, took = ?started.elapsed(), "tenants stopped");
    }

    /// A Warning event on the Secret, once per version of it (the caller remembers it).
    async fn report_invalid(&self, spec: &Spec, reason: &str) {
        let mut secret = Secret::default();
        secret.metadata.namespace = Some(spec.namespace.clone());
        secret.metadata.name = Some(spec.name.clone());
        secret.metadata.uid = Some(spec.uid.clone()).filter(|uid| !uid.is_empty());
        let reference = secret.object_ref(&());
        let event = Event {
            type_: EventType::Warning,
            reason: "TenantConfigInvalid".to_owned(),
            note: Some(truncate(reason, 1000)),
            action: "StartTenant".to_owned(),
            secondary: None,
        };
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(err) = recorder.publish(&event, &reference).await {
            debug!(error = %err, "cannot publish the TenantConfigInvalid event");
        }
    }
}

/// Event notes are limited to 1 KiB by the API.
fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max.saturating_sub(3);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

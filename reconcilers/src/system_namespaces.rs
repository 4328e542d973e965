//! Loop: system namespaces.
//!
//! Upstream (`pkg/controlplane/controller/systemnamespaces`) creates a fixed list of namespaces
//! once a minute and never does anything else. We keep its semantics (create when missing,
//! `AlreadyExists` is success, a `Terminating` namespace counts as present, never delete or rename)
//! but also wake on the namespace watch, so a deleted namespace is back as soon as it is gone,
//! and we let operators declare extra namespaces with labels and annotations.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

use crate::contract::{
    Action, Drift, LoopError, PassContext, PassReport, Reconciler, Trigger, drift,
    ignore_already_exists,
};

use crate::metrics::{loop_registry, registered};
use crate::names::{validate_dns1123_label, validate_label_value, validate_qualified_name};
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval,
};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "system-namespaces";

/// Upstream's interval (`wait.UntilWithContext(ctx, sync, 1*time.Minute)`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

/// A namespace terminating this long is stuck (kube-apiserver's namespace controller empties one
/// in seconds): reported, since nothing here may touch it.
const STUCK_TERMINATING: std::time::Duration = std::time::Duration::from_secs(300);

/// How long a pass waits for the namespace cache's first list before giving up and retrying.
const CACHE_SYNC_TIMEOUT: Duration = Duration::from_secs(10);

const FIELD_MANAGER: &str = "bootstrap-controller";

/// The namespaces kube-apiserver ensures, in its order.
pub const UPSTREAM_NAMESPACES: [&str; 4] =
    ["kube-system", "kube-public", "kube-node-lease", "default"];

/// One declared namespace. Declared labels and annotations are kept at their declared values;
/// keys nobody declared are left alone.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct NamespaceSpec {
    pub name: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

impl NamespaceSpec {
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ..Self::default()
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub namespaces: Vec<NamespaceSpec>,
    pub interval: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            namespaces: UPSTREAM_NAMESPACES
                .iter()
                .map(|name| NamespaceSpec::named(*name))
                .collect(),
            interval: DEFAULT_INTERVAL,
        }
    }
}

/// `loops.systemNamespaces`: which namespaces must exist, how often to check besides the watch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
    pub namespaces: Vec<NamespaceSpec>,
}

impl Default for Section {
    fn default() -> Self {
        let Config {
            namespaces,
            interval,
        } = Config::default();
        Section {
            enabled: true,
            interval,
            namespaces,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<ConfigError>) {
        validate_interval(path, self.interval, errors);
        let mut seen = std::collections::BTreeSet::new();
        for (index, namespace) in self.namespaces.iter().enumerate() {
            let field = format!("{path}.namespaces[{index}]");
            if let Err(why) = validate_dns1123_label(&namespace.name) {
                errors.push(ConfigError::new(
                    format!("{field}.name"),
                    format!(
                        "{:?} is not a valid namespace name: {why} (expected a DNS-1123 label \
                         such as kube-system)",
                        namespace.name
                    ),
                ));
            } else if !seen.insert(namespace.name.as_str()) {
                errors.push(ConfigError::new(
                    format!("{field}.name"),
                    format!(
                        "{:?} is listed twice (list each namespace once and merge its labels \
                         and annotations)",
                        namespace.name
                    ),
                ));
            }
            for key in namespace.labels.keys() {
                if let Err(why) = validate_qualified_name(key) {
                    errors.push(ConfigError::new(
                        format!("{field}.labels"),
                        format!(
                            "key {key:?} is not a valid label key: {why} (expected e.g. \
                             example.com/team or team)"
                        ),
                    ));
                }
            }
            for (key, value) in &namespace.labels {
                if let Err(why) = validate_label_value(value) {
                    errors.push(ConfigError::new(
                        format!("{field}.labels.{key}"),
                        format!("{value:?} is not a valid label value: {why}"),
                    ));
                }
            }
            for key in namespace.annotations.keys() {
                if let Err(why) = validate_qualified_name(key) {
                    errors.push(ConfigError::new(
                        format!("{field}.annotations"),
                        format!(
                            "key {key:?} is not a valid annotation key: {why} (expected e.g. \
                             example.com/owner)"
                        ),
                    ));
                }
            }
        }
    }

    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        let config = Config {
            namespaces: self.namespaces.clone(),
            interval: self.interval,
        };
        Ok(vec![Arc::new(SystemNamespaces::new(
            context.client.clone(),
            config,
            context.registry,
        ))])
    }
}

/// What one declared namespace needs, judged from the cache alone (pure, so it is unit-tested).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceNeed {
    Nothing,
    /// Present but being deleted: upstream counts it as present; it is recreated once gone.
    Terminating {
        since: Option<jiff::Timestamp>,
        /// What it waits for: `metadata.finalizers` and `spec.finalizers`.
        finalizers: Vec<String>,
    },
    Create,
    /// Declared labels/annotations missing or different: these are the keys to set.
    SetMetadata {
        labels: BTreeMap<String, String>,
        annotations: BTreeMap<String, String>,
    },
}

pub fn assess(spec: &NamespaceSpec, existing: Option<&Namespace>) -> NamespaceNeed {
    let Some(existing) = existing else {
        return NamespaceNeed::Create;
    };
    if let Some(since) = &existing.metadata.deletion_timestamp {
        let finalizers = existing
            .metadata
            .finalizers
            .iter()
            .flatten()
            .chain(
                existing
                    .spec
                    .as_ref()
                    .and_then(|spec| spec.finalizers.as_ref())
                    .into_iter()
                    .flatten(),
            )
            .cloned()
            .collect();
        return NamespaceNeed::Terminating {
            since: Some(since.0),
            finalizers,
        };
    }
    let labels = missing_entries(&spec.labels, existing.metadata.labels.as_ref());
    let annotations = missing_entries(&spec.annotations, existing.metadata.annotations.as_ref());
    if labels.is_empty() && annotations.is_empty() {
        NamespaceNeed::Nothing
    } else {
        NamespaceNeed::SetMetadata {
            labels,
            annotations,
        }
    }
}

fn missing_entries(
    declared: &BTreeMap<String, String>,
    actual: Option<&BTreeMap<String, String>>,
) -> BTreeMap<String, String> {
    declared
        .iter()
        .filter(|(key, value)| actual.and_then(|actual| actual.get(*key)) != Some(*value))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect()
}

fn desired_namespace(spec: &NamespaceSpec) -> Namespace {
    let non_empty = |map: &BTreeMap<String, String>| (!map.is_empty()).then(|| map.clone());
    Namespace {
        metadata: ObjectMeta {
            name: Some(spec.name.clone()),
            labels: non_empty(&spec.labels),
            annotations: non_empty(&spec.annotations),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

pub struct SystemNamespaces {
    config: Config,
    api: Api<Namespace>,
    store: Store<Namespace>,
    /// Taken by the runner's single call to `triggers()`; the reflector inside feeds `store`.
    trigger: std::sync::Mutex<Option<Trigger>>,
    missing: Gauge,
    /// Namespaces reported stuck terminating: warned about once when each gets stuck.
    stuck: crate::findings::ReportOnce<String>,
}

impl SystemNamespaces {
    pub fn new(client: Client, config: Config, registry: &mut Registry) -> Self {
        let api: Api<Namespace> = Api::all(client);
        let (store, writer) = reflector::store();
        let trigger = reflector::reflector(
            writer,
            watcher(api.clone(), watcher::Config::default()).default_backoff(),
        )
        .filter_map({
            let mut failure = crate::findings::RepeatedFailure::default();
            move |event| {
                let woken = match event {
                    Ok(event) => {
                        // Init starts every attempt to list, the failing ones too.
                        if !matches!(event, watcher::Event::Init) {
                            failure.succeeded();
                        }
                        Some(())
                    }
                    Err(err) if failure.is_new(&err) => {
                        tracing::warn!(error = %err, "namespace watch failed; retrying with backoff (the same failure again is logged at debug level)");
                        None
                    }
                    Err(err) => {
                        tracing::debug!(error = %err, "namespace watch failed again");
                        None
                    }
                };
                futures::future::ready(woken)
            }
        })
        .boxed();

        let missing = registered(
            loop_registry(registry, NAME),
            "missing",
            "Declared system namespaces absent at the end of the last pass (dry-run: before it)",
            Gauge::default(),
        );
        Self {
            config,
            api,
            store,
            trigger: std::sync::Mutex::new(Some(trigger)),
            missing,
            stuck: crate::findings::ReportOnce::new(),
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        tokio::time::timeout(CACHE_SYNC_TIMEOUT, self.store.wait_until_ready())
            .await
            .map_err(|_| LoopError::NotSynced("namespace cache has not listed yet".into()))?
            .map_err(|_| LoopError::NotSynced("namespace watch stopped".into()))?;

        let mut report = PassReport::default();
        let mut first_error = None;
        let mut still_missing = 0;
        for spec in &self.config.namespaces {
            let existing = self.store.get(&ObjectRef::new(&spec.name));
            let need = assess(spec, existing.as_deref());
            match self.apply(ctx, spec, need).await {
                Ok(Some(found)) => {
                    if found.action == Action::Create && !found.applied {
                        still_missing += 1;
                    }
                    report.push(found);
                }
                Ok(None) => {}
                Err(err) => {
                    still_missing += usize::from(existing.is_none());
                    tracing::error!(namespace = %spec.name, error = %err,
                        "unable to reconcile required system namespace");
                    first_error.get_or_insert(err);
                }
            }
        }
        self.missing
            .set(i64::try_from(still_missing).unwrap_or(i64::MAX));
        let stuck = report
            .drift
            .iter()
            .filter(|found| found.kind == "namespace_stuck_terminating");
        let messages: std::collections::BTreeMap<&str, &str> = stuck
            .map(|found| (found.object.as_str(), found.message.as_str()))
            .collect();
        for object in self
            .stuck
            .update(messages.keys().map(|object| (*object).to_owned()))
        {
            tracing::warn!(%object, "{}", messages.get(object.as_str()).copied().unwrap_or_default());
        }
        match first_error {
            // Every namespace was tried; the runner retries the pass with backoff.
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(report),
        }
    }

    async fn apply(
        &self,
        ctx: &PassContext,
        spec: &NamespaceSpec,
        need: NamespaceNeed,
    ) -> Result<Option<Drift>, kube::Error> {
        let object = format!("Namespace/{}", spec.name);
        match need {
            NamespaceNeed::Nothing => Ok(None),
            NamespaceNeed::Terminating { since, finalizers } => {
                let stuck_for = since
                    .and_then(|since| {
                        std::time::Duration::try_from(jiff::Timestamp::now() - since).ok()
                    })
                    .filter(|age| *age >= STUCK_TERMINATING);
                let Some(stuck_for) = stuck_for else {
                    tracing::debug!(namespace = %spec.name, "namespace is terminating; will recreate once it is gone");
                    return Ok(None);
                };
                Ok(Some(drift(
                    "namespace_stuck_terminating",
                    object,
                    Action::Report,
                    format!(
                        "required system namespace {} has been terminating for {}s, waiting for finalizers [{}]; it is left alone and recreated once it is gone (remove what holds it, or its finalizer)",
                        spec.name,
                        stuck_for.as_secs(),
                        finalizers.join(", ")
                    ),
                    false,
                )))
            }
            NamespaceNeed::Create => {
                if !ctx.dry_run {
                    let created = ignore_already_exists(
                        self.api
                            .create(&PostParams::default(), &desired_namespace(spec))
                            .await,
                    )?;
                    if created.is_some() {
                        tracing::info!(namespace = %spec.name, "created missing system namespace");
                    }
                }
                Ok(Some(drift(
                    "namespace_missing",
                    object,
                    Action::Create,
                    format!("required system namespace {} does not exist", spec.name),
                    !ctx.dry_run,
                )))
            }
            NamespaceNeed::SetMetadata {
                labels,
                annotations,
            } => {
                let keys: Vec<&str> = labels
                    .keys()
                    .map(|k| k.as_str())
                    .chain(annotations.keys().map(|k| k.as_str()))
                    .collect();
                let message = format!(
                    "declared labels/annotations missing or different: {}",
                    keys.join(", ")
                );
                if !ctx.dry_run {
                    // A merge patch touches only the declared keys, leaving everyone else's alone.
                    let patch = serde_json::json!({
                        "metadata": { "labels": labels, "annotations": annotations }
                    });
                    self.api
                        .patch(
                            &spec.name,
                            &PatchParams {
                                field_manager: Some(FIELD_MANAGER.into()),
                                ..PatchParams::default()
                            },
                            &Patch::Merge(&patch),
                        )
                        .await?;
                    tracing::info!(namespace = %spec.name, keys = %keys.join(","), "restored declared namespace metadata");
                }
                Ok(Some(drift(
                    "namespace_metadata",
                    object,
                    Action::Update,
                    message,
                    !ctx.dry_run,
                )))
            }
        }
    }
}

impl Reconciler for SystemNamespaces {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.config.interval
    }

    fn triggers(&self) -> Vec<Trigger> {
        match self.trigger.lock() {
            Ok(mut slot) => slot.take().into_iter().collect(),
            Err(poisoned) => poisoned.into_inner().take().into_iter().collect(),
        }
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    fn namespace(name: &str, labels: &[(&str, &str)]) -> Namespace {
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(
                    labels
                        .iter()
                        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        }
    }

    fn spec_with_label(name: &str, key: &str, value: &str) -> NamespaceSpec {
        NamespaceSpec {
            name: name.into(),
            labels: BTreeMap::from([(key.into(), value.into())]),
            annotations: BTreeMap::new(),
        }
    }

    #[test]
    fn default_list_is_upstreams() {
        let names: Vec<_> = Config::default()
            .namespaces
            .into_iter()
            .map(|spec| spec.name)
            .collect();
        assert_eq!(
            names,
            ["kube-system", "kube-public", "kube-node-lease", "default"]
        );
        assert_eq!(Config::default().interval, Duration::from_secs(60));
    }

    #[test]
    fn missing_namespace_is_created() {
        assert_eq!(
            assess(&NamespaceSpec::named("kube-public"), None),
            NamespaceNeed::Create
        );
    }

    #[test]
    fn present_namespace_needs_nothing() {
        let existing = namespace(
            "kube-public",
            &[("kubernetes.io/metadata.name", "kube-public")],
        );
        assert_eq!(
            assess(&NamespaceSpec::named("kube-public"), Some(&existing)),
            NamespaceNeed::Nothing
        );
    }

    #[test]
    fn terminating_namespace_counts_as_present() {
        let mut existing = namespace("kube-public", &[]);
        existing.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        let spec = spec_with_label("kube-public", "team", "platform");
        existing.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        assert_eq!(
            assess(&spec, Some(&existing)),
            NamespaceNeed::Terminating {
                since: Some(jiff::Timestamp::UNIX_EPOCH),
                finalizers: vec!["example.com/hold".into()],
            }
        );
    }

    #[test]
    fn only_missing_or_different_declared_keys_are_set() {
        let spec = NamespaceSpec {
            name: "tenants".into(),
            labels: BTreeMap::from([
                ("team".into(), "platform".into()),
                ("tier".into(), "system".into()),
                ("kept".into(), "same".into()),
            ]),
            annotations: BTreeMap::from([("owner".into(), "ops".into())]),
        };
        let existing = namespace(
            "tenants",
            &[("tier", "user"), ("kept", "same"), ("other", "x")],
        );
        assert_eq!(
            assess(&spec, Some(&existing)),
            NamespaceNeed::SetMetadata {
                labels: BTreeMap::from([
                    ("team".into(), "platform".into()),
                    ("tier".into(), "system".into()),
                ]),
                annotations: BTreeMap::from([("owner".into(), "ops".into())]),
            }
        );
    }

    #[test]
    fn desired_namespace_carries_declared_metadata_only() {
        let spec = spec_with_label("tenants", "team", "platform");
        let ns = desired_namespace(&spec);
        assert_eq!(ns.metadata.name.as_deref(), Some("tenants"));
        assert_eq!(ns.metadata.labels, Some(spec.labels.clone()));
        assert_eq!(ns.metadata.annotations, None);
    }
}

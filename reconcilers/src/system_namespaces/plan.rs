//! What each declared namespace needs, judged from the namespace cache and the time the pass
//! gives: no I/O.
//!
//! | the namespace | the need |
//! | --- | --- |
//! | absent | [`NamespaceNeed::Create`] it with its declared labels and annotations |
//! | being deleted | [`NamespaceNeed::Terminating`]: left alone (upstream counts it as present), recreated once gone |
//! | being deleted for [`STUCK_TERMINATING`] or longer | [`NamespaceNeed::StuckTerminating`]: left alone too, and reported |
//! | a declared label or annotation missing or different | [`NamespaceNeed::SetMetadata`]: a merge patch of those keys only |
//! | as declared (other keys are not ours) | [`NamespaceNeed::Nothing`] |

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::ObjectMeta;

use super::section::NamespaceSpec;

/// A namespace terminating this long is stuck (kube-apiserver's namespace controller empties one
/// in seconds): reported, since nothing here may touch it.
pub const STUCK_TERMINATING: Duration = Duration::from_secs(300);

/// What one declared namespace needs (pure, so it is unit-tested).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NamespaceNeed {
    Nothing,
    /// Present but being deleted: upstream counts it as present; it is recreated once gone.
    Terminating,
    /// Being deleted for [`STUCK_TERMINATING`] or longer: left alone, and reported.
    StuckTerminating {
        /// Its `deletionTimestamp`: what it is reported with, the same every pass.
        since: jiff::Timestamp,
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

pub fn assess(
    spec: &NamespaceSpec,
    existing: Option<&Namespace>,
    now: jiff::Timestamp,
) -> NamespaceNeed {
    let Some(existing) = existing else {
        return NamespaceNeed::Create;
    };
    if let Some(since) = &existing.metadata.deletion_timestamp {
        let stuck = Duration::try_from(now - since.0).is_ok_and(|age| age >= STUCK_TERMINATING);
        if !stuck {
            return NamespaceNeed::Terminating;
        }
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
        return NamespaceNeed::StuckTerminating {
            since: since.0,
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

impl NamespaceNeed {
    /// What a stuck namespace is reported with, in the log and the pass's report: the same
    /// every pass while nothing changes, so it is reported once.
    pub fn stuck_note(&self, name: &str) -> Option<String> {
        let NamespaceNeed::StuckTerminating { since, finalizers } = self else {
            return None;
        };
        Some(format!(
            "required system namespace {name} has been terminating since {since}, waiting for \
             finalizers [{}]; it is left alone and recreated once it is gone (remove what holds \
             it, or its finalizer)",
            finalizers.join(", ")
        ))
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

pub fn desired_namespace(spec: &NamespaceSpec) -> Namespace {
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
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
    fn missing_namespace_is_created() {
        assert_eq!(
            assess(&NamespaceSpec::named("kube-public"), None, now()),
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
            assess(&NamespaceSpec::named("kube-public"), Some(&existing), now()),
            NamespaceNeed::Nothing
        );
    }

    fn now() -> jiff::Timestamp {
        jiff::Timestamp::from_second(1_800_000_000).unwrap()
    }

    #[test]
    fn terminating_namespace_counts_as_present_and_is_stuck_in_the_same_words_later() {
        let mut existing = namespace("kube-public", &[]);
        let spec = spec_with_label("kube-public", "team", "platform");
        existing.metadata.finalizers = Some(vec!["example.com/hold".into()]);
        let since = |ago: u64| Some(Time(now() - Duration::from_secs(ago)));
        existing.metadata.deletion_timestamp = since(299);
        assert_eq!(
            assess(&spec, Some(&existing), now()),
            NamespaceNeed::Terminating
        );
        existing.metadata.deletion_timestamp = since(300);
        let stuck = assess(&spec, Some(&existing), now());
        assert_eq!(
            stuck,
            NamespaceNeed::StuckTerminating {
                since: now() - STUCK_TERMINATING,
                finalizers: vec!["example.com/hold".into()],
            }
        );
        // A pass a minute later reports it in the same words: the runner reports it once.
        let later = assess(&spec, Some(&existing), now() + Duration::from_secs(60));
        assert_eq!(
            later.stuck_note("kube-public"),
            stuck.stuck_note("kube-public")
        );
        assert!(
            stuck.stuck_note("kube-public").unwrap().contains(
                "terminating since 2027-01-15T07:55:00Z, waiting for finalizers [example.com/hold]"
            ),
            "{stuck:?}"
        );
        // A deletion time ahead of this clock is not stuck.
        existing.metadata.deletion_timestamp = Some(Time(now() + Duration::from_secs(600)));
        assert_eq!(
            assess(&spec, Some(&existing), now()),
            NamespaceNeed::Terminating
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
            assess(&spec, Some(&existing), now()),
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

//! What each declared namespace needs, judged from the namespace cache alone: no I/O, no clock.
//!
//! | the namespace | the need |
//! | --- | --- |
//! | absent | [`NamespaceNeed::Create`] it with its declared labels and annotations |
//! | being deleted | [`NamespaceNeed::Terminating`]: left alone (upstream counts it as present), recreated once gone; reported if stuck |
//! | a declared label or annotation missing or different | [`NamespaceNeed::SetMetadata`]: a merge patch of those keys only |
//! | as declared (other keys are not ours) | [`NamespaceNeed::Nothing`] |

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::ObjectMeta;

use super::section::NamespaceSpec;

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

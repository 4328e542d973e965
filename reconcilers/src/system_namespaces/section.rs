//! `loops.systemNamespaces`: the section of the configuration file (the namespaces to keep, each
//! with the labels and annotations it must carry), which is also the loop's configuration.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::SystemNamespacesLoop;
use crate::contract::Reconciler;
use crate::names::{validate_dns1123_label, validate_label_value, validate_qualified_name};
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval,
};

/// Upstream's interval (`wait.UntilWithContext(ctx, sync, 1*time.Minute)`).
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(60);

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

/// `loops.systemNamespaces`: which namespaces must exist, how often to check besides the watch.
/// The loop's one configuration type: the loop is built from the section itself.
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
        Section {
            enabled: true,
            interval: DEFAULT_INTERVAL,
            namespaces: UPSTREAM_NAMESPACES
                .iter()
                .map(|name| NamespaceSpec::named(*name))
                .collect(),
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
            validate_metadata(&field, namespace, errors);
        }
    }

    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        Ok(vec![Arc::new(SystemNamespacesLoop::new(
            context.client.clone(),
            self.clone(),
            &context.budget,
            context.settings.reporter(),
            context.registry,
        ))])
    }
}

/// The label kube-apiserver sets on every namespace, to the namespace's name.
const METADATA_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// The most bytes of annotations (keys and values) kube-apiserver takes on one object
/// (`TotalAnnotationSizeLimitB`).
const ANNOTATIONS_LIMIT_BYTES: usize = 256 * 1024;

/// The declared labels and annotations of the namespace at `field`.
fn validate_metadata(field: &str, namespace: &NamespaceSpec, errors: &mut Vec<ConfigError>) {
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
    // Any other value would be reset by kube-apiserver and set again by every pass.
    if let Some(value) = namespace.labels.get(METADATA_NAME_LABEL)
        && *value != namespace.name
    {
        errors.push(ConfigError::new(
            format!("{field}.labels.{METADATA_NAME_LABEL}"),
            format!(
                "{value:?} is not the namespace's name {:?}: kube-apiserver always sets it to \
                 the namespace's name; remove it",
                namespace.name
            ),
        ));
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
    let size: usize = namespace
        .annotations
        .iter()
        .map(|(key, value)| key.len() + value.len())
        .sum();
    if size > ANNOTATIONS_LIMIT_BYTES {
        errors.push(ConfigError::new(
            format!("{field}.annotations"),
            format!(
                "the annotations take {size} bytes (keys and values), more than the \
                 {ANNOTATIONS_LIMIT_BYTES} kube-apiserver takes on one object; declare fewer \
                 or shorter annotations"
            ),
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_list_is_upstreams() {
        let names: Vec<_> = Section::default()
            .namespaces
            .into_iter()
            .map(|spec| spec.name)
            .collect();
        assert_eq!(
            names,
            ["kube-system", "kube-public", "kube-node-lease", "default"]
        );
        assert_eq!(Section::default().interval, Duration::from_secs(60));
    }

    /// The errors of validating `namespaces` as the section's list.
    fn errors_of(namespaces: Vec<NamespaceSpec>) -> Vec<ConfigError> {
        let section = Section {
            namespaces,
            ..Section::default()
        };
        let mut errors = Vec::new();
        section.validate(
            "loops.systemNamespaces",
            &crate::section::test_settings(),
            &mut errors,
        );
        errors
    }

    #[test]
    fn the_metadata_name_label_may_only_be_the_namespaces_name() {
        let with_label = |name: &str, value: &str| NamespaceSpec {
            labels: BTreeMap::from([(METADATA_NAME_LABEL.into(), value.into())]),
            ..NamespaceSpec::named(name)
        };
        assert_eq!(errors_of(vec![with_label("tenants", "tenants")]), []);
        let errors = errors_of(vec![
            NamespaceSpec::named("kube-system"),
            with_label("tenants", "other"),
        ]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].field,
            "loops.systemNamespaces.namespaces[1].labels.kubernetes.io/metadata.name"
        );
        assert!(
            errors[0]
                .message
                .contains("kube-apiserver always sets it to the namespace's name; remove it"),
            "{}",
            errors[0].message
        );
    }

    #[test]
    fn annotations_over_kube_apiservers_limit_are_refused() {
        let annotated = |values: &[usize]| NamespaceSpec {
            annotations: values
                .iter()
                .enumerate()
                .map(|(at, len)| (format!("a{at}"), "x".repeat(*len)))
                .collect(),
            ..NamespaceSpec::named("tenants")
        };
        // Two keys of 2 bytes: at the limit, then a byte over it.
        let at_limit = ANNOTATIONS_LIMIT_BYTES - 4;
        assert_eq!(
            errors_of(vec![annotated(&[at_limit / 2, at_limit / 2])]),
            []
        );
        let errors = errors_of(vec![annotated(&[at_limit / 2, at_limit / 2 + 1])]);
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(
            errors[0].field,
            "loops.systemNamespaces.namespaces[0].annotations"
        );
        assert!(
            errors[0].message.contains("262145 bytes"),
            "{}",
            errors[0].message
        );
    }
}

//! The writes of a namespace's need, each made unless the pass is a dry run, and the drift each
//! is reported as. Namespaces are created and patched, never deleted or renamed.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::Resource;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;

use super::SystemNamespacesLoop;
use super::plan::{NamespaceNeed, desired_namespace};
use super::section::NamespaceSpec;
use crate::contract::{Action, Drift, PassContext, drift, ignore_already_exists};

const FIELD_MANAGER: &str = "bootstrap-controller";

impl SystemNamespacesLoop {
    pub(super) async fn apply(
        &self,
        ctx: &PassContext,
        spec: &NamespaceSpec,
        need: NamespaceNeed,
    ) -> Result<Option<Drift>, kube::Error> {
        let object = format!("Namespace/{}", spec.name);
        match need {
            NamespaceNeed::Nothing => Ok(None),
            NamespaceNeed::Terminating => {
                tracing::debug!(namespace = %spec.name, "namespace is terminating; will recreate once it is gone");
                Ok(None)
            }
            NamespaceNeed::StuckTerminating { .. } => Ok(Some(drift(
                "namespace_stuck_terminating",
                object,
                Action::Report,
                need.stuck_note(&spec.name).unwrap_or_default(),
                false,
            ))),
            NamespaceNeed::Create => {
                if !ctx.dry_run {
                    let created = ignore_already_exists(
                        self.api
                            .create(&PostParams::default(), &desired_namespace(spec))
                            .await,
                    )?;
                    // Created meanwhile (the read lagged): nothing was repaired, and the next
                    // pass reads it.
                    let Some(created) = created else {
                        return Ok(None);
                    };
                    self.publish(
                        &created,
                        "SystemNamespaceCreated",
                        "Create",
                        format!("created missing system namespace {}", spec.name),
                    )
                    .await;
                }
                Ok(Some(
                    drift(
                        "namespace_missing",
                        object,
                        Action::Create,
                        format!("required system namespace {} does not exist", spec.name),
                        !ctx.dry_run,
                    )
                    .changed("absent", "created"),
                ))
            }
            NamespaceNeed::SetMetadata {
                labels,
                annotations,
            } => {
                self.set_metadata(ctx, spec, object, labels, annotations)
                    .await
            }
        }
    }

    /// Merge-patches the declared labels and annotations that are missing or different.
    async fn set_metadata(
        &self,
        ctx: &PassContext,
        spec: &NamespaceSpec,
        object: String,
        labels: BTreeMap<String, String>,
        annotations: BTreeMap<String, String>,
    ) -> Result<Option<Drift>, kube::Error> {
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
            let patched = self
                .api
                .patch(
                    &spec.name,
                    &PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    },
                    &Patch::Merge(&patch),
                )
                .await?;
            self.publish(
                &patched,
                "SystemNamespaceMetadataRestored",
                "Update",
                format!("restored declared labels/annotations: {}", keys.join(", ")),
            )
            .await;
        }
        let declared: Vec<String> = labels
            .iter()
            .chain(annotations.iter())
            .map(|(key, value)| format!("{key}={value}"))
            .collect();
        Ok(Some(
            drift(
                "namespace_metadata",
                object,
                Action::Update,
                message.clone(),
                !ctx.dry_run,
            )
            .changed(message, declared.join(", ")),
        ))
    }
}

impl SystemNamespacesLoop {
    /// An event on a repaired namespace (in `default`, where events about cluster-scoped objects
    /// go). A refused event is logged, never a failed pass: the namespace is repaired.
    async fn publish(&self, namespace: &Namespace, reason: &str, action: &str, note: String) {
        let reference = namespace.object_ref(&());
        let _ = crate::events::emit(
            &self.client,
            &self.reporter,
            &reference,
            EventType::Normal,
            reason,
            action,
            &note,
        )
        .await;
    }
}

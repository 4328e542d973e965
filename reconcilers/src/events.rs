//! Publishing an event, and the refusal that means it can never be written.
//!
//! An event lives in the namespace of the object it is about. kube-apiserver's
//! NamespaceLifecycle admission (`plugin/pkg/admission/namespace/lifecycle/admission.go`) refuses
//! every create in a namespace that is being deleted (403 "unable to create new content in
//! namespace X because it is being terminated", cause `NamespaceTerminating`) or that does not
//! exist (404 `namespaces "X" not found`). Neither passes: the namespace only goes on towards
//! its end, and its objects with it. Such an event is dropped with one line, never retried.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::core::Status;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{info, warn};

use crate::service_cache::record::ServiceRef;

/// Who this process's events say they come from: the controller, and this replica (its
/// `reportingController` is never one of kube-apiserver's own).
pub fn reporter(identity: &str) -> Reporter {
    Reporter {
        controller: "bootstrap-controller".to_owned(),
        instance: Some(identity.to_owned()),
    }
}

/// Publishes an event about `reference` whose note is `note` sanitized (it may carry text from
/// the cluster), through a Recorder made for it and dropped once it is published. A failure is
/// logged here and returned, for the callers whose finding must not count as reported without its
/// event; the others ignore it.
pub async fn emit(
    client: &Client,
    reporter: &Reporter,
    reference: &ObjectReference,
    type_: EventType,
    reason: &str,
    action: &str,
    note: &str,
) -> Result<(), kube::Error> {
    let recorder = Recorder::new(client.clone(), reporter.clone());
    emit_in(&recorder, reference, type_, reason, action, note).await
}

/// [`emit`] through `recorder`, which a repair keeps for its loop's life: kube's Recorder keeps
/// what it published (until a later publish, six minutes on), so a finding that clears and comes
/// back within that time is counted into its first event's series, as client-go's recorder
/// counts the repeats of upstream's repairs, rather than made a second Event.
pub async fn emit_in(
    recorder: &Recorder,
    reference: &ObjectReference,
    type_: EventType,
    reason: &str,
    action: &str,
    note: &str,
) -> Result<(), kube::Error> {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(crate::sanitize::sanitize(note).into()),
        action: action.to_owned(),
        secondary: None,
    };
    match recorder.publish(&event, reference).await {
        // An event whose namespace is being deleted or is gone is dropped: it counts as
        // published.
        Err(kube::Error::Api(status)) if namespace_is_ending(&status) => {
            info!(
                namespace = reference.namespace.as_deref().unwrap_or("default"),
                reason,
                object = reference.name.as_deref().unwrap_or(""),
                "event dropped: its namespace is being deleted or is gone ({})",
                status.message
            );
            Ok(())
        }
        other => other.inspect_err(|err| {
            warn!(
                reason,
                object = reference.name.as_deref().unwrap_or(""),
                error = %crate::sanitize::Sanitized::new(&err.to_string()),
                "cannot publish event"
            )
        }),
    }
}

/// A reference to `service` (with its uid when known), for its events.
pub fn service_reference(service: &ServiceRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".to_owned()),
        kind: Some("Service".to_owned()),
        namespace: Some(service.namespace.to_string()),
        name: Some(service.name.to_string()),
        uid: Some(service.uid.to_string()).filter(|uid| !uid.is_empty()),
        ..ObjectReference::default()
    }
}

/// Whether `status` is the API refusing a create because its namespace is being deleted or does
/// not exist (not a 404 about the object itself, such as an event series whose event expired).
pub fn namespace_is_ending(status: &Status) -> bool {
    let details = status.details.as_ref();
    match status.code {
        403 => {
            status.message.contains("because it is being terminated")
                || details.is_some_and(|details| {
                    details
                        .causes
                        .iter()
                        .any(|cause| cause.reason == "NamespaceTerminating")
                })
        }
        404 => {
            details.is_some_and(|details| details.kind == "namespaces" && details.group.is_empty())
        }
        _ => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn status(json: serde_json::Value) -> Status {
        serde_json::from_value(json).unwrap()
    }

    /// kube-apiserver's answers, as its NamespaceLifecycle admission writes them, and the
    /// refusals that look alike and are not about the namespace.
    #[test]
    fn only_a_namespace_being_deleted_or_gone_is_the_end() {
        let terminating = status(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403,
            "reason": "Forbidden",
            "message": "events.events.k8s.io \"web.1\" is forbidden: unable to create new content in namespace services-5151 because it is being terminated",
            "details": {"name": "web.1", "group": "events.k8s.io", "kind": "events",
                "causes": [{"reason": "NamespaceTerminating",
                    "message": "namespace services-5151 is being terminated",
                    "field": "metadata.namespace"}]},
        }));
        let gone = status(serde_json::json!({
            "kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404,
            "reason": "NotFound", "message": "namespaces \"services-5151\" not found",
            "details": {"name": "services-5151", "kind": "namespaces"},
        }));
        assert!(namespace_is_ending(&terminating));
        assert!(namespace_is_ending(&gone));
        let rbac = status(serde_json::json!({
            "code": 403, "reason": "Forbidden",
            "message": "events.events.k8s.io is forbidden: User \"x\" cannot create resource \"events\"",
            "details": {"group": "events.k8s.io", "kind": "events"},
        }));
        let event_gone = status(serde_json::json!({
            "code": 404, "reason": "NotFound", "message": "events.events.k8s.io \"web.1\" not found",
            "details": {"name": "web.1", "group": "events.k8s.io", "kind": "events"},
        }));
        let bare = status(
            serde_json::json!({"code": 404, "message": "the server could not find the requested resource"}),
        );
        for refusal in [rbac, event_gone, bare] {
            assert!(!namespace_is_ending(&refusal), "{refusal:?}");
        }
    }
}

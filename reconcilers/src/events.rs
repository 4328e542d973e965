//! Publishing an event, and the refusal that means it can never be written.
//!
//! An event lives in the namespace of the object it is about. kube-apiserver's
//! NamespaceLifecycle admission (`plugin/pkg/admission/namespace/lifecycle/admission.go`) refuses
//! every create in a namespace that is being deleted (403 "unable to create new content in
//! namespace X because it is being terminated", cause `NamespaceTerminating`) or that does not
//! exist (404 `namespaces "X" not found`). Neither passes: the namespace only goes on towards
//! its end, and its objects with it. Such an event is dropped with one line, never retried.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::core::Status;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::{debug, info, warn};

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
    publish(&recorder, reference, type_, reason, action, note)
        .await
        .inspect_err(|err| {
            let object = reference.name.as_deref().unwrap_or("");
            let error = crate::sanitize::Sanitized::new(&err.to_string());
            warn!(reason, object, %error, "cannot publish event");
        })
}

/// [`emit`] through `recorder`, which a repair keeps for its loop's life, so a finding that
/// clears and comes back is counted into its first event's series.
pub async fn emit_in(
    recorder: &SeriesRecorder,
    reference: &ObjectReference,
    type_: EventType,
    reason: &str,
    action: &str,
    note: &str,
) -> Result<(), kube::Error> {
    let kube_recorder = recorder.current(Instant::now());
    let result = publish(&kube_recorder, reference, type_, reason, action, note).await;
    // The callers retry a refused event on their next pass, for as long as the refusal lasts
    // (RBAC taken away, a webhook, a quota): the first failure after a success is warned about,
    // the rest of the streak logged at debug level.
    let first = {
        let mut kept = recorder.kept();
        let first = result.is_err() && !kept.failing;
        kept.failing = result.is_err();
        first
    };
    result.inspect_err(|err| cannot_publish(first, reason, reference, err))
}

/// Logs an event that could not be published: at warn level when `warn`, else at debug level.
fn cannot_publish(warn: bool, reason: &str, reference: &ObjectReference, err: &kube::Error) {
    let object = reference.name.as_deref().unwrap_or("");
    let error = crate::sanitize::Sanitized::new(&err.to_string());
    if warn {
        warn!(reason, object, %error, "cannot publish event (until one is published again, further failures are logged at debug level)");
    } else {
        debug!(reason, object, %error, "cannot publish event, again");
    }
}

/// The most events a [`SeriesRecorder`] publishes through one kube Recorder before it starts a
/// fresh one. kube's Recorder keeps every event it published until a later publish six minutes
/// on, with no bound on their number, and what a repair reports comes from the cluster; a fresh
/// Recorder lets the kept ones go. A finding seen again after that is a new Event rather than
/// the next count of its series. Upstream's recorder (client-go's `EventCorrelator`) bounds its
/// cache the same way, with an LRU of 4,096 for the whole process.
pub const MAX_KEPT_EVENTS: u32 = 256;

/// How long a kept event may still take a repeat into its series: kube's Recorder's own TTL
/// (`CACHE_TTL` in kube-runtime's `events.rs`).
pub const SERIES_TTL: Duration = Duration::from_secs(6 * 60);

/// A Recorder kept for a loop's life, so its events form series as client-go's recorder makes
/// them for upstream's repairs, with what it keeps bounded: at most [`MAX_KEPT_EVENTS`], and
/// none once [`SERIES_TTL`] has passed without an event ([`SeriesRecorder::forget_idle`]; kube's
/// Recorder lets its events go only when it publishes, so a loop at rest would keep them for
/// good).
pub struct SeriesRecorder {
    client: Client,
    reporter: Reporter,
    kept: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    /// None until the first event, and again once it went idle.
    recorder: Option<Recorder>,
    /// Events published through `recorder`.
    published: u32,
    /// When the last one was.
    last: Option<Instant>,
    /// Whether the last publish failed.
    failing: bool,
}

impl SeriesRecorder {
    pub fn new(client: Client, reporter: Reporter) -> Self {
        SeriesRecorder {
            client,
            reporter,
            kept: Mutex::default(),
        }
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.kept
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
    }

    /// The Recorder the event published at `now` goes through: a fresh one after
    /// [`MAX_KEPT_EVENTS`].
    fn current(&self, now: Instant) -> Recorder {
        let mut kept = self.kept();
        let recorder = match kept.recorder.take() {
            Some(recorder) if kept.published < MAX_KEPT_EVENTS => recorder,
            _ => {
                kept.published = 0;
                Recorder::new(self.client.clone(), self.reporter.clone())
            }
        };
        kept.published += 1;
        kept.last = Some(now);
        kept.recorder = Some(recorder.clone());
        recorder
    }

    /// Lets the kept events go once none was published for [`SERIES_TTL`]: none of them could
    /// take a repeat into its series any more. The loops call it at each pass.
    pub fn forget_idle(&self) {
        self.forget_idle_at(Instant::now());
    }

    fn forget_idle_at(&self, now: Instant) {
        let mut kept = self.kept();
        if kept
            .last
            .is_some_and(|last| now.saturating_duration_since(last) >= SERIES_TTL)
        {
            *kept = Kept::default();
        }
    }

    /// Whether a Recorder, and what it keeps, is held now.
    #[cfg(test)]
    fn holds_events(&self) -> bool {
        self.kept().recorder.is_some()
    }

    /// Events published through the Recorder held now.
    #[cfg(test)]
    fn published(&self) -> u32 {
        self.kept().published
    }
}

async fn publish(
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
        other => other,
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

    /// A client that is never called: making a kube Recorder sends nothing.
    fn idle_client() -> Client {
        let service = tower::service_fn(|_request: http::Request<kube::client::Body>| async {
            Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
                "not called",
            ))
        });
        Client::new(service, "default")
    }

    #[tokio::test]
    async fn a_series_recorder_starts_afresh_after_its_bound() {
        let recorder = SeriesRecorder::new(idle_client(), reporter("a"));
        let now = Instant::now();
        for _ in 0..MAX_KEPT_EVENTS {
            recorder.current(now);
        }
        assert_eq!(recorder.published(), MAX_KEPT_EVENTS);
        recorder.current(now);
        assert_eq!(
            recorder.published(),
            1,
            "the Recorder after the bound is a fresh one"
        );
    }

    #[tokio::test]
    async fn a_series_recorder_lets_its_events_go_once_idle_for_the_series_ttl() {
        let recorder = SeriesRecorder::new(idle_client(), reporter("a"));
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let ttl = SERIES_TTL.as_secs();
        assert!(
            !recorder.holds_events(),
            "nothing is kept before the first event"
        );
        recorder.current(at(0));
        recorder.forget_idle_at(at(ttl - 1));
        assert!(
            recorder.holds_events(),
            "a repeat may still join the series"
        );
        recorder.current(at(ttl - 1));
        recorder.forget_idle_at(at(ttl));
        assert!(recorder.holds_events(), "the TTL runs from the last event");
        assert_eq!(recorder.published(), 2);
        recorder.forget_idle_at(at(2 * ttl - 1));
        assert!(!recorder.holds_events());
        recorder.current(at(2 * ttl));
        assert_eq!(
            recorder.published(),
            1,
            "the next event starts a fresh Recorder"
        );
    }

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

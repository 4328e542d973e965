//! The contract between a loop and the runner that drives it.
//!
//! A loop is a name, an interval, optional trigger streams, and an async pass. The runner runs the
//! pass once at start, then on the interval or when a trigger fires, never two passes of one loop at
//! once. A pass reports every drift it found as a [`Drift`], whether or not it repaired it, so the
//! same code serves `run`, `run --dry-run` and `check`.

use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::BoxStream;

/// A stream whose items mean "something this loop cares about may have changed".
///
/// Trigger streams are polled continuously by the runner, also between passes and in
/// `--timer-only` mode (where their items are ignored), so a reflector inside one keeps its store
/// fresh. The runner debounces the items.
pub type Trigger = BoxStream<'static, ()>;

/// A trigger that fires at an instant a pass chooses (a Lease's expiry, a re-probe, a finding to
/// look at again): once, and not again until a pass chooses another instant.
#[derive(Default)]
pub struct WakeAt {
    next: tokio::sync::watch::Sender<Option<tokio::time::Instant>>,
}

impl WakeAt {
    /// Fires at `at` instead of the instant set before; `None` fires nothing.
    pub fn set(&self, at: Option<tokio::time::Instant>) {
        self.next.send_replace(at);
    }

    /// Fires at `at`, or at the instant set before if that is earlier: a pass that finds several
    /// things to look at again is woken for the first of them.
    pub fn schedule(&self, at: tokio::time::Instant) {
        self.next.send_if_modified(|next| {
            let earlier = next.is_none_or(|current| at < current);
            if earlier {
                *next = Some(at);
            }
            earlier
        });
    }

    /// The trigger: one item at each instant set or scheduled.
    pub fn trigger(&self) -> Trigger {
        use futures::StreamExt;
        // The trigger clears the instant it fired at: left set, it would fire again at every
        // poll until a pass replaced it, and would keep a later instant from being scheduled.
        let next = self.next.clone();
        let rx = next.subscribe();
        futures::stream::unfold((next, rx), |(next, mut rx)| async move {
            loop {
                let at = *rx.borrow_and_update();
                let due = async move {
                    match at {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = due => {
                        next.send_if_modified(|next| {
                            let fired = *next == at;
                            if fired {
                                *next = None;
                            }
                            fired
                        });
                        return Some(((), (next, rx)));
                    }
                    changed = rx.changed() => if changed.is_err() { return None },
                }
            }
        })
        .boxed()
    }
}

/// What one pass of a loop gets to work with.
#[derive(Clone)]
pub struct PassContext {
    pub client: kube::Client,
    /// Compute and report the writes, but do not make them.
    pub dry_run: bool,
    /// Whether this replica leads, as the runner's leader election says now (true without an
    /// election). A leader-only loop runs its passes only while it leads; its shutdown hook runs
    /// whatever the election says, so it reads this to know whether it is still the writer.
    pub leader: tokio::sync::watch::Receiver<bool>,
}

impl PassContext {
    /// The context of a replica that always leads (no leader election).
    pub fn leading(client: kube::Client, dry_run: bool) -> Self {
        // The sender goes: the value stays readable, and never changes.
        let (_, leader) = tokio::sync::watch::channel(true);
        PassContext {
            client,
            dry_run,
            leader,
        }
    }

    /// Whether this replica leads now.
    pub fn leads(&self) -> bool {
        *self.leader.borrow()
    }
}

/// What a pass did or would do about one piece of drift.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Create,
    Update,
    Delete,
    /// Drift that this loop only reports, by design (for example an immutable field).
    Report,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Create => "create",
            Action::Update => "update",
            Action::Delete => "delete",
            Action::Report => "report",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One difference between the cluster and the desired state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Drift {
    /// A stable, metric-friendly label for the kind of drift, e.g. `namespace_missing`.
    pub kind: &'static str,
    /// The object concerned, as `Kind/name` or `Kind/namespace/name`.
    pub object: String,
    pub action: Action,
    /// A sentence for humans: what is wrong and what is (or would be) done.
    pub message: String,
    /// Whether the write was made in this pass (false in dry-run and for [`Action::Report`]).
    pub applied: bool,
    /// What the object was and what the repair made it, when the loop can say it more exactly
    /// than [`Drift::change`] does from the message and the action.
    pub change: Option<Change>,
}

/// An object before and after a repair, as the repair's log line shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub was: String,
    pub became: String,
}

impl Drift {
    /// The same drift, saying what the object was and what the repair made it.
    pub fn changed(mut self, was: impl Into<String>, became: impl Into<String>) -> Self {
        self.change = Some(Change {
            was: was.into(),
            became: became.into(),
        });
        self
    }

    /// What the object was and became: the loop's own words, else the message (what was wrong)
    /// and the action (what was done about it).
    pub fn change(&self) -> Change {
        self.change.clone().unwrap_or_else(|| Change {
            was: self.message.clone(),
            became: match self.action {
                Action::Create => "created",
                Action::Update => "repaired",
                Action::Delete => "deleted",
                Action::Report => "left as it is",
            }
            .to_owned(),
        })
    }
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]: {}", self.object, self.kind, self.message)
    }
}

/// Everything one pass found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    pub drift: Vec<Drift>,
}

impl PassReport {
    pub fn push(&mut self, drift: Drift) {
        self.drift.push(drift);
    }

    pub fn is_clean(&self) -> bool {
        self.drift.is_empty()
    }
}

/// Why a pass failed. The runner retries failed passes with backoff.
#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error("Kubernetes API request failed: {}", api_error_text(.0))]
    Api(#[from] kube::Error),
    /// The loop's cache has not synced or is older than the API: acting now could destroy data.
    #[error("cache not ready: {0}")]
    NotSynced(String),
    /// The cluster holds something this loop cannot work with (for example an object it must not
    /// overwrite). Retrying will not help until someone changes it.
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Other(String),
}

/// An API refusal as one line, `404 NotFound: namespaces "default" not found` (kube's own text
/// adds the whole Status in debug form); other errors as kube writes them.
fn api_error_text(error: &kube::Error) -> String {
    match error {
        kube::Error::Api(status) => {
            format!("{} {}: {}", status.code, status.reason, status.message)
        }
        other => other.to_string(),
    }
}

impl LoopError {
    /// Why the pass cannot run yet, when that is normal for a moment after start-up: every loop
    /// starts at once, so a namespace a loop writes into may not exist yet (the system-namespaces
    /// loop creates it) and a cache may still be syncing or waiting for an object another loop
    /// creates. The runner warns about these only once they last.
    pub fn not_yet(&self) -> Option<String> {
        match self {
            LoopError::NotSynced(_) => Some(self.to_string()),
            LoopError::Api(kube::Error::Api(status)) if status.code == 404 => status
                .details
                .as_ref()
                .filter(|details| details.kind == "namespaces" && !details.name.is_empty())
                .map(|details| format!("namespace {} does not exist yet", details.name)),
            _ => None,
        }
    }

    /// A short, bounded label for the `errors` metric.
    pub fn category(&self) -> &'static str {
        match self {
            LoopError::Api(kube::Error::Api(status)) => match status.code {
                401 | 403 => "forbidden",
                404 => "not_found",
                409 => "conflict",
                422 => "invalid",
                429 => "throttled",
                500..=599 => "server_error",
                _ => "api_other",
            },
            LoopError::Api(_) => "connection",
            LoopError::NotSynced(_) => "not_synced",
            LoopError::Invalid(_) => "invalid",
            LoopError::Other(_) => "other",
        }
    }
}

/// One reconcile loop.
///
/// Implementations hold their own configuration, caches and metric handles; they are built once at
/// start-up with a client and a metrics registry.
pub trait Reconciler: Send + Sync + 'static {
    /// Stable name: used in logs, metrics labels, `/readyz` detail and the configuration file.
    fn name(&self) -> &'static str;

    /// Time between passes when nothing triggers one.
    fn interval(&self) -> Duration;

    /// Whether the loop writes cluster-wide objects, and so runs only on the elected leader.
    fn needs_leadership(&self) -> bool {
        true
    }

    /// Streams that wake the loop. Called once by the runner.
    fn triggers(&self) -> Vec<Trigger> {
        Vec::new()
    }

    /// One pass: compare, repair (unless `ctx.dry_run`), report.
    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>>;

    /// Runs once on graceful shutdown, after the last pass finished, within the runner's timeout.
    fn shutdown<'a>(&'a self, _ctx: &'a PassContext) -> BoxFuture<'a, Result<(), LoopError>> {
        Box::pin(async { Ok(()) })
    }
}

/// Treat `409 AlreadyExists` as success, as upstream's create-if-missing loops do.
pub fn ignore_already_exists<T>(result: Result<T, kube::Error>) -> Result<Option<T>, kube::Error> {
    match result {
        Ok(value) => Ok(Some(value)),
        Err(kube::Error::Api(status)) if status.code == 409 && status.reason == "AlreadyExists" => {
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

/// Small helper so loops build [`Drift`] values uniformly.
pub fn drift(
    kind: &'static str,
    object: impl Into<String>,
    action: Action,
    message: impl Into<String>,
    applied: bool,
) -> Drift {
    Drift {
        kind,
        object: object.into(),
        action,
        message: message.into(),
        applied,
        change: None,
    }
}

/// Interval used when a configuration asks for none; kept here so loops agree.
pub const DEFAULT_DEBOUNCE: Duration = Duration::from_millis(10);

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wake_fires_once_at_the_earliest_instant_scheduled() {
        use futures::StreamExt;
        let wake = WakeAt::default();
        let mut trigger = wake.trigger();
        let now = tokio::time::Instant::now();
        wake.schedule(now + Duration::from_secs(600));
        wake.schedule(now + Duration::from_millis(50));
        wake.schedule(now + Duration::from_secs(300));
        let fired = tokio::time::timeout(Duration::from_secs(60), trigger.next()).await;
        assert_eq!(fired, Ok(Some(())));
        let again = tokio::time::timeout(Duration::from_millis(300), trigger.next()).await;
        assert!(again.is_err(), "a fired instant fires no more");
        // The next instant chosen fires in its turn.
        wake.schedule(tokio::time::Instant::now() + Duration::from_millis(50));
        let fired = tokio::time::timeout(Duration::from_secs(60), trigger.next()).await;
        assert_eq!(fired, Ok(Some(())));
    }

    #[test]
    fn an_api_refusal_reads_as_one_line() {
        let status = kube::core::Status::failure("namespaces \"default\" not found", "NotFound")
            .with_code(404)
            .boxed();
        let error = LoopError::from(kube::Error::Api(status));
        assert_eq!(
            error.to_string(),
            "Kubernetes API request failed: 404 NotFound: namespaces \"default\" not found"
        );
        assert_eq!(error.category(), "not_found");
    }

    fn not_found(kind: &str, name: &str) -> LoopError {
        let details = kube::core::response::StatusDetails {
            name: name.to_owned(),
            group: String::new(),
            kind: kind.to_owned(),
            uid: String::new(),
            causes: Vec::new(),
            retry_after_seconds: 0,
        };
        let status =
            kube::core::Status::failure(&format!("{kind} \"{name}\" not found"), "NotFound")
                .with_code(404)
                .with_details(details)
                .boxed();
        LoopError::from(kube::Error::Api(status))
    }

    #[test]
    fn a_missing_namespace_and_an_unsynced_cache_are_not_yet_failures() {
        assert_eq!(
            not_found("namespaces", "default").not_yet().as_deref(),
            Some("namespace default does not exist yet")
        );
        assert_eq!(
            LoopError::NotSynced("Service cache has not synced yet".into())
                .not_yet()
                .as_deref(),
            Some("cache not ready: Service cache has not synced yet")
        );
        // The object itself missing, a refusal without details, anything else: a failure.
        assert_eq!(not_found("services", "kubernetes").not_yet(), None);
        assert_eq!(not_found("namespaces", "").not_yet(), None);
        assert_eq!(LoopError::Other("x".into()).not_yet(), None);
    }
}

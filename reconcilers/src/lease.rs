//! What every Lease protocol of this project shares: leader election
//! (`bootstrap_controller::leader`), the tenant replicas (`bootstrap_controller::shards`), the
//! apiservers' membership (the `apiserver-lease` loop) and the tenants'
//! etcd-claim records (`bootstrap_controller::etcd_claims`).
//!
//! Every one of them writes by compare-and-swap: a create fails when the Lease exists, a replace
//! carries the resourceVersion it read and fails when someone wrote since ([`is_conflict`]); the
//! loser reads again rather than overwriting. Another holder's Lease is judged alive by when
//! this observer saw it change ([`sign_of_life`], [`Liveness`]), by this observer's own clock,
//! as client-go's leader election judges it by its `observedTime`: hosts' clocks need not agree.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::jiff::Timestamp;
use kube::Resource;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::runtime::events::{EventType, Reporter};
use tokio::time::Instant;

use crate::contract::ignore_already_exists;

/// What changes when a holder renews: its identity and renew time. A change is a sign of life;
/// anything else in the Lease (annotations, labels) is not.
pub fn sign_of_life(lease: &Lease) -> (Option<String>, Option<Timestamp>) {
    let spec = lease.spec.as_ref();
    (
        spec.and_then(|s| s.holder_identity.clone()),
        spec.and_then(|s| s.renew_time.as_ref()).map(|t| t.0),
    )
}

/// The Lease's own `leaseDurationSeconds`, when it says a positive one.
pub fn duration(lease: &Lease) -> Option<Duration> {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.lease_duration_seconds)
        .and_then(|d| u64::try_from(d).ok())
        .filter(|d| *d > 0)
        .map(Duration::from_secs)
}

/// A resourceVersion as a number. Opaque by contract, numbers in practice.
pub fn version(value: Option<&str>) -> Option<u64> {
    value.and_then(|v| v.parse().ok())
}

/// Whether resourceVersion `seen` is at least `wanted`; if either is not a number, only equality
/// proves it.
pub fn at_least(seen: Option<&str>, wanted: Option<&str>) -> bool {
    match (version(seen), version(wanted)) {
        (Some(seen), Some(wanted)) => seen >= wanted,
        _ => seen.is_some() && seen == wanted,
    }
}

/// The API's status code, when the error is the API's answer.
pub fn status_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Whether a compare-and-swap write lost: someone else created the Lease first, or wrote it
/// since it was read.
pub fn is_conflict(err: &kube::Error) -> bool {
    status_code(err) == Some(409)
}

/// Creates the namespace of one of this process's own Leases (leader election, the replica
/// group) when the cluster lacks it. The Lease writes themselves are this process's bookkeeping;
/// a namespace it creates is a change to the cluster, so it is reported as every repair is: one
/// `repaired` line in the runner's shape and one event on the namespace. Read first, so a
/// namespace that exists needs no `create` right.
#[derive(Clone)]
pub struct LeaseNamespaces {
    api: Api<Namespace>,
    client: kube::Client,
    reporter: Reporter,
    /// The part of the process whose Lease needs it, named in the line's `loop` field.
    by: &'static str,
}

impl LeaseNamespaces {
    pub fn new(client: kube::Client, reporter: Reporter, by: &'static str) -> Self {
        LeaseNamespaces {
            api: Api::all(client.clone()),
            client,
            reporter,
            by,
        }
    }

    /// Namespace `name`, created unless it exists; true when this call created it.
    pub async fn ensure(&self, name: &str) -> Result<bool, kube::Error> {
        if self.api.get_opt(name).await?.is_some() {
            return Ok(false);
        }
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let Some(created) =
            ignore_already_exists(self.api.create(&PostParams::default(), &namespace).await)?
        else {
            return Ok(false);
        };
        tracing::info!(
            "loop" = self.by,
            object = name,
            kind = "namespace_missing",
            action = "create",
            was = "absent",
            became = "created",
            "repaired"
        );
        // Logged there; the namespace stands without its event.
        let _ = crate::events::emit(
            &self.client,
            &self.reporter,
            &created.object_ref(&()),
            EventType::Normal,
            "LeaseNamespaceCreated",
            "Create",
            &format!("created missing namespace {name} for the {} Lease", self.by),
        )
        .await;
        Ok(true)
    }
}

/// One Lease's liveness as this observer judges it: alive until a lease duration after it last
/// saw a [`sign_of_life`] change, by this observer's monotonic clock (tokio's, so tests can
/// pause time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Liveness {
    seen: Option<(Option<String>, Option<Timestamp>)>,
    changed_at: Instant,
}

impl Liveness {
    /// Nothing seen yet: a Lease first met counts from `now`.
    pub fn new(now: Instant) -> Self {
        Liveness {
            seen: None,
            changed_at: now,
        }
    }

    /// Records the Lease as seen at `now` (`None`: it does not exist); true when that is a
    /// change, which restarts its time.
    pub fn observe(&mut self, lease: Option<&Lease>, now: Instant) -> bool {
        // An absent Lease is neither holder nor renew time, so its creation is a change.
        let seen = lease.map_or((None, None), sign_of_life);
        let changed = self.seen.as_ref() != Some(&seen);
        if changed {
            self.changed_at = now;
        }
        self.seen = Some(seen);
        changed
    }

    /// The renew time last seen.
    pub fn renewed(&self) -> Option<Timestamp> {
        self.seen.as_ref().and_then(|(_, renewed)| *renewed)
    }

    /// When this observer last saw it change.
    pub fn changed_at(&self) -> Instant {
        self.changed_at
    }

    /// When it expires if it does not change again.
    pub fn expires(&self, duration: Duration) -> Instant {
        self.changed_at + duration
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

    use super::*;

    fn lease(holder: &str, renewed: i64, seconds: Option<i32>) -> Lease {
        Lease {
            metadata: ObjectMeta::default(),
            spec: Some(LeaseSpec {
                holder_identity: Some(holder.to_owned()),
                renew_time: Some(MicroTime(
                    Timestamp::from_second(1_800_000_000 + renewed).expect("a time"),
                )),
                lease_duration_seconds: seconds,
                ..LeaseSpec::default()
            }),
        }
    }

    #[test]
    fn only_a_new_holder_or_renew_time_restarts_the_time() {
        let start = Instant::now();
        let mut liveness = Liveness::new(start);
        assert!(liveness.observe(Some(&lease("a", 0, Some(15))), start));
        let later = start + Duration::from_secs(5);
        let mut annotated = lease("a", 0, Some(15));
        annotated.metadata.annotations = Some([("x".to_owned(), "y".to_owned())].into());
        assert!(
            !liveness.observe(Some(&annotated), later),
            "annotations are no sign of life"
        );
        assert_eq!(
            liveness.expires(Duration::from_secs(15)),
            start + Duration::from_secs(15)
        );
        assert!(liveness.observe(Some(&lease("a", 1, Some(15))), later));
        assert_eq!(liveness.changed_at(), later);
        assert!(
            liveness.observe(None, later + Duration::from_secs(1)),
            "deleted"
        );
    }

    #[test]
    fn a_duration_is_the_leases_own_when_positive() {
        assert_eq!(
            duration(&lease("a", 0, Some(15))),
            Some(Duration::from_secs(15))
        );
        assert_eq!(duration(&lease("a", 0, Some(0))), None);
        assert_eq!(duration(&lease("a", 0, Some(-5))), None);
        assert_eq!(duration(&lease("a", 0, None)), None);
    }

    #[test]
    fn resource_versions_compare_as_numbers_else_only_equal() {
        assert!(at_least(Some("10"), Some("9")));
        assert!(!at_least(Some("9"), Some("10")));
        assert!(at_least(Some("abc"), Some("abc")));
        assert!(!at_least(Some("abc"), Some("abd")));
        assert!(!at_least(None, Some("1")));
    }
}

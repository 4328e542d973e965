//! Membership Leases: one `coordination.k8s.io/v1` Lease per apiserver, written by the sidecar next
//! to it while its `/readyz` answers 200. Pure: building, parsing and judging expiry, and which
//! changes of them wake the endpoints loop.
//!
//! Upstream keeps this in TTL'd etcd keys (`/registry/masterleases/<ip>`) nobody outside can see.
//! Leases are API-visible, so stale members can be inspected and deleted with `kubectl`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::runtime::watcher;
use tokio::time::Instant;

use super::members::{MemberSet, parse_ip};
use super::objects::EndpointsTarget;
use crate::budget::{CacheError, CacheEvent};
use crate::contract::Trigger;
use crate::lease::Liveness;
use crate::watch_cache::Lenient;

/// Selects every membership Lease; the value is the Service the member serves.
pub const MEMBER_LABEL: &str = "bootstrap-controller.io/apiserver-endpoint";
/// The advertise address the member serves on.
pub const ADDRESS_ANNOTATION: &str = "bootstrap-controller.io/advertise-address";
/// The member's `--secure-port`.
pub const PORT_ANNOTATION: &str = "bootstrap-controller.io/secure-port";

/// Everything that identifies this instance's membership Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnLease {
    pub namespace: String,
    /// The Service the member serves: its name labels the Lease, its port is the member's.
    pub target: EndpointsTarget,
    pub address: IpAddr,
    /// `holderIdentity`: who writes it (pod or host name), for humans.
    pub holder: String,
    pub ttl: Duration,
}

impl OwnLease {
    /// `apiserver-<address>`, so a restarted instance finds the Lease a crash left; IPv6 colons
    /// become dashes (`fd00::1` -> `fd00--1`): Lease names are DNS subdomains.
    pub fn name(&self) -> String {
        format!("apiserver-{}", self.address.to_string().replace(':', "-"))
    }

    pub fn object_ref(&self) -> String {
        format!("Lease/{}/{}", self.namespace, self.name())
    }

    /// The Lease as it should be after a renewal at `now`. `existing` keeps its metadata
    /// (resourceVersion, foreign labels) and its `acquireTime`.
    pub fn renewed(&self, existing: Option<&Lease>, now: Timestamp) -> Lease {
        let mut lease = existing.cloned().unwrap_or_else(|| Lease {
            metadata: ObjectMeta {
                name: Some(self.name()),
                namespace: Some(self.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec: None,
        });
        lease.metadata.managed_fields = None;
        lease
            .metadata
            .labels
            .get_or_insert_with(BTreeMap::new)
            .insert(MEMBER_LABEL.to_owned(), self.target.service_name.clone());
        let annotations = lease.metadata.annotations.get_or_insert_with(BTreeMap::new);
        annotations.insert(ADDRESS_ANNOTATION.to_owned(), self.address.to_string());
        annotations.insert(PORT_ANNOTATION.to_owned(), self.target.port.to_string());
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        spec.holder_identity = Some(self.holder.clone());
        spec.lease_duration_seconds = Some(ttl_seconds(self.ttl));
        spec.renew_time = Some(MicroTime(now));
        if spec.acquire_time.is_none() {
            spec.acquire_time = Some(MicroTime(now));
        }
        lease
    }
}

/// Whole seconds, at least one: the API's `leaseDurationSeconds` is an integer.
pub fn ttl_seconds(ttl: Duration) -> i32 {
    i32::try_from(ttl.as_secs().max(1)).unwrap_or(i32::MAX)
}

/// What one membership Lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedMember {
    pub lease_name: String,
    pub address: IpAddr,
    pub port: Option<i32>,
    pub holder: Option<String>,
    pub renewed: Timestamp,
    /// The Lease's `leaseDurationSeconds`, or the fallback when it is missing or not positive.
    pub duration: SignedDuration,
    pub expires: Timestamp,
}

/// Read one Lease. `fallback_ttl` applies when `leaseDurationSeconds` is missing. The error
/// says why a Lease carrying the member label is not a member.
pub fn observe(lease: &Lease, fallback_ttl: Duration) -> Result<ObservedMember, String> {
    let lease_name = lease.metadata.name.clone().unwrap_or_default();
    let found = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ADDRESS_ANNOTATION))
        .cloned();
    let Some(address) = found.as_deref().and_then(parse_ip) else {
        // The value is the Lease writer's: quoted at most 64 bytes of it, as the problem is
        // kept for as long as the Lease is.
        let found = found.map_or("no".to_owned(), |v| {
            format!("a non-IP ({})", crate::sanitize::Sanitized::within(&v, 64))
        });
        return Err(format!(
            "Lease {lease_name} has {found} annotation {ADDRESS_ANNOTATION}; ignoring it"
        ));
    };
    let port = lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(PORT_ANNOTATION))
        .and_then(|p| p.trim().parse::<i32>().ok());
    let spec = lease.spec.clone().unwrap_or_default();
    let Some(MicroTime(renewed)) = spec.renew_time else {
        return Err(format!("Lease {lease_name} has no renewTime; ignoring it"));
    };
    let seconds = spec
        .lease_duration_seconds
        .filter(|s| *s > 0)
        .unwrap_or_else(|| ttl_seconds(fallback_ttl));
    let duration = SignedDuration::from_secs(i64::from(seconds));
    let expires = renewed.checked_add(duration).unwrap_or(renewed);
    Ok(ObservedMember {
        lease_name,
        address,
        port,
        holder: spec.holder_identity,
        renewed,
        duration,
        expires,
    })
}

/// The member set the Leases give at `now`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseMembership {
    pub members: MemberSet,
    /// The live Leases, each with its expiry as judged (see [`Sightings`]), on the wall clock
    /// for people to read.
    pub live: Vec<ObservedMember>,
    /// Leases whose time ran out (their address is not a member unless another live Lease has it).
    pub expired: Vec<ObservedMember>,
    /// Why each unusable Lease is not a member.
    pub problems: Vec<String>,
    /// When the first live Lease runs out unless it is renewed, on the monotonic clock.
    pub next_expiry: Option<Instant>,
}

/// A renewal further ahead of the reader's clock than this is no clock's error but a corrupted
/// object (an etcd restore, a hand edit).
const FAR_FUTURE: SignedDuration = SignedDuration::from_hours(24);

/// Each Lease's [`Liveness`], the rule every Lease protocol of this project judges by: a
/// member expires a lease duration after this reader saw its Lease change, by the reader's own
/// monotonic clock, as client-go's leader election does (its `observedTime`). So a control-plane
/// host whose clock is off is neither flapping nor missing: comparing the writer's `renewTime`
/// with the reader's clock would make a host 5 s behind expire and rejoin every interval, and one
/// a whole TTL behind never be listed. And a step of the reader's own wall clock (an NTP
/// correction, a resumed VM) neither drops the members nor keeps dead ones longer.
///
/// A Lease met for the first time (every Lease on a new leader's first pass), or renewed back in
/// time, is judged by its `renewTime` against the wall clock, the only time it can be judged by
/// then: live, it counts as renewed now (so a member a few seconds behind does not expire before
/// its next renewal); expired, it stays expired until a change is seen (so a long-dead member is
/// not listed). On a failover, this first judgement drops a member whose host clock is more than
/// about TTL − interval behind the new leader's until its next renewal is seen.
pub type Sightings = BTreeMap<String, Sighting>;

/// One Lease as this reader saw it.
#[derive(Clone, Debug)]
pub struct Sighting {
    liveness: Liveness,
    /// Met already expired, and not seen to change since.
    stale: bool,
}

/// Records `lease` as seen at `mono` and gives how long it stays live unless it changes again
/// (`None`: it is expired; see [`Sightings`]).
fn time_left(
    sightings: &mut Sightings,
    lease: &Lease,
    member: &ObservedMember,
    now: Timestamp,
    mono: Instant,
) -> Option<Duration> {
    let name = &member.lease_name;
    // Renewed back in time (a clock stepped back, a hand edit): met afresh.
    if (sightings.get(name)).is_some_and(|seen| seen.liveness.renewed() > Some(member.renewed)) {
        sightings.remove(name);
    }
    let first = !sightings.contains_key(name);
    let sighting = sightings.entry(name.clone()).or_insert_with(|| Sighting {
        liveness: Liveness::new(mono),
        stale: member.expires <= now,
    });
    // Only a renewal seen after the first sight revives a stale Lease.
    if sighting.liveness.observe(Some(lease), mono) && !first {
        sighting.stale = false;
    }
    if sighting.stale {
        return None;
    }
    let duration = member.duration.unsigned_abs();
    let since = mono.saturating_duration_since(sighting.liveness.changed_at());
    duration.checked_sub(since).filter(|left| !left.is_zero())
}

/// Judge every Lease (expiry as [`Sightings`] says) at `now` on the wall clock and `mono` on the
/// monotonic one. Leases being deleted are not members.
pub fn membership<'a>(
    leases: impl IntoIterator<Item = &'a Lease>,
    now: Timestamp,
    mono: Instant,
    fallback_ttl: Duration,
    sightings: &mut Sightings,
) -> LeaseMembership {
    let mut out = LeaseMembership::default();
    let mut present = std::collections::BTreeSet::new();
    for lease in leases {
        if lease.metadata.deletion_timestamp.is_some() {
            continue;
        }
        match observe(lease, fallback_ttl) {
            Ok(member) if member.renewed > now.checked_add(FAR_FUTURE).unwrap_or(now) => {
                out.problems.push(format!(
                    "Lease {} says it was renewed at {}, more than a day ahead of this clock; \
                     ignoring it",
                    member.lease_name, member.renewed
                ));
            }
            Ok(mut member) => {
                present.insert(member.lease_name.clone());
                match time_left(sightings, lease, &member, now, mono) {
                    Some(left) => {
                        member.expires = SignedDuration::try_from(left)
                            .ok()
                            .and_then(|left| now.checked_add(left).ok())
                            .unwrap_or(Timestamp::MAX);
                        let deadline = mono.checked_add(left);
                        out.next_expiry = match (out.next_expiry, deadline) {
                            (Some(next), Some(deadline)) => Some(next.min(deadline)),
                            (next, deadline) => next.or(deadline),
                        };
                        out.members.insert(member.address);
                        out.live.push(member);
                    }
                    None => out.expired.push(member),
                }
            }
            Err(problem) => out.problems.push(problem),
        }
    }
    sightings.retain(|name, _| present.contains(name));
    out.expired.retain(|m| !out.members.contains(&m.address));
    out
}

/// The Lease watch as a trigger, minus plain renewals: with N members a renewal arrives every
/// interval/N, and each would cost the leader a pass that finds nothing. A Lease fires when it
/// appears, goes, changes address, or is renewed after it had expired (a member coming back).
pub fn lease_trigger<S>(stream: S, fallback_ttl: Duration) -> Trigger
where
    S: futures::Stream<Item = CacheEvent<Lenient<Lease>>> + Send + 'static,
{
    let mut seen: BTreeMap<String, (IpAddr, Timestamp)> = BTreeMap::new();
    stream
        .filter_map(move |event| {
            let fire = match event {
                Ok(watcher::Event::Init) => {
                    seen.clear();
                    false
                }
                Ok(watcher::Event::InitApply(Lenient(lease))) => {
                    if let (Some(name), Ok(member)) =
                        (lease.metadata.name.clone(), observe(&lease, fallback_ttl))
                    {
                        seen.insert(name, (member.address, member.expires));
                    }
                    false
                }
                Ok(watcher::Event::InitDone) => true,
                Ok(watcher::Event::Apply(Lenient(lease))) => {
                    let name = lease.metadata.name.clone().unwrap_or_default();
                    match observe(&lease, fallback_ttl) {
                        Ok(member) => {
                            let before = seen.insert(name, (member.address, member.expires));
                            match before {
                                Some((address, expires)) => {
                                    address != member.address || expires <= Timestamp::now()
                                }
                                None => true,
                            }
                        }
                        Err(_) => seen.remove(&name).is_some(),
                    }
                }
                Ok(watcher::Event::Delete(Lenient(lease))) => {
                    seen.remove(&lease.metadata.name.clone().unwrap_or_default());
                    true
                }
                // The cache emptied or lost an event: the pass reads the API instead.
                Err(CacheError::OverBudget(_) | CacheError::Lost { .. }) => {
                    seen.clear();
                    true
                }
                Err(err) => {
                    tracing::debug!(error = %err, "Lease watch failed; retrying with backoff");
                    false
                }
            };
            futures::future::ready(fire.then_some(()))
        })
        .boxed()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_renewed_far_in_the_future_is_a_problem_not_an_everlasting_member() {
        let now = Timestamp::now();
        let mut lease = own("192.0.2.9").renewed(None, now);
        let spec = lease.spec.as_mut().unwrap();
        spec.renew_time = Some(MicroTime("9000-01-01T00:00:00Z".parse().unwrap()));
        spec.lease_duration_seconds = Some(-5);
        let judged = membership(
            &[lease],
            now,
            Instant::now(),
            Duration::from_secs(15),
            &mut Sightings::default(),
        );
        assert!(judged.members.is_empty());
        assert!(
            matches!(judged.problems.as_slice(), [p] if p.contains("more than a day ahead")),
            "{:?}",
            judged.problems
        );
        // A writer's clock ahead of the reader's is no problem: met for the first time, it
        // counts as renewed now.
        let skewed = own("192.0.2.8").renewed(None, now + SignedDuration::from_secs(60));
        let judged = membership(
            &[skewed],
            now,
            Instant::now(),
            Duration::from_secs(15),
            &mut Sightings::default(),
        );
        assert_eq!(judged.members.len(), 1);
        assert_eq!(judged.live[0].expires, now + SignedDuration::from_secs(15));
    }

    fn own(ip: &str) -> OwnLease {
        OwnLease {
            namespace: "kube-system".into(),
            target: EndpointsTarget::default(),
            address: ip.parse().unwrap(),
            holder: "cp-1".into(),
            ttl: Duration::from_secs(15),
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).unwrap()
    }

    /// The monotonic clock `secs` after a fixed start (which this clock, unlike the wall one,
    /// cannot be set to).
    fn mono(secs: i64) -> Instant {
        static START: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);
        *START + Duration::from_secs(secs.unsigned_abs())
    }

    #[test]
    fn names_are_dns_subdomains() {
        assert_eq!(own("192.0.2.1").name(), "apiserver-192.0.2.1");
        assert_eq!(own("fd00::1").name(), "apiserver-fd00--1");
    }

    #[test]
    fn renewed_lease_carries_address_port_and_ttl() {
        let lease = own("192.0.2.1").renewed(None, at(0));
        let json = serde_json::to_value(&lease).unwrap();
        assert_eq!(json["metadata"]["labels"][MEMBER_LABEL], "kubernetes");
        assert_eq!(
            json["metadata"]["annotations"][ADDRESS_ANNOTATION],
            "192.0.2.1"
        );
        assert_eq!(json["metadata"]["annotations"][PORT_ANNOTATION], "6443");
        assert_eq!(json["spec"]["leaseDurationSeconds"], 15);
        assert_eq!(json["spec"]["holderIdentity"], "cp-1");
        let member = observe(&lease, Duration::from_secs(1)).unwrap();
        assert_eq!(member.expires, at(15));
        assert_eq!(member.port, Some(6443));
    }

    #[test]
    fn a_non_ip_address_is_quoted_cut() {
        let mut lease = own("192.0.2.1").renewed(None, at(0));
        lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(ADDRESS_ANNOTATION.to_owned(), "x".repeat(256 * 1024));
        let problem = observe(&lease, Duration::from_secs(1)).unwrap_err();
        assert!(
            problem.len() < 300 && problem.contains("a non-IP"),
            "{} bytes: {}",
            problem.len(),
            &problem[..problem.len().min(300)]
        );
    }

    #[test]
    fn renewal_keeps_acquire_time_and_metadata() {
        let mut first = own("192.0.2.1").renewed(None, at(0));
        first.metadata.resource_version = Some("9".into());
        let second = own("192.0.2.1").renewed(Some(&first), at(10));
        assert_eq!(second.metadata.resource_version.as_deref(), Some("9"));
        let spec = second.spec.unwrap();
        assert_eq!(spec.acquire_time, Some(MicroTime(at(0))));
        assert_eq!(spec.renew_time, Some(MicroTime(at(10))));
    }

    #[test]
    fn membership_drops_expired_and_broken_leases() {
        let live = own("192.0.2.1").renewed(None, at(0));
        let dead = own("192.0.2.2").renewed(None, at(-20));
        let mut garbage = own("192.0.2.3").renewed(None, at(0));
        garbage
            .metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(ADDRESS_ANNOTATION.into(), "nope".into());
        let mut deleting = own("192.0.2.4").renewed(None, at(0));
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(0)));
        let m = membership(
            &[live, dead, garbage, deleting],
            at(5),
            mono(5),
            Duration::from_secs(15),
            &mut Sightings::default(),
        );
        assert_eq!(m.members.sorted_strings(), vec!["192.0.2.1"]);
        assert_eq!(m.expired.len(), 1);
        assert_eq!(m.expired[0].address.to_string(), "192.0.2.2");
        assert_eq!(m.problems.len(), 1);
        assert!(m.problems[0].to_string().contains("nope"));
    }

    #[test]
    fn expiry_is_exclusive_at_the_deadline() {
        let lease = own("192.0.2.1").renewed(None, at(0));
        assert_eq!(
            membership(
                std::slice::from_ref(&lease),
                at(14),
                mono(14),
                Duration::ZERO,
                &mut Sightings::default()
            )
            .members
            .len(),
            1
        );
        assert_eq!(
            membership(
                std::slice::from_ref(&lease),
                at(15),
                mono(15),
                Duration::ZERO,
                &mut Sightings::default()
            )
            .members
            .len(),
            0
        );
    }

    #[test]
    fn missing_duration_uses_fallback_and_missing_renew_is_a_problem() {
        let mut lease = own("192.0.2.1").renewed(None, at(0));
        lease.spec.as_mut().unwrap().lease_duration_seconds = None;
        assert_eq!(
            observe(&lease, Duration::from_secs(30)).unwrap().expires,
            at(30)
        );
        lease.spec.as_mut().unwrap().renew_time = None;
        assert!(matches!(
            observe(&lease, Duration::from_secs(30)),
            Err(problem) if problem.contains("no renewTime")
        ));
    }

    /// A renewal past jiff's last representable time (9999-12-31T23:59:59Z, which the API
    /// takes) reads as a renewal in the future instead of failing the whole list.
    #[test]
    fn a_renewal_past_the_last_readable_time_is_a_problem_not_a_failed_list() {
        let list = serde_json::json!([{
            "metadata": {"name": "far", "namespace": "kube-system",
                         "annotations": {ADDRESS_ANNOTATION: "192.0.2.9"}},
            "spec": {"holderIdentity": "192.0.2.9:6443", "renewTime": "9999-12-31T23:59:59.000000Z",
                     "leaseDurationSeconds": 15},
        }, {
            "metadata": {"name": "near", "namespace": "kube-system",
                         "annotations": {ADDRESS_ANNOTATION: "192.0.2.8"}},
            "spec": {"holderIdentity": "192.0.2.8:6443", "renewTime": "2026-11-25T08:00:00.000000Z",
                     "leaseDurationSeconds": 15},
        }]);
        assert!(
            serde_json::from_value::<Vec<Lease>>(list.clone()).is_err(),
            "k8s-openapi alone cannot read it"
        );
        let leases: Vec<Lenient<Lease>> = serde_json::from_value(list).unwrap();
        assert_eq!(
            leases[0]
                .0
                .spec
                .as_ref()
                .unwrap()
                .renew_time
                .as_ref()
                .unwrap()
                .0
                .as_second(),
            Timestamp::MAX.as_second()
        );
        let judged = membership(
            leases.iter().map(|lease| &lease.0),
            "2026-11-25T08:00:05Z".parse().unwrap(),
            Instant::now(),
            Duration::from_secs(15),
            &mut Sightings::default(),
        );
        assert!(
            matches!(judged.problems.as_slice(), [p] if p.contains("more than a day ahead")),
            "{:?}",
            judged.problems
        );
        assert_eq!(judged.members.len(), 1, "the readable member stays");
    }

    /// A member whose clock runs `skew` behind (negative: ahead of) the reader's renews every
    /// 10 s with a 15 s duration; the reader judges every second for two minutes. Returns
    /// how often the member left and rejoined, and whether it was listed at the end.
    fn judged_over_two_minutes(skew: i64) -> (usize, bool) {
        let mut sightings = Sightings::default();
        let mut listed = Vec::new();
        for second in 0..120 {
            let renewed_at = second - second % 10;
            let lease = own("192.0.2.7").renewed(None, at(renewed_at - skew));
            let judged = membership(
                &[lease],
                at(second),
                mono(second),
                Duration::ZERO,
                &mut sightings,
            );
            listed.push(!judged.members.is_empty());
        }
        let flips = listed.windows(2).filter(|pair| pair[0] && !pair[1]).count();
        (flips, listed.last().copied().unwrap_or(false))
    }

    #[test]
    fn a_member_whose_clock_is_off_neither_flaps_nor_goes_missing() {
        for skew in [0, 5, 14, 15, 60, 3600, -5, -60] {
            assert_eq!(
                judged_over_two_minutes(skew),
                (0, true),
                "clock {skew} s behind"
            );
        }
    }

    #[test]
    fn a_step_of_the_readers_wall_clock_neither_drops_nor_keeps_a_member() {
        let mut sightings = Sightings::default();
        let renewed = |second| own("192.0.2.7").renewed(None, at(second));
        let mut judge = |lease, wall, monotonic| {
            membership(
                &[lease],
                at(wall),
                mono(monotonic),
                Duration::ZERO,
                &mut sightings,
            )
        };
        judge(renewed(0), 0, 0);
        // The reader's wall clock steps a minute ahead 5 s later: the member renewed 6 s ago.
        assert_eq!(judge(renewed(0), 66, 6).members.len(), 1);
        assert_eq!(judge(renewed(10), 70, 10).members.len(), 1);
        // Then two minutes back, and the member stops renewing: gone 15 s after its last
        // renewal was seen, not when the wall clock comes back to that renewal.
        assert_eq!(judge(renewed(10), -50, 24).members.len(), 1);
        let judged = judge(renewed(10), -49, 25);
        assert!(judged.members.is_empty());
        assert_eq!(judged.expired.len(), 1);
    }

    #[test]
    fn a_renewal_back_in_time_is_judged_by_its_renew_time_as_if_met_afresh() {
        let mut sightings = Sightings::default();
        let first = own("192.0.2.7").renewed(None, at(0));
        membership(&[first], at(0), mono(0), Duration::ZERO, &mut sightings);
        // Its host's clock stepped back 3 s: still live by its renewTime, so counted from now.
        let back = own("192.0.2.7").renewed(None, at(-3));
        let judged = membership(&[back], at(10), mono(10), Duration::ZERO, &mut sightings);
        assert_eq!(judged.live[0].expires, at(25));
        // Set back a minute (an old copy restored): expired by its renewTime, so not listed.
        let restored = own("192.0.2.7").renewed(None, at(-60));
        let judged = membership(
            &[restored],
            at(11),
            mono(11),
            Duration::ZERO,
            &mut sightings,
        );
        assert!(judged.members.is_empty());
    }

    #[test]
    fn a_member_seen_renewed_expires_a_duration_after_the_last_renewal_seen() {
        let mut sightings = Sightings::default();
        // Its clock is a minute behind: by its renewTime it expired long ago.
        let first = own("192.0.2.7").renewed(None, at(-60));
        let judged = membership(&[first], at(0), mono(0), Duration::ZERO, &mut sightings);
        assert!(
            judged.members.is_empty(),
            "not yet seen renewed: judged by renewTime"
        );
        let second = own("192.0.2.7").renewed(None, at(-50));
        let judged = membership(
            std::slice::from_ref(&second),
            at(10),
            mono(10),
            Duration::ZERO,
            &mut sightings,
        );
        assert_eq!(judged.live[0].expires, at(25));
        // No renewal after that: listed until 15 s after it was seen, not after.
        let judged = membership(
            std::slice::from_ref(&second),
            at(24),
            mono(24),
            Duration::ZERO,
            &mut sightings,
        );
        assert_eq!(judged.members.len(), 1);
        let judged = membership(
            std::slice::from_ref(&second),
            at(25),
            mono(25),
            Duration::ZERO,
            &mut sightings,
        );
        assert!(judged.members.is_empty());
        assert_eq!(judged.expired.len(), 1);
        // A deleted Lease is forgotten: back, it is judged by its renewTime again.
        membership(&[], at(26), mono(26), Duration::ZERO, &mut sightings);
        let judged = membership(
            std::slice::from_ref(&second),
            at(27),
            mono(27),
            Duration::ZERO,
            &mut sightings,
        );
        assert!(judged.members.is_empty());
    }

    #[tokio::test]
    async fn lease_trigger_ignores_plain_renewals() {
        let lease = |ip: &str, renewed| Lenient(own(ip).renewed(None, renewed));
        let now = Timestamp::now();
        let long_ago = Timestamp::from_second(1_600_000_000).unwrap();
        let events = vec![
            watcher::Event::Init,
            watcher::Event::InitApply(lease("192.0.2.1", now)),
            watcher::Event::InitApply(lease("192.0.2.2", long_ago)),
            watcher::Event::InitDone,
            // 1: plain renewal -> nothing.
            watcher::Event::Apply(lease("192.0.2.1", now)),
            // 2: renewal of an expired member (it comes back) -> fires.
            watcher::Event::Apply(lease("192.0.2.2", now)),
            // 3: a new member -> fires.
            watcher::Event::Apply(lease("192.0.2.3", now)),
            // 4: a member goes -> fires.
            watcher::Event::Delete(lease("192.0.2.1", now)),
        ];
        let events = events.into_iter().map(Ok::<_, CacheError>);
        let fired: Vec<()> = lease_trigger(futures::stream::iter(events), Duration::from_secs(15))
            .collect()
            .await;
        // InitDone + expired-renewed + new + deleted.
        assert_eq!(fired.len(), 4);
    }
}

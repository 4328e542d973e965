#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::ObjectMeta;

use super::view::{StableHasher, fenced_view_id, view_id, weight};
use super::*;

/// Computed independently of this code, from the FNV-1a and splitmix64 definitions.
const PINNED_VIEW: u64 = 0x2c5b_7173_ce31_6e36;
const PINNED_INCARNATION_VIEW: u64 = 0x8e01_65ff_aa58_3c07;
const PINNED_WEIGHT: u64 = 0xbbf1_216c_4bc4_75aa;

fn view(replicas: &[&str], me: &str) -> View {
    View {
        replicas: replicas.iter().map(|m| (*m).to_owned()).collect(),
        ..View::single(me)
    }
}

#[test]
fn the_hash_is_stable_across_builds() {
    // Replicas built by different toolchains must agree on owners and view ids.
    assert_eq!(view_id([("a", None), ("b", None)]), PINNED_VIEW);
    assert_eq!(
        view_id([("a", Some(1_700_000_000_000_000)), ("b", None)]),
        PINNED_INCARNATION_VIEW
    );
    assert_eq!(weight("a", "ns/t"), PINNED_WEIGHT);
    let single = View::single("a");
    assert_eq!(single.id, view_id([("a", None)]));
    assert_eq!(weight("a", "t"), weight("a", "t"));
    assert_ne!(weight("ab", "c"), weight("a", "bc"));
    assert_ne!(fenced_view_id("a", 1), fenced_view_id("a", 2));
    let mut hasher = StableHasher::new();
    hasher.write(b"a");
    // FNV-1a of "a" is a well-known constant.
    assert_eq!(hasher.0, 0xaf63_dc4c_8601_ec8c);
}

#[test]
fn removing_a_member_moves_only_its_tenants() {
    let three = view(&["a", "b", "c"], "a");
    let two = view(&["a", "b"], "a");
    let mut moved = 0;
    for i in 0..1000 {
        let tenant = format!("ns/t{i}");
        let before = three.owner(&tenant).unwrap();
        let after = two.owner(&tenant).unwrap();
        if before != "c" {
            assert_eq!(before, after, "{tenant} moved though its owner stayed");
        } else {
            moved += 1;
        }
    }
    assert!((200..=470).contains(&moved), "c owned {moved} of 1000");
    assert_eq!(view(&[], "a").owner("x"), None);
    let fenced = View {
        fenced: true,
        ..View::single("a")
    };
    assert!(!fenced.owns("x") && View::single("a").owns("x"));
}

fn settings() -> LeaderElection {
    LeaderElection {
        enabled: true,
        lease_name: "g".into(),
        lease_namespace: "kube-system".into(),
        identity: "me".into(),
        lease_duration: Duration::from_secs(15),
        renew_grace: Duration::from_secs(5),
    }
}

fn lease(name: &str, holder: &str, renewed: i64, ack: Option<u64>, version: u64) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            resource_version: Some(version.to_string()),
            annotations: ack
                .map(|id| BTreeMap::from([(VIEW_ANNOTATION.to_owned(), id.to_string())])),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.to_owned()),
            renew_time: Some(MicroTime(
                Timestamp::from_second(1_700_000_000 + renewed).unwrap(),
            )),
            lease_duration_seconds: Some(15),
            ..LeaseSpec::default()
        }),
    }
}

fn fenced(mut lease: Lease, millis: &str) -> Lease {
    lease
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(FENCED_ANNOTATION.to_owned(), millis.to_owned());
    lease
}

/// A successful write of what the state wants, answered with `version`; returns the Lease
/// for the watch to deliver back.
fn write(state: &mut State, at: Instant, ack: Option<u64>, version: u64) -> Lease {
    let content = state.content(ack);
    let mut lease = state.desired(&content);
    lease.metadata.resource_version = Some(version.to_string());
    state.wrote(lease.clone(), content, at);
    lease
}

/// Joins as `follow` and a prompt manager do: the first write, the fenced view acknowledged,
/// the rejoin written, the view acknowledged and written, and both seen back.
fn join(state: &mut State, at: Instant) -> View {
    let first = state.current(at, None);
    assert!(first.fenced && !first.settled);
    write(state, at, Some(first.id), 1);
    let view = state.current(at, Some(first.id));
    assert!(
        !view.fenced,
        "joined once the manager acknowledged the fence"
    );
    write(state, at, Some(first.id), 2);
    let own = write(state, at, Some(view.id), 3);
    state.observe(&own, at);
    let view = state.current(at, Some(view.id));
    assert!(!view.fenced);
    view
}

fn at(t0: Instant, millis: u64) -> Instant {
    t0 + Duration::from_millis(millis)
}

#[tokio::test]
async fn a_view_settles_once_every_live_lease_acknowledges_it_after_this_ones_own() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let view = state.current(t0, None);
    assert!(view.fenced && !view.settled && view.replicas.is_empty());

    state.observe(&lease("g-other", "other", 1, None, 5), t0);
    let view = join(&mut state, t0);
    assert_eq!(&*view.replicas, ["me".to_owned(), "other".to_owned()]);
    assert!(!view.settled, "the other replica has not acknowledged it");

    state.observe(&lease("g-other", "other", 2, Some(view.id), 8), t0);
    assert!(state.current(t0, Some(view.id)).settled);
    // A renewal changing nothing else keeps the view settled while the watch lags.
    write(&mut state, t0, Some(view.id), 9);
    assert!(state.current(t0, Some(view.id)).settled);
    // A stale acknowledgement from the other replica unsettles it.
    state.observe(&lease("g-other", "other", 3, Some(1), 10), t0);
    assert!(!state.current(t0, Some(view.id)).settled);

    // This replica's own acknowledgement counts once seen back.
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let view = join(&mut state, t0);
    let next = write(&mut state, t0, Some(view.id), 4);
    assert!(state.current(t0, Some(view.id)).settled);
    state.observe(&lease("g-other", "other", 1, None, 5), t0);
    let two = state.current(t0, Some(view.id));
    let own = write(&mut state, t0, Some(two.id), 6);
    state.observe(&lease("g-other", "other", 2, Some(two.id), 7), t0);
    state.observe(&next, t0);
    assert!(
        !state.current(t0, Some(two.id)).settled,
        "this replica's acknowledgement is not seen back yet"
    );
    state.observe(&own, t0);
    assert!(state.current(t0, Some(two.id)).settled);
}

#[tokio::test]
async fn a_rejoining_member_makes_a_new_view() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let mut other = lease("g-other", "other", 1, None, 5);
    other.spec.as_mut().unwrap().acquire_time = Some(MicroTime(Timestamp::from_second(1).unwrap()));
    state.observe(&other, t0);
    let before = join(&mut state, t0);
    other.spec.as_mut().unwrap().acquire_time = Some(MicroTime(Timestamp::from_second(2).unwrap()));
    state.observe(&other, t0);
    let after = state.current(t0, Some(before.id));
    assert_eq!(before.replicas, after.replicas);
    assert_ne!(
        before.id, after.id,
        "an acknowledgement of the old incarnation is worthless"
    );
}

#[tokio::test]
async fn members_expire_by_this_replicas_clock_and_fencing_comes_first() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    state.observe(&lease("g-other", "other", 1, None, 5), t0);
    // Seen again unchanged (a relist): no sign of life.
    state.observe(&lease("g-other", "other", 1, None, 5), at(t0, 10_000));
    let renewed = at(t0, 5_000);
    let ack = Some(join(&mut state, renewed).id);
    assert_eq!(state.view(at(t0, 14_999)).replicas.len(), 2);
    assert_eq!(&*state.view(at(t0, 15_000)).replicas, ["me".to_owned()]);
    // Own renewals failing: fenced at lease duration less grace after the last one was sent,
    // before the others can see this replica's Lease expire.
    assert!(!state.current(at(renewed, 9_999), ack).fenced);
    assert_eq!(
        state.next_change(at(renewed, 9_999)),
        Some(at(renewed, 10_000))
    );
    let view = state.current(at(renewed, 10_000), ack);
    assert!(view.fenced && !view.owns("t"));
}

#[tokio::test]
async fn a_view_left_unacknowledged_fences_this_replica_until_the_manager_acknowledges_the_fence() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let ack = Some(join(&mut state, t0).id);
    // A replica joins; the manager is given the new view and never acknowledges it.
    state.observe(&lease("g-other", "other", 1, None, 5), t0);
    let given = state.current(t0, ack);
    assert!(Some(given.id) != ack && !given.fenced);
    // Renewals go on and are seen back: only the missing acknowledgement fences.
    for (i, millis) in [4_000, 8_000, 12_000].into_iter().enumerate() {
        let i = i as u64;
        let own = write(&mut state, at(t0, millis), ack, 10 + 2 * i);
        state.observe(&own, at(t0, millis));
        state.observe(
            &lease("g-other", "other", 2 + i as i64, None, 11 + 2 * i),
            at(t0, millis),
        );
        assert!(!state.current(at(t0, millis), ack).fenced);
    }
    assert!(!state.current(at(t0, 14_999), ack).fenced);
    assert_eq!(state.next_change(at(t0, 14_999)), Some(at(t0, 15_000)));
    let fence = state.current(at(t0, 15_000), ack);
    assert!(fence.fenced && !fence.settled);
    assert_eq!(
        state.content(ack).fenced,
        Some(5_000),
        "the Lease says so, with the renew grace"
    );
    assert_eq!(state.renewal_due(ack), None, "written at once");
    write(&mut state, at(t0, 15_000), ack, 20);
    // The manager comes back and acknowledges the fence (it stopped every runtime): the
    // replica rejoins under a new incarnation.
    let incarnation = state.acquired;
    let back = state.current(at(t0, 16_000), Some(fence.id));
    assert!(!back.fenced && state.acquired > incarnation);
    assert_eq!(state.content(Some(fence.id)).fenced, None);
    assert_eq!(state.renewal_due(Some(fence.id)), None, "written at once");
}

#[tokio::test]
async fn a_watch_that_does_not_deliver_this_replicas_writes_back_fences_it() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let ack = Some(join(&mut state, t0).id);
    let mut last = None;
    for (i, millis) in [4_000, 8_000, 12_000, 16_000].into_iter().enumerate() {
        last = Some(write(&mut state, at(t0, millis), ack, 10 + i as u64));
        assert!(!state.current(at(t0, millis), ack).fenced);
    }
    assert!(!state.current(at(t0, 18_999), ack).fenced);
    let fence = state.current(at(t0, 19_000), ack);
    assert!(fence.fenced);
    assert_eq!(state.content(ack).fenced, Some(5_000));
    // The manager acknowledges at once, but the watch must catch up first.
    assert!(state.current(at(t0, 19_000), Some(fence.id)).fenced);
    state.observe(&last.unwrap(), at(t0, 19_500));
    assert!(!state.current(at(t0, 19_500), Some(fence.id)).fenced);
}

#[tokio::test]
async fn a_lease_gone_without_its_owners_word_counts_until_it_would_have_expired() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let replicas = |state: &State, millis| state.view(at(t0, millis)).replicas.len();
    // Deleted by hand.
    let deleted = lease("g-a", "a", 1, None, 5);
    state.observe(&deleted, t0);
    state.forget(&deleted);
    // Its holder removed by hand.
    let emptied = lease("g-b", "b", 1, None, 6);
    state.observe(&emptied, t0);
    let mut without_holder = emptied.clone();
    without_holder.spec.as_mut().unwrap().holder_identity = None;
    state.observe(&without_holder, at(t0, 1_000));
    // Gone while the watch was down: missing from the relist.
    let relisted = lease("g-c", "c", 1, None, 7);
    state.observe(&relisted, t0);
    state.relisted(&[], at(t0, 2_000));
    // One written back from a copy (the same renew time): no sign of life either.
    state.observe(&deleted, at(t0, 10_000));
    assert_eq!(replicas(&state, 14_999), 3);
    assert_eq!(state.next_change(at(t0, 2_000)), Some(at(t0, 15_000)));
    assert_eq!(replicas(&state, 15_000), 0);
    state.current(at(t0, 15_000), None);
    let left: Vec<&String> = state.others.keys().collect();
    assert_eq!(left, ["g-a"], "the deleted ones are dropped once expired");
    let cleanup: Vec<String> = state
        .due_for_cleanup(at(t0, 100_000))
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    assert_eq!(
        cleanup,
        ["g-a"],
        "only a Lease that still exists is deleted"
    );
}

#[tokio::test]
async fn a_fenced_lease_counts_until_its_time_has_passed_from_when_it_was_seen() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let replicas = |state: &State, millis| state.view(at(t0, millis)).replicas.len();
    state.observe(&fenced(lease("g-a", "a", 1, None, 5), "2000"), t0);
    // Renewed, still fenced: counted from the first sight.
    state.observe(
        &fenced(lease("g-a", "a", 2, None, 6), "2000"),
        at(t0, 1_000),
    );
    assert_eq!(replicas(&state, 1_999), 1);
    assert_eq!(state.next_change(at(t0, 1_000)), Some(at(t0, 2_000)));
    assert_eq!(replicas(&state, 2_000), 0);
    // Its word withdrawn (it rejoins): live again.
    state.observe(&lease("g-a", "a", 3, None, 7), at(t0, 3_000));
    assert_eq!(replicas(&state, 3_000), 1);
    // A clean stop: 0, gone at once; its deletion then changes nothing.
    let released = fenced(lease("g-a", "a", 4, None, 8), "0");
    state.observe(&released, at(t0, 4_000));
    assert_eq!(replicas(&state, 4_000), 0);
    state.forget(&released);
    assert_eq!(replicas(&state, 4_000), 0);
    // Beyond the Lease's duration, or not a number: the Lease's expiry decides.
    state.observe(
        &fenced(lease("g-b", "b", 1, None, 9), &u64::MAX.to_string()),
        t0,
    );
    state.observe(&fenced(lease("g-c", "c", 1, None, 10), "soon"), t0);
    assert_eq!(replicas(&state, 14_999), 2);
    assert_eq!(replicas(&state, 15_000), 0);
}

#[tokio::test]
async fn this_replicas_lease_deleted_by_hand_is_written_again_without_a_fence() {
    let t0 = Instant::now();
    let mut state = State::new(&settings(), lease_name("g", "me"));
    let ack = Some(join(&mut state, t0).id);
    let mut gone = state.desired(&state.content(ack));
    // A Delete of an older version is stale: this replica wrote it again since.
    gone.metadata.resource_version = Some("2".to_owned());
    state.forget(&gone);
    assert!(state.renewal_due(ack).is_some());
    gone.metadata.resource_version = Some("4".to_owned());
    state.forget(&gone);
    assert_eq!(state.renewal_due(ack), None, "written again at once");
    assert!(
        !state.current(t0, ack).fenced,
        "the others count it live meanwhile"
    );
}

#[test]
fn fencing_takes_every_runtimes_leadership_for_good() {
    let leadership = Leadership::default();
    let (_running, running) = leadership.grant();
    let (stopped_sender, _stopped) = leadership.grant();
    // The manager stopped one runtime itself.
    stopped_sender.send_replace(false);
    assert!(*running.borrow());
    assert_eq!(leadership.revoke(), 1);
    assert!(!*running.borrow());
    let (_, while_fenced) = leadership.grant();
    assert!(!*while_fenced.borrow(), "no runtime leads while fenced");
    leadership.restore();
    assert!(!*running.borrow() && !*while_fenced.borrow());
    let (_, after) = leadership.grant();
    assert!(*after.borrow());
}

#[test]
fn lease_names_are_dns_safe_and_distinct() {
    assert_eq!(lease_name("bc", "pod-0"), "bc-pod-0");
    let upper = lease_name("bc", "Pod_0");
    assert!(upper.starts_with("bc-pod-0-"), "{upper}");
    assert_ne!(upper, lease_name("bc", "pod-0"));
    assert_ne!(lease_name("bc", "Pod_0"), lease_name("bc", "Pod:0"));
    assert!(lease_name("bc", "a.-b").starts_with("bc-a--b-"));
    let long = lease_name("bc", &"x".repeat(400));
    assert!(long.len() <= 253, "{}", long.len());
    assert!(long.chars().last().unwrap().is_ascii_alphanumeric());
    assert_eq!(group_label("bootstrap-controller"), "bootstrap-controller");
    assert!(group_label(&"g".repeat(100)).len() <= 63);
}

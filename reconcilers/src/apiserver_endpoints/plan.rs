//! What a pass of the endpoints loop does ([`plan`]): the members, from what the pass read and
//! what it remembers, and the writes that bring the `kubernetes` Endpoints and EndpointSlices to
//! them (the objects themselves are `objects.rs`'s).
//!
//! Pure: no client, no clock (the time is given). The loop reads a [`Snapshot`], plans, and
//! `apply.rs` writes what the plan says.
//!
//! | the pass finds | the plan |
//! | --- | --- |
//! | members | writes repairing each object's drift; says who joined, left or expired, and the repairs |
//! | no member (not withdrawing) | no write: the endpoints stay as they are (`no_members`); warned after a lease period |
//! | a graceful stop withdrawing this instance | writes the members without it, even none |
//! | a member of the other family, or one the API would reject | leaves it out; a Warning, once |
//! | an unreadable membership Lease, or a member on another port | a warning, once |
//! | a `static` name that does not resolve | keeps its last good addresses; a Warning, once per run |

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Endpoints;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

use super::lease::{Sightings, membership};
use super::members::{EmptyStreak, MemberSet, MembershipChange, endpoint_ip_problem};
use super::objects::{
    EndpointsTarget, MANAGED_BY_LABEL, Op, SKIP_MIRROR_LABEL, Write, desired_endpoints,
    endpoints_drift, foreign_slices, listed_members, other_writers, plan_slices, slice_members,
};
use super::{Section, StaticAddress};
use crate::alloc::IpFamily;

/// What a pass of the endpoints loop reads before it decides anything.
pub struct Snapshot {
    /// The Endpoints as found (`None` with slices only: it is not kept then).
    pub endpoints: Option<Endpoints>,
    /// Slices only, and an Endpoints object is still there.
    pub endpoints_left: bool,
    /// The slices carrying the service-name label.
    pub slices: Vec<EndpointSlice>,
    /// The slice named like the Service when the label selector misses it: its label removed by
    /// hand makes it invisible to the selector, yet it is the one to repair, not to create.
    pub unlabelled: Option<EndpointSlice>,
    pub sources: Sources,
    /// The Service's IP family and where it was learnt, while known.
    pub service_family: Option<(IpFamily, String)>,
    /// This instance's address: `advertiseAddress`, or the default route's.
    pub own: Option<IpAddr>,
    /// A graceful stop taking this instance out: its address is left out, and an empty member
    /// set is written (the one case where upstream empties the endpoints too).
    pub withdrawing: bool,
}

/// Where the members come from, by `endpointReconcilerType`.
pub enum Sources {
    Leases(Vec<Lease>),
    /// Each `static` name's answer.
    Static(BTreeMap<String, Result<Vec<IpAddr>, String>>),
    /// Whether the local apiserver counts as ready (never while shutting down); `None` before a
    /// probe passed and while fewer than the threshold failed: its address is left as listed.
    MasterCount {
        ready: Option<bool>,
    },
    None,
}

/// What the plan carries from one pass to the next.
#[derive(Default)]
pub struct Memory {
    /// The member set as of the last write (the listed one before the first), to tell membership
    /// changes from hand edits.
    pub previous: Option<MemberSet>,
    /// `static` mode: last non-empty answer per name.
    last_good: BTreeMap<String, Vec<IpAddr>>,
    /// `static` mode: names whose last lookup failed (warned once per failure streak).
    failing: BTreeSet<String>,
    /// Since when the passes have found no member, and whether that was warned about.
    empty: EmptyStreak,
    /// Members already warned about for advertising another port than the endpoints carry.
    warned_ports: BTreeSet<(IpAddr, i32)>,
    /// Members already warned about for an address the API server rejects.
    warned_invalid: BTreeSet<IpAddr>,
    /// Members already warned about for an address of the other family than the Service's.
    warned_family: BTreeSet<IpAddr>,
    /// Slices only: whether a leftover Endpoints object was reported.
    warned_endpoints_left: bool,
    /// Slices kept by another controller, already warned about.
    warned_foreign: BTreeSet<String>,
    /// When each membership Lease was seen renewed (expiry on this clock).
    sightings: Sightings,
}

/// What a pass does.
#[derive(Default)]
pub struct Plan {
    /// The members, of the Service's family only.
    pub members: MemberSet,
    /// The target with the Service's family as its primary one.
    pub target: EndpointsTarget,
    pub writes: Vec<Write>,
    pub findings: Vec<Finding>,
    /// Every unusable membership Lease of this pass (the loop logs each once while it stays).
    pub lease_problems: Vec<String>,
    /// Who joined and left since the previous pass.
    pub change: MembershipChange,
    /// Addresses whose Lease ran out (events say "expired" rather than "left").
    pub expired: BTreeSet<IpAddr>,
    /// Earliest expiry among live membership Leases, on the monotonic clock.
    pub next_expiry: Option<Instant>,
    /// Who last wrote each object before this pass, when not this controller.
    pub writers: BTreeMap<String, String>,
    /// No member: nothing is written, for this reason.
    pub refused: Option<&'static str>,
}

/// What a pass found beside its writes: each logged, some also a Warning event.
#[derive(Clone, Debug, PartialEq)]
pub enum Finding {
    /// A member whose sidecar advertises another port than the endpoints carry (logged once).
    OtherPort { member: IpAddr, port: i32 },
    /// Slices only, and an Endpoints object is left over (logged once).
    EndpointsLeft,
    /// No member for a whole lease period (logged once per run).
    NoMembersForLong { waited: Duration },
    /// A member of the other family than the Service's, left out.
    WrongFamily { member: IpAddr, note: String },
    /// A member the API server would reject as an endpoint address, left out.
    Rejected { member: IpAddr, why: &'static str },
    /// A `static` name's lookup failed or found nothing; its last good addresses are kept.
    StaticLookupFailed {
        name: String,
        reason: String,
        kept: Vec<IpAddr>,
    },
    /// A `static` name whose lookup failed resolves again (logged).
    StaticResolves { name: String },
    /// A slice of the Service that another controller keeps, left alone (logged once).
    ForeignSlice { name: String, manager: String },
}

impl Finding {
    /// The Warning event's reason, for the findings published as events.
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Finding::WrongFamily { .. } => Some("MemberWrongFamily"),
            Finding::Rejected { .. } => Some("InvalidMemberAddress"),
            Finding::StaticLookupFailed { .. } => Some("StaticAddressResolutionFailed"),
            _ => None,
        }
    }

    /// What the finding says, in the log and in its event.
    pub fn note(&self, target: &EndpointsTarget) -> String {
        let (namespace, service) = (&target.namespace, &target.service_name);
        match self {
            Finding::OtherPort { member, port } => format!(
                "member {member} advertises secure port {port}, but the endpoints carry {}; give \
                 every instance the same securePort",
                target.port
            ),
            Finding::EndpointsLeft => format!(
                "writeEndpoints is false: this Endpoints object is no longer kept up to date; \
                 delete it once nothing reads it (kubectl -n {namespace} delete endpoints \
                 {service})"
            ),
            Finding::NoMembersForLong { waited } => format!(
                "no live apiserver members for a whole lease period ({waited:?}); refusing to \
                 erase all endpoints of the {service} Service"
            ),
            Finding::WrongFamily { note, .. } => note.clone(),
            Finding::Rejected { member, why } => format!("left out {member}: {why}"),
            Finding::StaticLookupFailed { name, reason, kept } => format!(
                "resolving {name} failed ({reason}); keeping its last good addresses {}",
                kept.iter().copied().collect::<MemberSet>()
            ),
            Finding::StaticResolves { name } => format!("static address {name} resolves again"),
            Finding::ForeignSlice { name, manager } => format!(
                "EndpointSlice {namespace}/{name} of Service {service} is kept by {manager} \
                 (its {MANAGED_BY_LABEL} label), not written from the apiserver members: its \
                 addresses are served too, and it is left alone, as {manager} would write it \
                 again; remove what it is made from (for the mirroring controller, an Endpoints \
                 without the label {SKIP_MIRROR_LABEL}: \"true\")"
            ),
        }
    }
}

/// The pass's decision, from what it read, what it remembers and the time: the members, the
/// writes that bring the Endpoints and slices to them, and what to say about it.
pub fn plan(
    snapshot: &Snapshot,
    memory: &mut Memory,
    section: &Section,
    target: &EndpointsTarget,
    now: Timestamp,
    mono: Instant,
) -> Plan {
    let listed = listed(section, snapshot.endpoints.as_ref(), &snapshot.slices);
    let mut plan = Plan {
        target: target.clone(),
        ..Plan::default()
    };
    if snapshot.endpoints_left && !std::mem::replace(&mut memory.warned_endpoints_left, true) {
        plan.findings.push(Finding::EndpointsLeft);
    }
    let slices = snapshot.slices.iter().chain(&snapshot.unlabelled);
    let foreign: BTreeMap<String, String> = foreign_slices(target, slices).into_iter().collect();
    for name in newly(&mut memory.warned_foreign, foreign.keys().cloned()) {
        let manager = foreign.get(&name).cloned().unwrap_or_default();
        plan.findings.push(Finding::ForeignSlice { name, manager });
    }
    plan.members = match &snapshot.sources {
        Sources::Leases(leases) => {
            lease_members(&mut plan, memory, section, target, leases, (now, mono))
        }
        Sources::Static(answers) => {
            let entries = section.static_entries();
            static_members(&entries, answers, memory, &mut plan.findings)
        }
        Sources::MasterCount { ready } => match (snapshot.own, ready) {
            (Some(own), Some(true)) => master_count_members(
                &listed,
                own,
                usize::try_from(section.apiserver_count).unwrap_or(usize::MAX),
            ),
            (Some(own), Some(false)) => {
                let mut without = listed.clone();
                without.remove(&own);
                without
            }
            (None, _) | (_, None) => listed.clone(),
        },
        Sources::None => MemberSet::new(),
    };
    if snapshot.withdrawing
        && let Some(own) = snapshot.own
    {
        plan.members.remove(&own);
    }
    let family = leave_out_unusable(&mut plan, memory, snapshot.service_family.as_ref());
    plan.target.primary_family = Some(family);
    if !snapshot.withdrawing {
        let previous = memory.previous.get_or_insert(listed);
        if plan.members.is_empty() {
            // Upstream refuses too (`doReconcile` in `pkg/controlplane/reconcilers/lease.go`): an
            // empty list would cut every in-cluster client off. Only the last member's own
            // shutdown may empty it.
            plan.refused = Some(if previous.is_empty() {
                "no live apiserver members yet; nothing to write until one renews its Lease"
            } else {
                "no live apiserver members; refusing to erase all endpoints (kept as they are)"
            });
            if memory.empty.observe(now, section.lease_ttl) {
                plan.findings.push(Finding::NoMembersForLong {
                    waited: section.lease_ttl,
                });
            }
            return plan;
        }
        plan.change = previous.changes_to(&plan.members);
        memory.empty = EmptyStreak::default();
        if section.name_conflicting_writers {
            plan.writers = other_writers(target, snapshot.endpoints.as_ref(), &snapshot.slices);
        }
    }
    plan.writes = writes(
        &plan.target,
        &plan.members,
        snapshot,
        section.write_endpoints,
    );
    plan
}

/// `lease` mode: the members whose Lease is live, the expired ones, when the next one runs out,
/// and what is wrong with the others.
fn lease_members(
    plan: &mut Plan,
    memory: &mut Memory,
    section: &Section,
    target: &EndpointsTarget,
    leases: &[Lease],
    (now, mono): (Timestamp, Instant),
) -> MemberSet {
    let judged = membership(leases, now, mono, section.lease_ttl, &mut memory.sightings);
    plan.lease_problems = judged.problems;
    // One port for all members (the Endpoints have one subset): a member whose sidecar says
    // otherwise is misconfigured, and clients would miss it.
    let other_ports = (judged.live.iter())
        .filter_map(|member| Some((member.address, member.port.filter(|p| *p != target.port)?)));
    for (member, port) in newly(&mut memory.warned_ports, other_ports) {
        plan.findings.push(Finding::OtherPort { member, port });
    }
    plan.expired = judged.expired.iter().map(|m| m.address).collect();
    plan.next_expiry = judged.next_expiry;
    judged.members
}

/// `static` mode: the configured addresses, names resolved. A name whose lookup fails or finds
/// nothing (absent from `answers`: not resolved) keeps its last good addresses, and is warned
/// about once per run of failures.
fn static_members(
    entries: &[StaticAddress],
    answers: &BTreeMap<String, Result<Vec<IpAddr>, String>>,
    memory: &mut Memory,
    findings: &mut Vec<Finding>,
) -> MemberSet {
    let mut members = MemberSet::new();
    for entry in entries {
        let name = match entry {
            StaticAddress::Ip(ip) => {
                members.insert(*ip);
                continue;
            }
            StaticAddress::Name(name) => name,
        };
        let answer = match answers.get(name) {
            Some(Ok(ips)) if ips.is_empty() => Err("resolved to no addresses".to_owned()),
            Some(answer) => answer.clone(),
            None => Err("not resolved".to_owned()),
        };
        match answer {
            Ok(ips) => {
                members.extend(ips.iter().copied());
                memory.last_good.insert(name.clone(), ips);
                if memory.failing.remove(name) {
                    findings.push(Finding::StaticResolves { name: name.clone() });
                }
            }
            Err(reason) => {
                let kept = memory.last_good.get(name).cloned().unwrap_or_default();
                members.extend(kept.iter().copied());
                if memory.failing.insert(name.clone()) {
                    let name = name.clone();
                    findings.push(Finding::StaticLookupFailed { name, reason, kept });
                }
            }
        }
    }
    members
}

/// Upstream's `master-count` rule (`ReconcileEndpoints` in
/// `pkg/controlplane/reconcilers/instancecount.go`): our own address is always listed; when there
/// are more than `count` addresses, the ones following ours in (string) order are dropped, wrapping
/// around. Unlike upstream's loop, which can drop its own address when the removal wraps, ours is
/// always kept.
pub fn master_count_members(listed: &MemberSet, own: IpAddr, count: usize) -> MemberSet {
    let mut all = listed.clone();
    all.insert(own);
    if all.len() <= count.max(1) {
        return all;
    }
    let order = all.sorted_strings();
    let own_text = own.to_string();
    let start = order.iter().position(|s| *s == own_text).unwrap_or(0);
    // Keep ours and the ones *before* it (cyclically), i.e. drop the ones right after it.
    let keep = count.max(1);
    let n = order.len();
    (0..keep)
        .map(|back| &order[(start + n - back) % n])
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// Leaves out the members of the other family than the Service's and the addresses the API
/// server would reject, each warned about once; gives the Service's family.
fn leave_out_unusable(
    plan: &mut Plan,
    memory: &mut Memory,
    service_family: Option<&(IpFamily, String)>,
) -> IpFamily {
    // One family, the Service's, as upstream (`pkg/controlplane/reconcilers` lists the addresses
    // of the apiservers, which share the Service's family): clients of an IPv6 Service cannot
    // use IPv4 endpoints. A member of the other family is a misconfigured sidecar, left out and
    // reported once.
    let (family, source) = match service_family {
        Some((family, source)) => (*family, source.as_str()),
        None => (
            plan.target.primary_family(&plan.members),
            "its members (no serviceClusterIPRange, and the Service does not exist yet)",
        ),
    };
    let other: Vec<IpAddr> = (plan.members.iter())
        .filter(|ip| IpFamily::of(**ip) != family)
        .copied()
        .collect();
    for member in &other {
        plan.members.remove(member);
    }
    for member in newly(&mut memory.warned_family, other) {
        let note = format!(
            "left out {member}: an {} address, but the {} Service is {} (from {source}); set \
             that apiserver's advertiseAddress (--advertise-address) to its {} address",
            IpFamily::of(member).as_str(),
            plan.target.service_name,
            family.as_str(),
            family.as_str()
        );
        plan.findings.push(Finding::WrongFamily { member, note });
    }
    let rejected: Vec<(IpAddr, &'static str)> = (plan.members.iter())
        .filter_map(|ip| endpoint_ip_problem(ip).map(|why| (*ip, why)))
        .collect();
    for (member, _) in &rejected {
        plan.members.remove(member);
    }
    let why: BTreeMap<IpAddr, &'static str> = rejected.into_iter().collect();
    for member in newly(&mut memory.warned_invalid, why.keys().copied()) {
        let why = why.get(&member).copied().unwrap_or_default();
        plan.findings.push(Finding::Rejected { member, why });
    }
    family
}

/// The items of `current` that `warned` does not hold, which then holds `current`: each is
/// warned about when it appears, again only after it cleared and came back, and `warned` never
/// holds more than what the pass found (names and addresses come from the cluster).
fn newly<K: Ord + Clone>(warned: &mut BTreeSet<K>, current: impl IntoIterator<Item = K>) -> Vec<K> {
    let current: BTreeSet<K> = current.into_iter().collect();
    let new = current.difference(warned).cloned().collect();
    *warned = current;
    new
}

/// Who the endpoints list now: the Endpoints' addresses, or with slices only, the slices'.
pub fn listed(
    section: &Section,
    endpoints: Option<&Endpoints>,
    slices: &[EndpointSlice],
) -> MemberSet {
    if section.write_endpoints {
        return endpoints.map(listed_members).unwrap_or_default();
    }
    slice_members(slices)
}

/// The writes that bring the Endpoints (when written) and the slices to `members`.
fn writes(
    target: &EndpointsTarget,
    members: &MemberSet,
    snapshot: &Snapshot,
    write_endpoints: bool,
) -> Vec<Write> {
    let mut writes = Vec::new();
    let existing = snapshot.endpoints.as_ref();
    let drift = if write_endpoints {
        endpoints_drift(target, members, existing)
    } else {
        Vec::new()
    };
    if !drift.is_empty() {
        let object = desired_endpoints(target, members, existing);
        writes.push(Write {
            name: target.service_name.clone(),
            op: match existing {
                None => Op::CreateEndpoints(object),
                Some(_) => Op::ReplaceEndpoints(object),
            },
            uid: None,
            drift,
        });
    }
    let slices: Vec<EndpointSlice> = (snapshot.slices.iter().chain(&snapshot.unlabelled))
        .cloned()
        .collect();
    writes.extend(plan_slices(target, members, &slices));
    writes
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A slice another controller keeps is named once, however many passes meet it, and again
    /// once it was gone and came back; what is remembered is what the last pass found, however
    /// many names come and go.
    #[test]
    fn a_foreign_slice_is_reported_once() {
        let target = EndpointsTarget {
            namespace: "default".into(),
            service_name: "kubernetes".into(),
            port: 6443,
            primary_family: None,
        };
        let mut mirrored = EndpointSlice {
            address_type: "IPv4".into(),
            ..EndpointSlice::default()
        };
        mirrored.metadata.name = Some("kubernetes-x7k2p".into());
        mirrored.metadata.labels = Some(
            [
                ("kubernetes.io/service-name", "kubernetes"),
                (MANAGED_BY_LABEL, "endpointslicemirroring-controller.k8s.io"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        );
        let snapshot = Snapshot {
            endpoints: None,
            endpoints_left: false,
            slices: vec![mirrored],
            unlabelled: None,
            sources: Sources::None,
            service_family: None,
            own: None,
            withdrawing: false,
        };
        let mut memory = Memory::default();
        let section = Section::default();
        let now = Timestamp::now();
        let first = plan(
            &snapshot,
            &mut memory,
            &section,
            &target,
            now,
            Instant::now(),
        );
        assert!(
            matches!(first.findings.as_slice(), [Finding::ForeignSlice { name, .. }] if name == "kubernetes-x7k2p"),
            "{:?}",
            first.findings
        );
        let again = plan(
            &snapshot,
            &mut memory,
            &section,
            &target,
            now,
            Instant::now(),
        );
        assert!(again.findings.is_empty(), "{:?}", again.findings);

        let mut snapshot = snapshot;
        for n in 0..100 {
            snapshot.slices[0].metadata.name = Some(format!("kubernetes-churn-{n}"));
            let pass = plan(
                &snapshot,
                &mut memory,
                &section,
                &target,
                now,
                Instant::now(),
            );
            assert_eq!(pass.findings.len(), 1, "{:?}", pass.findings);
        }
        assert_eq!(
            memory.warned_foreign.len(),
            1,
            "only the last pass's names are kept"
        );
        snapshot.slices[0].metadata.name = Some("kubernetes-x7k2p".into());
        let back = plan(
            &snapshot,
            &mut memory,
            &section,
            &target,
            now,
            Instant::now(),
        );
        assert!(
            matches!(back.findings.as_slice(), [Finding::ForeignSlice { name, .. }] if name == "kubernetes-x7k2p"),
            "named again once back: {:?}",
            back.findings
        );
    }

    #[test]
    fn master_count_adds_own_within_count() {
        let m = master_count_members(&set(&["192.0.2.1"]), ip("192.0.2.2"), 3);
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.2"]));
    }

    #[test]
    fn master_count_drops_the_ones_after_own_wrapping() {
        let listed = set(&["192.0.2.1", "192.0.2.2", "192.0.2.4"]);
        // Sorted: .1 .2 .3(own) .4 -> keep own and the two before it.
        assert_eq!(
            master_count_members(&listed, ip("192.0.2.3"), 3),
            set(&["192.0.2.1", "192.0.2.2", "192.0.2.3"])
        );
        // Own first: the ones before it wrap to the end.
        let listed = set(&["192.0.2.2", "192.0.2.3", "192.0.2.4"]);
        assert_eq!(
            master_count_members(&listed, ip("192.0.2.1"), 2),
            set(&["192.0.2.1", "192.0.2.4"])
        );
        assert_eq!(
            master_count_members(&listed, ip("192.0.2.1"), 1),
            set(&["192.0.2.1"])
        );
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(ips: &[&str]) -> MemberSet {
        ips.iter().map(|s| ip(s)).collect()
    }

    #[test]
    fn static_keeps_last_good_set_on_failure_and_empty_answer() {
        let entries = vec![
            StaticAddress::Ip(ip("192.0.2.9")),
            StaticAddress::Name("lb.example.com".into()),
        ];
        let mut memory = Memory::default();
        let mut pass = |answer: Option<Result<Vec<IpAddr>, String>>| {
            let answers = answer.map(|a| ("lb.example.com".to_owned(), a));
            let mut findings = Vec::new();
            let members = static_members(
                &entries,
                &answers.into_iter().collect(),
                &mut memory,
                &mut findings,
            );
            (members, findings)
        };
        let (m, findings) = pass(Some(Ok(vec![ip("192.0.2.1"), ip("fd00::1")])));
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));
        assert_eq!(findings, vec![]);

        let (m, findings) = pass(Some(Ok(vec![])));
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));
        assert!(
            matches!(&findings[..], [Finding::StaticLookupFailed { reason, kept, .. }]
                if reason.contains("no addresses") && kept.len() == 2),
            "{findings:?}"
        );

        let (m, findings) = pass(Some(Err("SERVFAIL".to_owned())));
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));
        assert_eq!(findings, vec![], "warned once per run of failures");

        let (m, findings) = pass(Some(Ok(vec![ip("192.0.2.2")])));
        assert_eq!(m, set(&["192.0.2.2", "192.0.2.9"]));
        assert_eq!(
            findings,
            vec![Finding::StaticResolves {
                name: "lb.example.com".to_owned()
            }]
        );
    }

    #[test]
    fn static_name_never_resolved_contributes_nothing() {
        let entries = vec![StaticAddress::Name("lb.example.com".into())];
        let mut findings = Vec::new();
        let m = static_members(
            &entries,
            &BTreeMap::new(),
            &mut Memory::default(),
            &mut findings,
        );
        assert!(m.is_empty());
        assert!(
            matches!(&findings[..], [Finding::StaticLookupFailed { kept, .. }] if kept.is_empty())
        );
    }
}

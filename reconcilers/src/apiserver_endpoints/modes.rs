//! Pure member computations of the `static` and `master-count` modes.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::StaticAddress;
use super::members::MemberSet;

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

/// What one `static` entry contributed in one pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EntryOutcome {
    Ip,
    Resolved(Vec<IpAddr>),
    /// Failed or empty answer; `kept` is the last good answer still used (maybe empty).
    Failed {
        reason: String,
        kept: Vec<IpAddr>,
    },
}

/// Combine this pass's answers with the last good ones. `answers` maps each name to its lookup
/// result; a name absent from `answers` counts as failed. `last_good` is updated in place.
pub fn static_members(
    entries: &[StaticAddress],
    answers: &BTreeMap<String, Result<Vec<IpAddr>, String>>,
    last_good: &mut BTreeMap<String, Vec<IpAddr>>,
) -> (MemberSet, Vec<(String, EntryOutcome)>) {
    let mut members = MemberSet::new();
    let mut outcomes = Vec::new();
    for entry in entries {
        match entry {
            StaticAddress::Ip(ip) => {
                members.insert(*ip);
                outcomes.push((ip.to_string(), EntryOutcome::Ip));
            }
            StaticAddress::Name(name) => {
                let answer = answers
                    .get(name)
                    .cloned()
                    .unwrap_or_else(|| Err("not resolved".to_owned()));
                let outcome = match answer {
                    Ok(ips) if !ips.is_empty() => {
                        last_good.insert(name.clone(), ips.clone());
                        EntryOutcome::Resolved(ips)
                    }
                    Ok(_) => EntryOutcome::Failed {
                        reason: "resolved to no addresses".to_owned(),
                        kept: last_good.get(name).cloned().unwrap_or_default(),
                    },
                    Err(reason) => EntryOutcome::Failed {
                        reason,
                        kept: last_good.get(name).cloned().unwrap_or_default(),
                    },
                };
                match &outcome {
                    EntryOutcome::Resolved(ips) | EntryOutcome::Failed { kept: ips, .. } => {
                        for ip in ips {
                            members.insert(*ip);
                        }
                    }
                    EntryOutcome::Ip => {}
                }
                outcomes.push((name.clone(), outcome));
            }
        }
    }
    (members, outcomes)
}

/// What a `static` pass says about its names: a lookup that fails is warned about once (its last
/// good addresses kept, a Warning event to publish returned), and said again when it resolves.
pub fn note_static_outcomes(
    outcomes: Vec<(String, EntryOutcome)>,
    failing: &mut std::collections::BTreeSet<String>,
) -> Vec<(String, String)> {
    let mut warnings = Vec::new();
    for (name, outcome) in outcomes {
        match outcome {
            EntryOutcome::Failed { reason, kept } => {
                if failing.insert(name.clone()) {
                    let kept_text = kept
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ");
                    tracing::warn!(%name, %reason, kept = %kept_text, "static address lookup failed; keeping the last good set");
                    warnings.push((
                        "StaticAddressResolutionFailed".to_owned(),
                        format!("resolving {name} failed ({reason}); keeping its last good addresses [{kept_text}]"),
                    ));
                }
            }
            EntryOutcome::Resolved(_) => {
                if failing.remove(&name) {
                    tracing::info!(%name, "static address resolves again");
                }
            }
            EntryOutcome::Ip => {}
        }
    }
    warnings
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn set(ips: &[&str]) -> MemberSet {
        ips.iter().map(|s| ip(s)).collect()
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

    #[test]
    fn static_keeps_last_good_set_on_failure_and_empty_answer() {
        let entries = vec![
            StaticAddress::Ip(ip("192.0.2.9")),
            StaticAddress::Name("lb.example.com".into()),
        ];
        let mut last_good = BTreeMap::new();
        let ok = BTreeMap::from([(
            "lb.example.com".to_owned(),
            Ok(vec![ip("192.0.2.1"), ip("fd00::1")]),
        )]);
        let (m, _) = static_members(&entries, &ok, &mut last_good);
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));

        let empty = BTreeMap::from([("lb.example.com".to_owned(), Ok(vec![]))]);
        let (m, outcomes) = static_members(&entries, &empty, &mut last_good);
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));
        assert!(
            matches!(&outcomes[1].1, EntryOutcome::Failed { reason, .. } if reason.contains("no addresses"))
        );

        let failed = BTreeMap::from([("lb.example.com".to_owned(), Err("SERVFAIL".to_owned()))]);
        let (m, _) = static_members(&entries, &failed, &mut last_good);
        assert_eq!(m, set(&["192.0.2.1", "192.0.2.9", "fd00::1"]));

        let moved = BTreeMap::from([("lb.example.com".to_owned(), Ok(vec![ip("192.0.2.2")]))]);
        let (m, _) = static_members(&entries, &moved, &mut last_good);
        assert_eq!(m, set(&["192.0.2.2", "192.0.2.9"]));
    }

    #[test]
    fn static_name_never_resolved_contributes_nothing() {
        let entries = vec![StaticAddress::Name("lb.example.com".into())];
        let (m, outcomes) = static_members(&entries, &BTreeMap::new(), &mut BTreeMap::new());
        assert!(m.is_empty());
        assert!(matches!(&outcomes[0].1, EntryOutcome::Failed { kept, .. } if kept.is_empty()));
    }
}

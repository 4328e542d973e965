//! The member model: which apiserver addresses belong in the `kubernetes` endpoints.
//!
//! Every write of the Endpoints object and of the EndpointSlices is derived from one [`MemberSet`],
//! so the two can never disagree about who the members are.

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;

use crate::alloc::IpFamily;

/// The set of apiserver addresses that should be listed, both families together.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemberSet {
    ips: BTreeSet<IpAddr>,
}

impl MemberSet {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, ip: IpAddr) -> bool {
        self.ips.insert(canonical(ip))
    }

    pub fn remove(&mut self, ip: &IpAddr) -> bool {
        self.ips.remove(&canonical(*ip))
    }

    pub fn contains(&self, ip: &IpAddr) -> bool {
        self.ips.contains(&canonical(*ip))
    }

    pub fn is_empty(&self) -> bool {
        self.ips.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ips.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = &IpAddr> {
        self.ips.iter()
    }

    pub fn count(&self, family: IpFamily) -> usize {
        self.ips
            .iter()
            .filter(|ip| IpFamily::of(**ip) == family)
            .count()
    }

    pub fn has_family(&self, family: IpFamily) -> bool {
        self.ips.iter().any(|ip| IpFamily::of(*ip) == family)
    }

    /// All addresses as strings, in the order upstream writes them: sorted by the address
    /// *string* (`RepackSubsets` sorts by `ip` string), so `10.0.0.10` comes before `10.0.0.9`.
    /// Matching upstream keeps objects written by us and by kube-apiserver byte-identical.
    pub fn sorted_strings(&self) -> Vec<String> {
        let mut out: Vec<String> = self.ips.iter().map(ToString::to_string).collect();
        out.sort();
        out
    }

    /// The addresses of one family, in the same string order.
    pub fn sorted_strings_of(&self, family: IpFamily) -> Vec<String> {
        let mut out: Vec<String> = self
            .ips
            .iter()
            .filter(|ip| IpFamily::of(**ip) == family)
            .map(ToString::to_string)
            .collect();
        out.sort();
        out
    }

    /// Who joined and who left between `self` (before) and `next` (after).
    pub fn changes_to(&self, next: &MemberSet) -> MembershipChange {
        MembershipChange {
            joined: next.ips.difference(&self.ips).copied().collect(),
            left: self.ips.difference(&next.ips).copied().collect(),
        }
    }
}

impl Extend<IpAddr> for MemberSet {
    fn extend<T: IntoIterator<Item = IpAddr>>(&mut self, iter: T) {
        for ip in iter {
            self.insert(ip);
        }
    }
}

impl FromIterator<IpAddr> for MemberSet {
    fn from_iter<T: IntoIterator<Item = IpAddr>>(iter: T) -> Self {
        let mut set = MemberSet::new();
        set.extend(iter);
        set
    }
}

impl fmt::Display for MemberSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}]", self.sorted_strings().join(", "))
    }
}

/// The difference between two member sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MembershipChange {
    pub joined: Vec<IpAddr>,
    pub left: Vec<IpAddr>,
}

impl MembershipChange {
    pub fn is_empty(&self) -> bool {
        self.joined.is_empty() && self.left.is_empty()
    }
}

/// IPv4-mapped IPv6 addresses (`::ffff:10.0.0.1`) are stored as IPv4: the API server validates
/// Endpoints addresses as the family they really are, and two spellings of one address must not
/// count as two members.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        },
        v4 => v4,
    }
}

/// Why the API server would reject `ip` as an endpoint address (upstream `ValidateEndpointIP`),
/// or `None`. One such member would make every Endpoints write fail, so members are checked
/// before they are written.
pub fn endpoint_ip_problem(ip: &IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        return Some("may not be unspecified (0.0.0.0, ::)");
    }
    if ip.is_loopback() {
        return Some("may not be in the loopback range (127.0.0.0/8, ::1/128)");
    }
    let link_local_unicast = match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    };
    if link_local_unicast {
        return Some("may not be in the link-local range (169.254.0.0/16, fe80::/10)");
    }
    let link_local_multicast = match ip {
        IpAddr::V4(v4) => v4.octets()[..3] == [224, 0, 0],
        IpAddr::V6(v6) => v6.is_multicast() && (v6.segments()[0] & 0x000f) == 0x0002,
    };
    if link_local_multicast {
        return Some("may not be in the link-local multicast range (224.0.0.0/24, ff02::/16)");
    }
    None
}

/// Parse an address as written in an Endpoints/EndpointSlice/Lease, tolerating surrounding space.
pub fn parse_ip(text: &str) -> Option<IpAddr> {
    text.trim().parse::<IpAddr>().ok().map(canonical)
}

/// A run of passes that found no member. At start that is normal for a moment (this instance's
/// Lease may not be written yet, its namespace may not exist yet, and watch events can run two
/// passes within a second), so the warning waits until the run has lasted a whole lease period:
/// by then every live member has renewed its Lease at least once.
#[derive(Debug, Default)]
pub struct EmptyStreak {
    since: Option<Timestamp>,
    warned: bool,
}

impl EmptyStreak {
    /// Records a pass without members at `now`; true exactly once per run, when it has lasted
    /// `grace`.
    pub fn observe(&mut self, now: Timestamp, grace: Duration) -> bool {
        let since = *self.since.get_or_insert(now);
        // A clock stepped back counts as no time passed.
        let lasted = Duration::try_from(now.duration_since(since)).unwrap_or_default();
        if self.warned || lasted < grace {
            return false;
        }
        self.warned = true;
        true
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn sorted_like_upstream_by_string_not_numerically() {
        let set: MemberSet = [ip("192.0.2.9"), ip("192.0.2.10"), ip("192.0.2.1")]
            .into_iter()
            .collect();
        assert_eq!(
            set.sorted_strings(),
            vec!["192.0.2.1", "192.0.2.10", "192.0.2.9"]
        );
    }

    #[test]
    fn families_are_split_and_counted() {
        let set: MemberSet = [ip("fd00::2"), ip("192.0.2.1"), ip("fd00::1")]
            .into_iter()
            .collect();
        assert_eq!(set.count(IpFamily::V4), 1);
        assert_eq!(set.count(IpFamily::V6), 2);
        assert_eq!(
            set.sorted_strings_of(IpFamily::V6),
            vec!["fd00::1", "fd00::2"]
        );
        assert_eq!(set.sorted_strings_of(IpFamily::V4), vec!["192.0.2.1"]);
        assert!(set.has_family(IpFamily::V6));
    }

    #[test]
    fn mapped_ipv6_counts_as_the_ipv4_member() {
        let mut set = MemberSet::new();
        assert!(set.insert(ip("192.0.2.1")));
        assert!(!set.insert(ip("::ffff:192.0.2.1")));
        assert_eq!(set.len(), 1);
        assert_eq!(parse_ip(" ::ffff:192.0.2.2 "), Some(ip("192.0.2.2")));
        assert_eq!(parse_ip("not-an-ip"), None);
    }

    #[test]
    fn changes_report_joined_and_left() {
        let before: MemberSet = [ip("192.0.2.1"), ip("192.0.2.2")].into_iter().collect();
        let after: MemberSet = [ip("192.0.2.2"), ip("192.0.2.3")].into_iter().collect();
        let change = before.changes_to(&after);
        assert_eq!(change.joined, vec![ip("192.0.2.3")]);
        assert_eq!(change.left, vec![ip("192.0.2.1")]);
        assert!(before.changes_to(&before).is_empty());
    }

    #[test]
    fn addresses_the_api_rejects_are_named() {
        for bad in [
            "0.0.0.0",
            "::",
            "127.0.0.1",
            "::1",
            "169.254.1.1",
            "fe80::1",
            "224.0.0.5",
            "ff02::1",
        ] {
            assert!(endpoint_ip_problem(&ip(bad)).is_some(), "{bad}");
        }
        // Private, unique-local, documentation and public addresses are all valid members.
        for good in ["10.0.0.1", "192.0.2.1", "fd00::1", "2001:db8::1", "8.8.8.8"] {
            assert_eq!(endpoint_ip_problem(&ip(good)), None, "{good}");
        }
    }

    #[test]
    fn an_empty_member_list_is_warned_about_once_after_a_whole_lease_period() {
        let grace = Duration::from_secs(15);
        let start = Timestamp::UNIX_EPOCH;
        let mut streak = EmptyStreak::default();
        // Two passes within a second at start: no warning.
        assert!(!streak.observe(start, grace));
        assert!(!streak.observe(start + Duration::from_millis(240), grace));
        assert!(!streak.observe(start + Duration::from_secs(14), grace));
        assert!(
            streak.observe(start + grace, grace),
            "warned once the period is over"
        );
        assert!(
            !streak.observe(start + Duration::from_secs(30), grace),
            "and only once"
        );
        // A member came back; a new run waits a whole period again.
        let mut streak = EmptyStreak::default();
        let later = start + Duration::from_secs(60);
        assert!(!streak.observe(later, grace));
        assert!(streak.observe(later + Duration::from_secs(16), grace));
    }
}

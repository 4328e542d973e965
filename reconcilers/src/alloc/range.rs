//! One service range: offset <-> address math, the addresses a Service may hold, and sizes.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// An IP family, spelled as Kubernetes spells it (`IPv4`, `IPv6`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IpFamily {
    V4,
    V6,
}

impl IpFamily {
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }

    pub fn of_net(net: &IpNet) -> Self {
        match net {
            IpNet::V4(_) => IpFamily::V4,
            IpNet::V6(_) => IpFamily::V6,
        }
    }

    /// The value of `v1.IPFamily`, of an EndpointSlice's `addressType` and of the
    /// `ipaddress.kubernetes.io/ip-family` label.
    pub fn as_str(self) -> &'static str {
        match self {
            IpFamily::V4 => "IPv4",
            IpFamily::V6 => "IPv6",
        }
    }

    pub fn other(self) -> Self {
        match self {
            IpFamily::V4 => IpFamily::V6,
            IpFamily::V6 => IpFamily::V4,
        }
    }

    /// Lower-case short form used in object names (`ipv4`, `ipv6`).
    pub fn short(self) -> &'static str {
        match self {
            IpFamily::V4 => "ipv4",
            IpFamily::V6 => "ipv6",
        }
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Parses an IP the way Kubernetes' `netutils.ParseIPSloppy` does: IPv4 octets may carry leading
/// zeros (read as decimal, not octal), and an IPv4-mapped IPv6 address is an IPv4 address.
///
/// Objects written by old API servers can hold such spellings; rejecting them would report valid
/// Services as corrupt.
pub fn parse_ip_sloppy(text: &str) -> Option<IpAddr> {
    if let Ok(ip) = text.parse::<IpAddr>() {
        return Some(match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
            v4 => v4,
        });
    }
    parse_ipv4_leading_zeros(text).map(IpAddr::V4)
}

fn parse_ipv4_leading_zeros(text: &str) -> Option<Ipv4Addr> {
    let mut octets = [0u8; 4];
    let mut parts = text.split('.');
    for octet in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *octet = part.parse().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Ipv4Addr::from(octets))
}

/// A service IP range (one CIDR), with addresses numbered as offsets from the network address.
///
/// IPv4 addresses are handled as `u32` and IPv6 as `u128`; both are widened to `u128` offsets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceRange {
    net: IpNet,
}

impl ServiceRange {
    /// The range of `net`, with host bits cleared (`10.0.0.7/24` is `10.0.0.0/24`).
    pub fn new(net: IpNet) -> Self {
        Self { net: net.trunc() }
    }

    pub fn net(&self) -> IpNet {
        self.net
    }

    pub fn family(&self) -> IpFamily {
        IpFamily::of_net(&self.net)
    }

    pub fn host_bits(&self) -> u8 {
        self.net.max_prefix_len() - self.net.prefix_len()
    }

    fn network_number(&self) -> u128 {
        ip_to_u128(self.net.network())
    }

    /// Offset of `ip` from the network address, or `None` when `ip` is outside the CIDR or of the
    /// other family.
    pub fn offset_of(&self, ip: IpAddr) -> Option<u128> {
        if IpFamily::of(ip) != self.family() || !self.net.contains(&ip) {
            return None;
        }
        Some(ip_to_u128(ip) - self.network_number())
    }

    /// The address at `offset` from the network address, or `None` past the end of the CIDR.
    pub fn address_at(&self, offset: u128) -> Option<IpAddr> {
        let host_bits = u32::from(self.host_bits());
        if host_bits < 128 && offset >> host_bits != 0 {
            return None;
        }
        let number = self.network_number().checked_add(offset)?;
        Some(match self.family() {
            IpFamily::V4 => IpAddr::V4(Ipv4Addr::from(u32::try_from(number).ok()?)),
            IpFamily::V6 => IpAddr::V6(Ipv6Addr::from(number)),
        })
    }

    /// The first address a Service can get: network + 1. Upstream gives it to the `kubernetes`
    /// Service (`GetIndexedIP(range, 1)`, e.g. `10.96.0.1`). `None` for a range too small to
    /// hold any Service address.
    pub fn first_usable(&self) -> Option<IpAddr> {
        if self.usable_size() == 0 {
            return None;
        }
        self.address_at(1)
    }

    /// Whether a Service may hold `ip` in this range, as upstream's `servicecidr.ContainsIP`
    /// decides: inside the CIDR, not the network address and, for IPv4, not the broadcast
    /// address (a ServiceCIDR never allocates those, so a Service holding one is out of range).
    pub fn holds_service_ip(&self, ip: IpAddr) -> bool {
        let Some(offset) = self.offset_of(ip) else {
            return false;
        };
        if offset == 0 {
            return false;
        }
        match self.family() {
            IpFamily::V4 => offset != self.last_offset(),
            IpFamily::V6 => true,
        }
    }

    fn last_offset(&self) -> u128 {
        let host_bits = u32::from(self.host_bits());
        if host_bits >= 128 {
            u128::MAX
        } else {
            (1u128 << host_bits) - 1
        }
    }

    /// Total addresses in the CIDR, saturating at `u128::MAX` for `::/0`.
    pub fn total_size(&self) -> u128 {
        self.last_offset().saturating_add(1)
    }

    /// Addresses a Service can hold: all but the network address, and for IPv4 also all but the
    /// broadcast address.
    pub fn usable_size(&self) -> u128 {
        let reserved = match self.family() {
            IpFamily::V4 => 2,
            IpFamily::V6 => 1,
        };
        self.total_size().saturating_sub(reserved)
    }

    /// Size of the legacy bitmap allocator upstream keeps for this range (`ipallocator.New`):
    /// IPv4 drops the network and broadcast addresses, IPv6 is capped at 65,536 addresses
    /// before dropping the network address. IPs past the cap were reported out of range upstream
    /// (kubernetes/kubernetes#86497); we only expose the number, the audit does not reproduce it.
    pub fn legacy_bitmap_size(&self) -> u128 {
        match self.family() {
            IpFamily::V4 => self.total_size().saturating_sub(2),
            IpFamily::V6 => self.total_size().min(65_536).saturating_sub(1),
        }
    }
}

impl fmt::Display for ServiceRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.net.fmt(f)
    }
}

fn ip_to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn range(cidr: &str) -> ServiceRange {
        ServiceRange::new(cidr.parse().unwrap())
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn offsets_round_trip_in_both_families() {
        let v4 = range("10.96.0.0/12");
        assert_eq!(v4.offset_of(ip("10.96.0.1")), Some(1));
        assert_eq!(v4.offset_of(ip("10.111.255.255")), Some((1 << 20) - 1));
        assert_eq!(v4.address_at(1), Some(ip("10.96.0.1")));
        assert_eq!(v4.address_at(1 << 20), None);
        assert_eq!(v4.offset_of(ip("10.112.0.0")), None);
        assert_eq!(v4.offset_of(ip("fd00::1")), None);

        let v6 = range("fd00:10:96::/112");
        assert_eq!(v6.offset_of(ip("fd00:10:96::ff")), Some(255));
        assert_eq!(v6.address_at(255), Some(ip("fd00:10:96::ff")));
        assert_eq!(v6.address_at(65_536), None);

        let whole = range("::/0");
        assert_eq!(
            whole.address_at(u128::MAX),
            Some(ip("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"))
        );
        assert_eq!(whole.total_size(), u128::MAX);
    }

    #[test]
    fn host_bits_are_cleared() {
        assert_eq!(range("10.0.0.7/24").net().to_string(), "10.0.0.0/24");
    }

    #[test]
    fn first_usable_is_network_plus_one() {
        assert_eq!(range("10.96.0.0/12").first_usable(), Some(ip("10.96.0.1")));
        assert_eq!(range("10.0.0.0/24").first_usable(), Some(ip("10.0.0.1")));
        assert_eq!(range("fd00::/108").first_usable(), Some(ip("fd00::1")));
        assert_eq!(range("10.0.0.0/31").first_usable(), None);
        assert_eq!(range("10.0.0.0/32").first_usable(), None);
        assert_eq!(range("fd00::1/128").first_usable(), None);
    }

    #[test]
    fn service_ips_exclude_network_and_ipv4_broadcast() {
        let v4 = range("10.0.0.0/24");
        assert!(!v4.holds_service_ip(ip("10.0.0.0")));
        assert!(v4.holds_service_ip(ip("10.0.0.1")));
        assert!(v4.holds_service_ip(ip("10.0.0.254")));
        assert!(!v4.holds_service_ip(ip("10.0.0.255")));
        assert!(!v4.holds_service_ip(ip("10.0.1.1")));

        let v6 = range("fd00::/120");
        assert!(!v6.holds_service_ip(ip("fd00::")));
        assert!(v6.holds_service_ip(ip("fd00::ff")));
        assert!(!v6.holds_service_ip(ip("10.0.0.1")));
    }

    #[test]
    fn sizes_follow_upstream() {
        assert_eq!(range("10.0.0.0/24").usable_size(), 254);
        assert_eq!(range("10.0.0.0/24").legacy_bitmap_size(), 254);
        assert_eq!(range("10.96.0.0/12").legacy_bitmap_size(), (1 << 20) - 2);
        assert_eq!(range("10.0.0.0/31").usable_size(), 0);
        assert_eq!(range("10.0.0.0/32").legacy_bitmap_size(), 0);
        assert_eq!(range("fd00::/120").usable_size(), 255);
        assert_eq!(range("fd00::/120").legacy_bitmap_size(), 255);
        assert_eq!(range("fd00::/108").usable_size(), (1 << 20) - 1);
        assert_eq!(range("fd00::/108").legacy_bitmap_size(), 65_535);
        assert_eq!(range("fd00::/64").legacy_bitmap_size(), 65_535);
        assert_eq!(range("fd00::/64").usable_size(), (1u128 << 64) - 1);
        assert_eq!(range("0.0.0.0/0").usable_size(), (1u128 << 32) - 2);
    }

    #[test]
    fn sloppy_parsing_matches_kubernetes() {
        assert_eq!(parse_ip_sloppy("192.0.2.1"), Some(ip("192.0.2.1")));
        assert_eq!(parse_ip_sloppy("192.000.002.012"), Some(ip("192.0.2.12")));
        assert_eq!(parse_ip_sloppy("::ffff:192.0.2.1"), Some(ip("192.0.2.1")));
        assert_eq!(parse_ip_sloppy("fd00::1"), Some(ip("fd00::1")));
        assert_eq!(parse_ip_sloppy("192.0.2.256"), None);
        assert_eq!(parse_ip_sloppy("192.0.2"), None);
        assert_eq!(parse_ip_sloppy("192.0.2.1.2"), None);
        assert_eq!(parse_ip_sloppy("192.0.2.0001"), None);
        assert_eq!(parse_ip_sloppy("not-an-ip"), None);
        assert_eq!(parse_ip_sloppy(""), None);
    }

    #[test]
    fn family_strings_are_kubernetes_spellings() {
        assert_eq!(IpFamily::of(ip("192.0.2.1")).to_string(), "IPv4");
        assert_eq!(IpFamily::of(ip("fd00::1")).as_str(), "IPv6");
    }
}

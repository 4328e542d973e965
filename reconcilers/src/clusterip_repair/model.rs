//! The compact records the repair works on.
//!
//! Lists and watches are decoded straight into these (only the fields the repair reads), never
//! into full `k8s-openapi` objects: at 100,000 Services the difference is hundreds of megabytes
//! (managedFields, annotations, ports, status) and most of the decoding time.

use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;

use crate::alloc::{IpFamily, parse_ip_sloppy};

/// Label naming the controller that manages an IPAddress.
pub const LABEL_MANAGED_BY: &str = "ipaddress.kubernetes.io/managed-by";
/// Label holding an IPAddress's family (`IPv4`/`IPv6`).
pub const LABEL_IP_FAMILY: &str = "ipaddress.kubernetes.io/ip-family";
/// The value of [`LABEL_MANAGED_BY`] on IPAddresses of Service ClusterIPs.
pub const IPALLOCATOR_MANAGER: &str = "ipallocator.k8s.io";

/// A namespace or object name. Kept inline up to 24 bytes (most names; no heap allocation):
/// the decision compares each IPAddress's parent with its Service's namespace and name, and with
/// the text inside the record that costs no extra cache miss.
pub type Name = compact_str::CompactString;

/// The parts of a Service the repair needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRecord {
    pub namespace: Name,
    pub name: Name,
    pub uid: Token,
    /// 0 when not a number (see [`super::reflector::parse_resource_version`]).
    pub resource_version: u64,
    /// The Service's cluster IPs, parsed once at decode time; empty when the Service has no
    /// cluster IP (headless, ExternalName, not yet allocated).
    pub cluster_ips: ClusterIps,
    /// The non-zero `spec.ports[].nodePort`s with their protocols, in spec order, whatever the
    /// Service's type: what the NodePort repair counts (upstream's `collectServiceNodePorts`).
    pub node_ports: NodePorts,
    /// `spec.healthCheckNodePort`, 0 when unset.
    pub health_check_node_port: i32,
    /// `metadata.creationTimestamp`: an IPAddress newer than its Service may have been written
    /// ahead of the Service's update that lists it.
    pub created: Option<jiff::Timestamp>,
}

/// Boxed: most Services hold no node port, and an empty box costs no allocation.
pub type NodePorts = Box<[(i32, Protocol)]>;

/// `spec.ports[].protocol`, as far as the NodePort repair tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Protocol {
    /// `TCP`, and an unset protocol (the API defaults it to TCP).
    Tcp,
    Udp,
    Sctp,
    /// Anything else; the API admits only the three above.
    Other,
}

impl Protocol {
    pub fn from_bytes(text: &[u8]) -> Self {
        match text {
            b"TCP" | b"" => Protocol::Tcp,
            b"UDP" => Protocol::Udp,
            b"SCTP" => Protocol::Sctp,
            _ => Protocol::Other,
        }
    }
}

/// At most two cluster IPs (dual-stack) are valid, so they are kept inside the record: no
/// allocation per Service when decoding, and no second cache miss when a pass reads them.
pub type ClusterIps = smallvec::SmallVec<[ClusterIp; 2]>;

/// One entry of `spec.clusterIPs`: an address (kept inline, no allocation) or, rarely, the
/// text that does not parse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterIp {
    Ip(IpAddr),
    Invalid(Box<str>),
}

impl ClusterIp {
    /// Parses as kube-apiserver does ([`parse_ip_sloppy`]).
    pub fn parse(text: &str) -> Self {
        if let Some(ip) = canonical_ip(text.as_bytes()) {
            // Canonical texts never spell an IPv4-mapped address (those display dotted, which
            // `canonical_ipv6` does not accept), so the sloppy parse would give the same IP.
            return ClusterIp::Ip(ip);
        }
        parse_ip_sloppy(text).map_or_else(|| ClusterIp::Invalid(text.into()), ClusterIp::Ip)
    }

    /// From the raw bytes of a protobuf string: canonical IPs are ASCII by construction, so
    /// only other texts are checked for UTF-8.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, std::str::Utf8Error> {
        match canonical_ip(bytes) {
            Some(ip) => Ok(ClusterIp::Ip(ip)),
            None => Ok(ClusterIp::parse(std::str::from_utf8(bytes)?)),
        }
    }

    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            ClusterIp::Ip(ip) => Some(*ip),
            ClusterIp::Invalid(_) => None,
        }
    }
}

impl std::fmt::Display for ClusterIp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterIp::Ip(ip) => ip.fmt(f),
            ClusterIp::Invalid(raw) => f.write_str(raw),
        }
    }
}

impl ServiceRecord {
    /// Whether the Service lists `ip` among its cluster IPs.
    pub fn lists_ip(&self, ip: IpAddr) -> bool {
        self.cluster_ips
            .iter()
            .any(|listed| listed.ip() == Some(ip))
    }

    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// `spec.parentRef` of an IPAddress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParentRef {
    pub namespace: Name,
    pub name: Name,
    /// The group and resource, a Service's (the usual) without an allocation.
    kind: ParentKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum ParentKind {
    /// The core group, resource `services`.
    Service,
    /// Anything else: `(group, resource)`.
    Other(Box<(Box<str>, Box<str>)>),
}

impl ParentRef {
    pub fn new(group: &str, resource: &str, namespace: Name, name: Name) -> Self {
        let kind = if group.is_empty() && equals(resource.as_bytes(), b"services") {
            ParentKind::Service
        } else {
            ParentKind::Other(Box::new((group.into(), resource.into())))
        };
        Self {
            namespace,
            name,
            kind,
        }
    }

    pub fn group(&self) -> &str {
        match &self.kind {
            ParentKind::Service => "",
            ParentKind::Other(other) => &other.0,
        }
    }

    pub fn resource(&self) -> &str {
        match &self.kind {
            ParentKind::Service => "services",
            ParentKind::Other(other) => &other.1,
        }
    }

    pub fn is_service(&self) -> bool {
        matches!(self.kind, ParentKind::Service)
    }
}

/// The two labels of an IPAddress the repair reads. The values the allocator writes (on every
/// IPAddress it manages) are kept as bits of one byte; any other value behind one pointer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IpLabels {
    usual: u8,
    unusual: Option<Box<UnusualLabels>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct UnusualLabels {
    managed_by: Option<Box<str>>,
    family: Option<Box<str>>,
}

const MANAGED_BY_IPALLOCATOR: u8 = 1;
const FAMILY_IPV4: u8 = 1 << 1;
const FAMILY_IPV6: u8 = 1 << 2;
const FAMILIES: [(u8, &str); 2] = [(FAMILY_IPV4, "IPv4"), (FAMILY_IPV6, "IPv6")];

impl IpLabels {
    pub fn new(managed_by: Option<&str>, family: Option<&str>) -> Self {
        let mut labels = Self::default();
        labels.set_managed_by(managed_by);
        labels.set_family(family);
        labels
    }

    /// [`LABEL_MANAGED_BY`].
    pub fn managed_by(&self) -> Option<&str> {
        if self.usual & MANAGED_BY_IPALLOCATOR != 0 {
            return Some(IPALLOCATOR_MANAGER);
        }
        self.unusual.as_ref()?.managed_by.as_deref()
    }

    /// [`LABEL_IP_FAMILY`].
    pub fn family(&self) -> Option<&str> {
        match FAMILIES.iter().find(|(bit, _)| self.usual & bit != 0) {
            Some((_, family)) => Some(family),
            None => self.unusual.as_ref()?.family.as_deref(),
        }
    }

    pub fn set_managed_by(&mut self, value: Option<&str>) {
        if value.is_some_and(|v| equals(v.as_bytes(), IPALLOCATOR_MANAGER_BYTES)) {
            self.usual |= MANAGED_BY_IPALLOCATOR;
            self.set_unusual(|labels| labels.managed_by = None, false);
        } else {
            self.usual &= !MANAGED_BY_IPALLOCATOR;
            let unusual = value.map(Box::from);
            let keep = unusual.is_some();
            self.set_unusual(|labels| labels.managed_by = unusual, keep);
        }
    }

    pub fn set_family(&mut self, value: Option<&str>) {
        self.usual &= !(FAMILY_IPV4 | FAMILY_IPV6);
        let bit = value.and_then(|v| match v.as_bytes() {
            bytes if equals(bytes, b"IPv4") => Some(FAMILY_IPV4),
            bytes if equals(bytes, b"IPv6") => Some(FAMILY_IPV6),
            _ => None,
        });
        if let Some(bit) = bit {
            self.usual |= bit;
            self.set_unusual(|labels| labels.family = None, false);
        } else {
            let unusual = value.map(Box::from);
            let keep = unusual.is_some();
            self.set_unusual(|labels| labels.family = unusual, keep);
        }
    }

    /// Changes the unusual values, keeping none allocated when there are none (so equal labels
    /// compare equal). `adds` says whether the change stores a value: when it does not and
    /// there are no unusual values, nothing is allocated (the usual case, once per label of
    /// each of 130,000 IPAddresses in a LIST).
    fn set_unusual(&mut self, change: impl FnOnce(&mut UnusualLabels), adds: bool) {
        if self.unusual.is_none() && !adds {
            return;
        }
        let mut unusual = self.unusual.take().unwrap_or_default();
        change(&mut unusual);
        if *unusual != UnusualLabels::default() {
            self.unusual = Some(unusual);
        }
    }
}

const IPALLOCATOR_MANAGER_BYTES: &[u8; IPALLOCATOR_MANAGER.len()] = array(IPALLOCATOR_MANAGER);

/// `text` as an array, for [`equals`]; only for constants (a wrong `N` fails the build).
pub(super) const fn array<const N: usize>(text: &'static str) -> &'static [u8; N] {
    match text.as_bytes().first_chunk::<N>() {
        Some(bytes) if text.len() == N => bytes,
        _ => panic!("array: N is not the length of the text"),
    }
}

/// `bytes == constant`, for texts compared once per object of a LIST: with the length known at
/// compile time the comparison is a few inline loads instead of a call to `memcmp`, which a
/// profile of decoding IPAddresses showed as a fifth of the time.
#[inline(always)]
pub(super) fn equals<const N: usize>(bytes: &[u8], constant: &[u8; N]) -> bool {
    <&[u8; N]>::try_from(bytes).is_ok_and(|bytes| bytes == constant)
}

/// The parts of an IPAddress the repair needs. The Service phase reads the parent and the
/// labels of IPAddresses in random order, so they come first (`repr(C)`), in as few cache lines
/// as the record allows.
#[repr(C)]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpAddressRecord {
    pub parent: Option<ParentRef>,
    pub labels: IpLabels,
    /// The object name, which is the IP in canonical form.
    pub name: IpName,
    pub uid: Token,
    pub resource_version: Token,
    /// `None` when missing or unparseable; treated as "old" as upstream does.
    pub created: Option<jiff::Timestamp>,
    pub deleting: bool,
}

impl IpAddressRecord {
    pub fn managed_by_ipallocator(&self) -> bool {
        self.labels.usual & MANAGED_BY_IPALLOCATOR != 0
    }

    /// Whether both labels hold what the allocator writes for an IP of `family`.
    pub fn labels_as_allocated(&self, family: IpFamily) -> bool {
        let bit = match family {
            IpFamily::V4 => FAMILY_IPV4,
            IpFamily::V6 => FAMILY_IPV6,
        };
        self.labels.usual == MANAGED_BY_IPALLOCATOR | bit
    }
}

/// The values the repair compares labels and references with, recognised as static strings:
/// no allocation, no UTF-8 check, no call to `memcmp` ([`equals`]).
pub(super) fn known_manager(text: &[u8]) -> Option<&'static str> {
    equals(text, IPALLOCATOR_MANAGER_BYTES).then_some(IPALLOCATOR_MANAGER)
}

pub(super) fn known_family(text: &[u8]) -> Option<&'static str> {
    if equals(text, b"IPv4") {
        Some("IPv4")
    } else if equals(text, b"IPv6") {
        Some("IPv6")
    } else {
        None
    }
}

pub(super) fn known_resource(text: &[u8]) -> Option<&'static str> {
    equals(text, b"services").then_some("services")
}

pub(super) fn known_group(text: &[u8]) -> Option<&'static str> {
    text.is_empty().then_some("")
}

/// The parts of a ServiceCIDR the repair needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrRecord {
    pub name: Box<str>,
    pub resource_version: u64,
    /// Parsed `spec.cidrs`; entries that do not parse are dropped (the API validates them).
    pub cidrs: Vec<IpNet>,
    /// `spec.cidrs` as written, for comparisons with the configuration.
    pub raw_cidrs: Vec<Box<str>>,
    pub deleting: bool,
}

/// Object identity for preconditioned writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectVersion {
    pub uid: Box<str>,
    pub resource_version: Box<str>,
}

/// An identifier from the API (a uid, a resourceVersion), kept without a heap allocation when it
/// has the usual shape and rendered back exactly as received. At 100,000 Services and 130,000
/// IPAddresses the allocations it saves are a large part of decoding a LIST.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Token {
    /// A lowercase hyphenated UUID, as kube-apiserver generates uids: high and low halves
    /// (a `u128` would align the whole enum, and every record holding one, to 16 bytes).
    Uuid([u64; 2]),
    /// A decimal number without leading zeros, as etcd-backed resourceVersions are.
    Number(u64),
    Text(Box<str>),
}

impl Token {
    pub fn new(text: &str) -> Self {
        match Token::canonical(text.as_bytes()) {
            Some(token) => token,
            None => Token::Text(text.into()),
        }
    }

    /// From the raw bytes of a protobuf string: the usual shapes are ASCII by construction, so
    /// only the rare other texts are checked for UTF-8.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, std::str::Utf8Error> {
        match Token::canonical(bytes) {
            Some(token) => Ok(token),
            None => Ok(Token::Text(std::str::from_utf8(bytes)?.into())),
        }
    }

    fn canonical(bytes: &[u8]) -> Option<Self> {
        canonical_number(bytes)
            .map(Token::Number)
            .or_else(|| canonical_uuid(bytes).map(Token::Uuid))
    }

    /// The token as a number, when it is one (resourceVersions).
    pub fn number(&self) -> Option<u64> {
        match self {
            Token::Number(number) => Some(*number),
            _ => None,
        }
    }
}

impl From<&str> for Token {
    fn from(text: &str) -> Self {
        Token::new(text)
    }
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::Uuid([high, low]) => {
                let v = (u128::from(*high) << 64) | u128::from(*low);
                write!(
                    f,
                    "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
                    v >> 96,
                    (v >> 80) & 0xffff,
                    (v >> 64) & 0xffff,
                    (v >> 48) & 0xffff,
                    v & 0xffff_ffff_ffff
                )
            }
            Token::Number(number) => number.fmt(f),
            Token::Text(text) => f.write_str(text),
        }
    }
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// A Service's `resourceVersion` as the record keeps it (`wire::version`: the number, or 0 when
/// it is not one), from the raw bytes of a protobuf string: the usual digits need no UTF-8 check.
pub(super) fn resource_version_number(bytes: &[u8]) -> Result<u64, std::str::Utf8Error> {
    match canonical_number(bytes) {
        Some(number) => Ok(number),
        None => Ok(std::str::from_utf8(bytes)?.parse().unwrap_or(0)),
    }
}

/// Digits only, no leading zero, fits a u64: exactly the texts `u64::to_string` produces.
fn canonical_number(bytes: &[u8]) -> Option<u64> {
    let plain = !bytes.is_empty()
        && bytes.len() <= 19
        && (bytes[0] != b'0' || bytes.len() == 1)
        && bytes.iter().all(u8::is_ascii_digit);
    // At most 19 digits: no overflow.
    plain.then(|| {
        bytes
            .iter()
            .fold(0u64, |value, digit| value * 10 + u64::from(digit - b'0'))
    })
}

/// `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` in lowercase hex: exactly what [`Token`]'s `Display`
/// writes back.
fn canonical_uuid(bytes: &[u8]) -> Option<[u64; 2]> {
    if bytes.len() != 36 || [8, 13, 18, 23].iter().any(|&at| bytes[at] != b'-') {
        return None;
    }
    let high = (hex(&bytes[0..8])? << 32) | (hex(&bytes[9..13])? << 16) | hex(&bytes[14..18])?;
    let low = (hex(&bytes[19..23])? << 48) | hex(&bytes[24..36])?;
    Some([high, low])
}

/// Lowercase hex digits (at most 16) as a number. Table-driven and branch-free per digit: two
/// uids per object, 230,000 objects in a LIST at scale.
fn hex(digits: &[u8]) -> Option<u64> {
    const INVALID: u8 = 0xF0;
    const VALUES: [u8; 256] = {
        let mut table = [INVALID; 256];
        let mut digit = 0;
        while digit < 10 {
            table[b'0' as usize + digit] = digit as u8;
            digit += 1;
        }
        let mut letter = 0;
        while letter < 6 {
            table[b'a' as usize + letter] = 10 + letter as u8;
            letter += 1;
        }
        table
    };
    let mut value: u64 = 0;
    let mut invalid = 0u8;
    for &byte in digits {
        let digit = VALUES[usize::from(byte)];
        invalid |= digit;
        value = (value << 4) | u64::from(digit & 0x0F);
    }
    (invalid & INVALID == 0).then_some(value)
}

/// An IPAddress object's name: the IP itself when the name is its canonical spelling (always, for
/// names the API accepted; no allocation), otherwise the text as written.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum IpName {
    Canonical(IpAddr),
    Other(Box<str>),
}

impl IpName {
    pub fn new(text: &str) -> Self {
        match canonical_ip(text.as_bytes()) {
            Some(ip) => IpName::Canonical(ip),
            None => IpName::uncommon(text),
        }
    }

    /// From the raw bytes of a protobuf string (a canonical IP needs no UTF-8 check).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, std::str::Utf8Error> {
        match canonical_ip(bytes) {
            Some(ip) => Ok(IpName::Canonical(ip)),
            None => Ok(IpName::uncommon(std::str::from_utf8(bytes)?)),
        }
    }

    /// What [`canonical_ip`] leaves: IPv4-mapped IPv6 (canonical only if it renders back the
    /// same), other spellings, or no IP at all.
    fn uncommon(text: &str) -> Self {
        match text.parse::<IpAddr>() {
            Ok(ip) if renders_as(ip, text) => IpName::Canonical(ip),
            _ => IpName::Other(text.into()),
        }
    }

    /// The IP the name spells (strict parse, as the API validates names).
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            IpName::Canonical(ip) => Some(*ip),
            IpName::Other(text) => text.parse().ok(),
        }
    }
}

impl From<&str> for IpName {
    fn from(text: &str) -> Self {
        IpName::new(text)
    }
}

impl std::fmt::Display for IpName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            IpName::Canonical(ip) => ip.fmt(f),
            IpName::Other(text) => f.write_str(text),
        }
    }
}

impl std::fmt::Debug for IpName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.to_string())
    }
}

/// Dotted decimal without leading zeros: exactly the texts `Ipv4Addr`'s `Display` writes (and
/// its `FromStr` accepts). A hand-written scan: 100,000 IPv4 names and cluster IPs per LIST.
pub(crate) fn canonical_ipv4(bytes: &[u8]) -> Option<std::net::Ipv4Addr> {
    if !(7..=15).contains(&bytes.len()) {
        return None;
    }
    let mut octets = [0u8; 4];
    let mut at = 0;
    for (index, octet) in octets.iter_mut().enumerate() {
        if index > 0 {
            if bytes.get(at) != Some(&b'.') {
                return None;
            }
            at += 1;
        }
        let start = at;
        let mut value = 0u32;
        while at < bytes.len() && at - start < 3 && bytes[at].is_ascii_digit() {
            value = value * 10 + u32::from(bytes[at] - b'0');
            at += 1;
        }
        let digits = at - start;
        if digits == 0 || (digits > 1 && bytes[start] == b'0') {
            return None;
        }
        *octet = u8::try_from(value).ok()?;
    }
    (at == bytes.len()).then_some(std::net::Ipv4Addr::from(octets))
}

/// [`canonical_ipv4`], else [`canonical_ipv6`].
pub(crate) fn canonical_ip(bytes: &[u8]) -> Option<IpAddr> {
    match canonical_ipv4(bytes) {
        Some(v4) => Some(IpAddr::V4(v4)),
        None => canonical_ipv6(bytes).map(IpAddr::V6),
    }
}

/// IPv6 exactly as `Ipv6Addr`'s `Display` writes it (RFC 5952: lowercase, no leading zeros, the
/// first longest run of two or more zero groups as `::`), except IPv4-mapped addresses, which
/// it writes dotted and this leaves to the slow path. A hand-written scan: std's parser tries
/// an embedded IPv4 at every group, and proving the text canonical by formatting the address
/// again cost as much as the parse; 30,000 IPv6 names and as many cluster IPs per LIST.
pub(crate) fn canonical_ipv6(bytes: &[u8]) -> Option<std::net::Ipv6Addr> {
    if !(2..=39).contains(&bytes.len()) {
        return None;
    }
    let mut segments = [0u16; 8];
    let mut count = 0;
    // Where `::` stands, as an index into `segments` before the right part is moved.
    let mut gap: Option<usize> = None;
    let mut at = 0;
    if bytes.starts_with(b"::") {
        gap = Some(0);
        at = 2;
    }
    while at < bytes.len() {
        let start = at;
        let mut value = 0u16;
        while at < bytes.len() && at - start < 4 {
            let digit = match bytes[at] {
                digit @ b'0'..=b'9' => digit - b'0',
                letter @ b'a'..=b'f' => letter - b'a' + 10,
                _ => break,
            };
            value = (value << 4) | u16::from(digit);
            at += 1;
        }
        let digits = at - start;
        if digits == 0 || (digits > 1 && bytes[start] == b'0') || count == 8 {
            return None;
        }
        segments[count] = value;
        count += 1;
        if at == bytes.len() {
            break;
        }
        if bytes[at] != b':' {
            return None;
        }
        at += 1;
        if bytes.get(at) == Some(&b':') {
            if gap.is_some() {
                return None;
            }
            gap = Some(count);
            at += 1;
            if at == bytes.len() {
                break;
            }
        } else if at == bytes.len() {
            return None;
        }
    }
    let written = match gap {
        None if count == 8 => segments,
        // `::` must stand for at least one group (and, canonically, two: checked below).
        Some(gap) if count < 8 => {
            let mut full = [0u16; 8];
            full[..gap].copy_from_slice(&segments[..gap]);
            let right = count - gap;
            full[8 - right..].copy_from_slice(&segments[gap..count]);
            full
        }
        _ => return None,
    };
    // The first longest run of zero groups, as `Display` picks it.
    let (mut longest, mut longest_at, mut run) = (0, 0, 0);
    for (index, &segment) in written.iter().enumerate() {
        run = if segment == 0 { run + 1 } else { 0 };
        if run > longest {
            longest = run;
            longest_at = index + 1 - run;
        }
    }
    let expected_gap = (longest > 1).then_some((longest_at, longest));
    let actual_gap = gap.map(|gap| (gap, 8 - count));
    let address = std::net::Ipv6Addr::from(written);
    (expected_gap == actual_gap && address.to_ipv4_mapped().is_none()).then_some(address)
}

/// Whether `ip` displays as exactly `text`, without allocating.
fn renders_as(ip: IpAddr, text: &str) -> bool {
    // std's IPv4 parser accepts only plain dotted decimal without leading zeros, which is what
    // it displays; IPv6 has several spellings of one address, so compare.
    if ip.is_ipv4() {
        return true;
    }
    struct Compare<'a> {
        rest: &'a [u8],
        equal: bool,
    }
    impl std::fmt::Write for Compare<'_> {
        fn write_str(&mut self, piece: &str) -> std::fmt::Result {
            match self.rest.strip_prefix(piece.as_bytes()) {
                Some(rest) => self.rest = rest,
                None => self.equal = false,
            }
            Ok(())
        }
    }
    let mut compare = Compare {
        rest: text.as_bytes(),
        equal: true,
    };
    use std::fmt::Write;
    let _ = write!(compare, "{ip}");
    compare.equal && compare.rest.is_empty()
}

/// `metadata.creationTimestamp`. The API always writes `YYYY-MM-DDTHH:MM:SSZ`, which is read
/// directly (a general RFC 3339 parse of 130,000 timestamps is a visible part of decoding a
/// LIST); anything else goes through jiff.
pub fn parse_timestamp(text: &str) -> Option<jiff::Timestamp> {
    utc_seconds_timestamp(text).or_else(|| text.parse().ok())
}

fn utc_seconds_timestamp(text: &str) -> Option<jiff::Timestamp> {
    let b = text.as_bytes();
    if b.len() != 20
        || b[4] != b'-'
        || b[7] != b'-'
        || b[10] != b'T'
        || b[13] != b':'
        || b[16] != b':'
        || b[19] != b'Z'
    {
        return None;
    }
    let number = |from: usize, to: usize| -> Option<i64> {
        b[from..to].iter().try_fold(0i64, |acc, &c| {
            c.is_ascii_digit().then(|| acc * 10 + i64::from(c - b'0'))
        })
    };
    let (year, month, day) = (number(0, 4)?, number(5, 7)?, number(8, 10)?);
    let (hour, minute, second) = (number(11, 13)?, number(14, 16)?, number(17, 19)?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return None,
    };
    if day < 1 || day > month_days || hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    // Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let year_of_era = y - era * 400;
    let day_of_year = (153 * ((month + 9) % 12) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    let days = era * 146_097 + day_of_era - 719_468;
    jiff::Timestamp::from_second(days * 86_400 + hour * 3_600 + minute * 60 + second).ok()
}

/// A page of a LIST response.
#[derive(Debug, Deserialize)]
#[serde(bound(deserialize = "T: Deserialize<'de>"))]
pub struct ListPage<T> {
    #[serde(default)]
    pub metadata: ListMeta,
    #[serde(default = "Vec::new")]
    pub items: Vec<T>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListMeta {
    pub resource_version: Option<String>,
    #[serde(rename = "continue")]
    pub continue_token: Option<String>,
    /// How many items the pages after this one hold, when the server says (a hint).
    pub remaining_item_count: Option<u64>,
}

pub(super) mod wire {
    //! What the API sends, borrowed from the response body where possible: only the fields kept
    //! are copied out, everything else is skipped without allocating.

    use std::borrow::Cow;

    use serde::Deserialize;

    fn boxed(text: Cow<'_, str>) -> Box<str> {
        Box::from(text.as_ref())
    }

    fn name(text: Cow<'_, str>) -> super::Name {
        super::Name::new(text.as_ref())
    }

    fn version(text: Option<Cow<'_, str>>) -> u64 {
        text.and_then(|t| t.parse().ok()).unwrap_or(0)
    }

    #[derive(Deserialize, Default)]
    #[serde(default, rename_all = "camelCase")]
    pub struct ServiceMeta<'a> {
        #[serde(borrow)]
        pub name: Cow<'a, str>,
        #[serde(borrow)]
        pub namespace: Cow<'a, str>,
        #[serde(borrow)]
        pub uid: Cow<'a, str>,
        #[serde(borrow)]
        pub resource_version: Option<Cow<'a, str>>,
        #[serde(borrow)]
        pub creation_timestamp: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct Service<'a> {
        #[serde(borrow)]
        pub metadata: ServiceMeta<'a>,
        #[serde(borrow)]
        pub spec: ServiceSpec<'a>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct ServiceSpec<'a> {
        #[serde(rename = "clusterIP", borrow)]
        pub cluster_ip: Option<Cow<'a, str>>,
        #[serde(rename = "clusterIPs")]
        pub cluster_ips: Option<ParsedIps>,
        pub ports: ParsedNodePorts,
        #[serde(rename = "healthCheckNodePort")]
        pub health_check_node_port: i32,
    }

    /// One entry of `spec.ports`: only what the NodePort repair reads.
    #[derive(Deserialize, Default)]
    #[serde(default)]
    struct ServicePort<'a> {
        #[serde(rename = "nodePort")]
        node_port: i32,
        #[serde(borrow)]
        protocol: Option<Cow<'a, str>>,
    }

    /// `spec.ports`, reduced while decoding to the non-zero node ports (no intermediate list).
    #[derive(Default)]
    pub struct ParsedNodePorts(pub super::NodePorts);

    impl<'de> Deserialize<'de> for ParsedNodePorts {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl<'de> serde::de::Visitor<'de> for Visitor {
                type Value = ParsedNodePorts;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a list of service ports")
                }
                fn visit_seq<A: serde::de::SeqAccess<'de>>(
                    self,
                    mut seq: A,
                ) -> Result<ParsedNodePorts, A::Error> {
                    let mut ports = Vec::new();
                    while let Some(port) = seq.next_element::<ServicePort<'de>>()? {
                        if port.node_port != 0 {
                            let protocol = port.protocol.as_deref().unwrap_or_default();
                            ports.push((
                                port.node_port,
                                super::Protocol::from_bytes(protocol.as_bytes()),
                            ));
                        }
                    }
                    Ok(ParsedNodePorts(ports.into_boxed_slice()))
                }
                fn visit_unit<E: serde::de::Error>(self) -> Result<ParsedNodePorts, E> {
                    Ok(ParsedNodePorts::default())
                }
            }
            d.deserialize_any(Visitor)
        }
    }

    /// A string borrowed from the body unless it has escapes.
    #[derive(Deserialize)]
    struct Text<'a>(#[serde(borrow)] Cow<'a, str>);

    /// `spec.clusterIPs`, parsed while decoding (no intermediate list of strings).
    #[derive(Default)]
    pub struct ParsedIps(pub super::ClusterIps);

    impl<'de> Deserialize<'de> for ParsedIps {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl<'de> serde::de::Visitor<'de> for Visitor {
                type Value = ParsedIps;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a list of IP addresses")
                }
                fn visit_seq<A: serde::de::SeqAccess<'de>>(
                    self,
                    mut seq: A,
                ) -> Result<ParsedIps, A::Error> {
                    let mut ips = super::ClusterIps::new();
                    while let Some(Text(text)) = seq.next_element::<Text<'de>>()? {
                        ips.push(super::ClusterIp::parse(&text));
                    }
                    Ok(ParsedIps(ips))
                }
            }
            d.deserialize_seq(Visitor)
        }
    }

    impl From<Service<'_>> for super::ServiceRecord {
        fn from(wire: Service<'_>) -> Self {
            // upstream's IsServiceIPSet: a Service without a cluster IP, or a headless one, has no
            // IPs to repair whatever clusterIPs says.
            let has_ip = wire
                .spec
                .cluster_ip
                .as_deref()
                .is_some_and(|ip| !ip.is_empty() && ip != "None");
            let cluster_ips = if !has_ip {
                super::ClusterIps::new()
            } else {
                match wire.spec.cluster_ips {
                    Some(ParsedIps(ips)) if !ips.is_empty() => ips,
                    _ => wire
                        .spec
                        .cluster_ip
                        .iter()
                        .map(|ip| super::ClusterIp::parse(ip))
                        .collect(),
                }
            };
            Self {
                namespace: name(wire.metadata.namespace),
                name: name(wire.metadata.name),
                uid: super::Token::new(&wire.metadata.uid),
                resource_version: version(wire.metadata.resource_version),
                cluster_ips,
                node_ports: wire.spec.ports.0,
                health_check_node_port: wire.spec.health_check_node_port,
                created: wire
                    .metadata
                    .creation_timestamp
                    .and_then(|text| super::parse_timestamp(&text)),
            }
        }
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct IpLabels<'a> {
        #[serde(rename = "ipaddress.kubernetes.io/managed-by", borrow)]
        pub managed_by: Option<Cow<'a, str>>,
        #[serde(rename = "ipaddress.kubernetes.io/ip-family", borrow)]
        pub family: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct IpAddress<'a> {
        #[serde(borrow)]
        pub metadata: IpAddressMeta<'a>,
        #[serde(borrow)]
        pub spec: IpAddressSpec<'a>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default, rename_all = "camelCase")]
    pub struct IpAddressMeta<'a> {
        #[serde(borrow)]
        pub name: Cow<'a, str>,
        #[serde(borrow)]
        pub uid: Cow<'a, str>,
        #[serde(borrow)]
        pub resource_version: Cow<'a, str>,
        #[serde(borrow)]
        pub creation_timestamp: Option<Cow<'a, str>>,
        #[serde(borrow)]
        pub deletion_timestamp: Option<Cow<'a, str>>,
        #[serde(borrow)]
        pub labels: IpLabels<'a>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default, rename_all = "camelCase")]
    pub struct IpAddressSpec<'a> {
        #[serde(borrow)]
        pub parent_ref: Option<ParentRef<'a>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct ParentRef<'a> {
        #[serde(borrow)]
        pub group: Cow<'a, str>,
        #[serde(borrow)]
        pub resource: Cow<'a, str>,
        #[serde(borrow)]
        pub namespace: Cow<'a, str>,
        #[serde(borrow)]
        pub name: Cow<'a, str>,
    }

    impl From<IpAddress<'_>> for super::IpAddressRecord {
        fn from(wire: IpAddress<'_>) -> Self {
            let meta = wire.metadata;
            Self {
                name: super::IpName::new(&meta.name),
                uid: super::Token::new(&meta.uid),
                resource_version: super::Token::new(&meta.resource_version),
                labels: super::IpLabels::new(
                    meta.labels.managed_by.as_deref(),
                    meta.labels.family.as_deref(),
                ),
                parent: wire.spec.parent_ref.map(|p| {
                    super::ParentRef::new(&p.group, &p.resource, name(p.namespace), name(p.name))
                }),
                created: meta
                    .creation_timestamp
                    .and_then(|text| super::parse_timestamp(&text)),
                deleting: meta.deletion_timestamp.is_some(),
            }
        }
    }

    #[derive(Deserialize, Default)]
    #[serde(default, rename_all = "camelCase")]
    pub struct ServiceCidrMeta<'a> {
        #[serde(borrow)]
        pub name: Cow<'a, str>,
        #[serde(borrow)]
        pub resource_version: Option<Cow<'a, str>>,
        #[serde(borrow)]
        pub deletion_timestamp: Option<Cow<'a, str>>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct ServiceCidr<'a> {
        #[serde(borrow)]
        pub metadata: ServiceCidrMeta<'a>,
        #[serde(borrow)]
        pub spec: ServiceCidrSpec<'a>,
    }

    #[derive(Deserialize, Default)]
    #[serde(default)]
    pub struct ServiceCidrSpec<'a> {
        #[serde(borrow)]
        pub cidrs: Vec<Cow<'a, str>>,
    }

    impl From<ServiceCidr<'_>> for super::ServiceCidrRecord {
        fn from(wire: ServiceCidr<'_>) -> Self {
            Self {
                name: boxed(wire.metadata.name),
                resource_version: version(wire.metadata.resource_version),
                cidrs: wire
                    .spec
                    .cidrs
                    .iter()
                    .filter_map(|cidr| cidr.parse().ok())
                    .collect(),
                raw_cidrs: wire.spec.cidrs.into_iter().map(boxed).collect(),
                deleting: wire.metadata.deletion_timestamp.is_some(),
            }
        }
    }

    /// `Deserialize` for a record through its borrowed wire form.
    macro_rules! via_wire {
        ($record:ty, $wire:ident) => {
            impl<'de> Deserialize<'de> for $record {
                fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                    $wire::deserialize(d).map(Into::into)
                }
            }
        };
    }
    via_wire!(super::ServiceRecord, Service);
    via_wire!(super::IpAddressRecord, IpAddress);
    via_wire!(super::ServiceCidrRecord, ServiceCidr);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    #[test]
    fn decodes_a_dual_stack_service() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"shop",
            "uid":"u1","resourceVersion":"42","managedFields":[{"manager":"x"}]},
            "spec":{"clusterIP":"10.0.0.5","clusterIPs":["10.0.0.5","fd00::5"],"ports":[{"port":80}]}}"#;
        let svc: ServiceRecord = serde_json::from_str(json).unwrap();
        assert_eq!(&*svc.namespace, "shop");
        assert_eq!(&*svc.name, "web");
        assert_eq!(svc.resource_version, 42);
        assert_eq!(svc.cluster_ips.len(), 2);
        assert!(svc.lists_ip("fd00::5".parse().unwrap()));
        assert!(!svc.lists_ip("10.0.0.6".parse().unwrap()));
    }

    #[test]
    fn headless_and_old_services() {
        let headless: ServiceRecord = serde_json::from_str(
            r#"{"metadata":{"name":"h","namespace":"d"},"spec":{"clusterIP":"None","clusterIPs":["None"]}}"#,
        )
        .unwrap();
        assert!(headless.cluster_ips.is_empty());
        let external: ServiceRecord = serde_json::from_str(
            r#"{"metadata":{"name":"e","namespace":"d"},"spec":{"type":"ExternalName"}}"#,
        )
        .unwrap();
        assert!(external.cluster_ips.is_empty());
        let old: ServiceRecord = serde_json::from_str(
            r#"{"metadata":{"name":"o","namespace":"d"},"spec":{"clusterIP":"10.0.0.9"}}"#,
        )
        .unwrap();
        assert_eq!(
            old.cluster_ips[0],
            ClusterIp::Ip("10.0.0.9".parse().unwrap())
        );
    }

    #[test]
    fn decodes_upstream_fixtures() {
        let ip: IpAddressRecord = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURES}/networking.k8s.io.v1.IPAddress.json"))
                .unwrap(),
        )
        .unwrap();
        assert!(!ip.name.to_string().is_empty());
        assert!(ip.parent.is_some());
        let cidr: ServiceCidrRecord = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURES}/networking.k8s.io.v1.ServiceCIDR.json"))
                .unwrap(),
        )
        .unwrap();
        assert!(!cidr.raw_cidrs.is_empty());
        assert!(
            cidr.cidrs.is_empty(),
            "placeholder CIDR strings are not parsed as ranges"
        );
        let svc: ServiceRecord = serde_json::from_str(
            &std::fs::read_to_string(format!("{FIXTURES}/core.v1.Service.json")).unwrap(),
        )
        .unwrap();
        assert!(!svc.name.is_empty());
    }

    #[test]
    fn tokens_render_back_exactly() {
        for text in [
            "0",
            "42",
            "18446744073709551615",
            "18446744073709551616",
            "007",
            "",
            "abc",
            "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f",
            "6F2C1D5E-8B7A-4C3D-9E1F-0A2B3C4D5E6F",
            "6f2c1d5e8b7a4c3d9e1f0a2b3c4d5e6f",
            "uid-10.0.0.5",
        ] {
            assert_eq!(Token::new(text).to_string(), text);
        }
        assert_eq!(Token::new("42"), Token::Number(42));
        assert_eq!(Token::new("42").number(), Some(42));
        assert!(matches!(
            Token::new("6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f"),
            Token::Uuid(_)
        ));
        assert!(matches!(Token::new("007"), Token::Text(_)));
    }

    /// A pass holds one record per Service and per IPAddress: 100,000s at scale, so every
    /// byte counts (and a field aligned to 16 bytes pads the whole record).
    #[test]
    fn records_stay_compact() {
        assert_eq!(size_of::<Token>(), 24);
        // 168 bytes for the ClusterIP repair's fields (the creation time among them), 24 for the
        // NodePort repair's (its boxed node ports and the health check port): 19.2 MB at 100,000
        // Services.
        assert!(
            size_of::<ServiceRecord>() <= 192,
            "{}",
            size_of::<ServiceRecord>()
        );
        assert!(
            size_of::<IpAddressRecord>() <= 176,
            "{}",
            size_of::<IpAddressRecord>()
        );
        // What the Service phase reads of an IPAddress fits in 72 bytes at its start.
        assert_eq!(std::mem::offset_of!(IpAddressRecord, labels), 56);
        assert!(size_of::<IpLabels>() <= 16);
    }

    #[test]
    fn byte_constructors_agree_with_the_text_ones() {
        for text in [
            "0",
            "42",
            "18446744073709551615",
            "9999999999999999999",
            "007",
            "",
            "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f",
            "6F2C1D5E-8B7A-4C3D-9E1F-0A2B3C4D5E6F",
            "10.0.0.1",
            "010.0.0.1",
            "fd00::1",
            "FD00::1",
            "::ffff:10.0.0.1",
            "nämlich",
        ] {
            assert_eq!(
                Token::from_bytes(text.as_bytes()).unwrap(),
                Token::new(text)
            );
            assert_eq!(
                IpName::from_bytes(text.as_bytes()).unwrap(),
                IpName::new(text)
            );
        }
        assert!(Token::from_bytes(b"\xff\xfe").is_err());
        assert!(IpName::from_bytes(b"10.0.0.\xff").is_err());
        assert_eq!(known_resource(b"services"), Some("services"));
        assert_eq!(known_resource(b"endpoints"), None);
        assert_eq!(known_resource(b"service"), None);
        assert_eq!(known_family(b"IPv4"), Some("IPv4"));
        assert_eq!(known_family(b"IPv6"), Some("IPv6"));
        assert_eq!(known_family(b"ipv6"), None);
        assert_eq!(
            known_manager(b"ipallocator.k8s.io"),
            Some(IPALLOCATOR_MANAGER)
        );
        assert_eq!(known_manager(b"ipallocator.k8s.io."), None);
        assert_eq!(known_group(b""), Some(""));
        assert_eq!(known_group(b"apps"), None);
    }

    /// Labels and parents keep what they are given, however they are set, and equal values
    /// compare equal.
    #[test]
    fn labels_and_parents_round_trip() {
        let values = [
            None,
            Some(IPALLOCATOR_MANAGER),
            Some("IPv4"),
            Some("IPv6"),
            Some("x"),
        ];
        for managed_by in values {
            for family in values {
                let labels = IpLabels::new(managed_by, family);
                assert_eq!((labels.managed_by(), labels.family()), (managed_by, family));
                // Set over other values, in either order: the same labels.
                let mut over = IpLabels::new(Some("y"), Some("IPv6"));
                over.set_family(family);
                over.set_managed_by(managed_by);
                assert_eq!(over, labels, "{managed_by:?} {family:?}");
            }
        }
        let mut record: IpAddressRecord = serde_json::from_str(
            r#"{"metadata":{"name":"10.0.0.5","labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4"}}}"#,
        )
        .unwrap();
        assert!(record.labels_as_allocated(IpFamily::V4));
        assert!(!record.labels_as_allocated(IpFamily::V6));
        record.labels.set_family(Some("ipv4"));
        assert!(!record.labels_as_allocated(IpFamily::V4));
        assert!(record.managed_by_ipallocator());
        record.labels.set_managed_by(None);
        assert!(!record.managed_by_ipallocator());

        let service = ParentRef::new("", "services", "d".into(), "s".into());
        assert!(service.is_service());
        assert_eq!((service.group(), service.resource()), ("", "services"));
        for (group, resource) in [("", "pods"), ("apps", "services"), ("x", "")] {
            let other = ParentRef::new(group, resource, "d".into(), "s".into());
            assert!(!other.is_service());
            assert_eq!((other.group(), other.resource()), (group, resource));
        }
    }

    /// The hand-written IPv4 scan accepts exactly what std parses and prints back unchanged.
    #[test]
    fn canonical_ipv4_is_what_std_parses_and_prints() {
        let parts = [
            "", "0", "00", "000", "1", "01", "001", "9", "10", "99", "100", "199", "200", "249",
            "250", "255", "256", "260", "300", "999", "1000", "a", "-1", "+1", " 1",
        ];
        let mut checked = 0;
        for a in parts {
            for b in parts {
                for c in ["0", "01", "255", "256", ""] {
                    for d in parts {
                        let text = format!("{a}.{b}.{c}.{d}");
                        let expected = text
                            .parse::<std::net::Ipv4Addr>()
                            .ok()
                            .filter(|ip| ip.to_string() == text);
                        assert_eq!(canonical_ipv4(text.as_bytes()), expected, "{text:?}");
                        checked += 1;
                    }
                }
            }
        }
        for text in [
            "1.2.3",
            "1.2.3.4.5",
            "1.2.3.4.",
            ".1.2.3.4",
            "1..2.3",
            "1.2.3.4 ",
            "255.255.255.255",
            "0.0.0.0",
            "1.2.3.4567",
            "1234.1.1.1",
        ] {
            let expected = text.parse::<std::net::Ipv4Addr>().ok();
            assert_eq!(canonical_ipv4(text.as_bytes()), expected, "{text:?}");
        }
        assert!(checked > 70_000);
    }

    /// `canonical_ipv6` accepts exactly the texts std's `Display` writes (bar IPv4-mapped
    /// addresses, left to the slow path), for every pattern of zero groups, and no other
    /// spelling of the same addresses.
    #[test]
    fn canonical_ipv6_is_exactly_what_std_prints() {
        // What `canonical_ipv6` must give: the address when std parses `text` and prints it
        // back the same, unless it is IPv4-mapped.
        fn std_canonical(text: &str) -> Option<std::net::Ipv6Addr> {
            text.parse::<std::net::Ipv6Addr>()
                .ok()
                .filter(|ip| ip.to_string() == text && ip.to_ipv4_mapped().is_none())
        }
        let mut checked = 0;
        for zeros in 0u32..256 {
            for fill in [0x1u16, 0xa, 0xf0, 0xabc, 0xffff, 0x1000] {
                let mut segments = [0u16; 8];
                for (index, segment) in segments.iter_mut().enumerate() {
                    if zeros & (1 << index) == 0 {
                        *segment = fill.wrapping_add(index as u16) | 1;
                    }
                }
                let ip = std::net::Ipv6Addr::from(segments);
                let text = ip.to_string();
                let expected = (ip.to_ipv4_mapped().is_none()).then_some(ip);
                assert_eq!(canonical_ipv6(text.as_bytes()), expected, "{text}");
                // Other spellings of the same address: not canonical.
                let full = segments.map(|s| format!("{s:x}")).join(":");
                let padded = segments.map(|s| format!("{s:04x}")).join(":");
                for other in [
                    full,
                    padded,
                    text.to_uppercase(),
                    format!("{text}:"),
                    format!(":{text}"),
                ] {
                    assert_eq!(
                        canonical_ipv6(other.as_bytes()),
                        std_canonical(&other),
                        "{other}"
                    );
                }
                checked += 1;
            }
        }
        for text in [
            "",
            ":",
            "::",
            ":::",
            "::1",
            "1::",
            "1:2:3:4:5:6:7:8",
            "1:2:3:4:5:6:7:8:9",
            "1:2:3:4::5:6:7:8",
            "1::2::3",
            "fd00::0:1",
            "fd00:0::1",
            "fd00::01",
            "fd00::12345",
            "fd00::g",
            "fd00::1%eth0",
            "::ffff:10.0.0.1",
            "::ffff:a00:1",
            "::a00:1",
            "::10.0.0.1",
            "1:0:0:1:0:0:0:1",
            "1::1:0:0:0:1",
            "1:0:0:1::1",
            "0:0:1::",
            "::1:0:0",
            "1:2:3:4:5:6::",
            "1:2:3:4:5:6:7::",
            "::2:3:4:5:6:7:8",
            "1:2:3:4:5:6:0:0",
            "fd00:\u{e9}::1",
        ] {
            assert_eq!(
                canonical_ipv6(text.as_bytes()),
                std_canonical(text),
                "{text:?}"
            );
            checked += 1;
        }
        assert!(checked > 1_500);
    }

    #[test]
    fn ip_names_render_back_exactly() {
        for text in [
            "10.0.0.1",
            "fd00::1",
            "FD00::1",
            "fd00:0:0:0:0:0:0:1",
            "::ffff:10.0.0.1",
            "010.0.0.1",
            "not-an-ip",
        ] {
            assert_eq!(IpName::new(text).to_string(), text);
        }
        assert!(matches!(IpName::new("fd00::1"), IpName::Canonical(_)));
        assert!(matches!(IpName::new("FD00::1"), IpName::Other(_)));
        assert_eq!(
            IpName::new("FD00::1").ip(),
            Some("fd00::1".parse().unwrap())
        );
        assert_eq!(IpName::new("010.0.0.1").ip(), None);
    }

    #[test]
    fn timestamps_match_jiff() {
        // Every day of several years (leap and not), at varied times of day.
        let mut day = jiff::civil::date(1999, 12, 1);
        let mut checked = 0;
        while day < jiff::civil::date(2101, 3, 2) {
            let seconds = (checked * 7_919) % 86_400;
            let text = format!(
                "{day}T{:02}:{:02}:{:02}Z",
                seconds / 3_600,
                seconds / 60 % 60,
                seconds % 60
            );
            assert_eq!(
                utc_seconds_timestamp(&text),
                Some(text.parse::<jiff::Timestamp>().unwrap()),
                "{text}"
            );
            day = day.tomorrow().unwrap();
            checked += 1;
        }
        for edge in [
            "0000-01-01T00:00:00Z",
            "0001-01-01T00:00:00Z",
            "1600-02-29T12:00:00Z",
            "1969-12-31T23:59:59Z",
            "1970-01-01T00:00:00Z",
            "9999-12-30T22:00:00Z",
            // Past jiff's range: both say no.
            "9999-12-31T23:59:59Z",
        ] {
            assert_eq!(
                utc_seconds_timestamp(edge),
                edge.parse::<jiff::Timestamp>().ok(),
                "{edge}"
            );
        }
        for bad in [
            "2026-02-29T00:00:00Z",
            "2026-13-01T00:00:00Z",
            "2026-00-01T00:00:00Z",
            "2026-01-01T24:00:00Z",
            "2026-01-01T00:60:00Z",
            "2026-01-01 00:00:00Z",
        ] {
            assert_eq!(utc_seconds_timestamp(bad), None, "{bad}");
        }
        // Other RFC 3339 spellings still parse, through jiff.
        assert_eq!(
            parse_timestamp("2026-01-02T03:04:05.5+01:00"),
            Some("2026-01-02T02:04:05.5Z".parse().unwrap())
        );
        assert_eq!(parse_timestamp("yesterday"), None);
    }

    #[test]
    fn decodes_ipaddress_labels_and_times() {
        let json = r#"{"metadata":{"name":"10.0.0.5","uid":"u","resourceVersion":"7",
            "creationTimestamp":"2026-01-02T03:04:05Z",
            "labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4","x":"y"}},
            "spec":{"parentRef":{"resource":"services","namespace":"d","name":"s"}}}"#;
        let ip: IpAddressRecord = serde_json::from_str(json).unwrap();
        assert!(ip.managed_by_ipallocator());
        assert_eq!(ip.labels.family(), Some("IPv4"));
        let parent = ip.parent.unwrap();
        assert!(parent.is_service());
        assert_eq!(&*parent.name, "s");
        assert_eq!(ip.created.unwrap().to_string(), "2026-01-02T03:04:05Z");
        assert!(!ip.deleting);
    }
}

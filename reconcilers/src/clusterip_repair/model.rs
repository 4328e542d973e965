//! The compact records the repair works on: each object the caches receive is projected to
//! the fields the repair reads and dropped (at 100,000 Services the full objects would take
//! hundreds of megabytes: managedFields, annotations, status).

use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
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
    /// 0 when not a number.
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
    pub fn parse(text: &str) -> Self {
        match text {
            "TCP" | "" => Protocol::Tcp,
            "UDP" => Protocol::Udp,
            "SCTP" => Protocol::Sctp,
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
        parse_ip_sloppy(text).map_or_else(|| ClusterIp::Invalid(text.into()), ClusterIp::Ip)
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

    /// The order of the Services' etcd keys ([`key_order`]).
    pub fn key_cmp(&self, other: &Self) -> std::cmp::Ordering {
        key_order((&self.namespace, &self.name), (&other.namespace, &other.name))
    }
}

/// The order kube-apiserver lists objects in: their etcd keys `<prefix>/<namespace>/<name>`
/// compared as bytes. Upstream's repairs walk a LIST in this order, so the first of two Services
/// holding one IP or port is the one with the smaller key. It is not (namespace, name) order:
/// `-` sorts before the `/` that ends a namespace, so `a-b/x` comes before `a/y`.
pub fn key_order(a: (&str, &str), b: (&str, &str)) -> std::cmp::Ordering {
    let (a_ns, b_ns) = (a.0.as_bytes(), b.0.as_bytes());
    if a_ns == b_ns {
        return a.1.cmp(b.1);
    }
    // Namespaces hold no `/`: where one namespace is a prefix of the other, its `/` meets the
    // other's next byte.
    let common = a_ns.len().min(b_ns.len());
    match a_ns[..common].cmp(&b_ns[..common]) {
        std::cmp::Ordering::Equal => {
            let a_next = a_ns.get(common).copied().unwrap_or(b'/');
            let b_next = b_ns.get(common).copied().unwrap_or(b'/');
            a_next.cmp(&b_next)
        }
        unequal => unequal,
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
        let kind = if group.is_empty() && resource == "services" {
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
        if value == Some(IPALLOCATOR_MANAGER) {
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
        let bit = match value {
            Some("IPv4") => Some(FAMILY_IPV4),
            Some("IPv6") => Some(FAMILY_IPV6),
            _ => None,
        };
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
    /// Canonical when the name parses and renders back as written.
    pub fn new(text: &str) -> Self {
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

fn name_of(text: Option<&String>) -> Name {
    Name::new(text.map_or("", String::as_str))
}

fn version_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

impl From<&Service> for ServiceRecord {
    fn from(service: &Service) -> Self {
        let meta = &service.metadata;
        let spec = service.spec.as_ref();
        let cluster_ip = spec.and_then(|spec| spec.cluster_ip.as_deref());
        // upstream's IsServiceIPSet: a Service without a cluster IP, or a headless one, has no
        // IPs to repair whatever clusterIPs says.
        let has_ip = cluster_ip.is_some_and(|ip| !ip.is_empty() && ip != "None");
        let listed = spec
            .and_then(|spec| spec.cluster_ips.as_deref())
            .filter(|ips| !ips.is_empty());
        let cluster_ips = match (has_ip, listed) {
            (false, _) => ClusterIps::new(),
            (true, Some(ips)) => ips.iter().map(|ip| ClusterIp::parse(ip)).collect(),
            (true, None) => cluster_ip.map(ClusterIp::parse).into_iter().collect(),
        };
        let node_ports = spec
            .and_then(|spec| spec.ports.as_deref())
            .unwrap_or_default()
            .iter()
            .filter_map(|port| {
                let node_port = port.node_port.filter(|port| *port != 0)?;
                Some((
                    node_port,
                    Protocol::parse(port.protocol.as_deref().unwrap_or("")),
                ))
            })
            .collect();
        Self {
            namespace: name_of(meta.namespace.as_ref()),
            name: name_of(meta.name.as_ref()),
            uid: Token::new(meta.uid.as_deref().unwrap_or("")),
            resource_version: version_of(meta),
            cluster_ips,
            node_ports,
            health_check_node_port: spec
                .and_then(|spec| spec.health_check_node_port)
                .unwrap_or(0),
            created: meta.creation_timestamp.as_ref().map(|time| time.0),
        }
    }
}

/// An IPAddress as the cache receives it: k8s-openapi's type requires `spec.parentRef` and its
/// fields, and one object without them (the API validates them, a broken or hostile store may
/// not) would fail every list of the collection; this one takes any spec.
#[derive(Clone, Debug, Deserialize)]
pub struct IpAddressObject {
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: IpAddressObjectSpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct IpAddressObjectSpec {
    pub parent_ref: Option<IpAddressParent>,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct IpAddressParent {
    pub group: String,
    pub resource: String,
    pub namespace: String,
    pub name: String,
}

impl kube::Resource for IpAddressObject {
    type DynamicType = ();
    type Scope = kube::core::ClusterResourceScope;

    fn kind(_: &()) -> std::borrow::Cow<'_, str> {
        "IPAddress".into()
    }
    fn group(_: &()) -> std::borrow::Cow<'_, str> {
        "networking.k8s.io".into()
    }
    fn version(_: &()) -> std::borrow::Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> std::borrow::Cow<'_, str> {
        "ipaddresses".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<&IpAddressObject> for IpAddressRecord {
    fn from(object: &IpAddressObject) -> Self {
        let meta = &object.metadata;
        let label = |key: &str| meta.labels.as_ref()?.get(key).map(String::as_str);
        Self {
            name: IpName::new(meta.name.as_deref().unwrap_or("")),
            uid: Token::new(meta.uid.as_deref().unwrap_or("")),
            resource_version: Token::new(meta.resource_version.as_deref().unwrap_or("")),
            labels: IpLabels::new(label(LABEL_MANAGED_BY), label(LABEL_IP_FAMILY)),
            parent: object.spec.parent_ref.as_ref().map(|parent| {
                ParentRef::new(
                    &parent.group,
                    &parent.resource,
                    Name::new(&parent.namespace),
                    Name::new(&parent.name),
                )
            }),
            created: meta.creation_timestamp.as_ref().map(|time| time.0),
            deleting: meta.deletion_timestamp.is_some(),
        }
    }
}

impl From<&ServiceCIDR> for ServiceCidrRecord {
    fn from(cidr: &ServiceCIDR) -> Self {
        let raw: &[String] = cidr
            .spec
            .as_ref()
            .and_then(|spec| spec.cidrs.as_deref())
            .unwrap_or_default();
        Self {
            name: cidr.metadata.name.as_deref().unwrap_or("").into(),
            resource_version: version_of(&cidr.metadata),
            cidrs: raw.iter().filter_map(|text| text.parse().ok()).collect(),
            raw_cidrs: raw.iter().map(|text| text.as_str().into()).collect(),
            deleting: cidr.metadata.deletion_timestamp.is_some(),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn service(json: &str) -> ServiceRecord {
        ServiceRecord::from(&serde_json::from_str::<Service>(json).unwrap())
    }

    fn ip_address(json: &str) -> IpAddressRecord {
        IpAddressRecord::from(&serde_json::from_str::<IpAddressObject>(json).unwrap())
    }

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    /// The order of `<namespace>/<name>` as bytes, for every pair of a few names chosen around
    /// the `/`: `-` and `.` sort below it, digits and letters above.
    #[test]
    fn key_order_is_the_order_of_the_keys_as_bytes() {
        let names = [
            ("a", "z"),
            ("a", "y"),
            ("a-b", "x"),
            ("a0", "a"),
            ("a", "a-b"),
            ("ab", "a"),
            ("", "a"),
            ("a", ""),
            ("b", "a"),
        ];
        for a in names {
            for b in names {
                let want = format!("{}/{}", a.0, a.1)
                    .as_bytes()
                    .cmp(format!("{}/{}", b.0, b.1).as_bytes());
                assert_eq!(key_order(a, b), want, "{a:?} vs {b:?}");
            }
        }
        assert_eq!(
            key_order(("a-b", "x"), ("a", "y")),
            std::cmp::Ordering::Less
        );
    }


    #[test]
    fn decodes_a_dual_stack_service() {
        let json = r#"{"apiVersion":"v1","kind":"Service","metadata":{"name":"web","namespace":"shop",
            "uid":"u1","resourceVersion":"42","managedFields":[{"manager":"x"}]},
            "spec":{"clusterIP":"10.0.0.5","clusterIPs":["10.0.0.5","fd00::5"],"ports":[{"port":80}]}}"#;
        let svc = service(json);
        assert_eq!(&*svc.namespace, "shop");
        assert_eq!(&*svc.name, "web");
        assert_eq!(svc.resource_version, 42);
        assert_eq!(svc.cluster_ips.len(), 2);
        assert!(svc.lists_ip("fd00::5".parse().unwrap()));
        assert!(!svc.lists_ip("10.0.0.6".parse().unwrap()));
    }

    #[test]
    fn headless_and_old_services() {
        let headless = service(
            r#"{"metadata":{"name":"h","namespace":"d"},"spec":{"clusterIP":"None","clusterIPs":["None"]}}"#,
        );
        assert!(headless.cluster_ips.is_empty());
        let external =
            service(r#"{"metadata":{"name":"e","namespace":"d"},"spec":{"type":"ExternalName"}}"#);
        assert!(external.cluster_ips.is_empty());
        let old =
            service(r#"{"metadata":{"name":"o","namespace":"d"},"spec":{"clusterIP":"10.0.0.9"}}"#);
        assert_eq!(
            old.cluster_ips[0],
            ClusterIp::Ip("10.0.0.9".parse().unwrap())
        );
    }

    #[test]
    fn decodes_upstream_fixtures() {
        let ip = ip_address(
            &std::fs::read_to_string(format!("{FIXTURES}/networking.k8s.io.v1.IPAddress.json"))
                .unwrap(),
        );
        assert!(!ip.name.to_string().is_empty());
        assert!(ip.parent.is_some());
        let cidr = ServiceCidrRecord::from(
            &serde_json::from_str::<ServiceCIDR>(
                &std::fs::read_to_string(format!(
                    "{FIXTURES}/networking.k8s.io.v1.ServiceCIDR.json"
                ))
                .unwrap(),
            )
            .unwrap(),
        );
        assert!(!cidr.raw_cidrs.is_empty());
        assert!(
            cidr.cidrs.is_empty(),
            "placeholder CIDR strings are not parsed as ranges"
        );
        let svc =
            service(&std::fs::read_to_string(format!("{FIXTURES}/core.v1.Service.json")).unwrap());
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
        let mut record = ip_address(
            r#"{"metadata":{"name":"10.0.0.5","labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4"}}}"#,
        );
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
    fn decodes_ipaddress_labels_and_times() {
        let json = r#"{"metadata":{"name":"10.0.0.5","uid":"u","resourceVersion":"7",
            "creationTimestamp":"2026-01-02T03:04:05Z",
            "labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4","x":"y"}},
            "spec":{"parentRef":{"resource":"services","namespace":"d","name":"s"}}}"#;
        let ip = ip_address(json);
        assert!(ip.managed_by_ipallocator());
        assert_eq!(ip.labels.family(), Some("IPv4"));
        let parent = ip.parent.unwrap();
        assert!(parent.is_service());
        assert_eq!(&*parent.name, "s");
        assert_eq!(ip.created.unwrap().to_string(), "2026-01-02T03:04:05Z");
        assert!(!ip.deleting);
    }

    /// An IPAddress without a parentRef (or without its fields) is a record, not a failed list.
    #[test]
    fn ipaddress_without_a_parent_is_projected() {
        let bare = ip_address(r#"{"metadata":{"name":"10.0.0.6"},"spec":{}}"#);
        assert_eq!(bare.parent, None);
        let empty = ip_address(r#"{"metadata":{"name":"foo"},"spec":{"parentRef":{}}}"#);
        let parent = empty.parent.unwrap();
        assert!(!parent.is_service());
        assert_eq!(empty.name.ip(), None);
    }
}

//! The compact record of a Service the repairs keep: each Service the cache receives is projected
//! to the fields the ClusterIP and NodePort repairs read and dropped (at 100,000 Services the full
//! objects would take hundreds of megabytes: managedFields, annotations, status).
//!
//! The objects are decoded into lean types of their own ([`ServiceObject`], [`LeanMeta`]) that
//! read only those fields and take any shape kube-apiserver serves: nulls where k8s-openapi wants
//! a value (a status condition written without `lastTransitionTime` is stored and served with
//! `null`), missing optional fields, fields a newer API adds. One object the decoder refused
//! would fail the watch's event about it (a delete lost, a deleted Service kept for ever) or a
//! whole LIST.

use std::collections::BTreeMap;
use std::net::IpAddr;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde::{Deserialize, Deserializer};

use crate::alloc::parse_ip_sloppy;

/// A namespace or object name. Kept inline up to 24 bytes (most names; no heap allocation):
/// the decision compares each IPAddress's parent with its Service's namespace and name, and with
/// the text inside the record that costs no extra cache miss.
pub type Name = compact_str::CompactString;

/// A Service as a repair names it: the one an event is about, an IPAddress is (re)created for,
/// an IPAddress's parent, the first holder of a bit or of a duplicated IP. Its uid is the
/// object's the cache saw, or empty where only the name is known (a parent the cache does not
/// hold, the `kubernetes` Service as configured): a live read then accepts whichever Service
/// has the name.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceRef {
    pub namespace: Name,
    pub name: Name,
    pub uid: Token,
}

impl ServiceRef {
    pub fn of(svc: &ServiceRecord) -> Self {
        Self {
            namespace: svc.namespace.clone(),
            name: svc.name.clone(),
            uid: svc.uid.clone(),
        }
    }

    pub fn named(namespace: &str, name: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
            uid: Token::new(""),
        }
    }
}

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

    /// The text kept of an entry that does not parse.
    pub fn heap_bytes(&self) -> usize {
        match self {
            ClusterIp::Ip(_) => 0,
            ClusterIp::Invalid(raw) => raw.len(),
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
    #[inline]
    pub fn key_cmp(&self, other: &Self) -> std::cmp::Ordering {
        key_order(
            (&self.namespace, &self.name),
            (&other.namespace, &other.name),
        )
    }
}

/// The order kube-apiserver lists objects in: their etcd keys `<prefix>/<namespace>/<name>`
/// compared as bytes. Upstream's repairs walk a LIST in this order, so the first of two Services
/// holding one IP or port is the one with the smaller key. It is not (namespace, name) order:
/// `-` sorts before the `/` that ends a namespace, so `a-b/x` comes before `a/y`.
#[inline]
pub fn key_order(a: (&str, &str), b: (&str, &str)) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (a_ns, b_ns) = (a.0.as_bytes(), b.0.as_bytes());
    let common = a_ns.len().min(b_ns.len());
    match a_ns[..common].cmp(&b_ns[..common]) {
        // Namespaces hold no `/`: where one is a prefix of the other, its `/` meets the other's
        // next byte.
        Ordering::Equal => match a_ns.len().cmp(&b_ns.len()) {
            Ordering::Equal => a.1.cmp(b.1),
            Ordering::Less => b'/'.cmp(&b_ns[common]),
            Ordering::Greater => a_ns[common].cmp(&b'/'),
        },
        unequal => unequal,
    }
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

    /// The text kept of a token without the usual shape.
    pub fn heap_bytes(&self) -> usize {
        match self {
            Token::Uuid(_) | Token::Number(_) => 0,
            Token::Text(text) => text.len(),
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

pub(crate) fn name_of(text: Option<&String>) -> Name {
    Name::new(text.map_or("", String::as_str))
}

pub(crate) fn version_of(meta: &ObjectMeta) -> u64 {
    meta.resource_version
        .as_deref()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}

/// Decodes a field whose `null` means its default, as Go's decoder reads it into the zero value.
pub(crate) fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// `metadata` as the repairs read it: the identity `kube::Resource` and the watcher need (name,
/// namespace, uid, resourceVersion) in an [`ObjectMeta`], with the labels and the two times; the
/// rest (managedFields, ownerReferences, annotations) is skipped unread. A time that does not
/// parse is left out (a missing creation time counts as old, as upstream's repair takes it);
/// `deleting` says whether any `deletionTimestamp` was given.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeanMeta {
    pub meta: ObjectMeta,
    pub deleting: bool,
}

impl<'de> Deserialize<'de> for LeanMeta {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Default, Deserialize)]
        #[serde(default, rename_all = "camelCase")]
        struct Wire {
            name: Option<String>,
            namespace: Option<String>,
            uid: Option<String>,
            resource_version: Option<String>,
            creation_timestamp: Option<String>,
            deletion_timestamp: Option<String>,
            #[serde(deserialize_with = "labels_without_nulls")]
            labels: BTreeMap<String, String>,
        }
        let wire = Option::<Wire>::deserialize(deserializer)?.unwrap_or_default();
        let time = |text: Option<&String>| Some(Time(text?.parse().ok()?));
        let labels = wire.labels;
        Ok(Self {
            deleting: wire.deletion_timestamp.is_some(),
            meta: ObjectMeta {
                creation_timestamp: time(wire.creation_timestamp.as_ref()),
                deletion_timestamp: time(wire.deletion_timestamp.as_ref()),
                labels: (!labels.is_empty()).then_some(labels),
                name: wire.name,
                namespace: wire.namespace,
                uid: wire.uid,
                resource_version: wire.resource_version,
                ..ObjectMeta::default()
            },
        })
    }
}

/// `metadata.labels`, a `null` map or value read as absent, straight into the map `ObjectMeta`
/// holds (no second map per object: 130,000 IPAddresses in a LIST at scale).
fn labels_without_nulls<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    struct Labels;
    impl<'de> serde::de::Visitor<'de> for Labels {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a map of label values, or null")
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(BTreeMap::new())
        }
        fn visit_some<D: Deserializer<'de>>(self, inner: D) -> Result<Self::Value, D::Error> {
            inner.deserialize_map(self)
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut labels = BTreeMap::new();
            while let Some((key, value)) = map.next_entry::<String, Option<String>>()? {
                if let Some(value) = value {
                    labels.insert(key, value);
                }
            }
            Ok(labels)
        }
    }
    deserializer.deserialize_option(Labels)
}

/// A core/v1 Service as the Service cache and the repairs' live reads decode it: the fields
/// [`ServiceRecord`] holds, every one optional, `null` read as unset, anything else ignored
/// (`status` above all, where kube-apiserver keeps conditions as their writer gave them).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ServiceObject {
    pub metadata: LeanMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub spec: ServiceObjectSpec,
}

/// The parts of `spec` a [`ServiceRecord`] holds.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ServiceObjectSpec {
    #[serde(rename = "clusterIP")]
    pub cluster_ip: Option<String>,
    #[serde(rename = "clusterIPs", deserialize_with = "null_as_default")]
    pub cluster_ips: Vec<Option<String>>,
    #[serde(deserialize_with = "null_as_default")]
    pub ports: Vec<Option<ServiceObjectPort>>,
    pub health_check_node_port: Option<i32>,
}

/// The parts of `spec.ports[]` the NodePort repair counts.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ServiceObjectPort {
    pub node_port: Option<i32>,
    pub protocol: Option<String>,
}

/// `kube::Resource` for a lean type decoding objects of the API type `$api` (its `metadata` a
/// [`LeanMeta`]): kind, group, version, plural and scope are `$api`'s own.
macro_rules! lean_resource {
    ($lean:ty, $api:ty) => {
        impl kube::Resource for $lean {
            type DynamicType = ();
            type Scope = <$api as k8s_openapi::Resource>::Scope;

            fn kind(_: &()) -> std::borrow::Cow<'_, str> {
                <$api as k8s_openapi::Resource>::KIND.into()
            }
            fn group(_: &()) -> std::borrow::Cow<'_, str> {
                <$api as k8s_openapi::Resource>::GROUP.into()
            }
            fn version(_: &()) -> std::borrow::Cow<'_, str> {
                <$api as k8s_openapi::Resource>::VERSION.into()
            }
            fn plural(_: &()) -> std::borrow::Cow<'_, str> {
                <$api as k8s_openapi::Resource>::URL_PATH_SEGMENT.into()
            }
            fn meta(&self) -> &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata.meta
            }
            fn meta_mut(
                &mut self,
            ) -> &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata.meta
            }
        }
    };
}
pub(crate) use lean_resource;

lean_resource!(ServiceObject, k8s_openapi::api::core::v1::Service);

impl From<&ServiceObject> for ServiceRecord {
    fn from(service: &ServiceObject) -> Self {
        let meta = &service.metadata.meta;
        let spec = &service.spec;
        let cluster_ip = spec.cluster_ip.as_deref();
        // upstream's IsServiceIPSet: a Service without a cluster IP, or a headless one, has no
        // IPs to repair whatever clusterIPs says.
        let has_ip = cluster_ip.is_some_and(|ip| !ip.is_empty() && ip != "None");
        let listed = spec.cluster_ips.iter().flatten();
        let cluster_ips = match (has_ip, spec.cluster_ips.iter().any(Option::is_some)) {
            (false, _) => ClusterIps::new(),
            (true, true) => listed.map(|ip| ClusterIp::parse(ip)).collect(),
            (true, false) => cluster_ip.map(ClusterIp::parse).into_iter().collect(),
        };
        let node_ports = spec
            .ports
            .iter()
            .flatten()
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
            health_check_node_port: spec.health_check_node_port.unwrap_or(0),
            created: meta.creation_timestamp.as_ref().map(|time| time.0),
        }
    }
}

impl crate::watch_cache::Cached for ServiceRecord {
    type Object = ServiceObject;
    type Key = (Name, Name);
    fn project(object: &ServiceObject) -> Self {
        ServiceRecord::from(object)
    }
    fn key(&self) -> Self::Key {
        (self.namespace.clone(), self.name.clone())
    }
    /// A uid of any other shape than a UUID, cluster IPs that do not parse and node ports are
    /// the object's to make as large as it likes; two cluster IPs stay inside the record.
    fn heap_bytes(&self) -> usize {
        let spilled = if self.cluster_ips.spilled() {
            self.cluster_ips.capacity() * size_of::<ClusterIp>()
        } else {
            0
        };
        self.uid.heap_bytes()
            + spilled
            + self
                .cluster_ips
                .iter()
                .map(ClusterIp::heap_bytes)
                .sum::<usize>()
            + size_of_val::<[(i32, Protocol)]>(&self.node_ports)
    }
    fn resource_version(&self) -> Option<u64> {
        (self.resource_version != 0).then_some(self.resource_version)
    }
}

/// The parts of a ServiceCIDR its loops need (the ClusterIP repair, the service-cidr loop).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCidrRecord {
    pub name: Box<str>,
    pub resource_version: u64,
    /// Parsed `spec.cidrs`; entries that do not parse are dropped (the API validates them).
    pub cidrs: Vec<IpNet>,
    pub deleting: bool,
}

/// A ServiceCIDR as the cache receives it: `spec.cidrs` and the metadata the record holds,
/// decoded as leniently as a Service.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ServiceCidrObject {
    pub metadata: LeanMeta,
    #[serde(deserialize_with = "null_as_default")]
    pub spec: ServiceCidrObjectSpec,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct ServiceCidrObjectSpec {
    #[serde(deserialize_with = "null_as_default")]
    pub cidrs: Vec<Option<String>>,
}

lean_resource!(
    ServiceCidrObject,
    k8s_openapi::api::networking::v1::ServiceCIDR
);

impl From<&ServiceCidrObject> for ServiceCidrRecord {
    fn from(cidr: &ServiceCidrObject) -> Self {
        let meta = &cidr.metadata.meta;
        let cidrs = cidr.spec.cidrs.iter().flatten();
        Self {
            name: meta.name.as_deref().unwrap_or("").into(),
            resource_version: version_of(meta),
            cidrs: cidrs.filter_map(|text| text.parse().ok()).collect(),
            deleting: cidr.metadata.deleting,
        }
    }
}

impl crate::watch_cache::Cached for ServiceCidrRecord {
    type Object = ServiceCidrObject;
    type Key = Box<str>;
    fn project(object: &ServiceCidrObject) -> Self {
        ServiceCidrRecord::from(object)
    }
    fn key(&self) -> Self::Key {
        self.name.clone()
    }
    /// The list of CIDRs, as many as the object gives.
    fn heap_bytes(&self) -> usize {
        self.cidrs.capacity() * size_of::<IpNet>()
    }
    fn resource_version(&self) -> Option<u64> {
        (self.resource_version != 0).then_some(self.resource_version)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::watch_cache::Cached;

    fn service(json: &str) -> ServiceRecord {
        ServiceRecord::from(&serde_json::from_str::<ServiceObject>(json).unwrap())
    }

    fn weight<T: Cached>(object: serde_json::Value) -> usize {
        T::weight(&serde_json::from_value(object).unwrap())
    }

    /// A Service as kube-apiserver makes them: nothing of it on the heap, so the budget
    /// counts no more than its cache entry and names, and a budget sized for compact records
    /// holds as many as it was sized for.
    #[test]
    fn an_ordinary_service_weighs_its_entry_and_names() {
        let object = serde_json::json!({
            "metadata": {"name": "web", "namespace": "shop",
                "uid": "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f", "resourceVersion": "48213",
                "creationTimestamp": "2026-11-28T10:00:00Z"},
            "spec": {"clusterIP": "10.96.1.2", "clusterIPs": ["10.96.1.2"],
                "ports": [{"port": 80, "protocol": "TCP", "targetPort": 8080}]},
        });
        let record = ServiceRecord::project(&serde_json::from_value(object.clone()).unwrap());
        assert_eq!(record.heap_bytes(), 0);
        let ordinary = weight::<ServiceRecord>(object);
        assert!(ordinary < 512, "{ordinary}");
    }

    /// A tenant's API may serve a uid that is no UUID, cluster IPs that do not parse and node
    /// ports by the thousand: the record keeps them all, so the budget counts them all.
    #[test]
    fn a_service_weighs_the_text_and_lists_it_keeps() {
        let uid = "u".repeat(1 << 20);
        let weight_of_uid = weight::<ServiceRecord>(serde_json::json!({
            "metadata": {"name": "s", "namespace": "d", "uid": uid},
        }));
        assert!(weight_of_uid >= 1 << 20, "{weight_of_uid}");

        let ips: Vec<String> = (0..10_000).map(|i| format!("not-an-ip-{i}")).collect();
        let text: usize = ips.iter().map(String::len).sum();
        let weight_of_ips = weight::<ServiceRecord>(serde_json::json!({
            "metadata": {"name": "s", "namespace": "d"},
            "spec": {"clusterIP": ips[0], "clusterIPs": ips},
        }));
        assert!(
            weight_of_ips >= text + 10_000 * size_of::<ClusterIp>(),
            "{weight_of_ips}"
        );

        let ports: Vec<_> = (1..=10_000)
            .map(|port| serde_json::json!({"port": 80, "nodePort": port}))
            .collect();
        let weight_of_ports = weight::<ServiceRecord>(serde_json::json!({
            "metadata": {"name": "s", "namespace": "d"},
            "spec": {"ports": ports},
        }));
        assert!(
            weight_of_ports >= 10_000 * size_of::<(i32, Protocol)>(),
            "{weight_of_ports}"
        );
    }

    /// `spec.cidrs` is kept parsed: every CIDR counts, whatever their number; text that does
    /// not parse is not kept, so however long it is it costs nothing.
    #[test]
    fn a_service_cidr_weighs_the_cidrs_it_keeps() {
        let valid: Vec<String> = (0..1_000)
            .map(|i| format!("10.{}.0.0/24", i % 256))
            .collect();
        let of_valid = weight::<ServiceCidrRecord>(serde_json::json!({
            "metadata": {"name": "kubernetes"},
            "spec": {"cidrs": valid},
        }));
        assert!(of_valid >= 1_000 * size_of::<IpNet>(), "{of_valid}");

        let text: Vec<String> = (0..1_000)
            .map(|i| format!("{i}-{}", "x".repeat(1 << 10)))
            .collect();
        let object =
            serde_json::json!({"metadata": {"name": "kubernetes"}, "spec": {"cidrs": text}});
        let record = ServiceCidrRecord::project(&serde_json::from_value(object.clone()).unwrap());
        assert!(record.cidrs.is_empty());
        assert!(weight::<ServiceCidrRecord>(object) < 512);
    }

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
            "spec":{"clusterIP":"192.0.2.5","clusterIPs":["192.0.2.5","fd00::5"],"ports":[{"port":80}]}}"#;
        let svc = service(json);
        assert_eq!(&*svc.namespace, "shop");
        assert_eq!(&*svc.name, "web");
        assert_eq!(svc.resource_version, 42);
        assert_eq!(svc.cluster_ips.len(), 2);
        assert!(svc.lists_ip("fd00::5".parse().unwrap()));
        assert!(!svc.lists_ip("192.0.2.6".parse().unwrap()));
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
        let old = service(
            r#"{"metadata":{"name":"o","namespace":"d"},"spec":{"clusterIP":"192.0.2.9"}}"#,
        );
        assert_eq!(
            old.cluster_ips[0],
            ClusterIp::Ip("192.0.2.9".parse().unwrap())
        );
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
            "uid-192.0.2.5",
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

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    fn fixture(name: &str) -> String {
        std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap()
    }

    /// Upstream's round-trip fixture, every field of the type set, in both encodings a client
    /// may read: the record holds what it says.
    #[test]
    fn decodes_the_upstream_fixture_as_json_and_yaml() {
        let json: ServiceObject = serde_json::from_str(&fixture("core.v1.Service.json")).unwrap();
        let yaml: ServiceObject = serde_saphyr::from_str(&fixture("core.v1.Service.yaml")).unwrap();
        for object in [json, yaml] {
            let svc = ServiceRecord::from(&object);
            assert_eq!(
                (&*svc.namespace, &*svc.name),
                ("namespaceValue", "nameValue")
            );
            assert_eq!(svc.uid.to_string(), "uidValue");
            assert_eq!(svc.resource_version, 0, "not a number");
            assert_eq!(
                svc.cluster_ips.as_slice(),
                [ClusterIp::Invalid("clusterIPsValue".into())]
            );
            assert_eq!(&*svc.node_ports, [(5, Protocol::Other)]);
            assert_eq!(svc.health_check_node_port, 12);
            assert_eq!(svc.created.unwrap().to_string(), "2008-01-01T01:01:01Z");
            assert!(object.metadata.deleting);
            assert_eq!(
                object.metadata.meta.labels.unwrap()["labelsKey"],
                "labelsValue"
            );
        }
    }

    /// What kube-apiserver serves after a client set a Service status condition without
    /// `lastTransitionTime` (the conformance test "should complete a service status
    /// lifecycle" does): it stores and serves `null`. k8s-openapi's Service refuses the object,
    /// which cost the watch that Service's update and delete events; the lean object reads it.
    const NULL_TRANSITION_TIME: &str = r#"{
        "kind": "Service", "apiVersion": "v1",
        "metadata": {"name": "test-service-lifecycle", "namespace": "services-5151",
            "uid": "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f", "resourceVersion": "48213",
            "creationTimestamp": "2026-11-28T10:00:00Z", "labels": {"test-service-static": "true"},
            "managedFields": [{"manager": "e2e.test", "operation": "Update", "apiVersion": "v1",
                "time": "2026-11-28T10:00:01Z", "fieldsType": "FieldsV1", "fieldsV1": {},
                "subresource": "status"}]},
        "spec": {"ports": [{"name": "http", "protocol": "TCP", "port": 80, "targetPort": 80}],
            "clusterIP": "192.0.2.15", "clusterIPs": ["192.0.2.15"], "type": "ClusterIP",
            "sessionAffinity": "None", "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
            "internalTrafficPolicy": "Cluster"},
        "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.250"}]},
            "conditions": [{"type": "StatusUpdate", "status": "True", "lastTransitionTime": null,
                "reason": "E2E", "message": "Set from e2e test"}]}
    }"#;

    #[test]
    fn a_condition_without_transition_time_fails_k8s_openapi_but_not_the_lean_object() {
        let refused =
            serde_json::from_str::<k8s_openapi::api::core::v1::Service>(NULL_TRANSITION_TIME)
                .unwrap_err();
        assert!(refused.to_string().contains("null"), "{refused}");
        let svc = service(NULL_TRANSITION_TIME);
        assert_eq!(&*svc.name, "test-service-lifecycle");
        assert_eq!(svc.resource_version, 48213);
        assert!(svc.lists_ip("192.0.2.15".parse().unwrap()));
        assert!(matches!(svc.uid, Token::Uuid(_)));
    }

    /// Shapes a real apiserver may serve (nulls for anything optional, fields missing, fields
    /// this code does not know) and a few no validation would let through: each decodes.
    #[test]
    fn nulls_missing_and_unknown_fields_decode() {
        let empty = service("{}");
        assert_eq!(
            (
                empty.name.as_str(),
                empty.uid.to_string(),
                empty.cluster_ips.len()
            ),
            ("", String::new(), 0)
        );
        for json in [
            r#"{"metadata":null,"spec":null,"status":null}"#,
            r#"{"metadata":{"name":null,"namespace":null,"uid":null,"resourceVersion":null,
                "creationTimestamp":null,"deletionTimestamp":null,"labels":null,
                "annotations":null,"ownerReferences":null,"managedFields":null},
               "spec":{"clusterIP":null,"clusterIPs":null,"ports":null,
                "healthCheckNodePort":null,"type":null,"selector":null}}"#,
            r#"{"metadata":{"ownerReferences":[{}],"managedFields":[{"time":null}],
                "labels":{"a":null}},"spec":{"ports":[null,{"nodePort":null,"protocol":null}]},
               "status":{"conditions":[{"lastTransitionTime":null}],"loadBalancer":null}}"#,
        ] {
            let svc = service(json);
            assert!(
                svc.cluster_ips.is_empty() && svc.node_ports.is_empty(),
                "{json}"
            );
            assert_eq!(
                (svc.created, svc.health_check_node_port),
                (None, 0),
                "{json}"
            );
        }
        let odd = serde_json::from_str::<ServiceObject>(
            r#"{"apiVersion":"v1","kind":"Service","futureField":{"x":[1,2]},
                "metadata":{"name":"odd","namespace":"d","creationTimestamp":"yesterday",
                    "deletionTimestamp":"soon","labels":{"kept":"yes","dropped":null},
                    "futureMeta":1},
                "spec":{"clusterIP":"192.0.2.7","clusterIPs":[null,"192.0.2.7"],
                    "ports":[{"port":80,"nodePort":30080,"protocol":"UDP","futurePort":true}],
                    "healthCheckNodePort":30081,"futureSpec":"x"}}"#,
        )
        .unwrap();
        assert!(
            odd.metadata.deleting,
            "any deletionTimestamp means deleting"
        );
        assert_eq!(
            odd.metadata
                .meta
                .labels
                .as_ref()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["kept"]
        );
        let svc = ServiceRecord::from(&odd);
        assert_eq!(svc.created, None, "an unreadable time counts as none");
        assert!(svc.lists_ip("192.0.2.7".parse().unwrap()));
        assert_eq!(&*svc.node_ports, [(30080, Protocol::Udp)]);
        assert_eq!(svc.health_check_node_port, 30081);
    }
}

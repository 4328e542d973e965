//! The compact records of IPAddresses and ServiceCIDRs the ClusterIP repair works on: each object
//! its caches receive is projected to the fields the repair reads and dropped. The Services' are
//! in [`crate::service_cache::record`].

use std::net::IpAddr;

use serde::Deserialize;

use crate::alloc::IpFamily;
use crate::service_cache::record::{LeanMeta, Name, Token, lean_resource, null_as_default};
pub use crate::service_cache::record::{
    ServiceCidrObject, ServiceCidrObjectSpec, ServiceCidrRecord,
};
use crate::watch_cache::Cached;

/// Label naming the controller that manages an IPAddress.
pub const LABEL_MANAGED_BY: &str = "ipaddress.kubernetes.io/managed-by";
/// Label holding an IPAddress's family (`IPv4`/`IPv6`).
pub const LABEL_IP_FAMILY: &str = "ipaddress.kubernetes.io/ip-family";
/// The value of [`LABEL_MANAGED_BY`] on IPAddresses of Service ClusterIPs.
pub const IPALLOCATOR_MANAGER: &str = "ipallocator.k8s.io";

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

    /// Names too long to sit inside the record, and the group and resource of a parent that is
    /// not a Service.
    fn heap_bytes(&self) -> usize {
        let kind = match &self.kind {
            ParentKind::Service => 0,
            ParentKind::Other(other) => {
                size_of::<(Box<str>, Box<str>)>() + other.0.len() + other.1.len()
            }
        };
        name_heap_bytes(&self.namespace) + name_heap_bytes(&self.name) + kind
    }
}

fn name_heap_bytes(name: &Name) -> usize {
    if name.is_heap_allocated() {
        name.capacity()
    } else {
        0
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

    /// The values other than the allocator's, kept behind their pointer.
    fn heap_bytes(&self) -> usize {
        self.unusual.as_ref().map_or(0, |unusual| {
            size_of::<UnusualLabels>()
                + unusual.managed_by.as_ref().map_or(0, |value| value.len())
                + unusual.family.as_ref().map_or(0, |value| value.len())
        })
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

/// Object identity for preconditioned writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectVersion {
    pub uid: Box<str>,
    pub resource_version: Box<str>,
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

/// An IPAddress as the cache receives it: k8s-openapi's type requires `spec.parentRef` and its
/// fields, and one object without them (the API validates them, a broken or hostile store may
/// not) would fail every list of the collection; this one takes any spec, `null` read as unset
/// and unknown fields ignored, as [`crate::service_cache::record::ServiceObject`] does.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(default)]
pub struct IpAddressObject {
    pub metadata: LeanMeta,
    #[serde(deserialize_with = "null_as_default")]
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
    #[serde(deserialize_with = "null_as_default")]
    pub group: String,
    #[serde(deserialize_with = "null_as_default")]
    pub resource: String,
    #[serde(deserialize_with = "null_as_default")]
    pub namespace: String,
    #[serde(deserialize_with = "null_as_default")]
    pub name: String,
}

lean_resource!(IpAddressObject, k8s_openapi::api::networking::v1::IPAddress);

impl From<&IpAddressObject> for IpAddressRecord {
    fn from(object: &IpAddressObject) -> Self {
        let meta = &object.metadata.meta;
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
            deleting: object.metadata.deleting,
        }
    }
}

impl Cached for IpAddressRecord {
    type Object = IpAddressObject;
    /// The name, which is the IP: no allocation for the usual (canonical) names.
    type Key = IpName;
    fn project(object: &IpAddressObject) -> Self {
        IpAddressRecord::from(object)
    }
    fn key(&self) -> Self::Key {
        self.name.clone()
    }
    /// A uid or resourceVersion of an unusual shape, unusual labels and the parent's names and
    /// kind: all the object's to make as large as it likes.
    fn heap_bytes(&self) -> usize {
        self.parent.as_ref().map_or(0, ParentRef::heap_bytes)
            + self.labels.heap_bytes()
            + self.uid.heap_bytes()
            + self.resource_version.heap_bytes()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::service_cache::record::{ServiceObject, ServiceRecord};

    fn service(json: &str) -> ServiceRecord {
        ServiceRecord::from(&serde_json::from_str::<ServiceObject>(json).unwrap())
    }

    fn ip_address(json: &str) -> IpAddressRecord {
        IpAddressRecord::from(&serde_json::from_str::<IpAddressObject>(json).unwrap())
    }

    fn ip_address_weight(object: serde_json::Value) -> usize {
        IpAddressRecord::weight(&serde_json::from_value(object).unwrap())
    }

    /// An IPAddress as the allocator writes them keeps nothing on the heap; one whose uid,
    /// resourceVersion, labels or parent a tenant's API made large is counted for all of it.
    #[test]
    fn an_ip_address_weighs_the_text_it_keeps() {
        let ordinary = ip_address_weight(serde_json::json!({
            "metadata": {"name": "10.96.1.2", "uid": "6f2c1d5e-8b7a-4c3d-9e1f-0a2b3c4d5e6f",
                "resourceVersion": "48213",
                "labels": {LABEL_MANAGED_BY: IPALLOCATOR_MANAGER, LABEL_IP_FAMILY: "IPv4"}},
            "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "shop",
                "name": "web"}},
        }));
        assert!(ordinary < 512, "{ordinary}");

        let huge = "h".repeat(1 << 20);
        for (field, object) in [
            (
                "uid",
                serde_json::json!({"metadata": {"name": "10.96.1.2", "uid": huge}}),
            ),
            (
                "resourceVersion",
                serde_json::json!({"metadata": {"name": "10.96.1.2", "resourceVersion": huge}}),
            ),
            (
                "labels",
                serde_json::json!({"metadata": {"name": "10.96.1.2",
                    "labels": {LABEL_MANAGED_BY: huge}}}),
            ),
            (
                "parent's group",
                serde_json::json!({"metadata": {"name": "10.96.1.2"},
                    "spec": {"parentRef": {"group": huge, "resource": "services"}}}),
            ),
            (
                "parent's namespace",
                serde_json::json!({"metadata": {"name": "10.96.1.2"},
                    "spec": {"parentRef": {"resource": "services", "namespace": huge}}}),
            ),
            (
                "parent's name",
                serde_json::json!({"metadata": {"name": "10.96.1.2"},
                    "spec": {"parentRef": {"resource": "services", "name": huge}}}),
            ),
        ] {
            let weight = ip_address_weight(object);
            assert!(weight >= 1 << 20, "{field}: {weight}");
        }
    }

    const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/k8s-api");

    #[test]
    fn decodes_upstream_fixtures() {
        let ip = ip_address(
            &std::fs::read_to_string(format!("{FIXTURES}/networking.k8s.io.v1.IPAddress.json"))
                .unwrap(),
        );
        assert!(!ip.name.to_string().is_empty());
        assert!(ip.parent.is_some());
        let object = serde_json::from_str::<ServiceCidrObject>(
            &std::fs::read_to_string(format!("{FIXTURES}/networking.k8s.io.v1.ServiceCIDR.json"))
                .unwrap(),
        )
        .unwrap();
        assert!(!object.spec.cidrs.is_empty());
        let cidr = ServiceCidrRecord::from(&object);
        assert!(
            cidr.cidrs.is_empty(),
            "placeholder CIDR strings are not parsed as ranges"
        );
        let svc =
            service(&std::fs::read_to_string(format!("{FIXTURES}/core.v1.Service.json")).unwrap());
        assert!(!svc.name.is_empty());
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
            r#"{"metadata":{"name":"192.0.2.5","labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4"}}}"#,
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
            "192.0.2.1",
            "fd00::1",
            "FD00::1",
            "fd00:0:0:0:0:0:0:1",
            "::ffff:192.0.2.1",
            "192.0.2.01",
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
        assert_eq!(IpName::new("192.0.2.01").ip(), None);
    }

    #[test]
    fn decodes_ipaddress_labels_and_times() {
        let json = r#"{"metadata":{"name":"192.0.2.5","uid":"u","resourceVersion":"7",
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
        let bare = ip_address(r#"{"metadata":{"name":"192.0.2.6"},"spec":{}}"#);
        assert_eq!(bare.parent, None);
        let empty = ip_address(r#"{"metadata":{"name":"foo"},"spec":{"parentRef":{}}}"#);
        let parent = empty.parent.unwrap();
        assert!(!parent.is_service());
        assert_eq!(empty.name.ip(), None);
    }

    /// The fixtures' YAML encodings decode to the same records as their JSON.
    #[test]
    fn yaml_fixtures_decode_as_the_json_does() {
        let read = |name: &str| std::fs::read_to_string(format!("{FIXTURES}/{name}")).unwrap();
        let ip = |text: &IpAddressObject| IpAddressRecord::from(text);
        let json: IpAddressObject =
            serde_json::from_str(&read("networking.k8s.io.v1.IPAddress.json")).unwrap();
        let yaml: IpAddressObject =
            serde_saphyr::from_str(&read("networking.k8s.io.v1.IPAddress.yaml")).unwrap();
        assert_eq!(ip(&json), ip(&yaml));
        assert!(ip(&json).deleting);
        let json: ServiceCidrObject =
            serde_json::from_str(&read("networking.k8s.io.v1.ServiceCIDR.json")).unwrap();
        let yaml: ServiceCidrObject =
            serde_saphyr::from_str(&read("networking.k8s.io.v1.ServiceCIDR.yaml")).unwrap();
        assert_eq!(
            ServiceCidrRecord::from(&json),
            ServiceCidrRecord::from(&yaml)
        );
    }

    /// Nulls, missing and unknown fields in IPAddresses and ServiceCIDRs decode.
    #[test]
    fn nulls_missing_and_unknown_fields_decode() {
        for json in [
            r#"{}"#,
            r#"{"metadata":null,"spec":null}"#,
            r#"{"metadata":{"name":"192.0.2.8","labels":null,"managedFields":[{"time":null}]},
               "spec":{"parentRef":null}}"#,
        ] {
            let record = ip_address(json);
            assert_eq!((record.parent, record.deleting), (None, false), "{json}");
        }
        let record = ip_address(
            r#"{"metadata":{"name":"192.0.2.8","creationTimestamp":null,"futureMeta":{}},
                "spec":{"parentRef":{"group":null,"resource":"services","namespace":"d",
                    "name":"s","futureRef":1},"futureSpec":[]},"status":{"x":null}}"#,
        );
        assert!(record.parent.unwrap().is_service());
        assert_eq!(record.created, None);
        for json in [
            r#"{}"#,
            r#"{"metadata":null,"spec":null,"status":null}"#,
            r#"{"metadata":{"name":"kubernetes"},"spec":{"cidrs":null},
               "status":{"conditions":[{"type":"Ready","lastTransitionTime":null}]}}"#,
        ] {
            let cidr: ServiceCidrObject = serde_json::from_str(json).unwrap();
            assert!(cidr.spec.cidrs.is_empty(), "{json}");
            assert!(ServiceCidrRecord::from(&cidr).cidrs.is_empty(), "{json}");
        }
        let cidr: ServiceCidrObject = serde_json::from_str(
            r#"{"metadata":{"name":"kubernetes","deletionTimestamp":"2026-01-01T00:00:00Z"},
                "spec":{"cidrs":[null,"192.0.2.0/24"],"futureSpec":1}}"#,
        )
        .unwrap();
        let cidr = ServiceCidrRecord::from(&cidr);
        assert_eq!(
            cidr.cidrs,
            ["192.0.2.0/24".parse::<ipnet::IpNet>().unwrap()]
        );
        assert!(cidr.deleting);
    }
}

//! The compact records the repair works on.
//!
//! Lists and watches are decoded straight into these (only the fields the repair reads), never
//! into full `k8s-openapi` objects: at 100,000 Services the difference is hundreds of megabytes
//! (managedFields, annotations, ports, status) and most of the decoding time.

use std::borrow::Cow;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::Deserialize;

use crate::alloc::parse_ip_sloppy;

/// Label naming the controller that manages an IPAddress.
pub const LABEL_MANAGED_BY: &str = "ipaddress.kubernetes.io/managed-by";
/// Label holding an IPAddress's family (`IPv4`/`IPv6`).
pub const LABEL_IP_FAMILY: &str = "ipaddress.kubernetes.io/ip-family";
/// The value of [`LABEL_MANAGED_BY`] on IPAddresses of Service ClusterIPs.
pub const IPALLOCATOR_MANAGER: &str = "ipallocator.k8s.io";

/// The parts of a Service the repair needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRecord {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    /// 0 when not a number (see [`super::reflector::parse_resource_version`]).
    pub resource_version: u64,
    /// The Service's cluster IPs, parsed once at decode time; empty when the Service has no
    /// cluster IP (headless, ExternalName, not yet allocated).
    pub cluster_ips: Box<[ClusterIp]>,
}

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
}

/// `spec.parentRef` of an IPAddress.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParentRef {
    /// Usually empty, which costs no allocation.
    pub group: Box<str>,
    /// Usually `services`, kept without an allocation.
    pub resource: Cow<'static, str>,
    pub namespace: Box<str>,
    pub name: Box<str>,
}

impl ParentRef {
    pub fn is_service(&self) -> bool {
        self.group.is_empty() && &*self.resource == "services"
    }
}

/// The parts of an IPAddress the repair needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpAddressRecord {
    /// The object name, which is the IP in canonical form.
    pub name: Box<str>,
    pub uid: Box<str>,
    pub resource_version: Box<str>,
    /// Shared constants for the usual values, so 130,000 records do not each hold copies.
    pub managed_by: Option<Cow<'static, str>>,
    pub family_label: Option<Cow<'static, str>>,
    pub parent: Option<ParentRef>,
    /// `None` when missing or unparseable; treated as "old" as upstream does.
    pub created: Option<jiff::Timestamp>,
    pub deleting: bool,
}

impl IpAddressRecord {
    pub fn managed_by_ipallocator(&self) -> bool {
        self.managed_by.as_deref() == Some(IPALLOCATOR_MANAGER)
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
}

mod wire {
    //! What the API sends, borrowed from the response body where possible: only the fields kept
    //! are copied out, everything else is skipped without allocating.

    use std::borrow::Cow;

    use serde::Deserialize;

    fn boxed(text: Cow<'_, str>) -> Box<str> {
        Box::from(text.as_ref())
    }

    /// `text` as a static string when it is one of `known`, else copied.
    fn shared(text: Cow<'_, str>, known: &[&'static str]) -> Cow<'static, str> {
        match known.iter().find(|k| **k == text.as_ref()) {
            Some(k) => Cow::Borrowed(k),
            None => Cow::Owned(text.into_owned()),
        }
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
        #[serde(rename = "clusterIPs", borrow)]
        pub cluster_ips: Option<Vec<Cow<'a, str>>>,
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
            let cluster_ips: Box<[super::ClusterIp]> = if !has_ip {
                Box::default()
            } else {
                match &wire.spec.cluster_ips {
                    Some(ips) if !ips.is_empty() => {
                        ips.iter().map(|ip| super::ClusterIp::parse(ip)).collect()
                    }
                    _ => wire
                        .spec
                        .cluster_ip
                        .iter()
                        .map(|ip| super::ClusterIp::parse(ip))
                        .collect(),
                }
            };
            Self {
                namespace: boxed(wire.metadata.namespace),
                name: boxed(wire.metadata.name),
                uid: boxed(wire.metadata.uid),
                resource_version: version(wire.metadata.resource_version),
                cluster_ips,
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
                name: boxed(meta.name),
                uid: boxed(meta.uid),
                resource_version: boxed(meta.resource_version),
                managed_by: meta
                    .labels
                    .managed_by
                    .map(|m| shared(m, &[super::IPALLOCATOR_MANAGER])),
                family_label: meta.labels.family.map(|f| shared(f, &["IPv4", "IPv6"])),
                parent: wire.spec.parent_ref.map(|p| super::ParentRef {
                    group: boxed(p.group),
                    resource: shared(p.resource, &["services"]),
                    namespace: boxed(p.namespace),
                    name: boxed(p.name),
                }),
                created: meta
                    .creation_timestamp
                    .and_then(|text| text.parse::<jiff::Timestamp>().ok()),
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

    const FIXTURES: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/fixtures/k8s-api-testdata"
    );

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
        assert!(!ip.name.is_empty());
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
    fn decodes_ipaddress_labels_and_times() {
        let json = r#"{"metadata":{"name":"10.0.0.5","uid":"u","resourceVersion":"7",
            "creationTimestamp":"2026-01-02T03:04:05Z",
            "labels":{"ipaddress.kubernetes.io/managed-by":"ipallocator.k8s.io","ipaddress.kubernetes.io/ip-family":"IPv4","x":"y"}},
            "spec":{"parentRef":{"resource":"services","namespace":"d","name":"s"}}}"#;
        let ip: IpAddressRecord = serde_json::from_str(json).unwrap();
        assert!(ip.managed_by_ipallocator());
        assert_eq!(ip.family_label.as_deref(), Some("IPv4"));
        let parent = ip.parent.unwrap();
        assert!(parent.is_service());
        assert_eq!(&*parent.name, "s");
        assert_eq!(ip.created.unwrap().to_string(), "2026-01-02T03:04:05Z");
        assert!(!ip.deleting);
    }
}

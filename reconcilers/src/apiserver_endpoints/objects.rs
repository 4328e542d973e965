//! The `kubernetes` Endpoints and EndpointSlices wanted from a member set, and the drift between
//! them and the cluster. Pure. Shapes follow upstream's `EndpointsAdapter`
//! (`pkg/controlplane/reconcilers/endpointsadapter.go`): the Endpoints carries the `skip-mirror`
//! label and one subset; each slice carries `kubernetes.io/service-name`, `conditions.ready: true`
//! and the same port.
//!
//! One family, the Service's: the plan gives these functions members of that family only and
//! the family as `primary_family`, so there is one slice, named like the Service (`kubernetes`),
//! exactly as upstream names its only slice. Given members of both families (tests, a caller
//! that does not filter), the other family's slice would be `<service>-<family>`, e.g.
//! `kubernetes-ipv6`. Any other slice carrying the service-name label is stray and is deleted,
//! as the newest upstream adapter does.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{
    EndpointAddress, EndpointPort, EndpointSubset, Endpoints, Service,
};
use k8s_openapi::api::discovery::v1::{
    Endpoint, EndpointConditions, EndpointPort as SlicePort, EndpointSlice,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::members::{MemberSet, parse_ip};
use crate::alloc::IpFamily;

/// Makes the EndpointSliceMirroring controller ignore the Endpoints (we write the slices).
pub const SKIP_MIRROR_LABEL: &str = "endpointslice.kubernetes.io/skip-mirror";
/// Set by a controller on the slices it keeps; neither kube-apiserver nor this controller sets it.
pub const MANAGED_BY_LABEL: &str = "endpointslice.kubernetes.io/managed-by";
/// Ties an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The port name upstream uses for the apiserver endpoint.
pub const PORT_NAME: &str = "https";

/// Which objects to write and with which port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointsTarget {
    pub namespace: String,
    pub service_name: String,
    /// The apiservers' `--secure-port`.
    pub port: i32,
    /// The family of the primary service CIDR. `None`: IPv4 unless every member is IPv6 (upstream's
    /// `addressType` rule).
    pub primary_family: Option<IpFamily>,
}

impl Default for EndpointsTarget {
    fn default() -> Self {
        Self {
            namespace: "default".to_owned(),
            service_name: "kubernetes".to_owned(),
            port: 6443,
            primary_family: None,
        }
    }
}

impl EndpointsTarget {
    pub fn primary_family(&self, members: &MemberSet) -> IpFamily {
        self.primary_family.unwrap_or_else(|| {
            if members.has_family(IpFamily::V4) || members.is_empty() {
                IpFamily::V4
            } else {
                IpFamily::V6
            }
        })
    }

    /// Name of the slice that holds `family`'s addresses.
    pub fn slice_name(&self, family: IpFamily, primary: IpFamily) -> String {
        if family == primary {
            self.service_name.clone()
        } else {
            format!("{}-{}", self.service_name, family.short())
        }
    }

    pub fn endpoints_ref(&self) -> String {
        format!("Endpoints/{}/{}", self.namespace, self.service_name)
    }

    pub fn slice_ref(&self, name: &str) -> String {
        format!("EndpointSlice/{}/{}", self.namespace, name)
    }

    fn endpoint_ports(&self) -> Vec<EndpointPort> {
        vec![EndpointPort {
            name: Some(PORT_NAME.to_owned()),
            port: self.port,
            protocol: Some("TCP".to_owned()),
            app_protocol: None,
        }]
    }

    fn slice_ports(&self) -> Vec<SlicePort> {
        vec![SlicePort {
            name: Some(PORT_NAME.to_owned()),
            port: Some(self.port),
            protocol: Some("TCP".to_owned()),
            app_protocol: None,
        }]
    }
}

/// The Endpoints for `members`: `existing` rewritten, keeping its metadata (resourceVersion for
/// optimistic concurrency, other people's labels and annotations), or a new one.
pub fn desired_endpoints(
    target: &EndpointsTarget,
    members: &MemberSet,
    existing: Option<&Endpoints>,
) -> Endpoints {
    let mut endpoints = existing.cloned().unwrap_or_else(|| Endpoints {
        metadata: ObjectMeta {
            name: Some(target.service_name.clone()),
            namespace: Some(target.namespace.clone()),
            ..ObjectMeta::default()
        },
        subsets: None,
    });
    endpoints.metadata.managed_fields = None;
    (endpoints.metadata.labels.get_or_insert_with(BTreeMap::new))
        .insert(SKIP_MIRROR_LABEL.to_owned(), "true".to_owned());
    // Upstream's RepackSubsets drops an empty subset, leaving none.
    endpoints.subsets = (!members.is_empty()).then(|| {
        let addresses = (members.sorted_strings().into_iter())
            .map(|ip| EndpointAddress {
                ip,
                ..EndpointAddress::default()
            })
            .collect();
        vec![EndpointSubset {
            addresses: Some(addresses),
            not_ready_addresses: None,
            ports: Some(target.endpoint_ports()),
        }]
    });
    endpoints
}

/// One difference found on an object: `(metric kind, human message)`.
pub type DriftLine = (&'static str, String);

/// What a drift of the ports says: the ports found, each `name/protocol:port` (`-` for none),
/// and the one wanted.
fn ports_drift<'a>(
    target: &EndpointsTarget,
    found: impl Iterator<Item = (&'a Option<String>, &'a Option<String>, Option<i32>)>,
) -> String {
    let found: Vec<String> = found
        .map(|(name, protocol, port)| {
            let port = port.map_or("-".to_owned(), |n| n.to_string());
            let (name, protocol) = (name.as_deref(), protocol.as_deref());
            format!("{}/{}:{port}", name.unwrap_or(""), protocol.unwrap_or(""))
        })
        .collect();
    format!(
        "ports are [{}], want [https/TCP:{}]",
        found.join(", "),
        target.port
    )
}

/// Every difference between `existing` and the desired Endpoints. Address order is not drift
/// (upstream's `ipsCorrect` is order-insensitive), but we always write sorted.
pub fn endpoints_drift(
    target: &EndpointsTarget,
    members: &MemberSet,
    existing: Option<&Endpoints>,
) -> Vec<DriftLine> {
    let Some(existing) = existing else {
        return vec![(
            "endpoints_missing",
            "the Endpoints object does not exist".to_owned(),
        )];
    };
    let mut drift = Vec::new();
    let label =
        (existing.metadata.labels.as_ref()).and_then(|labels| labels.get(SKIP_MIRROR_LABEL));
    if label.map(String::as_str) != Some("true") {
        let found = label.map_or("missing".to_owned(), |v| format!("{v:?}"));
        let message = format!("label {SKIP_MIRROR_LABEL} is {found}, want \"true\"");
        drift.push(("endpoints_label", message));
    }
    let subsets = existing.subsets.as_deref().unwrap_or_default();
    if !members.is_empty() && subsets.len() != 1 {
        let message = format!("{} subsets, want exactly one", subsets.len());
        drift.push(("endpoints_subsets", message));
    }
    let listed = (subsets.iter())
        .flat_map(|subset| subset.addresses.iter().flatten())
        .map(|address| address.ip.as_str());
    let mut seen = BTreeSet::new();
    let mut unexpected = Vec::new();
    for text in listed {
        match parse_ip(text) {
            Some(ip) if members.contains(&ip) && seen.insert(ip) => {}
            _ => unexpected.push(text.to_owned()),
        }
    }
    let missing: Vec<String> = (members.iter())
        .filter(|ip| !seen.contains(*ip))
        .map(ToString::to_string)
        .collect();
    let mut parts = Vec::new();
    if !unexpected.is_empty() {
        parts.push(format!("unexpected addresses [{}]", unexpected.join(", ")));
    }
    if !missing.is_empty() {
        parts.push(format!("missing members [{}]", missing.join(", ")));
    }
    if !parts.is_empty() {
        drift.push(("endpoints_addresses", parts.join("; ")));
    }
    let not_ready: usize = (subsets.iter())
        .map(|subset| subset.not_ready_addresses.as_ref().map_or(0, Vec::len))
        .sum();
    if not_ready > 0 {
        let message = format!("{not_ready} notReadyAddresses, want none");
        drift.push(("endpoints_not_ready_addresses", message));
    }
    // Ports only matter while there is a subset to carry them; upstream never repairs them on the
    // periodic path (kubernetes/kubernetes#104252), we do.
    if !members.is_empty() && subsets.len() == 1 {
        let found = subsets[0].ports.clone().unwrap_or_default();
        if found != target.endpoint_ports() {
            let found = found.iter().map(|p| (&p.name, &p.protocol, Some(p.port)));
            drift.push(("endpoints_ports", ports_drift(target, found)));
        }
    }
    drift
}

/// The addresses an Endpoints object lists (ready ones, all subsets), as members.
pub fn listed_members(existing: &Endpoints) -> MemberSet {
    existing
        .subsets
        .iter()
        .flatten()
        .flat_map(|subset| subset.addresses.iter().flatten())
        .filter_map(|address| parse_ip(&address.ip))
        .collect()
}

/// The `kubernetes` Service's IP family, and where it was learnt: its first `ipFamilies`, else
/// its clusterIP's; `None` when it says neither.
pub fn service_family(service: &Service) -> Option<(IpFamily, String)> {
    let spec = service.spec.as_ref()?;
    let by_families = (spec.ip_families.as_ref())
        .and_then(|families| families.first())
        .and_then(|family| match family.as_str() {
            "IPv4" => Some(IpFamily::V4),
            "IPv6" => Some(IpFamily::V6),
            _ => None,
        });
    let ip = spec.cluster_ip.as_deref().unwrap_or_default();
    let by_ip = parse_ip(ip).map(IpFamily::of);
    let family = by_families.or(by_ip)?;
    Some((family, format!("its clusterIP {ip}")))
}

/// The field manager kube-apiserver records for this controller's writes: the product of its
/// User-Agent (`bootstrap-controller/<version> (...)`), as kube-apiserver names an update
/// without `fieldManager`.
pub const FIELD_MANAGER: &str = "bootstrap-controller";

/// Who last wrote `meta`'s object, if that was not this controller: the manager of its newest
/// `managedFields` entry (kube-apiserver's own reconciler is `kube-apiserver`, kubectl
/// `kubectl-edit`, `kubectl-patch`, ...). Entries without a time count as oldest.
pub fn other_writer(meta: &ObjectMeta) -> Option<String> {
    let newest = meta
        .managed_fields
        .iter()
        .flatten()
        .max_by_key(|entry| entry.time.as_ref().map(|t| t.0))?;
    let manager = newest.manager.as_deref().filter(|m| !m.is_empty())?;
    (manager != FIELD_MANAGER && !manager.starts_with(&format!("{FIELD_MANAGER}-")))
        .then(|| manager.chars().take(128).collect())
}

/// The other writers ([`other_writer`]) of the Endpoints and the slices, by object reference.
pub fn other_writers(
    target: &EndpointsTarget,
    endpoints: Option<&Endpoints>,
    slices: &[EndpointSlice],
) -> BTreeMap<String, String> {
    let mut writers = BTreeMap::new();
    if let Some(manager) = endpoints.and_then(|e| other_writer(&e.metadata)) {
        writers.insert(target.endpoints_ref(), manager);
    }
    for slice in slices {
        if let (Some(name), Some(manager)) = (
            slice.metadata.name.as_deref(),
            other_writer(&slice.metadata),
        ) {
            writers.insert(target.slice_ref(name), manager);
        }
    }
    writers
}

/// The addresses the slices list as ready (all slices given, every family).
pub fn slice_members(slices: &[EndpointSlice]) -> MemberSet {
    slices
        .iter()
        .flat_map(|slice| slice.endpoints.iter())
        .filter(|endpoint| endpoint.conditions.as_ref().and_then(|c| c.ready) != Some(false))
        .flat_map(|endpoint| endpoint.addresses.iter())
        .filter_map(|address| parse_ip(address))
        .collect()
}

/// The desired slices, primary family first.
pub fn desired_slices(target: &EndpointsTarget, members: &MemberSet) -> Vec<EndpointSlice> {
    let primary = target.primary_family(members);
    let mut slices = vec![slice_for(target, members, primary, primary)];
    if members.has_family(primary.other()) {
        slices.push(slice_for(target, members, primary.other(), primary));
    }
    slices
}

fn slice_for(
    target: &EndpointsTarget,
    members: &MemberSet,
    family: IpFamily,
    primary: IpFamily,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(target.slice_name(family, primary)),
            namespace: Some(target.namespace.clone()),
            labels: Some(BTreeMap::from([(
                SERVICE_NAME_LABEL.to_owned(),
                target.service_name.clone(),
            )])),
            ..ObjectMeta::default()
        },
        address_type: family.as_str().to_owned(),
        endpoints: members
            .sorted_strings_of(family)
            .into_iter()
            .map(|ip| Endpoint {
                addresses: vec![ip],
                conditions: Some(EndpointConditions {
                    ready: Some(true),
                    ..EndpointConditions::default()
                }),
                ..Endpoint::default()
            })
            .collect(),
        ports: Some(target.slice_ports()),
    }
}

/// What to do to the Endpoints or to one slice. A replacement keeps the existing metadata
/// (resourceVersion, foreign labels).
#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    CreateEndpoints(Endpoints),
    ReplaceEndpoints(Endpoints),
    CreateSlice(EndpointSlice),
    UpdateSlice(EndpointSlice),
    /// `addressType` is immutable: delete, then create.
    RecreateSlice(EndpointSlice),
    DeleteSlice,
}

/// One write and the drift that justifies it.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    pub name: String,
    pub op: Op,
    /// The uid of the slice found: a deletion is conditional on it.
    pub uid: Option<String>,
    /// Every difference found on this object.
    pub drift: Vec<DriftLine>,
}

/// Compare the desired slices with `existing` (every slice carrying the service-name label, plus
/// any slice with a desired name) and plan the writes. Deletions come last so consumers never see
/// a moment with fewer slices than needed.
pub fn plan_slices(
    target: &EndpointsTarget,
    members: &MemberSet,
    existing: &[EndpointSlice],
) -> Vec<Write> {
    let desired = desired_slices(target, members);
    let named = |name: &str| (existing.iter()).find(|s| s.metadata.name.as_deref() == Some(name));
    let mut changes: Vec<Write> = (desired.iter())
        .filter_map(|want| {
            let name = want.metadata.name.clone().unwrap_or_default();
            match named(&name) {
                Some(have) => slice_repair(target, name, want, have),
                None => Some(Write {
                    drift: vec![(
                        "endpointslice_missing",
                        format!("EndpointSlice {name} does not exist"),
                    )],
                    name,
                    op: Op::CreateSlice(want.clone()),
                    uid: None,
                }),
            }
        })
        .collect();
    let wanted: BTreeSet<&str> = desired
        .iter()
        .filter_map(|s| s.metadata.name.as_deref())
        .collect();
    for have in existing {
        let Some(name) = have.metadata.name.clone() else {
            continue;
        };
        if service_label(have) == Some(&target.service_name)
            && !wanted.contains(name.as_str())
            && have.metadata.deletion_timestamp.is_none()
            && managed_by(have).is_none()
        {
            changes.push(Write {
                drift: vec![(
                    "endpointslice_stray",
                    format!(
                        "stray {} EndpointSlice {name} for Service {} (not written from the member set)",
                        have.address_type, target.service_name
                    ),
                )],
                op: Op::DeleteSlice,
                name,
                uid: have.metadata.uid.clone(),
            });
        }
    }
    changes
}

fn service_label(slice: &EndpointSlice) -> Option<&String> {
    (slice.metadata.labels.as_ref()).and_then(|labels| labels.get(SERVICE_NAME_LABEL))
}

fn managed_by(slice: &EndpointSlice) -> Option<&String> {
    (slice.metadata.labels.as_ref()).and_then(|labels| labels.get(MANAGED_BY_LABEL))
}

/// The slices of the Service another controller keeps (`managed-by` set), by name, with that
/// controller: left alone, as deleting them would only make it write them again.
pub fn foreign_slices<'a>(
    target: &EndpointsTarget,
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
) -> Vec<(String, String)> {
    (slices.into_iter())
        .filter(|slice| service_label(slice) == Some(&target.service_name))
        .filter_map(|slice| Some((slice.metadata.name.clone()?, managed_by(slice)?.clone())))
        .collect()
}

/// The write that brings existing slice `have` to `want`, if they differ: recreated when its
/// `addressType` (immutable) is another, else updated keeping its metadata.
fn slice_repair(
    target: &EndpointsTarget,
    name: String,
    want: &EndpointSlice,
    have: &EndpointSlice,
) -> Option<Write> {
    if have.address_type != want.address_type {
        let message = format!(
            "addressType is {}, want {} (immutable: recreating)",
            have.address_type, want.address_type
        );
        return Some(Write {
            name,
            op: Op::RecreateSlice(want.clone()),
            drift: vec![("endpointslice_address_type", message)],
            uid: have.metadata.uid.clone(),
        });
    }
    let mut drift = Vec::new();
    if have.endpoints != want.endpoints {
        let (have, want) = (&have.endpoints, &want.endpoints);
        let message = format!(
            "endpoints are [{}], want [{}] all ready",
            describe_endpoints(have),
            describe_endpoints(want)
        );
        drift.push(("endpointslice_endpoints", message));
    }
    if have.ports != want.ports {
        let found = (have.ports.iter().flatten()).map(|p| (&p.name, &p.protocol, p.port));
        drift.push(("endpointslice_ports", ports_drift(target, found)));
    }
    let label = service_label(have);
    if label != Some(&target.service_name) {
        let found = label.map_or("missing".to_owned(), |v| format!("{v:?}"));
        let message = format!(
            "label {SERVICE_NAME_LABEL} is {found}, want {:?}",
            target.service_name
        );
        drift.push(("endpointslice_labels", message));
    }
    if drift.is_empty() {
        return None;
    }
    let mut repaired = have.clone();
    repaired.metadata.managed_fields = None;
    (repaired.metadata.labels.get_or_insert_with(BTreeMap::new))
        .insert(SERVICE_NAME_LABEL.to_owned(), target.service_name.clone());
    repaired.endpoints = want.endpoints.clone();
    repaired.ports = want.ports.clone();
    Some(Write {
        name,
        op: Op::UpdateSlice(repaired),
        drift,
        uid: have.metadata.uid.clone(),
    })
}

fn describe_endpoints(endpoints: &[Endpoint]) -> String {
    endpoints
        .iter()
        .map(|endpoint| {
            let ready = endpoint
                .conditions
                .as_ref()
                .and_then(|c| c.ready)
                .map_or("?", |r| if r { "ready" } else { "not-ready" });
            format!("{} {ready}", endpoint.addresses.join("+"))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    fn members(ips: &[&str]) -> MemberSet {
        ips.iter().map(|s| s.parse::<IpAddr>().unwrap()).collect()
    }

    fn target() -> EndpointsTarget {
        EndpointsTarget::default()
    }

    #[test]
    fn desired_endpoints_match_upstream_shape() {
        let endpoints = desired_endpoints(&target(), &members(&["192.0.2.9", "192.0.2.10"]), None);
        let json = serde_json::to_value(&endpoints).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "apiVersion": "v1",
                "kind": "Endpoints",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"endpointslice.kubernetes.io/skip-mirror": "true"}
                },
                "subsets": [{
                    "addresses": [{"ip": "192.0.2.10"}, {"ip": "192.0.2.9"}],
                    "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
                }]
            })
        );
    }

    #[test]
    fn empty_member_set_has_no_subsets() {
        let endpoints = desired_endpoints(&target(), &MemberSet::new(), None);
        assert_eq!(endpoints.subsets, None);
        let slices = desired_slices(&target(), &MemberSet::new());
        assert_eq!(slices.len(), 1);
        assert!(slices[0].endpoints.is_empty());
        assert_eq!(slices[0].address_type, "IPv4");
    }

    #[test]
    fn desired_endpoints_have_no_drift() {
        let m = members(&["192.0.2.1", "192.0.2.2"]);
        let endpoints = desired_endpoints(&target(), &m, None);
        assert!(endpoints_drift(&target(), &m, Some(&endpoints)).is_empty());
    }

    #[test]
    fn missing_endpoints_is_drift() {
        assert_eq!(
            endpoints_drift(&target(), &members(&["192.0.2.1"]), None),
            vec![(
                "endpoints_missing",
                "the Endpoints object does not exist".to_owned()
            )]
        );
    }

    #[test]
    fn address_order_is_not_drift() {
        let m = members(&["192.0.2.1", "192.0.2.2"]);
        let mut endpoints = desired_endpoints(&target(), &m, None);
        endpoints.subsets.as_mut().unwrap()[0]
            .addresses
            .as_mut()
            .unwrap()
            .reverse();
        assert!(endpoints_drift(&target(), &m, Some(&endpoints)).is_empty());
    }

    /// An Endpoints for 1.2.3.4 listing `ports` as (name, port), as upstream's lease_test.go
    /// builds them.
    fn listing_ports(ports: &[(&str, i32)]) -> Endpoints {
        let mut endpoints = desired_endpoints(&target(), &members(&["1.2.3.4"]), None);
        endpoints.subsets.as_mut().unwrap()[0].ports = Some(
            ports
                .iter()
                .map(|(name, port)| EndpointPort {
                    name: Some((*name).to_owned()),
                    port: *port,
                    protocol: Some("TCP".to_owned()),
                    app_protocol: None,
                })
                .collect(),
        );
        endpoints
    }

    /// upstream lease_test.go's "existing endpoints extra service ports satisfy", "...missing
    /// port" and "...missing port no update". Upstream's apiserver may serve several ports; ours
    /// serves the one `https` port, so "extra" is a port besides it. The listed ports must equal
    /// the wanted ones, as upstream's `checkEndpointSubsetFormatWithLease` requires when it
    /// reconciles ports. Upstream's periodic pass does not reconcile ports ("...no update"): it
    /// leaves a wrong port until the apiserver restarts (kubernetes/kubernetes#104252). Ours
    /// repairs them on every pass, so that case is drift repaired here.
    #[test]
    fn endpoint_ports_must_equal_the_wanted_ones_as_upstreams_lease_reconciler_checks() {
        let m = members(&["1.2.3.4"]);
        let wanted = || listing_ports(&[("https", 6443)]);
        // "satisfy": exactly the wanted ports, nothing to write.
        assert_eq!(endpoints_drift(&target(), &m, Some(&wanted())), vec![]);
        for (case, listed) in [
            ("missing port", listing_ports(&[("foo", 8080)])),
            ("missing port no update", listing_ports(&[])),
            (
                "extra port",
                listing_ports(&[("https", 6443), ("bar", 1000)]),
            ),
        ] {
            let drift = endpoints_drift(&target(), &m, Some(&listed));
            assert_eq!(
                drift.iter().map(|d| d.0).collect::<Vec<_>>(),
                ["endpoints_ports"],
                "{case}"
            );
            let repaired = desired_endpoints(&target(), &m, Some(&listed));
            assert_eq!(repaired.subsets, wanted().subsets, "{case}");
        }
    }

    #[test]
    fn port_drift_is_detected_and_repaired() {
        let m = members(&["192.0.2.1"]);
        let mut endpoints = desired_endpoints(&target(), &m, None);
        endpoints.metadata.resource_version = Some("42".into());
        endpoints.subsets.as_mut().unwrap()[0]
            .ports
            .as_mut()
            .unwrap()[0]
            .port = 443;
        let drift = endpoints_drift(&target(), &m, Some(&endpoints));
        assert_eq!(drift.len(), 1);
        assert_eq!(drift[0].0, "endpoints_ports");
        assert!(drift[0].1.contains("https/TCP:443"), "{drift:?}");
        let repaired = desired_endpoints(&target(), &m, Some(&endpoints));
        assert_eq!(repaired.metadata.resource_version.as_deref(), Some("42"));
        assert!(endpoints_drift(&target(), &m, Some(&repaired)).is_empty());
    }

    #[test]
    fn wrong_missing_duplicate_and_garbage_addresses_are_drift() {
        let m = members(&["192.0.2.1", "192.0.2.2"]);
        let mut endpoints = desired_endpoints(&target(), &m, None);
        endpoints.subsets.as_mut().unwrap()[0].addresses = Some(
            ["192.0.2.1", "192.0.2.1", "198.51.100.9", "bogus"]
                .iter()
                .map(|ip| EndpointAddress {
                    ip: (*ip).to_owned(),
                    ..EndpointAddress::default()
                })
                .collect(),
        );
        let drift = endpoints_drift(&target(), &m, Some(&endpoints));
        assert_eq!(
            drift,
            vec![(
                "endpoints_addresses",
                "unexpected addresses [192.0.2.1, 198.51.100.9, bogus]; missing members \
                 [192.0.2.2]"
                    .to_owned()
            )]
        );
    }

    #[test]
    fn label_subsets_and_not_ready_drift() {
        let m = members(&["192.0.2.1"]);
        let mut endpoints = desired_endpoints(&target(), &m, None);
        endpoints.metadata.labels = Some(BTreeMap::from([
            (SKIP_MIRROR_LABEL.to_owned(), "false".to_owned()),
            ("team".to_owned(), "x".to_owned()),
        ]));
        let mut second = endpoints.subsets.as_ref().unwrap()[0].clone();
        second.addresses = None;
        second.not_ready_addresses = Some(vec![EndpointAddress {
            ip: "192.0.2.7".into(),
            ..EndpointAddress::default()
        }]);
        endpoints.subsets.as_mut().unwrap().push(second);
        let kinds: Vec<_> = endpoints_drift(&target(), &m, Some(&endpoints))
            .iter()
            .map(|d| d.0)
            .collect();
        assert_eq!(
            kinds,
            vec![
                "endpoints_label",
                "endpoints_subsets",
                "endpoints_not_ready_addresses"
            ]
        );
        let repaired = desired_endpoints(&target(), &m, Some(&endpoints));
        assert!(endpoints_drift(&target(), &m, Some(&repaired)).is_empty());
        assert_eq!(
            repaired
                .metadata
                .labels
                .unwrap()
                .get("team")
                .map(String::as_str),
            Some("x"),
            "foreign labels are kept"
        );
    }

    #[test]
    fn empty_members_only_flag_listed_addresses() {
        let m = members(&["192.0.2.1"]);
        let endpoints = desired_endpoints(&target(), &m, None);
        let drift = endpoints_drift(&target(), &MemberSet::new(), Some(&endpoints));
        assert_eq!(
            drift,
            vec![(
                "endpoints_addresses",
                "unexpected addresses [192.0.2.1]".to_owned()
            )]
        );
        let emptied = desired_endpoints(&target(), &MemberSet::new(), Some(&endpoints));
        assert!(endpoints_drift(&target(), &MemberSet::new(), Some(&emptied)).is_empty());
    }

    #[test]
    fn listed_members_reads_ready_addresses() {
        let m = members(&["192.0.2.1", "fd00::1"]);
        assert_eq!(listed_members(&desired_endpoints(&target(), &m, None)), m);
    }

    #[test]
    fn single_stack_slice_matches_upstream_shape() {
        let slices = desired_slices(&target(), &members(&["192.0.2.2", "192.0.2.1"]));
        assert_eq!(slices.len(), 1);
        let json = serde_json::to_value(&slices[0]).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kubernetes",
                    "namespace": "default",
                    "labels": {"kubernetes.io/service-name": "kubernetes"}
                },
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": ["192.0.2.1"], "conditions": {"ready": true}},
                    {"addresses": ["192.0.2.2"], "conditions": {"ready": true}}
                ],
                "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
            })
        );
    }

    #[test]
    fn dual_stack_gets_a_second_slice_named_by_family() {
        let m = members(&["192.0.2.1", "fd00::1"]);
        let slices = desired_slices(&target(), &m);
        let names: Vec<_> = slices
            .iter()
            .map(|s| (s.metadata.name.clone().unwrap(), s.address_type.clone()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("kubernetes".to_owned(), "IPv4".to_owned()),
                ("kubernetes-ipv6".to_owned(), "IPv6".to_owned())
            ]
        );
        let v6_primary = EndpointsTarget {
            primary_family: Some(IpFamily::V6),
            ..target()
        };
        let slices = desired_slices(&v6_primary, &m);
        assert_eq!(slices[0].address_type, "IPv6");
        assert_eq!(slices[1].metadata.name.as_deref(), Some("kubernetes-ipv4"));
    }

    #[test]
    fn ipv6_only_members_default_to_ipv6_primary() {
        let slices = desired_slices(&target(), &members(&["fd00::1"]));
        assert_eq!(slices.len(), 1);
        assert_eq!(slices[0].metadata.name.as_deref(), Some("kubernetes"));
        assert_eq!(slices[0].address_type, "IPv6");
    }

    #[test]
    fn plan_creates_missing_and_is_quiet_when_equal() {
        let m = members(&["192.0.2.1", "fd00::1"]);
        let plan = plan_slices(&target(), &m, &[]);
        assert_eq!(plan.len(), 2);
        assert!(plan.iter().all(|c| matches!(c.op, Op::CreateSlice(_))));
        let existing = desired_slices(&target(), &m);
        assert!(plan_slices(&target(), &m, &existing).is_empty());
    }

    #[test]
    fn plan_repairs_ports_endpoints_and_labels_keeping_metadata() {
        let m = members(&["192.0.2.1"]);
        let mut have = desired_slices(&target(), &m).remove(0);
        have.metadata.resource_version = Some("7".into());
        have.ports.as_mut().unwrap()[0].port = Some(1);
        have.endpoints[0].conditions = Some(EndpointConditions {
            ready: Some(false),
            ..EndpointConditions::default()
        });
        have.metadata.labels = Some(BTreeMap::from([("other".into(), "x".into())]));
        let plan = plan_slices(&target(), &m, std::slice::from_ref(&have));
        assert_eq!(plan.len(), 1);
        let kinds: Vec<_> = plan[0].drift.iter().map(|(k, _)| *k).collect();
        assert_eq!(
            kinds,
            vec![
                "endpointslice_endpoints",
                "endpointslice_ports",
                "endpointslice_labels"
            ]
        );
        let Op::UpdateSlice(repaired) = &plan[0].op else {
            panic!("expected an update, got {:?}", plan[0].op);
        };
        assert_eq!(repaired.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            repaired
                .metadata
                .labels
                .as_ref()
                .unwrap()
                .get("other")
                .map(String::as_str),
            Some("x")
        );
        assert!(plan_slices(&target(), &m, std::slice::from_ref(repaired)).is_empty());
    }

    /// A slice of the Service another controller keeps (the mirroring controller's, say) is
    /// not deleted: that controller would write it again, pass after pass.
    #[test]
    fn a_slice_another_controller_keeps_is_left_alone_and_named() {
        let m = members(&["192.0.2.1"]);
        let mut mirrored = desired_slices(&target(), &m).remove(0);
        mirrored.metadata.name = Some("kubernetes-x7k2p".into());
        mirrored.metadata.labels.as_mut().unwrap().insert(
            MANAGED_BY_LABEL.to_owned(),
            "endpointslicemirroring-controller.k8s.io".to_owned(),
        );
        let existing = vec![desired_slices(&target(), &m).remove(0), mirrored.clone()];
        assert!(plan_slices(&target(), &m, &existing).is_empty());
        assert_eq!(
            foreign_slices(&target(), &existing),
            [(
                "kubernetes-x7k2p".to_owned(),
                "endpointslicemirroring-controller.k8s.io".to_owned()
            )]
        );
    }

    #[test]
    fn plan_recreates_on_address_type_change_and_deletes_strays() {
        let m = members(&["192.0.2.1"]);
        let dual = desired_slices(&target(), &members(&["fd00::1", "192.0.2.1"]));
        let mut wrong_family = desired_slices(&target(), &m).remove(0);
        wrong_family.address_type = "IPv6".into();
        let mut unrelated = dual[1].clone();
        unrelated.metadata.name = Some("someone-else".into());
        unrelated.metadata.labels = Some(BTreeMap::from([(
            SERVICE_NAME_LABEL.to_owned(),
            "other-service".to_owned(),
        )]));
        let existing = vec![wrong_family, dual[1].clone(), unrelated];
        let plan = plan_slices(&target(), &m, &existing);
        assert_eq!(plan.len(), 2, "{plan:?}");
        assert!(matches!(plan[0].op, Op::RecreateSlice(ref s) if s.address_type == "IPv4"));
        assert_eq!(plan[1].op, Op::DeleteSlice);
        assert_eq!(plan[1].name, "kubernetes-ipv6");
        assert_eq!(plan[1].drift[0].0, "endpointslice_stray");
    }

    #[test]
    fn the_other_writer_is_the_newest_manager_if_not_this_controller() {
        let meta = |entries: &[(&str, i64)]| ObjectMeta {
            managed_fields: Some(
                entries
                    .iter()
                    .map(|(manager, at)| {
                        k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
                            manager: Some((*manager).to_owned()),
                            operation: Some("Update".to_owned()),
                            time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                                k8s_openapi::jiff::Timestamp::from_second(1_800_000_000 + at)
                                    .unwrap(),
                            )),
                            ..Default::default()
                        }
                    })
                    .collect(),
            ),
            ..ObjectMeta::default()
        };
        assert_eq!(
            other_writer(&meta(&[(FIELD_MANAGER, 1), ("kube-apiserver", 2)])).as_deref(),
            Some("kube-apiserver")
        );
        assert_eq!(
            other_writer(&meta(&[("kube-apiserver", 1), (FIELD_MANAGER, 2)])),
            None
        );
        assert_eq!(other_writer(&meta(&[])), None);
        assert_eq!(other_writer(&ObjectMeta::default()), None);
    }
}

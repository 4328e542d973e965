//! The hostile objects of `hostile_objects.rs`: objects no healthy apiserver would hand out (as
//! an etcd restore or a buggy client could leave them), shared with `real_admission.rs`, which
//! pins which of them a real kube-apiserver refuses through its API.

use anyhow::Result;
use serde_json::{Value, json};

use crate::common::service_ip;

/// The addresses of the target's service range the hostile objects hold, by offset (see
/// [`service_ip`]): the Service with junk among its cluster IPs, the one with a newer
/// apiserver's fields, and the IPAddress without a parent.
const JUNK_IPS: u32 = 50;
const FUTURE: u32 = 60;
pub const UNPARENTED: u32 = 77;

pub fn managed(name: &str, parent: Value) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
        "metadata": {"name": name, "labels": {
            "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
            "ipaddress.kubernetes.io/ip-family": "IPv4"}},
        "spec": parent,
    })
}

pub fn member_lease(name: &str, address: &str, spec: Value) -> Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": name, "namespace": "kube-system",
                        "labels": {"bootstrap-controller.io/apiserver-endpoint": "kubernetes"},
                        "annotations": {"bootstrap-controller.io/advertise-address": address}},
           "spec": spec})
}

pub fn service(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
           "spec": spec})
}

/// The address the controller advertises in these tests.
pub const ADVERTISED: &str = "192.0.2.1";

/// The hostile objects, their cluster IPs and IPAddresses in `range` (the target's service
/// range), each with what a loop must not do about it.
pub fn hostile(range: &str) -> Result<Vec<Value>> {
    let junk_ip = service_ip(range, JUNK_IPS)?;
    let future_ip = service_ip(range, FUTURE)?;
    let mut ten_thousand = Vec::new();
    for i in 0..10_000u32 {
        ten_thousand.push(
            json!({"ip": format!("10.{}.{}.{}", 100 + i / 65_536, (i / 256) % 256, i % 256)}),
        );
    }
    Ok(vec![
        // ClusterIP repair: unparseable cluster IPs are reported, never allocated or freed.
        service(
            "bad-ip",
            json!({"clusterIP": "not-an-ip", "clusterIPs": ["not-an-ip"],
                                 "ports": [{"port": 80}]}),
        ),
        service(
            "junk-ips",
            json!({"clusterIP": junk_ip,
                                   "clusterIPs": [junk_ip, "zzz", "::1::"],
                                   "ports": [{"port": 80}]}),
        ),
        // Fields from a newer apiserver, at every level.
        service(
            "future",
            json!({"clusterIP": future_ip, "clusterIPs": [future_ip],
                                 "ports": [{"port": 80, "futurePortField": true}],
                                 "futureSpecField": {"nested": [1, 2, 3]}}),
        ),
        // IPAddresses: a name that is no IP, and one without a parent.
        managed(
            "foo",
            json!({"parentRef": {"group": "", "resource": "services",
                                            "namespace": "default", "name": "bad-ip"}}),
        ),
        managed(&service_ip(range, UNPARENTED)?, json!({})),
        // A ServiceCIDR whose CIDR cannot parse (a prefix no IPv4 address has).
        json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
               "metadata": {"name": "broken"}, "spec": {"cidrs": ["10.0.0.0/33"]}}),
        // Membership Leases with nonsense: a holder address that is no IP; a renewal at the last
        // second the API can write (past what k8s-openapi's clock can read) with a negative
        // duration (it would never expire).
        member_lease(
            "garbage-address",
            "\u{1f4a5} not an address",
            json!({
            "holderIdentity": "\u{0}\u{7f}", "leaseDurationSeconds": 15,
            "renewTime": "2026-01-01T00:00:00.000000Z"}),
        ),
        member_lease(
            "everlasting",
            "192.0.2.9",
            json!({
            "holderIdentity": "x", "leaseDurationSeconds": -5,
            "renewTime": "9999-12-31T23:59:59.999999Z"}),
        ),
        // The kubernetes Endpoints with 10,000 addresses nobody serves.
        json!({"apiVersion": "v1", "kind": "Endpoints",
               "metadata": {"name": "kubernetes", "namespace": "default"},
               "subsets": [{"addresses": ten_thousand,
                            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}]}),
        // A system namespace stuck Terminating: left to its finalizer, not fought over.
        json!({"apiVersion": "v1", "kind": "Namespace",
               "metadata": {"name": "kube-node-lease",
                            "deletionTimestamp": "2026-01-01T00:00:00Z",
                            "finalizers": ["example.com/stuck"]},
               "spec": {"finalizers": ["kubernetes"]},
               "status": {"phase": "Terminating"}}),
    ])
}

/// A hostile object kube-apiserver refuses: `Kind name` (as [`name_of`] names it), the status
/// code and a part of the message.
pub type Refusal = (String, u16, String);

/// The hostile objects of [`hostile`] with `range` that kube-apiserver (1.37) refuses when
/// created through its API; `real_admission.rs` pins this list.
pub fn refused_by_a_real_apiserver(range: &str) -> Result<Vec<Refusal>> {
    let junk_ip = service_ip(range, JUNK_IPS)?;
    Ok(vec![
        (
            format!("IPAddress {}", service_ip(range, UNPARENTED)?),
            422,
            "spec.parentRef: Required value".to_owned(),
        ),
        (
            "IPAddress foo".to_owned(),
            422,
            r#"metadata.name: Invalid value: "foo": must be a valid IP address"#.to_owned(),
        ),
        (
            "Lease everlasting".to_owned(),
            422,
            "spec.leaseDurationSeconds: Invalid value: -5: must be greater than 0".to_owned(),
        ),
        (
            "Service bad-ip".to_owned(),
            422,
            r#"spec.clusterIPs[0]: Invalid value: "not-an-ip": must be a valid IP address"#
                .to_owned(),
        ),
        (
            "Service junk-ips".to_owned(),
            422,
            format!(
                r#"spec.clusterIPs: Invalid value: ["{junk_ip}","zzz","::1::"]: may only hold up to 2 values"#
            ),
        ),
        (
            "ServiceCIDR broken".to_owned(),
            422,
            r#"spec.cidrs[0]: Invalid value: "10.0.0.0/33": must be a valid CIDR value"#.to_owned(),
        ),
    ])
}

/// `Kind name` of a hostile object, as [`refused_by_a_real_apiserver`] names it.
pub fn name_of(object: &Value) -> String {
    format!(
        "{} {}",
        object["kind"].as_str().unwrap_or("?"),
        object["metadata"]["name"].as_str().unwrap_or("?")
    )
}

/// Whether a real kube-apiserver takes `object` through its API, `refused` being
/// [`refused_by_a_real_apiserver`] (the Terminating namespace it takes, but as an Active one: a
/// client cannot set deletionTimestamp).
pub fn accepted_by_a_real_apiserver(refused: &[Refusal], object: &Value) -> bool {
    let name = name_of(object);
    !refused.iter().any(|(refused, _, _)| *refused == name)
}

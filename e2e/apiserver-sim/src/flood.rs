//! The flooding faults, `EndlessPages` and `EndlessNewObjects`: a hostile server answers with
//! responses that are each well formed and small, but whose objects never end. Every object is
//! valid for its resource (a client decodes and keeps it) and has a name never sent before, so a
//! client's cache grows with each one rather than replacing what it holds.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use ipnet::IpNet;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::resources::{RESOURCES, ResIdx};

/// Objects on one page of an endless list: a few, as a small page of a real list would hold,
/// fewer when the client asks for fewer.
const PAGE_ITEMS: usize = 20;

/// Numbers the generated objects process-wide, so that no two (in one list, one watch, or a
/// list after a watch) share a name.
static SERIAL: AtomicU64 = AtomicU64::new(0);

/// The range generated Services take their clusterIPs from when the simulator has none
/// (kubeadm's default, the simulator's own default).
const DEFAULT_RANGE: &str = "10.96.0.0/12";

/// What the generated objects of one response share.
pub(crate) struct Flood {
    res: ResIdx,
    namespace: String,
    range: IpNet,
    rv: u64,
}

impl Flood {
    /// Objects of `res` in `ns` (in `default` for a request across namespaces), Services with
    /// clusterIPs of the first of `ranges`, at resourceVersions from `rv` on.
    pub(crate) fn new(res: ResIdx, ns: Option<&str>, ranges: &[IpNet], rv: u64) -> Self {
        let fallback = DEFAULT_RANGE
            .parse()
            .unwrap_or(IpNet::V4(ipnet::Ipv4Net::default()));
        Flood {
            res,
            namespace: ns.unwrap_or("default").to_owned(),
            range: ranges.first().copied().unwrap_or(fallback),
            rv,
        }
    }

    /// One page of an endless list: `limit` objects at most (fewer than [`PAGE_ITEMS`] when
    /// asked), and a `continue` token that is never empty.
    pub(crate) fn page(&self, query: &HashMap<String, String>) -> Bytes {
        let items = query
            .get("limit")
            .and_then(|limit| limit.parse::<usize>().ok())
            .filter(|limit| *limit > 0)
            .map_or(PAGE_ITEMS, |limit| limit.min(PAGE_ITEMS));
        let objects: Vec<Value> = (0..items).map(|_| self.next_object(self.rv)).collect();
        let def = &RESOURCES[self.res];
        let list = json!({
            "kind": format!("{}List", def.kind),
            "apiVersion": def.api_version(),
            "metadata": {
                "resourceVersion": self.rv.to_string(),
                "continue": format!("endless-{}", SERIAL.load(Ordering::Relaxed)),
            },
            "items": objects,
        });
        Bytes::from(serde_json::to_vec(&list).unwrap_or_default())
    }

    /// Sends ADDED events of new objects until the client goes away or `cancel` fires; each
    /// event waits for the client to read the ones before (the channel is bounded).
    pub(crate) async fn stream(self, tx: mpsc::Sender<Bytes>, cancel: CancellationToken) {
        let mut rv = self.rv;
        loop {
            rv += 1;
            let object = self.next_object(rv);
            let mut line =
                serde_json::to_vec(&json!({"type": "ADDED", "object": object})).unwrap_or_default();
            line.push(b'\n');
            tokio::select! {
                _ = cancel.cancelled() => return,
                sent = tx.send(Bytes::from(line)) => if sent.is_err() { return },
            }
        }
    }

    /// A new valid object of the resource at resourceVersion `rv`.
    fn next_object(&self, rv: u64) -> Value {
        let serial = SERIAL.fetch_add(1, Ordering::Relaxed);
        let def = &RESOURCES[self.res];
        let name = format!("flood-{serial}");
        let mut metadata = json!({
            "name": name,
            "uid": crate::meta::new_uid(),
            "resourceVersion": rv.to_string(),
            "creationTimestamp": crate::meta::now_rfc3339(),
        });
        if def.namespaced {
            metadata["namespace"] = json!(self.namespace);
        }
        let mut object = json!({
            "apiVersion": def.api_version(),
            "kind": def.kind,
            "metadata": metadata,
        });
        // The fields each kind requires, so that a client decodes the object rather than
        // failing the response.
        let body = match (def.group, def.kind) {
            ("", "Service") => {
                let ip = nth_address(self.range, serial).to_string();
                let family = if self.range.addr().is_ipv4() {
                    "IPv4"
                } else {
                    "IPv6"
                };
                json!({
                    "spec": {
                        "type": "ClusterIP",
                        "clusterIP": ip,
                        "clusterIPs": [ip],
                        "ipFamilies": [family],
                        "ipFamilyPolicy": "SingleStack",
                        "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 80}],
                        "selector": {"app": name},
                        "sessionAffinity": "None",
                        "internalTrafficPolicy": "Cluster",
                    },
                    "status": {"loadBalancer": {}},
                })
            }
            ("", "Namespace") => json!({
                "spec": {"finalizers": ["kubernetes"]},
                "status": {"phase": "Active"},
            }),
            ("", "Event") => json!({
                "involvedObject": {"kind": "Service", "namespace": self.namespace, "name": name},
                "reason": "Flood",
                "type": "Normal",
            }),
            ("events.k8s.io", "Event") => json!({
                "eventTime": crate::meta::now_rfc3339_micros(),
                "reason": "Flood",
                "type": "Normal",
            }),
            ("", "ConfigMap") | ("", "Secret") => json!({"data": {}}),
            ("coordination.k8s.io", "Lease") => json!({"spec": {}}),
            ("discovery.k8s.io", "EndpointSlice") => json!({
                "addressType": "IPv4",
                "endpoints": [],
            }),
            ("networking.k8s.io", "IPAddress") => json!({
                "spec": {"parentRef": {
                    "group": "",
                    "resource": "services",
                    "namespace": self.namespace,
                    "name": name,
                }},
            }),
            ("networking.k8s.io", "ServiceCIDR") => json!({
                "spec": {"cidrs": [self.range.to_string()]},
            }),
            _ => json!({}),
        };
        if let (Some(object), Value::Object(body)) = (object.as_object_mut(), body) {
            object.extend(body);
        }
        object
    }
}

/// The `n`th address of `range`, skipping its network address and first host (the `kubernetes`
/// Service's), wrapping around once the range is used up.
fn nth_address(range: IpNet, n: u64) -> IpAddr {
    let bits = u32::from(range.max_prefix_len() - range.prefix_len());
    // Ranges of a /64 or more still wrap within 2^64 addresses.
    let size = 1u128.checked_shl(bits.min(64)).unwrap_or(u128::MAX);
    let usable = size.saturating_sub(3).max(1);
    let offset = 2 + u128::from(n) % usable;
    match range.network() {
        IpAddr::V4(base) => {
            let offset = u32::try_from(offset).unwrap_or(2);
            IpAddr::V4(std::net::Ipv4Addr::from(
                u32::from(base).wrapping_add(offset),
            ))
        }
        IpAddr::V6(base) => IpAddr::V6(std::net::Ipv6Addr::from(
            u128::from(base).wrapping_add(offset),
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn addresses_stay_inside_the_range_and_skip_the_first_two() {
        let range: IpNet = "10.96.0.0/30".parse().unwrap();
        let got: Vec<String> = (0..3).map(|n| nth_address(range, n).to_string()).collect();
        assert_eq!(got, ["10.96.0.2", "10.96.0.2", "10.96.0.2"]);
        let range: IpNet = "10.96.0.0/12".parse().unwrap();
        assert_eq!(nth_address(range, 0).to_string(), "10.96.0.2");
        assert_eq!(nth_address(range, 300).to_string(), "10.96.1.46");
        let range: IpNet = "fd00::/108".parse().unwrap();
        assert_eq!(nth_address(range, 1).to_string(), "fd00::3");
    }

    #[test]
    fn pages_hold_new_names_and_never_end() {
        let services = crate::resources::find("", "v1", "services").unwrap();
        let flood = Flood::new(services, Some("team"), &[], 7);
        let query = HashMap::from([("limit".to_owned(), "5".to_owned())]);
        let first: Value = serde_json::from_slice(&flood.page(&query)).unwrap();
        let second: Value = serde_json::from_slice(&flood.page(&query)).unwrap();
        let names = |page: &Value| -> Vec<String> {
            page["items"]
                .as_array()
                .unwrap()
                .iter()
                .map(|item| item["metadata"]["name"].as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(names(&first).len(), 5);
        assert!(names(&first).iter().all(|n| !names(&second).contains(n)));
        for page in [&first, &second] {
            assert!(!page["metadata"]["continue"].as_str().unwrap().is_empty());
            let service: k8s_openapi::api::core::v1::Service =
                serde_json::from_value(page["items"][0].clone()).unwrap();
            assert_eq!(service.metadata.namespace.as_deref(), Some("team"));
        }
    }
}

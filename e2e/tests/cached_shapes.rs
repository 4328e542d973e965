//! End to end: every kind a loop caches, in the shapes real apiservers store, reaches its cache.
//! Each kind is written through the API four ways: with every field upstream's round-trip
//! fixture sets (`tests/fixtures/k8s-api-testdata`, with values a real apiserver takes), with
//! only the required fields, with optional fields `null`, and with fields no version of the API
//! has. After each write a repair that needs the cached object must happen, and at the end every
//! loop is ready, no watch event was lost and nothing was reported as undecodable. The
//! leader-election Lease is written once, as another client left it, for the controller to take
//! over.
//!
//! kube-apiserver stores a `null` optional field as left out (but the `null`s it serves itself:
//! a condition's time left out, an EndpointSlice without endpoints) and prunes unknown fields of
//! built-in kinds (accepting the write with a warning), so against a real cluster
//! (`e2e/control-plane/test.sh --test cached_shapes`) those two shapes reach the caches as the
//! apiserver serves them; the simulator stores and serves them as written, so it alone feeds
//! the caches the `null`s and the unknown fields.

mod common;

use std::collections::BTreeSet;

use anyhow::{Context, Result, ensure};
use common::{
    CONVERGE, ConfigFile, ControllerLeftovers, ControllerProcess, Target, eventually, service_ip,
};
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::{IPAddress, ServiceCIDR};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

/// The address the controller advertises.
const ADVERTISED: &str = "192.0.2.1";
/// Addresses the written endpoints list, which the controller must replace by [`ADVERTISED`].
const STRAY: &str = "192.0.2.200";
const STRAY_NOT_READY: &str = "192.0.2.201";
/// The extra ServiceCIDR of the fixture shape, and a Service address in it.
const EXTRA_CIDR: &str = "192.0.2.128/28";
const EXTRA_CIDR_IP: &str = "192.0.2.130";
/// A declared system namespace; each shape written drops its declared label.
const DECLARED: &str = "cached-shapes";
/// The node ports of the fixture-shaped LoadBalancer Service.
const NODE_PORT: i64 = 31777;
const HEALTH_CHECK_NODE_PORT: i64 = 31778;

/// The four shapes of a kind, named.
const SHAPES: [&str; 4] = ["fixture", "minimal", "nulls", "unknown"];

/// A status condition without `lastTransitionTime`, as upstream's conformance test patches one
/// (`test/e2e/network/service.go`): kube-apiserver stores it and serves the time as `null`
/// (Go's zero `metav1.Time`).
static NO_TIME_CONDITION: std::sync::LazyLock<Value> = std::sync::LazyLock::new(|| {
    json!({"type": "ShapesNoTime", "status": "True", "reason": "E2E",
           "message": "a condition without its time"})
});

/// Upstream's fixture of `kind` (e.g. `core.v1.Service`).
fn fixture(kind: &str) -> Result<Value> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/k8s-api-testdata")
        .join(format!("{kind}.json"));
    let text = std::fs::read_to_string(&path).with_context(|| format!("{}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

/// Every path to a leaf of `value` (array items as `[]`), below `prefix`.
fn paths(value: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        Value::Object(members) if !members.is_empty() => {
            for (key, member) in members {
                paths(member, &format!("{prefix}/{key}"), out);
            }
        }
        Value::Array(items) if !items.is_empty() => {
            for item in items {
                paths(item, &format!("{prefix}/[]"), out);
            }
        }
        _ => {
            out.insert(prefix.to_owned());
        }
    }
}

/// Metadata the server sets or that would make the object go away (a garbage-collected owner,
/// a deletion under way): left out of every written shape.
const SERVER_METADATA: [&str; 10] = [
    "/metadata/selfLink",
    "/metadata/uid",
    "/metadata/resourceVersion",
    "/metadata/generation",
    "/metadata/creationTimestamp",
    "/metadata/deletionTimestamp",
    "/metadata/deletionGracePeriodSeconds",
    "/metadata/ownerReferences",
    "/metadata/finalizers",
    "/metadata/managedFields",
];

/// The written shape `written` (object and status together) sets every field of the fixture
/// of `kind` but the server's metadata, and, named the fixture's way, the labels and
/// annotations: so a field a newer fixture adds fails this check until the shape has it.
fn covers_fixture(kind: &str, written: &[&Value]) -> Result<()> {
    let mut want = BTreeSet::new();
    paths(&fixture(kind)?, "", &mut want);
    let mut have = BTreeSet::new();
    for value in written {
        paths(value, "", &mut have);
    }
    let missing: Vec<&String> = want
        .iter()
        .filter(|path| !SERVER_METADATA.iter().any(|m| path.starts_with(m)))
        .filter(|path| !["/kind", "/apiVersion"].contains(&path.as_str()))
        // A cluster-scoped kind has none.
        .filter(|path| {
            *path != "/metadata/namespace" || written[0]["metadata"].get("namespace").is_some()
        })
        .filter(|path| {
            // Map fields: the fixture's one key stands for any.
            let map = ["labels", "annotations", "selector", "deprecatedTopology"]
                .iter()
                .find_map(|m| {
                    path.split_once(&format!("/{m}/"))
                        .map(|(head, _)| (head, *m))
                });
            match map {
                Some((head, m)) => !have.iter().any(|h| h.starts_with(&format!("{head}/{m}/"))),
                None => !have.contains(*path),
            }
        })
        .collect();
    ensure!(
        missing.is_empty(),
        "the written {kind} leaves out fields of upstream's fixture: {missing:?}"
    );
    Ok(())
}

/// `value` with a field no API version has in every object of it (but in maps, where a key is
/// data).
fn with_unknown_fields(value: &mut Value) {
    match value {
        Value::Object(members) => {
            for (key, member) in members.iter_mut() {
                if !["labels", "annotations", "selector", "deprecatedTopology"]
                    .contains(&key.as_str())
                {
                    with_unknown_fields(member);
                }
            }
            members.insert(
                "shapesFutureField".to_owned(),
                json!({"nested": [1, "two", {"three": true}], "empty": {}}),
            );
        }
        Value::Array(items) => items.iter_mut().for_each(with_unknown_fields),
        _ => {}
    }
}

/// `value` with the members at `pointers` set to `null`.
fn with_nulls(mut value: Value, pointers: &[&str]) -> Result<Value> {
    for pointer in pointers {
        let member = value
            .pointer_mut(pointer)
            .with_context(|| format!("no {pointer} to null"))?;
        *member = Value::Null;
    }
    Ok(value)
}

/// The four shapes of an object: `full` as the fixture sets it, `minimal`, `full` with the
/// optional fields at `nullable` null, and `full` with unknown fields.
fn shapes(full: &Value, minimal: Value, nullable: &[&str]) -> Result<Vec<Value>> {
    let mut unknown = full.clone();
    with_unknown_fields(&mut unknown);
    Ok(vec![
        full.clone(),
        minimal,
        with_nulls(full.clone(), nullable)?,
        unknown,
    ])
}

/// Creates `object` through the API, or replaces the one of its name; then writes its status
/// (which a create or replace ignores), if it has one.
async fn put(client: &Client, object: &Value) -> Result<()> {
    common::create_or_replace(client, object).await?;
    let api = common::api_of(client, object).await?;
    let name = object["metadata"]["name"].as_str().context("name")?;
    if let Some(status) = object.get("status").filter(|s| !s.is_null()) {
        api.patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .with_context(|| format!("the status of {name}: {status}"))?;
    }
    Ok(())
}

fn service(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default"}, "spec": spec})
}

/// The Services: a LoadBalancer with every field of the fixture (but `externalName`), an
/// ExternalName one for that, and the other shapes as ClusterIP Services. Each with its address
/// (`None`: the apiserver picks one).
fn service_shapes(range: &str) -> Result<Vec<(Value, Option<String>)>> {
    let fixture_ip = service_ip(range, 50)?;
    let full = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {
            "name": "shapes-fixture", "generateName": "shapes-", "namespace": "default",
            "labels": {"labelsKey": "labelsValue"},
            "annotations": {"annotationsKey": "annotationsValue"},
        },
        "spec": {
            "ports": [{"name": "web", "protocol": "TCP", "appProtocol": "example.com/web",
                       "port": 3, "targetPort": "web-port", "nodePort": NODE_PORT}],
            "selector": {"selectorKey": "selectorValue"},
            "clusterIP": fixture_ip, "clusterIPs": [fixture_ip], "type": "LoadBalancer",
            "externalIPs": ["192.0.2.10"], "sessionAffinity": "ClientIP",
            "loadBalancerIP": "192.0.2.11", "loadBalancerSourceRanges": ["192.0.2.0/24"],
            "externalTrafficPolicy": "Local", "healthCheckNodePort": HEALTH_CHECK_NODE_PORT,
            "publishNotReadyAddresses": true,
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 1}},
            "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
            "allocateLoadBalancerNodePorts": true, "loadBalancerClass": "example.com/lb",
            "internalTrafficPolicy": "Cluster", "trafficDistribution": "PreferClose",
        },
        "status": {
            "loadBalancer": {"ingress": [{
                "ip": "192.0.2.12", "hostname": "lb.example.com", "ipMode": "VIP",
                "ports": [{"port": 3, "protocol": "TCP", "error": "ShapesError"}],
            }]},
            "conditions": [{
                "type": "ShapesFixture", "status": "True", "observedGeneration": 1,
                "lastTransitionTime": "2004-01-01T01:01:01Z", "reason": "Fixture",
                "message": "every field of the fixture",
            }],
        },
    });
    let external = service(
        "shapes-external",
        json!({"type": "ExternalName", "externalName": "example.com"}),
    );
    covers_fixture("core.v1.Service", &[&full, &external])?;
    let nulls_ip = service_ip(range, 51)?;
    let nulls = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "shapes-nulls", "namespace": "default",
                     "labels": null, "annotations": null, "generateName": null},
        "spec": {
            "ports": [{"name": null, "protocol": "TCP", "appProtocol": null, "port": 80,
                       "targetPort": null, "nodePort": null}],
            "selector": null, "clusterIP": nulls_ip, "clusterIPs": [nulls_ip],
            "type": null, "externalIPs": null, "sessionAffinity": null, "loadBalancerIP": null,
            "loadBalancerSourceRanges": null, "externalName": null,
            "externalTrafficPolicy": null, "healthCheckNodePort": null,
            "publishNotReadyAddresses": null, "sessionAffinityConfig": null,
            "ipFamilies": null, "ipFamilyPolicy": null, "allocateLoadBalancerNodePorts": null,
            "loadBalancerClass": null, "internalTrafficPolicy": null,
            "trafficDistribution": null,
        },
        // A condition without its time: kube-apiserver serves the time `null`.
        "status": {"loadBalancer": {"ingress": null}, "conditions": [NO_TIME_CONDITION.clone()]},
    });
    let unknown_ip = service_ip(range, 52)?;
    let mut unknown = service(
        "shapes-unknown",
        json!({"clusterIP": unknown_ip, "clusterIPs": [unknown_ip],
               "ports": [{"port": 80, "protocol": "TCP"}], "selector": {"app": "shapes"}}),
    );
    unknown["status"] = json!({"conditions": [{
        "type": "ShapesUnknown", "status": "False", "lastTransitionTime": "2004-01-01T01:01:01Z",
        "reason": "Unknown", "message": "fields no version has",
    }]});
    with_unknown_fields(&mut unknown);
    let cidr = service(
        "shapes-in-extra-cidr",
        json!({"clusterIP": EXTRA_CIDR_IP, "clusterIPs": [EXTRA_CIDR_IP],
               "ports": [{"port": 80}]}),
    );
    Ok(vec![
        (full, Some(fixture_ip)),
        (external, None),
        (
            service("shapes-minimal", json!({"ports": [{"port": 80}]})),
            None,
        ),
        (nulls, Some(nulls_ip)),
        (unknown, Some(unknown_ip)),
        (cidr, Some(EXTRA_CIDR_IP.to_owned())),
    ])
}

/// The `default/kubernetes` Endpoints in each shape, listing stray addresses.
fn endpoints() -> Result<Vec<Value>> {
    let target = json!({"kind": "Pod", "namespace": "default", "name": "shapes-pod",
                        "uid": "00000000-0000-0000-0000-000000000001", "apiVersion": "v1",
                        "resourceVersion": "1", "fieldPath": "spec.containers{shapes}"});
    let full = json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "kubernetes", "generateName": "shapes-", "namespace": "default",
                     "labels": {"endpointslice.kubernetes.io/skip-mirror": "true",
                                "labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "subsets": [{
            "addresses": [{"ip": STRAY, "hostname": "stray", "nodeName": "shapes-node",
                           "targetRef": target}],
            "notReadyAddresses": [{"ip": STRAY_NOT_READY, "hostname": "stray-not-ready",
                                   "nodeName": "shapes-node", "targetRef": target}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP", "appProtocol": "https"}],
        }],
    });
    covers_fixture("core.v1.Endpoints", &[&full])?;
    let minimal = json!({
        "apiVersion": "v1", "kind": "Endpoints",
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "subsets": [{"addresses": [{"ip": STRAY}], "ports": [{"port": 6443}]}],
    });
    shapes(
        &full,
        minimal,
        &[
            "/metadata/annotations",
            "/subsets/0/notReadyAddresses",
            "/subsets/0/addresses/0/hostname",
            "/subsets/0/addresses/0/nodeName",
            "/subsets/0/addresses/0/targetRef",
            "/subsets/0/ports/0/name",
            "/subsets/0/ports/0/appProtocol",
        ],
    )
}

/// The `default/kubernetes` EndpointSlice in each shape, listing a stray address.
fn endpoint_slices() -> Result<Vec<Value>> {
    let full = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "generateName": "shapes-", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes",
                                "labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "addressType": "IPv4",
        "endpoints": [{
            "addresses": [STRAY],
            "conditions": {"ready": true, "serving": true, "terminating": false},
            "hostname": "stray",
            "targetRef": {"kind": "Pod", "namespace": "default", "name": "shapes-pod",
                          "uid": "00000000-0000-0000-0000-000000000001", "apiVersion": "v1",
                          "resourceVersion": "1", "fieldPath": "spec.containers{shapes}"},
            "deprecatedTopology": {"deprecatedTopologyKey": "deprecatedTopologyValue"},
            "nodeName": "shapes-node", "zone": "shapes-zone",
            "hints": {"forZones": [{"name": "shapes-zone"}], "forNodes": [{"name": "shapes-node"}]},
        }],
        "ports": [{"name": "https", "protocol": "TCP", "port": 6443, "appProtocol": "https"}],
    });
    covers_fixture("discovery.k8s.io.v1.EndpointSlice", &[&full])?;
    let minimal = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [STRAY]}],
        "ports": null,
    });
    shapes(
        &full,
        minimal,
        &[
            "/metadata/annotations",
            // An EndpointSlice without endpoints: kube-apiserver serves `"endpoints": null`.
            "/endpoints",
            "/ports/0/name",
            "/ports/0/appProtocol",
        ],
    )
}

/// A membership Lease of `address` in each shape (one address per shape), renewed now for an
/// hour.
fn leases() -> Result<Vec<(Value, String)>> {
    let now = k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%S%.6fZ")
        .to_string();
    let lease = |address: &str, spec: Value| {
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {
                "name": format!("apiserver-{address}"), "generateName": "shapes-",
                "namespace": "kube-system",
                "labels": {"bootstrap-controller.io/apiserver-endpoint": "kubernetes",
                           "labelsKey": "labelsValue"},
                "annotations": {"bootstrap-controller.io/advertise-address": address,
                                "bootstrap-controller.io/secure-port": "6443",
                                "annotationsKey": "annotationsValue"},
            },
            "spec": spec,
        })
    };
    let full_spec = json!({
        "holderIdentity": "shapes-holder", "leaseDurationSeconds": 3600,
        "acquireTime": now, "renewTime": now, "leaseTransitions": 5,
        "strategy": "OldestEmulationVersion", "preferredHolder": "shapes-holder",
    });
    let full = lease("192.0.2.77", full_spec.clone());
    covers_fixture("coordination.k8s.io.v1.Lease", &[&full])?;
    let minimal = lease(
        "192.0.2.78",
        json!({"leaseDurationSeconds": 3600, "renewTime": now}),
    );
    let nulls = with_nulls(
        lease("192.0.2.79", full_spec.clone()),
        &[
            "/spec/holderIdentity",
            "/spec/acquireTime",
            "/spec/leaseTransitions",
            "/spec/strategy",
            "/spec/preferredHolder",
        ],
    )?;
    let mut unknown = lease("192.0.2.80", full_spec);
    with_unknown_fields(&mut unknown);
    Ok([full, minimal, nulls, unknown]
        .into_iter()
        .zip(["192.0.2.77", "192.0.2.78", "192.0.2.79", "192.0.2.80"])
        .map(|(lease, address)| (lease, address.to_owned()))
        .collect())
}

/// The leader-election Lease held by another client, expired: every field of the fixture, an
/// optional one `null` and fields no version has.
fn leader_lease() -> Value {
    let mut lease = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "bootstrap-controller", "namespace": "kube-system",
                     "labels": {"labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "spec": {
            "holderIdentity": "shapes-holder", "leaseDurationSeconds": 2,
            "acquireTime": "2003-01-01T01:01:01.000003Z",
            "renewTime": "2004-01-01T01:01:01.000004Z", "leaseTransitions": 5,
            "strategy": "OldestEmulationVersion", "preferredHolder": null,
        },
    });
    with_unknown_fields(&mut lease);
    lease
}

/// The declared namespace in each shape, each without its declared label.
fn namespace_shapes() -> Result<Vec<Value>> {
    let full = json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": DECLARED, "generateName": "shapes-", "labels": {"labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "spec": {"finalizers": ["kubernetes"]},
        "status": {"phase": "Active", "conditions": [{
            "type": "ShapesFixture", "status": "True",
            "lastTransitionTime": "2004-01-01T01:01:01Z", "reason": "Fixture",
            "message": "every field of the fixture",
        }]},
    });
    covers_fixture("core.v1.Namespace", &[&full])?;
    let minimal = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DECLARED}});
    shapes(
        &full,
        minimal,
        &[
            "/metadata/labels",
            "/metadata/annotations",
            "/status/conditions/0/lastTransitionTime",
            "/status/conditions/0/reason",
        ],
    )
}

/// The extra ServiceCIDR, with every field of the fixture.
fn service_cidr() -> Result<Value> {
    let full = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
        "metadata": {"name": "shapes-extra", "generateName": "shapes-", "labels": {"labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "spec": {"cidrs": [EXTRA_CIDR]},
        "status": {"conditions": [{
            "type": "ShapesFixture", "status": "True", "observedGeneration": 1,
            "lastTransitionTime": "2004-01-01T01:01:01Z", "reason": "Fixture",
            "message": "every field of the fixture",
        }, NO_TIME_CONDITION.clone()]},
    });
    covers_fixture("networking.k8s.io.v1.ServiceCIDR", &[&full])?;
    Ok(full)
}

/// The IPAddress of a Service of ours, as the allocator makes it, with every field of the
/// fixture and, for `shape` "unknown", unknown fields.
fn ip_address(ip: &str, service: &str, shape: &str) -> Result<Value> {
    let mut full = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
        "metadata": {"name": ip, "generateName": "shapes-",
                     "labels": {"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                                "ipaddress.kubernetes.io/ip-family": "IPv4",
                                "labelsKey": "labelsValue"},
                     "annotations": {"annotationsKey": "annotationsValue"}},
        "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default",
                               "name": service}},
    });
    covers_fixture("networking.k8s.io.v1.IPAddress", &[&full])?;
    match shape {
        "nulls" => full = with_nulls(full, &["/metadata/annotations", "/spec/parentRef/group"])?,
        "unknown" => with_unknown_fields(&mut full),
        _ => {}
    }
    Ok(full)
}

/// Changes the conditions of the ServiceCIDR `name` with `change`. Read as JSON: a
/// condition without its time is served `null`, which k8s-openapi refuses.
async fn patch_conditions(
    client: &Client,
    name: &str,
    change: impl FnOnce(&mut Vec<Value>),
) -> Result<()> {
    let cidr = json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                      "metadata": {"name": name}});
    let api = common::api_of(client, &cidr).await?;
    let current = api.get(name).await?;
    let mut conditions: Vec<Value> = current.data["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    change(&mut conditions);
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": conditions}})),
    )
    .await
    .with_context(|| format!("the status of ServiceCIDR {name}"))?;
    Ok(())
}

/// Sets the conditions of the `kubernetes` Service (JSON: k8s-openapi refuses a condition
/// without its time).
async fn kubernetes_service_conditions(client: &Client, conditions: Value) -> Result<()> {
    let api = common::api_of(client, &service("kubernetes", json!({}))).await?;
    api.patch_status(
        "kubernetes",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": conditions}})),
    )
    .await
    .context("the kubernetes Service's status")?;
    Ok(())
}

/// What this test leaves on a shared real cluster, removed whatever its outcome.
async fn clean_up(client: &Client) -> Result<()> {
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    kubernetes_service_conditions(client, Value::Null).await?;
    // Without the ServiceCIDR API (before 1.33) there is none to clean.
    let _ = patch_conditions(client, "kubernetes", |conditions| {
        conditions.retain(|c| c["type"] != NO_TIME_CONDITION["type"]);
    })
    .await;
    for name in [
        "shapes-fixture",
        "shapes-external",
        "shapes-minimal",
        "shapes-nulls",
        "shapes-unknown",
        "shapes-in-extra-cidr",
    ] {
        let _ = services.delete(name, &DeleteParams::default()).await;
    }
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-system");
    for address in ["192.0.2.77", "192.0.2.78", "192.0.2.79", "192.0.2.80"] {
        let _ = leases
            .delete(&format!("apiserver-{address}"), &DeleteParams::default())
            .await;
    }
    let _ = Api::<ServiceCIDR>::all(client.clone())
        .delete("shapes-extra", &DeleteParams::default())
        .await;
    let _ = Api::<Namespace>::all(client.clone())
        .delete(DECLARED, &DeleteParams::default())
        .await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_cached_kind_in_every_stored_shape_reaches_its_cache() -> Result<()> {
    let target = Target::start().await?;
    // Earlier tests' Leases would list their addresses and hold the leadership.
    let _leftovers = ControllerLeftovers::forget(&target)?;
    let client = target.client().await?;
    let outcome = cached_shapes(&target, &client).await;
    if let Target::Cluster { .. } = target {
        let cleaned = clean_up(&client).await.context("cleaning up");
        // The test's own failure first: a failed clean-up may follow from it.
        outcome?;
        return cleaned;
    }
    outcome
}

/// The addresses the `kubernetes` Endpoints and EndpointSlice list, if they list `want`.
async fn listed_exactly(client: &Client, want: &BTreeSet<String>) -> Result<Option<()>> {
    let endpoints = Api::<Endpoints>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?;
    let in_endpoints: BTreeSet<String> = endpoints
        .into_iter()
        .flat_map(|e| e.subsets.unwrap_or_default())
        .flat_map(|s| {
            s.addresses
                .unwrap_or_default()
                .into_iter()
                .chain(s.not_ready_addresses.unwrap_or_default())
        })
        .map(|a| a.ip)
        .collect();
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?;
    let in_slice: BTreeSet<String> = slice
        .into_iter()
        .flat_map(|s| s.endpoints)
        .flat_map(|e| e.addresses)
        .collect();
    Ok((&in_endpoints == want && &in_slice == want).then_some(()))
}

async fn cached_shapes(target: &Target, client: &Client) -> Result<()> {
    let range = target.service_range().await?;
    let ip_api = target
        .serves(
            "its IPAddress and ServiceCIDR shapes and the Services' lost IPAddresses",
            "networking.k8s.io/v1",
            "ipaddresses",
            "1.33",
        )
        .await?;
    let config = ConfigFile::new(&format!(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: kube-system\n      - name: kube-public\n      - name: kube-node-lease\n      - name: default\n      - name: {DECLARED}\n        labels: {{shapes: declared}}\n"
    ))?;
    // Lease: the leader-election Lease as another client left it; the controller takes it over
    // once it has seen it expire.
    // A new simulator has no kube-system yet.
    let kube_system = serde_json::from_value(json!({"metadata": {"name": "kube-system"}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &kube_system)
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(err) => return Err(err.into()),
    }
    put(client, &leader_lease())
        .await
        .context("the leader Lease")?;
    let mut controller = ControllerProcess::start(
        target.kubeconfig(),
        &[
            "--config",
            &config.path,
            "--service-cluster-ip-range",
            &range,
            "--endpoint-reconciler-type",
            "lease",
            "--advertise-address",
            ADVERTISED,
        ],
    )?;
    controller.wait_ready().await?;
    let lease_api: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(client.clone(), "kube-system");
    eventually("the leader Lease taken over", CONVERGE, || async {
        let holder = lease_api
            .get("bootstrap-controller")
            .await?
            .spec
            .and_then(|spec| spec.holder_identity);
        Ok(holder.filter(|h| h != "shapes-holder").map(|_| ()))
    })
    .await?;
    let alone: BTreeSet<String> = [ADVERTISED.to_owned()].into();
    eventually("the advertised address listed", CONVERGE, || async {
        listed_exactly(client, &alone).await
    })
    .await?;

    // The `kubernetes` Service and ServiceCIDR, which the loops watch by name, with a condition
    // without its time (removed again by `clean_up`); the repairs below need both caches.
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    eventually("the kubernetes Service", CONVERGE, || async {
        Ok(services.get_opt("kubernetes").await?)
    })
    .await?;
    kubernetes_service_conditions(client, json!([NO_TIME_CONDITION.clone()])).await?;
    if ip_api {
        patch_conditions(client, "kubernetes", |conditions| {
            conditions.push(NO_TIME_CONDITION.clone())
        })
        .await?;
    }

    // Namespace: each shape drops the declared label, which the controller restores.
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for (shape, object) in SHAPES.iter().zip(namespace_shapes()?) {
        put(client, &object).await.context(*shape)?;
        eventually(
            &format!("the declared label restored on the {shape} Namespace"),
            CONVERGE,
            || async {
                let ns = namespaces.get(DECLARED).await?;
                Ok(ns
                    .metadata
                    .labels
                    .unwrap_or_default()
                    .get("shapes")
                    .is_some_and(|v| v == "declared")
                    .then_some(()))
            },
        )
        .await?;
    }

    // Lease: each shape's address joins the endpoints, and leaves once its Lease is gone.
    let mut members = alone.clone();
    for (shape, (lease, address)) in SHAPES.iter().zip(leases()?) {
        put(client, &lease).await.context(*shape)?;
        members.insert(address);
        eventually(
            &format!("the {shape} Lease's address listed"),
            CONVERGE,
            || async { listed_exactly(client, &members).await },
        )
        .await?;
    }
    for address in ["192.0.2.77", "192.0.2.78", "192.0.2.79", "192.0.2.80"] {
        lease_api
            .delete(&format!("apiserver-{address}"), &DeleteParams::default())
            .await?;
    }
    eventually("the Leases' addresses withdrawn", CONVERGE, || async {
        listed_exactly(client, &alone).await
    })
    .await?;

    // Endpoints and EndpointSlice: each shape lists stray addresses, which the controller
    // replaces.
    for (kind, objects) in [
        ("Endpoints", endpoints()?),
        ("EndpointSlice", endpoint_slices()?),
    ] {
        for (shape, object) in SHAPES.iter().zip(objects) {
            put(client, &object)
                .await
                .with_context(|| format!("{shape} {kind}"))?;
            eventually(
                &format!("the {shape} {kind} repaired"),
                CONVERGE,
                || async { listed_exactly(client, &alone).await },
            )
            .await?;
        }
    }

    // Service, ServiceCIDR and IPAddress: each Service's IPAddress, lost, is made again.
    if ip_api {
        // Its conditions added to any the cluster has set (kube-controller-manager's `Ready`).
        let mut cidr = service_cidr()?;
        let status = cidr
            .as_object_mut()
            .and_then(|object| object.remove("status"))
            .context("status")?;
        put(client, &cidr).await.context("ServiceCIDR")?;
        let added = status["conditions"].as_array().cloned().unwrap_or_default();
        patch_conditions(client, "shapes-extra", |conditions| {
            conditions.extend(added)
        })
        .await?;
    }
    let addresses: Api<IPAddress> = Api::all(client.clone());
    let mut addressed = Vec::new();
    for (object, ip) in service_shapes(&range)? {
        if !ip_api && ip.as_deref() == Some(EXTRA_CIDR_IP) {
            continue;
        }
        let name = object["metadata"]["name"]
            .as_str()
            .context("name")?
            .to_owned();
        // kube-apiserver's allocator takes an address in the new ServiceCIDR once its
        // informer has it.
        eventually(&format!("{name} created"), CONVERGE, || async {
            put(client, &object).await.map(Some)
        })
        .await?;
        let ip = match ip {
            Some(ip) => Some(ip),
            None => services
                .get(&name)
                .await?
                .spec
                .and_then(|spec| spec.cluster_ip)
                .filter(|ip| ip.parse::<std::net::IpAddr>().is_ok()),
        };
        if let Some(ip) = ip {
            addressed.push((name, ip));
        }
    }
    if ip_api {
        for ((name, ip), shape) in addressed.iter().zip(SHAPES.iter().cycle()) {
            eventually(&format!("{name}'s IPAddress"), CONVERGE, || async {
                Ok(addresses
                    .get_opt(ip)
                    .await?
                    .filter(|a| a.metadata.deletion_timestamp.is_none()))
            })
            .await?;
            // Replaced by its shape (the same owner): a repair must not take it for another's.
            addresses.delete(ip, &DeleteParams::default()).await?;
            eventually(&format!("{name}'s IPAddress gone"), CONVERGE, || async {
                Ok(addresses.get_opt(ip).await?.is_none().then_some(()))
            })
            .await?;
            match target {
                // The simulator keeps the lost IPAddress lost until the controller makes it.
                Target::Sim(_) => {
                    eventually(
                        &format!("{name}'s lost IPAddress recreated"),
                        CONVERGE,
                        || async { Ok(addresses.get_opt(ip).await?) },
                    )
                    .await?;
                    addresses.delete(ip, &DeleteParams::default()).await?;
                    // The controller may make it again first; `put` then replaces that one.
                    put(client, &ip_address(ip, name, shape)?)
                        .await
                        .with_context(|| format!("the {shape} IPAddress of {name}"))?;
                }
                // kube-apiserver's own repair races the controller for it here.
                Target::Cluster { .. } => {
                    eventually(
                        &format!("{name}'s lost IPAddress recreated"),
                        CONVERGE,
                        || async { Ok(addresses.get_opt(ip).await?) },
                    )
                    .await?;
                }
            }
        }
    }

    // A few more passes over every shape.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    ensure!(controller.is_running(), "exited:\n{}", controller.log());
    let (ready, verbose) = controller.admin_get("/readyz?verbose").await?;
    ensure!(ready == 200, "/readyz {ready}:\n{verbose}");
    let (status, metrics) = controller.admin_get("/metrics").await?;
    ensure!(status == 200, "/metrics: {status}");
    let lost: Vec<&str> = metrics
        .lines()
        .filter(|line| line.starts_with("bootstrap_cache_events_lost_total"))
        .filter(|line| !line.trim_end().ends_with(" 0"))
        .collect();
    ensure!(lost.is_empty(), "events lost: {lost:?}");
    let log = controller.log();
    for sign in [
        "could not be decoded",
        "panicked",
        "list failed",
        "WrongReference",
    ] {
        ensure!(!log.contains(sign), "{sign:?} in the log:\n{log}");
    }
    if target.as_sim().is_some() {
        // The simulator served the shapes as written: the nulls and unknown fields reached the
        // caches (a real apiserver drops them on write).
        for (name, sign) in [
            ("shapes-nulls", "\"selector\":null"),
            ("shapes-unknown", "shapesFutureField"),
        ] {
            let api = common::api_of(client, &service(name, json!({}))).await?;
            let served = serde_json::to_string(&api.get(name).await?)?;
            ensure!(
                served.contains(sign),
                "{name} served without {sign}: {served}"
            );
        }
    }
    Ok(())
}

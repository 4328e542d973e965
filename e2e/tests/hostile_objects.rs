//! End to end: objects no healthy apiserver would hand out (written through the simulator's
//! backdoor, as an etcd restore or a buggy client could leave them) next to healthy ones. Every
//! loop keeps running and keeps repairing the rest: no pass panics, `/readyz` stays 200, the
//! healthy objects are repaired, and the strange ones are skipped, not "repaired" into damage.

mod common;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{CONVERGE, ControllerProcess, Target, eventually};
use k8s_openapi::api::core::v1::{Endpoints, Namespace};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::Api;
use serde_json::{Value, json};

fn managed(name: &str, parent: Value) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
        "metadata": {"name": name, "labels": {
            "ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
            "ipaddress.kubernetes.io/ip-family": "IPv4"}},
        "spec": parent,
    })
}

fn member_lease(name: &str, address: &str, spec: Value) -> Value {
    json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
           "metadata": {"name": name, "namespace": "kube-system",
                        "labels": {"bootstrap-controller.io/apiserver-endpoint": "kubernetes"},
                        "annotations": {"bootstrap-controller.io/advertise-address": address}},
           "spec": spec})
}

fn service(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Service",
           "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
           "spec": spec})
}

/// The hostile objects, each with what a loop must not do about it.
fn hostile() -> Vec<Value> {
    let mut ten_thousand = Vec::new();
    for i in 0..10_000u32 {
        ten_thousand.push(
            json!({"ip": format!("10.{}.{}.{}", 100 + i / 65_536, (i / 256) % 256, i % 256)}),
        );
    }
    vec![
        // ClusterIP repair: unparseable cluster IPs are reported, never allocated or freed.
        service(
            "bad-ip",
            json!({"clusterIP": "not-an-ip", "clusterIPs": ["not-an-ip"],
                                 "ports": [{"port": 80}]}),
        ),
        service(
            "junk-ips",
            json!({"clusterIP": "10.96.0.50",
                                   "clusterIPs": ["10.96.0.50", "zzz", "::1::"],
                                   "ports": [{"port": 80}]}),
        ),
        // Fields from a newer apiserver, at every level.
        service(
            "future",
            json!({"clusterIP": "10.96.0.60", "clusterIPs": ["10.96.0.60"],
                                 "ports": [{"port": 80, "futurePortField": true}],
                                 "futureSpecField": {"nested": [1, 2, 3]}}),
        ),
        // IPAddresses: a name that is no IP, and one without a parent.
        managed(
            "foo",
            json!({"parentRef": {"group": "", "resource": "services",
                                            "namespace": "default", "name": "bad-ip"}}),
        ),
        managed("10.96.0.77", json!({})),
        // A ServiceCIDR whose CIDR cannot parse.
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
            "10.0.0.9",
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
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_objects_are_skipped_and_every_loop_keeps_working() -> Result<()> {
    let target = Target::start().await?;
    let Some(sim) = target.sim("hostile objects written by backdoor") else {
        return Ok(());
    };
    let client = target.client().await?;
    for object in hostile() {
        let name = object["metadata"]["name"].clone();
        sim.admin("PUT", "/sim/backdoor", Some(object))
            .await
            .with_context(|| format!("planting {name}"))?;
    }
    // A healthy Service whose IPAddress is lost: the repair must still recreate it.
    let web = sim
        .admin(
            "PUT",
            "/sim/backdoor",
            Some(service(
                "web",
                json!({"clusterIP": "10.96.0.40",
                                        "clusterIPs": ["10.96.0.40"],
                                        "ports": [{"port": 80}]}),
            )),
        )
        .await?;
    ensure!(web.contains("10.96.0.40"), "{web}");

    let mut controller = ControllerProcess::start(
        target.kubeconfig(),
        &[
            "--service-cluster-ip-range",
            "10.96.0.0/12",
            "--advertise-address",
            "10.0.0.1",
            "--leader-elect=false",
        ],
    )?;
    controller.wait_ready().await?;

    let addresses: Api<IPAddress> = Api::all(client.clone());
    eventually("web's lost IPAddress recreated", CONVERGE, || async {
        Ok(addresses.get_opt("10.96.0.40").await?)
    })
    .await?;
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
    eventually(
        "the 10,000 addresses replaced by the one member",
        CONVERGE,
        || async {
            let e = endpoints.get("kubernetes").await?;
            let listed: Vec<String> = e
                .subsets
                .unwrap_or_default()
                .into_iter()
                .flat_map(|s| s.addresses.unwrap_or_default())
                .map(|a| a.ip)
                .collect();
            Ok((listed == ["10.0.0.1"]).then_some(()))
        },
    )
    .await?;
    // A few more passes over the same objects.
    tokio::time::sleep(Duration::from_secs(3)).await;

    ensure!(controller.is_running(), "exited:\n{}", controller.log());
    let (status, readyz) = controller.admin_get("/readyz?verbose").await?;
    ensure!(status == 200, "{readyz}\n{}", controller.log());
    let (_, metrics) = controller.admin_get("/metrics").await?;
    let panics: Vec<&str> = metrics
        .lines()
        .filter(|line| line.contains("result=\"panic\"") && !line.ends_with(" 0"))
        .collect();
    ensure!(panics.is_empty(), "passes panicked: {panics:?}");
    // Skipped, not repaired into damage: the stuck namespace is left to its finalizer (not
    // recreated under it), and the everlasting Lease's address never became a member (checked
    // above: the endpoints list 10.0.0.1 alone).
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let stuck = namespaces.get("kube-node-lease").await?;
    ensure!(
        stuck.metadata.deletion_timestamp.is_some(),
        "the Terminating namespace was replaced: {stuck:?}"
    );
    let log = controller.log();
    // Each strange object is reported (upstream's events for the ClusterIP repair's findings),
    // and replacing 10,000 stale addresses is one event, not 10,000.
    let events: Api<Event> = Api::all(client.clone());
    let events: Vec<(String, String)> = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.regarding.and_then(|r| r.name).unwrap_or_default(),
            )
        })
        .collect();
    for (reason, regarding) in [
        ("ClusterIPNotValid", "bad-ip"),
        ("ClusterIPNotValid", "junk-ips"),
        ("IPAddressWrongReference", "foo"),
        ("IPAddressNotAllocated", "10.96.0.77"),
    ] {
        ensure!(
            events
                .iter()
                .any(|(r, name)| r == reason && name == regarding),
            "no {reason} event about {regarding}: {events:?}"
        );
    }
    let left = events.iter().filter(|(r, _)| r == "MemberLeft").count();
    ensure!(left == 1, "{left} MemberLeft events for one replacement");
    ensure!(log.contains("Lease garbage-address has a non-IP"), "{log}");
    ensure!(
        log.contains("Lease everlasting says it was renewed at"),
        "{log}"
    );
    // The stuck namespace is warned about (once) with what holds it.
    ensure!(
        log.contains("kube-node-lease has been terminating") && log.contains("example.com/stuck"),
        "{log}"
    );
    ensure!(!log.contains("panicked"), "{log}");
    Ok(())
}

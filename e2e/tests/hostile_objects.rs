//! End to end: objects no healthy apiserver would hand out (as an etcd restore or a buggy client
//! could leave them) next to healthy ones. Every loop keeps running and keeps repairing the
//! rest: no pass panics, `/readyz` stays 200, the healthy objects are repaired, and the strange
//! ones are skipped, not "repaired" into damage.
//!
//! On the simulator every hostile object is planted through its backdoor. Against a real cluster
//! (`BOOTSTRAP_E2E_KUBECONFIG`, e.g. `e2e/control-plane/test.sh --test hostile_objects`) the ones
//! a real kube-apiserver takes are created through its API (`real_admission.rs` pins which it
//! refuses), and the stuck namespace is made as a client can: a finalizer, then a delete.

mod common;
#[path = "hostile/objects.rs"]
mod hostile;

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::{CONVERGE, ControllerProcess, Target, eventually, service_ip};
use hostile::{
    ADVERTISED, accepted_by_a_real_apiserver, hostile, refused_by_a_real_apiserver, service,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

/// Creates `object` through the API, or replaces the one of its name (a shared cluster keeps
/// the `kubernetes` Endpoints of earlier tests).
async fn put(client: &Client, object: &Value) -> Result<()> {
    let mut object = object.clone();
    if let Some(metadata) = object["metadata"].as_object_mut() {
        metadata.remove("uid");
    }
    common::create_or_replace(client, &object).await
}

/// What the hostile objects leave behind on a real cluster, removed whatever the test's outcome
/// (the suite shares one cluster): the Services and the Lease, and the stuck namespace's
/// finalizer (the controller, still running, recreates the namespace once it is gone).
async fn clean_up(client: &Client) -> Result<()> {
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    for name in ["future", "web"] {
        let _ = services.delete(name, &DeleteParams::default()).await;
    }
    let _ = Api::<Lease>::namespaced(client.clone(), "kube-system")
        .delete("garbage-address", &DeleteParams::default())
        .await;
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .patch(
            "kube-node-lease",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
    // Gone once the finalizer is off; then made again here, as the controller that would have
    // is stopped by now (kube-apiserver's own loop would, within a minute).
    eventually("kube-node-lease finalized", CONVERGE, || async {
        Ok(match namespaces.get_opt("kube-node-lease").await? {
            None => Some(()),
            Some(ns) => ns.metadata.deletion_timestamp.is_none().then_some(()),
        })
    })
    .await?;
    let fresh = serde_json::from_value(json!({"metadata": {"name": "kube-node-lease"}}))?;
    match namespaces.create(&PostParams::default(), &fresh).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(()),
        Err(err) => Err(err.into()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_objects_are_skipped_and_every_loop_keeps_working() -> Result<()> {
    let target = Target::start().await?;
    let client = target.client().await?;
    let outcome = hostile_objects(&target, &client).await;
    if let Target::Cluster { .. } = target {
        clean_up(&client).await.context("cleaning up")?;
    }
    outcome
}

async fn hostile_objects(target: &Target, client: &Client) -> Result<()> {
    // Against a cluster, the objects only a backdoor can make are left out, and so are their
    // reports: said once, as a skip of that part.
    let sim = target.sim(
        "the objects a real apiserver refuses (invalid cluster IPs, a wrong reference, an \
         everlasting Lease, a namespace terminating for over 5 minutes) and their reports",
    );
    let range = target.service_range().await?;
    // Without the IPAddress API (nor ServiceCIDR, served alike) its hostile objects cannot be
    // made, and the ClusterIP repair audits: the other loops are still checked.
    let ip_api = target
        .serves(
            "its IPAddress and ServiceCIDR objects and the lost IPAddress",
            "networking.k8s.io/v1",
            "ipaddresses",
            "1.33",
        )
        .await?;
    let web_ip = service_ip(&range, 40)?;
    let web = service(
        "web",
        json!({"clusterIP": web_ip, "clusterIPs": [web_ip], "ports": [{"port": 80}]}),
    );
    let addresses: Api<IPAddress> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let events: Api<Event> = Api::all(client.clone());
    // Only this test's events count: a shared cluster keeps earlier tests' events.
    let earlier: BTreeSet<String> = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter_map(|e| e.metadata.uid)
        .collect();
    match sim {
        Some(sim) => {
            for object in hostile(&range)? {
                let name = object["metadata"]["name"].clone();
                sim.admin("PUT", "/sim/backdoor", Some(object))
                    .await
                    .with_context(|| format!("planting {name}"))?;
            }
            // A healthy Service whose IPAddress is lost: the repair must still recreate it.
            let web = sim.admin("PUT", "/sim/backdoor", Some(web)).await?;
            ensure!(web.contains(&web_ip), "{web}");
        }
        None => {
            let refused = refused_by_a_real_apiserver(&range)?;
            for object in hostile(&range)?
                .into_iter()
                .filter(|object| accepted_by_a_real_apiserver(&refused, object))
                .filter(|o| o["kind"] != "Namespace")
                .filter(|o| {
                    ip_api
                        || !["IPAddress", "ServiceCIDR"].contains(&o["kind"].as_str().unwrap_or(""))
                })
            {
                put(client, &object).await?;
            }
            // The stuck namespace, as a client makes one: a finalizer nobody removes, a delete.
            namespaces
                .patch(
                    "kube-node-lease",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"finalizers": ["example.com/stuck"]}})),
                )
                .await?;
            namespaces
                .delete("kube-node-lease", &DeleteParams::default())
                .await?;
            // A healthy Service whose IPAddress is lost (kube-apiserver's own IPAddress repair
            // races the controller for it here).
            put(client, &web).await?;
            if ip_api {
                addresses.delete(&web_ip, &DeleteParams::default()).await?;
            }
        }
    }

    let mut controller = ControllerProcess::start(
        target.kubeconfig(),
        &[
            "--service-cluster-ip-range",
            &range,
            "--endpoint-reconciler-type",
            "lease",
            "--advertise-address",
            ADVERTISED,
            "--leader-elect=false",
        ],
    )?;
    controller.wait_ready().await?;

    if ip_api {
        eventually("web's lost IPAddress recreated", CONVERGE, || async {
            Ok(addresses.get_opt(&web_ip).await?)
        })
        .await?;
    }
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
            Ok((listed == [ADVERTISED]).then_some(()))
        },
    )
    .await?;
    // A few more passes over the same objects; with the simulator's objects, until the ClusterIP
    // repair has reported each of them (its events are checked below).
    tokio::time::sleep(Duration::from_secs(3)).await;
    if sim.is_some() {
        // Each finding is confirmed by a live read before it is reported, one after the other:
        // wait for every one, not for the first of each reason.
        let unparented = service_ip(&range, hostile::UNPARENTED)?;
        let expected = [
            ("ClusterIPNotValid", "bad-ip"),
            ("ClusterIPNotValid", "junk-ips"),
            ("IPAddressWrongReference", "foo"),
            ("IPAddressNotAllocated", unparented.as_str()),
        ];
        eventually(
            "the ClusterIP repair's findings reported",
            CONVERGE,
            || async {
                let reported: BTreeSet<(String, String)> = events
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
                Ok(expected
                    .iter()
                    .all(|(reason, name)| {
                        reported.contains(&((*reason).to_owned(), (*name).to_owned()))
                    })
                    .then_some(()))
            },
        )
        .await?;
    }

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
    // above: the endpoints list the advertised address alone).
    let stuck = namespaces.get("kube-node-lease").await?;
    ensure!(
        stuck.metadata.deletion_timestamp.is_some(),
        "the Terminating namespace was replaced: {stuck:?}"
    );
    let log = controller.log();
    let events: Vec<(String, String)> = events
        .list(&Default::default())
        .await?
        .items
        .into_iter()
        .filter(|e| {
            e.metadata
                .uid
                .as_ref()
                .is_none_or(|uid| !earlier.contains(uid))
        })
        .map(|e| {
            (
                e.reason.unwrap_or_default(),
                e.regarding.and_then(|r| r.name).unwrap_or_default(),
            )
        })
        .collect();
    // Replacing 10,000 stale addresses is one event, not 10,000.
    let left = events.iter().filter(|(r, _)| r == "MemberLeft").count();
    ensure!(left == 1, "{left} MemberLeft events for one replacement");
    ensure!(log.contains("Lease garbage-address has a non-IP"), "{log}");
    ensure!(!log.contains("panicked"), "{log}");
    if sim.is_none() {
        return Ok(());
    }
    let unparented = service_ip(&range, hostile::UNPARENTED)?;
    // The objects only the simulator's backdoor can make (a real apiserver refuses them) are
    // each reported (upstream's events for the ClusterIP repair's findings).
    for (reason, regarding) in [
        ("ClusterIPNotValid", "bad-ip"),
        ("ClusterIPNotValid", "junk-ips"),
        ("IPAddressWrongReference", "foo"),
        ("IPAddressNotAllocated", unparented.as_str()),
    ] {
        ensure!(
            events
                .iter()
                .any(|(r, name)| r == reason && name == regarding),
            "no {reason} event about {regarding}: {events:?}"
        );
    }
    ensure!(
        log.contains("Lease everlasting says it was renewed at"),
        "{log}"
    );
    // The stuck namespace is warned about (once) with what holds it: its deletionTimestamp,
    // which only the backdoor can set, is past the 5 minutes that takes.
    ensure!(
        (log.lines())
            .filter(|line| line.contains("WARN")
                && line.contains("kube-node-lease has been terminating"))
            .count()
            == 1
            && log.contains("example.com/stuck"),
        "{log}"
    );
    Ok(())
}

/// A Service's status condition without `lastTransitionTime`, as upstream's conformance test
/// patches one (`test/e2e/network/service.go`): kube-apiserver stores and serves it as `null`,
/// which k8s-openapi refuses. The Service caches read it as a Go client does: no event is lost,
/// `/readyz` stays 200, and the ClusterIP repair still recreates that Service's lost IPAddress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_condition_without_its_time_is_read_as_a_go_client_reads_it() -> Result<()> {
    let target = Target::start().await?;
    let client = target.client().await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let outcome = status_condition_without_time(&target, &client).await;
    if let Target::Cluster { .. } = target {
        let _ = services
            .delete("status-patched", &DeleteParams::default())
            .await;
    }
    outcome
}

async fn status_condition_without_time(target: &Target, client: &Client) -> Result<()> {
    let range = target.service_range().await?;
    let ip_api = target
        .serves(
            "the lost IPAddress of the Service with the odd status",
            "networking.k8s.io/v1",
            "ipaddresses",
            "1.33",
        )
        .await?;
    let ip = service_ip(&range, 41)?;
    let condition = json!({
        "type": "StatusPatched", "status": "True", "reason": "E2E",
        "message": "Set from e2e test",
    });
    let mut object = service(
        "status-patched",
        json!({"clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": 80}]}),
    );
    match target {
        // As kube-apiserver serves it: the time null.
        Target::Sim(sim) => {
            let mut served = condition.clone();
            served["lastTransitionTime"] = Value::Null;
            object["status"] = json!({"conditions": [served]});
            sim.admin("PUT", "/sim/backdoor", Some(object)).await?;
        }
        Target::Cluster { .. } => {
            if let Some(metadata) = object["metadata"].as_object_mut() {
                metadata.remove("uid");
            }
            let services: Api<Service> = Api::namespaced(client.clone(), "default");
            let created: DynamicObject = serde_json::from_value(object)?;
            let dynamic = common::api_of(client, &serde_json::to_value(&created)?).await?;
            dynamic.create(&PostParams::default(), &created).await?;
            // The answer holds the null k8s-openapi refuses, so a typed patch may fail to
            // decode it; only the API's refusal counts.
            let patched = services
                .patch_status(
                    "status-patched",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"status": {"conditions": [condition]}})),
                )
                .await;
            if let Err(kube::Error::Api(status)) = &patched {
                anyhow::bail!("the status patch was refused: {status:?}");
            }
        }
    }

    let mut controller = ControllerProcess::start(
        target.kubeconfig(),
        &["--service-cluster-ip-range", &range, "--leader-elect=false"],
    )?;
    controller.wait_ready().await?;
    if ip_api {
        let addresses: Api<IPAddress> = Api::all(client.clone());
        eventually("the Service's IPAddress", CONVERGE, || async {
            Ok(addresses.get_opt(&ip).await?)
        })
        .await?;
        addresses.delete(&ip, &DeleteParams::default()).await?;
        eventually(
            "the Service's lost IPAddress recreated",
            CONVERGE,
            || async {
                Ok(addresses
                    .get_opt(&ip)
                    .await?
                    .filter(|address| address.metadata.deletion_timestamp.is_none()))
            },
        )
        .await?;
    }
    let (status, body) = controller.admin_get("/metrics").await?;
    ensure!(status == 200, "/metrics: {status}");
    let lost: Vec<&str> = body
        .lines()
        .filter(|line| line.starts_with("bootstrap_cache_events_lost_total"))
        .filter(|line| !line.trim_end().ends_with(" 0"))
        .collect();
    ensure!(lost.is_empty(), "events lost: {lost:?}");
    let (ready, verbose) = controller.admin_get("/readyz?verbose").await?;
    ensure!(ready == 200, "/readyz {ready}:\n{verbose}");
    ensure!(controller.is_running(), "{}", controller.log());
    ensure!(
        !controller.log().contains("could not be decoded"),
        "{}",
        controller.log()
    );
    Ok(())
}

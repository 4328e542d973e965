//! The node port allocation bitmap with its real writer: a real kube-apiserver allocates node
//! ports into the real etcd (`<prefix>/ranges/servicenodeports`, its protobuf `RangeAllocation`)
//! while the controller's NodePort repair runs in etcd mode beside it. The test changes the
//! bitmap itself by compare-and-swap, with the project's codec and etcd client, as a lost write
//! or an etcd restore would leave it.
//!
//! kube-apiserver repairs this bitmap too, but every 3 minutes: what happens here within seconds
//! is the controller's doing, and its metrics and log say so. Timings are printed, not asserted
//! (2-core machines). What the controller must not write is checked too: the node port bitmap
//! when the controller's range is not kube-apiserver's, and the legacy ClusterIP bitmap that
//! kube-apiserver 1.37 no longer uses.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::control_plane::{ControlPlane, OwnControlPlane, own_control_plane};
use common::node_port_bitmap::NodePortBitmap;
use common::{
    CONVERGE, ConfigFile, ControllerProcess, client_from, eventually, kubectl, run_controller,
};
use k8s_openapi::api::core::v1::Service;
use kube::Api;

/// A control plane of `test`'s own, one at a time; `None` under the shared control plane.
async fn own(test: &str, apiservers: usize) -> Result<Option<OwnControlPlane>> {
    own_control_plane("real_allocations", test, apiservers).await
}

/// The repairs' interval in these tests, and how far apart sightings of a leak count.
const INTERVAL: Duration = Duration::from_secs(2);

/// `kubectl create service nodeport NAME --node-port PORT` through the real apiserver.
fn create_node_port_service(
    kubeconfig: &std::path::Path,
    name: &str,
    port: u16,
) -> Result<std::process::Output> {
    kubectl(
        kubeconfig,
        &[
            "create",
            "service",
            "nodeport",
            name,
            "--tcp=80:80",
            &format!("--node-port={port}"),
        ],
    )
}

fn succeeded(output: &std::process::Output, what: &str) -> Result<()> {
    ensure!(
        output.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(())
}

/// `bootstrap_nodeport_repair_port_errors_total{type=...}`.
async fn port_errors(controller: &ControllerProcess, kind: &str) -> Result<u64> {
    let (_, metrics) = controller.admin_get("/metrics").await?;
    let prefix = format!("bootstrap_nodeport_repair_port_errors_total{{type=\"{kind}\"}} ");
    Ok(metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|count| count.trim().parse().ok())
        .unwrap_or(0))
}

/// `port_errors` once it reaches `want` (the metric is counted just after the etcd write a test
/// sees), or as it is after a few seconds.
async fn counted(controller: &ControllerProcess, kind: &str, want: u64) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let count = port_errors(controller, kind).await?;
        if count >= want || Instant::now() > deadline {
            return Ok(count);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The admin's kubeconfig and the node port bitmap, once the admin created the Service `live`
/// on node port 30100 (kube-apiserver's allocator sets its bit).
fn live_service_on_30100(cp: &ControlPlane) -> Result<(PathBuf, NodePortBitmap)> {
    let admin = cp.admin_kubeconfig(1);
    let bitmap = NodePortBitmap::new(cp.etcd_url()?, cp.etcd_prefix()?);
    succeeded(
        &create_node_port_service(&admin, "live", 30100)?,
        "creating live",
    )?;
    Ok((admin, bitmap))
}

/// The controller in etcd mode with `config` and no leader election, once ready.
async fn etcd_mode_controller(
    kubeconfig: &Path,
    config: &ConfigFile,
    etcd_url: &str,
) -> Result<ControllerProcess> {
    let mut controller = ControllerProcess::start(
        kubeconfig,
        &[
            "--config",
            &config.path,
            "--etcd-servers",
            etcd_url,
            "--leader-elect=false",
        ],
    )?;
    controller.wait_ready().await?;
    Ok(controller)
}

/// The fresh LISTs of Services (no watch) the controller's user made, from the audit log.
fn service_lists(cp: &ControlPlane, user: &str) -> Result<usize> {
    Ok(cp
        .audit_events_of(user)?
        .iter()
        .filter(|event| {
            event["verb"] == "list"
                && event["objectRef"]["resource"] == "services"
                && event["stage"] == "ResponseComplete"
        })
        .count())
}

/// A live port's bit cleared in etcd is set again by the controller, after which the real
/// apiserver refuses the port to a new Service; a leaked bit is kept through its first two
/// sightings (the real apiserver still refuses the port) and released on the third, an interval
/// apart each and after a fresh list of the Services, after which the real apiserver hands the
/// port out.
#[tokio::test(flavor = "multi_thread")]
async fn node_port_bitmap_repaired_beside_the_real_allocator() -> Result<()> {
    let test = "node_port_bitmap_repaired_beside_the_real_allocator";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    // The real allocator writes the bitmap.
    let (admin, bitmap) = live_service_on_30100(&cp)?;
    let services: Api<Service> = Api::namespaced(client_from(&admin).await?, "default");
    ensure!(
        bitmap.contains(30100).await?,
        "kube-apiserver did not set 30100 in {}",
        bitmap.key
    );

    // The control: with no repair running, a cleared bit is all the real allocator goes by, and
    // it hands a live Service's port to a second one. Deleting that duplicate releases the bit
    // again: the live Service holds a port the bitmap has lost.
    bitmap.set(30100, false).await?;
    succeeded(
        &create_node_port_service(&admin, "duplicate", 30100)?,
        "the real apiserver should hand out a port whose bit is cleared",
    )?;
    services.delete("duplicate", &Default::default()).await?;
    eventually("the duplicate's release", CONVERGE, || async {
        Ok((!bitmap.contains(30100).await?).then_some(()))
    })
    .await?;

    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nendpointReconcilerType: none\nloops:\n  nodePortRepair:\n    interval: {}s\n    leakSightingSpacing: {}s\n",
        cp.service_range()?,
        INTERVAL.as_secs(),
        INTERVAL.as_secs()
    ))?;
    let user = "bootstrap-controller";
    let kubeconfig = cp.user_kubeconfig(user, &["system:masters"], 1)?;
    let started = Instant::now();
    let mut controller = etcd_mode_controller(&kubeconfig, &config, cp.etcd_url()?).await?;
    eventually("30100 set at start", CONVERGE, || async {
        Ok(bitmap.contains(30100).await?.then_some(()))
    })
    .await?;
    println!(
        "real allocator: the lost bit of a live port set {:.2} s after the controller started",
        started.elapsed().as_secs_f64()
    );

    // A live port's bit cleared while the controller runs: its etcd watch wakes it.
    let cleared = Instant::now();
    bitmap.set(30100, false).await?;
    eventually("30100 set again", CONVERGE, || async {
        Ok(bitmap.contains(30100).await?.then_some(()))
    })
    .await?;
    let took = cleared.elapsed();
    println!(
        "real allocator: a live port's cleared bit set again in {:.3} s",
        took.as_secs_f64()
    );
    // The count follows the write that made the bit visible: wait for it, then want it exact.
    let repairs = counted(&controller, "repair", 2).await?;
    ensure!(
        repairs == 2,
        "the controller should have counted both repairs, counted {repairs} (kube-apiserver's own \
         repair runs every 3 minutes; a count short of 2 means it, not the controller, set the \
         bit)\n{}",
        controller.log()
    );
    let refused = create_node_port_service(&admin, "thief", 30100)?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success() && stderr.contains("provided port is already allocated"),
        "the real apiserver should refuse the repaired port: {stderr}"
    );

    // A leaked bit: set for a port no Service uses.
    let lists_before = service_lists(&cp, user)?;
    let leaked = Instant::now();
    bitmap.set(31000, true).await?;
    let refused = create_node_port_service(&admin, "early", 31000)?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success() && stderr.contains("provided port is already allocated"),
        "a leaked bit holds its port until it is released: {stderr}"
    );
    let last_seen_set = std::cell::Cell::new(Duration::ZERO);
    eventually("the leaked 31000 released", CONVERGE, || async {
        if bitmap.contains(31000).await? {
            last_seen_set.set(leaked.elapsed());
            return Ok(None);
        }
        Ok(Some(()))
    })
    .await?;
    let released_after = leaked.elapsed();
    let seen_set_after = last_seen_set.get();
    println!(
        "real allocator: a leaked bit released {:.2} s after it was set (still set at {:.2} s; \
         three sightings {} s apart need at least {} s)",
        released_after.as_secs_f64(),
        seen_set_after.as_secs_f64(),
        INTERVAL.as_secs(),
        2 * INTERVAL.as_secs()
    );
    // The first sighting comes at the earliest when the bit is set, the third at least two
    // intervals later: the bit cannot be seen cleared before that.
    ensure!(
        released_after >= 2 * INTERVAL,
        "the leak was released before its third sighting ({released_after:?} after it was \
         made)\n{}",
        controller.log()
    );
    let leaks = counted(&controller, "leak", 1).await?;
    ensure!(
        leaks == 1,
        "the controller should have counted the leak it released, counted {leaks}\n{}",
        controller.log()
    );
    ensure!(
        service_lists(&cp, user)? > lists_before,
        "no fresh list of the Services confirmed the leak before its release"
    );
    let log = controller.log();
    ensure!(
        log.contains("31000 may have leaked") && log.contains("31000 appears to have leaked"),
        "the log should flag then release 31000:\n{log}"
    );
    succeeded(
        &create_node_port_service(&admin, "late", 31000)?,
        "the real apiserver should hand out the released port",
    )?;
    ensure!(
        bitmap.contains(31000).await?,
        "the new Service's port is set"
    );
    ensure!(bitmap.contains(30100).await?, "the live port stays set");
    ensure!(controller.is_running(), "{}", controller.log());
    Ok(())
}

/// `bootstrap_loop_passes_total{loop=..., result="success"}`.
async fn successful_passes(controller: &ControllerProcess, loop_name: &str) -> Result<u64> {
    let (_, metrics) = controller.admin_get("/metrics").await?;
    let name = format!("loop=\"{loop_name}\"");
    Ok(metrics
        .lines()
        .filter(|line| {
            line.starts_with("bootstrap_loop_passes_total{")
                && line.contains(&name)
                && line.contains("result=\"success\"")
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

/// The events in `default` with `reason`, as `(type, involved object, message)`.
fn events_of(kubeconfig: &std::path::Path, reason: &str) -> Result<Vec<(String, String, String)>> {
    let output = kubectl(
        kubeconfig,
        &["get", "events", "-n", "default", "-o", "json"],
    )?;
    succeeded(&output, "listing events")?;
    let list: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    Ok(list["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|event| event["reason"] == reason)
        .map(|event| {
            let text = |value: &serde_json::Value| value.as_str().unwrap_or_default().to_owned();
            (
                text(&event["type"]),
                format!(
                    "{}/{}/{}",
                    text(&event["involvedObject"]["kind"]),
                    text(&event["involvedObject"]["namespace"]),
                    text(&event["involvedObject"]["name"])
                ),
                text(&event["message"]),
            )
        })
        .collect())
}

/// The controller believes the node port range is 20000-22767 (a management cluster's guess
/// for a tenant, a flag not updated with the apiserver's); the real kube-apiserver's is the
/// default 30000-32767 and its bitmap is stored under it. The mismatch is reported once (a
/// Warning event on the `kubernetes` Service naming both ranges, the metric, `check`) and the
/// bitmap is never written: kube-apiserver keeps allocating node ports, and its live port stays
/// allocated.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_port_range_mismatch_is_reported_and_the_bitmap_left_alone() -> Result<()> {
    let test = "a_node_port_range_mismatch_is_reported_and_the_bitmap_left_alone";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    let (admin, bitmap) = live_service_on_30100(&cp)?;
    // `read` checks the stored range is kube-apiserver's 30000-32767.
    let (ports, _, revision) = bitmap.read().await?;
    ensure!(ports.contains(&30100), "kube-apiserver did not set 30100");

    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nserviceNodePortRange: 20000-22767\nendpointReconcilerType: none\nloops:\n  nodePortRepair:\n    interval: {}s\n    leakSightingSpacing: {}s\n",
        cp.service_range()?,
        INTERVAL.as_secs(),
        INTERVAL.as_secs()
    ))?;
    let kubeconfig = cp.user_kubeconfig("bootstrap-controller", &["system:masters"], 1)?;
    let etcd_url = cp.etcd_url()?;
    let mut controller = etcd_mode_controller(&kubeconfig, &config, etcd_url).await?;
    // Three passes an interval apart, after the first: nothing written.
    let passes = successful_passes(&controller, "nodeport-repair").await?;
    eventually("three more passes", CONVERGE, || async {
        Ok((successful_passes(&controller, "nodeport-repair").await? >= passes + 3).then_some(()))
    })
    .await?;
    let (range, now) = stored_range(&cp, &bitmap.key).await?;
    ensure!(
        now == revision,
        "the bitmap was written (now under {range:?})\n{}",
        controller.log()
    );

    // Reported once: the event on the kubernetes Service naming both ranges, the metric.
    let reported = eventually("the NodePortRangeMismatch event", CONVERGE, || async {
        let events = events_of(&admin, "NodePortRangeMismatch")?;
        Ok((!events.is_empty()).then_some(events))
    })
    .await?;
    let (type_, regarding, message) = &reported[0];
    ensure!(
        type_ == "Warning" && regarding == "Service/default/kubernetes",
        "{reported:?}"
    );
    ensure!(
        message.contains("20000-22767")
            && message.contains("30000-32767")
            && message.contains(&bitmap.key),
        "the event should name the key and both ranges: {message}"
    );
    ensure!(
        port_errors(&controller, "rangeMismatch").await? == 1
            && port_errors(&controller, "repair").await? == 0,
        "the mismatch should be counted once, and nothing repaired"
    );

    // kube-apiserver's allocator still works: a new node port is handed out and set, under its
    // range, and the controller leaves that write alone too.
    let created = kubectl(
        &admin,
        &["create", "service", "nodeport", "next", "--tcp=80:80"],
    )?;
    succeeded(&created, "kube-apiserver should still hand out node ports")?;
    let next: Service = services_api(&admin).await?.get("next").await?;
    let port = next
        .spec
        .and_then(|spec| spec.ports)
        .and_then(|ports| ports.first().and_then(|port| port.node_port))
        .context("the new Service has no node port")?;
    let port = u16::try_from(port)?;
    ensure!(bitmap.contains(port).await?, "{port} not set");
    let after_create = bitmap.revision().await?;
    let passes = successful_passes(&controller, "nodeport-repair").await?;
    eventually("two more passes", CONVERGE, || async {
        Ok((successful_passes(&controller, "nodeport-repair").await? >= passes + 2).then_some(()))
    })
    .await?;
    ensure!(
        bitmap.revision().await? == after_create,
        "the bitmap was written\n{}",
        controller.log()
    );
    let (ports, _, _) = bitmap.read().await?;
    ensure!(ports.contains(&30100) && ports.contains(&port), "{ports:?}");
    ensure!(
        events_of(&admin, "NodePortRangeMismatch")?.len() == 1,
        "the mismatch should be reported in one event"
    );
    ensure!(controller.is_running(), "{}", controller.log());
    controller.terminate()?;

    // `check` lists it: exit 1, the drift naming both ranges.
    let check = run_controller(&[
        "--config",
        &config.path,
        "--etcd-servers",
        etcd_url,
        "check",
        "--kubeconfig",
        &kubeconfig.to_string_lossy(),
    ])?;
    let stdout = String::from_utf8_lossy(&check.stdout);
    ensure!(
        check.status.code() == Some(1),
        "check should exit 1: {check:?}"
    );
    ensure!(
        stdout.contains("nodeport_range_mismatch")
            && stdout.contains("20000-22767")
            && stdout.contains("30000-32767"),
        "check should list the mismatch:\n{stdout}"
    );
    ensure!(
        bitmap.revision().await? == after_create,
        "check wrote the bitmap"
    );
    Ok(())
}

/// The range `key` is stored under, whatever it is, and its revision.
async fn stored_range(cp: &ControlPlane, key: &str) -> Result<(String, i64)> {
    use reconcilers::legacy_alloc::codec::RangeAllocation;
    use reconcilers::legacy_alloc::etcd::{EtcdConfig, EtcdStore};
    let store = EtcdStore::new(EtcdConfig {
        servers: vec![cp.etcd_url()?.to_owned()],
        prefix: cp.etcd_prefix()?.to_owned(),
        ..EtcdConfig::default()
    });
    let stored = store
        .get(key)
        .await?
        .with_context(|| format!("{key} is gone"))?;
    Ok((
        RangeAllocation::decode(&stored.value)?.range,
        stored.mod_revision,
    ))
}

async fn services_api(kubeconfig: &std::path::Path) -> Result<Api<Service>> {
    Ok(Api::namespaced(client_from(kubeconfig).await?, "default"))
}

/// Kubernetes 1.37 allocates cluster IPs with IPAddress objects only: it neither creates,
/// reads nor writes `<prefix>/ranges/serviceips`, which a cluster upgraded from before 1.33
/// keeps in etcd. Such a key, left as the upgrade left it, is not touched by etcd mode: a new
/// Service's IP is not set in it and no `ClusterIPNotAllocated` is sent.
#[tokio::test(flavor = "multi_thread")]
async fn the_legacy_cluster_ip_bitmap_of_an_upgraded_cluster_is_left_alone() -> Result<()> {
    use reconcilers::legacy_alloc::codec::RangeAllocation;
    use reconcilers::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};
    let test = "the_legacy_cluster_ip_bitmap_of_an_upgraded_cluster_is_left_alone";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    let admin = cp.admin_kubeconfig(1);
    let etcd = EtcdConfig {
        servers: vec![cp.etcd_url()?.to_owned()],
        prefix: cp.etcd_prefix()?.to_owned(),
        ..EtcdConfig::default()
    };
    let key = etcd.key(RangeKey::ServiceIps);
    let store = EtcdStore::new(etcd);
    ensure!(
        store.get(&key).await?.is_none(),
        "kube-apiserver 1.37 should keep no {key}"
    );
    // As an upgrade leaves it: the range, and the bits of the IPs allocated before (none here).
    let left = RangeAllocation::new(cp.service_range()?.to_owned(), Vec::new()).encode();
    ensure!(
        store.compare_and_swap(&key, None, left).await?,
        "{key} exists"
    );
    let revision = store.get(&key).await?.context("written")?.mod_revision;

    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nendpointReconcilerType: none\nloops:\n  clusterIPRepair:\n    interval: {}s\n    leakSightingSpacing: {}s\n",
        cp.service_range()?,
        INTERVAL.as_secs(),
        INTERVAL.as_secs()
    ))?;
    let kubeconfig = cp.user_kubeconfig("bootstrap-controller", &["system:masters"], 1)?;
    let mut controller = etcd_mode_controller(&kubeconfig, &config, cp.etcd_url()?).await?;
    succeeded(
        &kubectl(
            &admin,
            &["create", "service", "clusterip", "web", "--tcp=80:80"],
        )?,
        "creating web",
    )?;
    // The Service wakes the repair; two more passes an interval apart see it for sure.
    let passes = successful_passes(&controller, "clusterip-repair").await?;
    eventually("two more ClusterIP repair passes", CONVERGE, || async {
        Ok((successful_passes(&controller, "clusterip-repair").await? >= passes + 2).then_some(()))
    })
    .await?;
    let now = store.get(&key).await?.context("the key is gone")?;
    ensure!(
        now.mod_revision == revision,
        "{key} was written (revision {revision} -> {})\n{}",
        now.mod_revision,
        controller.log()
    );
    ensure!(
        events_of(&admin, "ClusterIPNotAllocated")?.is_empty(),
        "ClusterIPNotAllocated sent for a bitmap nobody uses"
    );
    let log = controller.log();
    ensure!(
        log.contains("legacy ClusterIP bitmaps in etcd are left alone"),
        "the log should say why the bitmap is left alone:\n{log}"
    );
    ensure!(controller.is_running(), "{log}");
    Ok(())
}

//! The node port allocation bitmap with its real writer: a real kube-apiserver allocates node
//! ports into the real etcd (`<prefix>/ranges/servicenodeports`, its protobuf `RangeAllocation`)
//! while the controller's NodePort repair runs in etcd mode beside it. The test changes the
//! bitmap itself by compare-and-swap, with the project's codec and etcd client, as a lost write
//! or an etcd restore would leave it.
//!
//! kube-apiserver repairs this bitmap too, but every 3 minutes: what happens here within seconds
//! is the controller's doing, and its metrics and log say so. Timings are printed, not asserted
//! (2-core machines).

mod common;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::control_plane::{ControlPlane, skipped_under_shared_control_plane};
use common::node_port_bitmap::NodePortBitmap;
use common::{CONVERGE, ConfigFile, ControllerProcess, client_from, eventually, kubectl};
use k8s_openapi::api::core::v1::Service;
use kube::Api;

/// One control plane at a time: each is three processes that want a core.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The NodePort repair's interval in these tests: sightings of a leak are this far apart.
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
    if skipped_under_shared_control_plane(
        "real_allocations",
        "node_port_bitmap_repaired_beside_the_real_allocator",
    ) {
        return Ok(());
    }
    let _one = ONE_AT_A_TIME.lock().await;
    let cp = ControlPlane::start(1)?;
    let admin = cp.admin_kubeconfig(1);
    let bitmap = NodePortBitmap::new(cp.etcd_url()?, cp.etcd_prefix()?);
    let services: Api<Service> = Api::namespaced(client_from(&admin).await?, "default");

    // The real allocator writes the bitmap.
    succeeded(
        &create_node_port_service(&admin, "live", 30100)?,
        "creating live",
    )?;
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
        "serviceClusterIPRange: {}\nendpointReconcilerType: none\nloops:\n  nodePortRepair:\n    interval: {}s\n",
        cp.service_range()?,
        INTERVAL.as_secs()
    ))?;
    let user = "bootstrap-controller";
    let kubeconfig = cp.user_kubeconfig(user, &["system:masters"], 1)?;
    let started = Instant::now();
    let mut controller = ControllerProcess::start(
        &kubeconfig,
        &[
            "--config",
            &config.path,
            "--etcd-servers",
            cp.etcd_url()?,
            "--leader-elect=false",
        ],
    )?;
    controller.wait_ready().await?;
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

//! End to end, on the real control plane only (`e2e/control-plane/test.sh --test no_fight`):
//! beside upstream's own loops that still run where the controller runs too (kube-apiserver's
//! IPAddress repair, system namespaces, default ServiceCIDR and `kubernetes` Service loops, and
//! kube-controller-manager's service-CIDRs controller, which keeps the ServiceCIDRs' Ready
//! condition too), they never undo each other. The objects both keep are damaged a few times,
//! and every write to them is read from the apiserver's audit log: after each damage, the writes
//! by the controller and by upstream's loops to one object must not go back and forth
//! (controller, then upstream, then controller again, or the other way round).
//!
//! None of upstream's repair intervals has a flag (`pkg/controlplane/instance.go`:
//! `repairLoopInterval` 3m, `DefaultEndpointReconcilerInterval` 10s; the system namespaces loop
//! 1m and the default ServiceCIDR loop 10s are constants), so the test counts over the real
//! ones that fit in the window ([`window`]): at least fifteen of the ServiceCIDR and `kubernetes`
//! Service loops and two of the system namespaces loop. The IPAddress repair answers each
//! deletion at once (its informer) and walks every Service and IPAddress again on its 3-minute
//! resync: where the IPAddress API is served the window holds, wherever kube-apiserver's timer
//! stands, a resync after the controller has answered a damage, and time for the controller to
//! answer that resync, so a resync that would take back the controller's answers shows in the
//! log as a fight. The controller's own intervals are shortened, so that it meets
//! kube-apiserver's loops as often as they run.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::control_plane::describe;
use common::{CONVERGE, ConfigFile, ControllerProcess, Target, eventually, service_ip, skip};
use k8s_openapi::api::core::v1::{Namespace, Service};
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

/// kube-apiserver's IPAddress repair resync (`repairLoopInterval`, `pkg/controlplane/instance.go`).
const IPADDRESS_RESYNC: Duration = Duration::from_secs(180);

/// How long the writes are counted: every damage, and the loops' answers to it. Where the
/// IPAddress repair runs, one resync and a margin: its timer started with kube-apiserver, not
/// with the test, so a resync falls either after the first damage was answered (the controller
/// answers a deleted IPAddress within seconds, from its watch) or within that first margin, and
/// then again one resync later, after every damage was answered and still inside the window.
/// Either way a resync meets the controller's answers, and the margin leaves the controller time
/// to answer the resync in turn.
fn window(ip_api: bool) -> Duration {
    if ip_api {
        IPADDRESS_RESYNC + Duration::from_secs(45)
    } else {
        Duration::from_secs(150)
    }
}

/// Who wrote: the controller (its user agent), upstream's own loops (kube-apiserver's, as
/// `system:apiserver`; kube-controller-manager's, as `system:kube-controller-manager` or, with
/// `--use-service-account-credentials` as up.sh and kubeadm run it, as each controller's service
/// account in `kube-system`), or anyone else (the test's damage). kube-controller-manager's
/// writes to a namespace finish the test's deletion of it (the namespace controller's
/// finalization): they are part of the damage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Writer {
    Controller,
    Upstream,
    Other,
}

fn writer(event: &Value) -> Writer {
    let user = event["user"]["username"].as_str().unwrap_or_default();
    if event["userAgent"]
        .as_str()
        .is_some_and(|agent| agent.starts_with("bootstrap-controller/"))
    {
        Writer::Controller
    } else if user == "system:apiserver"
        || ((user == "system:kube-controller-manager"
            || user.starts_with("system:serviceaccount:kube-system:"))
            && event["objectRef"]["resource"] != "namespaces")
    {
        Writer::Upstream
    } else {
        Writer::Other
    }
}

/// The objects both sides keep.
const CONTESTED: [&str; 4] = ["namespaces", "services", "servicecidrs", "ipaddresses"];

/// The successful writes to contested objects among `events`, by object (`resource[/sub]
/// ns/name`), each with its writer and description, in the log's order.
fn writes_by_object(events: &[Value]) -> BTreeMap<String, Vec<(Writer, String)>> {
    let mut by_object: BTreeMap<String, Vec<(Writer, String)>> = BTreeMap::new();
    for event in common::control_plane::writes(events) {
        let object = &event["objectRef"];
        let resource = object["resource"].as_str().unwrap_or_default();
        let succeeded = event["responseStatus"]["code"]
            .as_u64()
            .is_some_and(|code| code < 300);
        if !succeeded || !CONTESTED.contains(&resource) {
            continue;
        }
        // A status write is a write to the same object: a fight can be over either.
        // A namespace's own requests name it as their namespace too.
        let namespace = match resource {
            "namespaces" => "",
            _ => object["namespace"].as_str().unwrap_or_default(),
        };
        let key = format!(
            "{resource} {namespace}/{}",
            object["name"].as_str().unwrap_or_default()
        );
        by_object.entry(key).or_default().push((
            writer(event),
            format!("{:?}: {}", writer(event), describe(event)),
        ));
    }
    by_object
}

/// The objects written back and forth: after a write by anyone else (a damage), the
/// controller's and upstream's writes alternate more than once (A, B, A).
fn fights(by_object: &BTreeMap<String, Vec<(Writer, String)>>) -> Vec<String> {
    let mut found = Vec::new();
    for (object, writes) in by_object {
        let mut run: Vec<Writer> = Vec::new();
        for (who, _) in writes {
            match who {
                Writer::Other => run.clear(),
                who if run.last() != Some(who) => run.push(*who),
                _ => {}
            }
            if run.len() >= 3 {
                let history: Vec<&str> = writes.iter().take(12).map(|(_, d)| d.as_str()).collect();
                found.push(format!("{object}:\n    {}", history.join("\n    ")));
                break;
            }
        }
    }
    found
}

#[test]
fn alternating_writers_are_a_fight_and_a_race_is_not() {
    let event = |agent: &str, user: &str| {
        json!({"verb": "update", "userAgent": agent, "user": {"username": user},
               "objectRef": {"resource": "servicecidrs", "name": "kubernetes"},
               "responseStatus": {"code": 200}})
    };
    let ours = event("bootstrap-controller/0.1.0", "admin");
    let theirs = event("kube-apiserver/v1.37.2", "system:apiserver");
    let damage = event("kubectl", "admin");
    let race = [
        damage.clone(),
        ours.clone(),
        theirs.clone(),
        damage,
        theirs.clone(),
    ];
    assert!(fights(&writes_by_object(&race)).is_empty());
    let fight = [ours.clone(), theirs, ours.clone()];
    assert_eq!(fights(&writes_by_object(&fight)).len(), 1);
    // kube-controller-manager keeps ServiceCIDRs too; its namespace writes finish a deletion.
    let controller_manager = event(
        "kube-controller-manager/v1.37.2",
        "system:kube-controller-manager",
    );
    let fight = [ours.clone(), controller_manager.clone(), ours.clone()];
    assert_eq!(fights(&writes_by_object(&fight)).len(), 1);
    let service_cidrs_controller = event(
        "kube-controller-manager/v1.37.2",
        "system:serviceaccount:kube-system:service-cidrs-controller",
    );
    assert_eq!(writer(&service_cidrs_controller), Writer::Upstream);
    let mut finalize = controller_manager;
    finalize["objectRef"] = json!({"resource": "namespaces", "name": "kube-node-lease"});
    assert_eq!(writer(&finalize), Writer::Other);
}

/// The audit log of the control plane `kubeconfig` belongs to (`up.sh` writes both in one
/// directory), if there is one.
fn audit_log(kubeconfig: &std::path::Path) -> Option<PathBuf> {
    let log = kubeconfig.parent()?.join("audit-1.log");
    log.exists().then_some(log)
}

fn audit_events(log: &std::path::Path) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(log).with_context(|| format!("{}", log.display()))?;
    // kube-apiserver appends while this reads: a last line without its newline is not whole yet.
    let complete = text.rfind('\n').map_or("", |end| &text[..end]);
    complete
        .lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).context("audit line"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_and_kube_apiservers_own_repairs_never_undo_each_other() -> Result<()> {
    if std::env::var_os("BOOTSTRAP_E2E_KUBECONFIG").is_none() {
        skip(
            "the whole test: needs upstream's own repair loops and the audit log; \
             `e2e/control-plane/test.sh --test no_fight` runs it",
        );
        return Ok(());
    }
    let target = Target::start().await?;
    let Some(log) = audit_log(target.kubeconfig()) else {
        skip(
            "the whole test: needs the audit log e2e/control-plane/up.sh writes beside its kubeconfig",
        );
        return Ok(());
    };
    let client = target.client().await?;
    let outcome = no_fight(&target, &client, &log).await;
    let _ = Api::<Service>::namespaced(client.clone(), "default")
        .delete("no-fight", &DeleteParams::default())
        .await;
    outcome
}

async fn no_fight(target: &Target, client: &Client, log: &std::path::Path) -> Result<()> {
    let range = target.service_range().await?;
    let ip_api = target
        .serves(
            "the IPAddress repair's part",
            "networking.k8s.io/v1",
            "ipaddresses",
            "1.33",
        )
        .await?;
    let config = ConfigFile::new(
        "loops:\n  systemNamespaces:\n    interval: 5s\n  kubernetesService:\n    interval: 2s\n  serviceCIDR:\n    interval: 2s\n  clusterIPRepair:\n    interval: 10s\n  nodePortRepair:\n    interval: 10s\n",
    )?;
    let ip = service_ip(&range, 60)?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let service = serde_json::from_value(json!({
        "metadata": {"name": "no-fight", "namespace": "default"},
        "spec": {"clusterIP": ip, "clusterIPs": [ip], "ports": [{"port": 80}]},
    }))?;
    match services.create(&PostParams::default(), &service).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(err) => return Err(err.into()),
    }
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
            "192.0.2.1",
            "--leader-elect=false",
        ],
    )?;
    controller.wait_ready().await?;
    // Converged: the first passes have written what they write.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before = audit_events(log)?.len();
    let started = tokio::time::Instant::now();
    // Judged even when a damage was not answered: a fight may be why.
    let window = window(ip_api);
    // Three damages spread over the window, the last well before its end.
    let spacing = window / 3 - Duration::from_secs(10);
    let damaged = damage(client, &ip, ip_api, spacing).await;
    if let Some(rest) = window.checked_sub(started.elapsed()) {
        tokio::time::sleep(rest).await;
    }

    let events = audit_events(log)?;
    let during = &events[before..];
    let by_object = writes_by_object(during);
    let count = |who: Writer| {
        by_object
            .values()
            .flatten()
            .filter(|(w, _)| *w == who)
            .count()
    };
    println!(
        "no fight, {} s beside upstream's loops ({} of the IPAddress repair's resyncs at least): {} writes to shared objects by the controller, {} by upstream's loops, {} by others (the damages)",
        started.elapsed().as_secs(),
        if ip_api {
            started.elapsed().as_secs() / IPADDRESS_RESYNC.as_secs()
        } else {
            0
        },
        count(Writer::Controller),
        count(Writer::Upstream),
        count(Writer::Other),
    );
    for (object, writes) in &by_object {
        let by = |who: Writer| writes.iter().filter(|(w, _)| *w == who).count();
        println!(
            "  {object}: controller {}, upstream {}, others {}",
            by(Writer::Controller),
            by(Writer::Upstream),
            by(Writer::Other)
        );
    }
    let fought = fights(&by_object);
    ensure!(
        fought.is_empty(),
        "written back and forth by the controller and kube-apiserver:\n{}",
        fought.join("\n")
    );
    let renewals = common::control_plane::writes(during)
        .into_iter()
        .filter(|event| writer(event) == Writer::Controller)
        .filter(|event| event["objectRef"]["resource"] == "leases")
        .count();
    ensure!(
        renewals > 0,
        "no write by the controller at all: was it running?"
    );
    ensure!(
        count(Writer::Controller) + count(Writer::Upstream) > 0,
        "nobody answered the damages"
    );
    damaged?;
    ensure!(controller.is_running(), "{}", controller.log());
    controller.terminate()?;
    if ip_api {
        apiservers_loop_runs(client, log).await?;
    }
    Ok(())
}

/// The damages, `spacing` apart: no-fight's IPAddress deleted and the default ServiceCIDR's Ready
/// condition removed three times, `kube-node-lease` deleted once.
async fn damage(client: &Client, ip: &str, ip_api: bool, spacing: Duration) -> Result<()> {
    let addresses: Api<IPAddress> = Api::all(client.clone());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for round in 0..3 {
        if ip_api {
            eventually("no-fight's IPAddress", CONVERGE, || async {
                Ok(addresses.get_opt(ip).await?)
            })
            .await?;
            addresses.delete(ip, &DeleteParams::default()).await?;
            let cidr = common::api_of(
                client,
                &json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                        "metadata": {"name": "kubernetes"}}),
            )
            .await?;
            cidr.patch_status(
                "kubernetes",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"conditions": []}})),
            )
            .await
            .context("removing the default ServiceCIDR's Ready condition")?;
        }
        if round == 0 {
            // Finalized by the namespace controller, then made again by one of the two.
            namespaces
                .delete("kube-node-lease", &DeleteParams::default())
                .await?;
        }
        tokio::time::sleep(spacing).await;
    }
    eventually("kube-node-lease made again", CONVERGE * 4, || async {
        Ok(namespaces
            .get_opt("kube-node-lease")
            .await?
            .filter(|ns| ns.metadata.deletion_timestamp.is_none()))
    })
    .await?;

    Ok(())
}

/// Upstream's own loops ran beside the controller: with the controller stopped, the default
/// ServiceCIDR's Ready condition, removed, is set again by kube-apiserver (its loop runs every
/// 10 s) or kube-controller-manager (its service-CIDRs controller answers the change), whichever
/// comes first, as the audit log shows.
async fn apiservers_loop_runs(client: &Client, log: &std::path::Path) -> Result<()> {
    let before = audit_events(log)?.len();
    let cidr = common::api_of(
        client,
        &json!({"apiVersion": "networking.k8s.io/v1", "kind": "ServiceCIDR",
                "metadata": {"name": "kubernetes"}}),
    )
    .await?;
    cidr.patch_status(
        "kubernetes",
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"conditions": []}})),
    )
    .await?;
    eventually(
        "upstream's Ready=True on the default ServiceCIDR",
        CONVERGE,
        || async {
            let events = audit_events(log)?;
            Ok(writes_by_object(&events[before..])
                .get("servicecidrs /kubernetes")
                .is_some_and(|writes| writes.iter().any(|(w, _)| *w == Writer::Upstream))
                .then_some(()))
        },
    )
    .await?;
    Ok(())
}

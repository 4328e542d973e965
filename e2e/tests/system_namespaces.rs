//! End to end: the system-namespaces loop, the `check` subcommand and configuration errors,
//! with the real `bootstrap-controller` binary against a real `apiserver-sim` process.

mod common;

use std::time::Duration;

use anyhow::{Result, ensure};
use common::{CONVERGE, ControllerProcess, Target, eventually, kubectl, managers, run_controller};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::DeleteParams;

const SYSTEM: [&str; 4] = ["kube-system", "kube-public", "kube-node-lease", "default"];

/// Only the loop under test, one replica (no leader election to wait for), and the target's
/// service range, as a real deployment would match its apiserver's.
struct NamespacesOnly {
    _dir: tempfile::TempDir,
    config: String,
    /// The target's service range.
    range: String,
}

impl NamespacesOnly {
    async fn new(target: &Target) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("config.yaml");
        std::fs::write(
            &path,
            "loops:\n  kubernetesService: {enabled: false}\n  apiserverEndpoints: {enabled: false}\n  \
             serviceCIDR: {enabled: false}\n  clusterIPRepair: {enabled: false}\n",
        )?;
        Ok(Self {
            config: path.to_string_lossy().into_owned(),
            range: target.service_range().await?,
            _dir: dir,
        })
    }

    fn args<'a>(&'a self, extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "--config",
            self.config.as_str(),
            "--leader-elect=false",
            "--service-cluster-ip-range",
            self.range.as_str(),
        ];
        args.extend_from_slice(extra);
        args
    }
}

async fn all_present(api: &Api<Namespace>) -> Result<Option<()>> {
    for name in SYSTEM {
        match api.get_opt(name).await? {
            Some(ns) if ns.metadata.deletion_timestamp.is_none() => {}
            _ => return Ok(None),
        }
    }
    Ok(Some(()))
}

/// The Namespace API of `target`.
async fn namespaces_of(target: &Target) -> Result<Api<Namespace>> {
    Ok(Api::all(target.client().await?))
}

/// Waits until the four system namespaces exist and none is terminating.
async fn four_present(api: &Api<Namespace>) -> Result<()> {
    eventually("the four system namespaces", CONVERGE, || all_present(api)).await
}

/// The system namespace a test deletes: a real kube-apiserver refuses to delete `default`,
/// `kube-system` and `kube-public` (NamespaceLifecycle admission) but not `kube-node-lease`
/// (kubernetes/kubernetes#105743); the simulator allows both, as an apiserver without that
/// admission plugin or a restored etcd would, and there it is `kube-public`.
fn deletable(target: &Target) -> &'static str {
    match target {
        Target::Sim(_) => "kube-public",
        Target::Cluster { .. } => "kube-node-lease",
    }
}

/// How long a deleted system namespace may take to come back, finalization included. A bound on
/// correctness, not on speed: a real kube-apiserver recreates the four system namespaces itself,
/// once a minute, so a wait of a minute or more could be met by that in-tree loop alone. Well under
/// it, with the creator read from `managedFields` and this controller's repair counter moved, the
/// apiserver's repair cannot pass for this controller's.
const BACK_WITHIN: Duration = Duration::from_secs(30);

/// Waits until namespace `name` is live again under a uid other than `before`, and checks that
/// `controller` made it: its repair counter past `repaired_before`, and on a cluster its field
/// manager on the new object, not kube-apiserver's (the simulator has no other writer of
/// namespaces, and records `managedFields` only for server-side apply).
async fn recreated(
    target: &Target,
    api: &Api<Namespace>,
    controller: &ControllerProcess,
    name: &str,
    before: Option<String>,
    repaired_before: u64,
) -> Result<()> {
    eventually(&format!("{name} recreated"), BACK_WITHIN, || async {
        let now = live_uid(api, name).await?;
        Ok(now.filter(|uid| Some(uid) != before.as_ref()))
    })
    .await?;
    if matches!(target, Target::Cluster { .. }) {
        let managers = managers(&api.get(name).await?.metadata);
        ensure!(
            managers.iter().any(|m| m == "bootstrap-controller")
                && !managers.iter().any(|m| m == "kube-apiserver"),
            "{name} came back, but not written by this controller: its managers are {managers:?}"
        );
    }
    eventually(
        &format!("the repair of {name} counted in /metrics"),
        CONVERGE,
        || async {
            let now = controller
                .repaired("system-namespaces", "namespace_missing")
                .await?;
            Ok((now > repaired_before).then_some(()))
        },
    )
    .await
}

/// Returns the uid of a live (not terminating) namespace, if there is one.
async fn live_uid(api: &Api<Namespace>, name: &str) -> Result<Option<String>> {
    Ok(api
        .get_opt(name)
        .await?
        .filter(|ns| ns.metadata.deletion_timestamp.is_none())
        .and_then(|ns| ns.metadata.uid))
}

async fn create_system_namespaces(api: &Api<Namespace>) -> Result<()> {
    for name in SYSTEM {
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "metadata": { "name": name }
        }))?;
        match api.create(&Default::default(), &ns).await {
            Ok(_) => {}
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(err) => return Err(err.into()),
        }
    }
    Ok(())
}

#[tokio::test]
async fn creates_system_namespaces_and_heals_deletions() -> Result<()> {
    let target = Target::start().await?;
    let namespaces = namespaces_of(&target).await?;

    let only = NamespacesOnly::new(&target).await?;
    let mut controller = ControllerProcess::start(target.kubeconfig(), &only.args(&[]))?;
    controller.wait_ready().await?;
    four_present(&namespaces).await?;

    // Deleted through the kube client (the one a real kube-apiserver lets us delete).
    let victim = deletable(&target);
    let before = live_uid(&namespaces, victim).await?;
    let repaired = controller
        .repaired("system-namespaces", "namespace_missing")
        .await?;
    namespaces.delete(victim, &DeleteParams::default()).await?;
    recreated(&target, &namespaces, &controller, victim, before, repaired).await?;

    // Deleted by an independent client.
    let before = live_uid(&namespaces, "kube-node-lease").await?;
    let repaired = controller
        .repaired("system-namespaces", "namespace_missing")
        .await?;
    let out = kubectl(
        target.kubeconfig(),
        &["delete", "namespace", "kube-node-lease", "--wait=false"],
    )?;
    ensure!(out.status.success(), "kubectl delete failed: {out:?}");
    recreated(
        &target,
        &namespaces,
        &controller,
        "kube-node-lease",
        before,
        repaired,
    )
    .await?;

    // Every repair has its event, from this controller, on the namespace it made.
    let uid = live_uid(&namespaces, "kube-node-lease").await?;
    let events: Api<Event> = Api::namespaced(target.client().await?, "default");
    eventually("the repair's event", CONVERGE, || async {
        let found = events
            .list(&Default::default())
            .await?
            .items
            .into_iter()
            .any(|e| {
                e.reason.as_deref() == Some("SystemNamespaceCreated")
                    && e.reporting_controller.as_deref() == Some("bootstrap-controller")
                    && e.regarding.as_ref().and_then(|r| r.uid.clone()) == uid
            });
        Ok(found.then_some(()))
    })
    .await?;

    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    let status = controller.terminate()?;
    ensure!(
        status.success(),
        "controller exited with {status} after SIGTERM"
    );
    Ok(())
}

#[tokio::test]
async fn dry_run_reports_but_does_not_heal_and_check_names_the_drift() -> Result<()> {
    let target = Target::start().await?;
    let namespaces = namespaces_of(&target).await?;
    create_system_namespaces(&namespaces).await?;
    four_present(&namespaces).await?;
    // The one a real kube-apiserver lets us delete; kube-public on the simulator.
    let victim = deletable(&target);

    let kubeconfig = target.kubeconfig().to_string_lossy().into_owned();
    let only = NamespacesOnly::new(&target).await?;
    let check = only.args(&["check", "--kubeconfig", &kubeconfig]);
    let clean = run_controller(&check)?;
    ensure!(
        clean.status.code() == Some(0),
        "check on a clean cluster should exit 0: {clean:?}"
    );

    let mut controller = ControllerProcess::start(target.kubeconfig(), &only.args(&["--dry-run"]))?;
    controller.wait_ready().await?;
    // Nothing recreates the victim on the simulator. A real kube-apiserver's own system-namespaces
    // loop does, once a minute: when that falls into an attempt, the attempt proves nothing and is
    // made again. This controller recreating it (its field manager) is the defect looked for.
    for attempt in 1.. {
        namespaces.delete(victim, &DeleteParams::default()).await?;
        eventually(&format!("{victim} gone"), CONVERGE, || async {
            Ok(namespaces.get_opt(victim).await?.is_none().then_some(()))
        })
        .await?;
        // Long enough for the watch to wake the dry-run loop many times over.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let drift = run_controller(&check)?;
        let stdout = String::from_utf8_lossy(&drift.stdout);
        if let Some(back) = namespaces.get_opt(victim).await? {
            let managers = managers(&back.metadata);
            ensure!(
                !managers.iter().any(|m| m == "bootstrap-controller"),
                "--dry-run or check recreated {victim}: {managers:?}"
            );
            ensure!(
                matches!(target, Target::Cluster { .. }) && attempt < 3,
                "{victim} came back (managers {managers:?})"
            );
            eprintln!("attempt {attempt}: {managers:?} recreated {victim} meanwhile; again");
            continue;
        }
        ensure!(
            controller.is_running(),
            "controller died:\n{}",
            controller.log()
        );
        ensure!(
            drift.status.code() == Some(1),
            "check with drift should exit 1: {drift:?}"
        );
        ensure!(
            stdout.contains(victim),
            "check does not name the missing namespace:\n{stdout}"
        );
        break;
    }
    // A shared cluster gets its namespace back (the simulator dies with the test).
    drop(controller);
    create_system_namespaces(&namespaces).await?;
    Ok(())
}

#[tokio::test]
async fn survives_a_flaky_api_and_converges_once_it_recovers() -> Result<()> {
    let target = Target::start().await?;
    let Some(sim) = target.sim("the whole test: injected failures") else {
        return Ok(());
    };
    let namespaces = namespaces_of(&target).await?;

    let only = NamespacesOnly::new(&target).await?;
    let mut controller = ControllerProcess::start(target.kubeconfig(), &only.args(&[]))?;
    controller.wait_ready().await?;
    four_present(&namespaces).await?;

    sim.clear_requests().await?;
    sim.inject_random_failures(0.3).await?;
    // Keep the controller busy while the API fails: each deletion (through the backdoor, which
    // faults do not touch) makes it recreate the namespace, until enough injected failures have
    // hit its requests to mean something.
    eventually(
        "injected failures reaching the controller",
        CONVERGE,
        || async {
            if live_uid(&namespaces, "kube-public")
                .await
                .ok()
                .flatten()
                .is_some()
            {
                sim.admin("DELETE", "/sim/backdoor/namespaces/kube-public", None)
                    .await?;
            }
            let failed = sim
                .requests()
                .await?
                .iter()
                .filter(|r| r.user_agent.starts_with("bootstrap-controller/"))
                .filter(|r| r.status == 0 || r.status >= 500)
                .count();
            Ok((failed >= 5).then_some(()))
        },
    )
    .await?;
    ensure!(
        controller.is_running(),
        "controller exited under faults:\n{}",
        controller.log()
    );
    sim.clear_faults().await?;

    eventually("kube-public back after faults stop", CONVERGE, || async {
        Ok(live_uid(&namespaces, "kube-public").await?.map(|_| ()))
    })
    .await?;
    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    Ok(())
}

/// Each invalid configuration exits 2 before touching a cluster, naming the field at fault.
#[test]
fn invalid_configurations_exit_2_naming_the_field() -> Result<()> {
    let cases: &[(&str, &[&str], &str, &str)] = &[
        (
            "bad CIDR",
            &["--service-cluster-ip-range", "10.0.0.0/33"],
            "",
            "service-cluster-ip-range",
        ),
        (
            "two CIDRs of one family",
            &["--service-cluster-ip-range", "10.0.0.0/16,10.1.0.0/16"],
            "",
            "service-cluster-ip-range",
        ),
        (
            "inverted port range",
            &["--service-node-port-range", "32767-30000"],
            "",
            "service-node-port-range",
        ),
        (
            "zero interval",
            &[],
            "loops:\n  systemNamespaces:\n    interval: 0s\n",
            "interval",
        ),
        (
            "unknown field",
            &[],
            "loops:\n  systemNamespaces:\n    intervall: 10s\n",
            "intervall",
        ),
        (
            "invalid namespace name",
            &[],
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: Kube_Public\n",
            "Kube_Public",
        ),
    ];
    let dir = tempfile::tempdir()?;
    for (what, flags, yaml, field) in cases {
        let file = dir.path().join("config.yaml");
        std::fs::write(&file, yaml)?;
        let file = file.to_string_lossy().into_owned();
        for subcommand in [
            &["config", "validate", "--config", file.as_str()][..],
            &["run", "--config", file.as_str()][..],
        ] {
            let mut args: Vec<&str> = subcommand.to_vec();
            if subcommand[0] == "run" {
                // Nothing listens here: a config error must be reported before any connection.
                args.extend(["--kubeconfig", "/nonexistent/kubeconfig"]);
            }
            args.extend(flags.iter());
            let out = run_controller(&args)?;
            let stderr = String::from_utf8_lossy(&out.stderr);
            ensure!(
                out.status.code() == Some(2),
                "{what}: `{}` should exit 2, got {:?}\n{stderr}",
                args.join(" "),
                out.status.code()
            );
            ensure!(
                stderr.contains(field),
                "{what}: the error does not name `{field}`:\n{stderr}"
            );
        }
    }
    Ok(())
}

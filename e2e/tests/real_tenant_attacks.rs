//! Management mode against real control planes, attacked through tenant Secrets: a user whom
//! real RBAC allows only to create Secrets in the tenants' namespace tries to obtain the
//! controller's service-account token, run a program in it, read its files and reach another
//! tenant through it. The controller runs with its own service-account token (a `tokenFile`, as
//! in a pod); one legitimate tenant, a real kube-apiserver on the management cluster's etcd,
//! is kept meanwhile.
//!
//! Judged by a listener that would receive any connection, a marker file a program would
//! create, the events on the Secrets, the controller's log, `/readyz` and `/metrics`, the
//! tenant's audit log (who reached it, who wrote) and its bitmap in etcd.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use common::control_plane::{
    ControlPlane, control_plane_slot, describe, self_contained_kubeconfig,
    skipped_under_shared_control_plane, writes,
};
use common::node_port_bitmap::NodePortBitmap;
use common::{CONVERGE, ControllerProcess, client_from, eventually, kubectl};
use k8s_openapi::api::core::v1::{Secret, Service};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::PostParams;

const TENANTS_NAMESPACE: &str = "tenants";
const SELECTOR_LABEL: &str = "bootstrap-controller.io/tenant";
/// The legitimate tenant's kubeconfig user, as its audit log names it.
const TENANT_USER: &str = "tenant-admin";
/// The controller's own identity in the management cluster: the chart's ServiceAccount for a
/// release `bc` in namespace `bootstrap`.
const CONTROLLER_SA: &str = "system:serviceaccount:bootstrap:bc-bootstrap-controller";

/// The chart's management-mode RBAC for one replica (the ServiceAccount, Roles and bindings,
/// leader election off as this test runs it), rendered by the real Helm engine as
/// e2e/packaging renders it, as YAML documents.
fn chart_rbac() -> Result<String> {
    let packaging = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging");
    let script = format!(
        "import sys, yaml\n\
         sys.path.insert(0, {packaging:?})\n\
         from harness import objects\n\
         values = {{'replicaCount': 1, 'tenants': {{'enabled': True, 'namespace': '{TENANTS_NAMESPACE}', \
         'secretSelector': '{SELECTOR_LABEL}=true'}}, \
         'config': {{'leaderElection': {{'enabled': False}}}}}}\n\
         kinds = {{'ServiceAccount', 'Role', 'RoleBinding', 'ClusterRole', 'ClusterRoleBinding'}}\n\
         print(yaml.safe_dump_all([o for o in objects(values) if o['kind'] in kinds]))\n"
    );
    let output = std::process::Command::new("python3")
        .args(["-c", &script])
        .output()
        .context("python3 (with helm-python-sdk and pyyaml, as e2e/packaging needs)")?;
    ensure!(
        output.status.success(),
        "rendering the chart's RBAC: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

fn kubectl_ok(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let output = kubectl(kubeconfig, args)?;
    ensure!(
        output.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn apply(kubeconfig: &Path, dir: &Path, name: &str, yaml: &str) -> Result<()> {
    let file = dir.join(name);
    std::fs::write(&file, yaml)?;
    kubectl_ok(kubeconfig, &["apply", "-f", &file.display().to_string()]).map(drop)
}

/// A kubeconfig with one cluster and one user, their YAML bodies indented by four spaces.
fn kubeconfig(cluster: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\ncurrent-context: t\ncontexts:\n- name: t\n  context: \
         {{cluster: c, user: u}}\nclusters:\n- name: c\n  cluster:\n{cluster}users:\n- name: u\n  \
         user:\n{user}"
    )
}

/// Counts the connections made to a loopback port.
async fn listener() -> Result<(u16, Arc<AtomicUsize>)> {
    let socket = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = socket.local_addr()?.port();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = socket.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            drop(stream);
        }
    });
    Ok((port, accepted))
}

fn secret(name: &str, kubeconfig: String, fragment: Option<String>) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([(
                SELECTOR_LABEL.to_owned(),
                "true".to_owned(),
            )])),
            annotations: fragment
                .map(|f| BTreeMap::from([("bootstrap-controller.io/config".to_owned(), f)])),
            ..ObjectMeta::default()
        },
        string_data: Some(BTreeMap::from([("value".to_owned(), kubeconfig)])),
        ..Secret::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_secret_writer_cannot_take_the_controllers_token_run_read_or_reach_another_tenant()
-> Result<()> {
    if skipped_under_shared_control_plane(
        "real_tenant_attacks",
        "a_secret_writer_cannot_take_the_controllers_token_run_read_or_reach_another_tenant",
    ) {
        return Ok(());
    }
    // Held until every control plane below has stopped (dropped after them).
    let _slot = control_plane_slot().await?;
    let management = ControlPlane::start(1)?;
    let etcd_url = management.etcd_url()?.to_owned();
    let etcd_network = management.etcd_network()?;
    let tenant = ControlPlane::start_on_etcd(1, &etcd_url, "/tenant-a", &[])?;
    let admin = management.admin_kubeconfig(1);
    let work = tempfile::tempdir()?;

    // The controller's identity: the chart's ServiceAccount with the chart's RBAC.
    apply(
        &admin,
        work.path(),
        "namespaces.yaml",
        &format!(
            "apiVersion: v1\nkind: Namespace\nmetadata: {{name: bootstrap}}\n---\n\
             apiVersion: v1\nkind: Namespace\nmetadata: {{name: {TENANTS_NAMESPACE}}}\n"
        ),
    )?;
    apply(&admin, work.path(), "chart-rbac.yaml", &chart_rbac()?)?;
    apply(
        &admin,
        work.path(),
        "rbac.yaml",
        &format!(
            "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {{name: \
             secret-writer, namespace: {TENANTS_NAMESPACE}}}\nrules:\n\
             - {{apiGroups: [\"\"], resources: [secrets], verbs: [create]}}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {{name: \
             mallory, namespace: {TENANTS_NAMESPACE}}}\nroleRef: {{apiGroup: \
             rbac.authorization.k8s.io, kind: Role, name: secret-writer}}\nsubjects:\n\
             - {{apiGroup: rbac.authorization.k8s.io, kind: User, name: mallory}}\n"
        ),
    )?;
    let token = kubectl_ok(
        &admin,
        &[
            "create",
            "token",
            "bc-bootstrap-controller",
            "-n",
            "bootstrap",
            "--duration",
            "1h",
        ],
    )?;
    ensure!(token.len() > 100, "no token");
    let token_file = work.path().join("token");
    std::fs::write(&token_file, &token)?;
    let controller_kubeconfig = work.path().join("controller.kubeconfig");
    std::fs::write(
        &controller_kubeconfig,
        kubeconfig(
            &format!(
                "    server: {}\n    certificate-authority: {}\n",
                management.apiserver_url(1)?,
                management.ca_file().display()
            ),
            &format!("    tokenFile: {}\n", token_file.display()),
        ),
    )?;

    // The legitimate tenant, older than every hostile Secret: its kubeconfig, its etcd prefix.
    let admin_client = client_from(&admin).await?;
    let secrets: Api<Secret> = Api::namespaced(admin_client.clone(), TENANTS_NAMESPACE);
    let legit =
        self_contained_kubeconfig(&tenant.user_kubeconfig(TENANT_USER, &["system:masters"], 1)?)?;
    secrets
        .create(
            &PostParams::default(),
            &secret(
                "tenant-a",
                legit,
                Some(format!(
                    "etcdServers: {etcd_url}\netcdPrefix: /tenant-a\nloops:\n  nodePortRepair:\n    \
                     interval: 5s\n"
                )),
            ),
        )
        .await?;

    let mut controller = ControllerProcess::start(
        &controller_kubeconfig,
        &[
            "--tenants-secret-selector",
            &format!("{SELECTOR_LABEL}=true"),
            "--tenants-namespace",
            TENANTS_NAMESPACE,
            "--leader-elect=false",
            "--tenants-etcd-allowed-cidrs",
            &etcd_network,
            // The chart's configuration file says so: the Leases in the release's namespace.
            "--leader-elect-lease-namespace",
            "bootstrap",
        ],
    )?;
    controller.wait_ready().await?;
    let tenant_client = client_from(&tenant.admin_kubeconfig(1)).await?;
    let services: Api<Service> = Api::namespaced(tenant_client.clone(), "default");
    eventually("the tenant's kubernetes Service", CONVERGE, || async {
        Ok(services.get_opt("kubernetes").await?.map(|_| ()))
    })
    .await?;
    let bitmap = NodePortBitmap::new(&etcd_url, "/tenant-a");
    let bitmap_revision = bitmap.revision().await?;

    // Mallory may create Secrets in the tenants' namespace, and nothing else.
    let mallory_kubeconfig = management.user_kubeconfig("mallory", &[], 1)?;
    let denied = kubectl(
        &mallory_kubeconfig,
        &["get", "secrets", "-n", TENANTS_NAMESPACE],
    )?;
    ensure!(!denied.status.success(), "mallory may list Secrets");
    let mallory: Api<Secret> =
        Api::namespaced(client_from(&mallory_kubeconfig).await?, TENANTS_NAMESPACE);
    let (port, accepted) = listener().await?;
    let marker = work.path().join("ran");
    let https = format!("    server: https://127.0.0.1:{port}\n");
    let http = format!("    server: http://127.0.0.1:{port}\n");
    let token_path = token_file.display().to_string();
    let tenant_cluster = {
        use base64::Engine;
        format!(
            "    server: {}\n    certificate-authority-data: {}\n",
            tenant.apiserver_url(1)?,
            base64::engine::general_purpose::STANDARD.encode(std::fs::read(tenant.ca_file())?)
        )
    };
    let hostile: Vec<(&str, Secret, Option<&str>)> = vec![
        (
            "steal-token",
            secret(
                "steal-token",
                kubeconfig(&https, &format!("    tokenFile: {token_path}\n")),
                None,
            ),
            Some("users[u].user.tokenFile"),
        ),
        (
            "steal-token-http",
            secret(
                "steal-token-http",
                kubeconfig(&http, &format!("    tokenFile: {token_path}\n")),
                None,
            ),
            Some("users[u].user.tokenFile"),
        ),
        (
            "run",
            secret(
                "run",
                kubeconfig(
                    &https,
                    &format!(
                        "    exec:\n      apiVersion: client.authentication.k8s.io/v1\n      \
                         command: /bin/sh\n      args: [-c, \"touch {}\"]\n",
                        marker.display()
                    ),
                ),
                None,
            ),
            Some("users[u].user.exec.command"),
        ),
        (
            "read",
            secret(
                "read",
                kubeconfig(
                    &format!(
                        "{https}    certificate-authority: {}\n",
                        controller_kubeconfig.display()
                    ),
                    "    token: x\n",
                ),
                None,
            ),
            Some("clusters[c].cluster.certificate-authority"),
        ),
        (
            "take-bitmap",
            secret(
                "take-bitmap",
                kubeconfig(&tenant_cluster, "    token: x\n"),
                Some(format!("etcdServers: {etcd_url}\netcdPrefix: /tenant-a\n")),
            ),
            Some("overlaps"),
        ),
        // Accepted (inline material only): it reaches the tenant with a token of its own, which
        // the tenant refuses, and never with anyone else's credentials.
        (
            "reach-tenant",
            secret(
                "reach-tenant",
                kubeconfig(&tenant_cluster, "    token: not-a-credential\n"),
                None,
            ),
            None,
        ),
    ];
    // Overlapping etcd claims are ordered by the Secrets' creationTimestamp, which has whole
    // seconds: Secrets created within the second of tenant-a's would tie with it (and ties go
    // by name). Mallory's come at least a second later.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for (name, secret, _) in &hostile {
        mallory
            .create(&PostParams::default(), secret)
            .await
            .with_context(|| format!("mallory creating {name}"))?;
    }

    let events: Api<Event> = Api::namespaced(admin_client.clone(), TENANTS_NAMESPACE);
    let refused = hostile.iter().filter(|(_, _, f)| f.is_some()).count();
    let notes: BTreeMap<String, String> =
        eventually("every hostile Secret refused", CONVERGE, || async {
            let notes: BTreeMap<String, String> = events
                .list(&Default::default())
                .await?
                .items
                .into_iter()
                .filter(|e| e.reason.as_deref() == Some("TenantConfigInvalid"))
                .filter_map(|e| Some((e.regarding?.name?, e.note.unwrap_or_default())))
                .collect();
            Ok((notes.len() >= refused).then_some(notes))
        })
        .await?;
    for (name, _, field) in &hostile {
        match field {
            Some(field) => {
                let note = notes
                    .get(*name)
                    .with_context(|| format!("{name}: {notes:?}"))?;
                ensure!(note.contains(field), "{name}: {note}");
            }
            None => ensure!(!notes.contains_key(*name), "{name} refused: {notes:?}"),
        }
    }
    // The accepted one's loops fail on the tenant's RBAC; let them try for a while.
    eventually("reach-tenant failing", CONVERGE, || async {
        let (_, body) = controller.admin_get("/readyz?verbose").await?;
        Ok(body
            .lines()
            .any(|l| {
                l.starts_with(&format!(
                    "[-]tenant {TENANTS_NAMESPACE}/reach-tenant failing"
                ))
            })
            .then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(6)).await;

    ensure!(
        accepted.load(Ordering::SeqCst) == 0,
        "the controller connected to the listener"
    );
    ensure!(!marker.exists(), "a program ran inside the controller");
    let (_, readyz) = controller.admin_get("/readyz?verbose").await?;
    let (_, metrics) = controller.admin_get("/metrics").await?;
    for (what, text) in [
        ("the log", controller.log()),
        ("/readyz", readyz),
        ("/metrics", metrics),
        ("the events", format!("{notes:?}")),
    ] {
        ensure!(
            !text.contains(&token),
            "{what} holds the controller's token"
        );
    }
    // The tenant: reached by its own user and by anonymous requests, never with the
    // controller's identity; written by its own user only; its bitmap untouched by the others.
    let audit = tenant.audit_events(1)?;
    let users: std::collections::BTreeSet<&str> = audit
        .iter()
        .filter_map(|e| e["user"]["username"].as_str())
        .collect();
    ensure!(!users.contains(CONTROLLER_SA), "{users:?}");
    let foreign_writes: Vec<String> = writes(&audit)
        .into_iter()
        .filter(|e| {
            e["responseStatus"]["code"]
                .as_u64()
                .is_some_and(|c| c < 300)
        })
        .filter(|e| {
            !matches!(
                e["user"]["username"].as_str(),
                Some(TENANT_USER) | Some("system:apiserver")
            ) && !e["user"]["username"]
                .as_str()
                .unwrap_or_default()
                .starts_with("system:kube-controller-manager")
                && !e["user"]["username"]
                    .as_str()
                    .unwrap_or_default()
                    .starts_with("system:serviceaccount:kube-system:")
        })
        .map(describe)
        .collect();
    ensure!(foreign_writes.is_empty(), "{foreign_writes:?}");
    ensure!(
        bitmap.revision().await? == bitmap_revision,
        "the tenant's bitmap was written"
    );
    // The controller's own requests to the management cluster: all granted by its Role.
    let refused_requests: Vec<String> = management
        .audit_events_of(CONTROLLER_SA)?
        .iter()
        .filter(|e| e["responseStatus"]["code"] == 403)
        .map(describe)
        .collect();
    ensure!(refused_requests.is_empty(), "{refused_requests:?}");
    Ok(())
}

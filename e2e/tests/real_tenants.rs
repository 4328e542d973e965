//! Management mode against real control planes: one etcd (the management control plane's) holds
//! the management cluster under `/registry` and two tenant clusters, each a real kube-apiserver
//! and kube-controller-manager of its own (`up.sh --etcd-url --etcd-prefix`), under `/tenant-a`
//! and `/tenant-b`, as Kamaji runs tenants on a shared etcd. The real binary runs in management
//! mode against the management cluster, whose Secrets hold the tenants' kubeconfigs and, in
//! their annotations, each tenant's etcd prefix, service range and one namespace of its own.
//!
//! Judged by the tenants' APIs and audit logs, the controller's `/readyz` and `/metrics`, and the
//! keys in the shared etcd: each tenant is kept through its own API, and the NodePort repair of
//! each keeps its bitmap under its own prefix without touching the others'. Timings are printed,
//! not asserted (2-core machines).
//!
//! Tenant B runs the oldest supported Kubernetes (1.30: no IPAddress or ServiceCIDR API, the
//! legacy allocator) where its binaries are built, so one controller keeps the oldest and the
//! newest minors at once; elsewhere it runs the newest too, and says so as a skip.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use common::control_plane::{
    ControlPlane, built_binaries_of, control_plane_slot, self_contained_kubeconfig,
    skipped_under_shared_control_plane,
};
use common::node_port_bitmap::NodePortBitmap;
use common::{CONVERGE, ControllerProcess, client_from, eventually, kubectl};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

const SELECTOR: &str = "bootstrap-controller.io/tenant=true";
const TENANTS_NAMESPACE: &str = "tenants";
/// The user of the kubeconfigs in the tenant Secrets: the writer the tenants' audit logs name.
const USER: &str = "bootstrap-controller";

struct TenantSpec {
    /// The Secret's name; the tenant is `tenants/<name>`.
    name: &'static str,
    prefix: &'static str,
    range: &'static str,
    kubernetes_ip: &'static str,
    /// A system namespace declared in this tenant's fragment only.
    own_namespace: &'static str,
    node_port: u16,
    /// Runs the oldest supported minor where its binaries are built.
    oldest: bool,
}

/// The oldest supported minor (README: Kubernetes versions).
const OLDEST: &str = "1.30";

const TENANTS: [TenantSpec; 2] = [
    TenantSpec {
        name: "tenant-a",
        prefix: "/tenant-a",
        range: "10.96.0.0/12",
        kubernetes_ip: "10.96.0.1",
        own_namespace: "platform-a",
        node_port: 30100,
        oldest: false,
    },
    TenantSpec {
        name: "tenant-b",
        prefix: "/tenant-b",
        range: "10.112.0.0/12",
        kubernetes_ip: "10.112.0.1",
        own_namespace: "platform-b",
        node_port: 30200,
        oldest: true,
    },
];

/// The tenant's configuration fragment: its etcd prefix on the shared etcd, its service range,
/// the default system namespaces plus one of its own, and the NodePort repair as often as a
/// tenant may set it (5 s).
fn fragment(tenant: &TenantSpec, etcd_url: &str) -> String {
    format!(
        "serviceClusterIPRange: {range}\n\
         etcdServers: {etcd_url}\n\
         etcdPrefix: {prefix}\n\
         loops:\n  \
           nodePortRepair:\n    \
             interval: 5s\n  \
           systemNamespaces:\n    \
             namespaces:\n      \
               - name: kube-system\n      \
               - name: kube-public\n      \
               - name: kube-node-lease\n      \
               - name: default\n      \
               - name: {own}\n        \
                 labels: {{tenant: {name}}}\n",
        range = tenant.range,
        prefix = tenant.prefix,
        own = tenant.own_namespace,
        name = tenant.name,
    )
}

/// Every key in the etcd, through its HTTP gateway (`/v3/kv/range`, keys only).
fn etcd_keys(etcd_url: &str) -> Result<Vec<String>> {
    let b64 = |bytes: &[u8]| serde_json::to_value(ByteString(bytes.to_vec()));
    let request =
        serde_json::json!({"key": b64(b"\0")?, "range_end": b64(b"\0")?, "keys_only": true});
    let output = Command::new("curl")
        .args(["-fsS", "-X", "POST", "--data-binary"])
        .arg(request.to_string())
        .arg(format!("{etcd_url}/v3/kv/range"))
        .output()
        .context("running curl")?;
    ensure!(
        output.status.success(),
        "etcd range request: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let body: serde_json::Value = serde_json::from_slice(&output.stdout).context("etcd answer")?;
    body["kvs"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|kv| {
            let key: ByteString = serde_json::from_value(kv["key"].clone())?;
            Ok(String::from_utf8_lossy(&key.0).into_owned())
        })
        .collect()
}

/// `bootstrap_nodeport_repair_port_errors_total` of one tenant and type (0 when absent).
fn port_errors(metrics: &str, tenant: &str, kind: &str) -> u64 {
    let tenant = format!("tenant=\"tenants/{tenant}\"");
    let kind = format!("type=\"{kind}\"");
    metrics
        .lines()
        .filter(|line| line.starts_with("bootstrap_nodeport_repair_port_errors_total{"))
        .filter(|line| line.contains(&tenant) && line.contains(&kind))
        .filter_map(|line| line.rsplit_once(' '))
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .map(|value| value as u64)
        .sum()
}

/// `err` with the controller's log after it (the cause first).
fn with_log(err: anyhow::Error, controller: &ControllerProcess) -> anyhow::Error {
    anyhow::anyhow!("{err:#}\n---- controller log ----\n{}", controller.log())
}

async fn active(namespaces: &Api<Namespace>, name: &str, what: &str) -> Result<()> {
    eventually(&format!("{name} active ({what})"), CONVERGE, || async {
        Ok(namespaces.get_opt(name).await?.and_then(|ns| {
            (ns.metadata.deletion_timestamp.is_none()
                && ns.status.and_then(|s| s.phase).as_deref() == Some("Active"))
            .then_some(())
        }))
    })
    .await
}

/// Successful creates of namespace `name` in a tenant's audit log, by user.
fn namespace_creators(cp: &ControlPlane, name: &str) -> Result<Vec<String>> {
    Ok(cp
        .audit_events(1)?
        .iter()
        .filter(|event| {
            event["verb"] == "create"
                && event["objectRef"]["resource"] == "namespaces"
                && event["objectRef"]["name"] == name
                && event["responseStatus"]["code"] == 201
        })
        .map(|event| event["user"]["username"].as_str().unwrap_or("?").to_owned())
        .collect())
}

fn kubectl_ok(kubeconfig: &std::path::Path, args: &[&str]) -> Result<()> {
    let output = kubectl(kubeconfig, args)?;
    ensure!(
        output.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn management_mode_keeps_real_tenants_on_one_etcd_apart() -> Result<()> {
    let oldest_required = std::env::var_os("BOOTSTRAP_E2E_OLDEST_REQUIRED").is_some();
    ensure!(
        !(oldest_required && std::env::var_os("BOOTSTRAP_E2E_KUBECONFIG").is_some()),
        "BOOTSTRAP_E2E_OLDEST_REQUIRED is set, and BOOTSTRAP_E2E_KUBECONFIG would skip the test"
    );
    if skipped_under_shared_control_plane(
        "real_tenants",
        "management_mode_keeps_real_tenants_on_one_etcd_apart",
    ) {
        return Ok(());
    }
    let started = Instant::now();
    // The management control plane owns the etcd; the tenants (dropped first, declared after)
    // store in it under their own prefixes.
    // Held until every control plane below has stopped (dropped after them).
    let _slot = control_plane_slot().await?;
    let management = ControlPlane::start(1)?;
    let etcd_url = management.etcd_url()?.to_owned();
    let oldest = built_binaries_of(OLDEST)?;
    if oldest.is_none() && oldest_required {
        bail!(
            "tenant-b on Kubernetes {OLDEST}: its binaries are not built, and \
             BOOTSTRAP_E2E_OLDEST_REQUIRED is set (e2e/control-plane/build.sh --kubernetes {OLDEST})"
        );
    }
    if oldest.is_none() {
        common::skip(&format!(
            "tenant-b on Kubernetes {OLDEST}: its binaries are not built \
             (e2e/control-plane/build.sh --kubernetes {OLDEST}); it runs the newest"
        ));
    }
    let mut tenants = Vec::new();
    for tenant in &TENANTS {
        let mut args = vec!["--service-cluster-ip-range", tenant.range];
        if let (true, Some(bin)) = (tenant.oldest, &oldest) {
            // A later --bin wins in up.sh.
            args.extend(["--bin", bin.to_str().context("binaries' path")?]);
        }
        tenants.push(ControlPlane::start_on_etcd(
            1,
            &etcd_url,
            tenant.prefix,
            &args,
        )?);
    }
    for (tenant, cp) in TENANTS.iter().zip(&tenants) {
        let client = client_from(&cp.admin_kubeconfig(1)).await?;
        let info = client.apiserver_version().await?;
        println!(
            "real tenants: {} runs Kubernetes {}",
            tenant.name, info.git_version
        );
        if tenant.oldest && oldest.is_some() {
            ensure!(
                info.minor == OLDEST.trim_start_matches("1."),
                "{} runs {}, not {OLDEST}",
                tenant.name,
                info.git_version
            );
        }
    }
    println!(
        "real tenants: management and two tenant control planes on one etcd up in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    ensure!(management.etcd_started_here() && management.pid("etcd").is_ok());
    for (tenant, cp) in TENANTS.iter().zip(&tenants) {
        ensure!(
            !cp.etcd_started_here() && cp.pid("etcd").is_err(),
            "{}: up.sh --etcd-url must not start (or own) an etcd",
            tenant.name
        );
        ensure!(cp.etcd_url()? == etcd_url && cp.etcd_prefix()? == tenant.prefix);
    }

    // A NodePort Service in each tenant, allocated by its own apiserver into its own bitmap.
    let registry = NodePortBitmap::new(&etcd_url, "/registry");
    let bitmaps: Vec<NodePortBitmap> = TENANTS
        .iter()
        .map(|tenant| NodePortBitmap::new(&etcd_url, tenant.prefix))
        .collect();
    for (tenant, cp) in TENANTS.iter().zip(&tenants) {
        kubectl_ok(
            &cp.admin_kubeconfig(1),
            &[
                "create",
                "service",
                "nodeport",
                "web",
                "--tcp=80:80",
                &format!("--node-port={}", tenant.node_port),
            ],
        )?;
    }
    for (i, tenant) in TENANTS.iter().enumerate() {
        let other = &TENANTS[1 - i];
        ensure!(bitmaps[i].contains(tenant.node_port).await?);
        ensure!(!bitmaps[i].contains(other.node_port).await?);
        ensure!(!registry.contains(tenant.node_port).await?);
    }

    // The management cluster: one kubeconfig Secret per tenant, with its fragment.
    let mgmt = client_from(&management.admin_kubeconfig(1)).await?;
    Api::<Namespace>::all(mgmt.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(TENANTS_NAMESPACE.to_owned()),
                    ..ObjectMeta::default()
                },
                ..Namespace::default()
            },
        )
        .await?;
    let secrets: Api<Secret> = Api::namespaced(mgmt.clone(), TENANTS_NAMESPACE);
    for (tenant, cp) in TENANTS.iter().zip(&tenants) {
        let kubeconfig =
            self_contained_kubeconfig(&cp.user_kubeconfig(USER, &["system:masters"], 1)?)?;
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(tenant.name.to_owned()),
                labels: Some(BTreeMap::from([(
                    "bootstrap-controller.io/tenant".to_owned(),
                    "true".to_owned(),
                )])),
                annotations: Some(BTreeMap::from([(
                    "bootstrap-controller.io/config".to_owned(),
                    fragment(tenant, &etcd_url),
                )])),
                ..ObjectMeta::default()
            },
            string_data: Some(BTreeMap::from([("value".to_owned(), kubeconfig)])),
            ..Secret::default()
        };
        secrets.create(&PostParams::default(), &secret).await?;
    }

    let controller_started = Instant::now();
    let etcd_network = management.etcd_network()?;
    let mut controller = ControllerProcess::start(
        &management.admin_kubeconfig(1),
        &[
            "--tenants-secret-selector",
            SELECTOR,
            "--tenants-namespace",
            TENANTS_NAMESPACE,
            "--leader-elect=false",
            "--tenants-etcd-allowed-cidrs",
            &etcd_network,
        ],
    )?;
    controller.wait_ready().await?;
    let ok_lines: Vec<String> = TENANTS
        .iter()
        .map(|t| format!("[+]tenant {TENANTS_NAMESPACE}/{} ok", t.name))
        .collect();
    eventually("both tenants ok in /readyz", CONVERGE, || async {
        let (status, body) = controller.admin_get("/readyz?verbose").await?;
        Ok(
            (status == 200 && ok_lines.iter().all(|line| body.lines().any(|l| l == line)))
                .then_some(()),
        )
    })
    .await
    .map_err(|err| with_log(err, &controller))?;
    println!(
        "real tenants: both tenants ok in /readyz {:.2} s after the controller started",
        controller_started.elapsed().as_secs_f64()
    );

    // Each tenant: kept through its own API, with its own settings.
    let clients: Vec<Client> = {
        let mut clients = Vec::new();
        for cp in &tenants {
            clients.push(client_from(&cp.admin_kubeconfig(1)).await?);
        }
        clients
    };
    for (i, tenant) in TENANTS.iter().enumerate() {
        let namespaces = Api::<Namespace>::all(clients[i].clone());
        active(&namespaces, tenant.own_namespace, tenant.name).await?;
        let service = Api::<Service>::namespaced(clients[i].clone(), "default")
            .get("kubernetes")
            .await?;
        let cluster_ip = service.spec.and_then(|s| s.cluster_ip);
        ensure!(
            cluster_ip.as_deref() == Some(tenant.kubernetes_ip),
            "{}: the kubernetes Service's clusterIP {cluster_ip:?}",
            tenant.name
        );
    }
    for (i, tenant) in TENANTS.iter().enumerate() {
        let other = &TENANTS[1 - i];
        let namespaces = Api::<Namespace>::all(clients[i].clone());
        ensure!(
            namespaces.get_opt(other.own_namespace).await?.is_none(),
            "{}'s namespace {} was created in {}",
            other.name,
            other.own_namespace,
            tenant.name
        );
        let creators = namespace_creators(&tenants[i], tenant.own_namespace)?;
        ensure!(
            creators == [USER],
            "{}: {} created by {creators:?}",
            tenant.name,
            tenant.own_namespace
        );
    }

    // A system namespace deleted through each tenant's API, and its own one: the tenant's
    // kube-controller-manager finalizes them, the controller creates them again.
    for (i, tenant) in TENANTS.iter().enumerate() {
        let namespaces = Api::<Namespace>::all(clients[i].clone());
        for name in ["kube-node-lease", tenant.own_namespace] {
            let deleted = Instant::now();
            namespaces.delete(name, &DeleteParams::default()).await?;
            eventually(
                &format!("{name} finalized in {}", tenant.name),
                CONVERGE,
                || async {
                    Ok(match namespaces.get_opt(name).await? {
                        None => Some(()),
                        Some(ns) if ns.metadata.deletion_timestamp.is_none() => Some(()),
                        Some(_) => None,
                    })
                },
            )
            .await?;
            active(&namespaces, name, tenant.name)
                .await
                .map_err(|err| with_log(err, &controller))?;
            println!(
                "real tenants: {}: {name} deleted -> finalized -> back in {:.2} s",
                tenant.name,
                deleted.elapsed().as_secs_f64()
            );
        }
        let creators = namespace_creators(&tenants[i], tenant.own_namespace)?;
        ensure!(
            creators == [USER, USER],
            "{}: {} created by {creators:?} (want the controller's user twice)",
            tenant.name,
            tenant.own_namespace
        );
        println!(
            "real tenants: {}: kube-node-lease created by {:?}",
            tenant.name,
            namespace_creators(&tenants[i], "kube-node-lease")?
        );
        let labels = namespaces
            .get(tenant.own_namespace)
            .await?
            .metadata
            .labels
            .unwrap_or_default();
        ensure!(
            labels.get("tenant").map(String::as_str) == Some(tenant.name),
            "{labels:?}"
        );
    }

    // Metrics: series of both tenants' loops.
    let (_, metrics) = controller.admin_get("/metrics").await?;
    for tenant in &TENANTS {
        let series = format!(
            "tenant=\"{TENANTS_NAMESPACE}/{}\",loop=\"system-namespaces\",result=\"success\"",
            tenant.name
        );
        ensure!(metrics.contains(&series), "missing {series} in\n{metrics}");
    }
    ensure!(
        metrics.contains("bootstrap_tenants{state=\"running\"} 2"),
        "{metrics}"
    );

    // The bitmaps: a live port's bit cleared under one tenant's prefix is set again there by
    // that tenant's NodePort repair (kube-apiserver's own repair runs every 3 minutes), counted
    // for that tenant only, and the other prefixes' bitmaps are not written.
    for (i, tenant) in TENANTS.iter().enumerate() {
        let other = &TENANTS[1 - i];
        let untouched = [
            (&registry, registry.revision().await?),
            (&bitmaps[1 - i], bitmaps[1 - i].revision().await?),
        ];
        let (_, before) = controller.admin_get("/metrics").await?;
        let other_repairs = port_errors(&before, other.name, "repair");
        bitmaps[i].set(tenant.node_port, false).await?;
        let cleared = Instant::now();
        eventually(
            &format!("{} set again in {}", tenant.node_port, bitmaps[i].key),
            CONVERGE,
            || async { Ok(bitmaps[i].contains(tenant.node_port).await?.then_some(())) },
        )
        .await
        .map_err(|err| with_log(err, &controller))?;
        println!(
            "real tenants: {}: a live port's cleared bit set again in {:.2} s",
            tenant.name,
            cleared.elapsed().as_secs_f64()
        );
        // The count follows the write that made the bit visible.
        let metrics = eventually(
            &format!("a repair counted for {}", tenant.name),
            CONVERGE,
            || async {
                let (_, metrics) = controller.admin_get("/metrics").await?;
                Ok((port_errors(&metrics, tenant.name, "repair") >= 1).then_some(metrics))
            },
        )
        .await?;
        ensure!(
            port_errors(&metrics, other.name, "repair") == other_repairs,
            "a repair was counted for {} too:\n{metrics}",
            other.name
        );
        for (bitmap, revision) in untouched {
            ensure!(
                bitmap.revision().await? == revision,
                "{} was written while {} was repaired",
                bitmap.key,
                bitmaps[i].key
            );
            ensure!(
                !bitmap.contains(tenant.node_port).await?,
                "{} has {}'s port {}",
                bitmap.key,
                tenant.name,
                tenant.node_port
            );
        }
    }

    // The shared etcd: every key under one of the three prefixes, and each tenant's objects
    // under its own only.
    let keys = etcd_keys(&etcd_url)?;
    let prefixes = ["/registry/", "/tenant-a/", "/tenant-b/"];
    let stray: Vec<&String> = keys
        .iter()
        .filter(|key| !prefixes.iter().any(|p| key.starts_with(p)))
        .filter(|key| key.as_str() != "compact_rev_key")
        .collect();
    ensure!(stray.is_empty(), "keys outside the prefixes: {stray:?}");
    let has = |key: String| keys.contains(&key);
    for prefix in ["/registry", "/tenant-a", "/tenant-b"] {
        for key in ["ranges/servicenodeports", "namespaces/kube-node-lease"] {
            ensure!(has(format!("{prefix}/{key}")), "no {prefix}/{key} in etcd");
        }
    }
    for tenant in &TENANTS {
        let own = format!("namespaces/{}", tenant.own_namespace);
        for prefix in ["/registry", "/tenant-a", "/tenant-b"] {
            ensure!(
                has(format!("{prefix}/{own}")) == (prefix == tenant.prefix),
                "{prefix}/{own}: present {}",
                has(format!("{prefix}/{own}"))
            );
        }
        ensure!(has(format!(
            "/registry/secrets/{TENANTS_NAMESPACE}/{}",
            tenant.name
        )));
    }
    println!(
        "real tenants: {} keys in the shared etcd ({} under /registry, {} under /tenant-a, {} under /tenant-b)",
        keys.len(),
        keys.iter().filter(|k| k.starts_with("/registry/")).count(),
        keys.iter().filter(|k| k.starts_with("/tenant-a/")).count(),
        keys.iter().filter(|k| k.starts_with("/tenant-b/")).count()
    );

    ensure!(controller.is_running(), "{}", controller.log());
    ensure!(
        !controller.log().contains("panicked"),
        "{}",
        controller.log()
    );
    // The tenants stop first and leave the shared etcd to the management control plane.
    let etcd_pid = management.pid("etcd")?;
    drop(controller);
    drop(tenants);
    ensure!(
        common::control_plane::process_alive(etcd_pid),
        "stopping the tenants stopped the shared etcd"
    );
    ensure!(
        etcd_keys(&etcd_url).is_ok(),
        "the shared etcd stopped answering"
    );
    println!(
        "real tenants: the whole test took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

//! `kubectl` as an independent client: TLS with the embedded CA, discovery, printing, writes
//! and watches. Needs `kubectl` on PATH (installed on every build machine).
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Stdio;
use std::time::Duration;

use apiserver_sim::Sim;
use common::{create_ns, eventually, in_new_namespace, start};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Secret, Service};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

/// `kubectl --kubeconfig <kubeconfig> <args>`, which must succeed; its stdout.
async fn kubectl_with(
    kubeconfig: &std::path::Path,
    args: impl IntoIterator<Item = impl AsRef<std::ffi::OsStr>>,
) -> String {
    let out = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

async fn kubectl(sim: &Sim, args: &[&str]) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        Command::new("kubectl")
            .arg("--kubeconfig")
            .arg(sim.kubeconfig_path())
            .arg("--request-timeout=20s")
            .args(args)
            .output(),
    )
    .await
    .expect("kubectl finishes within 60s")
    .expect("kubectl runs (is it on PATH?)");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "kubectl {args:?} failed: {}\nstdout: {stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

const MANIFEST: &str = r#"apiVersion: v1
kind: Namespace
metadata:
  name: shop
---
apiVersion: v1
kind: Service
metadata:
  name: web
  namespace: shop
  labels:
    app: web
spec:
  ports:
  - name: http
    port: 80
    targetPort: 8080
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: settings
  namespace: shop
data:
  mode: fast
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_reads_and_writes() {
    let sim = start().await;
    let client = sim.client();
    create_ns(&client, "first").await;
    let out = kubectl(&sim, &["get", "ns"]).await;
    assert!(out.contains("first"), "{out}");

    let dir = tempfile::tempdir().unwrap();
    let manifest = dir.path().join("shop.yaml");
    std::fs::write(&manifest, MANIFEST).unwrap();
    let manifest_path = manifest.to_str().unwrap();
    let out = kubectl(&sim, &["create", "-f", manifest_path, "--validate=false"]).await;
    assert!(out.contains("service/web created"), "{out}");
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    let web = svcs.get("web").await.unwrap();
    assert!(
        web.spec.unwrap().cluster_ip.is_some(),
        "allocated on kubectl create"
    );

    // Server-side printing: kube-apiserver's columns.
    let out = kubectl(&sim, &["get", "svc", "-A"]).await;
    let ip = svcs
        .get("web")
        .await
        .unwrap()
        .spec
        .unwrap()
        .cluster_ip
        .unwrap();
    assert!(
        out.contains("CLUSTER-IP") && out.contains(&ip) && out.contains("80/TCP"),
        "{out}"
    );
    let out = kubectl(&sim, &["get", "ns"]).await;
    assert!(out.contains("STATUS") && out.contains("Active"), "{out}");

    let out = kubectl(&sim, &["get", "svc", "-A", "-o", "json"]).await;
    let list: serde_json::Value = serde_json::from_str(&out).unwrap();
    let items = list["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0]["metadata"]["name"], "web");
    assert_eq!(items[0]["metadata"]["namespace"], "shop");

    // `kubectl describe` reads through client-go's typed client, which asks for protobuf: the
    // simulator's encoding must decode in upstream's own decoder (the target port is an
    // IntOrString, the labels a map).
    let described = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(sim.kubeconfig_path())
        .args(["describe", "svc", "web", "-n", "shop", "-v=8"])
        .output()
        .await
        .unwrap();
    assert!(described.status.success(), "kubectl describe failed");
    let out = String::from_utf8_lossy(&described.stdout);
    let log = String::from_utf8_lossy(&described.stderr);
    assert!(
        log.contains("Content-Type: application/vnd.kubernetes.protobuf"),
        "kubectl describe got protobuf: {log}"
    );
    assert!(
        out.contains(&ip) && out.contains("8080/TCP") && out.contains("app=web"),
        "{out}"
    );

    // replace -f with a changed label.
    std::fs::write(&manifest, MANIFEST.replace("app: web", "app: web-v2")).unwrap();
    let out = kubectl(&sim, &["replace", "-f", manifest_path, "--validate=false"]).await;
    assert!(out.contains("service/web replaced"), "{out}");
    let web = svcs.get("web").await.unwrap();
    assert_eq!(web.metadata.labels.unwrap()["app"], "web-v2");

    let out = kubectl(
        &sim,
        &[
            "patch",
            "configmap",
            "settings",
            "-n",
            "shop",
            "--type=merge",
            "-p",
            r#"{"data":{"mode":"slow"}}"#,
        ],
    )
    .await;
    assert!(out.contains("patched"), "{out}");
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "shop");
    assert_eq!(
        cms.get("settings").await.unwrap().data.unwrap()["mode"],
        "slow"
    );

    let out = kubectl(&sim, &["delete", "svc", "web", "-n", "shop"]).await;
    assert!(out.contains("deleted"), "{out}");
    assert!(svcs.get_opt("web").await.unwrap().is_none());

    // Namespace deletion: kubectl waits until the namespace is finalized.
    kubectl(&sim, &["delete", "ns", "shop"]).await;
    let nss: Api<Namespace> = Api::all(client.clone());
    assert!(nss.get_opt("shop").await.unwrap().is_none());
    assert!(cms.get_opt("settings").await.unwrap().is_none());

    let out = kubectl(
        &sim,
        &["get", "svc", "missing", "-n", "first", "--ignore-not-found"],
    )
    .await;
    assert!(out.trim().is_empty());
    assert!(
        sim.requests()
            .iter()
            .any(|r| r.user_agent.starts_with("kubectl/")),
        "the request log records kubectl's User-Agent"
    );
    sim.shutdown().await;
}

/// kubectl's generators send protobuf bodies (and do not fall back to JSON): each of them for
/// the kinds the simulator serves creates what kubectl meant.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_generators_create_through_protobuf() {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    let sim = start().await;
    let client = sim.client();
    kubectl(&sim, &["create", "namespace", "gen"]).await;
    for args in [
        &["create", "service", "clusterip", "web", "--tcp=80:8080"][..],
        &[
            "create",
            "service",
            "nodeport",
            "np",
            "--tcp=8080:80",
            "--node-port=30123",
        ],
        &[
            "create",
            "service",
            "externalname",
            "ext",
            "--external-name=example.com",
        ],
        &["create", "service", "loadbalancer", "lb", "--tcp=443"],
        &[
            "create",
            "configmap",
            "settings",
            "--from-literal=mode=fast",
        ],
        // How people add a tenant in management mode.
        &[
            "create",
            "secret",
            "generic",
            "tenant-a",
            "--from-literal=value=apiVersion: v1",
        ],
    ] {
        let mut args = args.to_vec();
        args.extend(["--namespace", "gen"]);
        kubectl(&sim, &args).await;
    }
    let namespace = Api::<Namespace>::all(client.clone())
        .get("gen")
        .await
        .unwrap();
    assert_eq!(namespace.metadata.name.as_deref(), Some("gen"));
    let services: Api<Service> = Api::namespaced(client.clone(), "gen");
    let web = services.get("web").await.unwrap();
    let spec = web.spec.unwrap();
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    assert!(spec.cluster_ip.is_some_and(|ip| ip.starts_with("10.")));
    let port = &spec.ports.unwrap()[0];
    assert_eq!(
        (port.port, port.target_port.clone()),
        (80, Some(IntOrString::Int(8080)))
    );
    assert_eq!(web.metadata.labels.unwrap()["app"], "web");
    let np = services.get("np").await.unwrap().spec.unwrap();
    assert_eq!(np.type_.as_deref(), Some("NodePort"));
    assert_eq!(np.ports.unwrap()[0].node_port, Some(30123));
    let ext = services.get("ext").await.unwrap().spec.unwrap();
    assert_eq!(ext.external_name.as_deref(), Some("example.com"));
    assert_eq!(
        ext.cluster_ip, None,
        "an ExternalName Service gets no cluster IP"
    );
    let lb = services.get("lb").await.unwrap().spec.unwrap();
    assert_eq!(lb.type_.as_deref(), Some("LoadBalancer"));
    let settings = Api::<ConfigMap>::namespaced(client, "gen")
        .get("settings")
        .await
        .unwrap();
    assert_eq!(settings.data.unwrap()["mode"], "fast");
    let secret = Api::<Secret>::namespaced(sim.client(), "gen")
        .get("tenant-a")
        .await
        .unwrap();
    assert_eq!(secret.type_.as_deref(), Some("Opaque"));
    assert_eq!(secret.data.unwrap()["value"].0, b"apiVersion: v1");
    // kubectl reads it back in protobuf too.
    let out = kubectl(
        &sim,
        &[
            "get",
            "secret",
            "tenant-a",
            "-n",
            "gen",
            "-o",
            "jsonpath={.data.value}",
        ],
    )
    .await;
    assert_eq!(out.trim(), "YXBpVmVyc2lvbjogdjE=");
    sim.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_watch_sees_another_clients_change() {
    let sim = start().await;
    let client = sim.client();
    let svcs: Api<Service> = in_new_namespace(&client, "w").await;
    let svc: Service = serde_json::from_value(json!({
        "metadata": {"name": "watched", "labels": {"stage": "one"}},
        "spec": {"ports": [{"port": 80}]}
    }))
    .unwrap();
    svcs.create(&Default::default(), &svc).await.unwrap();

    let mut child = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(sim.kubeconfig_path())
        .args([
            "get",
            "svc",
            "-n",
            "w",
            "-w",
            "-o",
            "jsonpath={.metadata.name}={.metadata.labels.stage}{\"\\n\"}",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("kubectl runs");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let next_line = async |lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>| {
        tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("kubectl prints within 30s")
            .unwrap()
            .expect("kubectl still running")
    };
    assert_eq!(next_line(&mut lines).await, "watched=one");
    // Make sure the watch request is established before changing the object.
    eventually("kubectl watch open", || async {
        sim.requests()
            .iter()
            .any(|r| r.verb == "watch" && r.user_agent.starts_with("kubectl/"))
    })
    .await;
    svcs.patch(
        "watched",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"stage": "two"}}})),
    )
    .await
    .unwrap();
    assert_eq!(next_line(&mut lines).await, "watched=two");
    child.kill().await.unwrap();
    sim.shutdown().await;
}

/// The binary: writes a kubeconfig kubectl accepts, logs where it listens, stops on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("kubeconfig");
    let mut child = Command::new(env!("CARGO_BIN_EXE_apiserver-sim"))
        .args(["--listen", "127.0.0.1:0", "--kubeconfig-out"])
        .arg(&kubeconfig)
        .args([
            "--service-cluster-ip-range",
            "10.0.0.0/16",
            "--service-node-port-range",
            "31000-31100",
        ])
        .args([
            "--seed-namespace",
            "default",
            "--namespace-finalize-delay",
            "100ms",
        ])
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), log.next_line())
        .await
        .expect("logs within 30s")
        .unwrap()
        .unwrap();
    assert!(line.contains("listening on https://127.0.0.1:"), "{line}");
    assert!(
        kubeconfig.exists(),
        "kubeconfig written before the log line"
    );
    let run = |args: Vec<&'static str>| kubectl_with(&kubeconfig, args);
    assert!(
        run(vec!["get", "ns", "default", "-o", "name"])
            .await
            .contains("namespace/default")
    );
    let dir_path = dir.path().join("svc.yaml");
    std::fs::write(
        &dir_path,
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: np\n  namespace: default\nspec:\n  type: NodePort\n  ports:\n  - port: 80\n",
    )
    .unwrap();
    kubectl_with(
        &kubeconfig,
        ["create", "--validate=false", "-f"]
            .map(std::ffi::OsStr::new)
            .into_iter()
            .chain([dir_path.as_os_str()]),
    )
    .await;
    let np =
        |jsonpath: &'static str| run(vec!["get", "svc", "np", "-n", "default", "-o", jsonpath]);
    let ip = np("jsonpath={.spec.clusterIP}").await;
    assert!(
        ip.starts_with("10.0."),
        "ClusterIP from --service-cluster-ip-range: {ip}"
    );
    let port: u16 = np("jsonpath={.spec.ports[0].nodePort}")
        .await
        .parse()
        .unwrap();
    assert!((31000..=31100).contains(&port), "{port}");

    let pid = child.id().unwrap().to_string();
    let status = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await
        .unwrap();
    assert!(status.success());
    let exit = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("exits within 30s of SIGTERM")
        .unwrap();
    assert!(exit.success(), "clean exit on SIGTERM: {exit:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_rejects_bad_flags_with_a_clear_error() {
    let cases: [(&[&str], &str); 4] = [
        (&["--service-node-port-range", "32000"], "A-B"),
        (
            &["--service-node-port-range", "32767-30000"],
            "start is after end",
        ),
        (
            &["--service-cluster-ip-range", "10.0.0.0/16,10.1.0.0/16"],
            "one CIDR per IP family",
        ),
        (
            &["--namespace-finalize-delay", "5 parsecs"],
            "--namespace-finalize-delay",
        ),
    ];
    for (args, hint) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_apiserver-sim"))
            .args(["--kubeconfig-out", "/dev/null"])
            .args(args)
            .output()
            .await
            .unwrap();
        assert!(!out.status.success(), "{args:?} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(args[0]) && err.contains(hint),
            "{args:?}: {err}"
        );
    }
}

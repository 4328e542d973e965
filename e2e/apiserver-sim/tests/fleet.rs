//! Secrets like any other resource, and a fleet: a management cluster holding one Cluster API
//! style kubeconfig Secret per tenant cluster, each tenant reachable with its Secret alone.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;

use apiserver_sim::{
    CLUSTER_NAME_LABEL, Fleet, FleetConfig, KUBECONFIG_SECRET_KEY, TENANT_LABEL, kubeconfig_secret,
};
use common::{api_err, fast_config, in_new_namespace, says, start};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::json;

fn secret(name: &str, labels: &[(&str, &str)], value: &[u8]) -> Secret {
    Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "value".to_string(),
            ByteString(value.to_vec()),
        )])),
        ..Default::default()
    }
}

#[tokio::test]
async fn secrets_crud_selectors_and_watch() {
    let sim = start().await;
    let client = sim.client();
    let api: Api<Secret> = in_new_namespace(&client, "tenants").await;

    let mut watch = api
        .watch(&WatchParams::default().labels("tier=a"), "0")
        .await
        .unwrap()
        .boxed();

    let a = api
        .create(
            &PostParams::default(),
            &secret("a", &[("tier", "a")], b"\x00binary\xff"),
        )
        .await
        .unwrap();
    assert_eq!(
        a.type_.as_deref(),
        Some("Opaque"),
        "type defaults to Opaque"
    );
    assert_eq!(a.data.unwrap()["value"].0, b"\x00binary\xff");
    api.create(&PostParams::default(), &secret("b", &[("tier", "b")], b"b"))
        .await
        .unwrap();

    let only_a = api
        .list(&ListParams::default().labels("tier=a"))
        .await
        .unwrap();
    let names: Vec<_> = only_a
        .items
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    assert_eq!(names, ["a"]);
    let all: Api<Secret> = Api::all(client.clone());
    assert_eq!(
        all.list(&ListParams::default().labels("tier in (a,b)"))
            .await
            .unwrap()
            .items
            .len(),
        2
    );

    // stringData is folded into data and never stored.
    let mut rotated = api.get("a").await.unwrap();
    rotated.data = None;
    rotated.string_data = Some(BTreeMap::from([("value".into(), "rotated".into())]));
    let replaced = api
        .replace("a", &PostParams::default(), &rotated)
        .await
        .unwrap();
    assert_eq!(replaced.data.unwrap()["value"].0, b"rotated");
    let stored = sim
        .backdoor()
        .get("secrets", "tenants", "a")
        .unwrap()
        .unwrap();
    assert_eq!(stored["data"]["value"], "cm90YXRlZA==");
    assert!(stored.get("stringData").is_none());

    api.delete("a", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match watch.try_next().await.unwrap().unwrap() {
            WatchEvent::Added(s) => seen.push(format!("ADDED {}", s.metadata.name.unwrap())),
            WatchEvent::Modified(s) => seen.push(format!("MODIFIED {}", s.metadata.name.unwrap())),
            WatchEvent::Deleted(s) => seen.push(format!("DELETED {}", s.metadata.name.unwrap())),
            _ => {}
        }
    }
    assert_eq!(seen, ["ADDED a", "MODIFIED a", "DELETED a"]);

    // Values must be base64 and keys config keys, as kube-apiserver checks.
    let bad: Secret = serde_json::from_value(json!({
        "metadata": {"name": "bad"},
        "data": {"a/b": "eA=="},
    }))
    .unwrap();
    let e = api_err(api.create(&PostParams::default(), &bad).await);
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "data[a/b]");
    let status = raw_create(
        &sim,
        json!({"metadata": {"name": "bad"}, "data": {"k": "not base64!"}}),
    )
    .await;
    assert_eq!(status, 422);
    sim.shutdown().await;
}

/// POSTs a Secret as JSON without kube-rs's typed encoding (which cannot express bad base64).
async fn raw_create(sim: &apiserver_sim::Sim, body: serde_json::Value) -> u16 {
    let req = hyper::Request::post("/api/v1/namespaces/tenants/secrets")
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body).unwrap())
        .unwrap();
    match sim.client().request::<Secret>(req).await {
        Ok(_) => 201,
        Err(kube::Error::Api(s)) => s.code,
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn fleet_secrets_reach_their_tenants() {
    let fleet = Fleet::start(FleetConfig {
        tenants: 3,
        management: fast_config(),
        tenant: fast_config(),
        ..FleetConfig::default()
    })
    .await
    .unwrap();
    let mgmt = fleet.management();
    assert_eq!(fleet.tenants().len(), 3);
    assert!(
        mgmt.requests().is_empty(),
        "seeding goes through the backdoor"
    );

    let api: Api<Secret> = Api::namespaced(mgmt.client(), "tenants");
    let listed = api
        .list(&ListParams::default().labels(&format!("{TENANT_LABEL}=true")))
        .await
        .unwrap();
    let mut names: Vec<_> = listed
        .items
        .iter()
        .map(|s| s.metadata.name.clone().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "tenant-0-kubeconfig",
            "tenant-1-kubeconfig",
            "tenant-2-kubeconfig"
        ]
    );

    let mut urls = Vec::new();
    for i in 0..3 {
        let s = api.get(&Fleet::secret_name(i)).await.unwrap();
        let labels = s.metadata.labels.clone().unwrap();
        assert_eq!(labels[CLUSTER_NAME_LABEL], format!("tenant-{i}"));
        assert_eq!(labels[TENANT_LABEL], "true");
        assert_eq!(s.type_.as_deref(), Some("cluster.x-k8s.io/secret"));
        let text = String::from_utf8(s.data.unwrap()[KUBECONFIG_SECRET_KEY].0.clone()).unwrap();
        assert_eq!(Some(&text), fleet.tenant_kubeconfig(i).as_ref());
        assert!(text.contains("certificate-authority-data: "), "{text}");

        // The Secret alone reaches the tenant, TLS verified against its inline CA.
        let kc = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        urls.push(cfg.cluster_url.to_string());
        let client = kube::Client::try_from(cfg).unwrap();
        let ns: Api<Namespace> = Api::all(client);
        ns.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": format!("only-in-{i}")}})).unwrap(),
        )
        .await
        .unwrap();
    }
    urls.dedup();
    assert_eq!(urls.len(), 3, "each tenant its own server: {urls:?}");

    // Tenants are independent: own objects, own request log.
    for (i, t) in fleet.tenants().iter().enumerate() {
        let nss: Vec<String> = t
            .backdoor()
            .list("namespaces")
            .unwrap()
            .iter()
            .map(|n| n["metadata"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(nss, [format!("only-in-{i}")]);
        assert_eq!(t.request_count("create", "namespaces"), 1);
    }
    assert_eq!(mgmt.request_count("create", "namespaces"), 0);

    // A test rotates or removes a Secret itself from the same JSON.
    let mut rotated = fleet.tenant_secret(1).unwrap();
    rotated["metadata"]["annotations"] =
        json!({"bootstrap-controller.io/config": "namespaces: {}"});
    mgmt.backdoor().put(rotated).unwrap();
    assert_eq!(
        api.get("tenant-1-kubeconfig")
            .await
            .unwrap()
            .metadata
            .annotations
            .unwrap()["bootstrap-controller.io/config"],
        "namespaces: {}"
    );
    api.delete("tenant-2-kubeconfig", &DeleteParams::default())
        .await
        .unwrap();
    assert_eq!(
        kubeconfig_secret("tenants", "tenant-2", "x")["metadata"]["name"],
        "tenant-2-kubeconfig"
    );
    fleet.shutdown().await;
}

/// A TLS handshake with the shared listener offering h2, as the controller does, naming
/// `server_name` (SNI): the ALPN protocol agreed, or the handshake's error.
async fn handshake(fleet: &Fleet, server_name: &str) -> Result<Option<Vec<u8>>, std::io::Error> {
    use rustls::pki_types::pem::PemObject;
    let ca = fleet.tenants()[0].ca_pem().unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(rustls::pki_types::CertificateDer::from_pem_slice(ca.as_bytes()).unwrap())
        .unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let tcp = tokio::net::TcpStream::connect(fleet.shared_addr().unwrap())
        .await
        .unwrap();
    let name = rustls::pki_types::ServerName::try_from(server_name.to_string()).unwrap();
    let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await?;
    Ok(tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec))
}

#[tokio::test]
async fn fleet_behind_one_listener_tells_tenants_apart_by_server_name() {
    let fleet = Fleet::start(FleetConfig {
        tenants: 3,
        management: fast_config(),
        tenant: fast_config(),
        shared_listener: true,
        ..FleetConfig::default()
    })
    .await
    .unwrap();
    let shared = fleet.shared_addr().unwrap();
    assert!(shared.ip().is_loopback(), "{shared}");
    assert_ne!(fleet.management().addr(), shared);
    for (i, t) in fleet.tenants().iter().enumerate() {
        assert_eq!(t.addr(), shared);
        assert_eq!(t.server_name(), Some(Fleet::server_name(i).as_str()));
        assert!(
            t.requests().is_empty(),
            "the start-up check leaves no request in the log: {:?}",
            t.requests()
        );
    }
    assert_eq!(Fleet::server_name(2), "tenant-2.apiserver-sim.test");

    // Each Secret alone reaches its own tenant through the one listener, TLS verified against
    // its inline CA for the server name it names.
    let api: Api<Secret> = Api::namespaced(fleet.management().client(), "tenants");
    for i in 0..3 {
        let s = api.get(&Fleet::secret_name(i)).await.unwrap();
        let text = String::from_utf8(s.data.unwrap()[KUBECONFIG_SECRET_KEY].0.clone()).unwrap();
        assert!(
            text.contains(&format!("tls-server-name: tenant-{i}.apiserver-sim.test\n")),
            "{text}"
        );
        let kc = kube::config::Kubeconfig::from_yaml(&text).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        assert_eq!(cfg.cluster_url.port_u16(), Some(shared.port()));
        let ns: Api<Namespace> = Api::all(kube::Client::try_from(cfg).unwrap());
        ns.create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": format!("only-in-{i}")}})).unwrap(),
        )
        .await
        .unwrap();
    }
    for (i, t) in fleet.tenants().iter().enumerate() {
        let nss: Vec<String> = t
            .backdoor()
            .list("namespaces")
            .unwrap()
            .iter()
            .map(|n| n["metadata"]["name"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(nss, [format!("only-in-{i}")]);
        assert_eq!(t.request_count("create", "namespaces"), 1);
    }

    // A client offering h2 (the controller's) gets it behind the shared listener too.
    assert_eq!(
        handshake(&fleet, &Fleet::server_name(1)).await.unwrap(),
        Some(b"h2".to_vec())
    );
    // A name no tenant has, or an address instead of a name (no SNI), gets no handshake.
    assert!(
        handshake(&fleet, "tenant-3.apiserver-sim.test")
            .await
            .is_err()
    );
    assert!(handshake(&fleet, "127.0.0.1").await.is_err());
    fleet.shutdown().await;
}

#[tokio::test]
async fn fleet_refuses_a_shared_listener_without_tls() {
    let mut tenant = fast_config();
    tenant.plain_http = true;
    let e = Fleet::start(FleetConfig {
        tenants: 2,
        tenant,
        shared_listener: true,
        ..FleetConfig::default()
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("needs TLS"), "{e}");
}

#[tokio::test]
async fn fleet_refuses_a_fixed_tenant_port_for_several_tenants() {
    let mut tenant = fast_config();
    tenant.listen = "127.0.0.1:1".parse().unwrap();
    let e = Fleet::start(FleetConfig {
        tenants: 2,
        tenant,
        ..FleetConfig::default()
    })
    .await
    .unwrap_err();
    assert!(e.to_string().contains("cannot share"), "{e}");
}

/// The binary with `--tenants`: the management cluster at `--kubeconfig-out` holds one Secret per
/// tenant, each tenant's kubeconfig file reaches that tenant, and SIGTERM stops them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_serves_a_fleet() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let kubeconfig = dir.path().join("management.kubeconfig");
    let tenants_dir = dir.path().join("tenants");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_apiserver-sim"))
        .arg("--kubeconfig-out")
        .arg(&kubeconfig)
        .args(["--tenants", "3", "--tenants-namespace", "clusters"])
        .arg("--tenants-kubeconfig-dir")
        .arg(&tenants_dir)
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("binary starts");
    let mut log = BufReader::new(child.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(std::time::Duration::from_secs(30), log.next_line())
        .await
        .expect("logs within 30s")
        .unwrap()
        .unwrap();
    assert!(line.contains("listening on https://127.0.0.1:"), "{line}");
    assert!(line.contains("tenants=3"), "{line}");

    let kc = kube::config::Kubeconfig::read_from(&kubeconfig).unwrap();
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap();
    let mgmt = kube::Client::try_from(cfg).unwrap();
    let secrets: Api<Secret> = Api::namespaced(mgmt, "clusters");
    let listed = secrets
        .list(&ListParams::default().labels(&format!("{TENANT_LABEL}=true")))
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 3);
    for i in 0..3 {
        let s = secrets.get(&Fleet::secret_name(i)).await.unwrap();
        let from_secret = String::from_utf8(s.data.unwrap()["value"].0.clone()).unwrap();
        let file =
            std::fs::read_to_string(tenants_dir.join(format!("tenant-{i}.kubeconfig"))).unwrap();
        assert_eq!(from_secret, file);
        let cfg = kube::Config::from_custom_kubeconfig(
            kube::config::Kubeconfig::from_yaml(&file).unwrap(),
            &Default::default(),
        )
        .await
        .unwrap();
        let tenant = kube::Client::try_from(cfg).unwrap();
        // The management cluster's Secret namespace is not seeded in a tenant.
        let e = api_err(Api::<Namespace>::all(tenant).get("clusters").await);
        assert_eq!(e.code, 404);
    }

    let pid = child.id().unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    let status = tokio::time::timeout(std::time::Duration::from_secs(30), child.wait())
        .await
        .expect("exits within 30s after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status}");
}

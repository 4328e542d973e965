//! Service ClusterIP / NodePort allocation and the IPAddress objects, through kube-rs.
#![allow(clippy::unwrap_used)]

mod common;

use common::{api_err, create_ns, fast_config, says, start, start_with};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

fn svc(name: &str, spec: Value) -> Service {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

/// The simulator's `app` namespace, created, and the Services in it.
async fn services_in_app(client: &kube::Client) -> Api<Service> {
    create_ns(client, "app").await;
    Api::namespaced(client.clone(), "app")
}

/// Creates Service `name` with `spec`: the simulator must accept it.
async fn create(api: &Api<Service>, name: &str, spec: Value) -> Service {
    api.create(&PostParams::default(), &svc(name, spec))
        .await
        .unwrap()
}

/// Creates Service `name` with `spec`: the simulator must refuse it, as the API error returned.
async fn refused(api: &Api<Service>, name: &str, spec: Value) -> kube::core::Status {
    api_err(api.create(&PostParams::default(), &svc(name, spec)).await)
}

fn ports() -> Value {
    json!([{"name": "http", "port": 80}])
}

#[tokio::test]
async fn cluster_ip_allocation_and_release() {
    let sim = start().await;
    let client = sim.client();
    let api = services_in_app(&client).await;
    let ips: Api<IPAddress> = Api::all(client.clone());

    let s = create(&api, "auto", json!({"ports": ports()})).await;
    let spec = s.spec.unwrap();
    let ip = spec.cluster_ip.clone().unwrap();
    let parsed: std::net::Ipv4Addr = ip.parse().unwrap();
    assert!(
        ipnet::Ipv4Net::new(std::net::Ipv4Addr::new(10, 96, 0, 0), 12)
            .unwrap()
            .contains(&parsed)
    );
    assert_eq!(spec.cluster_ips.unwrap(), vec![ip.clone()]);
    assert_eq!(spec.ip_families.unwrap(), vec!["IPv4"]);
    assert_eq!(spec.ip_family_policy.as_deref(), Some("SingleStack"));
    assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
    let svc_ports = spec.ports.unwrap();
    assert_eq!(svc_ports[0].protocol.as_deref(), Some("TCP"));

    let addr = ips.get(&ip).await.unwrap();
    let labels = addr.metadata.labels.unwrap();
    assert_eq!(
        labels["ipaddress.kubernetes.io/managed-by"],
        "ipallocator.k8s.io"
    );
    assert_eq!(labels["ipaddress.kubernetes.io/ip-family"], "IPv4");
    let parent = addr.spec.unwrap().parent_ref;
    // The core group is empty, which kube-apiserver does not serialize.
    assert_eq!(
        (
            parent.group.as_deref(),
            parent.resource.as_str(),
            parent.namespace.as_deref(),
            parent.name.as_str()
        ),
        (None, "services", Some("app"), "auto")
    );

    // A requested IP is honoured; the same one again is rejected with 422.
    let fixed = create(
        &api,
        "fixed",
        json!({"clusterIP": "10.96.0.10", "ports": ports()}),
    )
    .await;
    assert_eq!(
        fixed.spec.unwrap().cluster_ip.as_deref(),
        Some("10.96.0.10")
    );
    let e = refused(
        &api,
        "clash",
        json!({"clusterIP": "10.96.0.10", "ports": ports()}),
    )
    .await;
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "provided IP is already allocated");
    let e = refused(
        &api,
        "outside",
        json!({"clusterIP": "192.0.2.1", "ports": ports()}),
    )
    .await;
    assert_eq!(e.code, 422);
    says(&e, "is not in the valid range");

    // Headless.
    let headless = create(
        &api,
        "headless",
        json!({"clusterIP": "None", "ports": ports()}),
    )
    .await;
    assert_eq!(headless.spec.unwrap().cluster_ips.unwrap(), vec!["None"]);

    // clusterIP is immutable; omitting it in an update keeps it.
    let e = api_err(
        api.patch(
            "fixed",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"clusterIP": "10.96.0.11", "clusterIPs": ["10.96.0.11"]}}),
            ),
        )
        .await,
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "may not change once set");
    let mut current = api.get("fixed").await.unwrap();
    if let Some(spec) = current.spec.as_mut() {
        spec.cluster_ip = None;
        spec.cluster_ips = None;
    }
    let kept = api
        .replace("fixed", &PostParams::default(), &current)
        .await
        .unwrap();
    assert_eq!(kept.spec.unwrap().cluster_ip.as_deref(), Some("10.96.0.10"));

    // Delete releases: the IPAddress goes and the IP can be requested again.
    api.delete("fixed", &DeleteParams::default()).await.unwrap();
    assert_eq!(api_err(ips.get("10.96.0.10").await).code, 404);
    create(
        &api,
        "again",
        json!({"clusterIP": "10.96.0.10", "ports": ports()}),
    )
    .await;
    assert_eq!(
        ips.list(
            &ListParams::default().labels("ipaddress.kubernetes.io/managed-by=ipallocator.k8s.io")
        )
        .await
        .unwrap()
        .items
        .len(),
        2
    );
    sim.shutdown().await;
}

#[tokio::test]
async fn node_port_allocation() {
    let sim = start_with(apiserver_sim::SimConfig {
        service_node_port_range: 30000..=30010,
        ..fast_config()
    })
    .await;
    let client = sim.client();
    let api = services_in_app(&client).await;
    let np = create(&api, "np", json!({"type": "NodePort", "ports": [{"name": "a", "port": 80}, {"name": "b", "port": 81}]})).await;
    let spec = np.spec.unwrap();
    let got: Vec<i32> = spec
        .ports
        .unwrap()
        .iter()
        .map(|p| p.node_port.unwrap())
        .collect();
    assert!(got.iter().all(|p| (30000..=30010).contains(p)), "{got:?}");
    assert_ne!(got[0], got[1]);
    assert_eq!(spec.external_traffic_policy.as_deref(), Some("Cluster"));

    let e = refused(
        &api,
        "dup",
        json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": got[0]}]}),
    )
    .await;
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    says(&e, "provided port is already allocated");
    let e = refused(
        &api,
        "range",
        json!({"type": "NodePort", "ports": [{"port": 80, "nodePort": 31000}]}),
    )
    .await;
    says(&e, "provided port is not in the valid range");

    // LoadBalancer + Local gets a health-check port.
    let lb = create(
        &api,
        "lb",
        json!({"type": "LoadBalancer", "externalTrafficPolicy": "Local", "ports": ports()}),
    )
    .await;
    let lb_spec = lb.spec.unwrap();
    let hc = lb_spec.health_check_node_port.unwrap();
    assert!((30000..=30010).contains(&hc));
    let lb_port = lb_spec.ports.unwrap()[0].node_port.unwrap();
    let mut held = sim.backdoor().allocated_node_ports();
    held.sort();
    let mut want = vec![got[0] as u16, got[1] as u16, hc as u16, lb_port as u16];
    want.sort();
    assert_eq!(held, want);

    // Update keeps ports when omitted; switching to ClusterIP releases them.
    let mut current = api.get("np").await.unwrap();
    for p in current.spec.as_mut().unwrap().ports.as_mut().unwrap() {
        p.node_port = None;
    }
    let kept = api
        .replace("np", &PostParams::default(), &current)
        .await
        .unwrap();
    let kept_ports: Vec<i32> = kept
        .spec
        .unwrap()
        .ports
        .unwrap()
        .iter()
        .map(|p| p.node_port.unwrap())
        .collect();
    assert_eq!(kept_ports, got);
    let mut to_cip = api.get("np").await.unwrap();
    {
        let spec = to_cip.spec.as_mut().unwrap();
        spec.type_ = Some("ClusterIP".into());
        spec.external_traffic_policy = None;
        for p in spec.ports.as_mut().unwrap() {
            p.node_port = None;
        }
    }
    api.replace("np", &PostParams::default(), &to_cip)
        .await
        .unwrap();
    assert_eq!(sim.backdoor().allocated_node_ports().len(), 2);

    api.delete("lb", &DeleteParams::default()).await.unwrap();
    assert!(sim.backdoor().allocated_node_ports().is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn allocation_can_be_switched_off() {
    let sim = start_with(apiserver_sim::SimConfig {
        allocation: false,
        ..fast_config()
    })
    .await;
    let client = sim.client();
    let api = services_in_app(&client).await;
    let s = create(&api, "plain", json!({"type": "NodePort", "ports": ports()})).await;
    let spec = s.spec.unwrap();
    assert!(spec.cluster_ip.is_none());
    assert!(spec.ports.unwrap()[0].node_port.is_none());
    assert!(common::ip_addresses(&client).await.is_empty());
    sim.shutdown().await;
}

#[tokio::test]
async fn dual_stack_ranges() {
    let sim = start_with(apiserver_sim::SimConfig {
        service_cluster_ip_ranges: vec![
            "10.0.0.0/24".parse().unwrap(),
            "fd00::/108".parse().unwrap(),
        ],
        ..fast_config()
    })
    .await;
    let client = sim.client();
    let api = services_in_app(&client).await;
    let s = create(
        &api,
        "ds",
        json!({"ipFamilyPolicy": "RequireDualStack", "ports": ports()}),
    )
    .await;
    let spec = s.spec.unwrap();
    let ips = spec.cluster_ips.unwrap();
    assert_eq!(ips.len(), 2);
    assert!(ips[0].parse::<std::net::Ipv4Addr>().is_ok());
    assert!(ips[1].parse::<std::net::Ipv6Addr>().is_ok());
    assert_eq!(spec.ip_families.unwrap(), vec!["IPv4", "IPv6"]);
    let addr: Api<IPAddress> = Api::all(client.clone());
    let v6 = addr.get(&ips[1]).await.unwrap();
    assert_eq!(
        v6.metadata.labels.unwrap()["ipaddress.kubernetes.io/ip-family"],
        "IPv6"
    );
    sim.shutdown().await;
}

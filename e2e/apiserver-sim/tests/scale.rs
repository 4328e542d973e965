//! 100,000 Services: LIST (whole and paginated) stays correct. Timing is measured by
//! `cargo run --release -p apiserver-sim --example scale`, not asserted here.
#![allow(clippy::unwrap_used)]

mod common;

use common::start;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::ListParams;
use serde_json::json;

const COUNT: usize = 100_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_100k_services() {
    let sim = start().await;
    for i in 0..COUNT {
        let ns = format!("ns-{}", i % 100);
        sim.backdoor()
            .put(json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": format!("svc-{i:06}"), "namespace": ns, "labels": {"shard": (i % 10).to_string()}},
                "spec": {
                    "type": "ClusterIP",
                    "clusterIP": format!("10.{}.{}.{}", 96 + (i >> 16), (i >> 8) & 255, i & 255),
                    "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]
                }
            }))
            .unwrap();
    }
    let api: Api<Service> = Api::all(sim.client());
    let all = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(all.items.len(), COUNT);

    // Paginated, as kube-runtime's watcher lists.
    let mut total = 0;
    let mut params = ListParams::default().limit(5000);
    loop {
        let page = api.list(&params).await.unwrap();
        total += page.items.len();
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => {
                params = ListParams::default().limit(5000).continue_token(&c)
            }
            _ => break,
        }
    }
    assert_eq!(total, COUNT);

    let shard = api
        .list(&ListParams::default().labels("shard=3"))
        .await
        .unwrap();
    assert_eq!(shard.items.len(), COUNT / 10);
    let one_ns: Api<Service> = Api::namespaced(sim.client(), "ns-7");
    assert_eq!(
        one_ns
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .len(),
        COUNT / 100
    );
    sim.shutdown().await;
}

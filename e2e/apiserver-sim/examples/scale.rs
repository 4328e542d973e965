//! Measures the simulator with 100,000 Services: bulk load, full LIST through kube-rs,
//! paginated LIST, memory, and the rate of Service creates with allocation over HTTPS.
//!
//! `cargo run --release -p apiserver-sim --example scale`

use std::time::Instant;

use apiserver_sim::{Sim, SimConfig};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::json;

fn rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    const COUNT: usize = 100_000;
    let sim = Sim::start(SimConfig::default()).await?;
    let before = rss_mib();
    let t = Instant::now();
    for i in 0..COUNT {
        sim.backdoor().put(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": format!("svc-{i:06}"), "namespace": format!("ns-{}", i % 100), "labels": {"app": format!("app-{}", i % 1000)}},
            "spec": {
                "type": "ClusterIP",
                "clusterIP": format!("10.{}.{}.{}", 96 + (i >> 16), (i >> 8) & 255, i & 255),
                "clusterIPs": [format!("10.{}.{}.{}", 96 + (i >> 16), (i >> 8) & 255, i & 255)],
                "ipFamilies": ["IPv4"], "ipFamilyPolicy": "SingleStack",
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
                "sessionAffinity": "None", "internalTrafficPolicy": "Cluster"
            }
        }))?;
    }
    println!("backdoor put {COUNT} services: {:.2?}", t.elapsed());
    println!("RSS growth after load: {:.0} MiB", rss_mib() - before);

    let api: Api<Service> = Api::all(sim.client());
    for round in 0..3 {
        let t = Instant::now();
        let list = api.list(&ListParams::default()).await?;
        println!(
            "kube-rs LIST all ({} items, round {round}): {:.2?}",
            list.items.len(),
            t.elapsed()
        );
    }
    let t = Instant::now();
    let req = hyper::Request::get("/api/v1/services").body(Vec::new())?;
    let text = sim.client().request_text(req).await?;
    println!(
        "raw LIST all ({} MiB of JSON, no decoding into types): {:.2?}",
        text.len() / (1024 * 1024),
        t.elapsed()
    );
    let t = Instant::now();
    let mut n = 0;
    let mut params = ListParams::default().limit(500);
    loop {
        let page = api.list(&params).await?;
        n += page.items.len();
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => {
                params = ListParams::default().limit(500).continue_token(&c)
            }
            _ => break,
        }
    }
    println!(
        "kube-rs LIST in pages of 500 ({n} items): {:.2?}",
        t.elapsed()
    );

    // Creates through the API, with ClusterIP allocation and IPAddress objects.
    let nss: Api<Namespace> = Api::all(sim.client());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": "alloc"}}))?,
    )
    .await?;
    let svcs: Api<Service> = Api::namespaced(sim.client(), "alloc");
    const CREATES: usize = 5_000;
    let t = Instant::now();
    futures::stream::iter(0..CREATES)
        .map(|i| {
            let svcs = svcs.clone();
            async move {
                let s: Service = serde_json::from_value(json!({"metadata": {"name": format!("a-{i}")}, "spec": {"ports": [{"port": 80}]}}))
                    .map_err(anyhow::Error::from)?;
                svcs.create(&PostParams::default(), &s).await.map_err(anyhow::Error::from)
            }
        })
        .buffer_unordered(16)
        .for_each(|r| async move {
            if let Err(e) = r {
                eprintln!("create failed: {e}");
            }
        })
        .await;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{CREATES} Service creates over HTTPS, 16 in flight: {secs:.2}s ({:.0}/s)",
        CREATES as f64 / secs
    );
    println!("RSS total: {:.0} MiB", rss_mib());
    sim.shutdown().await;
    Ok(())
}

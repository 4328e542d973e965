//! The loops built together through one `BuildContext`, as the runtime builds them: one watch
//! per resource whatever number of loops read it, each loop woken by its changes, and the loops
//! that write one object whole reading it from their kept copy at rest; discovery asked once.

#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::PostParams;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::section::{BuildContext, LoopSection};

/// Reads (get, list) the loops sent, not counting watches.
fn reads(sim: &apiserver_sim::Sim) -> usize {
    sim.requests()
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "get" | "list"))
        .count()
}

type Woken = Arc<std::sync::atomic::AtomicUsize>;

/// The loops of `sections` built through one context, their triggers polled as the runner polls
/// them, each counting its loop's wake-ups.
fn started(
    sim: &apiserver_sim::Sim,
    sections: &[&dyn LoopSection],
) -> Vec<(Arc<dyn Reconciler>, Woken)> {
    let settings = common::settings(&["10.96.0.0/12"]);
    let mut registry = Registry::default();
    let loader: reconcilers::apiserver_endpoints::ConfigLoader =
        Arc::new(|| Box::pin(async { Err("no kubeconfig in this test".into()) }));
    let mut context = BuildContext::new(
        sim.client(),
        &mut registry,
        &settings,
        reconcilers::kubernetes_service::Section::default().service(),
        reconcilers::budget::CacheBudget::default(),
        loader,
    );
    let loops: Vec<Arc<dyn Reconciler>> = sections
        .iter()
        .flat_map(|section| section.build(&mut context).unwrap())
        .collect();
    assert_eq!(loops.len(), sections.len());
    loops
        .into_iter()
        .map(|built| {
            let count = Woken::default();
            for trigger in built.triggers() {
                let count = count.clone();
                tokio::spawn(trigger.for_each(move |()| {
                    count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    async {}
                }));
            }
            (built, count)
        })
        .collect()
}

/// The namespaces the Service watches were sent to ("" for every namespace).
fn service_watches(sim: &apiserver_sim::Sim) -> Vec<String> {
    let mut namespaces: Vec<String> = sim
        .requests()
        .into_iter()
        .filter(|r| r.resource == "services" && r.verb == "watch")
        .map(|r| r.namespace)
        .collect();
    namespaces.dedup();
    namespaces
}

#[tokio::test]
async fn the_loops_of_a_cluster_watch_each_resource_once_and_read_nothing_at_rest() {
    let sim = common::sim().await;
    let started = started(
        &sim,
        &[
            &reconcilers::kubernetes_service::Section::default(),
            &reconcilers::service_cidr::Section::default(),
            &reconcilers::clusterip_repair::Section::default(),
            &reconcilers::nodeport_repair::Section::default(),
        ],
    );
    let (loops, woken): (Vec<_>, Vec<_>) = started.into_iter().unzip();
    let ctx = common::ctx(&sim, false);
    common::eventually("every watch open", || async {
        ["services", "servicecidrs", "ipaddresses"]
            .iter()
            .all(|resource| sim.open_watches(resource) == 1)
    })
    .await;
    // Passes until the cluster is as the loops want it and their caches hold what they wrote.
    common::eventually("converged", || async {
        let mut quiet = true;
        for built in &loops {
            let report = built.reconcile(&ctx).await;
            quiet &= report.is_ok_and(|report| report.drift.iter().all(|d| !d.applied));
        }
        quiet
    })
    .await;
    for resource in ["services", "servicecidrs", "ipaddresses"] {
        assert_eq!(sim.open_watches(resource), 1, "{resource}");
    }
    assert_eq!(
        service_watches(&sim),
        [""],
        "the repairs read every Service"
    );
    // The ServiceCIDR loop and the ClusterIP repair (its pass and its gated trigger) all ask
    // discovery whether networking.k8s.io/v1 serves what they need: the cluster is asked once.
    let discovery = (sim.requests().iter())
        .filter(|r| r.path == "/apis/networking.k8s.io/v1")
        .count();
    assert_eq!(discovery, 1, "discovery of networking.k8s.io/v1");

    let before = reads(&sim);
    for built in &loops {
        built.reconcile(&ctx).await.unwrap();
    }
    assert_eq!(reads(&sim), before, "a pass at rest reads the caches only");

    // Another writer changes the `kubernetes` Service: the shared watch wakes the loop, which
    // reads the changed object (its kept copy is older) and repairs it.
    let services: Api<Service> = Api::namespaced(sim.client(), "default");
    let woken_before = woken[0].load(std::sync::atomic::Ordering::Relaxed);
    let mut service = services.get("kubernetes").await.unwrap();
    let spec = service.spec.as_mut().unwrap();
    spec.ports.as_mut().unwrap()[0].port = 8443;
    services
        .replace("kubernetes", &PostParams::default(), &service)
        .await
        .unwrap();
    common::eventually("the kubernetes Service loop woken", || async {
        woken[0].load(std::sync::atomic::Ordering::Relaxed) > woken_before
    })
    .await;
    common::eventually("the kubernetes Service repaired", || async {
        loops[0].reconcile(&ctx).await.unwrap();
        let service = services.get("kubernetes").await.unwrap();
        service.spec.unwrap().ports.unwrap()[0].port == 443
    })
    .await;
}

/// Without the repairs no loop reads every Service or ServiceCIDR: the shared caches watch only
/// the `kubernetes` Service and the default ServiceCIDR, as the two loops' own watches would.
#[tokio::test]
async fn without_the_repairs_the_shared_caches_watch_only_the_objects_the_loops_write() {
    let sim = common::sim().await;
    let started = started(
        &sim,
        &[
            &reconcilers::kubernetes_service::Section::default(),
            &reconcilers::service_cidr::Section::default(),
        ],
    );
    let ctx = common::ctx(&sim, false);
    common::eventually("both watches open", || async {
        sim.open_watches("services") == 1 && sim.open_watches("servicecidrs") == 1
    })
    .await;
    common::eventually("converged", || async {
        let mut quiet = true;
        for (built, _) in &started {
            let report = built.reconcile(&ctx).await;
            quiet &= report.is_ok_and(|report| report.drift.iter().all(|d| !d.applied));
        }
        quiet
    })
    .await;
    assert_eq!(
        service_watches(&sim),
        ["default"],
        "only the kubernetes Service's namespace"
    );
    let before = reads(&sim);
    for (built, _) in &started {
        built.reconcile(&ctx).await.unwrap();
    }
    assert_eq!(reads(&sim), before, "a pass at rest reads the caches only");
}

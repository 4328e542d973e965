//! `demo` scenario for the `kubernetes` endpoints: two more apiservers join next to the
//! demo's own, one is killed, one stops cleanly, the endpoint port is corrupted; each heals.
//!
//! The extra members run the real `apiserver-lease` loop in this process (their "apiservers"
//! always answer ready); the demo's controller is the leader that writes the endpoints.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Endpoints;
use kube::Api;
use kube::api::PostParams;
use prometheus_client::registry::Registry;
use reconcilers::apiserver_endpoints::{
    ApiserverLeaseLoop, EndpointsDeps, EndpointsMode, ReadinessProbe, Section, ShutdownGate,
    SystemResolver,
};
use reconcilers::section::Settings;
use reconcilers::{PassContext, Reconciler};

use crate::DemoEnv;

/// Documentation addresses (RFC 5737), so the demo never points at a real host.
const EXTRA_MEMBERS: [&str; 2] = ["192.0.2.11", "192.0.2.12"];

/// A demo member's apiserver: ready until the demo stops it.
#[derive(Default)]
struct DemoApiserver {
    stopped: std::sync::atomic::AtomicBool,
}

impl ReadinessProbe for DemoApiserver {
    fn check(&self) -> BoxFuture<'_, Result<(), reconcilers::apiserver_endpoints::NotReady>> {
        let stopped = self.stopped.load(std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            if stopped {
                Err(reconcilers::apiserver_endpoints::NotReady::Failed {
                    path: "/readyz".to_owned(),
                    reason: "connection refused (the demo stopped this apiserver)".to_owned(),
                })
            } else {
                Ok(())
            }
        })
    }
}

/// The scenario, in the shape `demo` runs.
pub fn apiserver_members<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(run(env))
}

fn millis(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

async fn listed(api: &Api<Endpoints>, name: &str) -> Result<(Vec<String>, Option<i32>), String> {
    let endpoints = api
        .get_opt(name)
        .await
        .map_err(|err| format!("cannot read Endpoints {name}: {err}"))?;
    let subset = endpoints
        .and_then(|e| e.subsets)
        .and_then(|subsets| subsets.into_iter().next());
    let ips = subset
        .as_ref()
        .and_then(|s| s.addresses.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|a| a.ip)
        .collect();
    let port = subset
        .and_then(|s| s.ports)
        .and_then(|ports| ports.first().map(|p| p.port));
    Ok((ips, port))
}

/// Poll until `done` holds for the listed addresses and port, or `limit` passes.
async fn wait_for(
    api: &Api<Endpoints>,
    name: &str,
    limit: Duration,
    what: &str,
    done: impl Fn(&[String], Option<i32>) -> bool,
) -> Result<Duration, String> {
    let started = Instant::now();
    loop {
        let (ips, port) = listed(api, name).await?;
        if done(&ips, port) {
            return Ok(started.elapsed());
        }
        if started.elapsed() > limit {
            return Err(format!(
                "{what}: not seen within {}s (endpoints now [{}], port {port:?})",
                limit.as_secs(),
                ips.join(", ")
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run(env: &DemoEnv<'_>) -> Result<String, String> {
    let section = &env.config.loops.apiserver_endpoints;
    let settings = &env.config.settings;
    if !section.enabled || section.endpoint_mode() != EndpointsMode::Lease {
        return Ok("skipped: the endpoints loop is not in lease mode".to_owned());
    }
    let service = env.config.loops.kubernetes_service.service();
    let target = Section::target(settings, &service);
    let name = target.service_name.clone();
    let port = target.port;
    let api: Api<Endpoints> = Api::namespaced(env.client.clone(), &target.namespace);
    let limit = section.lease_ttl + section.interval * 2 + Duration::from_secs(10);
    let ctx = PassContext::leading(env.client.clone(), false);

    let mut members = Vec::new();
    for (index, address) in EXTRA_MEMBERS.iter().enumerate() {
        let ip: IpAddr = address
            .parse()
            .map_err(|err| format!("demo address {address}: {err}"))?;
        let mut member_settings = Settings {
            identity: format!("demo-member-{}", index + 1),
            ..settings.clone()
        };
        member_settings.advertise_address = Some(ip);
        let apiserver = Arc::new(DemoApiserver::default());
        let deps = EndpointsDeps {
            client: env.client.clone(),
            shutdown: Arc::new(ShutdownGate::new(section, apiserver.clone())),
            readiness: apiserver.clone(),
            resolver: Arc::new(SystemResolver),
            reporter: kube::runtime::events::Reporter {
                controller: "bootstrap-controller-demo".to_owned(),
                instance: Some(member_settings.identity.clone()),
            },
            service: service.clone(),
            probed: None,
            budget: reconcilers::budget::CacheBudget::default(),
        };
        let lease_loop =
            ApiserverLeaseLoop::new(section, &member_settings, deps, &mut Registry::default())
                .ok_or_else(|| "cannot build a demo member".to_owned())?;
        let lease_loop = Arc::new(lease_loop);
        let task = {
            let lease_loop = lease_loop.clone();
            let ctx = ctx.clone();
            let interval = section.interval;
            tokio::spawn(async move {
                loop {
                    if let Err(err) = lease_loop.reconcile(&ctx).await {
                        println!("  (demo member: {err}; retrying)");
                    }
                    tokio::time::sleep(interval).await;
                }
            })
        };
        members.push((address.to_string(), lease_loop, task, apiserver));
    }
    let all: Vec<String> = members.iter().map(|(a, _, _, _)| a.clone()).collect();
    let joined = wait_for(&api, &name, limit, "two more apiservers join", |ips, _| {
        all.iter().all(|a| ips.contains(a))
    })
    .await?;
    let (ips, _) = listed(&api, &name).await?;
    println!(
        "  +{}  two more apiservers joined; endpoints: [{}]",
        millis(joined),
        ips.join(", ")
    );

    let mut members = members.into_iter();
    let (killed, _, killed_task, _) = members
        .next()
        .ok_or_else(|| "demo members missing".to_owned())?;
    killed_task.abort();
    println!(
        "  killed {killed} (no goodbye: its Lease just stops being renewed; TTL {}s)",
        section.lease_ttl.as_secs()
    );
    let killed_gone = wait_for(
        &api,
        &name,
        limit,
        "the killed member is removed",
        |ips, _| !ips.contains(&killed),
    )
    .await?;
    println!(
        "  +{}  {killed} removed: its Lease expired",
        millis(killed_gone)
    );

    let (stopped, stopped_loop, stopped_task, stopped_apiserver) = members
        .next()
        .ok_or_else(|| "demo members missing".to_owned())?;
    stopped_task.abort();
    let stop_started = Instant::now();
    // The node goes away: its apiserver stops with the controller, so the controller withdraws
    // (a controller restarting next to a ready apiserver would keep its Lease).
    stopped_apiserver
        .stopped
        .store(true, std::sync::atomic::Ordering::SeqCst);
    stopped_loop
        .shutdown(&ctx)
        .await
        .map_err(|err| format!("clean stop of {stopped}: {err}"))?;
    println!(
        "  stopped {stopped} with its apiserver (SIGTERM, /readyz failing: it deletes its Lease)"
    );
    wait_for(
        &api,
        &name,
        limit,
        "the stopped member is removed",
        |ips, _| !ips.contains(&stopped),
    )
    .await?;
    let stopped_gone = stop_started.elapsed();
    println!("  +{}  {stopped} removed", millis(stopped_gone));

    let mut endpoints = api
        .get(&name)
        .await
        .map_err(|err| format!("cannot read Endpoints {name}: {err}"))?;
    if let Some(p) = endpoints
        .subsets
        .as_mut()
        .and_then(|s| s.first_mut())
        .and_then(|s| s.ports.as_mut())
        .and_then(|p| p.first_mut())
    {
        p.port = 443;
    }
    api.replace(&name, &PostParams::default(), &endpoints)
        .await
        .map_err(|err| format!("cannot corrupt the Endpoints port: {err}"))?;
    println!(
        "  set the Endpoints port to 443 (upstream never repairs this, kubernetes/kubernetes#104252)"
    );
    let healed = wait_for(&api, &name, limit, "the port is repaired", |_, p| {
        p == Some(port)
    })
    .await?;
    println!("  +{}  port back to {port}", millis(healed));

    Ok(format!(
        "killed member removed after {}, cleanly stopped member after {}, port repaired after {}",
        millis(killed_gone),
        millis(stopped_gone),
        millis(healed)
    ))
}

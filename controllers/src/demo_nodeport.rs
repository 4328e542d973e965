//! The demo's NodePort scenario: two Services that share a node port and one outside the range,
//! written straight into the simulator's store (a real apiserver refuses both, but an etcd
//! restore or a bug leaves them behind), and the repair's events for each.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::events::v1::Event;
use kube::Api;

use crate::demo::{DemoEnv, REPAIR_TIMEOUT, millis};

/// The Services the scenario writes: (name, nodePort).
const SERVICES: [(&str, i32); 3] = [
    ("demo-np-first", 30080),
    ("demo-np-second", 30080),
    ("demo-np-outside", 40000),
];

pub fn node_ports<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(run(env))
}

async fn run(env: &DemoEnv<'_>) -> Result<String, String> {
    if !env.config.loops.node_port_repair.enabled {
        return Ok("skipped: the nodeport-repair loop is disabled".to_owned());
    }
    let started = Instant::now();
    for (name, node_port) in SERVICES {
        env.sim
            .backdoor()
            .put(serde_json::json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"type": "NodePort", "ports": [{"port": 80, "protocol": "TCP", "nodePort": node_port}]}
            }))
            .map_err(|err| format!("cannot write Service {name}: {err}"))?;
    }
    println!(
        "  wrote Services demo-np-first and demo-np-second (both nodePort 30080) and demo-np-outside (nodePort 40000, outside {})",
        env.config.service_node_port_range
    );
    let events: Api<Event> = Api::all(env.client.clone());
    let wanted = [
        ("PortAlreadyAllocated", "demo-np-second"),
        ("PortOutOfRange", "demo-np-outside"),
    ];
    let mut seen = Vec::new();
    let deadline = started + REPAIR_TIMEOUT;
    while seen.len() < wanted.len() {
        if Instant::now() > deadline {
            return Err(format!(
                "no event for {:?} within {}s",
                wanted
                    .iter()
                    .filter(|w| !seen.contains(*w))
                    .collect::<Vec<_>>(),
                REPAIR_TIMEOUT.as_secs()
            ));
        }
        let list = events
            .list(&Default::default())
            .await
            .map_err(|err| format!("cannot list events: {err}"))?;
        for event in list.items {
            let about = event.regarding.as_ref().and_then(|r| r.name.as_deref());
            for want in wanted {
                if event.reason.as_deref() == Some(want.0)
                    && about == Some(want.1)
                    && !seen.contains(&want)
                {
                    println!(
                        "  +{}  {} on Service {}: {}",
                        millis(started.elapsed()),
                        want.0,
                        want.1,
                        event.note.as_deref().unwrap_or_default()
                    );
                    seen.push(want);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("  each problem is reported once, not on every pass; no Service is changed");
    println!(
        "  where to look: kubectl get events -A --field-selector reason=PortAlreadyAllocated;"
    );
    println!(
        "    bootstrap-controller check (exits 1 and names both); /metrics bootstrap_nodeport_repair_*"
    );
    Ok(format!(
        "duplicate and out-of-range port reported after {}",
        millis(started.elapsed())
    ))
}

//! The demo's NodePort scenario: two Services that share a node port and one outside the range,
//! written straight into the simulator's store (a real apiserver refuses both, but an etcd
//! restore or a bug leaves them behind), and the repair's events for each.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use k8s_openapi::api::events::v1::Event;
use kube::Api;

use crate::{DemoEnv, REPAIR_TIMEOUT, millis};

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
        env.config.settings.node_port_range
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

/// An etcd the demo starts when one is on `PATH`, for the NodePort repair's etcd mode; stopped
/// and its data removed on drop.
pub struct DemoEtcd {
    child: std::process::Child,
    dir: std::path::PathBuf,
    pub url: String,
}

impl DemoEtcd {
    /// Starts `etcd` on free loopback ports; `None` when there is none on `PATH` or it does not
    /// come up.
    pub async fn start() -> Option<Self> {
        let binary = std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("etcd"))
                .find(|candidate| candidate.is_file())
        })?;
        let free_port = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|listener| listener.local_addr())
                .map(|addr| addr.port())
                .ok()
        };
        let (client, peer) = (free_port()?, free_port()?);
        let dir = std::env::temp_dir().join(format!("bootstrap-demo-etcd-{}", std::process::id()));
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let child = std::process::Command::new(binary)
            .arg("--name=demo")
            .arg(format!("--data-dir={}", dir.display()))
            .arg(format!("--listen-client-urls={url}"))
            .arg(format!("--advertise-client-urls={url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=demo={peer_url}"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let etcd = DemoEtcd { child, dir, url };
        let store = reconcilers::legacy_alloc::etcd::EtcdStore::new(etcd.config());
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.get("/probe").await.is_err() {
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Some(etcd)
    }

    fn config(&self) -> reconcilers::legacy_alloc::etcd::EtcdConfig {
        reconcilers::legacy_alloc::etcd::EtcdConfig {
            servers: vec![self.url.clone()],
            ..Default::default()
        }
    }
}

impl Drop for DemoEtcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn etcd_bitmap<'a>(env: &'a DemoEnv<'a>) -> BoxFuture<'a, Result<String, String>> {
    Box::pin(repair_bitmap(env))
}

/// Drops port 30080, held by demo-np-first, from kube-apiserver's NodePort bitmap in etcd and
/// waits for the repair to set it again.
async fn repair_bitmap(env: &DemoEnv<'_>) -> Result<String, String> {
    use reconcilers::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
    use reconcilers::legacy_alloc::etcd::{EtcdStore, RangeKey};
    let Some(etcd) = env.config.settings.etcd() else {
        return Ok("skipped: no etcd on PATH (Debian: apt-get install etcd-server)".to_owned());
    };
    if !env.config.loops.node_port_repair.enabled {
        return Ok("skipped: the nodeport-repair loop is disabled".to_owned());
    }
    let key = etcd.key(RangeKey::NodePorts);
    let store = EtcdStore::new(etcd.clone());
    let range = &env.config.settings.node_port_range;
    let size = usize::from(range.last() - range.base()) + 1;
    let offset = usize::from(30080 - range.base());
    let holds_30080 = |value: &[u8]| {
        RangeAllocation::decode(value)
            .map(|decoded| bitmap_from_bytes(&decoded.data, size).contains(offset))
            .unwrap_or(false)
    };
    let deadline = Instant::now() + REPAIR_TIMEOUT;
    let stored = loop {
        match store.get(&key).await {
            Ok(Some(stored)) if holds_30080(&stored.value) => break stored,
            Ok(_) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(_) => return Err(format!("{key} never held port 30080")),
            Err(err) => return Err(format!("cannot read {key}: {err}")),
        }
    };
    let decoded = RangeAllocation::decode(&stored.value).map_err(|err| err.to_string())?;
    let mut bits = bitmap_from_bytes(&decoded.data, size);
    bits.set(offset, false);
    let started = Instant::now();
    let written = store
        .compare_and_swap(
            &key,
            Some(stored.mod_revision),
            decoded.with_data(bitmap_to_bytes(&bits)).encode(),
        )
        .await
        .map_err(|err| format!("cannot write {key}: {err}"))?;
    if !written {
        return Err(format!("{key} changed while the demo wrote it"));
    }
    println!("  cleared port 30080 (held by demo-np-first) in {key}, as a lost allocation would");
    loop {
        if let Ok(Some(stored)) = store.get(&key).await
            && holds_30080(&stored.value)
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("port 30080 was not set again in {key}"));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!(
        "  +{}  set again by the repair (woken by its watch on the key; written by compare-and-swap)",
        millis(started.elapsed())
    );
    let events: Api<Event> = Api::all(env.client.clone());
    loop {
        let list = events
            .list(&Default::default())
            .await
            .map_err(|err| format!("cannot list events: {err}"))?;
        if let Some(event) = list.items.iter().find(|event| {
            event.reason.as_deref() == Some("PortNotAllocated")
                && event.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("demo-np-first")
        }) {
            println!(
                "  +{}  PortNotAllocated on Service demo-np-first: {}",
                millis(started.elapsed()),
                event.note.as_deref().unwrap_or_default()
            );
            break;
        }
        if Instant::now() > deadline {
            return Err("no PortNotAllocated event about demo-np-first".to_owned());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(format!(
        "the lost allocation repaired in etcd after {}",
        millis(started.elapsed())
    ))
}

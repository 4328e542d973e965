//! Shared helpers for the reconcilers' integration tests against the in-process simulator.
#![allow(dead_code, clippy::unwrap_used)]

pub mod etcd;

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use apiserver_sim::{Sim, SimConfig};
use futures::future::BoxFuture;
use kube::runtime::events::Reporter;
use reconcilers::PassContext;
use reconcilers::apiserver_endpoints::{NotReady, ReadinessProbe, Resolver};
use reconcilers::section::Settings;

pub async fn sim() -> Sim {
    Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        ..SimConfig::default()
    })
    .await
    .expect("simulator starts")
}

pub fn ctx(sim: &Sim, dry_run: bool) -> PassContext {
    PassContext::leading(sim.client(), dry_run)
}

/// The events of `reason` the simulator holds, read through its backdoor.
pub fn events_of(sim: &Sim, reason: &str) -> Vec<serde_json::Value> {
    sim.backdoor()
        .list("events.events.k8s.io")
        .unwrap()
        .into_iter()
        .filter(|event| event["reason"] == reason)
        .collect()
}

/// The drift of `kind` in `report`.
pub fn drift_of_kind<'a>(
    report: &'a reconcilers::PassReport,
    kind: &str,
) -> Vec<&'a reconcilers::Drift> {
    report
        .drift
        .iter()
        .filter(|drift| drift.kind == kind)
        .collect()
}

pub fn reporter() -> Reporter {
    Reporter {
        controller: "bootstrap-controller-test".into(),
        instance: None,
    }
}

/// The settings outside `loops` a loop is built with: `ranges` as `serviceClusterIPRange`
/// (none: read from the cluster), otherwise the controller's defaults and a fixed identity.
/// Tests change the fields they are about.
pub fn settings(ranges: &[&str]) -> Settings {
    Settings {
        service_ranges: ranges.iter().map(|range| range.parse().unwrap()).collect(),
        identity: "test-replica".to_owned(),
        ..Settings::default()
    }
}

/// A readiness probe the test flips.
#[derive(Default)]
pub struct Flag(AtomicBool);

impl Flag {
    pub fn new(ready: bool) -> Self {
        Flag(AtomicBool::new(ready))
    }

    pub fn set(&self, ready: bool) {
        self.0.store(ready, Ordering::SeqCst);
    }
}

impl ReadinessProbe for Flag {
    fn check(&self) -> BoxFuture<'_, Result<(), NotReady>> {
        let ready = self.0.load(Ordering::SeqCst);
        Box::pin(async move {
            if ready {
                Ok(())
            } else {
                Err(NotReady::Answered {
                    path: "/readyz".to_owned(),
                    status: http::StatusCode::SERVICE_UNAVAILABLE,
                })
            }
        })
    }
}

/// A resolver whose answers the test sets.
#[derive(Default)]
pub struct FakeResolver(Mutex<BTreeMap<String, Result<Vec<IpAddr>, String>>>);

impl FakeResolver {
    pub fn answer(&self, name: &str, answer: Result<Vec<IpAddr>, String>) {
        self.0.lock().unwrap().insert(name.to_owned(), answer);
    }
}

impl Resolver for FakeResolver {
    fn resolve<'a>(&'a self, host: &'a str) -> BoxFuture<'a, io::Result<Vec<IpAddr>>> {
        let answer = self
            .0
            .lock()
            .unwrap()
            .get(host)
            .cloned()
            .unwrap_or_else(|| Err(format!("{host}: no such host")));
        Box::pin(async move { answer.map_err(io::Error::other) })
    }
}

pub fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Requests that changed something (not reads, not events).
pub fn writes(sim: &Sim) -> Vec<String> {
    sim.requests()
        .into_iter()
        .filter(|r| {
            matches!(
                r.verb.as_str(),
                "create" | "update" | "patch" | "delete" | "deletecollection"
            )
        })
        .filter(|r| r.resource != "events")
        .map(|r| format!("{} {} {}/{}", r.verb, r.resource, r.namespace, r.name))
        .collect()
}

/// Poll `check` until it is true, failing after a generous timeout.
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    if let Err(err) = test_support::eventually(what, Duration::from_secs(25), check).await {
        panic!("{err}");
    }
}

/// Reasons of the events.k8s.io events recorded so far.
pub fn event_reasons(sim: &Sim) -> Vec<String> {
    sim.backdoor()
        .list("events.events.k8s.io")
        .unwrap()
        .iter()
        .filter_map(|e| e["reason"].as_str().map(str::to_owned))
        .collect()
}

/// Discovery requests for networking.k8s.io/v1 (whether the cluster serves ServiceCIDRs) so far.
pub fn networking_discoveries(sim: &Sim) -> usize {
    sim.requests()
        .iter()
        .filter(|r| {
            r.path
                .trim_end_matches('/')
                .ends_with("/apis/networking.k8s.io/v1")
        })
        .count()
}

/// What a test's subscriber wrote.
#[derive(Clone, Default)]
pub struct Captured(std::sync::Arc<Mutex<Vec<u8>>>);

impl io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Captured {
    /// Captures the lines at warn level and above logged on this thread until the guard drops.
    pub fn warnings() -> (Self, tracing::subscriber::DefaultGuard) {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .with_writer(move || writer.clone())
            .finish();
        (captured, tracing::subscriber::set_default(subscriber))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }

    /// The lines holding `needle`.
    pub fn count(&self, needle: &str) -> usize {
        self.text()
            .lines()
            .filter(|line| line.contains(needle))
            .count()
    }
}

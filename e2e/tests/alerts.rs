//! End to end: the chart's alerts in a real Prometheus (Debian's `prometheus` package) scraping
//! the real controller running against the simulator. Drift the controller cannot fix (two
//! Services on one node port, a cluster IP outside the range, both written through the
//! simulator's backdoor) makes BootstrapNodePortConflict and BootstrapClusterIPConflict fire in
//! Prometheus's alerts API; removing the drift resolves them. The rules are the chart's file with
//! every `for` shortened, scraped and evaluated every second. The same run checks that every
//! metric the dashboard and the rules name is in the controller's real `/metrics` (but the
//! tenant manager's, which only management mode has), that every rule evaluates without error,
//! and that every dashboard query runs, with the Tenant variable at All (`.*`, which matches the
//! series of a single cluster, without a tenant label).

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use common::{ControllerProcess, Target, eventually, free_port, node_port_service};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams};

/// Prometheus scrapes and evaluates every second; each wait is bounded by this.
const ALERT_WAIT: Duration = Duration::from_secs(90);

fn chart_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../charts/bootstrap-controller/files")
        .join(name)
}

/// The chart's rules with every `for` set to one second.
fn short_rules() -> Result<String> {
    let rules = std::fs::read_to_string(chart_file("prometheus-rules.yaml"))?;
    let mut out = String::new();
    let mut changed = 0;
    for line in rules.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("for: ") {
            let indent = &line[..line.len() - trimmed.len()];
            out += &format!("{indent}for: 1s\n");
            changed += 1;
        } else {
            out += line;
            out.push('\n');
        }
    }
    ensure!(
        changed >= 10,
        "expected a `for` per alert, changed {changed}"
    );
    Ok(out)
}

/// A Prometheus of the test's own, on a free loopback port; killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Result<Self> {
        let binary = which("prometheus").context(
            "the `prometheus` binary is not on PATH: this test needs it (Debian: \
             `apt-get install prometheus`)",
        )?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("rules.yaml"), short_rules()?)?;
        std::fs::write(
            dir.path().join("prometheus.yml"),
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
                 rule_files: [rules.yaml]\n\
                 scrape_configs:\n  - job_name: bootstrap-controller\n    \
                 static_configs:\n      - targets: ['{target}']\n"
            ),
        )?;
        let addr = free_port()?;
        let log = std::fs::File::create(dir.path().join("prometheus.log"))?;
        let child = Command::new(binary)
            .current_dir(dir.path())
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting prometheus")?;
        Ok(Prometheus { child, addr, dir })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    async fn get(&self, path: &str) -> Result<serde_json::Value> {
        let (status, body) = common::admin_get(self.addr, path).await?;
        ensure!(status == 200, "GET {path}: {status} {body}");
        Ok(serde_json::from_str(&body)?)
    }

    /// The alerts Prometheus holds (pending or firing) named `name`.
    async fn alerts(&self, name: &str) -> Result<Vec<serde_json::Value>> {
        let alerts = self.get("/api/v1/alerts").await?;
        Ok(alerts["data"]["alerts"]
            .as_array()
            .context("data.alerts")?
            .iter()
            .filter(|alert| alert["labels"]["alertname"] == name)
            .cloned()
            .collect())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- prometheus log ----\n{}", self.log());
        }
    }
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

/// Every `bootstrap_...` metric name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("bootstrap_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// The PromQL of every dashboard panel.
fn dashboard_queries() -> Result<Vec<String>> {
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart_file("dashboard.json"))?)?;
    let mut queries = Vec::new();
    let mut panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .context("panels")?
        .iter()
        .collect();
    while let Some(panel) = panels.pop() {
        if let Some(nested) = panel["panels"].as_array() {
            panels.extend(nested);
        }
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().context("expr")?.to_owned());
        }
    }
    Ok(queries)
}

#[tokio::test]
async fn alerts_fire_in_a_real_prometheus_and_resolve_when_the_drift_is_removed() -> Result<()> {
    tokio::time::timeout(Duration::from_secs(300), scenario())
        .await
        .context("the scenario did not finish within 5 minutes")?
}

async fn scenario() -> Result<()> {
    let target = Target::start().await?;
    // A real kube-apiserver refuses the drift this test needs.
    let Some(sim) = target.sim("the whole test: drift written by the backdoor") else {
        return Ok(());
    };
    let client = target.client().await?;
    let services: Api<Service> = Api::namespaced(client.clone(), "default");
    let slices: Api<EndpointSlice> = Api::namespaced(client, "default");

    let range = target.service_range().await?;
    let mut controller = ControllerProcess::start(
        target.kubeconfig(),
        &[
            "--service-cluster-ip-range",
            &range,
            "--endpoint-reconciler-type",
            "lease",
            "--advertise-address",
            "192.0.2.10",
        ],
    )?;
    controller.wait_ready().await?;
    let prometheus = Prometheus::start(controller.admin)?;
    eventually("Prometheus scrapes the controller", ALERT_WAIT, || async {
        let up = prometheus.get("/api/v1/query?query=up").await?;
        Ok(up["data"]["result"]
            .as_array()
            .is_some_and(|result| result.iter().any(|sample| sample["value"][1] == "1"))
            .then_some(()))
    })
    .await
    .with_context(|| prometheus.log())?;

    // Families that appear only once something happened: a repair woken by a watch event
    // through a failed pass (heal time, errors), and an endpoints repair.
    sim.admin(
        "POST",
        "/sim/faults",
        Some(serde_json::json!({
            "verb": "create", "resource": "services",
            "fault": {"type": "error", "code": 500}, "trigger": {"next": 1}
        })),
    )
    .await?;
    services
        .delete("kubernetes", &DeleteParams::default())
        .await?;
    eventually("the kubernetes Service is back", ALERT_WAIT, || async {
        Ok(services.get_opt("kubernetes").await?.map(drop))
    })
    .await?;
    // The refusal happened: a spent `next` rule leaves the simulator's list.
    let rules: serde_json::Value =
        serde_json::from_str(&sim.admin("GET", "/sim/faults", None).await?)?;
    ensure!(
        rules.as_array().is_some_and(Vec::is_empty),
        "the injected 500 on creating the Service was never spent: {rules}"
    );
    slices
        .patch(
            "kubernetes",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "ports": [{"name": "https", "port": 1234, "protocol": "TCP"}]
            })),
        )
        .await?;

    // Drift only a human can fix.
    for service in [
        node_port_service("a-first", 30080),
        node_port_service("b-second", 30080),
    ] {
        sim.admin("PUT", "/sim/backdoor", Some(service)).await?;
    }
    // A cluster IP outside every service range (TEST-NET).
    const OUTSIDE: &str = "192.0.2.5";
    sim.admin(
        "PUT",
        "/sim/backdoor",
        Some(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "outside", "namespace": "default", "uid": "uid-outside"},
            "spec": {"clusterIP": OUTSIDE, "clusterIPs": [OUTSIDE],
                     "ports": [{"port": 80, "protocol": "TCP"}]}
        })),
    )
    .await?;

    for (alert, kind, anchor) in [
        (
            "BootstrapNodePortConflict",
            "nodeport_duplicate",
            "#bootstrapnodeportconflict",
        ),
        (
            "BootstrapClusterIPConflict",
            "clusterip_out_of_range",
            "#bootstrapclusteripconflict",
        ),
    ] {
        let firing = eventually(&format!("{alert} firing"), ALERT_WAIT, || async {
            Ok(prometheus
                .alerts(alert)
                .await?
                .into_iter()
                .find(|a| a["state"] == "firing"))
        })
        .await
        .with_context(|| controller.log())?;
        ensure!(
            firing["labels"]["kind"] == kind && firing["labels"]["severity"] == "warning",
            "{alert}: {firing}"
        );
        ensure!(
            firing["annotations"]["runbook_url"]
                .as_str()
                .is_some_and(|url| url.ends_with(anchor)),
            "{alert}: {firing}"
        );
    }

    // Every metric the dashboard and the rules name is in the real scrape.
    let (_, scrape) = controller.admin_get("/metrics").await?;
    let exported: BTreeSet<String> = scrape
        .lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect();
    let mut named = BTreeSet::new();
    for query in dashboard_queries()? {
        named.extend(metric_names(&query));
    }
    let rules = std::fs::read_to_string(chart_file("prometheus-rules.yaml"))?;
    named.extend(metric_names(&rules));
    ensure!(named.len() >= 20, "too few names found: {named:?}");
    // The tenant manager's own metrics exist only in management mode (`--tenants-secret-selector`,
    // `TenantMetrics::register` in controllers/src/tenants/metrics.rs), and so do a tenant's
    // cache budget breaches (only a tenant's budget is limited, reconcilers/src/budget.rs); this
    // controller runs one cluster.
    for management_only in [
        "bootstrap_tenants",
        "bootstrap_tenant_config_errors_total",
        "bootstrap_tenant_starts_total",
        "bootstrap_tenant_stops_total",
        "bootstrap_cache_over_budget_total",
    ] {
        ensure!(
            named.remove(management_only),
            "{management_only} is no longer named by the dashboard or the rules"
        );
    }
    let missing: Vec<_> = named.difference(&exported).collect();
    ensure!(
        missing.is_empty(),
        "the dashboard or the rules name metrics the binary does not export: {missing:?}\n{scrape}"
    );

    // Every rule evaluates without error, and so does every dashboard query (what promtool's
    // parse cannot see: matching errors, wrong types at run time).
    // A rule seen failing fails the test: an error returned from the poll would only be retried.
    let failed_rules = std::sync::Mutex::new(None);
    eventually("every rule evaluated without error", ALERT_WAIT, || async {
        let rules = prometheus.get("/api/v1/rules").await?;
        let health: Vec<(String, String)> = rules["data"]["groups"]
            .as_array()
            .context("groups")?
            .iter()
            .flat_map(|group| group["rules"].as_array().cloned().unwrap_or_default())
            .map(|rule| {
                (
                    rule["name"].as_str().unwrap_or_default().to_owned(),
                    format!("{} {}", rule["health"], rule["lastError"]),
                )
            })
            .collect();
        let bad: Vec<_> = health
            .iter()
            .filter(|(_, health)| !health.starts_with("\"ok\""))
            .collect();
        if bad.iter().any(|(_, health)| health.starts_with("\"err")) {
            *failed_rules
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(format!("{bad:?}"));
            return Ok(Some(()));
        }
        Ok((health.len() >= 10 && bad.is_empty()).then_some(()))
    })
    .await?;
    if let Some(bad) = failed_rules
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
    {
        bail!("rules failed to evaluate: {bad}");
    }
    let mut empty = Vec::new();
    for query in dashboard_queries()? {
        let promql = query
            .replace("$__rate_interval", "1m")
            .replace("\"$job\"", "\".+\"")
            .replace("\"$tenant\"", "\".*\"");
        let answer = prometheus
            .get(&format!("/api/v1/query?query={}", url_encode(&promql)))
            .await
            .with_context(|| format!("dashboard query {promql}"))?;
        ensure!(answer["status"] == "success", "{promql}: {answer}");
        if answer["data"]["result"]
            .as_array()
            .is_none_or(|result| result.is_empty())
        {
            empty.push(promql);
        }
    }
    ensure!(
        !empty
            .iter()
            .any(|q| q.contains("bootstrap_apiserver_endpoints_members")
                || q.contains("bootstrap_loop_passes_total")),
        "the endpoints members and the passes show no data: {empty:?}"
    );

    // The drift goes; so do the alerts.
    services
        .delete("b-second", &DeleteParams::default())
        .await?;
    services.delete("outside", &DeleteParams::default()).await?;
    for alert in ["BootstrapNodePortConflict", "BootstrapClusterIPConflict"] {
        eventually(&format!("{alert} resolved"), ALERT_WAIT, || async {
            Ok(prometheus.alerts(alert).await?.is_empty().then_some(()))
        })
        .await
        .with_context(|| controller.log())?;
    }
    ensure!(
        controller.is_running(),
        "controller died:\n{}",
        controller.log()
    );
    if !prometheus
        .alerts("BootstrapControllerDown")
        .await?
        .is_empty()
    {
        bail!("BootstrapControllerDown while the controller is scraped");
    }
    Ok(())
}

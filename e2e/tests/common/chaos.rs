//! The chaos harness (see `tests/chaos.rs` for what it checks): shared by the short-mode test and
//! the long-mode bench.
use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::{ConfigFile, ControllerProcess, SimProcess, run_controller, service_ip};
use anyhow::{Context, Result, bail, ensure};
use k8s_openapi::jiff::Timestamp;
use serde_json::{Value, json};

const CONFIG: &str = "\
endpointReconcilerType: lease
loops:
  systemNamespaces: {interval: 2s}
  kubernetesService: {interval: 2s}
  apiserverEndpoints: {interval: 2s, leaseTTL: 6s}
  serviceCIDR: {interval: 2s}
  clusterIPRepair: {interval: 2s, orphanGracePeriod: 5s}
  nodePortRepair: {interval: 2s}
";

/// Seconds within which a converged member has renewed its Lease: more than its interval (2 s),
/// well within its TTL (6 s), so that `check` run next finds it live by its renewTime.
const MEMBER_RENEWED_WITHIN: i64 = 3;

/// Offsets in the simulator's service range (see [`service_ip`]): Service web's cluster IP, in
/// the middle of the five addresses whose IPAddresses the breakage deletes; and where the orphan
/// IPAddresses it plants start.
const WEB: u32 = 22;
const ORPHANS: u32 = 250 * 256;

/// Leader-only objects: a write of one of these by two replicas in the same second means two
/// writers.
const LEADER_ONLY: &[&str] = &[
    "namespaces",
    "services",
    "endpoints",
    "endpointslices",
    "servicecidrs",
    "ipaddresses",
];

/// xorshift64*: reproducible from the printed seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn replica_args(sim: &SimProcess, config: &ConfigFile, n: usize) -> Vec<String> {
    [
        "--config",
        config.path.as_str(),
        "--service-cluster-ip-range",
        sim.service_range.as_str(),
        "--advertise-address",
        &format!("10.0.0.{n}"),
        "--leader-elect-lease-duration",
        "4s",
        "--leader-elect-renew-grace",
        "2s",
        "--leader-elect-identity",
        &format!("replica-{n}"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect()
}

fn start(sim: &SimProcess, config: &ConfigFile, n: usize) -> Result<ControllerProcess> {
    let args = replica_args(sim, config, n);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    ControllerProcess::start(&sim.kubeconfig, &args)
}

async fn backdoor_get(sim: &SimProcess, path: &str) -> Result<Option<Value>> {
    match sim
        .admin("GET", &format!("/sim/backdoor/{path}"), None)
        .await
    {
        Ok(text) => Ok(Some(serde_json::from_str(&text)?)),
        Err(err) if err.to_string().contains("NotFound") || err.to_string().contains("404") => {
            Ok(None)
        }
        Err(err) => Err(err),
    }
}

async fn backdoor_put(sim: &SimProcess, object: Value) -> Result<()> {
    sim.admin("PUT", "/sim/backdoor", Some(object))
        .await
        .map(drop)
}

async fn backdoor_delete(sim: &SimProcess, path: &str) -> Result<()> {
    let _ = sim
        .admin("DELETE", &format!("/sim/backdoor/{path}"), None)
        .await;
    Ok(())
}

fn endpoint_ips(endpoints: &Value) -> Vec<String> {
    endpoints["subsets"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|s| s["addresses"].as_array().into_iter().flatten())
        .filter_map(|a| a["ip"].as_str().map(str::to_owned))
        .collect()
}

/// The ready addresses of an EndpointSlice, sorted.
fn slice_ips(slice: &Value) -> Vec<String> {
    let mut ips: Vec<String> = slice["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["conditions"]["ready"] != json!(false))
        .flat_map(|e| e["addresses"].as_array().into_iter().flatten())
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect();
    ips.sort();
    ips
}

/// Whether an Endpoints object lists no ready address: `subsets` absent (what a replace with
/// `subsets: None` leaves), `null` or `[]`, or subsets whose `addresses` are absent or empty.
pub fn endpoints_emptied(endpoints: &Value) -> bool {
    endpoint_ips(endpoints).is_empty()
}

/// Whether an EndpointSlice lists no ready address: `endpoints` absent, `null` or `[]`, or
/// every endpoint not ready or without addresses.
pub fn slice_emptied(slice: &Value) -> bool {
    slice_ips(slice).is_empty()
}

/// The invariant "the `kubernetes` endpoints are never emptied", fed every observation of the
/// Endpoints and the EndpointSlice. A missing object is not an emptying (the breakage deletes
/// them; the repair creates them again), but an invariant that observed neither checked nothing,
/// and fails.
#[derive(Debug, Default)]
pub struct NeverEmptied {
    pub endpoints_seen: usize,
    pub slices_seen: usize,
    pub emptied: Vec<String>,
}

impl NeverEmptied {
    pub fn observe(&mut self, endpoints: Option<&Value>, slice: Option<&Value>) {
        if let Some(endpoints) = endpoints {
            self.endpoints_seen += 1;
            if endpoints_emptied(endpoints) {
                self.emptied.push(format!("Endpoints {endpoints}"));
            }
        }
        if let Some(slice) = slice {
            self.slices_seen += 1;
            if slice_emptied(slice) {
                self.emptied.push(format!("EndpointSlice {slice}"));
            }
        }
    }

    pub fn check(&self) -> Result<()> {
        ensure!(
            self.endpoints_seen > 0 && self.slices_seen > 0,
            "the kubernetes endpoints were not observed while the chaos ran ({} Endpoints, {} \
             EndpointSlice observations): nothing was checked",
            self.endpoints_seen,
            self.slices_seen
        );
        ensure!(
            self.emptied.is_empty(),
            "the kubernetes endpoints were seen emptied {} time(s), first: {}",
            self.emptied.len(),
            self.emptied[0]
        );
        Ok(())
    }
}

/// A `410 Gone` rule spent on the first watch after it is injected: the probabilistic one beside
/// it leaves no trace the request log shows (a watch answered 410 is a 200 with an `ERROR` event),
/// a spent `next` rule does (it leaves the simulator's list of rules).
fn watch_gone_once() -> Value {
    json!({"verb": "watch", "fault": {"type": "watchGone"}, "trigger": {"next": 1}})
}

/// Whether the simulator has no unspent [`watch_gone_once`] rule left: read before the faults
/// are cleared.
async fn watch_gone_spent(sim: &SimProcess) -> Result<bool> {
    let rules: Value = serde_json::from_str(&sim.admin("GET", "/sim/faults", None).await?)?;
    Ok(!rules
        .as_array()
        .into_iter()
        .flatten()
        .any(|rule| rule["fault"]["type"] == "watchGone" && rule["trigger"].get("next").is_some()))
}

/// Each kind of refusal the faults inject, with the status the request log records for it: every
/// one must have reached the controllers, or the run did not test surviving it.
const REFUSALS: &[(&str, u16)] = &[
    ("500", 500),
    ("503 with Retry-After", 503),
    ("429 with Retry-After", 429),
    ("dropped connection", 0),
];

/// The fault that gives each refusal of [`REFUSALS`] by its status.
fn refusal_fault(status: u16) -> Value {
    match status {
        0 => json!({"type": "dropConnection"}),
        503 | 429 => json!({"type": "error", "code": status, "retryAfterSeconds": 1}),
        code => json!({"type": "error", "code": code}),
    }
}

/// Makes sure every refusal of [`REFUSALS`] reaches a controller however the dice fall: the
/// random rules alone leave a few runs in a hundred without a dropped connection (about one
/// controller request in fifty meets one). For the first refusal the request log does not yet
/// show on a controller's request, a rule for the next controller request is added, one at a
/// time (two pending at once would be spent on the same request, and only one would answer).
async fn deliver_missing_refusal(sim: &SimProcess) -> Result<()> {
    let rules: Value = serde_json::from_str(&sim.admin("GET", "/sim/faults", None).await?)?;
    let pending =
        rules.as_array().into_iter().flatten().any(|rule| {
            rule["trigger"].get("next").is_some() && rule["userAgent"] == CONTROLLER_AGENT
        });
    if pending {
        return Ok(());
    }
    let requests = sim.requests().await?;
    let missing = REFUSALS.iter().find(|(_, status)| {
        !requests
            .iter()
            .any(|r| r.user_agent.contains(CONTROLLER_AGENT) && r.status == *status)
    });
    if let Some((_, status)) = missing {
        sim.admin(
            "POST",
            "/sim/faults",
            Some(
                json!({"userAgent": CONTROLLER_AGENT, "fault": refusal_fault(*status),
                        "trigger": {"next": 1}}),
            ),
        )
        .await?;
    }
    Ok(())
}

/// What every controller's `User-Agent` contains (the simulator's own and the test's clients
/// send others).
const CONTROLLER_AGENT: &str = "bootstrap-controller/";

async fn inject_faults(sim: &SimProcess) -> Result<()> {
    let rule = |fault: Value, p: f64| json!({"fault": fault, "trigger": {"probability": p}});
    for body in [
        rule(refusal_fault(500), 0.10),
        rule(refusal_fault(503), 0.10),
        rule(refusal_fault(429), 0.10),
        rule(refusal_fault(0), 0.03),
        rule(json!({"type": "latency", "millis": 150}), 0.05),
        rule(json!({"type": "cutWatchAfterEvents", "events": 3}), 0.3),
        rule(json!({"type": "watchGone"}), 0.1),
        watch_gone_once(),
    ] {
        sim.admin("POST", "/sim/faults", Some(body)).await?;
    }
    Ok(())
}

/// One breakage every loop must heal; returns what it did.
async fn break_something(
    sim: &SimProcess,
    rng: &mut Rng,
    orphans: &mut Vec<String>,
    duplicates: &mut Vec<String>,
) -> Result<String> {
    Ok(match rng.below(7) {
        0 => {
            backdoor_delete(sim, "namespaces/kube-public").await?;
            "deleted namespace kube-public".to_owned()
        }
        1 => {
            if let Some(mut svc) = backdoor_get(sim, "services/default/kubernetes").await? {
                svc["spec"]["ports"][0]["port"] = json!(8443);
                backdoor_put(sim, svc).await?;
            }
            "changed the kubernetes Service's port".to_owned()
        }
        2 => {
            backdoor_delete(sim, "endpoints/default/kubernetes").await?;
            "deleted the kubernetes Endpoints".to_owned()
        }
        3 => {
            backdoor_delete(sim, "endpointslices/default/kubernetes").await?;
            "deleted the kubernetes EndpointSlice".to_owned()
        }
        4 => {
            let ip = service_ip(&sim.service_range, WEB - 2 + rng.below(5) as u32)?;
            backdoor_delete(sim, &format!("ipaddresses/{ip}")).await?;
            format!("deleted Service web's IPAddress {ip} (if it was the one)")
        }
        5 => {
            // Node port duplicates: reported, never "repaired" by changing a Service.
            let name = format!("dup-{}", rng.below(1_000_000));
            backdoor_put(
                sim,
                json!({"apiVersion": "v1", "kind": "Service",
                       "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
                       "spec": {"type": "NodePort",
                                "ports": [{"port": 80, "protocol": "TCP", "nodePort": 31000}]}}),
            )
            .await?;
            duplicates.push(name.clone());
            format!("created Service {name} holding node port 31000 too")
        }
        _ => {
            let ip = service_ip(&sim.service_range, ORPHANS + orphans.len() as u32 + 1)?;
            backdoor_put(
                sim,
                json!({
                    "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
                    "metadata": {"name": ip, "creationTimestamp": "2026-01-01T00:00:00Z",
                                 "labels": {"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                                            "ipaddress.kubernetes.io/ip-family": "IPv4"}},
                    "spec": {"parentRef": {"group": "", "resource": "services",
                                           "namespace": "default", "name": "gone"}},
                }),
            )
            .await?;
            orphans.push(ip.clone());
            format!("created orphan IPAddress {ip}")
        }
    })
}

/// Whether every loop's objects are as they should be.
async fn converged(
    sim: &SimProcess,
    orphans: &[String],
    web_ip: &str,
    members: &[String],
) -> Result<Option<String>> {
    for ns in ["kube-system", "kube-public", "kube-node-lease", "default"] {
        if backdoor_get(sim, &format!("namespaces/{ns}"))
            .await?
            .is_none()
        {
            return Ok(Some(format!("namespace {ns} missing")));
        }
    }
    let Some(svc) = backdoor_get(sim, "services/default/kubernetes").await? else {
        return Ok(Some("kubernetes Service missing".into()));
    };
    if svc["spec"]["ports"][0]["port"] != json!(443) {
        return Ok(Some(format!(
            "kubernetes Service port {}",
            svc["spec"]["ports"][0]["port"]
        )));
    }
    let Some(endpoints) = backdoor_get(sim, "endpoints/default/kubernetes").await? else {
        return Ok(Some("Endpoints missing".into()));
    };
    let mut ips = endpoint_ips(&endpoints);
    ips.sort();
    if ips != members {
        return Ok(Some(format!("Endpoints list {ips:?}")));
    }
    // The slice is written on its own: converged only when it too lists every member (`check`
    // compares both).
    let Some(slice) = backdoor_get(sim, "endpointslices/default/kubernetes").await? else {
        return Ok(Some("EndpointSlice missing".into()));
    };
    let slice_ips = slice_ips(&slice);
    if slice_ips != members {
        return Ok(Some(format!("EndpointSlice lists {slice_ips:?}")));
    }
    // The leader counts a membership Lease's TTL from when it saw the renewal, which faults on
    // its watch delay; `check`, meeting each Lease once, counts it from its renewTime. So
    // converged also means every member has renewed its Lease lately (it renews every 2 s), not
    // only that the leader still lists it, or `check` could rightly judge one that has not
    // renewed since the faults as expired.
    for member in members {
        let path = format!("leases/kube-system/apiserver-{member}");
        let renewed = backdoor_get(sim, &path).await?.and_then(|lease| {
            lease["spec"]["renewTime"]
                .as_str()
                .and_then(|at| at.parse::<Timestamp>().ok())
        });
        let fresh =
            Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(MEMBER_RENEWED_WITHIN);
        match renewed {
            Some(at) if at >= fresh => {}
            other => return Ok(Some(format!("{path} last renewed at {other:?}"))),
        }
    }
    if backdoor_get(sim, &format!("ipaddresses/{web_ip}"))
        .await?
        .is_none()
    {
        return Ok(Some(format!("web's IPAddress {web_ip} missing")));
    }
    for ip in orphans {
        if backdoor_get(sim, &format!("ipaddresses/{ip}"))
            .await?
            .is_some()
        {
            return Ok(Some(format!("orphan {ip} still there")));
        }
    }
    Ok(None)
}

/// One chaos run; the figures are printed, the first broken invariant is the error.
pub async fn run(seed: u64, secs: u64, count: usize) -> Result<()> {
    let mut rng = Rng(seed);
    let sim = SimProcess::start(&[]).await?;
    let config = ConfigFile::new(CONFIG)?;
    let mut replicas = Vec::new();
    for n in 1..=count {
        replicas.push(start(&sim, &config, n)?);
    }
    let members: Vec<String> = (1..=count).map(|n| format!("10.0.0.{n}")).collect();
    for replica in &mut replicas {
        replica.wait_ready().await?;
    }
    // A Service with a cluster IP in the range the breakage deletes from.
    let web_ip = &service_ip(&sim.service_range, WEB)?;
    sim.admin(
        "PUT",
        "/sim/backdoor",
        Some(json!({"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "web", "namespace": "default", "uid": "uid-web"},
                    "spec": {"clusterIP": web_ip, "clusterIPs": [web_ip],
                             "ports": [{"port": 80}]}})),
    )
    .await?;
    let mut orphans = Vec::new();
    // Services sharing a node port: reported, never changed; removed before `check`, as a
    // person would after the report.
    let mut duplicates = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Some(problem) = converged(&sim, &orphans, web_ip, &members).await? {
        ensure!(
            Instant::now() < deadline,
            "never converged before the faults: {problem}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The endpoints must never be seen emptied, polled through the backdoor (which no fault
    // touches) while the chaos runs.
    let stop = AtomicBool::new(false);
    let never_emptied = Mutex::new(NeverEmptied::default());
    let endpoints_watch = async {
        while !stop.load(Ordering::Relaxed) {
            let endpoints = backdoor_get(&sim, "endpoints/default/kubernetes").await;
            let slice = backdoor_get(&sim, "endpointslices/default/kubernetes").await;
            never_emptied
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .observe(
                    endpoints.ok().flatten().as_ref(),
                    slice.ok().flatten().as_ref(),
                );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };

    inject_faults(&sim).await?;
    sim.clear_requests().await?;
    let started = Instant::now();
    let mut breakages = Vec::new();
    let mut kills = 0;
    // (pid, when): a killed replica writes nothing after, so its writes cannot overlap a
    // successor's.
    let mut killed: Vec<(String, Timestamp)> = Vec::new();
    // (pid, when it had exited): the request log must show nothing from it after.
    let mut dead: Vec<(String, Timestamp)> = Vec::new();
    // (pid, from when): the partitioned leader, whose requests the log must show dropped.
    let mut partitioned: Option<(String, Timestamp)> = None;
    let mut partitions = 0;
    let mut watch_gone_delivered = false;
    let mut unhealthy = Vec::new();
    let mut restarted = vec![started; count];
    let chaos = async {
        let result = async {
            let mut next_kill = Instant::now() + Duration::from_secs(3);
            // With several replicas, the leader is cut off for longer than its Lease: the
            // simulator refuses its every request, then takes it back.
            let (mut partition, mut healed): (Option<Instant>, bool) = (None, false);
            // A leader that cannot be named now (its Lease held by a replica just killed, or
            // missing) is looked up again on the next round, never skipped.
            let partition_at = Duration::from_secs(secs.saturating_sub(13).max(1));
            while started.elapsed() < Duration::from_secs(secs) {
                if count > 1 && partition.is_none() && started.elapsed() >= partition_at {
                    let lease =
                        backdoor_get(&sim, "leases/kube-system/bootstrap-controller").await?;
                    let holder = lease
                        .as_ref()
                        .and_then(|l| l["spec"]["holderIdentity"].as_str())
                        .and_then(|h| h.strip_prefix("replica-"))
                        .and_then(|n| n.parse::<usize>().ok());
                    if let Some(pid) = holder
                        .and_then(|n| replicas.get(n - 1))
                        .and_then(ControllerProcess::pid)
                    {
                        // The partition goes first: the simulator applies the first rule that
                        // answers, and a base fault's 500 in its place would be a request that
                        // got through.
                        watch_gone_delivered |= watch_gone_spent(&sim).await?;
                        sim.admin("DELETE", "/sim/faults", None).await?;
                        sim.admin(
                            "POST",
                            "/sim/faults",
                            Some(json!({"userAgent": format!("pid {pid})"),
                                        "fault": {"type": "dropConnection"},
                                        "trigger": {"probability": 1.0}})),
                        )
                        .await?;
                        inject_faults(&sim).await?;
                        breakages.push(format!("partitioned the leader (pid {pid})"));
                        partitioned = Some((pid.to_string(), Timestamp::now()));
                        partitions += 1;
                        partition = Some(Instant::now());
                    }
                }
                if let Some(at) = partition
                    && !healed
                    && at.elapsed() > Duration::from_secs(6)
                {
                    // Heal: the base faults go on.
                    watch_gone_delivered |= watch_gone_spent(&sim).await?;
                    sim.admin("DELETE", "/sim/faults", None).await?;
                    inject_faults(&sim).await?;
                    healed = true;
                }
                deliver_missing_refusal(&sim).await?;
                breakages
                    .push(break_something(&sim, &mut rng, &mut orphans, &mut duplicates).await?);
                // Kill and restart a replica now and then, never in the last 6 s.
                if Instant::now() > next_kill
                    && started.elapsed() + Duration::from_secs(6) < Duration::from_secs(secs)
                {
                    let victim = usize::try_from(rng.below(count as u64))?;
                    if let Some(pid) = replicas[victim].pid() {
                        killed.push((pid.to_string(), Timestamp::now()));
                    }
                    replicas[victim].kill()?;
                    if let Some((pid, _)) = killed.last() {
                        dead.push((pid.clone(), Timestamp::now()));
                    }
                    replicas[victim] = start(&sim, &config, victim + 1)?;
                    restarted[victim] = Instant::now();
                    kills += 1;
                    next_kill = Instant::now() + Duration::from_secs(5);
                }
                for (i, replica) in replicas.iter_mut().enumerate() {
                    if !replica.is_running() {
                        bail!("replica {} exited:\n{}", i + 1, replica.log());
                    }
                    // A replica just restarted may not listen yet.
                    if restarted[i].elapsed() < Duration::from_secs(3) {
                        continue;
                    }
                    match replica.admin_get("/healthz").await {
                        Ok((200, _)) => {}
                        other => unhealthy.push(format!("replica {}: {other:?}", i + 1)),
                    }
                }
                tokio::time::sleep(Duration::from_millis(300 + rng.below(700))).await;
            }
            watch_gone_delivered |= watch_gone_spent(&sim).await?;
            let faults_stopped = Instant::now();
            sim.admin("DELETE", "/sim/faults", None).await?;
            // Convergence is judged, not timed: the time is printed (the bench reports it for
            // long runs), and CONVERGE bounds only a run that never gets there.
            while faults_stopped.elapsed() < super::CONVERGE {
                if converged(&sim, &orphans, web_ip, &members).await?.is_none() {
                    return Ok(Some(faults_stopped.elapsed()));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(None)
        }
        .await;
        stop.store(true, Ordering::Relaxed);
        result
    };
    let (convergence, ()) = tokio::join!(chaos, endpoints_watch);
    let requests = sim.requests().await?;
    let Some(convergence) = convergence? else {
        let problem = converged(&sim, &orphans, web_ip, &members).await?;
        bail!(
            "not converged {} s after the faults stopped: {problem:?}",
            super::CONVERGE.as_secs()
        );
    };

    for name in &duplicates {
        backdoor_delete(&sim, &format!("services/default/{name}")).await?;
    }
    // `check` agrees, checking as replica 1 (whose membership Lease is its own).
    let kubeconfig = sim.kubeconfig.to_string_lossy().into_owned();
    let check = run_controller(&[
        "check",
        "--kubeconfig",
        &kubeconfig,
        "--config",
        config.path.as_str(),
        "--service-cluster-ip-range",
        &sim.service_range,
        "--advertise-address",
        "10.0.0.1",
    ])?;

    // Invariants from the request log.
    let controller_requests: Vec<_> = requests
        .iter()
        .filter(|r| r.user_agent.contains(CONTROLLER_AGENT))
        .collect();
    let faults_hit = controller_requests
        .iter()
        .filter(|r| r.status >= 429 || r.status == 0)
        .count();
    let refusals_missing: Vec<&str> = REFUSALS
        .iter()
        .filter(|(_, status)| !controller_requests.iter().any(|r| r.status == *status))
        .map(|(what, _)| *what)
        .collect();
    // The partitioned leader's requests were dropped: the fault reached the replica it meant.
    let partition_dropped = partitioned.as_ref().map_or(0, |(pid, from)| {
        controller_requests
            .iter()
            .filter(|r| pid_of(&r.user_agent) == pid && r.status == 0)
            .filter(|r| r.time.parse::<Timestamp>().is_ok_and(|at| at >= *from))
            .count()
    });
    // A killed replica sent nothing after it had exited: the kill was real.
    let after_death: Vec<String> = controller_requests
        .iter()
        .filter_map(|r| {
            let at: Timestamp = r.time.parse().ok()?;
            dead.iter()
                .any(|(pid, when)| pid_of(&r.user_agent) == pid && at > *when)
                .then(|| format!("{} {} {} at {at}", r.user_agent, r.verb, r.path))
        })
        .collect();
    let writes: Vec<_> = controller_requests
        .iter()
        .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
        .collect();
    let wrong_deletes: Vec<String> = writes
        .iter()
        .filter(|r| r.status < 300)
        .filter(|r| match (r.verb.as_str(), r.resource.as_str()) {
            ("delete", "ipaddresses") => !orphans.contains(&r.name),
            ("delete", "namespaces" | "services" | "endpoints") => true,
            // Only the kubernetes Service is ever changed; node port duplicates are reported.
            ("update" | "patch", "services") => r.name != "kubernetes",
            _ => false,
        })
        .map(|r| format!("{} {}/{}", r.verb, r.resource, r.name))
        .collect();
    let mut two_writers = BTreeSet::new();
    let leader_writes: Vec<(Timestamp, &str, String)> = writes
        .iter()
        .filter(|r| LEADER_ONLY.contains(&r.resource.as_str()) && r.status < 300)
        .filter_map(|r| {
            let what = format!("{} {}/{} ({})", r.verb, r.resource, r.name, r.status);
            Some((r.time.parse().ok()?, pid_of(&r.user_agent), what))
        })
        .collect();
    let dead_by = |pid: &str, at: Timestamp| killed.iter().any(|(p, when)| p == pid && *when <= at);
    for (i, (at, pid, what)) in leader_writes.iter().enumerate() {
        for (other_at, other_pid, other_what) in &leader_writes[i + 1..] {
            let (first, second) = if other_at >= at {
                (pid, *other_at)
            } else {
                (other_pid, *at)
            };
            if other_pid != pid
                && other_at.duration_since(*at).abs().as_secs_f64() < 1.0
                && !dead_by(first, second)
            {
                two_writers.insert(format!(
                    "pid {pid} at {at}: {what}; pid {other_pid} at {other_at}: {other_what}"
                ));
            }
        }
    }
    println!(
        "chaos, {count} replica(s): {secs} s, {} breakages, {kills} replicas killed, {partitions} leader partitions, {} controller requests \
         ({faults_hit} answered with a fault), {} writes, converged {:.0} ms after the faults \
         stopped",
        breakages.len(),
        controller_requests.len(),
        writes.len(),
        convergence.as_secs_f64() * 1000.0
    );
    for replica in &mut replicas {
        ensure!(replica.is_running(), "a replica exited:\n{}", replica.log());
        ensure!(
            !replica.log().contains("panicked"),
            "a replica panicked:\n{}",
            replica.log()
        );
    }
    ensure!(unhealthy.is_empty(), "/healthz failed: {unhealthy:?}");
    ensure!(
        check.status.code() == Some(0),
        "check after convergence: {}\n{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    ensure!(
        wrong_deletes.is_empty(),
        "wrong deletes or writes: {wrong_deletes:?}"
    );
    ensure!(
        two_writers.is_empty(),
        "two writers at once: {two_writers:?}"
    );
    never_emptied
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .check()?;
    ensure!(faults_hit > 0, "no fault reached the controllers");
    ensure!(
        refusals_missing.is_empty(),
        "injected refusals that never reached a controller: {refusals_missing:?}"
    );
    ensure!(
        watch_gone_delivered,
        "no watch was answered 410 Gone: the once-only rule was never spent"
    );
    // The kills and the partition are what the run is about: one that did neither tested less
    // than it says. Kills fall between 3 s in and 6 s before the end: a run of 12 s or more
    // has a window of rounds long enough for one.
    if secs >= 12 {
        ensure!(kills > 0, "no replica was killed in {secs} s");
    }
    ensure!(
        dead.len() == kills,
        "{kills} kills, {} recorded",
        dead.len()
    );
    ensure!(
        after_death.is_empty(),
        "requests from killed replicas after they exited: {after_death:?}"
    );
    if count > 1 {
        ensure!(
            partitions == 1,
            "the leader was partitioned {partitions} times, not once"
        );
        ensure!(
            partition_dropped > 0,
            "the partitioned leader {partitioned:?} had no request dropped"
        );
    }
    Ok(())
}

fn pid_of(user_agent: &str) -> &str {
    user_agent
        .split("pid ")
        .nth(1)
        .map_or(user_agent, |rest| rest.trim_end_matches(')'))
}

/// A run with the seed from `BOOTSTRAP_CHAOS_SEED` (or a new one) and the length from
/// `BOOTSTRAP_CHAOS_SECS` (default 20 s).
pub async fn chaos(replicas: usize) -> Result<()> {
    let seed: u64 = match std::env::var("BOOTSTRAP_CHAOS_SEED") {
        Ok(seed) => seed.parse().context("BOOTSTRAP_CHAOS_SEED")?,
        Err(_) => u64::try_from(Timestamp::now().as_nanosecond())? | 1,
    };
    let secs: u64 = std::env::var("BOOTSTRAP_CHAOS_SECS").map_or(Ok(20), |s| s.parse())?;
    println!(
        "chaos, {replicas} replica(s): seed {seed} ({secs} s); replay with BOOTSTRAP_CHAOS_SEED={seed}"
    );
    let result = run(seed, secs, replicas).await;
    if let Err(err) = &result {
        eprintln!("chaos run failed; replay with BOOTSTRAP_CHAOS_SEED={seed}: {err:#}");
    }
    result
}

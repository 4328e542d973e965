//! The `kubernetes` endpoints end to end: real `bootstrap-controller` processes (one per simulated apiserver, each
//! with its own `/readyz`) against a real `apiserver-sim` process, or a real cluster
//! (`BOOTSTRAP_E2E_KUBECONFIG`, apiservers with `--endpoint-reconciler-type=none`) where the
//! request-log checks are skipped.
//!
//! Timings are printed, not asserted (2-core machines); BENCHMARKS.md measures them.

mod common;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use common::{
    CONVERGE, ConfigFile, ControllerLeftovers, ControllerProcess, SimProcess, Target, eventually,
    kubectl, run_controller,
};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::events::v1::Event;
use kube::api::PostParams;
use kube::{Api, Client};
use reconcilers::apiserver_endpoints::EndpointsTarget;
use reconcilers::apiserver_endpoints::lease::OwnLease;
use test_support::readyz::FakeReadyz;

/// One simulated control-plane node: its `/readyz` and its sidecar.
struct Member {
    address: String,
    identity: String,
    readyz: FakeReadyz,
    config: std::path::PathBuf,
    process: Option<ControllerProcess>,
}

const LEASE_SELECTOR: &str = "bootstrap-controller.io/apiserver-endpoint=kubernetes";

/// A JSON patch of the Endpoints' port to 443: drift the endpoints loop repairs.
const ENDPOINTS_PORT_443: &str =
    r#"[{"op":"replace","path":"/subsets/0/ports/0/port","value":443}]"#;

/// The three members' addresses, as listed when all are live (see [`Member::new`]).
const ALL_THREE: &[&str] = &["192.0.2.11", "192.0.2.12", "192.0.2.13"];

impl Member {
    /// Member `n`, advertising 192.0.2.(10 + n): TEST-NET addresses nobody serves on, clear of
    /// 192.0.2.1 (a SAN of the simulator's serving certificate, and the real control plane's
    /// own apiserver's address). `range` is the target's service range.
    async fn new(dir: &std::path::Path, n: u8, ttl: &str, range: &str) -> Result<Self> {
        let readyz = FakeReadyz::start().await?;
        let config = dir.join(format!("member-{n}.yaml"));
        std::fs::write(
            &config,
            format!(
                "serviceClusterIPRange: {range}\nendpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    interval: 1s\n    leaseTTL: {ttl}\n    readyzURL: {}\n",
                readyz.url()
            ),
        )?;
        Ok(Member {
            address: format!("192.0.2.{}", 10 + u16::from(n)),
            identity: format!("member-{n}"),
            readyz,
            config,
            process: None,
        })
    }

    fn args(&self) -> Vec<String> {
        vec![
            "--config".into(),
            self.config.display().to_string(),
            "--advertise-address".into(),
            self.address.clone(),
            "--leader-elect-identity".into(),
            self.identity.clone(),
            "--leader-elect-lease-duration".into(),
            "4s".into(),
            "--leader-elect-renew-grace".into(),
            "1s".into(),
        ]
    }

    fn start(&mut self, kubeconfig: &std::path::Path, extra: &[&str]) -> Result<()> {
        let mut args = self.args();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.process = Some(ControllerProcess::start(kubeconfig, &args)?);
        Ok(())
    }

    /// SIGTERM; returns the process's log.
    fn sigterm(&mut self) -> Result<String> {
        let mut process = self.process.take().context("not running")?;
        let status = process.terminate()?;
        if !status.success() {
            bail!(
                "{} exited with {status} after SIGTERM:\n{}",
                self.identity,
                process.log()
            );
        }
        Ok(process.log())
    }

    fn sigkill(&mut self) -> Result<()> {
        let process = self.process.take().context("not running")?;
        let pid = process.pid().context("no pid")?;
        let status = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -KILL {pid} failed");
        }
        drop(process);
        Ok(())
    }
}

async fn endpoints_state(
    client: &Client,
) -> Result<Option<(Vec<String>, Vec<i32>, Vec<String>, Vec<Option<i32>>)>> {
    let Some(endpoints) = Api::<Endpoints>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?
    else {
        return Ok(None);
    };
    let (ips, ports) = common::endpoints_addresses_and_ports(endpoints);
    let Some(slice) = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?
    else {
        return Ok(None);
    };
    let slice_ips = slice
        .endpoints
        .iter()
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) == Some(true))
        .flat_map(|e| e.addresses.clone())
        .collect();
    let slice_ports = slice.ports.iter().flatten().map(|p| p.port).collect();
    Ok(Some((ips, ports, slice_ips, slice_ports)))
}

/// Waits until Endpoints and the slice list exactly `want` (sorted), port 6443.
async fn wait_members(client: &Client, want: &[&str], what: &str) -> Result<Duration> {
    let started = Instant::now();
    let want: Vec<String> = want.iter().map(|s| (*s).to_owned()).collect();
    eventually(what, CONVERGE, || async {
        Ok(match endpoints_state(client).await? {
            Some((ips, ports, slice_ips, slice_ports))
                if ips == want
                    && slice_ips == want
                    && ports == vec![6443]
                    && slice_ports == vec![Some(6443)] =>
            {
                Some(())
            }
            _ => None,
        })
    })
    .await?;
    Ok(started.elapsed())
}

async fn leader(client: &Client) -> Result<Option<String>> {
    Ok(Api::<Lease>::namespaced(client.clone(), "kube-system")
        .get_opt("bootstrap-controller")
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity))
}

fn kubectl_ok(kubeconfig: &std::path::Path, args: &[&str]) -> Result<()> {
    let out = kubectl(kubeconfig, args)?;
    if !out.status.success() {
        bail!("kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Corrupts `default/kubernetes` of `kind` with `kubectl patch` (`patch_type` is `--type=...`).
fn patch_kubernetes(
    kubeconfig: &std::path::Path,
    kind: &str,
    patch_type: &str,
    patch: &str,
) -> Result<()> {
    kubectl_ok(
        kubeconfig,
        &[
            "-n",
            "default",
            "patch",
            kind,
            "kubernetes",
            patch_type,
            "-p",
            patch,
        ],
    )
}

/// A membership Lease written by hand, as the sidecar of `holder` at `address` would write it,
/// renewed at `renewed`; returns the Lease's writer and the Lease written.
async fn plant_member_lease(
    client: &Client,
    address: &str,
    holder: &str,
    ttl: Duration,
    renewed: k8s_openapi::jiff::Timestamp,
) -> Result<(OwnLease, Lease)> {
    let member = OwnLease {
        namespace: "kube-system".into(),
        target: EndpointsTarget::default(),
        address: address.parse()?,
        holder: holder.into(),
        ttl,
    };
    let written = Api::<Lease>::namespaced(client.clone(), "kube-system")
        .create(&PostParams::default(), &member.renewed(None, renewed))
        .await?;
    Ok((member, written))
}

/// How many Events in `default` have `reason` and a note holding every one of `words`.
async fn events_noting(client: &Client, reason: &str, words: &[&str]) -> Result<usize> {
    Ok(Api::<Event>::namespaced(client.clone(), "default")
        .list(&Default::default())
        .await?
        .items
        .iter()
        .filter(|e| {
            e.reason.as_deref() == Some(reason)
                && e.note
                    .as_deref()
                    .is_some_and(|n| words.iter().all(|w| n.contains(w)))
        })
        .count())
}

/// A seeded target and one member (`n`, advertising `address`, a 3 s Lease TTL) started and
/// listed. Fields drop in the order the tests' locals did: the member first, the target last.
struct OneMember {
    member: Member,
    _dir: tempfile::TempDir,
    _leftovers: ControllerLeftovers,
    client: Client,
    target: Target,
}

async fn one_member_listed(n: u8, address: &str) -> Result<OneMember> {
    let (target, client, leftovers) = seeded_and_cleaned_up().await?;
    let dir = tempfile::tempdir()?;
    let range = target.service_range().await?;
    let mut member = Member::new(dir.path(), n, "3s", &range).await?;
    member.address = address.into();
    member.start(target.kubeconfig(), &[])?;
    wait_members(&client, &[address], "the member listed").await?;
    Ok(OneMember {
        member,
        _dir: dir,
        _leftovers: leftovers,
        client,
        target,
    })
}

/// A simulator (or the real cluster) holding the namespaces the loops write into; `extra` are
/// further simulator flags.
async fn seeded(extra: &[&str]) -> Result<Target> {
    let mut args = vec![
        "--seed-namespace",
        "default",
        "--seed-namespace",
        "kube-system",
    ];
    args.extend_from_slice(extra);
    Target::start_with(&args).await
}

/// The endpoints tests' configuration: `serviceClusterIPRange` (unless `None`), `lease` mode, a 1 s interval,
/// a 3 s Lease TTL and `lines` more under `loops.apiserverEndpoints` (each ending in a newline).
fn endpoints_config(range: Option<&str>, lines: &str) -> Result<ConfigFile> {
    let range = range
        .map(|range| format!("serviceClusterIPRange: {range}\n"))
        .unwrap_or_default();
    ConfigFile::new(&format!(
        "{range}endpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    interval: 1s\n    leaseTTL: 3s\n{lines}"
    ))
}

/// A seeded target, a client of it, and what deletes the controllers' leftovers from a real
/// cluster when the test ends (bound in this order, the leftovers go before the target).
async fn seeded_and_cleaned_up() -> Result<(Target, Client, ControllerLeftovers)> {
    let target = seeded(&[]).await?;
    let client = target.client().await?;
    let leftovers = ControllerLeftovers::forget(&target)?;
    Ok((target, client, leftovers))
}

/// A controller with `config`, advertising `address` as `identity`.
fn start_member(
    kubeconfig: &std::path::Path,
    config: &ConfigFile,
    address: &str,
    identity: &str,
) -> Result<ControllerProcess> {
    ControllerProcess::start(
        kubeconfig,
        &[
            "--config",
            &config.path,
            "--advertise-address",
            address,
            "--leader-elect-identity",
            identity,
        ],
    )
}

/// Writes to the objects these loops own, from the simulator's request log.
async fn writes(sim: &SimProcess) -> Result<Vec<String>> {
    Ok(sim
        .requests()
        .await?
        .into_iter()
        .filter(|r| matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete"))
        .filter(|r| {
            matches!(
                r.resource.as_str(),
                "endpoints" | "endpointslices" | "services"
            )
        })
        .map(|r| format!("{} {} {}/{}", r.verb, r.resource, r.namespace, r.name))
        .collect())
}

// Two threads: `sigterm` blocks one while the stopping controller probes its `/readyz`, which
// the other serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_apiservers_join_leave_crash_and_heal() -> Result<()> {
    let target = seeded(&[]).await?;
    let sim = target.sim("its request-log checks (writes at rest, Lease deletions)");
    let kubeconfig = target.kubeconfig();
    let client = target.client().await?;
    let _leftovers = ControllerLeftovers::forget(&target)?;
    let dir = tempfile::tempdir()?;
    let range = target.service_range().await?;
    let mut members = Vec::new();
    for n in 1..=3 {
        let mut member = Member::new(dir.path(), n, "3s", &range).await?;
        member.start(kubeconfig, &[])?;
        members.push(member);
    }
    let took = wait_members(&client, ALL_THREE, "three members listed").await?;
    println!("three members listed after {took:?}");

    // A quiet period: membership renewals continue, the endpoints are not rewritten.
    if let Some(sim) = sim {
        tokio::time::sleep(Duration::from_secs(2)).await;
        sim.clear_requests().await?;
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert_eq!(writes(sim).await?, Vec::<String>::new(), "writes at rest");
    }

    let leader_id = eventually("a leader", CONVERGE, || async { leader(&client).await }).await?;
    let leader_index = members
        .iter()
        .position(|m| m.identity == leader_id)
        .context("leader is a member")?;
    let followers: Vec<usize> = (0..3).filter(|i| *i != leader_index).collect();
    let (f1, f2) = (followers[0], followers[1]);
    let addresses: Vec<String> = members.iter().map(|m| m.address.clone()).collect();
    let remaining = |gone: &[usize]| -> Vec<&str> {
        (0..3)
            .filter(|i| !gone.contains(i))
            .map(|i| addresses[i].as_str())
            .collect()
    };

    // SIGTERM of a sidecar whose apiserver stays ready (a restart or upgrade of the sidecar
    // alone): it keeps its Lease, which expires on its TTL (3s) since it does not come back.
    if let Some(sim) = sim {
        sim.clear_requests().await?;
    }
    let started = Instant::now();
    let log = members[f1].sigterm()?;
    assert!(
        log.contains("keeping this instance's apiserver membership"),
        "the decision is logged:\n{log}"
    );
    if let Some(sim) = sim {
        let lease_deletes: Vec<String> = sim
            .requests()
            .await?
            .into_iter()
            .filter(|r| r.verb == "delete" && r.resource == "leases")
            .map(|r| r.name)
            .collect();
        assert_eq!(lease_deletes, Vec::<String>::new(), "no Lease withdrawn");
    }
    wait_members(&client, &remaining(&[f1]), "kept Lease expired").await?;
    println!(
        "SIGTERM (apiserver ready) -> address removed on Lease expiry after {:?}",
        started.elapsed()
    );

    // SIGKILL: nobody says goodbye; the Lease expires (TTL 3s).
    let started = Instant::now();
    members[f2].sigkill()?;
    wait_members(&client, &remaining(&[f1, f2]), "SIGKILLed member removed").await?;
    println!(
        "SIGKILL -> address removed after {:?} (TTL 3s, interval 1s)",
        started.elapsed()
    );

    // Restart: back.
    members[f2].start(kubeconfig, &[])?;
    members[f1].start(kubeconfig, &[])?;
    wait_members(&client, ALL_THREE, "restarted members back").await?;

    // An apiserver whose /readyz fails is removed, and added back once ready.
    members[f2].readyz.set(false);
    wait_members(&client, &remaining(&[f2]), "not-ready member removed").await?;
    members[f2].readyz.set(true);
    wait_members(&client, ALL_THREE, "ready again").await?;

    // Corruption with kubectl is repaired: Endpoints port, an address, the slice, the Service.
    patch_kubernetes(kubeconfig, "endpoints", "--type=json", ENDPOINTS_PORT_443)?;
    wait_members(&client, ALL_THREE, "Endpoints port repaired").await?;
    patch_kubernetes(
        kubeconfig,
        "endpoints",
        "--type=json",
        r#"[{"op":"replace","path":"/subsets/0/addresses/0/ip","value":"192.0.2.199"}]"#,
    )?;
    wait_members(&client, ALL_THREE, "Endpoints address repaired").await?;
    patch_kubernetes(
        kubeconfig,
        "endpointslice",
        "--type=json",
        r#"[{"op":"replace","path":"/ports/0/port","value":1}]"#,
    )?;
    wait_members(&client, ALL_THREE, "EndpointSlice port repaired").await?;
    kubectl_ok(
        kubeconfig,
        &["-n", "default", "delete", "endpointslice", "kubernetes"],
    )?;
    wait_members(&client, ALL_THREE, "EndpointSlice recreated").await?;
    patch_kubernetes(
        kubeconfig,
        "service",
        "--type=merge",
        r#"{"spec":{"ports":[{"name":"https","port":8443,"protocol":"TCP","targetPort":6443}]}}"#,
    )?;
    let services = Api::<Service>::namespaced(client.clone(), "default");
    eventually("Service repaired", CONVERGE, || async {
        let spec = services.get("kubernetes").await?.spec.unwrap_or_default();
        let port = spec
            .ports
            .unwrap_or_default()
            .first()
            .map(|p| (p.port, p.node_port));
        Ok((spec.type_.as_deref() == Some("ClusterIP") && port == Some((443, None))).then_some(()))
    })
    .await?;

    // Every membership Lease deleted: the endpoints are never emptied meanwhile.
    kubectl_ok(
        kubeconfig,
        &[
            "-n",
            "kube-system",
            "delete",
            "leases",
            "-l",
            LEASE_SELECTOR,
        ],
    )?;
    let watch_until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < watch_until {
        let state = endpoints_state(&client).await?.context("endpoints exist")?;
        assert!(
            !state.0.is_empty() && !state.2.is_empty(),
            "endpoints emptied: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_members(&client, ALL_THREE, "members back after Lease deletion").await?;

    // The leader stops with its apiserver (readyz failing): it takes its own address out,
    // another replica takes over and repairs.
    let started = Instant::now();
    members[leader_index].readyz.set(false);
    members[leader_index].sigterm()?;
    wait_members(
        &client,
        &remaining(&[leader_index]),
        "SIGTERMed leader removed",
    )
    .await?;
    println!(
        "SIGTERM of the leader -> address removed after {:?}",
        started.elapsed()
    );
    eventually("a new leader", CONVERGE, || async {
        Ok(leader(&client).await?.filter(|id| *id != leader_id))
    })
    .await?;
    patch_kubernetes(kubeconfig, "endpoints", "--type=json", ENDPOINTS_PORT_443)?;
    wait_members(
        &client,
        &remaining(&[leader_index]),
        "port repaired by the new leader",
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn dry_run_and_check_report_instead_of_repairing() -> Result<()> {
    let target = seeded(&[]).await?;
    let sim = target.sim("no writes, judged from the request log");
    let kubeconfig = target.kubeconfig();
    let client = target.client().await?;
    // Also deletes, when the test ends, the Lease its killed member leaves for 5 minutes.
    let _leftovers = ControllerLeftovers::forget(&target)?;
    let dir = tempfile::tempdir()?;
    // A long TTL keeps the member listed after its sidecar is killed.
    let range = target.service_range().await?;
    let mut member = Member::new(dir.path(), 1, "5m", &range).await?;
    member.start(kubeconfig, &[])?;
    wait_members(&client, &[member.address.as_str()], "member listed").await?;
    member.sigkill()?;

    patch_kubernetes(kubeconfig, "endpoints", "--type=json", ENDPOINTS_PORT_443)?;

    // `run --dry-run` reports and writes nothing.
    member.start(kubeconfig, &["--dry-run"])?;
    member
        .process
        .as_mut()
        .context("running")?
        .wait_ready()
        .await?;
    if let Some(sim) = sim {
        sim.clear_requests().await?;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(sim) = sim {
        assert_eq!(writes(sim).await?, Vec::<String>::new());
    }
    let state = endpoints_state(&client).await?.context("endpoints")?;
    assert_eq!(state.1, vec![443], "dry-run left the corruption");
    let log = member.process.as_ref().context("running")?.log();
    assert!(
        log.contains("endpoints_ports"),
        "dry-run logs the drift:\n{log}"
    );
    member.sigterm()?;

    // `check` reports the drift with exit status 1.
    let config = member.config.display().to_string();
    let out = run_controller(&[
        "check",
        "--kubeconfig",
        &kubeconfig.display().to_string(),
        "--config",
        &config,
        "--advertise-address",
        &member.address,
    ])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "check exit status; stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("endpoints_ports"),
        "check names the drift:\n{stdout}"
    );
    let state = endpoints_state(&client).await?.context("endpoints")?;
    assert_eq!(state.1, vec![443], "check wrote nothing");
    Ok(())
}

/// SIGTERM with the local apiserver (the simulator's own `/readyz`) ready keeps the membership
/// Lease and the address; with `/readyz` failing (the apiserver stopping too) it withdraws both.
/// A long interval keeps the loops' regular passes out of the way: what happens is the shutdown's.
#[tokio::test]
async fn sigterm_keeps_a_ready_apiservers_address_and_withdraws_a_stopping_ones() -> Result<()> {
    let target = seeded(&[]).await?;
    let Some(sim) = target.sim(
        "the whole test: the local apiserver's /readyz switched and writes from the request log",
    ) else {
        return Ok(());
    };
    let client = target.client().await?;
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "serviceClusterIPRange: {}\nendpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    interval: 30s\n    leaseTTL: 5m\n",
            sim.service_range
        ),
    )?;
    let config = config.display().to_string();
    let args = [
        "--config",
        config.as_str(),
        "--advertise-address",
        "192.0.2.21",
        "--leader-elect-identity",
        "member-21",
    ];
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    const LEASE: &str = "apiserver-192.0.2.21";

    let mut process = ControllerProcess::start(&sim.kubeconfig, &args)?;
    wait_members(&client, &["192.0.2.21"], "member listed").await?;
    process.wait_ready().await?;
    let renewed = |lease: Option<Lease>| {
        lease
            .and_then(|l| l.spec)
            .and_then(|s| s.renew_time)
            .map(|t| t.0)
    };
    let before = renewed(leases.get_opt(LEASE).await?).context("renewed at start")?;
    sim.clear_requests().await?;
    let status = process.terminate()?;
    let log = process.log();
    assert!(status.success(), "exit status {status}:\n{log}");
    assert!(
        log.contains("keeping this instance's apiserver membership")
            && log.contains("the local apiserver stays ready"),
        "the decision is logged at info with its reason:\n{log}"
    );
    // Renewed once more on the way out: its TTL counts from the stop, so a sidecar whose new
    // pod is slow to start does not see its address drop out meanwhile.
    let after = renewed(leases.get_opt(LEASE).await?).context("the Lease is kept")?;
    assert!(
        after > before,
        "renewed at stop: {before} -> {after}\n{log}"
    );
    assert!(
        log.contains("renewed this instance's membership Lease on the way out"),
        "{log}"
    );
    assert_eq!(
        writes(sim).await?,
        Vec::<String>::new(),
        "nothing withdrawn"
    );
    assert!(leases.get_opt(LEASE).await?.is_some(), "the Lease is kept");
    let (ips, _, slice_ips, _) = endpoints_state(&client).await?.context("endpoints")?;
    assert_eq!(
        (ips, slice_ips),
        (vec!["192.0.2.21".to_owned()], vec!["192.0.2.21".to_owned()])
    );

    let mut process = ControllerProcess::start(&sim.kubeconfig, &args)?;
    process.wait_ready().await?;
    // Its apiserver stops too: /readyz fails from now on.
    sim.set_ready(false).await?;
    let status = process.terminate()?;
    let log = process.log();
    assert!(status.success(), "exit status {status}:\n{log}");
    assert!(
        log.contains("withdrawing this instance's apiserver membership")
            && log.contains("the local apiserver is stopping"),
        "the decision is logged at info with its reason:\n{log}"
    );
    assert!(
        leases.get_opt(LEASE).await?.is_none(),
        "the Lease is deleted"
    );
    let (ips, _, slice_ips, _) = endpoints_state(&client).await?.context("endpoints")?;
    assert!(
        ips.is_empty() && slice_ips.is_empty(),
        "the last member withdrew its address: {ips:?} {slice_ips:?}"
    );
    Ok(())
}

/// A member whose host clock runs behind the leader's: its sidecar's `renewTime`s are 20 s old
/// on the leader's clock, longer than the Lease's 3 s duration. Judged by when the leader sees
/// each renewal, it is listed once renewed and stays listed, with no expiry, while it renews.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_clock_runs_behind_is_listed_and_does_not_flap() -> Result<()> {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};

    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    let kubeconfig = target.kubeconfig();
    let readyz = FakeReadyz::start().await?;
    let config = endpoints_config(
        Some(&target.service_range().await?),
        &format!("    readyzURL: {}\n", readyz.url()),
    )?;
    let _leader = start_member(kubeconfig, &config, "192.0.2.31", "member-31")?;
    wait_members(&client, &["192.0.2.31"], "the leader's own address").await?;

    // The skewed member's sidecar, by hand: renewed every second, 20 s in the past.
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let behind = || Timestamp::now() - SignedDuration::from_secs(20);
    let (skewed, mut written) = plant_member_lease(
        &client,
        "192.0.2.32",
        "member-32",
        Duration::from_secs(3),
        behind(),
    )
    .await?;
    let renewer = {
        let leases = leases.clone();
        let name = skewed.name();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let next = skewed.renewed(Some(&written), behind());
                match leases.replace(&name, &PostParams::default(), &next).await {
                    Ok(lease) => written = lease,
                    Err(err) => return err.to_string(),
                }
            }
        })
    };
    wait_members(
        &client,
        &["192.0.2.31", "192.0.2.32"],
        "the member whose clock is behind listed",
    )
    .await?;
    // Ten of its renewals, each 20 s old when written: listed at every look.
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let (ips, _, slice_ips, _) = endpoints_state(&client).await?.context("endpoints")?;
        assert!(
            ips.contains(&"192.0.2.32".to_owned()) && slice_ips.contains(&"192.0.2.32".to_owned()),
            "the skewed member left the endpoints: {ips:?} {slice_ips:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !renewer.is_finished(),
        "the renewals failed: {:?}",
        renewer.await
    );
    renewer.abort();
    let expiries = events_noting(&client, "MemberExpired", &["192.0.2.32"]).await?;
    assert_eq!(expiries, 0, "MemberExpired events for the skewed member");
    // It stops renewing: it expires 3 s after the last renewal the leader saw.
    wait_members(&client, &["192.0.2.31"], "the silent skewed member expired").await?;
    Ok(())
}

/// One or two failed `/readyz` probes in a row (an etcd latency spike) keep the member listed;
/// three in a row (the default `readinessFailureThreshold`) withdraw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_readiness_probe_below_the_threshold_keeps_the_member() -> Result<()> {
    let setup = one_member_listed(41, "192.0.2.41").await?;
    let (client, member) = (&setup.client, &setup.member);
    let leases: Api<Lease> = Api::namespaced(client.clone(), "kube-system");
    let uid = |lease: Option<Lease>| lease.and_then(|l| l.metadata.uid);
    let first = uid(leases.get_opt("apiserver-192.0.2.41").await?).context("its Lease")?;

    for failures in [1, 2, 1] {
        member.readyz.fail_next(failures);
        let probes = member.readyz.probes();
        // Until the failures are answered and two more probes pass, listed at every look.
        let until = Instant::now() + CONVERGE;
        while member.readyz.failing() > 0 || member.readyz.probes() < probes + failures + 2 {
            assert!(Instant::now() < until, "the probes did not come");
            let (ips, _, slice_ips, _) = endpoints_state(client).await?.context("endpoints")?;
            assert_eq!(
                (ips, slice_ips),
                (vec!["192.0.2.41".to_owned()], vec!["192.0.2.41".to_owned()]),
                "withdrawn after {failures} failed probe(s)"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(
        uid(leases.get_opt("apiserver-192.0.2.41").await?),
        Some(first),
        "the membership Lease was deleted (and written again)"
    );
    let log = member.process.as_ref().context("running")?.log();
    assert!(
        log.contains("readiness probe failed; keeping this instance's membership"),
        "{log}"
    );

    // Failing from now on: withdrawn after three in a row (its Lease deleted; the endpoints keep
    // the last member, as upstream never empties them).
    member.readyz.set(false);
    eventually("the failing member's Lease deleted", CONVERGE, || async {
        Ok(leases
            .get_opt("apiserver-192.0.2.41")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    let log = member.process.as_ref().context("running")?.log();
    assert!(
        log.contains("local apiserver is not ready; withdrawing this instance"),
        "{log}"
    );
    member.readyz.set(true);
    eventually("the member's Lease back", CONVERGE, || async {
        Ok(leases.get_opt("apiserver-192.0.2.41").await?.map(|_| ()))
    })
    .await?;
    Ok(())
}

/// An IPv6 cluster with no `serviceClusterIPRange` given: the endpoints take the family of the
/// `kubernetes` Service (created IPv6 from the cluster's ServiceCIDR). A member of the other
/// family is left out with a Warning; a sidecar whose own address is of the other family
/// refuses to write its Lease, naming `advertiseAddress`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoints_take_the_services_family() -> Result<()> {
    let target = seeded(&["--service-cluster-ip-range", "2001:db8:96::/112"]).await?;
    // The real control plane here is IPv4.
    let Some(sim) =
        target.sim("the whole test: an IPv6 service range (the real control plane's is IPv4)")
    else {
        return Ok(());
    };
    let client = target.client().await?;
    let readyz = FakeReadyz::start().await?;
    let config = endpoints_config(None, &format!("    readyzURL: {}\n", readyz.url()))?;
    let start =
        |address: &str, identity: &str| start_member(&sim.kubeconfig, &config, address, identity);
    let _v6 = start("2001:db8::41", "member-v6")?;
    let v6_only = |want: &'static str| {
        let client = client.clone();
        async move {
            eventually(want, CONVERGE, || async {
                let Some(slice) = Api::<EndpointSlice>::namespaced(client.clone(), "default")
                    .get_opt("kubernetes")
                    .await?
                else {
                    return Ok(None);
                };
                let (ips, ..) = endpoints_state(&client).await?.context("endpoints")?;
                Ok((slice.address_type == "IPv6"
                    && ips == ["2001:db8::41"]
                    && slice
                        .endpoints
                        .iter()
                        .flat_map(|e| e.addresses.clone())
                        .eq(["2001:db8::41".to_owned()]))
                .then_some(()))
            })
            .await
        }
    };
    v6_only("an IPv6 slice listing the IPv6 member").await?;
    let service = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await?;
    let cluster_ip = service.spec.and_then(|s| s.cluster_ip).unwrap_or_default();
    assert!(
        cluster_ip.contains(':'),
        "the Service is IPv6: {cluster_ip}"
    );

    // A member of the other family (its sidecar configured with an IPv4 address): left out.
    plant_member_lease(
        &client,
        "192.0.2.42",
        "member-v4",
        Duration::from_secs(3600),
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await?;
    eventually("a MemberWrongFamily event", CONVERGE, || async {
        let events = events_noting(
            &client,
            "MemberWrongFamily",
            &["192.0.2.42", "advertiseAddress"],
        )
        .await?;
        Ok((events > 0).then_some(()))
    })
    .await?;
    v6_only("still only the IPv6 member").await?;
    let slices = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .list(&kube::api::ListParams::default().labels("kubernetes.io/service-name=kubernetes"))
        .await?;
    assert_eq!(slices.items.len(), 1, "one slice, one family: {slices:?}");

    // A sidecar whose own address is IPv4 refuses to write its Lease, naming the setting.
    let v4_sidecar = start("192.0.2.43", "member-v4-sidecar")?;
    eventually("the refusal logged", CONVERGE, || async {
        let log = v4_sidecar.log();
        Ok(log
            .contains(
                "advertiseAddress 192.0.2.43 is IPv4, but the Service default/kubernetes is IPv6",
            )
            .then_some(()))
    })
    .await?;
    assert!(
        Api::<Lease>::namespaced(client.clone(), "kube-system")
            .get_opt("apiserver-192.0.2.43")
            .await?
            .is_none(),
        "no Lease for the IPv4 sidecar"
    );
    Ok(())
}

/// A readiness probe aimed elsewhere than the local apiserver (here `0.0.0.0`, which Linux
/// connects to this host, standing in for a load balancer) is reported once, naming `readyzURL`;
/// the member is still listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_readiness_probe_of_another_server_is_reported() -> Result<()> {
    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    let readyz = FakeReadyz::start().await?;
    let elsewhere = readyz.url().replace("127.0.0.1", "0.0.0.0");
    let config = endpoints_config(
        Some(&target.service_range().await?),
        &format!("    readyzURL: {elsewhere}\n"),
    )?;
    let member = start_member(target.kubeconfig(), &config, "192.0.2.51", "member-51")?;
    wait_members(&client, &["192.0.2.51"], "the member listed").await?;
    // Probes go on every second: once three more have come, a warning each time would show.
    let probed = readyz.probes();
    eventually("three more probes", CONVERGE, || async {
        Ok((readyz.probes() >= probed + 3).then_some(()))
    })
    .await?;
    let log = member.log();
    let warning = "the readiness probe asks 0.0.0.0, which is neither loopback nor this \
                   instance's advertiseAddress 192.0.2.51";
    assert!(log.contains(warning), "{log}");
    assert_eq!(log.matches(warning).count(), 1, "reported once:\n{log}");
    assert!(readyz.probes() > 0, "the probe reached the stand-in");
    Ok(())
}

/// The local apiserver's serving certificate is checked against the advertised address, as
/// in-cluster clients check it: one it holds ([`Target::certificate_address`]) is quiet; one it
/// lacks is reported once, with the metric.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_advertised_address_the_serving_certificate_lacks_is_reported() -> Result<()> {
    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    // No readyzURL: the probe, and so the check, asks the kubeconfig's server over https.
    let config = endpoints_config(Some(&target.service_range().await?), "")?;
    let start = |address: &str, identity: &str| {
        start_member(target.kubeconfig(), &config, address, identity)
    };
    let lacking = "serving certificate is not valid for this instance's advertiseAddress";
    async fn gauge(process: &ControllerProcess) -> Result<Option<String>> {
        let (_, body) = process.admin_get("/metrics").await?;
        Ok(body
            .lines()
            .find(|line| line.starts_with(METRIC))
            .and_then(|line| line.rsplit(' ').next())
            .map(str::to_owned))
    }
    const METRIC: &str = "bootstrap_apiserver_lease_serving_certificate_lacks_address";

    let held = target.certificate_address()?;
    let holds = start(&held, "member-1")?;
    wait_members(&client, &[held.as_str()], "the member listed").await?;
    assert_eq!(gauge(&holds).await?.as_deref(), Some("0"));
    assert!(!holds.log().contains(lacking), "{}", holds.log());
    drop(holds);

    let lacks = start("192.0.2.62", "member-62")?;
    eventually("the mismatch reported", CONVERGE, || async {
        Ok((gauge(&lacks).await?.as_deref() == Some("1")).then_some(()))
    })
    .await?;
    // Passes go on every second; the finding is logged once.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = lacks.log();
    assert_eq!(log.matches(lacking).count(), 1, "{log}");
    assert!(
        log.contains("192.0.2.62") && log.contains("certSANs"),
        "{log}"
    );
    Ok(())
}

/// `writeEndpoints: false`: the EndpointSlice alone is kept; an Endpoints object left from
/// before is neither written nor deleted, and reported once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slices_only_keeps_the_slice_and_leaves_the_endpoints_alone() -> Result<()> {
    use kube::api::DeleteParams;

    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    // An Endpoints object from before (another writer, an earlier configuration).
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
    if endpoints.get_opt("kubernetes").await?.is_some() {
        endpoints
            .delete("kubernetes", &DeleteParams::default())
            .await?;
    }
    let stale: Endpoints = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "subsets": [{"addresses": [{"ip": "192.0.2.99"}],
                     "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]}],
    }))?;
    let stale = endpoints.create(&PostParams::default(), &stale).await?;

    let readyz = FakeReadyz::start().await?;
    let config = endpoints_config(
        Some(&target.service_range().await?),
        &format!(
            "    writeEndpoints: false\n    readyzURL: {}\n",
            readyz.url()
        ),
    )?;
    let member = start_member(target.kubeconfig(), &config, "192.0.2.71", "member-71")?;
    let slice_ips = || async {
        Ok::<_, anyhow::Error>(
            Api::<EndpointSlice>::namespaced(client.clone(), "default")
                .get_opt("kubernetes")
                .await?
                .map(|slice| {
                    slice
                        .endpoints
                        .iter()
                        .flat_map(|e| e.addresses.clone())
                        .collect::<Vec<_>>()
                }),
        )
    };
    eventually("the slice lists the member", CONVERGE, || async {
        Ok((slice_ips().await? == Some(vec!["192.0.2.71".to_owned()])).then_some(()))
    })
    .await?;

    // Another member joins: the slice follows.
    plant_member_lease(
        &client,
        "192.0.2.72",
        "member-72",
        Duration::from_secs(3600),
        k8s_openapi::jiff::Timestamp::now(),
    )
    .await?;
    eventually("the slice lists both", CONVERGE, || async {
        Ok(
            (slice_ips().await? == Some(vec!["192.0.2.71".to_owned(), "192.0.2.72".to_owned()]))
                .then_some(()),
        )
    })
    .await?;
    let now = endpoints.get("kubernetes").await?;
    assert_eq!(
        now.metadata.resource_version, stale.metadata.resource_version,
        "the Endpoints were written: {now:?}"
    );
    let log = member.log();
    let warning = "writeEndpoints is false: this Endpoints object is no longer kept up to date";
    assert_eq!(log.matches(warning).count(), 1, "{log}");
    endpoints
        .delete("kubernetes", &DeleteParams::default())
        .await?;
    Ok(())
}

/// Two apiservers behind one address (a VIP), each with its sidecar: one stopping (its
/// apiserver failing `/readyz`, then SIGTERM) never takes the address out while the other is
/// live; once the other fails too, the address goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_address_stays_listed_while_any_of_its_apiservers_is_live() -> Result<()> {
    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    let kubeconfig = target.kubeconfig();
    let dir = tempfile::tempdir()?;
    let range = target.service_range().await?;
    let mut a = Member::new(dir.path(), 81, "3s", &range).await?;
    let mut b = Member::new(dir.path(), 82, "3s", &range).await?;
    for member in [&mut a, &mut b] {
        member.address = "192.0.2.80".into();
        member.start(kubeconfig, &[])?;
    }
    wait_members(&client, &["192.0.2.80"], "the shared address listed").await?;
    let shared = "another instance renews this address's membership Lease: the address is shared";
    eventually("both sidecars see the sharing", CONVERGE, || async {
        let logs = [&a, &b].map(|m| m.process.as_ref().map(ControllerProcess::log));
        Ok(logs
            .iter()
            .all(|log| log.as_deref().is_some_and(|l| l.contains(shared)))
            .then_some(()))
    })
    .await?;

    // a's apiserver stops: /readyz fails, then its sidecar gets SIGTERM.
    a.readyz.set(false);
    let listed = || async {
        let (ips, ..) = endpoints_state(&client).await?.context("endpoints")?;
        let lease = Api::<Lease>::namespaced(client.clone(), "kube-system")
            .get_opt("apiserver-192.0.2.80")
            .await?;
        Ok::<_, anyhow::Error>(ips == ["192.0.2.80"] && lease.is_some())
    };
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        assert!(
            listed().await?,
            "the address left while b is live (a failing)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log = a.sigterm()?;
    assert!(
        log.contains("keeping this instance's apiserver membership")
            && log.contains("a shared address"),
        "{log}"
    );
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        assert!(
            listed().await?,
            "the address left while b is live (a stopped)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // b's apiserver fails too: nobody renews the Lease any more, so the address goes by
    // expiry (a sidecar that has seen its address shared leaves it to expiry).
    b.readyz.set(false);
    let renewed = || async {
        Ok::<_, anyhow::Error>(
            Api::<Lease>::namespaced(client.clone(), "kube-system")
                .get("apiserver-192.0.2.80")
                .await?
                .spec
                .and_then(|spec| spec.renew_time),
        )
    };
    tokio::time::sleep(Duration::from_secs(3)).await; // past the threshold's probes
    let last = renewed().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        renewed().await?,
        last,
        "still renewed with both apiservers failing"
    );
    let log = b.process.as_ref().context("running")?.log();
    assert!(log.contains("local apiserver is not ready"), "{log}");
    Ok(())
}

/// Another writer changes the Endpoints (here `other-reconciler`, as kube-apiserver's own
/// reconciler or a syncer would): the repair names it by its field manager, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_other_writer_of_a_repaired_object_is_named_once() -> Result<()> {
    let setup = one_member_listed(91, "192.0.2.91").await?;
    let (target, client, member) = (&setup.target, &setup.client, &setup.member);
    let kubeconfig = target.kubeconfig();

    let tamper = || async {
        match target.as_sim() {
            // The simulator keeps no managedFields of its own: the backdoor plants them as
            // kube-apiserver would record a write by `other-reconciler`.
            Some(sim) => {
                let mut endpoints = serde_json::to_value(
                    Api::<Endpoints>::namespaced(client.clone(), "default")
                        .get("kubernetes")
                        .await?,
                )?;
                endpoints["apiVersion"] = "v1".into();
                endpoints["kind"] = "Endpoints".into();
                endpoints["subsets"][0]["addresses"] = serde_json::json!([{"ip": "192.0.2.99"}]);
                endpoints["metadata"]["managedFields"] = serde_json::json!([{
                    "manager": "other-reconciler", "operation": "Update", "apiVersion": "v1",
                    "time": k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                    "fieldsType": "FieldsV1", "fieldsV1": {},
                }]);
                sim.admin("PUT", "/sim/backdoor", Some(endpoints)).await?;
            }
            None => kubectl_ok(
                kubeconfig,
                &[
                    "-n",
                    "default",
                    "patch",
                    "endpoints",
                    "kubernetes",
                    "--field-manager=other-reconciler",
                    "--type=json",
                    "-p",
                    r#"[{"op":"replace","path":"/subsets/0/addresses/0/ip","value":"192.0.2.99"}]"#,
                ],
            )?,
        }
        Ok::<_, anyhow::Error>(())
    };
    let named = || {
        events_noting(
            client,
            "ConflictingWriter",
            &["\"other-reconciler\"", "Endpoints/default/kubernetes"],
        )
    };
    for round in 1..=2 {
        tamper().await?;
        wait_members(client, &["192.0.2.91"], "the Endpoints repaired").await?;
        eventually("the other writer named", CONVERGE, || async {
            Ok((named().await? >= 1).then_some(()))
        })
        .await?;
        // A second event would follow the repair's write within moments.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(named().await?, 1, "named again in round {round}");
    }
    let log = member.process.as_ref().context("running")?.log();
    assert_eq!(
        log.matches("was last written by \"other-reconciler\"")
            .count(),
        1,
        "{log}"
    );
    Ok(())
}

/// With no endpoints mode named (flag, variable, file key), `run` leaves the `kubernetes`
/// Endpoints alone: no endpoints loop (none in `/readyz`), no membership Lease, no write to the
/// Endpoints or its slice, and one info line naming the flag to set; `check` reports nothing
/// about members and finds a healthy cluster clean. Against the simulator only: the test plants
/// a `kubernetes` Endpoints a real cluster's clients depend on.
#[tokio::test]
async fn with_no_mode_named_run_and_check_leave_the_endpoints_alone() -> Result<()> {
    let sim = SimProcess::start(&[
        "--seed-namespace",
        "default",
        "--seed-namespace",
        "kube-system",
    ])
    .await?;
    let client = common::client_from(&sim.kubeconfig).await?;
    let endpoints: Api<Endpoints> = Api::namespaced(client.clone(), "default");
    // What another writer (kube-apiserver's own reconciler, an operator) keeps there.
    let planted: Endpoints = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubernetes", "namespace": "default"},
        "subsets": [{
            "addresses": [{"ip": "192.0.2.50"}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}]
        }]
    }))?;
    let planted = endpoints.create(&PostParams::default(), &planted).await?;
    sim.clear_requests().await?;

    let mut controller = ControllerProcess::start(&sim.kubeconfig, &[])?;
    controller.wait_ready().await?;
    // Every loop this replica runs has had a successful pass once `/readyz` has no failing
    // line and the leader's namespaces loop created kube-public.
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let readyz = eventually("every loop passed once", CONVERGE, || async {
        let (status, body) = controller.admin_get("/readyz?verbose").await?;
        let created = namespaces.get_opt("kube-public").await?.is_some();
        Ok((status == 200 && created && !body.contains("[-]")).then_some(body))
    })
    .await?;
    assert!(
        !readyz.contains("apiserver-"),
        "no endpoints loop is built:\n{readyz}"
    );
    assert!(
        readyz.contains("[+]system-namespaces ok"),
        "the other loops run:\n{readyz}"
    );
    let kept = endpoints.get("kubernetes").await?;
    assert_eq!(
        common::endpoints_addresses_and_ports(kept.clone()),
        (vec!["192.0.2.50".to_owned()], vec![6443]),
        "the planted endpoints are kept"
    );
    assert_eq!(
        kept.metadata.resource_version, planted.metadata.resource_version,
        "never written"
    );
    let endpoint_writes: Vec<String> = writes(&sim)
        .await?
        .into_iter()
        .filter(|write| !write.contains(" services "))
        .collect();
    assert_eq!(endpoint_writes, Vec::<String>::new(), "no endpoints write");
    let leases: Vec<String> = Api::<Lease>::all(client.clone())
        .list(&Default::default())
        .await?
        .into_iter()
        .map(|lease| {
            let namespace = lease.metadata.namespace.unwrap_or_default();
            format!("{namespace}/{}", lease.metadata.name.unwrap_or_default())
        })
        .collect();
    assert_eq!(
        leases,
        ["kube-system/bootstrap-controller"],
        "the leader's Lease and no membership Lease"
    );
    let log = controller.log();
    let said: Vec<&str> = log
        .lines()
        .filter(|line| line.contains("no endpoint reconciler type is named"))
        .collect();
    assert_eq!(said.len(), 1, "said once:\n{log}");
    assert!(
        said[0].contains("INFO") && said[0].contains("--endpoint-reconciler-type"),
        "at info, naming the flag: {}",
        said[0]
    );
    controller.terminate()?;

    let out = run_controller(&[
        "check",
        "--kubeconfig",
        &sim.kubeconfig.display().to_string(),
    ])?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "check with nothing named is clean; stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains("no_members") && !stdout.contains("apiserver-"),
        "nothing about members:\n{stdout}"
    );
    assert_eq!(
        endpoints.get("kubernetes").await?.metadata.resource_version,
        planted.metadata.resource_version,
        "check wrote nothing"
    );
    Ok(())
}

/// A sidecar restarted on its host with its addresses (no identity given) is the same
/// instance: it renews its previous life's membership Lease, still live, without calling the
/// address shared. A second instance advertising that address from another admin address is
/// another instance, and the warning is given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_sidecar_is_not_taken_for_another_instance_sharing_its_address() -> Result<()> {
    const SHARED: &str = "the address is shared";
    let (target, client, _leftovers) = seeded_and_cleaned_up().await?;
    let kubeconfig = target.kubeconfig();
    let dir = tempfile::tempdir()?;
    let range = target.service_range().await?;
    // A TTL the restart fits in: the previous life's Lease is live when the new one reads it.
    let member = Member::new(dir.path(), 86, "60s", &range).await?;
    let config = member.config.display().to_string();
    let args = [
        "--config",
        config.as_str(),
        "--advertise-address",
        member.address.as_str(),
        "--leader-elect-lease-duration",
        "4s",
        "--leader-elect-renew-grace",
        "1s",
    ];
    let leases = Api::<Lease>::namespaced(client.clone(), "kube-system");
    let name = format!("apiserver-{}", member.address);
    let written = || async {
        Ok::<_, anyhow::Error>(
            leases
                .get_opt(&name)
                .await?
                .and_then(|lease| lease.spec)
                .and_then(|spec| Some((spec.holder_identity?, spec.renew_time?.0))),
        )
    };

    let mut first = ControllerProcess::start(kubeconfig, &args)?;
    let (holder, renewed) = eventually("the first life's Lease", CONVERGE, written).await?;
    // Killed: nothing withdraws or releases the Lease, as when a container is restarted.
    first.kill()?;
    let mut again = ControllerProcess::start_at(first.admin, kubeconfig, &args)?;
    let renewed_again = eventually(
        "the restarted sidecar renews the Lease",
        CONVERGE,
        || async { Ok(written().await?.filter(|(_, at)| *at != renewed)) },
    )
    .await?;
    assert_eq!(
        renewed_again.0, holder,
        "the restarted sidecar holds the Lease under its previous identity"
    );
    let log = again.log();
    assert!(!log.contains(SHARED), "a restart taken for sharing:\n{log}");
    assert!(again.is_running(), "{log}");

    let other = ControllerProcess::start(kubeconfig, &args)?;
    eventually(
        "another instance at the same address warns that it is shared",
        CONVERGE,
        || async { Ok(other.log().contains(SHARED).then_some(())) },
    )
    .await?;
    Ok(())
}

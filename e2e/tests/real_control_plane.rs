//! What only a real control plane can show: the controller beside real kube-apiservers (built from
//! the Go modules pinned in `e2e/control-plane/`, started by its `up.sh`), judged by their
//! behaviour and their audit logs.
//!
//! Each test starts a control plane of its own (they stop apiservers), one at a time but for the
//! at-rest test's window, which only waits and lets the next one start. Timings are printed, not
//! asserted (2-core machines); BENCHMARKS.md records them. The rest of the e2e suite runs against
//! a shared real control plane through `e2e/control-plane/test.sh`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use common::control_plane::{
    ControlPlane, OwnControlPlane, describe, own_control_plane, own_control_plane_with,
    process_alive, user, writes,
};
use common::{CONVERGE, ConfigFile, ControllerProcess, client_from, eventually, managers};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Namespace, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};

/// A control plane of `test`'s own, one at a time; `None` under the shared control plane.
async fn own(test: &str, apiservers: usize) -> Result<Option<OwnControlPlane>> {
    own_control_plane("real_control_plane", test, apiservers).await
}

/// The addresses the Endpoints and the EndpointSlice list, in that order.
async fn listed(client: &Client) -> Result<(BTreeSet<String>, BTreeSet<String>)> {
    let endpoints = Api::<Endpoints>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?;
    let in_endpoints = endpoints
        .into_iter()
        .flat_map(|e| e.subsets.unwrap_or_default())
        .flat_map(|s| s.addresses.unwrap_or_default())
        .map(|a| a.ip)
        .collect();
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get_opt("kubernetes")
        .await?;
    let in_slice = slice
        .into_iter()
        .flat_map(|s| s.endpoints)
        .flat_map(|e| e.addresses)
        .collect();
    Ok((in_endpoints, in_slice))
}

async fn wait_listed(client: &Client, want: &[&str], what: &str) -> Result<Duration> {
    let started = Instant::now();
    let want: BTreeSet<String> = want.iter().map(|s| (*s).to_owned()).collect();
    eventually(what, CONVERGE, || async {
        let (endpoints, slice) = listed(client).await?;
        Ok((endpoints == want && slice == want).then_some(()))
    })
    .await?;
    Ok(started.elapsed())
}

/// The cluster's service range, and the endpoints loop's Leases renewed every second with a
/// 3s TTL, so that a stopped apiserver leaves the endpoints within seconds.
fn fast_lease_config(cp: &ControlPlane) -> Result<ConfigFile> {
    ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nloops:\n  apiserverEndpoints:\n    interval: 1s\n    leaseTTL: 3s\n",
        cp.service_range()?
    ))
}

/// One sidecar: a controller in `lease` mode whose kubeconfig names its own apiserver.
fn sidecar(cp: &ControlPlane, n: usize, config: &ConfigFile) -> Result<ControllerProcess> {
    let (address, port) = (cp.apiserver_address(n)?, cp.apiserver_port(n)?);
    sidecar_advertising(cp, n, config, address, port)
}

/// The sidecar of apiserver `n`, advertising `address:port` (a VIP in front of several).
fn sidecar_advertising(
    cp: &ControlPlane,
    n: usize,
    config: &ConfigFile,
    address: &str,
    port: &str,
) -> Result<ControllerProcess> {
    let kubeconfig = cp.user_kubeconfig(&format!("sidecar-{n}"), &["system:masters"], n)?;
    let identity = format!("sidecar-{n}");
    ControllerProcess::start(
        &kubeconfig,
        &[
            "--config",
            &config.path,
            "--advertise-address",
            address,
            "--secure-port",
            port,
            "--endpoint-reconciler-type",
            "lease",
            "--leader-elect-identity",
            &identity,
            "--leader-elect-lease-duration",
            "4s",
            "--leader-elect-renew-grace",
            "1s",
        ],
    )
}

async fn leader(client: &Client) -> Result<Option<String>> {
    Ok(Api::<Lease>::namespaced(client.clone(), "kube-system")
        .get_opt("bootstrap-controller")
        .await?
        .and_then(|lease| lease.spec)
        .and_then(|spec| spec.holder_identity))
}

/// Who deleted a membership Lease, from the audit logs.
fn lease_deleters(cp: &ControlPlane, lease: &str) -> Result<Vec<String>> {
    let mut users = Vec::new();
    for n in 1..=3 {
        for event in cp.audit_events(n)? {
            if event["verb"] == "delete"
                && event["objectRef"]["resource"] == "leases"
                && event["objectRef"]["name"] == lease
                && event["responseStatus"]["code"]
                    .as_u64()
                    .is_some_and(|c| c < 300)
            {
                users.push(event["user"]["username"].as_str().unwrap_or("?").to_owned());
            }
        }
    }
    Ok(users)
}

/// Three real apiservers with `--endpoint-reconciler-type=none`, one sidecar each. The sidecars
/// list all three; an apiserver shutting down (SIGTERM) is withdrawn by its own sidecar while the
/// apiserver still serves its shutdown delay; a killed node (apiserver and sidecar SIGKILLed) is
/// removed when its Lease expires; restarting a sidecar alone never takes its healthy
/// apiserver's address out.
#[tokio::test(flavor = "multi_thread")]
async fn sidecars_beside_real_apiservers() -> Result<()> {
    let test = "sidecars_beside_real_apiservers";
    let Some(cp) = own(test, 3).await? else {
        return Ok(());
    };
    let config = fast_lease_config(&cp)?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let [a1, a2, a3] = [1, 2, 3].map(|n| cp.apiserver_address(n).map(str::to_owned));
    let (a1, a2, a3) = (a1?, a2?, a3?);

    // Sidecar 1 leads (started first, and the others wait for it), so the apiservers that go
    // away below are not the leader's.
    let started = Instant::now();
    let mut first = sidecar(&cp, 1, &config)?;
    first.wait_ready().await?;
    eventually("sidecar-1 to lead", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-1")).then_some(()))
    })
    .await?;
    let mut second = sidecar(&cp, 2, &config)?;
    let mut third = sidecar(&cp, 3, &config)?;
    wait_listed(&client, &[&a1, &a2, &a3], "all three apiservers listed").await?;
    println!(
        "real control plane: 3 sidecars listed in Endpoints and EndpointSlice {:.2} s after the first started",
        started.elapsed().as_secs_f64()
    );

    // SIGTERM to apiserver 2: its /readyz fails at once, it serves on for its shutdown delay,
    // and its sidecar deletes its Lease through it.
    cp.signal("kube-apiserver-2", "TERM")?;
    let took = wait_listed(&client, &[&a1, &a3], "apiserver 2 withdrawn after SIGTERM").await?;
    println!(
        "real control plane: SIGTERM to an apiserver -> withdrawn in {:.2} s",
        took.as_secs_f64()
    );
    let lease2 = format!("apiserver-{}", a2.replace(':', "-"));
    let deleters = lease_deleters(&cp, &lease2)?;
    ensure!(
        deleters.iter().any(|user| user == "sidecar-2"),
        "the stopping apiserver's own sidecar should delete its Lease (deleted by {deleters:?})\n{}",
        second.log()
    );
    ensure!(second.is_running(), "sidecar 2 must survive its apiserver");

    // SIGKILL to node 3 (apiserver and sidecar): nobody withdraws it; its Lease expires.
    cp.signal("kube-apiserver-3", "KILL")?;
    third.kill()?;
    let took = wait_listed(&client, &[&a1], "apiserver 3 removed after SIGKILL").await?;
    println!(
        "real control plane: SIGKILL of an apiserver and its sidecar -> removed in {:.2} s (TTL 3 s, interval 1 s)",
        took.as_secs_f64()
    );
    let lease3 = format!("apiserver-{}", a3.replace(':', "-"));
    ensure!(
        lease_deleters(&cp, &lease3)?
            .iter()
            .all(|user| user != "sidecar-3"),
        "a killed sidecar cannot have deleted its Lease"
    );

    // Restart sidecar 1 alone while its apiserver serves: its address never leaves.
    let watching = Arc::new(AtomicBool::new(true));
    let missing = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (client, watching, missing, a1) = (
            client.clone(),
            watching.clone(),
            missing.clone(),
            a1.clone(),
        );
        tokio::spawn(async move {
            // The reads that answered: a watch that saw nothing proves nothing.
            let mut seen = 0usize;
            while watching.load(Ordering::SeqCst) {
                if let Ok((endpoints, slice)) = listed(&client).await {
                    seen += 1;
                    if !endpoints.contains(&a1) || !slice.contains(&a1) {
                        missing.store(true, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        })
    };
    let status = first.terminate()?;
    ensure!(status.success(), "sidecar 1 exited with {status}");
    let mut first = sidecar(&cp, 1, &config)?;
    first.wait_ready().await?;
    eventually("sidecar-1 to lead again", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-1")).then_some(()))
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(4)).await; // past a Lease TTL after the restart
    watching.store(false, Ordering::SeqCst);
    let seen = watcher.await?;
    ensure!(
        seen >= 10,
        "the endpoints were read {seen} times while watched"
    );
    ensure!(
        !missing.load(Ordering::SeqCst),
        "restarting the sidecar of a healthy apiserver took its address out of the endpoints\n{}",
        first.log()
    );
    wait_listed(&client, &[&a1], "apiserver 1 still listed").await?;
    drop(second);
    Ok(())
}

/// Two real apiservers behind one address (a VIP), one sidecar each advertising it: a rolling
/// restart of the second (its apiserver SIGTERMed, failing `/readyz` and stopping, then its
/// sidecar) never takes the address out of the endpoints while the first serves.
#[tokio::test(flavor = "multi_thread")]
async fn a_vip_in_front_of_two_real_apiservers_stays_listed_through_a_rolling_restart() -> Result<()>
{
    const VIP: &str = "192.0.2.100";
    let test = "a_vip_in_front_of_two_real_apiservers_stays_listed_through_a_rolling_restart";
    let Some(cp) = own(test, 2).await? else {
        return Ok(());
    };
    let config = fast_lease_config(&cp)?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let behind_the_vip = |n: usize| sidecar_advertising(&cp, n, &config, VIP, "443");
    let mut first = behind_the_vip(1)?;
    first.wait_ready().await?;
    eventually("sidecar-1 to lead", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-1")).then_some(()))
    })
    .await?;
    let mut second = behind_the_vip(2)?;
    wait_listed(&client, &[VIP], "the VIP listed").await?;
    let shared = "another instance renews this address's membership Lease: the address is shared";
    eventually("both sidecars see the sharing", CONVERGE, || async {
        Ok((first.log().contains(shared) && second.log().contains(shared)).then_some(()))
    })
    .await?;

    let watching = Arc::new(AtomicBool::new(true));
    let missing = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (client, watching, missing) = (client.clone(), watching.clone(), missing.clone());
        tokio::spawn(async move {
            // The reads that answered: a watch that saw nothing proves nothing.
            let mut seen = 0usize;
            while watching.load(Ordering::SeqCst) {
                if let Ok((endpoints, slice)) = listed(&client).await {
                    seen += 1;
                    if !endpoints.contains(VIP) || !slice.contains(VIP) {
                        missing.store(true, Ordering::SeqCst);
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        })
    };
    // Apiserver 2 stops: /readyz fails at once; its sidecar probes it past the threshold.
    cp.signal("kube-apiserver-2", "TERM")?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let status = second.terminate()?;
    ensure!(status.success(), "sidecar 2 exited with {status}");
    let log = second.log();
    ensure!(
        log.contains("keeping this instance's apiserver membership")
            && log.contains("a shared address"),
        "sidecar 2 should keep the shared address at its stop:\n{log}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await; // past a Lease TTL
    watching.store(false, Ordering::SeqCst);
    let seen = watcher.await?;
    ensure!(
        seen >= 10,
        "the endpoints were read {seen} times while watched"
    );
    ensure!(
        !missing.load(Ordering::SeqCst),
        "the VIP left the endpoints while apiserver 1 served behind it\n{}\n{log}",
        first.log()
    );
    wait_listed(&client, &[VIP], "the VIP still listed").await?;
    ensure!(first.is_running(), "sidecar 1 stopped");
    Ok(())
}

/// Beside kube-apiserver's own bootstrap loops (system namespaces, the `kubernetes` Service, the
/// default ServiceCIDR, IPAddress repair) for two minutes with every loop on: once converged,
/// this controller writes nothing but its Lease renewals, no object flips between writers, and
/// counted from the audit log, the controller sends no request at all but its Lease renewals,
/// the `/readyz` probes that gate them, and its watches (which stay open): no GET, no LIST.
#[tokio::test(flavor = "multi_thread")]
async fn at_rest_beside_the_apiservers_own_loops() -> Result<()> {
    let test = "at_rest_beside_the_apiservers_own_loops";
    let Some(mut cp) = own(test, 1).await? else {
        return Ok(());
    };
    let config = fast_lease_config(&cp)?;
    let mut controller = sidecar(&cp, 1, &config)?;
    controller.wait_ready().await?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    wait_listed(&client, &[cp.apiserver_address(1)?], "the apiserver listed").await?;
    // Converged: the first passes have written what they write on a new cluster.
    tokio::time::sleep(Duration::from_secs(5)).await;
    // Every loop watches now, and its Lease and probe go on: over h2 all of it shares one
    // connection to the apiserver.
    let pid = controller
        .pid()
        .ok_or_else(|| anyhow::anyhow!("the controller has exited"))?;
    let port: u16 = cp.apiserver_port(1)?.parse()?;
    let connections = established_to(pid, port)?;
    println!("real control plane at rest: {connections} TCP connection(s) to the apiserver");
    ensure!(
        connections == 1,
        "{connections} connections from the controller to its apiserver; one (HTTP/2) expected"
    );
    let before = cp.audit_events(1)?.len();
    // The window only waits: the file's next control plane may start meanwhile.
    cp.let_the_next_start();
    let window = rest_window();
    tokio::time::sleep(window).await;
    let events = cp.audit_events(1)?;
    let during = &events[before..];
    let ours: Vec<String> = writes(during)
        .into_iter()
        .filter(|event| event["user"]["username"] == "sidecar-1")
        .filter(|event| event["objectRef"]["resource"] != "leases")
        .map(describe)
        .collect();
    let lease_writes = writes(during)
        .into_iter()
        .filter(|event| event["user"]["username"] == "sidecar-1")
        .count();
    // Anyone's writes to the objects both sides keep: a flip-flop shows as writes by both.
    let contested: Vec<String> = writes(during)
        .into_iter()
        .filter(|event| {
            matches!(
                event["objectRef"]["resource"].as_str(),
                Some(
                    "namespaces"
                        | "services"
                        | "endpoints"
                        | "endpointslices"
                        | "servicecidrs"
                        | "ipaddresses"
                )
            )
        })
        .map(describe)
        .collect();
    println!(
        "real control plane at rest, {} s: {} writes by the controller ({} Lease renewals), {} writes to shared objects by anyone",
        window.as_secs(),
        lease_writes,
        lease_writes - ours.len(),
        contested.len()
    );
    ensure!(
        ours.is_empty(),
        "writes other than Lease renewals at rest:\n{}",
        ours.join("\n")
    );
    ensure!(
        contested.is_empty(),
        "objects written at rest (a fight between writers?):\n{}",
        contested.join("\n")
    );
    ensure!(
        lease_writes > 0,
        "no Lease renewal seen: was the controller running?"
    );
    let at_rest = AtRest::of(during, "sidecar-1");
    println!(
        "real control plane at rest, {} s: requests by the controller: {} to its Leases, {} /readyz probes, {} watches resumed, {} others",
        window.as_secs(),
        at_rest.leases,
        at_rest.readyz,
        at_rest.resumed_watches,
        at_rest.others.len()
    );
    ensure!(
        at_rest.others.is_empty(),
        "requests at rest other than Lease renewals, /readyz probes and watches staying open:\n{}",
        at_rest.others.join("\n")
    );
    ensure!(controller.is_running());
    Ok(())
}

/// The established TCP connections of process `pid` to `port` (on any address), from /proc: its
/// socket inodes, matched in its network namespace's tcp tables.
fn established_to(pid: u32, port: u16) -> Result<usize> {
    let mut inodes = BTreeSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(target) = std::fs::read_link(entry?.path()) else {
            continue;
        };
        if let Some(inode) = target
            .to_string_lossy()
            .strip_prefix("socket:[")
            .and_then(|rest| rest.strip_suffix(']'))
        {
            inodes.insert(inode.to_owned());
        }
    }
    let mut count = 0;
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))?;
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(remote), Some(state), Some(inode)) =
                (fields.get(2), fields.get(3), fields.get(9))
            else {
                continue;
            };
            let remote_port = remote
                .rsplit(':')
                .next()
                .and_then(|hex| u16::from_str_radix(hex, 16).ok());
            // 01: ESTABLISHED.
            if *state == "01" && remote_port == Some(port) && inodes.contains(*inode) {
                count += 1;
            }
        }
    }
    Ok(count)
}

/// What a controller at rest asked its apiserver, counted from the audit events of a window.
struct AtRest {
    /// Requests to Leases in kube-system: leader election and apiserver membership renewals.
    leases: usize,
    /// `GET /readyz`: each membership renewal is gated on its own apiserver being ready.
    readyz: usize,
    /// Watches re-established from their resourceVersion (a watch the apiserver ended): they
    /// carry only changes, of which there are none at rest.
    resumed_watches: usize,
    /// Everything else (reads of objects, lists, writes other than Leases, watches started
    /// afresh), each described: none is expected at rest.
    others: Vec<String>,
}

impl AtRest {
    fn of(events: &[serde_json::Value], username: &str) -> Self {
        let mut at_rest = AtRest {
            leases: 0,
            readyz: 0,
            resumed_watches: 0,
            others: Vec::new(),
        };
        for event in events.iter().filter(|event| user(event) == username) {
            let uri = event["requestURI"].as_str().unwrap_or_default();
            if event["objectRef"]["resource"] == "leases"
                && event["objectRef"]["namespace"] == "kube-system"
            {
                at_rest.leases += 1;
            } else if event["verb"] == "get" && (uri == "/readyz" || uri.starts_with("/readyz?")) {
                at_rest.readyz += 1;
            } else if event["verb"] == "watch"
                && event["stage"] == "ResponseStarted"
                && uri.contains("resourceVersion=")
                && !uri.contains("resourceVersion=0&")
                && !uri.ends_with("resourceVersion=0")
                && !uri.contains("sendInitialEvents=true")
            {
                at_rest.resumed_watches += 1;
            } else if event["verb"] == "watch" && event["stage"] == "ResponseComplete" {
                // The end of a watch opened before the window: counted when it is resumed.
            } else {
                at_rest.others.push(format!("{} ({uri})", describe(event)));
            }
        }
        at_rest
    }
}

/// How long the at-rest test watches: 120 s, or `BOOTSTRAP_E2E_REST_SECONDS`.
fn rest_window() -> Duration {
    let seconds = std::env::var("BOOTSTRAP_E2E_REST_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(seconds)
}

/// A deleted `kube-node-lease` and a deleted declared extra namespace come back after the real
/// namespace controller finalizes them (the real apiserver refuses to delete `default`,
/// `kube-system` and `kube-public`), recreated by this controller: the audit log names its user
/// for the one create that succeeded, and its repair counter moved.
#[tokio::test(flavor = "multi_thread")]
async fn namespace_deletion_heals_through_the_real_namespace_controller() -> Result<()> {
    let test = "namespace_deletion_heals_through_the_real_namespace_controller";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nendpointReconcilerType: none\nloops:\n  systemNamespaces:\n    namespaces:\n      - name: kube-system\n      - name: kube-public\n      - name: kube-node-lease\n      - name: default\n      - name: tenant-extra\n        labels: {{team: platform}}\n",
        cp.service_range()?
    ))?;
    // A user of its own, so that the audit log tells its requests from the test's.
    let keeper = "namespace-keeper";
    let kubeconfig = cp.user_kubeconfig(keeper, &["system:masters"], 1)?;
    let mut controller = ControllerProcess::start(&kubeconfig, &["--config", &config.path])?;
    controller.wait_ready().await?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    for name in ["kube-node-lease", "tenant-extra"] {
        active(&namespaces, name).await?;
    }
    let mut gone_to_back = Vec::new();
    let mut delete_to_back = Vec::new();
    for round in 0..3 {
        for name in ["kube-node-lease", "tenant-extra"] {
            let repaired = controller
                .repaired("system-namespaces", "namespace_missing")
                .await?;
            let seen = cp.audit_events(1)?.len();
            let deleted = Instant::now();
            namespaces.delete(name, &DeleteParams::default()).await?;
            // Gone: the namespace controller emptied and finalized it.
            let gone = eventually(
                &format!("{name} finalized (round {round})"),
                CONVERGE,
                || async {
                    Ok(match namespaces.get_opt(name).await? {
                        None => Some(Instant::now()),
                        Some(ns) if ns.metadata.deletion_timestamp.is_none() => {
                            Some(Instant::now())
                        }
                        Some(_) => None,
                    })
                },
            )
            .await?;
            active(&namespaces, name).await?;
            gone_to_back.push(gone.elapsed());
            delete_to_back.push(deleted.elapsed());
            let creators: Vec<String> = cp.audit_events(1)?[seen..]
                .iter()
                .filter(|event| {
                    event["verb"] == "create"
                        && event["objectRef"]["resource"] == "namespaces"
                        && event["objectRef"]["name"] == name
                        && event["responseStatus"]["code"] == 201
                })
                .map(|event| event["user"]["username"].as_str().unwrap_or("?").to_owned())
                .collect();
            ensure!(
                creators == [keeper],
                "{name} (round {round}) should be recreated once, by {keeper}: created by {creators:?}"
            );
            eventually(
                &format!("the repair of {name} counted (round {round})"),
                CONVERGE,
                || async {
                    let now = controller
                        .repaired("system-namespaces", "namespace_missing")
                        .await?;
                    Ok((now > repaired).then_some(()))
                },
            )
            .await?;
        }
    }
    let ns = namespaces.get("tenant-extra").await?;
    ensure!(
        ns.metadata
            .labels
            .unwrap_or_default()
            .get("team")
            .map(String::as_str)
            == Some("platform"),
        "the declared label is back"
    );
    common::summary(
        "real control plane: namespace gone (finalized) -> back",
        gone_to_back,
    );
    common::summary(
        "real control plane: namespace delete request -> back (through finalization)",
        delete_to_back,
    );
    ensure!(controller.is_running());
    Ok(())
}

/// Waits for `name` to be live and Active. The wait is [`CONVERGE`], 30 s: a bound on correctness
/// as well as patience, since kube-apiserver's own system-namespaces loop recreates
/// `kube-node-lease` once a minute; the audit log's creator is what tells the two apart.
async fn active(namespaces: &Api<Namespace>, name: &str) -> Result<()> {
    eventually(&format!("{name} active"), CONVERGE, || async {
        Ok(namespaces.get_opt(name).await?.and_then(|ns| {
            (ns.metadata.deletion_timestamp.is_none()
                && ns.status.and_then(|s| s.phase).as_deref() == Some("Active"))
            .then_some(())
        }))
    })
    .await
}

/// The harness itself: up.sh's control plane answers, down.sh stops exactly what it started.
#[tokio::test(flavor = "multi_thread")]
async fn the_harness_starts_and_stops_exactly_its_processes() -> Result<()> {
    let test = "the_harness_starts_and_stops_exactly_its_processes";
    let Some(cp) = own(test, 2).await? else {
        return Ok(());
    };
    let names = [
        "etcd",
        "kube-apiserver-1",
        "kube-apiserver-2",
        "kube-controller-manager",
    ];
    for name in names {
        ensure!(
            cp.is_running(name)?,
            "{name} is not running:\n{}",
            cp.log(name)
        );
    }
    let pids: Vec<u32> = names.iter().map(|n| cp.pid(n)).collect::<Result<_>>()?;
    for n in 1..=2 {
        let client = client_from(&cp.admin_kubeconfig(n)).await?;
        let version = client.apiserver_version().await?;
        ensure!(version.git_version.starts_with("v1."), "{version:?}");
    }
    // A user without any binding is refused: the RBAC authorizer is on.
    let nobody = cp.user_kubeconfig("nobody", &[], 1)?;
    let refused = Api::<Namespace>::all(client_from(&nobody).await?)
        .list(&Default::default())
        .await;
    ensure!(
        matches!(&refused, Err(kube::Error::Api(status)) if status.code == 403),
        "{refused:?}"
    );
    drop(cp);
    for pid in pids {
        ensure!(!process_alive(pid), "process {pid} survived down.sh");
    }
    Ok(())
}

/// An IPv6 service range (the documentation prefix), as a single-stack IPv6 cluster has it.
const IPV6_RANGE: &str = "2001:db8:96::/112";

/// A real control plane whose only service range is IPv6, its apiserver advertising an IPv6
/// address: the `kubernetes` Service is single-stack IPv6 on the range's first address, the
/// Endpoints and the EndpointSlice (address type IPv6) list the advertised address, written by
/// this controller, and a Service's lost IPAddress is recreated by this controller's ClusterIP
/// repair with the IPv6 family label.
#[tokio::test(flavor = "multi_thread")]
async fn an_ipv6_service_range_on_a_real_control_plane() -> Result<()> {
    let test = "an_ipv6_service_range_on_a_real_control_plane";
    let Some(cp) = own_control_plane_with(
        "real_control_plane",
        test,
        1,
        &["--service-cluster-ip-range", IPV6_RANGE],
    )
    .await?
    else {
        return Ok(());
    };
    let address = cp.apiserver_address(1)?.to_owned();
    ensure!(
        address.parse::<std::net::Ipv6Addr>().is_ok(),
        "up.sh should advertise an IPv6 address beside an IPv6 service range, not {address}"
    );
    let config = fast_lease_config(&cp)?;
    let mut controller = sidecar(&cp, 1, &config)?;
    controller.wait_ready().await?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    wait_listed(&client, &[&address], "the IPv6 apiserver listed").await?;

    let service = Api::<Service>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await?;
    let spec = service.spec.context("the kubernetes Service has no spec")?;
    ensure!(
        spec.cluster_ip.as_deref() == Some("2001:db8:96::1")
            && spec.ip_families.as_deref() == Some(&["IPv6".to_owned()][..])
            && spec.ip_family_policy.as_deref() == Some("SingleStack"),
        "the kubernetes Service should be single-stack IPv6 on the range's first address: {:?} {:?} {:?}",
        spec.cluster_ip,
        spec.ip_families,
        spec.ip_family_policy
    );
    let slice = Api::<EndpointSlice>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await?;
    ensure!(
        slice.address_type == "IPv6",
        "the kubernetes EndpointSlice's addressType is {}, not IPv6",
        slice.address_type
    );
    let endpoints = Api::<Endpoints>::namespaced(client.clone(), "default")
        .get("kubernetes")
        .await?;
    for (what, meta) in [
        ("Endpoints", &endpoints.metadata),
        ("EndpointSlice", &slice.metadata),
    ] {
        let managers = managers(meta);
        ensure!(
            managers.iter().any(|m| m == "bootstrap-controller"),
            "the kubernetes {what} was not written by this controller: {managers:?}"
        );
    }

    // A Service's IPAddress lost: kube-apiserver's own repair recreates it only on its 3-minute
    // resync, so the IPAddress back within seconds, under this controller's field manager, is
    // this controller's repair, and its counter says so.
    let services = Api::<Service>::namespaced(client.clone(), "default");
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "ipv6-web"},
        "spec": {"ports": [{"port": 80}]}
    }))?;
    let web = services.create(&PostParams::default(), &web).await?;
    let ip = web
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the apiserver allocated no clusterIP")?;
    let in_range: ipnet::Ipv6Net = IPV6_RANGE.parse()?;
    ensure!(
        ip.parse::<std::net::Ipv6Addr>()
            .is_ok_and(|ip| in_range.contains(&ip)),
        "the Service's clusterIP {ip} is not of {IPV6_RANGE}"
    );
    let addresses = Api::<IPAddress>::all(client.clone());
    let lost = addresses.get(&ip).await?.metadata.uid;
    let repaired = controller
        .repaired("clusterip-repair", "clusterip_not_allocated")
        .await?;
    addresses.delete(&ip, &DeleteParams::default()).await?;
    let back = eventually("the lost IPv6 IPAddress recreated", CONVERGE, || async {
        Ok(addresses
            .get_opt(&ip)
            .await?
            .filter(|address| address.metadata.uid != lost))
    })
    .await?;
    let managers = managers(&back.metadata);
    ensure!(
        managers.iter().any(|m| m == "bootstrap-controller"),
        "{ip} came back, but not written by this controller: {managers:?}"
    );
    let family = back
        .metadata
        .labels
        .unwrap_or_default()
        .get("ipaddress.kubernetes.io/ip-family")
        .cloned();
    ensure!(
        family.as_deref() == Some("IPv6"),
        "the recreated IPAddress's family label is {family:?}"
    );
    let parent = back.spec.map(|s| s.parent_ref).context("no spec")?;
    ensure!(
        parent.resource == "services" && parent.name == "ipv6-web",
        "wrong parentRef: {parent:?}"
    );
    eventually("the repair counted", CONVERGE, || async {
        let now = controller
            .repaired("clusterip-repair", "clusterip_not_allocated")
            .await?;
        Ok((now > repaired).then_some(()))
    })
    .await?;
    ensure!(controller.is_running());
    Ok(())
}

/// Two service ranges, IPv4 first: the cluster's `kubernetes` Service is single-stack IPv4.
const DUAL_STACK_RANGES: &str = "10.97.0.0/24,2001:db8:97::/112";

/// A `kubernetes` Service of the wrong primary family on a real dual-stack control plane
/// (IPv6 first, holding the IPv4 range's first address as its secondary), as one left by a
/// cluster whose ranges were swapped: with `recreateOnClusterIPMismatch`, this controller's
/// checks (a live list, then kube-apiserver's dry-run create of the copy) let it through, and
/// it is recreated single-stack IPv4 on that address, once, with its event. kube-apiserver's
/// own loop only creates a missing Service and leaves this one as it is.
#[tokio::test(flavor = "multi_thread")]
async fn a_kubernetes_service_of_the_wrong_primary_family_is_recreated() -> Result<()> {
    let test = "a_kubernetes_service_of_the_wrong_primary_family_is_recreated";
    let Some(cp) = own_control_plane_with(
        "real_control_plane",
        test,
        1,
        &["--service-cluster-ip-range", DUAL_STACK_RANGES],
    )
    .await?
    else {
        return Ok(());
    };
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let services = Api::<Service>::namespaced(client.clone(), "default");
    let family = |service: &Service| {
        let spec = service.spec.clone().unwrap_or_default();
        (spec.ip_families, spec.cluster_ips)
    };
    let made = eventually("kube-apiserver's kubernetes Service", CONVERGE, || async {
        Ok(services.get_opt("kubernetes").await?)
    })
    .await?;
    ensure!(
        family(&made) == (Some(vec!["IPv4".into()]), Some(vec!["10.97.0.1".into()])),
        "kube-apiserver made {:?}",
        family(&made)
    );
    let wrong: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kubernetes", "namespace": "default",
                     "labels": {"provider": "kubernetes", "component": "apiserver"}},
        "spec": {
            "clusterIP": "2001:db8:97::1",
            "clusterIPs": ["2001:db8:97::1", "10.97.0.1"],
            "ipFamilies": ["IPv6", "IPv4"],
            "ipFamilyPolicy": "RequireDualStack",
            "ports": [{"name": "https", "port": 443, "protocol": "TCP", "targetPort": 6443}]
        }
    }))?;
    // kube-apiserver's loop recreates a missing Service every 10 s: the swap is tried again
    // should it win the gap between the delete and the create.
    eventually("the wrong-family Service in place", CONVERGE, || async {
        if let Some(current) = services.get_opt("kubernetes").await?
            && family(&current).0.as_deref() == Some(&["IPv6".to_owned(), "IPv4".to_owned()][..])
        {
            return Ok(Some(()));
        }
        services
            .delete("kubernetes", &DeleteParams::default())
            .await
            .ok();
        services.create(&PostParams::default(), &wrong).await.ok();
        Ok(None)
    })
    .await?;

    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {DUAL_STACK_RANGES}\nloops:\n  kubernetesService:\n    recreateOnClusterIPMismatch: true\n"
    ))?;
    let mut controller = sidecar(&cp, 1, &config)?;
    controller.wait_ready().await?;
    let right = eventually("the kubernetes Service recreated", CONVERGE, || async {
        Ok(services
            .get_opt("kubernetes")
            .await?
            .filter(|s| family(s).0.as_deref() == Some(&["IPv4".to_owned()][..])))
    })
    .await?;
    let spec = right.spec.clone().context("no spec")?;
    ensure!(
        spec.cluster_ips.as_deref() == Some(&["10.97.0.1".to_owned()][..])
            && spec.ip_family_policy.as_deref() == Some("SingleStack"),
        "recreated as {:?} {:?}",
        spec.cluster_ips,
        spec.ip_family_policy
    );
    eventually("the recreation counted", CONVERGE, || async {
        let repaired = controller
            .repaired("kubernetes-service", "service_cluster_ip")
            .await?;
        Ok((repaired == 1).then_some(()))
    })
    .await?;
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(client.clone(), "default")
        .list(&Default::default())
        .await?;
    let recreated = (events.items.iter())
        .filter(|e| e.reason.as_deref() == Some("KubernetesServiceRecreated"))
        .count();
    ensure!(
        recreated == 1,
        "{recreated} KubernetesServiceRecreated events"
    );
    ensure!(controller.is_running());
    Ok(())
}

/// The membership Lease of the apiserver advertising `address`.
fn membership_lease(address: &str) -> String {
    format!("apiserver-{}", address.replace(':', "-"))
}

/// A leading sidecar beside its ready real apiserver, sent SIGTERM, does what the simulator test
/// (`apiserver_endpoints.rs`, `sigterm_keeps_a_ready_apiservers_address_and_withdraws_a_stopping_ones`)
/// asserts: it renews its membership Lease on the way out (a later `renewTime`, the update in the
/// audit log after the signal) and keeps its address listed; and it releases the leader Lease
/// (no holder), so a successor need not wait for it to expire. A long interval and TTL keep the
/// loops' regular passes out of the way: what is seen after the signal is the shutdown's.
#[tokio::test(flavor = "multi_thread")]
async fn sigterm_renews_the_membership_lease_and_releases_the_leader_lease() -> Result<()> {
    let test = "sigterm_renews_the_membership_lease_and_releases_the_leader_lease";
    let Some(cp) = own(test, 1).await? else {
        return Ok(());
    };
    let config = ConfigFile::new(&format!(
        "serviceClusterIPRange: {}\nloops:\n  apiserverEndpoints:\n    interval: 30s\n    leaseTTL: 5m\n",
        cp.service_range()?
    ))?;
    let address = cp.apiserver_address(1)?.to_owned();
    let mut controller = sidecar(&cp, 1, &config)?;
    controller.wait_ready().await?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    eventually("sidecar-1 to lead", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-1")).then_some(()))
    })
    .await?;
    wait_listed(&client, &[&address], "the apiserver listed").await?;
    let leases = Api::<Lease>::namespaced(client.clone(), "kube-system");
    let lease = membership_lease(&address);
    let renewed = |lease: Option<Lease>| {
        lease
            .and_then(|l| l.spec)
            .and_then(|s| s.renew_time)
            .map(|t| t.0)
    };
    let before = renewed(leases.get_opt(&lease).await?).context("renewed at start")?;
    let seen = settled_audit(&cp, 1, "sidecar-1").await?;
    let status = controller.terminate()?;
    let log = controller.log();
    ensure!(status.success(), "exit status {status}:\n{log}");

    let after = renewed(leases.get_opt(&lease).await?).context("the Lease is kept")?;
    ensure!(
        after > before,
        "renewed at stop: {before} -> {after}\n{log}"
    );
    ensure!(
        log.contains("renewed this instance's membership Lease on the way out"),
        "{log}"
    );
    let since = &cp.audit_events(1)?[seen..];
    let written = |name: &str| {
        writes(since)
            .into_iter()
            .filter(|event| {
                user(event) == "sidecar-1"
                    && event["objectRef"]["resource"] == "leases"
                    && event["objectRef"]["name"] == name
                    && event["responseStatus"]["code"] == 200
            })
            .count()
    };
    ensure!(
        written(&lease) >= 1,
        "no renewal of {lease} by sidecar-1 in the audit log after SIGTERM"
    );
    let holder = leader(&client).await?;
    ensure!(
        holder.is_none() && written("bootstrap-controller") >= 1,
        "the leader Lease should be released on the way out (holder {holder:?})\n{log}"
    );
    ensure!(
        writes(since)
            .into_iter()
            .all(|event| user(event) != "sidecar-1" || event["objectRef"]["resource"] == "leases"),
        "wrote more than its Leases on the way out:\n{}",
        writes(since)
            .into_iter()
            .filter(|event| user(event) == "sidecar-1")
            .map(describe)
            .collect::<Vec<_>>()
            .join("\n")
    );
    wait_listed(&client, &[&address], "the address kept").await?;
    Ok(())
}

/// How many audit events apiserver `n` has logged once `user`'s writes besides its Leases have
/// settled. The pass that lists a member publishes its events (the member joined, the repairs)
/// just after its Endpoints and EndpointSlice writes: one still on its way when the count is
/// taken would count as written after it. Settled: an event was written after the last Endpoints
/// or EndpointSlice write, and no other write came for two seconds.
async fn settled_audit(cp: &ControlPlane, n: usize, user_name: &str) -> Result<usize> {
    let others = |events: &[serde_json::Value]| -> Vec<String> {
        writes(events)
            .into_iter()
            .filter(|event| user(event) == user_name && event["objectRef"]["resource"] != "leases")
            .map(describe)
            .collect()
    };
    let deadline = Instant::now() + CONVERGE;
    let (mut last, mut since) = (others(&cp.audit_events(n)?), Instant::now());
    loop {
        // An event written after the last write of another kind (or no write at all).
        let told = last
            .iter()
            .rposition(|write| !write.contains(" events "))
            .is_none_or(|at| last[at..].iter().any(|write| write.contains(" events ")));
        if told && since.elapsed() >= Duration::from_secs(2) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "{user_name}'s writes did not settle in {CONVERGE:?}: {last:#?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = others(&cp.audit_events(n)?);
        if now != last {
            (last, since) = (now, Instant::now());
        }
    }
    Ok(cp.audit_events(n)?.len())
}

/// The writes of the replicas `users` to the objects only the leader writes, oldest first, as
/// runs of one writer: `[(user, writes in a row)]`.
fn writer_runs(
    cp: &ControlPlane,
    apiservers: usize,
    users: &[&str],
) -> Result<Vec<(String, usize)>> {
    let mut events = Vec::new();
    for n in 1..=apiservers {
        events.extend(cp.audit_events(n)?);
    }
    let mut leader_writes: Vec<(String, String)> = writes(&events)
        .into_iter()
        .filter(|event| users.contains(&user(event)))
        .filter(|event| {
            matches!(
                event["objectRef"]["resource"].as_str(),
                Some("endpoints" | "endpointslices" | "namespaces" | "services")
            )
        })
        .map(|event| {
            (
                event["requestReceivedTimestamp"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                user(event).to_owned(),
            )
        })
        .collect();
    leader_writes.sort();
    let mut runs: Vec<(String, usize)> = Vec::new();
    for (_, writer) in leader_writes {
        match runs.last_mut() {
            Some((last, count)) if *last == writer => *count += 1,
            _ => runs.push((writer, 1)),
        }
    }
    Ok(runs)
}

/// Two replicas against one real control plane, each the sidecar of its own apiserver: the leader
/// is killed (SIGKILL, no release), the other takes over, and the audit logs show the writes to
/// the `kubernetes` Endpoints, EndpointSlice and Service and to namespaces coming from one
/// replica and then the other, never interleaved, each having written (a namespace deleted
/// before and after the handover gives each something to repair; the killed sidecar's address
/// leaving gives the new leader an endpoints write).
#[tokio::test(flavor = "multi_thread")]
async fn one_writer_at_a_time_through_a_leader_handover() -> Result<()> {
    let test = "one_writer_at_a_time_through_a_leader_handover";
    let Some(cp) = own(test, 2).await? else {
        return Ok(());
    };
    let config = fast_lease_config(&cp)?;
    let client = client_from(&cp.admin_kubeconfig(1)).await?;
    let (a1, a2) = (
        cp.apiserver_address(1)?.to_owned(),
        cp.apiserver_address(2)?.to_owned(),
    );
    let mut first = sidecar(&cp, 1, &config)?;
    first.wait_ready().await?;
    eventually("sidecar-1 to lead", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-1")).then_some(()))
    })
    .await?;
    let mut second = sidecar(&cp, 2, &config)?;
    second.wait_ready().await?;
    wait_listed(&client, &[&a1, &a2], "both apiservers listed").await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    let heal = |round: &'static str| {
        let namespaces = namespaces.clone();
        async move {
            let before = namespaces.get("kube-node-lease").await?.metadata.uid;
            namespaces
                .delete("kube-node-lease", &DeleteParams::default())
                .await?;
            eventually(
                &format!("kube-node-lease back ({round})"),
                CONVERGE,
                || async {
                    Ok(namespaces.get_opt("kube-node-lease").await?.filter(|ns| {
                        ns.metadata.uid != before && ns.metadata.deletion_timestamp.is_none()
                    }))
                },
            )
            .await
            .map(drop)
        }
    };
    heal("before the handover").await?;
    let runs = writer_runs(&cp, 2, &["sidecar-1", "sidecar-2"])?;
    ensure!(
        runs.len() == 1 && runs[0].0 == "sidecar-1",
        "only the leader, sidecar-1, should have written before the handover: {runs:?}"
    );

    first.kill()?;
    eventually("sidecar-2 to lead", CONVERGE, || async {
        Ok((leader(&client).await?.as_deref() == Some("sidecar-2")).then_some(()))
    })
    .await?;
    wait_listed(&client, &[&a2], "the killed sidecar's apiserver removed").await?;
    heal("after the handover").await?;
    ensure!(second.is_running(), "sidecar 2 stopped:\n{}", second.log());

    let runs = writer_runs(&cp, 2, &["sidecar-1", "sidecar-2"])?;
    println!("real control plane: writes to the leader's objects by replica, in order: {runs:?}");
    let writers: Vec<&str> = runs.iter().map(|(writer, _)| writer.as_str()).collect();
    ensure!(
        writers == ["sidecar-1", "sidecar-2"],
        "the leader's objects should be written by sidecar-1, then by sidecar-2 alone, never \
         both in turn: {runs:?}"
    );
    Ok(())
}

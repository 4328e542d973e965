//! What only a real control plane can show: the controller beside real kube-apiservers (built from
//! the Go modules pinned in `e2e/control-plane/`, started by its `up.sh`), judged by their
//! behaviour and their audit logs.
//!
//! Each test starts a control plane of its own (they stop apiservers), one at a time. Timings are
//! printed, not asserted (2-core machines); BENCHMARKS.md records them. The rest of the e2e suite
//! runs against a shared real control plane through `e2e/control-plane/test.sh`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use common::control_plane::{
    ControlPlane, OwnControlPlane, describe, own_control_plane, process_alive, writes,
};
use common::{CONVERGE, ConfigFile, ControllerProcess, client_from, eventually};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Endpoints, Namespace};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::DeleteParams;
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
            while watching.load(Ordering::SeqCst) {
                if let Ok((endpoints, slice)) = listed(&client).await
                    && (!endpoints.contains(&a1) || !slice.contains(&a1))
                {
                    missing.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
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
    watcher.await?;
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
            while watching.load(Ordering::SeqCst) {
                if let Ok((endpoints, slice)) = listed(&client).await
                    && (!endpoints.contains(VIP) || !slice.contains(VIP))
                {
                    missing.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
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
    watcher.await?;
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
/// this controller writes nothing but its Lease renewals, and no object flips between writers.
#[tokio::test(flavor = "multi_thread")]
async fn at_rest_beside_the_apiservers_own_loops() -> Result<()> {
    let test = "at_rest_beside_the_apiservers_own_loops";
    let Some(cp) = own(test, 1).await? else {
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
/// `kube-system` and `kube-public`).
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
    let kubeconfig = cp.admin_kubeconfig(1);
    let mut controller = ControllerProcess::start(&kubeconfig, &["--config", &config.path])?;
    controller.wait_ready().await?;
    let client = client_from(&kubeconfig).await?;
    let namespaces = Api::<Namespace>::all(client.clone());
    for name in ["kube-node-lease", "tenant-extra"] {
        active(&namespaces, name).await?;
    }
    let mut gone_to_back = Vec::new();
    let mut delete_to_back = Vec::new();
    for round in 0..3 {
        for name in ["kube-node-lease", "tenant-extra"] {
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

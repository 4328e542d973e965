//! Leader election against the API simulator: one leader at a time, failover on release, and
//! stepping down (without exiting) while the API fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use bootstrap_controller::config::LeaderElection;
use bootstrap_controller::health::Health;
use bootstrap_controller::leader::{self, LeaderMetrics};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

fn settings(identity: &str) -> LeaderElection {
    LeaderElection {
        enabled: true,
        lease_name: "bootstrap-controller".to_owned(),
        lease_namespace: "kube-system".to_owned(),
        identity: identity.to_owned(),
        lease_duration: Duration::from_secs(2),
        renew_grace: Duration::from_secs(1),
    }
}

/// Candidate `identity` in the election against `sim`, reporting to `health`: whether it leads,
/// its task, and the token that stops it.
async fn candidate(
    sim: &Sim,
    identity: &str,
    health: Health,
) -> anyhow::Result<(watch::Receiver<bool>, JoinHandle<()>, CancellationToken)> {
    let cancel = CancellationToken::new();
    let (leads, task) = leader::spawn(
        sim.new_client().await?.into(),
        settings(identity),
        LeaderMetrics::default(),
        health,
        cancel.clone(),
    );
    Ok((leads, task, cancel))
}

/// Faults cleared, the candidate leads again.
async fn leads_again_once_the_api_answers(sim: &Sim, leads: &watch::Receiver<bool>) {
    sim.faults().clear();
    eventually("leads again once the API answers", leads, true).await;
}

/// Stops the candidate, waits for its task to end, and shuts the simulator down.
async fn stop(sim: Sim, cancel: CancellationToken, task: JoinHandle<()>) -> anyhow::Result<()> {
    cancel.cancel();
    task.await?;
    sim.shutdown().await;
    Ok(())
}

/// Every request for Leases fails with `kind` until the faults are cleared.
fn leases_fail(sim: &Sim, kind: FaultKind) {
    sim.faults()
        .inject(FaultRule::probability(None, Some("leases"), 1.0, kind));
}

/// Whether `receiver` said true at any moment from now on (a sleep then a read of its last
/// value would miss a brief second leader).
fn ever_true(receiver: &watch::Receiver<bool>) -> Arc<AtomicBool> {
    let seen = Arc::new(AtomicBool::new(*receiver.borrow()));
    let (mut receiver, flag) = (receiver.clone(), seen.clone());
    tokio::spawn(async move {
        while receiver.changed().await.is_ok() {
            if *receiver.borrow_and_update() {
                flag.store(true, Ordering::SeqCst);
            }
        }
    });
    seen
}

/// The election's Lease: its holder and when it was last renewed.
async fn lease(sim: &Sim) -> anyhow::Result<(Option<String>, Option<String>)> {
    use k8s_openapi::api::coordination::v1::Lease;
    let leases = kube::Api::<Lease>::namespaced(sim.new_client().await?, "kube-system");
    let spec = leases
        .get("bootstrap-controller")
        .await?
        .spec
        .unwrap_or_default();
    let renewed = spec.renew_time.map(|time| time.0.to_string());
    Ok((spec.holder_identity, renewed))
}

async fn eventually(what: &str, receiver: &watch::Receiver<bool>, want: bool) {
    let holds = || std::future::ready(*receiver.borrow() == want);
    if let Err(err) = test_support::eventually(what, Duration::from_secs(30), holds).await {
        panic!("{err}");
    }
}

#[tokio::test]
async fn one_leader_at_a_time_and_failover_on_release() -> anyhow::Result<()> {
    // No namespaces at all: the election must create kube-system for its Lease.
    let sim = Sim::start(SimConfig::default()).await?;
    let (a, task_a, cancel_a) = candidate(&sim, "a", Health::default()).await?;
    eventually("a leads", &a, true).await;

    let (b, task_b, cancel_b) = candidate(&sim, "b", Health::default()).await?;
    let b_led = ever_true(&b);
    let (_, renewed) = lease(&sim).await?;
    // Give b a few renew periods to (wrongly) take over.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(*a.borrow(), "a keeps leading while it renews");
    assert!(
        !b_led.load(Ordering::SeqCst),
        "b must not lead while a holds the Lease"
    );
    // a renewed it meanwhile, and holds it still.
    let (holder, renewed_now) = lease(&sim).await?;
    assert_eq!(holder.as_deref(), Some("a"));
    assert_ne!(renewed_now, renewed, "a did not renew the Lease");

    cancel_a.cancel();
    task_a.await?;
    assert!(!*a.borrow(), "a stepped down on shutdown");
    eventually("b takes over after a released", &b, true).await;

    stop(sim, cancel_b, task_b).await
}

#[tokio::test]
async fn steps_down_while_the_api_fails_and_returns_after() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let health = Health::default();
    let (receiver, task, cancel) = candidate(&sim, "a", health.clone()).await?;
    eventually("a leads", &receiver, true).await;
    assert_eq!(
        health.readiness().lines,
        ["[+]leader-election ok (leader)"],
        "ready as leader"
    );

    leases_fail(
        &sim,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    );
    eventually("steps down while renewals fail", &receiver, false).await;
    assert!(!task.is_finished(), "the election task must keep running");
    let readiness = health.readiness();
    assert!(
        !readiness.ready,
        "not ready while the API fails: {readiness:?}"
    );
    assert!(
        readiness.lines[0].starts_with("[-]leader-election failed"),
        "{readiness:?}"
    );

    leads_again_once_the_api_answers(&sim, &receiver).await;
    assert!(health.readiness().ready, "{:?}", health.readiness());

    stop(sim, cancel, task).await
}

#[tokio::test]
async fn steps_down_when_the_api_hangs() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let kube_config = bootstrap_controller::kubeconfig::load(Some(sim.kubeconfig_path())).await?;
    let settings = settings("a");
    let client = leader::election_client(&kube_config, None, settings.renew_grace)?;
    let cancel = CancellationToken::new();
    let (receiver, task) = leader::spawn(
        leader::ElectionClients {
            watch: sim.new_client().await?,
            write: client,
        },
        settings,
        LeaderMetrics::default(),
        Health::default(),
        cancel.clone(),
    );
    eventually("a leads", &receiver, true).await;

    // Lease requests hang far longer than the Lease lasts (2 s).
    leases_fail(&sim, FaultKind::Latency { millis: 60_000 });
    eventually(
        "steps down instead of waiting on a hung renewal",
        &receiver,
        false,
    )
    .await;
    assert!(!task.is_finished(), "the election task must keep running");

    leads_again_once_the_api_answers(&sim, &receiver).await;
    stop(sim, cancel, task).await
}

#[tokio::test]
async fn steps_down_before_the_lease_expires_while_renewals_are_retried() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let (receiver, task, cancel) = candidate(&sim, "a", Health::default()).await?;
    eventually("a leads", &receiver, true).await;

    // kube's client retries 429 after Retry-After, up to 15 times: a renewal could take 15 s,
    // far past the 2 s Lease, while a standby takes over.
    sim.clear_requests();
    leases_fail(
        &sim,
        FaultKind::Error {
            code: 429,
            retry_after_seconds: Some(1),
        },
    );
    eventually("steps down", &receiver, false).await;
    // Counted, not timed: the refusals its Lease requests met before it stepped down are fewer
    // than one renewal's retries, so it did not wait for them to run out. Retry-After (1 s)
    // paces the retries, so a slower machine sends fewer, not more.
    let refused = sim
        .requests()
        .iter()
        .filter(|r| r.resource == "leases" && r.verb != "watch" && r.status == 429)
        .count();
    println!("stepped down after {refused} refused Lease requests");
    assert!(
        refused > 0,
        "no Lease request was refused: the fault never reached it"
    );
    assert!(
        refused < 15,
        "stepped down only after {refused} refused Lease requests"
    );

    leads_again_once_the_api_answers(&sim, &receiver).await;
    stop(sim, cancel, task).await
}

/// The identity is stable across restarts, so a candidate may find the Lease under its own
/// identity, written by another process: its previous life, or a duplicate given the same
/// identity. It does not lead on that: a live duplicate goes on leading alone, and a dead one's
/// Lease is taken once it has gone unrenewed for its duration.
#[tokio::test]
async fn the_same_identity_in_another_process_is_not_taken_for_this_one() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let (first, task_first, _cancel_first) = candidate(&sim, "node-a", Health::default()).await?;
    eventually("the first process leads", &first, true).await;

    let (second, task_second, cancel_second) = candidate(&sim, "node-a", Health::default()).await?;
    let second_led = ever_true(&second);
    // Give the second a few renew periods to (wrongly) take the Lease as its own.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(*first.borrow(), "the first keeps leading while it renews");
    assert!(
        !second_led.load(Ordering::SeqCst),
        "a Lease under this identity that this process did not write is another's"
    );

    // The first dies without releasing the Lease, as a killed container does.
    task_first.abort();
    assert!(task_first.await.is_err_and(|err| err.is_cancelled()));
    eventually(
        "the second takes the Lease once it has gone unrenewed",
        &second,
        true,
    )
    .await;
    stop(sim, cancel_second, task_second).await
}

/// The readiness lines of `health` reach `want`.
async fn readiness_becomes(what: &str, health: &Health, want: impl Fn(&[String]) -> bool) {
    let holds = || std::future::ready(want(&health.readiness().lines));
    if let Err(err) = test_support::eventually(what, Duration::from_secs(30), holds).await {
        panic!("{err}: {:?}", health.readiness());
    }
}

/// The Lease as another replica renews it now, written past the API (and its faults).
fn renewed_by_other(sim: &Sim) -> anyhow::Result<()> {
    let now = k8s_openapi::jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ");
    sim.backdoor().put(serde_json::json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "bootstrap-controller", "namespace": "kube-system"},
        "spec": {"holderIdentity": "other", "renewTime": now.to_string(),
                 "leaseDurationSeconds": 2},
    }))?;
    Ok(())
}

/// A standby whose takeover failed on an API error is ready again once it sees another replica
/// lead: nothing is left for it to write, so no later write would clear the failure.
#[tokio::test]
async fn a_standby_whose_takeover_failed_is_ready_again_once_another_leads() -> anyhow::Result<()> {
    let (sim, task, cancel, leads) = takeover_fails_then_another_leads(500, true).await?;
    assert!(!*leads.borrow());
    stop(sim, cancel, task).await
}

/// A takeover that met a Lease deleted under it (404) is no refusal: another replica may have
/// created it since, and this one is a ready standby again once it sees that.
#[tokio::test]
async fn a_standby_whose_takeover_met_no_lease_is_ready_again_once_another_leads()
-> anyhow::Result<()> {
    let (sim, task, cancel, _leads) = takeover_fails_then_another_leads(404, true).await?;
    stop(sim, cancel, task).await
}

/// A takeover the API refused (403 here) is no unavailability that passes by itself: while no
/// write of this replica has succeeded, it stays not ready, though another replica leads.
#[tokio::test]
async fn a_standby_whose_takeover_was_refused_stays_not_ready() -> anyhow::Result<()> {
    let (sim, task, cancel, _leads) = takeover_fails_then_another_leads(403, false).await?;
    stop(sim, cancel, task).await
}

/// Candidate `b` beside another replica that stops renewing; b's takeover fails with `code`,
/// then the other replica renews again. Returns once b's readiness shows what `code` calls for:
/// a standby again when the failure `passes` by itself, still failing for a refusal.
async fn takeover_fails_then_another_leads(
    code: u16,
    passes: bool,
) -> anyhow::Result<(
    Sim,
    JoinHandle<()>,
    CancellationToken,
    watch::Receiver<bool>,
)> {
    let sim = Sim::start(SimConfig::default()).await?;
    renewed_by_other(&sim)?;
    let health = Health::default();
    let (leads, task, cancel) = candidate(&sim, "b", health.clone()).await?;
    let standby = |lines: &[String]| lines == ["[+]leader-election ok (standby)"];
    readiness_becomes("a standby", &health, standby).await;

    // The other replica stops renewing, and b's takeover fails.
    sim.faults().inject(FaultRule::probability(
        Some(Verb::Update),
        Some("leases"),
        1.0,
        FaultKind::Error {
            code,
            retry_after_seconds: None,
        },
    ));
    readiness_becomes("not ready after the failed takeover", &health, |lines| {
        lines[0].starts_with("[-]leader-election failed: cannot renew or observe the Lease")
    })
    .await;

    // The other replica renews again, before b's next try; b's writes would still fail.
    let renewing = async {
        loop {
            renewed_by_other(&sim).expect("a backdoor write");
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    if passes {
        tokio::select! {
            () = readiness_becomes("a standby again", &health, standby) => {}
            () = renewing => {}
        }
    } else {
        // Seen renewing for a while (several of its renewals, each a watch event).
        let watched = tokio::time::sleep(Duration::from_secs(3));
        tokio::select! {
            () = watched => {}
            () = renewing => {}
        }
        let lines = health.readiness().lines;
        assert!(
            lines[0].starts_with("[-]leader-election failed"),
            "{lines:?}"
        );
    }
    Ok((sim, task, cancel, leads))
}

/// A replica that cannot watch the Lease says so on `/readyz` rather than waiting silently.
#[tokio::test]
async fn a_lease_watch_that_fails_is_the_readiness_reason() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    sim.faults().inject(FaultRule::probability(
        Some(Verb::List),
        Some("leases"),
        1.0,
        FaultKind::Error {
            code: 403,
            retry_after_seconds: None,
        },
    ));
    let health = Health::default();
    let (_leads, task, cancel) = candidate(&sim, "b", health.clone()).await?;
    readiness_becomes("the watch's failure named", &health, |lines| {
        lines[0].starts_with("[-]leader-election failed: cannot watch the Lease")
            && lines[0].contains("403")
    })
    .await;
    sim.faults().clear();
    readiness_becomes("leads once it can watch", &health, |lines| {
        lines == ["[+]leader-election ok (leader)"]
    })
    .await;
    stop(sim, cancel, task).await
}

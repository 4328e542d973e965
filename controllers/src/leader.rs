//! Leader election among replicas, with a `coordination.k8s.io/v1` Lease (kube-lease-manager).
//!
//! The result is a `watch::Receiver<bool>` the runner gates leader-only loops on. The election
//! task never ends the process: when the API is unavailable it keeps retrying, and it steps down
//! (publishes `false`) as soon as it cannot renew, because another replica may take the Lease once
//! it expires. It publishes `true` again once the Lease manager has worked without error for a
//! renew-grace period while still holding the Lease.

use std::time::Duration;

use kube_lease_manager::{LeaseManager, LeaseManagerBuilder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::runner::Health;

/// Name of the leader-election check in `/readyz`.
pub const READYZ_CHECK: &str = "leader-election";

/// Where the Lease lives and how this replica holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderSettings {
    pub lease_name: String,
    pub lease_namespace: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_grace: Duration,
}

/// Leadership metrics: whether this replica leads, and how often that changed.
#[derive(Clone, Default)]
pub struct LeaderMetrics {
    is_leader: Gauge,
    transitions: Counter,
}

impl LeaderMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let metrics = LeaderMetrics::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader-election Lease (always 1 with election off)",
            metrics.is_leader.clone(),
        );
        registry.register(
            "leader_transitions",
            "Times this replica gained or lost leadership",
            metrics.transitions.clone(),
        );
        metrics
    }
}

/// Leadership without election: always the leader.
pub fn always_leader(metrics: &LeaderMetrics) -> watch::Receiver<bool> {
    metrics.is_leader.set(1);
    // Dropping the sender is fine: the runner treats a closed channel as "no more changes".
    let (_sender, receiver) = watch::channel(true);
    receiver
}

/// A client for the election whose requests time out, so a hung API cannot keep this replica
/// believing it leads after its Lease expired: renewals start a renew grace before expiry, and
/// connecting plus answering must fit in it.
pub fn election_client(config: &kube::Config, renew_grace: Duration) -> kube::Result<kube::Client> {
    let timeout = (renew_grace / 2).max(Duration::from_millis(500));
    let mut config = config.clone();
    config.connect_timeout = Some(timeout);
    config.read_timeout = Some(timeout);
    config.write_timeout = Some(timeout);
    kube::Client::try_from(config)
}

/// Starts the election. The task runs until `cancel` fires, then releases the Lease (bounded by
/// the renew grace) so another replica can take over at once.
///
/// `health` gets a `leader-election` readiness check: failing until the replica has joined the
/// election and while it cannot reach the API, so a replica that cannot reach the API is never a
/// "ready standby".
pub fn spawn(
    client: kube::Client,
    settings: LeaderSettings,
    metrics: LeaderMetrics,
    health: Health,
    cancel: CancellationToken,
) -> (watch::Receiver<bool>, JoinHandle<()>) {
    let (sender, receiver) = watch::channel(false);
    metrics.is_leader.set(0);
    health.set_check(READYZ_CHECK, Err("not joined the election yet".to_owned()));
    let span = info_span!(
        "leader_election",
        lease = %format!("{}/{}", settings.lease_namespace, settings.lease_name),
        identity = %settings.identity
    );
    let task =
        tokio::spawn(elect(client, settings, metrics, health, sender, cancel).instrument(span));
    (receiver, task)
}

fn publish(sender: &watch::Sender<bool>, metrics: &LeaderMetrics, health: &Health, leader: bool) {
    health.set_leading(leader);
    let changed = sender.send_if_modified(|current| {
        let changed = *current != leader;
        *current = leader;
        changed
    });
    if changed {
        metrics.is_leader.set(i64::from(leader));
        metrics.transitions.inc();
        if leader {
            info!("became the leader");
        } else {
            info!("no longer the leader");
        }
    }
}

fn role(leader: bool) -> String {
    if leader { "leader" } else { "standby" }.to_owned()
}

async fn build_manager(
    client: &kube::Client,
    settings: &LeaderSettings,
    health: &Health,
    cancel: &CancellationToken,
) -> Option<LeaseManager> {
    let mut delay = Duration::from_millis(500);
    loop {
        // On a fresh control plane the Lease's namespace (kube-system) may not exist yet, and
        // the loop that creates it runs only on the leader.
        if let Err(err) = ensure_namespace(client, &settings.lease_namespace).await {
            health.set_check(
                READYZ_CHECK,
                Err(format!("cannot reach the API to join the election: {err}")),
            );
            warn!(error = %err, retry_in = ?delay, namespace = %settings.lease_namespace, "cannot ensure the leader-election Lease's namespace exists; retrying");
            tokio::select! {
                _ = cancel.cancelled() => return None,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(settings.renew_grace.max(Duration::from_secs(1)));
            continue;
        }
        let build = LeaseManagerBuilder::new(client.clone(), settings.lease_name.clone())
            .with_namespace(settings.lease_namespace.clone())
            .with_identity(settings.identity.clone())
            .with_duration(settings.lease_duration.as_secs())
            .with_grace(settings.renew_grace.as_secs())
            .with_field_manager(format!("bootstrap-controller/{}", settings.identity))
            .build();
        tokio::select! {
            _ = cancel.cancelled() => return None,
            built = build => match built {
                Ok(manager) => return Some(manager),
                Err(err) => {
                    health.set_check(
                        READYZ_CHECK,
                        Err(format!("cannot set up the leader-election Lease: {err}")),
                    );
                    warn!(error = %err, retry_in = ?delay, "cannot set up the leader-election Lease; retrying");
                }
            },
        }
        tokio::select! {
            _ = cancel.cancelled() => return None,
            _ = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(settings.renew_grace.max(Duration::from_secs(1)));
    }
}

async fn ensure_namespace(client: &kube::Client, name: &str) -> Result<(), kube::Error> {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{ObjectMeta, PostParams};
    let api: kube::Api<Namespace> = kube::Api::all(client.clone());
    if api.get_opt(name).await?.is_some() {
        return Ok(());
    }
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    if reconcilers::ignore_already_exists(api.create(&PostParams::default(), &namespace).await)?
        .is_some()
    {
        info!(
            namespace = name,
            "created the leader-election Lease's namespace"
        );
    }
    Ok(())
}

async fn elect(
    client: kube::Client,
    settings: LeaderSettings,
    metrics: LeaderMetrics,
    health: Health,
    sender: watch::Sender<bool>,
    cancel: CancellationToken,
) {
    let Some(manager) = build_manager(&client, &settings, &health, &cancel).await else {
        return;
    };
    info!("joined leader election");
    // Not "ready standby" yet: until the manager has either taken the Lease or watched another
    // holder for a while, nobody may be leading.
    health.set_check(
        READYZ_CHECK,
        Err("joined; waiting to learn which replica leads".to_owned()),
    );
    // What the Lease manager last told us; it only reports changes.
    let mut holds_lease = false;
    let mut failing = false;
    let mut settled = false;
    let mut delay = Duration::from_millis(500);
    let healthy_after = settings.renew_grace.max(Duration::from_secs(1));
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            changed = manager.changed() => match changed {
                Ok(leader) => {
                    holds_lease = leader;
                    failing = false;
                    settled = true;
                    delay = Duration::from_millis(500);
                    publish(&sender, &metrics, &health, leader);
                    health.set_check(READYZ_CHECK, Ok(role(leader)));
                }
                Err(err) => {
                    if !failing {
                        warn!(error = %err, "leader election cannot reach the API; stepping down until it can");
                    } else {
                        debug!(error = %err, "leader election still failing");
                    }
                    failing = true;
                    publish(&sender, &metrics, &health, false);
                    health.set_check(
                        READYZ_CHECK,
                        Err(format!("cannot renew or observe the Lease: {err}")),
                    );
                    tokio::select! {
                        _ = cancel.cancelled() => break,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    delay = (delay * 2).min(healthy_after);
                }
            },
            // `changed()` ran a whole grace period without error: the manager is renewing (or
            // waiting for the other holder's Lease to expire) normally again.
            _ = tokio::time::sleep(healthy_after), if failing || !settled => {
                if failing {
                    info!("leader election reaches the API again");
                }
                failing = false;
                settled = true;
                publish(&sender, &metrics, &health, holds_lease);
                health.set_check(READYZ_CHECK, Ok(role(holds_lease)));
            }
        }
    }

    publish(&sender, &metrics, &health, false);
    if holds_lease {
        match tokio::time::timeout(healthy_after, manager.release()).await {
            Ok(Ok(())) => info!("released the leader-election Lease"),
            Ok(Err(err)) => {
                warn!(error = %err, "could not release the Lease; it expires on its own")
            }
            Err(_) => warn!("releasing the Lease timed out; it expires on its own"),
        }
    }
}

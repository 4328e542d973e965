//! What a stopping controller does with its apiserver's membership: withdraw it only when the
//! apiserver itself is going away.
//!
//! The controller usually runs as a sidecar next to kube-apiserver, and the two stop for
//! different reasons: a pod deletion stops both, a sidecar upgrade or restart stops only the
//! controller. Withdrawing on every stop would empty the `kubernetes` endpoints of a
//! one-apiserver cluster while its apiserver serves. kube-apiserver fails `/readyz` as soon as its
//! own shutdown starts, so a few probes over a short window tell the two cases apart; a membership
//! Lease that is kept expires on its own TTL if the controller does not come back.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde::{Deserialize, Serialize};
use tokio::sync::OnceCell;

use super::Section;
use super::metrics::Label;
use super::probe::{NotReady, ReadinessProbe};
use crate::metrics::{MetricRegistry, loop_registry, registered};

/// `loops.apiserverEndpoints.onShutdown`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum OnShutdown {
    /// Probe the local apiserver's readiness; withdraw only if it fails (the apiserver is
    /// stopping too), keep the membership otherwise.
    #[default]
    WithdrawIfApiserverStopping,
    /// Withdraw on every stop, whatever the apiserver's state.
    AlwaysWithdraw,
    /// Never withdraw on stop: the membership Lease expires after its TTL.
    Keep,
}

impl OnShutdown {
    pub fn as_str(self) -> &'static str {
        match self {
            OnShutdown::WithdrawIfApiserverStopping => "withdrawIfApiserverStopping",
            OnShutdown::AlwaysWithdraw => "alwaysWithdraw",
            OnShutdown::Keep => "keep",
        }
    }
}

/// The decision, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShutdownDecision {
    pub withdraw: bool,
    pub reason: String,
    /// The local apiserver answered ready to every shutdown probe: only this controller stops
    /// (a restart or update of the sidecar), so the Lease is renewed once more on the way out.
    pub apiserver_ready: bool,
}

impl ShutdownDecision {
    /// The metric label and log word.
    pub fn label(&self) -> &'static str {
        if self.withdraw { "withdrew" } else { "kept" }
    }
}

/// Makes the decision once per process, shared by the loops that withdraw (the membership Lease
/// and the leader's endpoints): both hooks run at once on SIGTERM and must agree.
pub struct ShutdownGate {
    policy: OnShutdown,
    /// How many probes; every one must pass for the membership to be kept.
    probes: u32,
    /// The time from the first probe to the last.
    window: Duration,
    readiness: Arc<dyn ReadinessProbe>,
    decided: OnceCell<ShutdownDecision>,
    decisions: Family<Label, Counter>,
    /// Another instance seen renewing this address's membership Lease (see
    /// [`ShutdownGate::note_shared`]).
    shared: std::sync::Mutex<Option<String>>,
    /// `keepSharedAddress`: whether a shared address is left to Lease expiry.
    keep_shared: bool,
}

impl ShutdownGate {
    /// The gate of `section`'s `onShutdown`, `shutdownProbes`, `shutdownProbeWindow` and
    /// `keepSharedAddress`.
    pub fn new(section: &Section, readiness: Arc<dyn ReadinessProbe>) -> Self {
        Self {
            policy: section.on_shutdown,
            probes: section.shutdown_probes.max(1),
            window: section.shutdown_probe_window,
            readiness,
            decided: OnceCell::new(),
            decisions: Family::default(),
            shared: std::sync::Mutex::new(None),
            keep_shared: section.keep_shared_address,
        }
    }

    /// Another instance (`holder`) renews this address's membership Lease: the address is
    /// shared (several apiservers behind one VIP). From then on no stop of this instance
    /// withdraws the address: the other may still serve behind it, and once its own apiserver
    /// is down this sidecar often cannot see the Lease any more (it talks through that
    /// apiserver). The address then goes by Lease expiry once nobody renews it. True the first
    /// time, when the sharing is to be said.
    pub fn note_shared(&self, holder: String) -> bool {
        self.shared
            .lock()
            .is_ok_and(|mut shared| shared.replace(holder).is_none())
    }

    /// The other instance seen renewing this address's Lease, if any and `keepSharedAddress`
    /// leaves it to Lease expiry.
    pub fn shared_with(&self) -> Option<String> {
        let shared = self.shared.lock().ok()?.clone();
        shared.filter(|_| self.keep_shared)
    }

    /// Registers `bootstrap_apiserver_endpoints_shutdown_total{decision}`.
    pub fn register(&self, registry: &mut dyn MetricRegistry) {
        registered(
            loop_registry(registry, super::NAME),
            "shutdown",
            "Graceful stops by what was done with this instance's membership: kept (the local \
             apiserver still ready) or withdrew",
            self.decisions.clone(),
        );
    }

    /// How many stops ended with `decision` (`kept` or `withdrew`).
    pub fn count(&self, decision: &str) -> u64 {
        self.decisions
            .get_or_create(&[("decision", decision.to_owned())])
            .get()
    }

    /// The decision: made (probed, logged at info, counted) by the first caller, shared by the rest.
    pub async fn decide(&self) -> ShutdownDecision {
        self.decided
            .get_or_init(|| async {
                let decision = self.probe().await;
                tracing::info!(
                    decision = %decision.label(),
                    policy = %self.policy.as_str(),
                    reason = %decision.reason,
                    "shutdown: {} this instance's apiserver membership",
                    if decision.withdraw { "withdrawing" } else { "keeping" }
                );
                self.decisions
                    .get_or_create(&[("decision", decision.label().to_owned())])
                    .inc();
                decision
            })
            .await
            .clone()
    }

    /// The pause between two probes.
    fn spacing(&self) -> Duration {
        self.window.checked_div(self.probes - 1).unwrap_or_default()
    }

    /// How long a shutdown probe waits for an answer.
    fn probe_timeout(&self) -> Duration {
        self.spacing().max(Duration::from_secs(1))
    }

    async fn probe(&self) -> ShutdownDecision {
        if self.policy != OnShutdown::Keep
            && let Some(holder) = self.shared_with()
        {
            return ShutdownDecision {
                withdraw: false,
                apiserver_ready: false,
                reason: format!(
                    "another instance ({holder}) renews this address's membership Lease (a \
                     shared address): it stays listed while that instance is live"
                ),
            };
        }
        match self.policy {
            OnShutdown::AlwaysWithdraw => {
                return ShutdownDecision {
                    withdraw: true,
                    apiserver_ready: false,
                    reason: "onShutdown is alwaysWithdraw".to_owned(),
                };
            }
            OnShutdown::Keep => {
                return ShutdownDecision {
                    withdraw: false,
                    apiserver_ready: false,
                    reason: "onShutdown is keep; the membership Lease expires after its TTL"
                        .to_owned(),
                };
            }
            OnShutdown::WithdrawIfApiserverStopping => {}
        }
        let timeout = self.probe_timeout();
        let mut unanswered = 0;
        for n in 0..self.probes {
            if n > 0 {
                tokio::time::sleep(self.spacing()).await;
            }
            match tokio::time::timeout(timeout, self.readiness.check()).await {
                Ok(Ok(())) => {}
                // A busy apiserver answers late too: no answer is no sign that it is stopping.
                Ok(Err(NotReady::TimedOut { .. })) | Err(_) => unanswered += 1,
                Ok(Err(why)) => {
                    return ShutdownDecision {
                        withdraw: true,
                        apiserver_ready: false,
                        reason: format!("the local apiserver is stopping: {why}"),
                    };
                }
            }
        }
        if unanswered > 0 {
            return ShutdownDecision {
                withdraw: false,
                apiserver_ready: false,
                reason: format!(
                    "the local apiserver did not answer {unanswered} of {} readiness probes \
                     within {timeout:?} and refused none: the membership is not withdrawn on a \
                     guess, and its Lease expires after its TTL if the apiserver is gone",
                    self.probes
                ),
            };
        }
        ShutdownDecision {
            withdraw: false,
            apiserver_ready: true,
            reason: format!(
                "the local apiserver stays ready ({} readiness probes passed over {:?}); the \
                 membership Lease is kept and expires after its TTL if this controller does not \
                 come back",
                self.probes, self.window
            ),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures::future::BoxFuture;

    use super::*;

    /// Answers from a script, then ready; counts the probes.
    struct Scripted {
        answers: Mutex<Vec<bool>>,
        calls: AtomicUsize,
    }

    impl Scripted {
        fn new(answers: &[bool]) -> Arc<Self> {
            Arc::new(Self {
                answers: Mutex::new(answers.iter().rev().copied().collect()),
                calls: AtomicUsize::new(0),
            })
        }
    }

    impl ReadinessProbe for Scripted {
        fn check(&self) -> BoxFuture<'_, Result<(), NotReady>> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let ready = self.answers.lock().unwrap().pop().unwrap_or(true);
            Box::pin(async move {
                if ready {
                    Ok(())
                } else {
                    Err(NotReady::Failed {
                        path: "/readyz".into(),
                        reason: "connection refused".into(),
                    })
                }
            })
        }
    }

    fn gate(policy: OnShutdown, probe: Arc<Scripted>) -> ShutdownGate {
        let section = Section {
            on_shutdown: policy,
            shutdown_probes: 3,
            shutdown_probe_window: Duration::from_millis(20),
            ..Section::default()
        };
        ShutdownGate::new(&section, probe)
    }

    #[tokio::test]
    async fn a_ready_apiserver_keeps_the_membership_after_every_probe_passed() {
        let probe = Scripted::new(&[]);
        let gate = gate(OnShutdown::WithdrawIfApiserverStopping, probe.clone());
        let decision = gate.decide().await;
        assert!(!decision.withdraw, "{decision:?}");
        assert_eq!(probe.calls.load(Ordering::SeqCst), 3);
        assert_eq!((gate.count("kept"), gate.count("withdrew")), (1, 0));
    }

    #[tokio::test]
    async fn a_failing_probe_withdraws_at_once_and_the_decision_is_made_once() {
        let probe = Scripted::new(&[true, false]);
        let gate = gate(OnShutdown::WithdrawIfApiserverStopping, probe.clone());
        let decision = gate.decide().await;
        assert!(decision.withdraw, "{decision:?}");
        assert!(
            decision.reason.contains("connection refused"),
            "{decision:?}"
        );
        assert_eq!(probe.calls.load(Ordering::SeqCst), 2);
        // The second loop's hook gets the same answer without probing or counting again.
        assert_eq!(gate.decide().await, decision);
        assert_eq!(probe.calls.load(Ordering::SeqCst), 2);
        assert_eq!((gate.count("kept"), gate.count("withdrew")), (0, 1));
    }

    /// Never answers.
    struct Silent;

    impl ReadinessProbe for Silent {
        fn check(&self) -> BoxFuture<'_, Result<(), NotReady>> {
            Box::pin(std::future::pending())
        }
    }

    #[tokio::test]
    async fn an_apiserver_that_does_not_answer_keeps_the_membership() {
        let section = Section {
            shutdown_probes: 3,
            shutdown_probe_window: Duration::from_millis(20),
            ..Section::default()
        };
        let decision = ShutdownGate::new(&section, Arc::new(Silent)).decide().await;
        assert!(
            !decision.withdraw && !decision.apiserver_ready,
            "{decision:?}"
        );
        assert!(
            decision.reason.contains("did not answer 3 of 3"),
            "{decision:?}"
        );
    }

    #[tokio::test]
    async fn the_fixed_policies_do_not_probe() {
        let probe = Scripted::new(&[false]);
        assert!(
            gate(OnShutdown::AlwaysWithdraw, probe.clone())
                .decide()
                .await
                .withdraw
        );
        assert!(
            !gate(OnShutdown::Keep, probe.clone())
                .decide()
                .await
                .withdraw
        );
        assert_eq!(probe.calls.load(Ordering::SeqCst), 0);
    }

    /// Another instance renewing this address's Lease keeps the address at a stop, whatever the
    /// policy and the probes say, unless `keepSharedAddress` is off; the sharing is said once.
    #[tokio::test]
    async fn a_shared_address_is_kept_at_stop_unless_keep_shared_address_is_off() {
        for (keep, withdraw) in [(true, false), (false, true)] {
            let section = Section {
                on_shutdown: OnShutdown::WithdrawIfApiserverStopping,
                shutdown_probes: 2,
                shutdown_probe_window: Duration::from_millis(20),
                keep_shared_address: keep,
                ..Section::default()
            };
            let probe = Scripted::new(&[false]);
            let gate = ShutdownGate::new(&section, probe.clone());
            assert!(gate.note_shared("apiserver-b".to_owned()));
            assert!(!gate.note_shared("apiserver-b".to_owned()));
            assert_eq!(gate.shared_with(), keep.then(|| "apiserver-b".to_owned()));
            let decision = gate.decide().await;
            assert_eq!(decision.withdraw, withdraw, "keep {keep}: {decision:?}");
            assert_eq!(
                decision.reason.contains("a shared address"),
                keep,
                "{decision:?}"
            );
            // Kept for the sharing: the apiserver is not even probed.
            assert_eq!(probe.calls.load(Ordering::SeqCst), usize::from(!keep));
        }
    }

    #[test]
    fn probes_are_spread_over_the_window() {
        let probe = || Scripted::new(&[]);
        let default = ShutdownGate::new(&Section::default(), probe());
        assert_eq!(default.spacing(), Duration::from_secs(1));
        assert_eq!(default.probe_timeout(), Duration::from_secs(1));
        let one = Section {
            shutdown_probes: 1,
            ..Section::default()
        };
        assert_eq!(ShutdownGate::new(&one, probe()).spacing(), Duration::ZERO);
    }
}

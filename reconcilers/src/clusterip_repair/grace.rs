//! The graces an IPAddress waits out before it is deleted on its age, counted on this
//! controller's own clock as well as by the IPAddress's `creationTimestamp`.

use std::time::Duration;

use super::plan::{Decision, Finding, Problem, Repair, UNLISTED_GRACE};

/// When this controller first saw each IPAddress that waits out a grace or is deleted on its age
/// (an orphan, or one not listed by its Service), on its own monotonic clock. That age is
/// kube-apiserver's `creationTimestamp` against this controller's clock, which may run ahead:
/// 90 s ahead, a Service being created (its IPAddress written, its webhooks still running) would
/// look like a leak the moment its IPAddress is seen. So the grace is also waited out here,
/// from the first sight. One deletable at the loop's first pass is judged by its
/// `creationTimestamp` alone when kube-apiserver's own clock shows it past its grace: another
/// object of the view was created more than the grace after it. A restart then does not hold
/// back cleaning up old leaks, and a clock of this controller's however far ahead never makes
/// one in-flight look old (the newest objects are the in-flight ones).
#[derive(Debug, Default)]
pub struct FirstDeletable {
    /// By IPAddress uid; `None`: judged by its `creationTimestamp` alone.
    since: std::collections::BTreeMap<Box<str>, Option<tokio::time::Instant>>,
    started: bool,
}

/// A delete held back: the finding, and the grace it waits out on this controller's clock.
#[derive(Debug)]
pub struct Held {
    pub finding: Finding,
    pub grace: Duration,
}

/// Holds back the deletes [`decide_ipaddress_mode`](super::plan::decide_ipaddress_mode) found
/// on an IPAddress's age until the same grace has also passed on this controller's clock since
/// it first saw them (see [`FirstDeletable`]); the decision's recheck covers them. Returns the
/// findings held back, for a dry run to report: it deletes nothing, but says what a run would
/// do.
pub fn hold_until_seen_as_old(
    decision: &mut Decision,
    first: &mut FirstDeletable,
    now: jiff::Timestamp,
    mono: tokio::time::Instant,
    orphan_grace: Duration,
) -> Vec<Held> {
    let first_pass = !std::mem::replace(&mut first.started, true);
    let mut since = std::collections::BTreeMap::new();
    for uid in &decision.waiting {
        let met = first.since.get(uid).copied().unwrap_or(Some(mono));
        since.insert(uid.clone(), met);
    }
    let past_on_api_clock = &decision.past_grace_on_api_clock;
    let mut recheck = None;
    let mut held = Vec::new();
    for finding in std::mem::take(&mut decision.findings) {
        let (existing, grace) = match (&finding.repair, &finding.problem) {
            (Repair::Delete { existing, .. }, Problem::Leaked) => (existing, orphan_grace),
            (Repair::Delete { existing, .. }, Problem::WrongParent) => {
                (existing, UNLISTED_GRACE.unsigned_abs())
            }
            _ => {
                decision.findings.push(finding);
                continue;
            }
        };
        let met = match first.since.get(&existing.uid) {
            Some(met) => *met,
            None if first_pass && past_on_api_clock.contains(&existing.uid) => None,
            None => Some(mono),
        };
        since.insert(existing.uid.clone(), met);
        let left = met.map_or(Duration::ZERO, |met| {
            grace.saturating_sub(mono.saturating_duration_since(met))
        });
        if left.is_zero() {
            decision.findings.push(finding);
            continue;
        }
        let at = jiff::SignedDuration::try_from(left)
            .ok()
            .and_then(|left| now.checked_add(left).ok())
            .unwrap_or(jiff::Timestamp::MAX);
        recheck = Some(recheck.map_or(at, |earlier: jiff::Timestamp| earlier.min(at)));
        held.push(Held { finding, grace });
    }
    if let Some(at) = recheck {
        decision.recheck_by(at);
    }
    first.since = since;
    held
}

//! What a pass found in a bitmap, told once: each finding logged and counted, and its event
//! published, at most [`NAMED_PER_PASS`] of each finding about one bit a pass.

use std::collections::HashMap;

use kube::runtime::events::EventType;
use tracing::warn;

use super::{BitmapRange, LegacyBitmap, Outlet, Subject, repair};
use crate::contract::LoopError;
use crate::service_cache::record::ServiceRef;

/// A finding about a stored bitmap, reported once while it lasts.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BitmapFinding {
    NotAllocated(usize),
    MayHaveLeaked(usize),
    Released(usize),
    ReleaseHeld(usize),
    /// Stored under this range (empty: none), not the configured one; nothing written.
    RangeMismatch(String),
    /// Stored under this range (empty: none), rebuilt under the configured one (opted in).
    RangeRebuilt(String),
    Unusable(String),
    /// More bits look leaked than are followed at once ([`repair::MAX_SUSPECTS`]).
    Unfollowed,
}

impl BitmapFinding {
    /// Which of the findings about one bit it is, for [`NAMED_PER_PASS`].
    fn of_a_bit(&self) -> Option<usize> {
        match self {
            BitmapFinding::NotAllocated(_) => Some(0),
            BitmapFinding::MayHaveLeaked(_) => Some(1),
            BitmapFinding::Released(_) => Some(2),
            BitmapFinding::ReleaseHeld(_) => Some(3),
            _ => None,
        }
    }
}

/// A pass names at most this many bits of each finding about one bit (a line and an event
/// each); the others are told in one line, and one event where each would have had its own.
const NAMED_PER_PASS: usize = 10;

impl<R: BitmapRange> LegacyBitmap<R> {
    /// The new findings of a pass: each one logged, counted and its event published. A range
    /// mismatch is reported with its event or not at all (the next pass tries again); the
    /// others' events are best effort, as the bitmap is repaired either way.
    pub(super) async fn tell(
        &self,
        dry_run: bool,
        holders: &HashMap<usize, ServiceRef>,
        outlet: &Outlet<'_>,
        new: Vec<BitmapFinding>,
    ) -> Result<(), LoopError> {
        let kubernetes =
            ServiceRef::named(outlet.kubernetes_service.0, outlet.kubernetes_service.1);
        let mut unpublished = None;
        let mut of_a_bit = [0usize; 4];
        for finding in new {
            if let Some(which) = finding.of_a_bit() {
                of_a_bit[which] += 1;
                if of_a_bit[which] > NAMED_PER_PASS {
                    self.count(&finding, outlet);
                    continue;
                }
            }
            let Some((about, reason, note)) = self.record(&finding, holders, &kubernetes, outlet)
            else {
                continue;
            };
            let published = match dry_run {
                true => Ok(()),
                false => {
                    let reference = crate::events::service_reference(about);
                    let action = R::SUBJECT.event_action;
                    (crate::events::emit_in(
                        outlet.recorder,
                        &reference,
                        EventType::Warning,
                        &reason,
                        action,
                        &note,
                    ))
                    .await
                }
            };
            if let BitmapFinding::RangeMismatch(stored) = &finding {
                match published {
                    Ok(()) => {
                        warn!(key = self.key.as_str(), stored, configured = %self.range, "{note}");
                        outlet.count("rangeMismatch");
                    }
                    Err(err) => {
                        self.reported.forget(&finding);
                        unpublished.get_or_insert(err);
                    }
                }
            }
        }
        for (which, count) in of_a_bit.into_iter().enumerate() {
            if let Some(more) = count.checked_sub(NAMED_PER_PASS).filter(|more| *more > 0) {
                self.tell_more(dry_run, outlet, &kubernetes, which, more)
                    .await;
            }
        }
        match unpublished {
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(()),
        }
    }

    /// Counts a finding about one bit told with others ([`Self::tell_more`]), as
    /// [`Self::record`] counts it.
    fn count(&self, finding: &BitmapFinding, outlet: &Outlet<'_>) {
        match finding {
            BitmapFinding::NotAllocated(_) => outlet.count("repair"),
            BitmapFinding::Released(_) => outlet.count("leak"),
            _ => {}
        }
    }

    /// One line (and one event, for bits set or released) for the `more` findings of one kind
    /// about one bit past the [`NAMED_PER_PASS`] of a pass; each bit is in the pass's drift.
    async fn tell_more(
        &self,
        dry_run: bool,
        outlet: &Outlet<'_>,
        kubernetes: &ServiceRef,
        which: usize,
        more: usize,
    ) {
        let Subject {
            noun,
            item_noun,
            item_reason,
            event_action,
            ..
        } = R::SUBJECT;
        let key = self.key.as_str();
        let (line, event) = match which {
            0 => (
                format!("{more} more {noun}s are in use but not allocated; repairing"),
                Some((
                    format!("{item_reason}NotAllocated"),
                    format!("{more} more {item_noun}s are not allocated; repairing"),
                )),
            ),
            1 => (
                format!("{more} more {noun}s may have leaked: flagging for later clean up"),
                None,
            ),
            2 => (
                format!("{more} more {noun}s appear to have leaked: cleaning up"),
                Some((
                    format!("{item_reason}Released"),
                    format!(
                        "{more} more {item_noun}s appeared to have leaked (no Service holds \
                         them); released them from the allocation bitmap"
                    ),
                )),
            ),
            _ => (
                format!(
                    "{more} more {noun}s appear to have leaked, but no fresh list of the \
                     Services has confirmed them unused yet: keeping them until one does"
                ),
                None,
            ),
        };
        warn!(key, "{line}");
        if let Some((reason, note)) = event.filter(|_| !dry_run) {
            let reference = crate::events::service_reference(kubernetes);
            // Best effort, as for each bit's own (`emit_in` logs a refusal): the bitmap is
            // repaired either way.
            crate::events::emit_in(
                outlet.recorder,
                &reference,
                EventType::Warning,
                &reason,
                event_action,
                &note,
            )
            .await
            .ok();
        }
    }

    /// Logs a new finding and counts it; its event, if it has one: the Service it is about
    /// (a bit's holder, or `kubernetes` for the bitmap itself), its reason and its note.
    fn record<'a>(
        &self,
        finding: &BitmapFinding,
        holders: &'a HashMap<usize, ServiceRef>,
        kubernetes: &'a ServiceRef,
        outlet: &Outlet<'_>,
    ) -> Option<(&'a ServiceRef, String, String)> {
        let Subject {
            noun,
            item_noun,
            item_reason,
            bitmap_name,
            ..
        } = R::SUBJECT;
        let key = self.key.as_str();
        match finding {
            BitmapFinding::NotAllocated(offset) => {
                let item = self.item(*offset);
                warn!(
                    key,
                    "the {noun} {item} is in use but not allocated; repairing"
                );
                outlet.count("repair");
                let holder = holders.get(offset)?;
                let item = match self.range.family() {
                    Some(family) => format!("[{family}]:{item}"),
                    None => item,
                };
                let note = format!("{item_noun} {item} is not allocated; repairing");
                Some((holder, format!("{item_reason}NotAllocated"), note))
            }
            BitmapFinding::MayHaveLeaked(offset) => {
                warn!(
                    key,
                    "the {noun} {} may have leaked: flagging for later clean up",
                    self.item(*offset)
                );
                None
            }
            BitmapFinding::Released(offset) => {
                let item = self.item(*offset);
                warn!(key, "the {noun} {item} appears to have leaked: cleaning up");
                outlet.count("leak");
                let note = format!(
                    "{item_noun} {item} appeared to have leaked (no Service holds it); released \
                     it from the allocation bitmap"
                );
                Some((kubernetes, format!("{item_reason}Released"), note))
            }
            BitmapFinding::ReleaseHeld(offset) => {
                warn!(
                    key,
                    "the {noun} {} appears to have leaked, but no fresh list of the Services has confirmed it unused yet: keeping it until one does",
                    self.item(*offset)
                );
                None
            }
            // Logged once its event is published (`tell`): a refused event makes the next pass
            // find it anew.
            BitmapFinding::RangeMismatch(stored) => {
                let note = self.range_mismatch_note(stored);
                Some((kubernetes, format!("{bitmap_name}RangeMismatch"), note))
            }
            // The bitmap rebuilt under the configured range (or its range filled in).
            BitmapFinding::RangeRebuilt(stored) => {
                outlet.count("repair");
                let note = self.rebuilt(stored);
                Some((kubernetes, format!("{bitmap_name}BitmapRebuilt"), note))
            }
            BitmapFinding::Unusable(why) => {
                warn!(key, "the stored bitmap cannot be used: {why}");
                outlet.count("invalid");
                None
            }
            BitmapFinding::Unfollowed => {
                warn!(
                    key,
                    "more {noun}s are set that no Service holds than are followed at once ({}): the others stay set, and are followed as those are settled",
                    repair::MAX_SUSPECTS
                );
                None
            }
        }
    }

    /// Logs the bitmap rebuilt under the configured range from `stored` (empty: no range), and
    /// gives its event's note.
    fn rebuilt(&self, stored: &str) -> String {
        let (key, rebuild_setting) = (self.key.as_str(), R::SUBJECT.rebuild_setting);
        if stored.is_empty() {
            warn!(
                key,
                configured = %self.range,
                "the stored bitmap has no range; filling in the configured one ({rebuild_setting} is set)"
            );
        } else {
            warn!(
                key,
                stored,
                configured = %self.range,
                "the stored range differs from the configured one; rebuilding the bitmap under the configured range, dropping the allocations outside it ({rebuild_setting} is set)"
            );
        }
        format!(
            "rebuilt the {} allocation bitmap under {} (stored under {stored:?})",
            R::SUBJECT.bitmap_name,
            self.range
        )
    }
}

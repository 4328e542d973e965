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
    /// Which of the findings about one bit it is (an index), for [`NAMED_PER_PASS`].
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
        // Of each finding about one bit: how many, and the first past the named ones.
        let mut of_a_bit: [(usize, Option<BitmapFinding>); 4] = Default::default();
        for finding in new {
            self.count(&finding, outlet);
            if let Some(which) = finding.of_a_bit() {
                let (seen, past) = &mut of_a_bit[which];
                *seen += 1;
                if *seen > NAMED_PER_PASS {
                    past.get_or_insert(finding);
                    continue;
                }
            }
            let Some((about, reason, note)) = self.record(&finding, holders, &kubernetes) else {
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
        for (seen, past) in of_a_bit {
            if let Some(past) = past {
                let more = seen - NAMED_PER_PASS;
                self.tell_more(dry_run, outlet, &kubernetes, &past, more)
                    .await;
            }
        }
        match unpublished {
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(()),
        }
    }

    /// Counts a new finding, named or told with others: each bit counts. A range mismatch is
    /// counted once its event is published ([`Self::tell`]).
    fn count(&self, finding: &BitmapFinding, outlet: &Outlet<'_>) {
        match finding {
            BitmapFinding::NotAllocated(_) | BitmapFinding::RangeRebuilt(_) => {
                outlet.count("repair")
            }
            BitmapFinding::Released(_) => outlet.count("leak"),
            BitmapFinding::Unusable(_) => outlet.count("invalid"),
            _ => {}
        }
    }

    /// One line (and one event, for bits set or released) for the `more` findings of the kind of
    /// `past` past the [`NAMED_PER_PASS`] of a pass.
    async fn tell_more(
        &self,
        dry_run: bool,
        outlet: &Outlet<'_>,
        kubernetes: &ServiceRef,
        past: &BitmapFinding,
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
        let (line, event) = match past {
            BitmapFinding::NotAllocated(_) => (
                format!("{more} more {noun}s are in use but not allocated; repairing"),
                Some((
                    format!("{item_reason}NotAllocated"),
                    format!("{more} more {item_noun}s are not allocated; repairing"),
                )),
            ),
            BitmapFinding::MayHaveLeaked(_) => (
                format!("{more} more {noun}s may have leaked: flagging for later clean up"),
                None,
            ),
            BitmapFinding::Released(_) => (
                format!("{more} more {noun}s appear to have leaked: cleaning up"),
                Some((
                    format!("{item_reason}Released"),
                    format!(
                        "{more} more {item_noun}s appeared to have leaked (no Service holds \
                         them); released them from the allocation bitmap"
                    ),
                )),
            ),
            BitmapFinding::ReleaseHeld(_) => (
                format!(
                    "{more} more {noun}s appear to have leaked, but no fresh list of the \
                     Services has confirmed them unused yet: keeping them until one does"
                ),
                None,
            ),
            _ => return,
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

    /// Logs a new finding; its event, if it has one: the Service it is about (a bit's holder,
    /// or `kubernetes` for the bitmap itself), its reason and its note.
    fn record<'a>(
        &self,
        finding: &BitmapFinding,
        holders: &'a HashMap<usize, ServiceRef>,
        kubernetes: &'a ServiceRef,
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
                let note = self.rebuilt(stored);
                Some((kubernetes, format!("{bitmap_name}BitmapRebuilt"), note))
            }
            BitmapFinding::Unusable(why) => {
                warn!(key, "the stored bitmap cannot be used: {why}");
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

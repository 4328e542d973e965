//! One pass of upstream's bitmap repair (`portallocator/controller/repair.go`, and the legacy
//! `ipallocator/controller/repair.go`), on offsets into the range. Pure: no I/O, no clock.
//!
//! What the Services hold and the stored bitmap does not is set at once (`PortNotAllocated`,
//! `ClusterIPNotAllocated`). What the bitmap holds and no Service uses "may have leaked":
//! kube-apiserver sets the bit before it creates the Service, so a young bit without its Service
//! is normal. It is released only on its third sighting, and only when a fresh list of the
//! Services confirms it unused; until then it stays set. Upstream sees a leak once per 3-minute pass;
//! passes here also run on every Service change and may be set closer, so sightings count only
//! when `spacing` apart (the loop's `leakSightingSpacing`, 3 minutes by default).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fixedbitset::FixedBitSet;

/// Sightings of an unused bit before it is released (upstream's `numRepairsBeforeLeakCleanup`).
pub const SIGHTINGS_BEFORE_RELEASE: u8 = 3;

/// How far apart sightings count by default: upstream's repair interval (3 minutes), whatever
/// the loop's own interval. kube-apiserver sets a bit before the Service is stored, with
/// admission (webhooks among it) in between, so a bit is released no sooner than upstream would.
pub const DEFAULT_SIGHTING_SPACING: Duration = Duration::from_secs(180);

/// The most unused bits followed (their sightings counted) at once, per key. A bitmap has up to
/// 2^20 bits and its etcd value may set every one (a tenant's etcd is the tenant's): each bit
/// followed costs its sightings, its drift and its finding, so the others stay set (the side
/// that takes nothing from a Service) and are followed as the followed ones are settled, released
/// or found in use. Upstream follows every one; a cluster's leaks come a few at a time.
pub const MAX_SUSPECTS: usize = 1024;

/// Unused bits seen so far, across passes: at most [`MAX_SUSPECTS`].
#[derive(Debug, Default)]
pub struct LeakTracker {
    sightings: HashMap<usize, Sighting>,
}

impl LeakTracker {
    /// The bitmap without the `released` bits is stored: they are suspects no more. One set
    /// again before the next pass reads it is kube-apiserver's new allocation (its Service
    /// perhaps still in admission), a new suspect with no sighting yet, never a bit released
    /// again on the sightings of the old one.
    pub fn written(&mut self, released: &[usize]) {
        for offset in released {
            self.sightings.remove(offset);
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Sighting {
    count: u8,
    last: Instant,
}

/// What one pass decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The bitmap to store.
    pub bitmap: FixedBitSet,
    /// In use but not set in the stored bitmap: set by this plan.
    pub not_allocated: Vec<usize>,
    /// Unused bits seen for the first time: kept for now.
    pub flagged: Vec<usize>,
    /// Unused bits seen often enough, confirmed unused by a fresh list: cleared by this plan.
    pub released: Vec<usize>,
    /// Unused bits seen often enough, kept until a fresh list of the Services confirms them
    /// unused.
    pub held: Vec<usize>,
    /// Unused bits not followed yet ([`MAX_SUSPECTS`] are): kept.
    pub unfollowed: usize,
}

impl Plan {
    /// Releases the held bits that `fresh_in_use` (the offsets a fresh list of the Services
    /// holds) confirms unused; the others were in use after all (the cache was behind), and are
    /// no suspects any more. A released bit keeps its sightings until its write succeeds
    /// ([`LeakTracker::written`]): a write that loses its compare-and-swap leaves it set, and it
    /// must not start over as a new suspect.
    pub fn release_held(&mut self, leaks: &mut LeakTracker, fresh_in_use: &FixedBitSet) {
        for offset in self.held.drain(..) {
            if fresh_in_use.contains(offset) {
                leaks.sightings.remove(&offset);
            } else {
                self.bitmap.set(offset, false);
                self.released.push(offset);
            }
        }
    }

    /// Whether the stored bitmap must be written.
    pub fn changes(&self, stored: &FixedBitSet) -> bool {
        self.bitmap.ones().ne(stored.ones())
    }
}

/// Plans one pass: `stored` is the bitmap read from etcd, `in_use` the offsets the Services hold
/// (both of the range's size), `fresh` whether the Service view is proven at least as new as the
/// API. `leaks` carries the sightings from pass to pass.
pub fn plan(
    stored: &FixedBitSet,
    in_use: &FixedBitSet,
    leaks: &mut LeakTracker,
    fresh: bool,
    now: Instant,
    spacing: Duration,
) -> Plan {
    let mut bitmap = in_use.clone();
    bitmap.grow(stored.len());
    let not_allocated: Vec<usize> = in_use.difference(stored).collect();

    // A bit in use, or no longer set, is no suspect.
    leaks
        .sightings
        .retain(|offset, _| stored.contains(*offset) && !in_use.contains(*offset));

    let (mut flagged, mut released, mut held) = (Vec::new(), Vec::new(), Vec::new());
    let mut unfollowed = 0;
    for offset in stored.difference(in_use) {
        if leaks.sightings.len() >= MAX_SUSPECTS && !leaks.sightings.contains_key(&offset) {
            bitmap.insert(offset);
            unfollowed += 1;
            continue;
        }
        let sighting = leaks.sightings.entry(offset).or_insert_with(|| {
            flagged.push(offset);
            Sighting {
                count: 0,
                last: now,
            }
        });
        if sighting.count == 0 || now.duration_since(sighting.last) >= spacing {
            sighting.count = sighting.count.saturating_add(1);
            sighting.last = now;
        }
        if sighting.count < SIGHTINGS_BEFORE_RELEASE {
            bitmap.insert(offset);
        } else if fresh {
            // Its sightings go once a stored bitmap no longer holds it (see `release_held`).
            released.push(offset);
        } else {
            bitmap.insert(offset);
            held.push(offset);
        }
    }
    Plan {
        bitmap,
        not_allocated,
        flagged,
        released,
        held,
        unfollowed,
    }
}

/// The bitmap `stored` (kept under another range) under the configured range: each bit moves
/// to the offset its item (port, IP) has in the configured range, and bits whose item falls
/// outside it are dropped, as upstream's repair does when the range changed (its rebuilt
/// allocator cannot allocate them). `item` gives the item of a stored offset, `offset` the
/// configured offset of an item; `size` is the configured range's size.
pub fn rebase<T>(
    stored: &FixedBitSet,
    size: usize,
    item: impl Fn(usize) -> Option<T>,
    offset: impl Fn(T) -> Option<usize>,
) -> FixedBitSet {
    let mut bits = FixedBitSet::with_capacity(size);
    for moved in stored.ones().filter_map(|o| offset(item(o)?)) {
        if moved < size {
            bits.insert(moved);
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The port range "100-200" of upstream's tests: offset = port - 100.
    const SIZE: usize = 101;

    fn bits(ports: &[usize]) -> FixedBitSet {
        let mut bits = FixedBitSet::with_capacity(SIZE);
        for port in ports {
            bits.insert(port - 100);
        }
        bits
    }

    fn ports(plan_bits: &FixedBitSet) -> Vec<usize> {
        plan_bits.ones().map(|offset| offset + 100).collect()
    }

    /// Passes as upstream runs them: every sighting counts.
    fn pass(
        stored: &FixedBitSet,
        in_use: &FixedBitSet,
        leaks: &mut LeakTracker,
        fresh: bool,
    ) -> Plan {
        plan(stored, in_use, leaks, fresh, Instant::now(), Duration::ZERO)
    }

    /// An etcd value with every bit set and no Service: [`MAX_SUSPECTS`] bits are followed and
    /// released, the others kept, then followed in their turn.
    #[test]
    fn unused_bits_are_followed_a_budget_at_a_time() {
        let size = 3 * MAX_SUSPECTS + 7;
        let mut stored = FixedBitSet::with_capacity(size);
        stored.insert_range(..);
        let none = FixedBitSet::with_capacity(size);
        let mut leaks = LeakTracker::default();
        let first = pass(&stored, &none, &mut leaks, true);
        assert_eq!(first.flagged.len(), MAX_SUSPECTS);
        assert_eq!(first.unfollowed, size - MAX_SUSPECTS);
        assert_eq!(first.bitmap.count_ones(..), size, "nothing released yet");
        let mut released = 0;
        for _ in 0..20 {
            let plan = pass(&stored, &none, &mut leaks, true);
            assert!(leaks.sightings.len() <= MAX_SUSPECTS);
            assert!(plan.released.len() <= MAX_SUSPECTS);
            released += plan.released.len();
            stored = plan.bitmap;
        }
        assert_eq!(released, size, "every bit released in its turn");
        assert_eq!(stored.count_ones(..), 0);
    }

    /// TestRepair: an empty bitmap and no Services: nothing to change.
    #[test]
    fn repair_of_an_empty_range_changes_nothing() {
        let stored = bits(&[]);
        let plan = pass(&stored, &bits(&[]), &mut LeakTracker::default(), true);
        assert!(!plan.changes(&stored));
        assert!(plan.not_allocated.is_empty() && plan.flagged.is_empty());
    }

    /// TestRepairLeak: a leaked port survives two passes and is released by the third.
    #[test]
    fn a_leak_is_released_on_the_third_pass() {
        let mut stored = bits(&[111]);
        let mut leaks = LeakTracker::default();
        for round in 0..2 {
            let plan = pass(&stored, &bits(&[]), &mut leaks, true);
            assert_eq!(ports(&plan.bitmap), vec![111], "round {round}");
            assert_eq!(plan.flagged.len(), usize::from(round == 0));
            stored = plan.bitmap;
        }
        let plan = pass(&stored, &bits(&[]), &mut leaks, true);
        assert_eq!(ports(&plan.bitmap), Vec::<usize>::new());
        assert_eq!(plan.released, vec![11]);
        assert!(plan.changes(&stored));
        // Its write lost a compare-and-swap: read again, still set, it is released again, not
        // seen anew.
        let again = pass(&stored, &bits(&[]), &mut leaks, true);
        assert_eq!((again.released, again.flagged), (vec![11], vec![]));
        // Written: no longer stored, no suspect any more.
        pass(&plan.bitmap, &bits(&[]), &mut leaks, true);
        assert_eq!(leaks.sightings.len(), 0);
    }

    /// TestRepairWithExisting: Services holding 111, 122, 133 (an out-of-range port, an empty
    /// port and a duplicate are dropped before the bitmap) on an empty bitmap: all three set.
    #[test]
    fn ports_in_use_are_set() {
        let stored = bits(&[]);
        let plan = pass(
            &stored,
            &bits(&[111, 122, 133]),
            &mut LeakTracker::default(),
            true,
        );
        assert_eq!(ports(&plan.bitmap), vec![111, 122, 133]);
        assert_eq!(plan.not_allocated, vec![11, 22, 33]);
        assert_eq!(SIZE - plan.bitmap.count_ones(..), 98);
    }

    /// TestRepairLeakDeferredUntilCacheFresh and TestRepairLeakReleasedAfterCacheCatchesUp:
    /// with a stale Service view the leak is held however often it is seen, and released by the
    /// first pass with a fresh one.
    #[test]
    fn a_leak_waits_for_a_fresh_view() {
        let mut stored = bits(&[150]);
        let mut leaks = LeakTracker::default();
        for _ in 0..5 {
            let plan = pass(&stored, &bits(&[]), &mut leaks, false);
            assert_eq!(ports(&plan.bitmap), vec![150]);
            assert!(plan.released.is_empty());
            stored = plan.bitmap;
        }
        let plan = pass(&stored, &bits(&[]), &mut leaks, false);
        assert_eq!(plan.held, vec![50]);
        let plan = pass(&stored, &bits(&[]), &mut leaks, true);
        assert_eq!(plan.released, vec![50]);
        assert!(plan.bitmap.is_clear());
    }

    /// Held bits are released when a fresh list confirms them unused; one the fresh list shows
    /// in use (the cache was behind) stays set and is no suspect any more.
    #[test]
    fn held_bits_are_released_as_far_as_a_fresh_list_confirms() {
        let stored = bits(&[150, 160, 170]);
        let mut leaks = LeakTracker::default();
        for _ in 0..2 {
            pass(&stored, &bits(&[160]), &mut leaks, false);
        }
        let mut plan = pass(&stored, &bits(&[160]), &mut leaks, false);
        assert_eq!(ports(&plan.bitmap), vec![150, 160, 170]);
        plan.release_held(&mut leaks, &bits(&[160, 170]));
        assert_eq!(ports(&plan.bitmap), vec![160, 170]);
        assert_eq!((plan.released.clone(), plan.held.len()), (vec![50], 0));
        // 170 was in use after all; 150 stays a suspect until a stored bitmap no longer holds it
        // (a write that loses its compare-and-swap must not make it a new one).
        assert_eq!(leaks.sightings.len(), 1);
        let mut again = pass(&stored, &bits(&[160]), &mut leaks, false);
        assert_eq!(
            (again.held.clone(), again.flagged.clone()),
            (vec![50], vec![70])
        );
        again.release_held(&mut leaks, &bits(&[160, 170]));
        assert_eq!(again.released, vec![50]);
        pass(&plan.bitmap, &bits(&[160, 170]), &mut leaks, false);
        assert_eq!(leaks.sightings.len(), 0);
    }

    /// TestRepairStaleCacheStillRepairsAllocations: a stale view still sets what is in use.
    #[test]
    fn a_stale_view_still_sets_ports_in_use() {
        let stored = bits(&[]);
        let plan = pass(&stored, &bits(&[120]), &mut LeakTracker::default(), false);
        assert_eq!(ports(&plan.bitmap), vec![120]);
        assert_eq!(plan.not_allocated, vec![20]);
    }

    /// A suspect that turns out to be used (its Service arrived) is forgotten: it starts over if
    /// it is ever unused again.
    #[test]
    fn a_suspect_in_use_is_forgotten() {
        let stored = bits(&[111]);
        let mut leaks = LeakTracker::default();
        pass(&stored, &bits(&[]), &mut leaks, true);
        pass(&stored, &bits(&[]), &mut leaks, true);
        pass(&stored, &bits(&[111]), &mut leaks, true);
        assert_eq!(leaks.sightings.len(), 0);
        let plan = pass(&stored, &bits(&[]), &mut leaks, true);
        assert_eq!(plan.flagged, vec![11]);
        assert_eq!(ports(&plan.bitmap), vec![111]);
    }

    /// Passes closer together than `spacing` (woken by Service changes) do not count as
    /// sightings: the leak is released only after sightings `spacing` apart.
    #[test]
    fn sightings_count_only_when_spaced() {
        let stored = bits(&[111]);
        let mut leaks = LeakTracker::default();
        let start = Instant::now();
        let spacing = Duration::from_secs(90);
        for second in 0..100 {
            let at = start + Duration::from_millis(second * 10);
            let plan = plan(&stored, &bits(&[]), &mut leaks, true, at, spacing);
            assert!(plan.released.is_empty());
        }
        let plan2 = plan(
            &stored,
            &bits(&[]),
            &mut leaks,
            true,
            start + spacing,
            spacing,
        );
        assert!(plan2.released.is_empty());
        let plan3 = plan(
            &stored,
            &bits(&[]),
            &mut leaks,
            true,
            start + spacing * 2,
            spacing,
        );
        assert_eq!(plan3.released, vec![11]);
    }

    /// A range change moves each bit to its item's place in the new range, dropping what falls
    /// outside: 100-200 holding 111, 150, 199 onto 140-240 keeps 150 and 199, drops 111.
    #[test]
    fn rebase_keeps_items_and_drops_what_falls_outside() {
        let stored = bits(&[111, 150, 199]);
        let moved = rebase(
            &stored,
            101,
            |o| Some(o + 100),
            |port: usize| port.checked_sub(140),
        );
        assert_eq!(moved.len(), 101);
        assert_eq!(
            moved.ones().map(|o| o + 140).collect::<Vec<_>>(),
            vec![150, 199]
        );
        let grown = rebase(
            &stored,
            301,
            |o| Some(o + 100),
            |port: usize| port.checked_sub(50),
        );
        assert_eq!(
            grown.ones().map(|o| o + 50).collect::<Vec<_>>(),
            vec![111, 150, 199]
        );
        let shrunk = rebase(
            &stored,
            51,
            |o| Some(o + 100),
            |port: usize| port.checked_sub(100),
        );
        assert_eq!(
            shrunk.ones().map(|o| o + 100).collect::<Vec<_>>(),
            vec![111, 150]
        );
    }
}

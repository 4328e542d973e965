//! The legacy allocation bitmaps kube-apiserver keeps in etcd (`RangeAllocation` at
//! `<prefix>/ranges/servicenodeports`, `serviceips`, `secondaryserviceips`), and their repair.
//!
//! `codec` and `repair` are pure; `etcd` is the only part that talks to etcd; [`LegacyBitmap`]
//! is the pass both repair loops run on one key: read it, plan it against what the Services
//! hold, write the plan by compare-and-swap, and report each finding once.
//!
//! A bitmap stored under a range other than the configured one is reported and never written,
//! unless the operator opted in to rebuilding it ([`LegacyBitmap::new`]'s
//! `rebuild_on_range_change`). Inside kube-apiserver the configured range is the allocator's
//! own, so upstream's repair rebuilds the bitmap under it; from outside it is this process's
//! belief about kube-apiserver's flag, and a wrong belief (a management cluster giving a tenant
//! the default range) would make kube-apiserver refuse every allocation ("the provided range
//! does not match the current range") and drop what lies outside. A restarted kube-apiserver
//! rebuilds the bitmap under its new range itself.

pub mod codec;
pub mod etcd;
mod findings;
pub mod repair;
mod wire;

pub use findings::BitmapFinding;

use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fixedbitset::FixedBitSet;
use futures::stream::BoxStream;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use smallvec::SmallVec;
use tracing::debug;

use crate::alloc::IpFamily;
use crate::contract::{Action, Drift, LoopError, PassContext, PassReport, drift};
use crate::events::SeriesRecorder;
use crate::findings::{RepeatedFailure, ReportOnce};
use crate::sanitize::Sanitized;
use crate::service_cache::FreshList;
use crate::service_cache::live::{self, Liveness};
use crate::service_cache::record::{ServiceRecord, ServiceRef};
use codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use etcd::{EtcdError, EtcdStore, KeyCache};
use repair::{LeakTracker, plan};

/// How many times a pass reads, plans and writes the key again after a compare-and-swap lost
/// to another writer (kube-apiserver allocating), before it fails and the runner retries.
const WRITE_ATTEMPTS: usize = 3;

/// What one key holds, for messages and drift kinds.
#[derive(Clone, Copy, Debug)]
pub struct Subject {
    /// `"node port"`, `"cluster IP"`.
    pub noun: &'static str,
    /// Drift kinds start with this: `"nodeport"`, `"clusterip"`.
    pub kind_prefix: &'static str,
    /// The setting holding the configured range: `"serviceNodePortRange"`.
    pub range_setting: &'static str,
    /// kube-apiserver's flag it mirrors: `"--service-node-port-range"`.
    pub apiserver_flag: &'static str,
    /// The opt-in that rebuilds a bitmap stored under another range:
    /// `"loops.nodePortRepair.rebuildBitmapOnRangeChange"`.
    pub rebuild_setting: &'static str,
    /// A bit's item in upstream's event notes: `"Port"`, `"Cluster IP"`.
    pub item_noun: &'static str,
    /// upstream's event action: `"PortAllocation"`, `"ClusterIPAllocation"`.
    pub event_action: &'static str,
    /// The reasons of the events about one bit start with this (`PortNotAllocated`,
    /// `PortReleased`), those about the bitmap with `bitmap_name` (`NodePortRangeMismatch`,
    /// `NodePortBitmapRebuilt`, neither upstream's: its repair always rebuilds under its own
    /// range): `"Port"` and `"NodePort"`, `"ClusterIP"` and `"ClusterIP"`.
    pub item_reason: &'static str,
    pub bitmap_name: &'static str,
    /// Whether a missing key is created (the NodePort key), or left missing (the ClusterIP keys
    /// do not exist where kube-apiserver allocates with IPAddress objects alone).
    pub create_if_missing: bool,
}

/// The range a key's bitmap numbers: node ports, or the cluster IPs of a CIDR. Its `Display`
/// is the range as kube-apiserver stores it in the key: `"30000-32767"`, or the CIDR.
pub trait BitmapRange: std::fmt::Display + Sized + Send + Sync {
    /// What a bit stands for: a port, an IP.
    type Item: std::fmt::Display;
    const SUBJECT: Subject;
    /// A range as stored in a key (etcd's text); `None` when it cannot be read.
    fn parse(stored: &str) -> Option<Self>;
    /// The bits of the range's bitmap.
    fn bits(&self) -> usize;
    /// The item at a bit; `None` past the range.
    fn item(&self, bit: usize) -> Option<Self::Item>;
    /// The bit of an item; `None` outside the range.
    fn bit(&self, item: Self::Item) -> Option<usize>;
    /// Every item of this kind a Service holds, in any range.
    fn held(service: &ServiceRecord) -> SmallVec<[Self::Item; 4]>;
    /// The IP family a cluster IP's "not allocated" note names (`Cluster IP [IPv4]:…`).
    fn family(&self) -> Option<IpFamily> {
        None
    }
}

/// Where a repair's findings about its bitmap go: its error counter (by the metric's `type`)
/// and its events, those about the bitmap itself on the `kubernetes` Service (namespace, name).
pub struct Outlet<'a> {
    /// The loop's own, kept for its life ([`crate::events::emit_in`]).
    pub recorder: &'a SeriesRecorder,
    pub kubernetes_service: (&'a str, &'a str),
    pub errors: &'a Family<[(&'static str, &'static str); 1], Counter>,
}

impl Outlet<'_> {
    fn count(&self, error_type: &'static str) {
        self.errors.get_or_create(&[("type", error_type)]).inc();
    }
}

/// Up to this many bits missing from a bitmap are confirmed by a GET of each one's Service;
/// more (a key just created, a bitmap rebuilt) by one fresh list of the Services.
const CONFIRM_BY_GET: usize = 32;

/// A stored value as a pass reads it: its bits on the configured range's offsets, and the range
/// it was stored under with the number of allocations that move drops, when that differs.
struct Stored {
    value: Option<RangeAllocation>,
    mod_revision: Option<i64>,
    bits: FixedBitSet,
    range_change: Option<(String, usize)>,
}

/// One range key and what earlier passes saw of it.
pub struct LegacyBitmap<R: BitmapRange> {
    store: EtcdStore,
    key: String,
    /// The range the key must hold.
    range: R,
    /// How the Services are listed afresh.
    fresh_list: FreshList,
    /// Whether a bitmap stored under another range (or none) is rebuilt under `range`: the
    /// operator's opt-in; otherwise it is reported and left alone.
    rebuild_on_range_change: bool,
    /// Sightings of a leak count only this far apart.
    spacing: Duration,
    leaks: Mutex<LeakTracker>,
    reported: ReportOnce<BitmapFinding>,
    /// The last failure to list the Services afresh, warned about once.
    list_failure: Mutex<RepeatedFailure>,
    /// The key's value as its watch last saw it: at rest a pass reads nothing from etcd.
    cache: KeyCache,
}

impl<R: BitmapRange> LegacyBitmap<R> {
    pub fn new(
        store: EtcdStore,
        key: String,
        range: R,
        fresh_list: FreshList,
        rebuild_on_range_change: bool,
        spacing: Duration,
    ) -> Self {
        Self {
            store,
            key,
            range,
            fresh_list,
            rebuild_on_range_change,
            spacing,
            leaks: Mutex::default(),
            reported: ReportOnce::new(),
            list_failure: Mutex::default(),
            cache: KeyCache::default(),
        }
    }

    /// A trigger stream: yields when the key changes in etcd, and keeps the value passes read.
    pub fn watch(&self) -> BoxStream<'static, ()> {
        self.store.watch(self.key.clone(), self.cache.clone())
    }

    /// Renders an offset as the port or IP it stands for.
    fn item(&self, offset: usize) -> String {
        (self.range.item(offset))
            .map_or_else(|| format!("offset {offset}"), |item| item.to_string())
    }

    /// The bits of the range `service` holds.
    fn held_bits(&self, service: &ServiceRecord) -> impl Iterator<Item = usize> {
        let size = self.range.bits();
        R::held(service)
            .into_iter()
            .filter_map(|item| self.range.bit(item))
            // FixedBitSet panics on a bit past its length.
            .filter(move |offset| *offset < size)
    }

    /// The bitmap bytes `data` stored under the range `stored`, moved onto this key's range (see
    /// [`repair::rebase`]); `None` when `stored` cannot be read.
    pub(crate) fn rebase(&self, stored: &str, data: &[u8]) -> Option<FixedBitSet> {
        let from = R::parse(stored)?;
        // The stored range is etcd's text: a wide one (0.0.0.0/0 is 2^32 bits) must not size the
        // bitmap. Bits past the stored bytes are all clear.
        let bits = bitmap_from_bytes(data, from.bits().min(data.len().saturating_mul(8)));
        Some(repair::rebase(
            &bits,
            self.range.bits(),
            |offset| from.item(offset),
            |item| self.range.bit(item),
        ))
    }

    /// The bits `services` hold, and the Service holding each that upstream's walk of a LIST
    /// meets first: the smallest etcd key (a cache's order is a hash map's).
    pub fn in_use<'a>(
        &self,
        services: impl IntoIterator<Item = &'a ServiceRecord>,
    ) -> (FixedBitSet, HashMap<usize, ServiceRef>) {
        let size = self.range.bits();
        let mut bits = FixedBitSet::with_capacity(size);
        let mut first: HashMap<usize, &ServiceRecord> = HashMap::new();
        for service in services {
            for offset in self.held_bits(service) {
                bits.insert(offset);
                first
                    .entry(offset)
                    .and_modify(|held| {
                        if service.key_cmp(held).is_lt() {
                            *held = service;
                        }
                    })
                    .or_insert(service);
            }
        }
        let holders = first
            .into_iter()
            .map(|(offset, service)| (offset, ServiceRef::of(service)))
            .collect();
        (bits, holders)
    }

    /// The bits the Services hold by a fresh list of them, `None` if the list failed (warned
    /// about once while it fails the same way).
    async fn fresh_in_use(&self, client: &kube::Client) -> Option<FixedBitSet> {
        let mut bits = FixedBitSet::with_capacity(self.range.bits());
        let listed = (self.fresh_list.each(client, |service| {
            bits.extend(self.held_bits(service));
            ControlFlow::Continue(())
        }))
        .await;
        let mut failure = self.list_failure.lock().unwrap_or_else(|p| p.into_inner());
        match listed {
            Ok(()) => {
                failure.succeeded();
                Some(bits)
            }
            Err(err) => {
                if failure.is_new(&err) {
                    tracing::warn!(key = %self.key, error = %err, "cannot list the Services afresh: no leak is released, no bit set and no range rebuilt until a list succeeds");
                } else {
                    tracing::debug!(key = %self.key, error = %err, "cannot list the Services afresh");
                }
                None
            }
        }
    }

    /// What is wrong when the key is stored under `stored` (empty: no range), and how to
    /// resolve it: the drift's message, the event's note and the log line.
    fn range_mismatch_note(&self, stored: &str) -> String {
        let Subject {
            noun,
            range_setting,
            apiserver_flag,
            rebuild_setting,
            ..
        } = R::SUBJECT;
        let (key, configured) = (&self.key, &self.range);
        if self.rebuild_on_range_change {
            let under = match stored {
                "" => "without a range".to_owned(),
                stored => format!("under the range {stored}"),
            };
            return format!(
                "The {noun} allocation bitmap {key} is stored {under}, but {range_setting} is \
                 {configured}: it is rebuilt under {configured} once a fresh list of the Services \
                 succeeds ({rebuild_setting} is set)"
            );
        }
        if stored.is_empty() {
            format!(
                "The {noun} allocation bitmap {key} is stored without a range; {range_setting} is \
                 {configured}: the bitmap is left unchanged. kube-apiserver's own repair fills in \
                 its {apiserver_flag}; to fill in {configured} from here, set {rebuild_setting}: true"
            )
        } else {
            format!(
                "The {noun} allocation bitmap {key} is stored under the range {stored}, but \
                 {range_setting} is {configured}: the bitmap is left unchanged. If kube-apiserver's \
                 {apiserver_flag} is {stored}, set {range_setting} to it; if the flag was changed to \
                 {configured}, kube-apiserver rebuilds the bitmap when it restarts, or set \
                 {rebuild_setting}: true to rebuild it from here (allocations outside {configured} \
                 are dropped)"
            )
        }
    }

    /// A repair loop's pass over the key: reads it, plans it against the bits the cached
    /// Services hold (`in_use` and `holders`, as [`Self::in_use`] gives them) and writes the plan
    /// by compare-and-swap; the drift goes into `report`, the new findings to `outlet`. A pass
    /// lists the Services afresh when a leak is due for release or the bitmap is to be rebuilt
    /// under another range, once after each read of the key (again after a lost
    /// compare-and-swap). Every bit about to be set is confirmed by the Services read
    /// live (a GET of its holder each, or a list when a GET does not confirm it or there are many),
    /// as a bit set for a Service that is gone would hold its port or IP until three sightings
    /// release it; such a bit is neither set nor reported.
    pub async fn repair(
        &self,
        ctx: &PassContext,
        (in_use, holders): (&FixedBitSet, &HashMap<usize, ServiceRef>),
        outlet: &Outlet<'_>,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        // The offsets the Services hold by a fresh list taken after this attempt's read, once
        // one succeeded.
        let mut fresh: Option<FixedBitSet> = None;
        // Bits missing from the stored bitmap, judged live: whether no Service holds them after
        // all. Kept across the attempts of a compare-and-swap.
        let mut judged: HashMap<usize, bool> = HashMap::new();
        let new = 'pass: {
            for _ in 0..WRITE_ATTEMPTS {
                let stored = match self.read(self.current().await?, report) {
                    Ok(stored) => stored,
                    Err(new) => break 'pass new,
                };
                // Moving to another range drops what falls outside it: only on a fresh complete
                // list of the Services, never on the cache alone. Its Services are the ones in use.
                if let Some((from, dropped)) = stored
                    .range_change
                    .as_ref()
                    .filter(|(from, _)| !from.is_empty())
                {
                    if fresh.is_none() {
                        fresh = self.fresh_in_use(&ctx.client).await;
                    }
                    if fresh.is_none() {
                        break 'pass self.report_only(
                            report,
                            "range_mismatch",
                            BitmapFinding::RangeMismatch(from.clone()),
                            format!(
                                "the stored range {from:?} is not the configured {}: the bitmap is to be rebuilt under {} ({dropped} allocations outside it dropped; {}), once a fresh list of the Services succeeds",
                                self.range, self.range, R::SUBJECT.rebuild_setting
                            ),
                        );
                    }
                }
                let in_use = fresh.as_ref().unwrap_or(in_use);

                let mut plan = {
                    let mut leaks = self.leaks.lock().unwrap_or_else(|p| p.into_inner());
                    plan(
                        &stored.bits,
                        in_use,
                        &mut leaks,
                        false,
                        Instant::now(),
                        self.spacing,
                    )
                };
                if !plan.held.is_empty() {
                    if fresh.is_none() {
                        fresh = self.fresh_in_use(&ctx.client).await;
                    }
                    if let Some(fresh) = &fresh {
                        let mut leaks = self.leaks.lock().unwrap_or_else(|p| p.into_inner());
                        plan.release_held(&mut leaks, fresh);
                    }
                }
                self.drop_gone(&mut plan, &mut judged, ctx, holders).await?;

                let write = stored.value.is_none()
                    || stored.range_change.is_some()
                    || plan.changes(&stored.bits);
                let applied = write && !ctx.dry_run;
                if applied && !self.write(&stored, &plan).await? {
                    // Someone wrote the key since it was read: a release is judged again on a
                    // list taken after the next read, never on one older than what it reads.
                    fresh = None;
                    continue;
                }
                if applied {
                    let mut leaks = self.leaks.lock().unwrap_or_else(|p| p.into_inner());
                    leaks.written(&plan.released);
                }
                break 'pass self.outcome(&plan, stored.range_change, applied, holders, report);
            }
            return Err(self.failed(EtcdError::Conflicts {
                key: self.key.clone(),
                attempts: WRITE_ATTEMPTS,
            }));
        };
        self.tell(ctx.dry_run, holders, outlet, new).await
    }

    /// Why a pass over the key failed, as the loop reports it.
    fn failed(&self, why: impl std::fmt::Display) -> LoopError {
        LoopError::Other(format!("{} bitmap in etcd: {why}", R::SUBJECT.bitmap_name))
    }

    /// The drift kind of this key's subject for a finding (`leaked`: `nodeport_leaked`).
    fn kind(&self, suffix: &str) -> &'static str {
        match (R::SUBJECT.kind_prefix, suffix) {
            ("nodeport", "not_allocated") => "nodeport_not_allocated",
            ("nodeport", "leaked") => "nodeport_leaked",
            ("nodeport", "leak_held") => "nodeport_leak_held",
            ("nodeport", "leaks_unfollowed") => "nodeport_leaks_unfollowed",
            ("nodeport", "range_mismatch") => "nodeport_range_mismatch",
            ("nodeport", _) => "nodeport_bitmap_unusable",
            (_, "not_allocated") => "clusterip_bitmap_not_allocated",
            (_, "leaked") => "clusterip_bitmap_leaked",
            (_, "leak_held") => "clusterip_bitmap_leak_held",
            (_, "leaks_unfollowed") => "clusterip_bitmap_leaks_unfollowed",
            (_, "range_mismatch") => "clusterip_bitmap_range_mismatch",
            _ => "clusterip_bitmap_unusable",
        }
    }

    fn object(&self) -> String {
        format!("etcd{}", self.key)
    }

    /// Ends a pass that writes nothing with one finding about the key: its drift goes into
    /// `report`; returns it if it is new.
    fn report_only(
        &self,
        report: &mut PassReport,
        suffix: &str,
        finding: BitmapFinding,
        message: String,
    ) -> Vec<BitmapFinding> {
        let kind = self.kind(suffix);
        (report.drift).push(drift(kind, self.object(), Action::Report, message, false));
        self.reported.update(vec![finding])
    }

    /// The key's value as its watch keeps it, or else as etcd has it; `Ok(Err(why))` for a value
    /// too large to read, an unusable bitmap like any other.
    async fn current(&self) -> Result<Result<Option<etcd::Stored>, String>, LoopError> {
        if let Some(stored) = self.cache.get() {
            return Ok(Ok(stored));
        }
        match self.store.get(&self.key).await {
            Ok(stored) => Ok(Ok(stored)),
            Err(err @ EtcdError::TooLarge { .. }) => Ok(Err(err.to_string())),
            Err(err) => Err(self.failed(err)),
        }
    }

    /// The stored value decoded and its bits moved onto the configured range. When the key is
    /// missing and left so, or its value cannot be used, or lies under another range this pass
    /// may not leave, the pass ends here: `Err` holds its new findings, its drift is in `report`.
    fn read(
        &self,
        stored: Result<Option<etcd::Stored>, String>,
        report: &mut PassReport,
    ) -> Result<Stored, Vec<BitmapFinding>> {
        let mut unusable = |message: String| {
            self.report_only(
                report,
                "unusable",
                BitmapFinding::Unusable(message.clone()),
                message,
            )
        };
        let stored = stored.map_err(&mut unusable)?;
        if stored.is_none() && !R::SUBJECT.create_if_missing {
            return Err(Vec::new());
        }
        let (value, mod_revision) = match stored {
            None => (None, None),
            Some(stored) => match RangeAllocation::decode(&stored.value) {
                Ok(value) => (Some(value), Some(stored.mod_revision)),
                Err(err) => return Err(unusable(format!("{err}; nothing is written to it"))),
            },
        };
        // The range the value was stored under, when it is not the configured one: empty
        // (never initialized), or another range (kube-apiserver's flag differs from this
        // process's configuration, or was changed).
        let stored_range = value
            .as_ref()
            .map(|value| value.range.as_str())
            .filter(|range| *range != self.range.to_string());
        let bits = match (&value, stored_range) {
            (None, _) => FixedBitSet::with_capacity(self.range.bits()),
            (Some(value), Some(from)) if !from.is_empty() => (self.rebase(from, &value.data))
                .ok_or_else(|| {
                    unusable(format!(
                        "the stored range \"{}\" cannot be read; nothing is written to it",
                        Sanitized::within(from, 100)
                    ))
                })?,
            (Some(value), _) => bitmap_from_bytes(&value.data, self.range.bits()),
        };
        // etcd's text, quoted in findings kept while they last: a range is a few dozen bytes,
        // so a longer one is cut.
        let moved_from = stored_range.map(|range| Sanitized::within(range, 100).to_string());
        if let Some(from) = &moved_from
            && !self.rebuild_on_range_change
        {
            // Which range is kube-apiserver's cannot be told from here: report, write
            // nothing. Leak sightings made under the other range mean nothing any more.
            *self.leaks.lock().unwrap_or_else(|p| p.into_inner()) = LeakTracker::default();
            return Err(self.report_only(
                report,
                "range_mismatch",
                BitmapFinding::RangeMismatch(from.clone()),
                self.range_mismatch_note(from),
            ));
        }
        let range_change = moved_from.map(|from| {
            let kept = bits.count_ones(..);
            let stored = value.as_ref().map_or(kept, |value| {
                value
                    .data
                    .iter()
                    .map(|byte| byte.count_ones() as usize)
                    .sum()
            });
            (from, stored.saturating_sub(kept))
        });
        Ok(Stored {
            value,
            mod_revision,
            bits,
            range_change,
        })
    }

    /// The bits in `offsets` that no Service holds when read live. Each bit's Service by the
    /// cache (`holders`: namespace, name, uid) is read and must be the same object still holding
    /// it; where one is not, or there are many bits, a fresh list of the Services decides, as it
    /// also sees a second holder the cache put behind a gone one.
    async fn confirm_live(
        &self,
        client: &kube::Client,
        offsets: Vec<usize>,
        holders: &HashMap<usize, ServiceRef>,
    ) -> Result<HashSet<usize>, String> {
        let mut suspects = Vec::new();
        if offsets.len() > CONFIRM_BY_GET {
            suspects = offsets;
        } else {
            for offset in offsets {
                let Some(ServiceRef {
                    namespace,
                    name,
                    uid,
                }) = holders.get(&offset)
                else {
                    suspects.push(offset);
                    continue;
                };
                let liveness = live::confirm(client, namespace, name, uid, |service| {
                    self.held_bits(service).any(|held| held == offset)
                })
                .await
                .map_err(|err| format!("cannot read Service {namespace}/{name}: {err}"))?;
                if liveness != Liveness::Holds {
                    suspects.push(offset);
                }
            }
        }
        if suspects.is_empty() {
            return Ok(HashSet::new());
        }
        let fresh = (self.fresh_in_use(client).await)
            .ok_or_else(|| "cannot list the Services".to_owned())?;
        Ok(suspects
            .into_iter()
            .filter(|offset| !fresh.contains(*offset))
            .collect())
    }

    /// Confirms live ([`Self::confirm_live`]) the bits the plan would set that were not judged
    /// yet, and takes out of the plan those no live Service holds (the Service cache is behind).
    async fn drop_gone(
        &self,
        plan: &mut repair::Plan,
        judged: &mut HashMap<usize, bool>,
        ctx: &PassContext,
        holders: &HashMap<usize, ServiceRef>,
    ) -> Result<(), LoopError> {
        let unjudged: Vec<usize> = plan
            .not_allocated
            .iter()
            .copied()
            .filter(|offset| !judged.contains_key(offset))
            .collect();
        if !unjudged.is_empty() {
            let offsets = unjudged.clone();
            // Without a live read nothing is written: a bit set for a gone Service would hold it.
            let gone = (self.confirm_live(&ctx.client, offsets, holders).await).map_err(|why| {
                let (noun, key) = (R::SUBJECT.noun, &self.key);
                self.failed(format!(
                    "cannot confirm the Services holding {noun}s missing from {key}: {why}"
                ))
            })?;
            for offset in unjudged {
                judged.insert(offset, gone.contains(&offset));
            }
        }
        let repair::Plan {
            not_allocated,
            bitmap,
            ..
        } = plan;
        not_allocated.retain(|offset| {
            let gone = judged.get(offset).copied().unwrap_or(false);
            if gone {
                debug!(
                    key = self.key,
                    item = self.item(*offset),
                    "not set: no Service holds it when read live (the Service cache is behind)"
                );
                bitmap.set(*offset, false);
            }
            !gone
        });
        Ok(())
    }

    /// Writes the plan's bitmap by compare-and-swap on the revision read; false when the key
    /// changed in between, its cached value then dropped so the next attempt reads it again.
    async fn write(&self, stored: &Stored, plan: &repair::Plan) -> Result<bool, LoopError> {
        let bytes = bitmap_to_bytes(&plan.bitmap);
        let new_value = match &stored.value {
            Some(value) => value.with_range_and_data(self.range.to_string(), bytes),
            None => RangeAllocation::new(self.range.to_string(), bytes),
        };
        let encoded = new_value.encode();
        match self
            .store
            .compare_and_swap_revision(&self.key, stored.mod_revision, encoded.clone())
            .await
            .map_err(|err| self.failed(err))?
        {
            Some(revision) => {
                self.cache.wrote(encoded, revision);
                Ok(true)
            }
            None => {
                debug!(
                    key = self.key,
                    "the etcd key changed while the repair wrote it; reading it again"
                );
                self.cache.forget();
                Ok(false)
            }
        }
    }

    /// Ends a pass that planned (and, when `applied`, wrote) `plan`: its drifts go into `report`;
    /// returns its new findings.
    fn outcome(
        &self,
        plan: &repair::Plan,
        range_change: Option<(String, usize)>,
        applied: bool,
        holders: &HashMap<usize, ServiceRef>,
        report: &mut PassReport,
    ) -> Vec<BitmapFinding> {
        let mut drifts = self.bit_drifts(plan, applied, holders);
        let mut findings: Vec<BitmapFinding> = Vec::new();
        if let Some((from, dropped)) = &range_change {
            drifts.push(self.range_drift(from, *dropped, applied));
            findings.push(if applied {
                BitmapFinding::RangeRebuilt(from.clone())
            } else {
                BitmapFinding::RangeMismatch(from.clone())
            });
        }
        findings.extend(
            plan.not_allocated
                .iter()
                .map(|&o| BitmapFinding::NotAllocated(o)),
        );
        findings.extend(
            plan.flagged
                .iter()
                .map(|&o| BitmapFinding::MayHaveLeaked(o)),
        );
        findings.extend(plan.released.iter().map(|&o| BitmapFinding::Released(o)));
        findings.extend(plan.held.iter().map(|&o| BitmapFinding::ReleaseHeld(o)));
        if plan.unfollowed > 0 {
            findings.push(BitmapFinding::Unfollowed);
        }
        let new = self.reported.update(findings.iter().cloned());
        if applied {
            // Written: what was repaired is gone, so if it comes back (the bit cleared again
            // before a pass saw it set) that is a new occurrence, reported and counted again.
            let repaired = findings.iter().filter(|finding| {
                matches!(
                    finding,
                    BitmapFinding::NotAllocated(_)
                        | BitmapFinding::Released(_)
                        | BitmapFinding::RangeRebuilt(_)
                )
            });
            for finding in repaired {
                self.reported.forget(finding);
            }
        }
        report.drift.extend(drifts);
        new
    }

    /// One drift per bit the plan sets (on the Service holding it), clears, or keeps though it
    /// looks leaked, and one for the unused bits it does not follow.
    fn bit_drifts(
        &self,
        plan: &repair::Plan,
        applied: bool,
        holders: &HashMap<usize, ServiceRef>,
    ) -> Vec<Drift> {
        let (noun, key, object) = (R::SUBJECT.noun, &self.key, self.object());
        let state = |offset, state: &str| format!("{noun} {} {state} in {key}", self.item(offset));
        let allocate = plan.not_allocated.iter().map(|&offset| {
            drift(
                self.kind("not_allocated"),
                (holders.get(&offset)).map_or_else(
                    || object.clone(),
                    |holder| format!("Service/{}/{}", holder.namespace, holder.name),
                ),
                Action::Update,
                format!(
                    "the {noun} {} is in use but not allocated in {key}; repairing",
                    self.item(offset)
                ),
                applied,
            )
            .changed(state(offset, "free"), state(offset, "allocated"))
        });
        let release = plan.released.iter().map(|&offset| {
            drift(
                self.kind("leaked"),
                object.clone(),
                Action::Update,
                format!(
                    "the {noun} {} appears to have leaked: cleaning up",
                    self.item(offset)
                ),
                applied,
            )
            .changed(
                format!("{}, held by no Service", state(offset, "allocated")),
                state(offset, "free"),
            )
        });
        let hold = plan.held.iter().map(|&offset| {
            drift(
                self.kind("leak_held"),
                object.clone(),
                Action::Report,
                format!("the {noun} {} appears to have leaked, but no fresh list of the Services has confirmed it unused yet: kept until one does", self.item(offset)),
                false,
            )
        });
        // One drift for the bits past the followed ones, in the same words whatever their
        // number (a new message would be a new finding each time it changed): the number is in
        // its change.
        let unfollowed = (plan.unfollowed > 0).then(|| {
            let unfollowed = format!(
                "{} {noun}s set in {key} that no Service holds, not followed yet",
                plan.unfollowed
            );
            drift(
                self.kind("leaks_unfollowed"),
                object.clone(),
                Action::Report,
                format!(
                    "more {noun}s are set that no Service holds than are followed at once ({}): the others are kept set until their turn",
                    repair::MAX_SUSPECTS
                ),
                false,
            )
            .changed(unfollowed.clone(), unfollowed)
        });
        (allocate.chain(release).chain(hold).chain(unfollowed)).collect()
    }

    /// The drift of a bitmap stored under another range (`from`, empty for none) than the
    /// configured one, rebuilt under it (`dropped` allocations outside it lost).
    fn range_drift(&self, from: &str, dropped: usize, applied: bool) -> Drift {
        let message = if from.is_empty() {
            format!(
                "the stored value has no range: {} is filled in ({})",
                self.range,
                R::SUBJECT.rebuild_setting
            )
        } else {
            format!(
                "the stored range {from:?} is not the configured {}: the bitmap is rebuilt under {} ({dropped} allocations outside it dropped; {})",
                self.range,
                self.range,
                R::SUBJECT.rebuild_setting
            )
        };
        let was = match from {
            "" => format!("{} stored without a range", self.key),
            from => format!("{} stored under the range {from}", self.key),
        };
        drift(
            self.kind("range_mismatch"),
            self.object(),
            Action::Update,
            message,
            applied,
        )
        .changed(
            was,
            format!(
                "{} stored under the range {} ({dropped} allocations outside it dropped)",
                self.key, self.range
            ),
        )
    }
}

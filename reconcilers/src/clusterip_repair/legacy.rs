//! etcd mode: the ClusterIP allocation bitmaps kube-apiserver keeps in etcd
//! (`<prefix>/ranges/serviceips` for the primary range, `secondaryserviceips` for the other
//! family), repaired against the Service cache as upstream's legacy `ipallocator` repair does,
//! on clusters that allocate with them (the loop decides which: [`super::ClusterIpRepairLoop`]).
//! A key that does not exist is left missing. A key stored under another range than
//! `serviceClusterIPRange` is reported (a Warning event on the `kubernetes` Service naming both
//! ranges) and left alone, unless `rebuildBitmapOnRangeChange` is set.

use std::collections::HashMap;
use std::net::IpAddr;

use fixedbitset::FixedBitSet;
use futures::future::BoxFuture;
use ipnet::IpNet;
use kube::runtime::events::{EventType, Recorder};

use crate::alloc::{IpFamily, ServiceRange};
use crate::contract::{LoopError, PassContext, PassReport, Trigger};
use crate::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};
use crate::legacy_alloc::{BitmapFinding, LegacyBitmap, Subject};
use crate::section::ServiceName;
use crate::service_cache::record::{ClusterIp, ServiceRecord};
use crate::watch_cache::WatchCache;

/// The bitmaps of the configured ranges, primary first.
pub(super) struct LegacyIpBitmaps {
    bitmaps: Vec<(LegacyBitmap, ServiceRange)>,
    /// LIST page size of the fresh list that confirms a leak.
    page_size: u32,
    /// The `kubernetes` Service: a range mismatch is reported in an event about it.
    kubernetes_service: ServiceName,
}

/// The event reason of a bitmap stored under another range (not upstream's: its repair always
/// rebuilds under its own range).
pub(super) const RANGE_MISMATCH_REASON: &str = "ClusterIPRangeMismatch";

/// How the bitmaps are built.
pub(super) struct BitmapSettings<'a> {
    pub etcd: &'a EtcdConfig,
    pub interval: std::time::Duration,
    pub page_size: u32,
    pub rebuild_on_range_change: bool,
    pub kubernetes_service: &'a ServiceName,
}

impl LegacyIpBitmaps {
    pub(super) fn new(settings: &BitmapSettings<'_>, ranges: &[IpNet]) -> Self {
        let etcd = settings.etcd;
        let store = EtcdStore::new(etcd.clone());
        let bitmaps = ranges
            .iter()
            .zip([RangeKey::ServiceIps, RangeKey::SecondaryServiceIps])
            .map(|(net, key)| {
                let range = ServiceRange::new(*net);
                let size = usize::try_from(range.legacy_bitmap_size()).unwrap_or(usize::MAX);
                let bitmap = LegacyBitmap::new(
                    store.clone(),
                    etcd.key(key),
                    net.to_string(),
                    size,
                    false,
                    Subject {
                        noun: "cluster IP",
                        kind_prefix: "clusterip",
                        range_setting: "serviceClusterIPRange",
                        apiserver_flag: "--service-cluster-ip-range",
                        rebuild_setting: "loops.clusterIPRepair.rebuildBitmapOnRangeChange",
                    },
                    move |offset| {
                        range
                            .address_at(offset as u128 + 1)
                            .map_or_else(|| format!("offset {offset}"), |ip| ip.to_string())
                    },
                    move |stored: &str, data: &[u8]| {
                        let from = ServiceRange::new(stored.parse::<IpNet>().ok()?);
                        let bits =
                            crate::legacy_alloc::codec::bitmap_from_bytes(data, bitmap_size(&from));
                        Some(crate::legacy_alloc::repair::rebase(
                            &bits,
                            size,
                            |offset| from.address_at(offset as u128 + 1),
                            |ip| self::offset(&range, ip, size),
                        ))
                    },
                    settings.rebuild_on_range_change,
                    settings.interval,
                );
                (bitmap, range)
            })
            .collect();
        Self {
            bitmaps,
            page_size: settings.page_size,
            kubernetes_service: settings.kubernetes_service.clone(),
        }
    }

    pub(super) fn triggers(&self) -> Vec<Trigger> {
        self.bitmaps
            .iter()
            .map(|(bitmap, _)| bitmap.watch())
            .collect()
    }

    /// Repairs each bitmap against the cluster IPs the Service cache holds.
    pub(super) async fn pass(
        &self,
        ctx: &PassContext,
        services: &WatchCache<ServiceRecord>,
        recorder: &Recorder,
        count: &(dyn Fn(&'static str) + Sync),
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        for (bitmap, range) in &self.bitmaps {
            let (in_use, owners) = {
                let state = services.read();
                if !state.synced {
                    return Ok(());
                }
                in_use(state.values(), range, bitmap_size(range))
            };
            let owner = |offset: usize| {
                owners
                    .get(&offset)
                    .map(|(namespace, name, _)| format!("Service/{namespace}/{name}"))
            };
            let fresh_in_use = || -> BoxFuture<'static, Option<FixedBitSet>> {
                let (client, page_size, range) = (ctx.client.clone(), self.page_size, *range);
                Box::pin(async move {
                    let services = crate::service_cache::fresh_services(&client, page_size).await?;
                    Some(self::in_use(services.iter(), &range, bitmap_size(&range)).0)
                })
            };
            let owner_of = |offset: usize| {
                owners.get(&offset).map(|(namespace, name, uid)| {
                    (namespace.into(), name.into(), uid.as_str().into())
                })
            };
            let holds = |service: &ServiceRecord, offset: usize| {
                range
                    .address_at(offset as u128 + 1)
                    .is_some_and(|ip| service.lists_ip(ip))
            };
            let confirm = |offsets| {
                crate::legacy_alloc::confirm_live(
                    &ctx.client,
                    offsets,
                    &owner_of,
                    &holds,
                    fresh_in_use,
                )
            };
            let pass = bitmap
                .pass(&in_use, &owner, ctx.dry_run, fresh_in_use, confirm)
                .await
                .map_err(|err| LoopError::Other(format!("ClusterIP bitmap in etcd: {err}")))?;
            report.drift.extend(pass.drift);
            self.report_findings(ctx, bitmap, range, &owners, recorder, count, pass.new)
                .await?;
        }
        Ok(())
    }

    /// The new findings of one bitmap's pass: counted, and each repair's event published (a
    /// range mismatch is reported with its event or not at all: the next pass tries again).
    #[allow(clippy::too_many_arguments)]
    async fn report_findings(
        &self,
        ctx: &PassContext,
        bitmap: &LegacyBitmap,
        range: &ServiceRange,
        owners: &HashMap<usize, (String, String, String)>,
        recorder: &Recorder,
        count: &(dyn Fn(&'static str) + Sync),
        new: Vec<BitmapFinding>,
    ) -> Result<(), LoopError> {
        let mut unpublished = None;
        for finding in new {
            match finding {
                BitmapFinding::NotAllocated(offset) => {
                    count("repair");
                    if !ctx.dry_run
                        && let Some((namespace, name, uid)) = owners.get(&offset)
                    {
                        let family = match range.family() {
                            IpFamily::V4 => "IPv4",
                            IpFamily::V6 => "IPv6",
                        };
                        let note = format!(
                            "Cluster IP [{family}]:{} is not allocated; repairing",
                            bitmap.item(offset)
                        );
                        // The bitmap is repaired either way; the event is best effort here.
                        let _ = publish(
                            recorder,
                            (namespace.as_str(), name.as_str(), uid.as_str()),
                            "ClusterIPNotAllocated",
                            note,
                        )
                        .await;
                    }
                }
                BitmapFinding::Released(offset) => {
                    count("leak");
                    if !ctx.dry_run {
                        let service = &self.kubernetes_service;
                        let note = format!(
                            "Cluster IP {} appeared to have leaked (no Service holds it); \
                             released it from the allocation bitmap",
                            bitmap.item(offset)
                        );
                        let regarding = (service.namespace.as_str(), service.name.as_str(), "");
                        // Released either way; the event is best effort here.
                        let _ = publish(recorder, regarding, "ClusterIPReleased", note).await;
                    }
                }
                BitmapFinding::RangeMismatch(ref stored) => {
                    if !ctx.dry_run {
                        let service = &self.kubernetes_service;
                        let note = bitmap.range_mismatch_note(stored);
                        let regarding = (service.namespace.as_str(), service.name.as_str(), "");
                        if let Err(err) =
                            publish(recorder, regarding, RANGE_MISMATCH_REASON, note).await
                        {
                            // Reported with its event or not at all: the next pass tries
                            // again.
                            bitmap.forget(&finding);
                            unpublished.get_or_insert(err);
                            continue;
                        }
                    }
                    count("rangeMismatch");
                }
                // The bitmap rebuilt under the configured range (or its range filled in).
                BitmapFinding::RangeRebuilt(ref stored) => {
                    count("repair");
                    if !ctx.dry_run {
                        let service = &self.kubernetes_service;
                        let note = format!(
                            "rebuilt the ClusterIP allocation bitmap under the configured \
                             range (stored under {stored:?})"
                        );
                        let regarding = (service.namespace.as_str(), service.name.as_str(), "");
                        let _ = publish(recorder, regarding, "ClusterIPBitmapRebuilt", note).await;
                    }
                }
                BitmapFinding::Unusable(_) => count("invalid"),
                BitmapFinding::MayHaveLeaked(_) | BitmapFinding::ReleaseHeld(_) => {}
            }
        }
        match unpublished {
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(()),
        }
    }
}

fn bitmap_size(range: &ServiceRange) -> usize {
    usize::try_from(range.legacy_bitmap_size()).unwrap_or(usize::MAX)
}

/// The offsets (`ip - (network + 1)`, upstream's) the Services' cluster IPs take in `range`'s
/// bitmap, and the Service holding each that upstream's walk of a LIST meets first: the
/// smallest etcd key (the cache's order is a hash map's).
fn in_use<'a>(
    services: impl Iterator<Item = &'a ServiceRecord>,
    range: &ServiceRange,
    size: usize,
) -> (FixedBitSet, HashMap<usize, (String, String, String)>) {
    let mut bits = FixedBitSet::with_capacity(size);
    let mut first: HashMap<usize, &ServiceRecord> = HashMap::new();
    for service in services {
        for ip in service.cluster_ips.iter().filter_map(ClusterIp::ip) {
            if let Some(offset) = offset(range, ip, size) {
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
    }
    let owners = first
        .into_iter()
        .map(|(offset, service)| {
            let owner = (
                service.namespace.to_string(),
                service.name.to_string(),
                service.uid.to_string(),
            );
            (offset, owner)
        })
        .collect();
    (bits, owners)
}

fn offset(range: &ServiceRange, ip: IpAddr, size: usize) -> Option<usize> {
    let from_network = range.offset_of(ip)?;
    let offset = usize::try_from(from_network.checked_sub(1)?).ok()?;
    (offset < size).then_some(offset)
}

/// A Warning event about the Service `(namespace, name, uid)` (an empty uid: not known).
async fn publish(
    recorder: &Recorder,
    (namespace, name, uid): (&str, &str, &str),
    reason: &str,
    note: String,
) -> Result<(), kube::Error> {
    let reference = crate::events::service_reference(namespace, name, uid);
    crate::events::emit(
        recorder,
        &reference,
        EventType::Warning,
        reason,
        "ClusterIPAllocation",
        &note,
    )
    .await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::service_cache::record::Token;

    fn service(name: &str, ips: &[&str]) -> ServiceRecord {
        ServiceRecord {
            namespace: "default".into(),
            name: name.into(),
            uid: Token::new(name),
            resource_version: 1,
            cluster_ips: ips.iter().map(|ip| ClusterIp::parse(ip)).collect(),
            node_ports: Default::default(),
            health_check_node_port: 0,
            created: None,
        }
    }

    /// Upstream's offsets: IPv4 from network + 1 with the broadcast address excluded; IPv6 from
    /// network + 1, capped at 65,535 addresses.
    #[test]
    fn offsets_are_upstreams() {
        let v4 = ServiceRange::new("10.96.0.0/24".parse().unwrap());
        let size = bitmap_size(&v4);
        assert_eq!(size, 254);
        let services = [
            service("first", &["10.96.0.1"]),
            service("last", &["10.96.0.254"]),
            service("network", &["10.96.0.0"]),
            service("broadcast", &["10.96.0.255"]),
            service("outside", &["10.97.0.1"]),
            service("dual", &["fd00::5", "10.96.0.10"]),
            service("twice", &["10.96.0.10"]),
        ];
        let (bits, owners) = in_use(services.iter(), &v4, size);
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![0, 9, 253]);
        assert_eq!(owners[&9].1, "dual");

        let v6 = ServiceRange::new("fd00::/64".parse().unwrap());
        let size = bitmap_size(&v6);
        assert_eq!(size, 65_535);
        let (bits, _) = in_use(services.iter(), &v6, size);
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![4]);
        assert_eq!(offset(&v6, "fd00::1:0".parse().unwrap(), size), None);
    }

    /// The event of an IP missing from the bitmap goes to the Service upstream's walk meets
    /// first: the smallest etcd key (`a-b/x` before `a/z`), whatever the cache's order.
    #[test]
    fn the_owner_of_a_shared_ip_is_the_first_etcd_key() {
        let range = ServiceRange::new("10.96.0.0/24".parse().unwrap());
        let mut first = service("z", &["10.96.0.10"]);
        first.namespace = "a".into();
        let mut second = service("x", &["10.96.0.10"]);
        second.namespace = "a-b".into();
        for order in [[&first, &second], [&second, &first]] {
            let (_, owners) = in_use(order.into_iter(), &range, bitmap_size(&range));
            assert_eq!((owners[&9].0.as_str(), owners[&9].1.as_str()), ("a-b", "x"));
        }
    }

    /// upstream's legacy TestRepairLeakDualStack: a leaked IP in each family's bitmap survives
    /// two passes and is released by the third, each bitmap on its own.
    #[test]
    fn repair_leak_dual_stack() {
        use crate::legacy_alloc::repair::{LeakTracker, plan};
        use std::time::{Duration, Instant};
        let services = [service("web", &["192.168.1.2", "2000::2"])];
        for (cidr, leaked) in [
            ("192.168.1.0/24", "192.168.1.10"),
            ("2000::/108", "2000::10"),
        ] {
            let range = ServiceRange::new(cidr.parse().unwrap());
            let size = bitmap_size(&range);
            let (in_use, _) = in_use(services.iter(), &range, size);
            let leaked = offset(&range, leaked.parse().unwrap(), size).unwrap();
            let mut stored = in_use.clone();
            stored.insert(leaked);
            let mut leaks = LeakTracker::default();
            for round in 0..3 {
                let plan = plan(
                    &stored,
                    &in_use,
                    &mut leaks,
                    true,
                    Instant::now(),
                    Duration::ZERO,
                );
                assert_eq!(
                    plan.bitmap.contains(leaked),
                    round < 2,
                    "{cidr} round {round}"
                );
                assert_eq!(plan.bitmap.count_ones(..), if round < 2 { 2 } else { 1 });
                stored = plan.bitmap;
            }
        }
    }
}

//! etcd mode: the ClusterIP allocation bitmaps kube-apiserver keeps in etcd
//! (`<prefix>/ranges/serviceips` for the primary range, `secondaryserviceips` for the other
//! family), repaired against the Service cache as upstream's legacy `ipallocator` repair does,
//! on clusters that allocate with them (the loop decides which: [`super::ClusterIpRepairLoop`]).
//! A key that does not exist is left missing. A key stored under another range than
//! `serviceClusterIPRange` is reported (a Warning event on the `kubernetes` Service naming both
//! ranges) and left alone, unless `rebuildBitmapOnRangeChange` is set.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use fixedbitset::FixedBitSet;
use futures::StreamExt;
use futures::future::BoxFuture;
use ipnet::IpNet;
use tokio::sync::Notify;

use super::plan::ACTION_CLUSTERIP_ALLOCATION;
use super::{ClusterIpRepairLoop, Section};
use crate::alloc::ServiceRange;
use crate::contract::{LoopError, PassContext, PassReport, Trigger};
use crate::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};
use crate::legacy_alloc::{LegacyBitmap, Outlet, Subject};
use crate::section::ServiceName;
use crate::service_cache::record::{ClusterIp, ServiceRecord, ServiceRef};
use crate::service_range::ServiceRanges;

/// The bitmaps of the ranges, primary first: built at the first pass that finds the cluster
/// allocating with them, from the configured range or the one read from the cluster. Their etcd
/// watches wake the loop from then on; where they are left alone, nothing watches them.
pub(super) struct LegacyIpBitmaps {
    pub(super) etcd: EtcdConfig,
    /// The `kubernetes` Service: a range mismatch is reported in an event about it.
    kubernetes_service: ServiceName,
    bitmaps: Arc<OnceLock<Vec<(LegacyBitmap, ServiceRange)>>>,
    built: Arc<Notify>,
}

impl LegacyIpBitmaps {
    pub(super) fn new(etcd: EtcdConfig, kubernetes_service: ServiceName) -> Self {
        Self {
            etcd,
            kubernetes_service,
            bitmaps: Arc::default(),
            built: Arc::default(),
        }
    }

    /// The bitmaps, built from `ranges` the first time.
    async fn get_or_build(
        &self,
        section: &Section,
        ranges: &ServiceRanges,
    ) -> Result<&[(LegacyBitmap, ServiceRange)], LoopError> {
        if let Some(bitmaps) = self.bitmaps.get() {
            return Ok(bitmaps);
        }
        let ranges = ranges.resolve().await?;
        let bitmaps = self.bitmaps.get_or_init(|| self.build(section, &ranges));
        self.built.notify_one();
        Ok(bitmaps)
    }

    fn build(&self, section: &Section, ranges: &[IpNet]) -> Vec<(LegacyBitmap, ServiceRange)> {
        let store = EtcdStore::new(self.etcd.clone());
        ranges
            .iter()
            .zip([RangeKey::ServiceIps, RangeKey::SecondaryServiceIps])
            .map(|(net, key)| {
                let range = ServiceRange::new(*net);
                let size = usize::try_from(range.legacy_bitmap_size()).unwrap_or(usize::MAX);
                let bitmap = LegacyBitmap::new(
                    store.clone(),
                    self.etcd.key(key),
                    net.to_string(),
                    size,
                    false,
                    Subject {
                        noun: "cluster IP",
                        kind_prefix: "clusterip",
                        range_setting: "serviceClusterIPRange",
                        apiserver_flag: "--service-cluster-ip-range",
                        rebuild_setting: "loops.clusterIPRepair.rebuildBitmapOnRangeChange",
                        item_noun: "Cluster IP",
                        family: Some(range.family()),
                        event_action: ACTION_CLUSTERIP_ALLOCATION,
                        item_reason: "ClusterIP",
                        bitmap_name: "ClusterIP",
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
                    section.rebuild_bitmap_on_range_change,
                    section.interval,
                );
                (bitmap, range)
            })
            .collect()
    }

    /// The bitmaps' etcd watches, once they are built.
    pub(super) fn triggers(&self) -> Trigger {
        let (bitmaps, built) = (self.bitmaps.clone(), self.built.clone());
        futures::stream::once(async move {
            loop {
                if let Some(bitmaps) = bitmaps.get() {
                    let watches = bitmaps.iter().map(|(bitmap, _)| bitmap.watch());
                    return futures::stream::select_all(watches);
                }
                built.notified().await;
            }
        })
        .flatten()
        .boxed()
    }
}

impl ClusterIpRepairLoop {
    /// etcd mode, where kube-apiserver allocates with the bitmaps: repairs each against the
    /// cluster IPs the Service cache holds.
    pub(super) async fn repair_legacy_bitmaps(
        &self,
        ctx: &PassContext,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let Some(legacy) = &self.legacy else {
            return Ok(());
        };
        if !self.keeps_legacy_bitmaps(&ctx.client).await? {
            return Ok(());
        }
        let bitmaps = legacy.get_or_build(&self.section, &self.ranges).await?;
        let count = |error_type: &'static str| {
            self.metrics
                .ip_errors
                .get_or_create(&[("type", error_type)])
                .inc();
        };
        let outlet = Outlet {
            recorder: &self.recorder,
            kubernetes_service: (
                &legacy.kubernetes_service.namespace,
                &legacy.kubernetes_service.name,
            ),
            count: &count,
        };
        for (bitmap, range) in bitmaps {
            let (in_use, holders) = {
                let state = self.services.read();
                if !state.synced {
                    return Ok(());
                }
                in_use(state.values(), range, bitmap_size(range))
            };
            let fresh_in_use = || -> BoxFuture<'static, Option<FixedBitSet>> {
                let (client, page_size, range) =
                    (ctx.client.clone(), self.section.page_size, *range);
                Box::pin(async move {
                    let services = crate::service_cache::fresh_services(&client, page_size).await?;
                    Some(self::in_use(services.iter(), &range, bitmap_size(&range)).0)
                })
            };
            let holds = |service: &ServiceRecord, offset: usize| {
                range
                    .address_at(offset as u128 + 1)
                    .is_some_and(|ip| service.lists_ip(ip))
            };
            (bitmap.repair(
                ctx,
                (&in_use, &holders),
                holds,
                &fresh_in_use,
                &outlet,
                report,
            ))
            .await?;
        }
        Ok(())
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
) -> (FixedBitSet, HashMap<usize, ServiceRef>) {
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
        .map(|(offset, service)| (offset, ServiceRef::of(service)))
        .collect();
    (bits, owners)
}

fn offset(range: &ServiceRange, ip: IpAddr, size: usize) -> Option<usize> {
    let from_network = range.offset_of(ip)?;
    let offset = usize::try_from(from_network.checked_sub(1)?).ok()?;
    (offset < size).then_some(offset)
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
        assert_eq!(owners[&9].name.as_str(), "dual");

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
            assert_eq!(
                (owners[&9].namespace.as_str(), owners[&9].name.as_str()),
                ("a-b", "x")
            );
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

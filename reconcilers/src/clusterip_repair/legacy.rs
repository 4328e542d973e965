//! etcd mode: the ClusterIP allocation bitmaps kube-apiserver keeps in etcd
//! (`<prefix>/ranges/serviceips` for the primary range, `secondaryserviceips` for the other
//! family), repaired against the Service cache as upstream's legacy `ipallocator` repair does,
//! on clusters that allocate with them (the loop decides which: [`super::ClusterIpRepairLoop`]).
//! A key that does not exist is left missing. A key stored under another range than
//! `serviceClusterIPRange` is reported (a Warning event on the `kubernetes` Service naming both
//! ranges) and left alone, unless `rebuildBitmapOnRangeChange` is set.

use std::net::IpAddr;
use std::sync::{Arc, OnceLock};

use futures::StreamExt;
use ipnet::IpNet;
use tokio::sync::Notify;

use super::plan::ACTION_CLUSTERIP_ALLOCATION;
use super::{ClusterIpRepairLoop, Section};
use crate::alloc::ServiceRange;
use crate::contract::{LoopError, PassContext, PassReport, Trigger};
use crate::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};
use crate::legacy_alloc::{LegacyBitmap, Outlet, Subject};
use crate::section::ServiceName;
use crate::service_cache::record::{ClusterIp, ServiceRecord};
use crate::service_range::ServiceRanges;

/// The bitmaps of the ranges, primary first: built at the first pass that finds the cluster
/// allocating with them, from the configured range or the one read from the cluster. Their etcd
/// watches wake the loop from then on; where they are left alone, nothing watches them.
pub(super) struct LegacyIpBitmaps {
    pub(super) etcd: EtcdConfig,
    /// The `kubernetes` Service: a range mismatch is reported in an event about it.
    kubernetes_service: ServiceName,
    bitmaps: Arc<OnceLock<Vec<LegacyBitmap>>>,
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
    ) -> Result<&[LegacyBitmap], LoopError> {
        if let Some(bitmaps) = self.bitmaps.get() {
            return Ok(bitmaps);
        }
        let ranges = ranges.resolve().await?;
        let bitmaps = self.bitmaps.get_or_init(|| self.build(section, &ranges));
        self.built.notify_one();
        Ok(bitmaps)
    }

    fn build(&self, section: &Section, ranges: &[IpNet]) -> Vec<LegacyBitmap> {
        let store = EtcdStore::new(self.etcd.clone());
        ranges
            .iter()
            .zip([RangeKey::ServiceIps, RangeKey::SecondaryServiceIps])
            .map(|(net, key)| {
                let range = ServiceRange::new(*net);
                let size = bitmap_size(&range);
                LegacyBitmap::new(
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
                    move |service: &ServiceRecord| {
                        (service.cluster_ips.iter())
                            .filter_map(ClusterIp::ip)
                            .filter_map(|ip| offset(&range, ip, size))
                            .collect()
                    },
                    section.page_size,
                    section.rebuild_bitmap_on_range_change,
                    section.interval,
                )
            })
            .collect()
    }

    /// The bitmaps' etcd watches, once they are built.
    pub(super) fn triggers(&self) -> Trigger {
        let (bitmaps, built) = (self.bitmaps.clone(), self.built.clone());
        futures::stream::once(async move {
            loop {
                if let Some(bitmaps) = bitmaps.get() {
                    let watches = bitmaps.iter().map(LegacyBitmap::watch);
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
        for bitmap in bitmaps {
            let (in_use, holders) = {
                let state = self.services.read();
                if !state.synced {
                    return Ok(());
                }
                bitmap.in_use(state.values())
            };
            (bitmap.repair(ctx, (&in_use, &holders), &outlet, report)).await?;
        }
        Ok(())
    }
}

fn bitmap_size(range: &ServiceRange) -> usize {
    usize::try_from(range.legacy_bitmap_size()).unwrap_or(usize::MAX)
}

/// The offset of `ip` in `range`'s bitmap: `ip - (network + 1)`, upstream's.
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

    /// The bitmap the loop builds for `cidr`.
    fn bitmap(cidr: &str) -> LegacyBitmap {
        let kubernetes = ServiceName {
            namespace: "default".into(),
            name: "kubernetes".into(),
        };
        let legacy = LegacyIpBitmaps::new(EtcdConfig::default(), kubernetes);
        let mut bitmaps = legacy.build(&Section::default(), &[cidr.parse().unwrap()]);
        bitmaps.remove(0)
    }

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
            service("past the IPv6 cap", &["fd00::1:0"]),
        ];
        let (bits, owners) = bitmap("10.96.0.0/24").in_use(&services);
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![0, 9, 253]);
        assert_eq!(owners[&9].name.as_str(), "dual");

        let v6 = ServiceRange::new("fd00::/64".parse().unwrap());
        let size = bitmap_size(&v6);
        assert_eq!(size, 65_535);
        let (bits, _) = bitmap("fd00::/64").in_use(&services);
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![4]);
        assert_eq!(offset(&v6, "fd00::1:0".parse().unwrap(), size), None);
    }

    /// The event of an IP missing from the bitmap goes to the Service upstream's walk meets
    /// first: the smallest etcd key (`a-b/x` before `a/z`), whatever the cache's order.
    #[test]
    fn the_owner_of_a_shared_ip_is_the_first_etcd_key() {
        let bitmap = bitmap("10.96.0.0/24");
        let mut first = service("z", &["10.96.0.10"]);
        first.namespace = "a".into();
        let mut second = service("x", &["10.96.0.10"]);
        second.namespace = "a-b".into();
        for order in [[&first, &second], [&second, &first]] {
            let (_, owners) = bitmap.in_use(order);
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
            let (in_use, _) = bitmap(cidr).in_use(&services);
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

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
use smallvec::SmallVec;
use tokio::sync::Notify;

use super::plan::ACTION_CLUSTERIP_ALLOCATION;
use super::{ClusterIpRepairLoop, Section};
use crate::alloc::{IpFamily, ServiceRange};
use crate::budget::CacheBudget;
use crate::contract::{LoopError, PassContext, PassReport, Trigger};
use crate::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};
use crate::legacy_alloc::{BitmapRange, LegacyBitmap, Outlet, Subject};
use crate::section::ServiceName;
use crate::service_cache::FreshList;
use crate::service_cache::record::{ClusterIp, ServiceRecord};
use crate::service_range::RangeLookup;

/// The most bits kube-apiserver's bitmap allocator keeps for a range: 20 host bits.
const MAX_BITMAP_BITS: u128 = 1 << 20;

/// The bitmaps of the ranges, primary first: built at the first pass that finds the cluster
/// allocating with them, from the configured range or the one read from the cluster. Their etcd
/// watches wake the loop from then on, also once a control plane upgraded in place has them
/// left alone; where they are left alone from the start, nothing watches them.
pub(super) struct LegacyIpBitmaps {
    pub(super) etcd: EtcdConfig,
    /// The `kubernetes` Service: a range mismatch is reported in an event about it.
    kubernetes_service: ServiceName,
    /// The cluster's cache budget, which bounds a fresh list of the Services.
    budget: CacheBudget,
    bitmaps: Arc<OnceLock<Vec<LegacyBitmap<ServiceRange>>>>,
    built: Arc<Notify>,
}

impl LegacyIpBitmaps {
    pub(super) fn new(
        etcd: EtcdConfig,
        kubernetes_service: ServiceName,
        budget: CacheBudget,
    ) -> Self {
        Self {
            etcd,
            kubernetes_service,
            budget,
            bitmaps: Arc::default(),
            built: Arc::default(),
        }
    }

    /// The bitmaps, built from `ranges` the first time.
    async fn get_or_build(
        &self,
        section: &Section,
        ranges: &RangeLookup,
    ) -> Result<&[LegacyBitmap<ServiceRange>], LoopError> {
        if let Some(bitmaps) = self.bitmaps.get() {
            return Ok(bitmaps);
        }
        let ranges = ranges.resolve().await?;
        // kube-apiserver refuses such a range wherever it allocates with a bitmap
        // (`validateMaxCIDRRange`), and its bitmap would take this process 512 MiB at /0.
        if let Some(wide) = ranges
            .iter()
            .find(|net| ServiceRange::new(**net).legacy_bitmap_size() > MAX_BITMAP_BITS)
        {
            return Err(LoopError::Invalid(format!(
                "the service range {wide} has more than 20 host bits, more than kube-apiserver's \
                 bitmap allocator takes (an IPv4 mask of /12 or longer): no legacy bitmap is \
                 repaired for it; set serviceClusterIPRange to kube-apiserver's \
                 --service-cluster-ip-range"
            )));
        }
        let bitmaps = self.bitmaps.get_or_init(|| self.build(section, &ranges));
        self.built.notify_one();
        Ok(bitmaps)
    }

    fn build(&self, section: &Section, ranges: &[IpNet]) -> Vec<LegacyBitmap<ServiceRange>> {
        let store = EtcdStore::new(self.etcd.clone());
        ranges
            .iter()
            .zip([RangeKey::ServiceIps, RangeKey::SecondaryServiceIps])
            .map(|(net, key)| {
                LegacyBitmap::new(
                    store.clone(),
                    self.etcd.key(key),
                    ServiceRange::new(*net),
                    FreshList {
                        page_size: section.page_size,
                        budget: self.budget.clone(),
                    },
                    section.rebuild_bitmap_on_range_change,
                    section.leak_sighting_spacing,
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
        if !self.keeps_legacy_bitmaps().await? {
            return Ok(());
        }
        let bitmaps = legacy.get_or_build(&self.section, &self.ranges).await?;
        let outlet = Outlet {
            recorder: &self.recorder,
            kubernetes_service: (
                &legacy.kubernetes_service.namespace,
                &legacy.kubernetes_service.name,
            ),
            errors: &self.metrics.ip_errors,
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

/// The cluster-IP bitmap of a CIDR: a bit per address from network + 1, upstream's.
impl BitmapRange for ServiceRange {
    type Item = IpAddr;
    const SUBJECT: Subject = Subject {
        noun: "cluster IP",
        kind_prefix: "clusterip",
        range_setting: "serviceClusterIPRange",
        apiserver_flag: "--service-cluster-ip-range",
        rebuild_setting: "loops.clusterIPRepair.rebuildBitmapOnRangeChange",
        item_noun: "Cluster IP",
        event_action: ACTION_CLUSTERIP_ALLOCATION,
        item_reason: "ClusterIP",
        bitmap_name: "ClusterIP",
        create_if_missing: false,
    };

    fn parse(stored: &str) -> Option<Self> {
        stored.parse().ok().map(ServiceRange::new)
    }

    fn bits(&self) -> usize {
        usize::try_from(self.legacy_bitmap_size()).unwrap_or(usize::MAX)
    }

    fn item(&self, bit: usize) -> Option<IpAddr> {
        self.address_at(bit as u128 + 1)
    }

    /// `ip - (network + 1)`.
    fn bit(&self, ip: IpAddr) -> Option<usize> {
        let from_network = self.offset_of(ip)?;
        let offset = usize::try_from(from_network.checked_sub(1)?).ok()?;
        (offset < self.bits()).then_some(offset)
    }

    fn held(service: &ServiceRecord) -> SmallVec<[IpAddr; 4]> {
        service
            .cluster_ips
            .iter()
            .filter_map(ClusterIp::ip)
            .collect()
    }

    fn family(&self) -> Option<IpFamily> {
        Some(ServiceRange::family(self))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::discovery::NetworkingDiscovery;
    use crate::service_cache::record::Token;

    /// The bitmap the loop builds for `cidr`.
    fn bitmap(cidr: &str) -> LegacyBitmap<ServiceRange> {
        let kubernetes = ServiceName {
            namespace: "default".into(),
            name: "kubernetes".into(),
        };
        let legacy =
            LegacyIpBitmaps::new(EtcdConfig::default(), kubernetes, CacheBudget::default());
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
        let size = v4.bits();
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
        let size = v6.bits();
        assert_eq!(size, 65_535);
        let (bits, _) = bitmap("fd00::/64").in_use(&services);
        assert_eq!(bits.ones().collect::<Vec<_>>(), vec![4]);
        assert_eq!(v6.bit("fd00::1:0".parse().unwrap()), None);
    }

    /// A range kube-apiserver's bitmap allocator refuses is refused here too, naming it, and no
    /// bitmap is built for it.
    #[tokio::test]
    async fn a_range_over_20_host_bits_gets_no_bitmap() {
        let client = kube::Client::new(
            tower::service_fn(|_request: http::Request<kube::client::Body>| async {
                Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other(
                    "not called",
                ))
            }),
            "default",
        );
        let kubernetes = ServiceName {
            namespace: "default".into(),
            name: "kubernetes".into(),
        };
        let legacy = LegacyIpBitmaps::new(
            EtcdConfig::default(),
            kubernetes.clone(),
            CacheBudget::default(),
        );
        let wide = RangeLookup::new(
            client.clone(),
            vec!["10.0.0.0/11".parse().unwrap()],
            kubernetes.clone(),
            NetworkingDiscovery::new(client.clone()),
            std::time::Duration::ZERO,
        );
        let Err(err) = legacy.get_or_build(&Section::default(), &wide).await else {
            panic!("a bitmap was built for 10.0.0.0/11");
        };
        assert!(
            matches!(&err, LoopError::Invalid(why) if why.contains("10.0.0.0/11")),
            "{err}"
        );
        assert!(legacy.bitmaps.get().is_none());
        let widest = RangeLookup::new(
            client.clone(),
            vec!["10.0.0.0/12".parse().unwrap()],
            kubernetes,
            NetworkingDiscovery::new(client),
            std::time::Duration::ZERO,
        );
        assert_eq!(
            legacy
                .get_or_build(&Section::default(), &widest)
                .await
                .unwrap()
                .len(),
            1
        );
    }

    /// The most memory this process has held, in KiB (`VmHWM`).
    fn peak_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }

    /// A stored range as wide as 0.0.0.0/0 (2^32 bits, 512 MiB) is read from its bytes alone,
    /// not sized by it.
    #[test]
    fn a_wide_stored_range_is_sized_by_its_bytes() {
        let bitmap = bitmap("0.0.1.0/24");
        let size = 254;
        // Offset o of 0.0.0.0/0 is the address o + 1: 0.0.1.5 is offset 260, and offset 4 of
        // 0.0.1.0/24.
        let mut bytes = vec![0u8; 33];
        bytes[32 - 260 / 8] |= 1 << (260 % 8);
        bytes[32] |= 1;
        let before = peak_kib();
        let moved = bitmap.rebase("0.0.0.0/0", &bytes).unwrap();
        let grown = peak_kib() - before;
        assert!(grown < 128 * 1024, "{grown} KiB held to read 33 bytes");
        assert_eq!(moved.len(), size);
        assert_eq!(moved.ones().collect::<Vec<_>>(), vec![4]);
        let empty = bitmap.rebase("0.0.0.0/0", &[]).unwrap();
        assert_eq!(empty.count_ones(..), 0);
        assert!(bitmap.rebase("not a range", &bytes).is_none());
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
            let (in_use, _) = bitmap(cidr).in_use(&services);
            let leaked = range.bit(leaked.parse().unwrap()).unwrap();
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

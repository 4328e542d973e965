//! The node port allocation bitmap kube-apiserver keeps in etcd (`<prefix>/ranges/servicenodeports`),
//! read and written directly, as another writer (a restore, a lost write) would.

use anyhow::{Context, Result, bail, ensure};
use reconcilers::legacy_alloc::codec::{RangeAllocation, bitmap_from_bytes, bitmap_to_bytes};
use reconcilers::legacy_alloc::etcd::{EtcdConfig, EtcdStore, RangeKey};

/// kube-apiserver's default `--service-node-port-range` (up.sh does not change it).
pub const BASE: u16 = 30000;
pub const SIZE: usize = 2768;

/// One apiserver's node port bitmap, by its etcd and `--etcd-prefix`.
pub struct NodePortBitmap {
    store: EtcdStore,
    /// The etcd key, for messages.
    pub key: String,
}

impl NodePortBitmap {
    pub fn new(etcd_url: &str, prefix: &str) -> Self {
        let config = EtcdConfig {
            servers: vec![etcd_url.to_owned()],
            prefix: prefix.to_owned(),
            ..EtcdConfig::default()
        };
        let key = config.key(RangeKey::NodePorts);
        Self {
            store: EtcdStore::new(config),
            key,
        }
    }

    /// The ports set, the stored value, and its revision.
    pub async fn read(&self) -> Result<(Vec<u16>, RangeAllocation, i64)> {
        let stored = self
            .store
            .get(&self.key)
            .await?
            .with_context(|| format!("{} does not exist", self.key))?;
        ensure!(
            stored.value.starts_with(b"k8s\0"),
            "kube-apiserver stores protobuf (k8s\\0 envelope) at {}: {:?}",
            self.key,
            &stored.value[..stored.value.len().min(16)]
        );
        let decoded = RangeAllocation::decode(&stored.value)
            .with_context(|| format!("decoding {}", self.key))?;
        ensure!(
            decoded.range == "30000-32767",
            "{}: stored range {}",
            self.key,
            decoded.range
        );
        let ports = bitmap_from_bytes(&decoded.data, SIZE)
            .ones()
            .map(|offset| BASE + u16::try_from(offset).unwrap_or(u16::MAX))
            .collect();
        Ok((ports, decoded, stored.mod_revision))
    }

    pub async fn contains(&self, port: u16) -> Result<bool> {
        Ok(self.read().await?.0.contains(&port))
    }

    pub async fn revision(&self) -> Result<i64> {
        Ok(self.read().await?.2)
    }

    /// Sets or clears `port` by compare-and-swap (retried when the apiserver or the controller
    /// wrote in between).
    pub async fn set(&self, port: u16, allocated: bool) -> Result<()> {
        for _ in 0..10 {
            let (_, decoded, revision) = self.read().await?;
            let mut bits = bitmap_from_bytes(&decoded.data, SIZE);
            bits.set(usize::from(port - BASE), allocated);
            let value = decoded
                .with_range_and_data(decoded.range.clone(), bitmap_to_bytes(&bits))
                .encode();
            if self
                .store
                .compare_and_swap(&self.key, Some(revision), value)
                .await?
            {
                return Ok(());
            }
        }
        bail!("{} changed under ten compare-and-swaps", self.key)
    }
}

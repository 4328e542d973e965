//! The one part of the legacy bitmap repair that talks to etcd: read a range key, write it only
//! by compare-and-swap on its `mod_revision`, and watch it.
//!
//! The client connects lazily and every call returns an error rather than failing the process:
//! etcd briefly unavailable makes a pass fail, and the runner retries it with backoff.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, Identity, TlsOptions, Txn, TxnOp,
};
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::Mutex;
use tracing::{debug, warn};

use crate::findings::RepeatedFailure;

/// How to reach etcd: kube-apiserver's `--etcd-*` flags.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EtcdConfig {
    /// `--etcd-servers`: URLs such as `https://10.0.0.1:2379`.
    pub servers: Vec<String>,
    /// `--etcd-cafile`: verifies the servers' certificates (TLS only when set).
    pub ca_file: Option<PathBuf>,
    /// `--etcd-certfile` and `--etcd-keyfile`: the client certificate, both or neither.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// `--etcd-prefix` (default `/registry`).
    pub prefix: String,
}

impl EtcdConfig {
    /// The full key of a range, e.g. `/registry/ranges/servicenodeports`.
    pub fn key(&self, range: RangeKey) -> String {
        format!(
            "{}/ranges/{}",
            self.prefix.trim_end_matches('/'),
            range.name()
        )
    }
}

/// The range allocations kube-apiserver keeps in etcd.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeKey {
    NodePorts,
    ServiceIps,
    SecondaryServiceIps,
}

impl RangeKey {
    pub fn name(self) -> &'static str {
        match self {
            RangeKey::NodePorts => "servicenodeports",
            RangeKey::ServiceIps => "serviceips",
            RangeKey::SecondaryServiceIps => "secondaryserviceips",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("cannot read {flag} {path}: {source}")]
    File {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    #[error("etcd key {key} changed under every write ({attempts} compare-and-swap conflicts)")]
    Conflicts { key: String, attempts: usize },
}

/// A stored value and the revision it was last written at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    pub value: Vec<u8>,
    pub mod_revision: i64,
}

/// The last value of one key that its live watch saw: passes read it instead of etcd. Known
/// only while the watch is established and no write of ours has been refused since its last
/// event (a refused compare-and-swap means the watch has not caught up yet).
#[derive(Clone, Debug, Default)]
pub struct KeyCache(Arc<std::sync::Mutex<KeyCacheState>>);

#[derive(Debug, Default)]
struct KeyCacheState {
    live: bool,
    /// `Some(value)` when known (`Some(None)`: the key does not exist).
    value: Option<Option<Stored>>,
}

impl KeyCache {
    fn lock(&self) -> std::sync::MutexGuard<'_, KeyCacheState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `Some(value)` when known (`Some(None)`: the key does not exist).
    pub fn get(&self) -> Option<Option<Stored>> {
        let state = self.lock();
        if state.live {
            state.value.clone()
        } else {
            None
        }
    }

    /// What the watch saw (`live`: the watch is established).
    fn watched(&self, live: bool, value: Option<Option<Stored>>) {
        *self.lock() = KeyCacheState { live, value };
    }

    /// A write of ours went through at `mod_revision`.
    pub fn wrote(&self, value: Vec<u8>, mod_revision: i64) {
        let mut state = self.lock();
        if state.live {
            state.value = Some(Some(Stored {
                value,
                mod_revision,
            }));
        }
    }

    /// A write of ours was refused: read etcd itself until the watch's next event.
    pub fn forget(&self) {
        self.lock().value = None;
    }
}

/// A lazily connected etcd client.
#[derive(Clone)]
pub struct EtcdStore {
    config: Arc<EtcdConfig>,
    client: Arc<Mutex<Option<Client>>>,
}

impl EtcdStore {
    pub fn new(config: EtcdConfig) -> Self {
        Self {
            config: Arc::new(config),
            client: Arc::default(),
        }
    }

    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }

    async fn client(&self) -> Result<Client, EtcdError> {
        let mut slot = self.client.lock().await;
        if let Some(client) = slot.as_ref() {
            return Ok(client.clone());
        }
        let mut options = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(10));
        if let Some(tls) = self.tls()? {
            options = options.with_tls(tls);
        }
        let client = Client::connect(&self.config.servers, Some(options)).await?;
        *slot = Some(client.clone());
        Ok(client)
    }

    fn tls(&self) -> Result<Option<TlsOptions>, EtcdError> {
        let read = |flag: &'static str, path: &PathBuf| {
            std::fs::read(path).map_err(|source| EtcdError::File {
                flag,
                path: path.clone(),
                source,
            })
        };
        let config = &self.config;
        if config.ca_file.is_none() && config.cert_file.is_none() {
            return Ok(None);
        }
        let mut tls = TlsOptions::new();
        if let Some(ca) = &config.ca_file {
            tls = tls.ca_certificate(Certificate::from_pem(read("--etcd-cafile", ca)?));
        }
        if let (Some(cert), Some(key)) = (&config.cert_file, &config.key_file) {
            tls = tls.identity(Identity::from_pem(
                read("--etcd-certfile", cert)?,
                read("--etcd-keyfile", key)?,
            ));
        }
        Ok(Some(tls))
    }

    /// The key's value, `None` when it does not exist.
    pub async fn get(&self, key: &str) -> Result<Option<Stored>, EtcdError> {
        let mut client = self.client().await?;
        let response = client.get(key, None).await?;
        Ok(response.kvs().first().map(|kv| Stored {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        }))
    }

    /// Writes `value` only if the key was last written at `mod_revision`, or, with `None`, only
    /// if it does not exist. `Ok(false)`: someone wrote it in between; nothing was written.
    pub async fn compare_and_swap(
        &self,
        key: &str,
        mod_revision: Option<i64>,
        value: Vec<u8>,
    ) -> Result<bool, EtcdError> {
        Ok(self
            .compare_and_swap_revision(key, mod_revision, value)
            .await?
            .is_some())
    }

    /// As [`Self::compare_and_swap`]; `Some(revision)`: written, at that revision.
    pub async fn compare_and_swap_revision(
        &self,
        key: &str,
        mod_revision: Option<i64>,
        value: Vec<u8>,
    ) -> Result<Option<i64>, EtcdError> {
        let mut client = self.client().await?;
        let condition = match mod_revision {
            Some(revision) => Compare::mod_revision(key, CompareOp::Equal, revision),
            None => Compare::create_revision(key, CompareOp::Equal, 0),
        };
        let txn = Txn::new()
            .when([condition])
            .and_then([TxnOp::put(key, value, None)]);
        let response = client.txn(txn).await?;
        Ok(response
            .succeeded()
            .then(|| response.header().map_or(0, |header| header.revision())))
    }

    /// Yields after every change of `key` (and once when a watch is (re)established, since
    /// changes may have been missed while it was down), keeping `cache` at the key's value: the
    /// watch starts with one read and follows from that revision, so nothing falls in between.
    /// Reconnects with backoff, forever.
    pub fn watch(&self, key: String, cache: KeyCache) -> BoxStream<'static, ()> {
        let store = self.clone();
        let state = (
            store,
            key,
            cache,
            None,
            new_backoff(),
            RepeatedFailure::default(),
        );
        futures::stream::unfold(
            state,
            |(store, key, cache, mut stream, mut backoff, mut failure)| async move {
                loop {
                    let Some(watch) = stream.as_mut() else {
                        match store.establish(&key, &cache).await {
                            Ok(watch) => {
                                debug!(key, "watching the etcd key");
                                stream = Some(watch);
                                backoff = new_backoff();
                                failure.succeeded();
                                return Some(((), (store, key, cache, stream, backoff, failure)));
                            }
                            Err(err) if failure.is_new(&err) => {
                                warn!(key, error = %err, "cannot watch the etcd key; retrying (the same failure again is logged at debug level)");
                            }
                            Err(err) => {
                                debug!(key, error = %err, "cannot watch the etcd key, again");
                            }
                        }
                        tokio::time::sleep(backoff.next().unwrap_or(Duration::from_secs(30))).await;
                        continue;
                    };
                    match watch.next().await {
                        Some(Ok(response)) if !response.events().is_empty() => {
                            for event in response.events() {
                                if let Some(kv) = event.kv() {
                                    // A delete event carries the key with version 0.
                                    let value = (kv.version() != 0).then(|| Stored {
                                        value: kv.value().to_vec(),
                                        mod_revision: kv.mod_revision(),
                                    });
                                    cache.watched(true, Some(value));
                                }
                            }
                            return Some(((), (store, key, cache, stream, backoff, failure)));
                        }
                        Some(Ok(_)) => {}
                        Some(Err(err)) => {
                            warn!(key, error = %err, "the etcd watch failed; re-establishing it");
                            cache.watched(false, None);
                            stream = None;
                        }
                        None => {
                            debug!(key, "the etcd watch ended; re-establishing it");
                            cache.watched(false, None);
                            stream = None;
                        }
                    }
                }
            },
        )
        .boxed()
    }

    /// Reads the key into `cache` and watches it from the revision after that read.
    async fn establish(
        &self,
        key: &str,
        cache: &KeyCache,
    ) -> Result<etcd_client::WatchStream, EtcdError> {
        let mut client = self.client().await?;
        let response = client.get(key, None).await?;
        let revision = response.header().map_or(0, |header| header.revision());
        let stored = response.kvs().first().map(|kv| Stored {
            value: kv.value().to_vec(),
            mod_revision: kv.mod_revision(),
        });
        let watch = client
            .watch(
                key,
                Some(etcd_client::WatchOptions::new().with_start_revision(revision + 1)),
            )
            .await?;
        cache.watched(true, Some(stored));
        Ok(watch)
    }
}

fn new_backoff() -> backon::ExponentialBackoff {
    crate::retry::backoff(Duration::from_millis(200), Duration::from_secs(30)).build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_kube_apiservers() {
        let mut config = EtcdConfig {
            servers: vec!["http://127.0.0.1:2379".to_owned()],
            ca_file: None,
            cert_file: None,
            key_file: None,
            prefix: "/registry".to_owned(),
        };
        assert_eq!(
            config.key(RangeKey::NodePorts),
            "/registry/ranges/servicenodeports"
        );
        config.prefix = "/custom/".to_owned();
        assert_eq!(
            config.key(RangeKey::ServiceIps),
            "/custom/ranges/serviceips"
        );
        assert_eq!(
            config.key(RangeKey::SecondaryServiceIps),
            "/custom/ranges/secondaryserviceips"
        );
    }
}

//! Discovery of what the cluster serves in networking.k8s.io/v1 (ServiceCIDRs and IPAddresses
//! from 1.33), one per cluster: the ServiceCIDR loop, the ClusterIP repair and the range read
//! from the cluster all ask it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kube::Client;
use tokio::time::Instant;

/// What discovery says of networking.k8s.io/v1, asked once for all the loops of a cluster: a
/// loop that asks while a request is in flight waits for its answer. An answer that finds what
/// a loop asks for is kept for good; one that does not is asked again once the asking loop's
/// `recheck` has passed since it was given (a control plane upgraded in place serves the API
/// from then on).
pub struct NetworkingDiscovery {
    client: Client,
    /// The resources the group version serves (none where it is not served), and when that
    /// was answered.
    kept: tokio::sync::Mutex<Option<(Vec<String>, Instant)>>,
}

impl NetworkingDiscovery {
    pub fn new(client: Client) -> Arc<Self> {
        Arc::new(NetworkingDiscovery {
            client,
            kept: tokio::sync::Mutex::new(None),
        })
    }

    /// Whether the API serves every one of `resources` (plural names) in networking.k8s.io/v1;
    /// a cluster without the group version serves none.
    pub async fn serves(&self, resources: &[&str], recheck: Duration) -> Result<bool, kube::Error> {
        let serves_all = |served: &[String]| {
            resources
                .iter()
                .all(|name| served.iter().any(|r| r == name))
        };
        let mut kept = self.kept.lock().await;
        if let Some((served, at)) = kept.as_ref()
            && (serves_all(served) || at.elapsed() < recheck)
        {
            return Ok(serves_all(served));
        }
        let served = match self
            .client
            .list_api_group_resources("networking.k8s.io/v1")
            .await
        {
            Ok(list) => list.resources.into_iter().map(|r| r.name).collect(),
            Err(kube::Error::Api(status)) if status.code == 404 => Vec::new(),
            Err(err) => return Err(err),
        };
        let answer = serves_all(&served);
        *kept = Some((served, Instant::now()));
        Ok(answer)
    }
}

/// Tells whether an answer differs from the one before, so that a loop logs what discovery
/// found when it is the first answer or a change, not at every pass.
#[derive(Debug)]
pub(crate) struct LastAnswer<T>(Mutex<Option<T>>);

impl<T> Default for LastAnswer<T> {
    fn default() -> Self {
        LastAnswer(Mutex::new(None))
    }
}

impl<T: Copy + PartialEq> LastAnswer<T> {
    /// Keeps `answer`; returns the one kept before, if any.
    pub(crate) fn replace(&self, answer: T) -> Option<T> {
        let mut last = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        last.replace(answer)
    }
}

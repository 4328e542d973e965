//! The Service cache the ClusterIP and NodePort repairs share: every Service, projected to a
//! compact record ([`record`]) as the watch delivers it, kept by the projecting reflector of
//! [`store`] (which also keeps the ClusterIP repair's IPAddress and ServiceCIDR caches). One
//! watch of Services per process: both get the cache from
//! [`crate::section::BuildContext::services`], and the first to subscribe feeds it.

pub mod live;
pub mod record;
pub mod store;

use kube::Client;
use tracing::warn;

use record::ServiceRecord;

/// Every Service, listed now; `None` (logged) when the list fails.
pub async fn fresh_services(client: &Client, page_size: u32) -> Option<Vec<ServiceRecord>> {
    match store::list_fresh::<ServiceRecord>(client, page_size).await {
        Ok(services) => Some(services),
        Err(err) => {
            warn!(error = %err, "cannot list the Services to confirm a leak; it stays held");
            None
        }
    }
}

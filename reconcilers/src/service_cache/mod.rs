//! The Service cache the ClusterIP and NodePort repairs share: every Service, projected to a
//! compact record ([`record`]) as the watch delivers it, kept by the projecting reflector of
//! [`store`] (which also keeps the ClusterIP repair's IPAddress and ServiceCIDR caches). One
//! watch of Services per process: the ClusterIP repair builds the cache and hands it to the
//! NodePort repair through [`crate::section::BuildContext::services`]; the NodePort repair makes
//! its own when the ClusterIP repair is disabled.

pub mod record;
pub mod store;

use kube::Client;
use tracing::warn;

use crate::section::ConfigError;
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

/// `loops.<repair>.pageSize`: a LIST page holds at least one object.
pub(crate) fn validate_page_size(path: &str, page_size: u32, errors: &mut Vec<ConfigError>) {
    if page_size == 0 {
        errors.push(ConfigError::new(
            format!("{path}.pageSize"),
            format!(
                "must be at least 1 (the default is {})",
                store::DEFAULT_PAGE_SIZE
            ),
        ));
    }
}

//! The Service cache the ClusterIP and NodePort repairs share: every Service, projected to a
//! compact record ([`record`]) as the watch delivers it, kept by a
//! [`WatchCache`](crate::watch_cache::WatchCache). One watch of Services per process: both get the cache from [`crate::section::BuildContext::services`], and
//! the first to subscribe feeds it.

pub mod live;
pub mod record;

use kube::Client;
use kube::api::{Api, ListParams};

use record::{ServiceObject, ServiceRecord};

/// Every Service, listed now page by page: a read as fresh as the API's, for a decision no cache
/// may take alone (releasing a leaked bit of a bitmap in etcd). The caller reports a failure.
pub async fn fresh_services(
    client: &Client,
    page_size: u32,
) -> Result<Vec<ServiceRecord>, kube::Error> {
    let api: Api<ServiceObject> = Api::all(client.clone());
    let mut services = Vec::new();
    let mut params = ListParams::default().limit(page_size);
    loop {
        let page = api.list(&params).await?;
        services.extend(page.items.iter().map(ServiceRecord::from));
        match page.metadata.continue_ {
            Some(token) if !token.is_empty() => params = params.continue_token(&token),
            _ => return Ok(services),
        }
    }
}

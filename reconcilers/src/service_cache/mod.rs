//! The Service cache the ClusterIP and NodePort repairs share: every Service, projected to a
//! compact record ([`record`]) as the watch delivers it, kept by a
//! [`WatchCache`](crate::watch_cache::WatchCache). One watch of Services per process: both get the cache from [`crate::section::BuildContext::services`], and
//! the first to subscribe feeds it.

pub mod live;
pub mod record;

use std::ops::ControlFlow;

use kube::Client;
use kube::api::{Api, ListParams};

use crate::budget::CacheBudget;
use crate::contract::LoopError;
use record::{ServiceObject, ServiceRecord};

/// Every Service listed now, page by page: a read as fresh as the API's, for a decision no cache
/// may take alone (releasing a leaked bit of a bitmap in etcd, naming the holder of an IP). Each
/// page is handed on and dropped, and the list ends once it has more Services than the
/// cluster's caches may hold (its cache budget): an API whose list never ends costs one page at a
/// time, and only until then.
#[derive(Clone, Debug)]
pub struct FreshList {
    /// Services per page.
    pub page_size: u32,
    /// The cluster's cache budget: its objects are the most Services a list may have.
    pub budget: CacheBudget,
}

/// Why a fresh list of the Services gave no answer. The caller reports it.
#[derive(Debug, thiserror::Error)]
pub enum FreshListError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error(
        "the Services listed afresh are more than {limit}, the most the caches may hold: no \
         decision is taken on them; the budget is {hint}"
    )]
    OverBudget { limit: usize, hint: String },
}

impl From<FreshListError> for LoopError {
    fn from(err: FreshListError) -> Self {
        match err {
            FreshListError::Api(err) => LoopError::Api(err),
            // Retrying lists as many again until Services go or the budget grows.
            FreshListError::OverBudget { .. } => LoopError::Invalid(err.to_string()),
        }
    }
}

impl FreshList {
    /// Hands every Service to `each` as its page arrives, until `each` breaks.
    pub async fn each(
        &self,
        client: &Client,
        mut each: impl FnMut(&ServiceRecord) -> ControlFlow<()>,
    ) -> Result<(), FreshListError> {
        let api: Api<ServiceObject> = Api::all(client.clone());
        let limit = self.budget.max_objects();
        let mut listed = 0usize;
        let mut params = ListParams::default().limit(self.page_size);
        loop {
            let page = api.list(&params).await?;
            listed = listed.saturating_add(page.items.len());
            if listed > limit {
                return Err(FreshListError::OverBudget {
                    limit,
                    hint: self.budget.hint().to_owned(),
                });
            }
            for service in &page.items {
                if each(&ServiceRecord::from(service)).is_break() {
                    return Ok(());
                }
            }
            match page.metadata.continue_ {
                Some(token) if !token.is_empty() => params = params.continue_token(&token),
                _ => return Ok(()),
            }
        }
    }
}

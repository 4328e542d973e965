//! Writing this replica's Lease by compare-and-swap, and deleting stale ones.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, DeleteParams, PostParams, Preconditions};
use reconcilers::lease;
use tracing::{debug, info};

use super::state::{Content, State};

pub(super) use reconcilers::lease::status_code as code;

/// Creates or replaces this replica's Lease by compare-and-swap; reads only after a lost swap.
pub(super) async fn write(
    leases: &Api<Lease>,
    namespaces: &lease::LeaseNamespaces,
    state: &mut State,
    content: &Content,
) -> Result<Lease, WriteError> {
    let params = PostParams::default();
    // Each round fixes one obstacle: a missing namespace, an unknown or stale resourceVersion.
    for _ in 0..4 {
        let mut desired = state.desired(content);
        if state.exists != Some(true) {
            desired.metadata.resource_version = None;
            match leases.create(&params, &desired).await {
                Ok(lease) => return Ok(lease),
                Err(err) if code(&err) == Some(409) => state.exists = Some(true),
                Err(err) if code(&err) == Some(404) => {
                    let name = leases_namespace(leases).unwrap_or_default();
                    namespaces.ensure(&name).await?;
                    continue;
                }
                Err(err) => return Err(err.into()),
            }
            state.written_version = None;
        }
        if state.written_version.is_none() {
            match leases.get_opt(&state.name).await? {
                Some(lease) => state.written_version = lease.metadata.resource_version,
                None => {
                    state.exists = Some(false);
                    continue;
                }
            }
            desired = state.desired(content);
        }
        match leases.replace(&state.name, &params, &desired).await {
            Ok(lease) => return Ok(lease),
            Err(err) if code(&err) == Some(409) => state.written_version = None,
            Err(err) if code(&err) == Some(404) => state.exists = Some(false),
            Err(err) => return Err(err.into()),
        }
    }
    Err(WriteError::Contended)
}

pub(super) fn leases_namespace(leases: &Api<Lease>) -> Option<String> {
    leases.namespace().map(str::to_owned)
}

/// Deletes a Lease that stopped changing long ago, unless it changed since (the precondition):
/// every replica may try, and only one deletion can succeed.
pub(super) async fn clean_up(
    leases: Api<Lease>,
    name: String,
    version: Option<String>,
    timeout: Duration,
) {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            resource_version: version,
            uid: None,
        }),
        ..DeleteParams::default()
    };
    match tokio::time::timeout(timeout, leases.delete(&name, &params)).await {
        Ok(Ok(_)) => info!(lease = %name, "deleted the Lease of a replica gone for good"),
        Ok(Err(err)) if matches!(code(&err), Some(404 | 409)) => {}
        Ok(Err(err)) => {
            debug!(error = %err, lease = %name, "cannot delete a stale replica Lease; retrying later")
        }
        Err(_) => debug!(lease = %name, "deleting a stale replica Lease timed out; retrying later"),
    }
}

/// Why writing this replica's Lease failed.
#[derive(Debug, thiserror::Error)]
pub(super) enum WriteError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error("the Lease write did not finish before {0:?}")]
    TimedOut(Duration),
    #[error("the Lease kept changing under the write")]
    Contended,
}

//! A tenant Secret as the manager keeps it ([`Spec`]), and what it holds for the Secrets'
//! budget.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;

use super::listed::{Held, Listed};
use crate::config::{TENANT_CONFIG_ANNOTATION, TENANT_ETCD_KEYS};
use crate::etcd_claims::Record;

/// What the runtime of a tenant is made from: any change restarts the tenant.
///
/// Every sync compares each running tenant's Spec with its Secret's; the Secret's bytes are
/// shared (`Arc`), so an unchanged Spec compares by pointer rather than byte by byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Spec {
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) uid: String,
    /// Orders tenants whose etcd keys would overlap: the older Secret keeps them.
    pub(super) created: Option<Timestamp>,
    pub(super) kubeconfig: Option<Arc<[u8]>>,
    pub(super) fragment: Option<Arc<str>>,
    /// The etcd client certificate's data keys ([`TENANT_ETCD_KEYS`]): CA, certificate, key.
    pub(super) etcd: [Option<Arc<[u8]>>; 3],
    /// Held without its kubeconfig, annotation and certificates, which were this many bytes:
    /// they would have taken the Secrets over `--tenants-secrets-total-mib`.
    pub(super) shed: Option<usize>,
}

impl Held for Spec {
    fn held(&self) -> usize {
        let bytes = |data: &Option<Arc<[u8]>>| data.as_ref().map_or(0, |d| d.len());
        bytes(&self.kubeconfig)
            + self.fragment.as_ref().map_or(0, |f| f.len())
            + self.etcd.iter().map(bytes).sum::<usize>()
    }

    fn shed(self) -> Self {
        Spec {
            shed: Some(self.held()),
            kubeconfig: None,
            fragment: None,
            etcd: [None, None, None],
            ..self
        }
    }
}

impl Spec {
    pub(super) fn of(secret: &Secret, key: &str) -> Option<(String, Spec)> {
        let namespace = secret.metadata.namespace.clone()?;
        let name = secret.metadata.name.clone()?;
        let data = |key: &str| {
            secret
                .data
                .as_ref()
                .and_then(|data| data.get(key))
                .map(|bytes| Arc::from(bytes.0.as_slice()))
        };
        let spec = Spec {
            uid: secret.metadata.uid.clone().unwrap_or_default(),
            created: secret.metadata.creation_timestamp.as_ref().map(|t| t.0),
            kubeconfig: data(key),
            fragment: secret
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(TENANT_CONFIG_ANNOTATION))
                .map(|f| Arc::from(f.as_str())),
            etcd: [
                data(TENANT_ETCD_KEYS.ca),
                data(TENANT_ETCD_KEYS.cert),
                data(TENANT_ETCD_KEYS.key),
            ],
            namespace,
            name,
            shed: None,
        };
        Some((format!("{}/{}", spec.namespace, spec.name), spec))
    }
}

/// The etcd-claim records are this controller's own Leases, each of a few hundred bytes, one a
/// tenant Secret: they have no budget of their own.
impl Held for Record {
    fn held(&self) -> usize {
        0
    }

    fn shed(self) -> Self {
        self
    }
}

/// Whether a Secret held without its data (shed) would fit in the room the others leave.
pub(super) fn room_for_shed(secrets: &Listed<Spec>) -> bool {
    let (held, limit) = secrets.held();
    let room = limit.map_or(usize::MAX, |limit| limit.saturating_sub(held));
    secrets
        .complete
        .iter()
        .flatten()
        .filter_map(|(_, spec)| spec.shed)
        .any(|wanted| wanted <= room)
}

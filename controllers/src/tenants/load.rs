//! Reading a tenant's Secret into what its runtime is built from.

use reconcilers::legacy_alloc::etcd::{EtcdPin, InlineTls};

use super::{Spec, TenantSettings};
use crate::config::{Config, TENANT_CONFIG_ANNOTATION, TENANT_ETCD_KEYS};
use crate::limits::{LimitLayer, Limits};
use crate::tenant_kubeconfig;

/// What loading a tenant's Secret gives: everything its runtime is built from.
pub(super) struct Loaded {
    pub(super) config: Config,
    pub(super) kube_config: kube::Config,
    pub(super) client: kube::Client,
    /// The bounds of the client's responses; the cache budget pauses the client through it.
    pub(super) limits: LimitLayer,
}

/// Reads a tenant's Secret into what its runtime is built from: the configuration (fragment
/// over the file), the kubeconfig under the credential policy, the etcd credentials, and the
/// client (whose construction runs an allowed credential plugin, hence off the async threads).
pub(super) async fn load(
    settings: &TenantSettings,
    key: &str,
    spec: &Spec,
    etcd_pin: Option<EtcdPin>,
) -> Result<Loaded, String> {
    let mut config = settings
        .base
        .tenant(spec.fragment.as_deref())
        .map_err(|errors| format!("configuration: {errors}"))?;
    let source = format!(
        "Secret {key} key {:?}",
        settings.base.tenants.kubeconfig_key
    );
    let bytes = spec.kubeconfig.as_ref().ok_or_else(|| {
        format!(
            "{source} is missing (the kubeconfig must be under that data key; set \
             --tenants-kubeconfig-key for another)"
        )
    })?;
    let kube_config = tenant_kubeconfig::read(bytes, &source, &settings.credentials)
        .await
        .map_err(|err| err.to_string())?;
    config.settings.etcd.inline_tls = etcd_tls(key, spec, &config)?;
    // A tenant's etcd loops start only with the etcd its claim was decided for.
    if !config.settings.etcd.servers.is_empty() && etcd_pin.is_none() {
        return Err(format!(
            "{TENANT_CONFIG_ANNOTATION}: etcdServers: the etcd has not answered yet"
        ));
    }
    config.settings.etcd.pin = etcd_pin;
    let limits = Limits::TENANT.for_one_client(Some(&settings.pools.responses));
    let client = {
        let kube_config = kube_config.clone();
        let limits = limits.clone();
        tokio::task::spawn_blocking(move || {
            let server = crate::client::server_name(&kube_config.cluster_url);
            let read_ahead = Some(crate::client::ReadAhead::TENANT);
            crate::client::builder_reading_ahead(&kube_config, read_ahead).map(|builder| {
                builder
                    .with_layer(&crate::client::naming_connection_errors(server))
                    .with_layer(&limits)
                    .build()
            })
        })
        .await
        .map_err(|err| format!("{source}: cannot build a client: {err}"))?
        .map_err(|err| format!("{source}: cannot build a client: {err}"))?
    };
    Ok(Loaded {
        config,
        kube_config,
        client,
        limits,
    })
}

/// The tenant's etcd client certificate from its Secret's data keys, checked against its
/// `etcdServers`: credentials go to TLS servers only, a certificate comes with its key, and
/// credentials without servers are a mistake worth saying.
pub(super) fn etcd_tls(
    key: &str,
    spec: &Spec,
    config: &Config,
) -> Result<Option<InlineTls>, String> {
    let [ca, cert, client_key] = spec
        .etcd
        .clone()
        .map(|data| data.map(|bytes| bytes.to_vec()));
    let names = [
        TENANT_ETCD_KEYS.ca,
        TENANT_ETCD_KEYS.cert,
        TENANT_ETCD_KEYS.key,
    ];
    let given: Vec<&str> = spec
        .etcd
        .iter()
        .zip(names)
        .filter_map(|(data, name)| data.as_ref().map(|_| name))
        .collect();
    if config.settings.etcd.servers.is_empty() {
        if given.is_empty() {
            return Ok(None);
        }
        return Err(format!(
            "Secret {key} has etcd credentials ({}) but its {TENANT_CONFIG_ANNOTATION} \
             annotation sets no etcdServers: set etcdServers (and etcdPrefix), or remove them",
            given.join(", ")
        ));
    }
    if cert.is_some() != client_key.is_some() {
        return Err(format!(
            "Secret {key}: {} and {} go together (a client certificate and its key)",
            TENANT_ETCD_KEYS.cert, TENANT_ETCD_KEYS.key
        ));
    }
    if !given.is_empty()
        && let Some(plain) = config
            .settings
            .etcd
            .servers
            .iter()
            .find(|server| !server.starts_with("https://"))
    {
        return Err(format!(
            "{TENANT_CONFIG_ANNOTATION}: etcdServers {plain:?} is not https://: the Secret's \
             etcd credentials are sent over TLS only"
        ));
    }
    Ok(Some(InlineTls {
        ca,
        cert,
        key: client_key,
        origin: "the tenant Secret's etcd-ca.crt, etcd-client.crt, etcd-client.key",
    }))
}

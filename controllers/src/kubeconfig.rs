//! The Kubernetes client configuration: `--kubeconfig`, else `$KUBECONFIG`, `~/.kube/config`,
//! in-cluster. Its errors are configuration errors (exit 2): nothing about them gets better by
//! retrying.

use std::path::Path;

use kube::config::{KubeConfigOptions, Kubeconfig};

/// Why no usable client configuration could be read; each message names the flag and the fix.
#[derive(Debug, thiserror::Error)]
pub enum KubeconfigError {
    #[error(
        "--kubeconfig: cannot read {path}: {cause} (check the path and that it is a kubeconfig file)"
    )]
    Unreadable { path: String, cause: String },
    #[error(
        "--kubeconfig: {path} is not usable: {cause} (check its current-context, cluster and user)"
    )]
    Unusable { path: String, cause: String },
    #[error(
        "no usable Kubernetes configuration: {cause} (pass --kubeconfig FILE, set KUBECONFIG, or \
         run inside a cluster with a service account)"
    )]
    NoneFound { cause: String },
    #[error(
        "{source_name}: the cluster's certificate-authority(-data) holds no PEM certificate (it \
         must be the API server's CA bundle, PEM-encoded: -----BEGIN CERTIFICATE-----)"
    )]
    CaWithoutCertificate { source_name: String },
}

/// Reads the client configuration and sets this controller's User-Agent on it.
pub async fn load(path: Option<&Path>) -> Result<kube::Config, KubeconfigError> {
    let config = read(path).await?;
    finish(
        config,
        path.map_or_else(
            || "the Kubernetes configuration".to_owned(),
            |p| format!("--kubeconfig {}", p.display()),
        ),
    )
}

/// [`load`]'s last step, for a tenant's configuration too (see [`crate::tenant_kubeconfig`]).
pub(crate) fn finish(
    mut config: kube::Config,
    source_name: String,
) -> Result<kube::Config, KubeconfigError> {
    // A CA bundle without one PEM certificate trusts nothing: every TLS handshake would fail
    // and the loops would retry for ever, so it is a configuration error.
    if config.root_cert.as_ref().is_some_and(Vec::is_empty) {
        return Err(KubeconfigError::CaWithoutCertificate { source_name });
    }
    // kube-client sends no User-Agent; without one, audit logs and API request logs cannot tell
    // this controller's requests from anyone else's, nor one replica's from another's.
    let agent = user_agent();
    let value = http::HeaderValue::from_str(&agent)
        .unwrap_or_else(|_| http::HeaderValue::from_static(USER_AGENT_PRODUCT));
    config.headers.push((http::header::USER_AGENT, value));
    Ok(config)
}

/// The product part of the User-Agent: `bootstrap-controller/<version>`.
pub const USER_AGENT_PRODUCT: &str = concat!("bootstrap-controller/", env!("CARGO_PKG_VERSION"));

/// `bootstrap-controller/<version> (<pod or host name>; pid <pid>)`, sent with every API request.
pub fn user_agent() -> String {
    let host = crate::config::host_name()
        .filter(|name| name.is_ascii())
        .unwrap_or_else(|| "unknown".into());
    format!("{USER_AGENT_PRODUCT} ({host}; pid {})", std::process::id())
}

async fn read(path: Option<&Path>) -> Result<kube::Config, KubeconfigError> {
    let Some(path) = path else {
        return kube::Config::infer()
            .await
            .map_err(|err| KubeconfigError::NoneFound {
                cause: err.to_string(),
            });
    };
    let kubeconfig = Kubeconfig::read_from(path).map_err(|err| {
        // kube's message repeats the path, quoted twice; its cause says what went wrong.
        let cause =
            std::error::Error::source(&err).map_or_else(|| err.to_string(), ToString::to_string);
        KubeconfigError::Unreadable {
            path: path.display().to_string(),
            cause,
        }
    })?;
    kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|err| KubeconfigError::Unusable {
            path: path.display().to_string(),
            cause: err.to_string(),
        })
}

#[cfg(test)]
mod tests {
    /// kube-apiserver names an update without `fieldManager` after the User-Agent's product
    /// (the part before `/`); the endpoints loop tells its own writes from others' by that name.
    #[test]
    fn the_user_agent_names_the_field_manager_the_loops_expect() {
        let product = super::USER_AGENT_PRODUCT.split('/').next();
        assert_eq!(
            product,
            Some(reconcilers::apiserver_endpoints::objects::FIELD_MANAGER)
        );
    }
}

//! The two outside questions the endpoints loops ask: "is my apiserver ready?" and "what does this
//! name resolve to?". Both are traits so tests can answer them.

use std::io;
use std::net::IpAddr;
use std::time::Duration;

use futures::future::BoxFuture;

/// Whether the local apiserver is ready to serve.
pub trait ReadinessProbe: Send + Sync + 'static {
    /// `Ok(())` when ready; `Err(reason)` otherwise (the reason is logged).
    fn check(&self) -> BoxFuture<'_, Result<(), String>>;
}

/// `GET /readyz` (or another path) through a kube client, so it uses the kubeconfig's server,
/// CA and credentials. Upstream's own gate (spec §2.2 Run.1) accepts only status 200.
#[derive(Clone)]
pub struct ApiserverReadyz {
    client: kube::Client,
    path: String,
    timeout: Duration,
}

/// A readiness URL that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ReadyzUrlError {
    #[error("readyzURL {url:?} is not a URL: {reason}; use e.g. https://127.0.0.1:6443/readyz")]
    Parse { url: String, reason: String },
    #[error("readyzURL {url:?}: could not build a client for it: {reason}")]
    Client { url: String, reason: String },
}

impl ApiserverReadyz {
    /// Probe `path` (e.g. `/readyz`) on the server `client` talks to.
    pub fn new(client: kube::Client, path: impl Into<String>, timeout: Duration) -> Self {
        Self {
            client,
            path: path.into(),
            timeout,
        }
    }

    /// Probe a full URL, reusing `base`'s TLS trust and credentials (the kubeconfig's), so a sidecar
    /// can probe `https://127.0.0.1:6443/readyz` while writing through a load balancer.
    pub fn for_url(
        base: &kube::Config,
        url: &str,
        timeout: Duration,
    ) -> Result<Self, ReadyzUrlError> {
        let parse_err = |reason: String| ReadyzUrlError::Parse {
            url: url.to_owned(),
            reason,
        };
        let uri: hyper::Uri = url
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| parse_err(e.to_string()))?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(parse_err("scheme and host are required".to_owned()));
        };
        let server: hyper::Uri = format!("{scheme}://{authority}")
            .parse()
            .map_err(|e: hyper::http::uri::InvalidUri| parse_err(e.to_string()))?;
        let path = uri
            .path_and_query()
            .map(|p| p.as_str())
            .filter(|p| *p != "/" && !p.is_empty())
            .unwrap_or("/readyz")
            .to_owned();
        let mut config = base.clone();
        config.cluster_url = server;
        let client = kube::Client::try_from(config).map_err(|e| ReadyzUrlError::Client {
            url: url.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Self::new(client, path, timeout))
    }
}

impl ReadinessProbe for ApiserverReadyz {
    fn check(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let request = hyper::Request::get(self.path.as_str())
                .body(Vec::new())
                .map_err(|e| e.to_string())?;
            let response = tokio::time::timeout(
                self.timeout,
                self.client.send(request.map(kube::client::Body::from)),
            )
            .await
            .map_err(|_| format!("GET {} timed out after {:?}", self.path, self.timeout))?
            .map_err(|e| format!("GET {} failed: {e}", self.path))?;
            let status = response.status();
            if status == hyper::StatusCode::OK {
                Ok(())
            } else {
                Err(format!("GET {} answered {status}", self.path))
            }
        })
    }
}

/// Name resolution for `static` mode.
pub trait Resolver: Send + Sync + 'static {
    /// Every address `host` resolves to, both families.
    fn resolve<'a>(&'a self, host: &'a str) -> BoxFuture<'a, io::Result<Vec<IpAddr>>>;
}

/// The system resolver (`getaddrinfo` with no family filter, so A and AAAA).
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve<'a>(&'a self, host: &'a str) -> BoxFuture<'a, io::Result<Vec<IpAddr>>> {
        Box::pin(async move {
            let mut ips: Vec<IpAddr> = tokio::net::lookup_host((host, 0))
                .await?
                .map(|addr| addr.ip())
                .collect();
            ips.sort();
            ips.dedup();
            Ok(ips)
        })
    }
}

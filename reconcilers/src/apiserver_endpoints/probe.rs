//! The two outside questions the endpoints loops ask: "is my apiserver ready?" and "what does this
//! name resolve to?". Both are traits so tests can answer them.

use std::io;
use std::net::IpAddr;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::section::ConfigLoader;

/// Whether the local apiserver is ready to serve.
pub trait ReadinessProbe: Send + Sync + 'static {
    /// `Ok(())` when ready; why not otherwise (logged once when it starts).
    fn check(&self) -> BoxFuture<'_, Result<(), NotReady>>;
}

/// Why the local apiserver does not count as ready.
#[derive(Debug, Clone, thiserror::Error)]
pub enum NotReady {
    #[error("GET {path} timed out after {timeout:?}")]
    TimedOut { path: String, timeout: Duration },
    #[error("GET {path} failed: {reason}")]
    Failed { path: String, reason: String },
    #[error("GET {path} answered {status}")]
    Answered {
        path: String,
        status: http::StatusCode,
    },
    #[error("cannot build the readiness probe: {0}")]
    Setup(String),
}

/// `GET /readyz` (or another path) through a kube client, so it uses the kubeconfig's server, CA
/// and credentials. Upstream's own gate (the `/readyz` poll in `Start` of
/// `pkg/controlplane/controller/kubernetesservice/controller.go`) accepts only status 200.
#[derive(Clone)]
pub struct ApiserverReadyz {
    client: kube::Client,
    path: String,
    timeout: Duration,
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
    pub fn for_url(base: &kube::Config, url: &str, timeout: Duration) -> Result<Self, NotReady> {
        let parse_err = |reason: String| {
            NotReady::Setup(format!(
                "readyzURL {url:?} is not a URL: {reason}; use e.g. https://127.0.0.1:6443/readyz"
            ))
        };
        let uri: http::Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| parse_err(e.to_string()))?;
        let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
            return Err(parse_err("scheme and host are required".to_owned()));
        };
        let server: http::Uri = format!("{scheme}://{authority}")
            .parse()
            .map_err(|e: http::uri::InvalidUri| parse_err(e.to_string()))?;
        let path = uri
            .path_and_query()
            .map(|p| p.as_str())
            .filter(|p| *p != "/" && !p.is_empty())
            .unwrap_or("/readyz")
            .to_owned();
        let mut config = base.clone();
        config.cluster_url = server;
        let client = kube::Client::try_from(config).map_err(|e| {
            NotReady::Setup(format!(
                "readyzURL {url:?}: could not build a client for it: {e}"
            ))
        })?;
        Ok(Self::new(client, path, timeout))
    }
}

impl ReadinessProbe for ApiserverReadyz {
    fn check(&self) -> BoxFuture<'_, Result<(), NotReady>> {
        Box::pin(async move {
            let path = || self.path.clone();
            let request = http::Request::get(self.path.as_str())
                .body(Vec::new())
                .map_err(|e| NotReady::Setup(e.to_string()))?;
            let response = tokio::time::timeout(
                self.timeout,
                self.client.send(request.map(kube::client::Body::from)),
            )
            .await
            .map_err(|_| NotReady::TimedOut {
                path: path(),
                timeout: self.timeout,
            })?
            .map_err(|e| NotReady::Failed {
                path: path(),
                reason: e.to_string(),
            })?;
            match response.status() {
                http::StatusCode::OK => Ok(()),
                status => Err(NotReady::Answered {
                    path: path(),
                    status,
                }),
            }
        })
    }
}

/// Which server the readiness probe asks: the host of `readyzURL` when it is a full URL, else
/// the kubeconfig's server. Learnt once, at the first pass that needs it.
#[derive(Clone)]
pub struct ProbedServer {
    pub url: Option<String>,
    pub load: ConfigLoader,
    /// Whether [`Self::warn_if_elsewhere`] has looked: once per process, whichever loop asks.
    pub checked: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ProbedServer {
    /// The kubeconfig and the URL the probe asks.
    async fn target(&self) -> Result<(kube::Config, http::Uri), String> {
        let config = (self.load)()
            .await
            .map_err(|err| format!("cannot load the kubeconfig: {err}"))?;
        let uri = match &self.url {
            Some(url) => url.parse().map_err(|err| format!("readyzURL: {err}"))?,
            None => config.cluster_url.clone(),
        };
        Ok((config, uri))
    }

    /// Warns if the probe asks another server than this instance's apiserver
    /// ([`probed_elsewhere`]); a host that cannot be told is not warned about. Looks once.
    pub async fn warn_if_elsewhere(&self, advertised: Option<IpAddr>) {
        if self
            .checked
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        let Ok((_, uri)) = self.target().await else {
            return;
        };
        if let Some(why) = uri
            .host()
            .and_then(|host| probed_elsewhere(host, advertised))
        {
            tracing::warn!("{why}");
        }
    }
}

impl ProbedServer {
    /// Whether the probed server's certificate is valid for `address`, as a client of the
    /// `kubernetes` Service reaching the apiserver at `address` would check it: a TLS handshake
    /// with the kubeconfig's CA and `address` as the name to verify. Nothing is sent after it.
    /// `Ok(false)`: it chains to the CA but does not name the address; an error says why the
    /// check could not be made (no CA in the kubeconfig, a plain-HTTP probe, the server
    /// unreachable, another TLS failure).
    pub async fn certificate_holds(
        &self,
        address: IpAddr,
        timeout: Duration,
    ) -> Result<bool, String> {
        let (config, uri) = self.target().await?;
        if uri.scheme_str() != Some("https") {
            return Err(format!("{uri} is not https"));
        }
        let Some(host) = uri
            .host()
            .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
        else {
            return Err(format!("{uri} has no host"));
        };
        let mut roots = rustls::RootCertStore::empty();
        for der in config.root_cert.iter().flatten() {
            if let Err(err) = roots.add(rustls::pki_types::CertificateDer::from(der.clone())) {
                return Err(format!("the kubeconfig's certificate-authority: {err}"));
            }
        }
        if roots.is_empty() {
            return Err("the kubeconfig has no certificate-authority data".to_owned());
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = match rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
        {
            Ok(builder) => builder.with_root_certificates(roots).with_no_client_auth(),
            Err(err) => return Err(err.to_string()),
        };
        let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls));
        let port = uri.port_u16().unwrap_or(443);
        let handshake = async {
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            let name = rustls::pki_types::ServerName::IpAddress(address.into());
            connector.connect(name, tcp).await
        };
        match tokio::time::timeout(timeout, handshake).await {
            Err(_) => Err(format!(
                "no TLS handshake with {host}:{port} within {timeout:?}"
            )),
            Ok(Ok(_)) => Ok(true),
            Ok(Err(err)) => {
                let not_for_name = err
                    .get_ref()
                    .and_then(|inner| inner.downcast_ref::<rustls::Error>())
                    .is_some_and(|tls| {
                        matches!(
                            tls,
                            rustls::Error::InvalidCertificate(
                                rustls::CertificateError::NotValidForName
                                    | rustls::CertificateError::NotValidForNameContext { .. }
                            )
                        )
                    });
                if not_for_name {
                    Ok(false)
                } else {
                    Err(format!("TLS handshake with {host}:{port}: {err}"))
                }
            }
        }
    }
}

/// Why probing `host` may not say whether this instance's apiserver is ready, or `None`. A
/// sidecar probes its own apiserver: on loopback, or at the address it advertises. Any other
/// server (a load balancer in the kubeconfig, another node) answers for whichever apiserver it
/// reaches, so a dead local apiserver would stay listed.
pub fn probed_elsewhere(host: &str, advertised: Option<IpAddr>) -> Option<String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return None;
    }
    match super::members::parse_ip(host) {
        Some(ip) if ip.is_loopback() || Some(ip) == advertised => None,
        Some(ip) => Some(format!(
            "the readiness probe asks {ip}, which is neither loopback nor this instance's \
             advertiseAddress{}: if it is a load balancer or another apiserver, it answers for \
             whichever apiserver it reaches and a dead local apiserver stays listed; set readyzURL \
             to this apiserver's own address (e.g. https://127.0.0.1:6443/readyz)",
            advertised.map(|a| format!(" {a}")).unwrap_or_default()
        )),
        None => Some(format!(
            "the readiness probe asks {host:?}, a name rather than loopback or this instance's \
             advertiseAddress: if it leads to a load balancer or another apiserver, it answers \
             for whichever apiserver it reaches and a dead local apiserver stays listed; set \
             readyzURL to this apiserver's own address (e.g. https://127.0.0.1:6443/readyz)"
        )),
    }
}

/// How many failed readiness probes in a row withdraw a member. One slow `/readyz` (an etcd
/// latency spike fails `[-]etcd` on every apiserver at once) must not shrink the endpoints; an
/// apiserver that keeps failing must still go. A stopping apiserver is withdrawn at once by the
/// shutdown path ([`super::shutdown::ShutdownGate`]), which probes without this tolerance.
#[derive(Debug)]
pub struct FailureThreshold {
    threshold: u32,
    failures: std::sync::atomic::AtomicU32,
    /// Whether a probe has passed in this process.
    passed: std::sync::atomic::AtomicBool,
}

/// What one probe means once earlier ones are counted.
#[derive(Debug, Clone)]
pub enum Verdict {
    Ready,
    /// Failed, but fewer than the threshold in a row: still counts as ready.
    Tolerated {
        failures: u32,
        reason: NotReady,
    },
    /// Failed before any probe passed, fewer than the threshold in a row: not ready to join,
    /// and no reason yet to withdraw what an earlier process of this instance left.
    Unproven {
        failures: u32,
        reason: NotReady,
    },
    NotReady(NotReady),
}

impl FailureThreshold {
    /// `threshold` failures in a row are not ready (at least 1). Before a probe passes, fewer
    /// are [`Verdict::Unproven`]: no member is added on them, and none withdrawn (a restarted
    /// sidecar's first probe may meet a busy apiserver that its last process kept listed).
    pub fn new(threshold: u32) -> Self {
        Self {
            threshold: threshold.max(1),
            failures: std::sync::atomic::AtomicU32::new(0),
            passed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// Counts `probe` and says what it means.
    pub fn judge(&self, probe: Result<(), NotReady>) -> Verdict {
        use std::sync::atomic::Ordering;
        match probe {
            Ok(()) => {
                self.failures.store(0, Ordering::Relaxed);
                self.passed.store(true, Ordering::Relaxed);
                Verdict::Ready
            }
            Err(reason) => {
                let failures = self
                    .failures
                    .fetch_add(1, Ordering::Relaxed)
                    .saturating_add(1)
                    .min(self.threshold);
                if failures < self.threshold && !self.passed.load(Ordering::Relaxed) {
                    Verdict::Unproven { failures, reason }
                } else if failures < self.threshold {
                    Verdict::Tolerated { failures, reason }
                } else {
                    self.failures.store(self.threshold, Ordering::Relaxed);
                    Verdict::NotReady(reason)
                }
            }
        }
    }
}

impl Verdict {
    /// Ready or tolerated: `Ok`; not ready or unproven: why.
    pub fn result(&self) -> Result<(), NotReady> {
        match self {
            Verdict::Ready | Verdict::Tolerated { .. } => Ok(()),
            Verdict::NotReady(reason) | Verdict::Unproven { reason, .. } => Err(reason.clone()),
        }
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

/// [`ApiserverReadyz::for_url`], built on first use, for callers that only have an async way to
/// load the kubeconfig. A failure to build is reported as "not ready" and retried next check.
/// A probe that cannot connect (refused, TLS handshake failed) builds its client again from the
/// kubeconfig as it is then and tries once more: its client certificate and CA were read when it
/// was built, and may have been rotated on disk since.
pub struct LazyUrlReadyz {
    url: String,
    timeout: Duration,
    load: ConfigLoader,
    built: tokio::sync::Mutex<Option<ApiserverReadyz>>,
}

impl LazyUrlReadyz {
    pub fn new(url: impl Into<String>, timeout: Duration, load: ConfigLoader) -> Self {
        Self {
            url: url.into(),
            timeout,
            load,
            built: tokio::sync::Mutex::new(None),
        }
    }

    /// The probe, built from the kubeconfig if there is none yet or `fresh` is asked for.
    async fn probe(&self, fresh: bool) -> Result<ApiserverReadyz, NotReady> {
        let mut built = self.built.lock().await;
        if let Some(probe) = built.as_ref().filter(|_| !fresh) {
            return Ok(probe.clone());
        }
        let base = (self.load)()
            .await
            .map_err(|e| NotReady::Setup(e.to_string()))?;
        let probe = ApiserverReadyz::for_url(&base, &self.url, self.timeout)?;
        *built = Some(probe.clone());
        Ok(probe)
    }
}

impl ReadinessProbe for LazyUrlReadyz {
    fn check(&self) -> BoxFuture<'_, Result<(), NotReady>> {
        Box::pin(async move {
            match self.probe(false).await?.check().await {
                // No HTTP answer at all: perhaps credentials that changed on disk.
                Err(NotReady::Failed { .. }) => self.probe(true).await?.check().await,
                answered => answered,
            }
        })
    }
}

/// The address of the interface holding the default route for `family`, as kube-apiserver picks
/// when `--advertise-address` is unset. Connecting a UDP socket sends nothing; it only asks the
/// kernel which source address it would use.
pub fn default_route_address(family: crate::alloc::IpFamily) -> Option<IpAddr> {
    let (bind, probe) = match family {
        crate::alloc::IpFamily::V4 => ("0.0.0.0:0", "192.0.2.1:9"),
        crate::alloc::IpFamily::V6 => ("[::]:0", "[2001:db8::1]:9"),
    };
    let socket = std::net::UdpSocket::bind(bind).ok()?;
    socket.connect(probe).ok()?;
    let ip = socket.local_addr().ok()?.ip();
    (!ip.is_unspecified() && !ip.is_loopback()).then_some(ip)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failed() -> Result<(), NotReady> {
        Err(NotReady::Setup("probe failed".into()))
    }

    fn kinds(threshold: &FailureThreshold, probes: &[bool]) -> Vec<&'static str> {
        probes
            .iter()
            .map(
                |ok| match threshold.judge(if *ok { Ok(()) } else { failed() }) {
                    Verdict::Ready => "ready",
                    Verdict::Tolerated { .. } => "tolerated",
                    Verdict::Unproven { .. } => "unproven",
                    Verdict::NotReady(_) => "not ready",
                },
            )
            .collect()
    }

    #[test]
    fn a_probe_of_anything_but_loopback_or_the_advertised_address_is_reported() {
        let own: Option<IpAddr> = "192.0.2.10".parse().ok();
        for fine in ["127.0.0.1", "::1", "localhost", "LOCALHOST", "192.0.2.10"] {
            assert_eq!(probed_elsewhere(fine, own), None, "{fine}");
        }
        let lb = probed_elsewhere("192.0.2.99", own).unwrap_or_default();
        assert!(
            lb.contains("192.0.2.99") && lb.contains("advertiseAddress 192.0.2.10"),
            "{lb}"
        );
        let name = probed_elsewhere("api.example.com", own).unwrap_or_default();
        assert!(
            name.contains("\"api.example.com\"") && name.contains("readyzURL"),
            "{name}"
        );
    }

    #[test]
    fn failures_withdraw_only_when_the_threshold_is_reached_in_a_row() {
        let three = FailureThreshold::new(3);
        let probes = [
            false, true, false, true, false, false, true, false, false, false, false, true,
        ];
        // Unproven until a probe passes, unless the threshold is reached first; then a member is
        // kept below the threshold.
        let want = [
            "unproven",
            "ready",
            "tolerated",
            "ready",
            "tolerated",
            "tolerated",
            "ready",
            "tolerated",
            "tolerated",
            "not ready",
            "not ready",
            "ready",
        ];
        assert_eq!(kinds(&three, &probes), want);
        assert_eq!(
            kinds(&FailureThreshold::new(3), &[false, false, false, false]),
            ["unproven", "unproven", "not ready", "not ready"]
        );
        // 1: every failure counts, as without a threshold; 0 is read as 1.
        assert_eq!(
            kinds(&FailureThreshold::new(1), &[false, true]),
            ["not ready", "ready"]
        );
        assert_eq!(FailureThreshold::new(0).threshold(), 1);
    }
}

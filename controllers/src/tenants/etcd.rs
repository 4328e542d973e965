//! Which etcd a tenant's annotation names: its servers checked against the networks the
//! operator allows, and the etcd asked who it is, before the tenant's claim is decided
//! ([`crate::etcd_claims`]) and its loops start.
//!
//! Every replica asks about every Secret with `etcdServers` (not only the ones it runs), so
//! that every replica decides the claims alike. What the answer gives is pinned in the
//! tenant's configuration: its loops connect only to the addresses checked here and accept
//! only answers of the cluster that answered here.

use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use futures::FutureExt;
use ipnet::IpNet;
use reconcilers::legacy_alloc::etcd::{EtcdPin, EtcdStore};
use reconcilers::sanitize::Sanitized;
use tracing::{Instrument, debug, info_span};

use super::load::etcd_tls;
use super::{Manager, Spec, TenantSettings};
use crate::config::{TENANT_CONFIG_ANNOTATION, tenant_etcd_url};
use crate::etcd_claims::{Claimed, EtcdClaim};

/// How long asking a tenant's etcd may take (resolving its names, connecting, one read).
pub(super) const ASK_TIMEOUT: Duration = Duration::from_secs(20);
/// How soon an etcd that could not be asked is asked again.
pub(super) const ASK_RETRY: Duration = Duration::from_secs(30);

/// What asking a tenant's etcd gave.
#[derive(Clone, Debug)]
pub(super) struct Asked {
    pub(super) claim: EtcdClaim,
    pub(super) pin: EtcdPin,
    /// The URLs as the annotation writes them, for the record's readers.
    pub(super) servers: Vec<String>,
}

/// Why a Secret's etcd could not be asked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Unasked {
    pub(super) reason: String,
    /// It did not answer (no answer in time, no connection, a name that does not resolve
    /// now): asked again, it may fail in other words each time. Otherwise its configuration
    /// or the operator's networks refuse it.
    pub(super) unanswered: bool,
}

impl Unasked {
    // Kept (and retried) while the Secret lasts: an etcd's error text is cut here, not only
    // where it is shown.
    fn refused(reason: String) -> Self {
        Unasked {
            reason: Sanitized::new(&reason).into_string(),
            unanswered: false,
        }
    }

    fn unanswered(reason: String) -> Self {
        Unasked {
            reason: Sanitized::new(&reason).into_string(),
            unanswered: true,
        }
    }
}

impl std::fmt::Display for Unasked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.reason)
    }
}

/// What is known of a Secret's etcd.
#[derive(Clone, Debug)]
pub(super) enum EtcdState {
    /// No `etcdServers` (or a fragment that does not parse, which loading reports).
    None,
    /// Being asked; `failed` holds why the last time did not answer.
    Asking {
        prefix: String,
        failed: Option<Unasked>,
    },
    /// Could not be asked, at `at`: the tenant is not started, and it is asked again later.
    Failed {
        prefix: String,
        reason: Unasked,
        at: Instant,
    },
    Known(Asked),
}

impl EtcdState {
    /// What the claims' decision knows of it.
    pub(super) fn claimed(&self) -> Option<Claimed> {
        match self {
            EtcdState::None => None,
            EtcdState::Asking {
                prefix,
                failed: None,
            } => Some(Claimed::Asking {
                prefix: prefix.clone(),
            }),
            EtcdState::Asking { .. } | EtcdState::Failed { .. } => Some(Claimed::Unknown),
            EtcdState::Known(asked) => Some(Claimed::Known(asked.claim.clone())),
        }
    }

    /// Why the tenant cannot start, when its etcd could not be asked.
    pub(super) fn failure(&self) -> Option<&Unasked> {
        match self {
            EtcdState::Asking {
                failed: Some(reason),
                ..
            }
            | EtcdState::Failed { reason, .. } => Some(reason),
            _ => None,
        }
    }
}

/// What an ask task ends with: the tenant, the Secret version asked about, and the outcome.
pub(super) type AskOutcome = (String, Spec, Result<Asked, Unasked>);

impl Manager {
    /// Keeps what is known of every Secret's etcd: asks about a new Secret version, and again
    /// about one whose etcd could not be asked [`ASK_RETRY`] ago.
    pub(super) fn ask_etcds(&mut self, secrets: &std::collections::BTreeMap<String, Spec>) {
        self.etcds
            .retain(|key, (spec, _)| secrets.get(key) == Some(spec));
        let mut to_ask = Vec::new();
        for (key, spec) in secrets {
            match self.etcds.get_mut(key) {
                None => {
                    let state = match spec
                        .fragment
                        .as_deref()
                        .and_then(crate::config::fragment_etcd)
                    {
                        Some((_, prefix)) => {
                            to_ask.push((key.clone(), spec.clone()));
                            EtcdState::Asking {
                                prefix,
                                failed: None,
                            }
                        }
                        None => EtcdState::None,
                    };
                    self.etcds.insert(key.clone(), (spec.clone(), state));
                }
                Some((_, state)) => {
                    if let EtcdState::Failed { prefix, reason, at } = state
                        && at.elapsed() >= ASK_RETRY
                    {
                        *state = EtcdState::Asking {
                            prefix: std::mem::take(prefix),
                            failed: Some(std::mem::take(reason)),
                        };
                        to_ask.push((key.clone(), spec.clone()));
                    }
                }
            }
        }
        for (key, spec) in to_ask {
            let settings = self.settings.clone();
            let task_key = key.clone();
            self.asks.spawn(
                async move {
                    // A panic ends as a failure of this Secret's ask, which is tried again,
                    // rather than as a claim asked about for ever.
                    let asking = std::panic::AssertUnwindSafe(tokio::time::timeout(
                        ASK_TIMEOUT,
                        ask(&settings, &task_key, &spec),
                    ))
                    .catch_unwind();
                    let result = match asking.await {
                        Ok(Ok(result)) => result,
                        Ok(Err(_)) => Err(Unasked::unanswered(format!(
                            "{TENANT_CONFIG_ANNOTATION}: etcdServers: no answer within {} s",
                            ASK_TIMEOUT.as_secs()
                        ))),
                        Err(_) => Err(Unasked::unanswered(format!(
                            "{TENANT_CONFIG_ANNOTATION}: etcdServers: asking the etcd failed \
                             abnormally"
                        ))),
                    };
                    (task_key, spec, result)
                }
                .instrument(info_span!("tenant", tenant = %key)),
            );
        }
    }

    /// An ask ended: keep its answer if it is about the Secret version still known.
    pub(super) fn asked(&mut self, done: Result<AskOutcome, tokio::task::JoinError>) {
        // Asks catch their panics; only an abort (at shutdown) ends one otherwise.
        let Ok((key, spec, result)) = done else {
            return;
        };
        let Some((known, state)) = self.etcds.get_mut(&key) else {
            return;
        };
        if *known != spec {
            return;
        }
        let prefix = match state {
            EtcdState::Asking { prefix, .. } | EtcdState::Failed { prefix, .. } => prefix.clone(),
            EtcdState::Known(asked) => asked.claim.prefix.clone(),
            EtcdState::None => return,
        };
        *state = match result {
            Ok(asked) => {
                debug!(tenant = %key, cluster = format!("{:016x}", asked.claim.cluster), "the tenant's etcd answered");
                EtcdState::Known(asked)
            }
            Err(reason) => {
                debug!(tenant = %key, error = %reason, "the tenant's etcd could not be asked");
                EtcdState::Failed {
                    prefix,
                    reason,
                    at: Instant::now(),
                }
            }
        };
    }
}

/// Asks a Secret's etcd who it is: its configuration (fragment over the file, validated), its
/// credentials, its servers' addresses (each inside the allowed networks), and one count-only
/// read of its node-port key at those addresses, whose answer names the cluster.
async fn ask(settings: &TenantSettings, key: &str, spec: &Spec) -> Result<Asked, Unasked> {
    let mut config = settings
        .base
        .tenant(spec.fragment.as_deref())
        .map_err(|errors| Unasked::refused(format!("configuration: {errors}")))?;
    config.settings.etcd.inline_tls = etcd_tls(key, spec, &config).map_err(Unasked::refused)?;
    let addresses = checked_addresses(
        &config.settings.etcd.servers,
        &settings.base.tenants.etcd_allowed_cidrs,
    )
    .await?;
    let pin = EtcdPin {
        addresses,
        cluster_id: None,
    };
    config.settings.etcd.pin = Some(pin.clone());
    let etcd = config.settings.etcd().cloned().ok_or_else(|| {
        Unasked::refused(format!("{TENANT_CONFIG_ANNOTATION}: etcdServers is empty"))
    })?;
    let cluster = EtcdStore::new(etcd).cluster_id().await.map_err(|err| {
        Unasked::unanswered(format!("{TENANT_CONFIG_ANNOTATION}: etcdServers: {err}"))
    })?;
    Ok(Asked {
        claim: EtcdClaim {
            cluster,
            prefix: config.settings.etcd.prefix.clone(),
        },
        pin: EtcdPin {
            cluster_id: Some(cluster),
            ..pin
        },
        servers: config.settings.etcd.servers,
    })
}

/// The addresses of each server: its IP, or every address its host name resolves to now, each
/// inside one of `allowed`.
/// One address outside refuses the server: a name that resolves partly elsewhere is not one
/// the operator allowed.
pub(super) async fn checked_addresses(
    servers: &[String],
    allowed: &[IpNet],
) -> Result<Vec<Vec<SocketAddr>>, Unasked> {
    let field = format!("{TENANT_CONFIG_ANNOTATION}: etcdServers");
    let mut all = Vec::with_capacity(servers.len());
    for server in servers {
        let (_, host, port) =
            tenant_etcd_url(server).map_err(|why| Unasked::refused(format!("{field}: {why}")))?;
        let resolved: Vec<SocketAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(|err| {
                    Unasked::unanswered(format!(
                        "{field}: {server:?}: cannot resolve {host:?}: {err}"
                    ))
                })?
                .collect(),
        };
        // An IPv4-mapped IPv6 address is the IPv4 address it maps: checked and reached as such.
        let mut addresses: Vec<SocketAddr> = resolved
            .into_iter()
            .map(|address| SocketAddr::new(address.ip().to_canonical(), address.port()))
            .collect();
        addresses.sort();
        addresses.dedup();
        if addresses.is_empty() {
            return Err(Unasked::refused(format!(
                "{field}: {server:?}: {host:?} resolves to no address"
            )));
        }
        if let Some(outside) = addresses
            .iter()
            .find(|address| !allowed_address(address.ip(), allowed))
        {
            return Err(Unasked::refused(format!(
                "{field}: {server:?} is at {}, outside the networks a tenant's etcd may be in \
                 (--tenants-etcd-allowed-cidrs: {}): name an etcd inside them, or ask the \
                 operator to allow its network",
                outside.ip(),
                allowed
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            )));
        }
        all.push(addresses);
    }
    Ok(all)
}

fn allowed_address(ip: IpAddr, allowed: &[IpNet]) -> bool {
    allowed.iter().any(|net| net.contains(&ip))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().expect("a CIDR")).collect()
    }

    #[tokio::test]
    async fn servers_are_reached_only_inside_the_allowed_networks() {
        // localhost may resolve to ::1 as well as 127.0.0.1.
        let loopback = nets(&["127.0.0.0/8", "::1/128"]);
        let ok = |server: &str| vec![server.to_owned()];
        for server in [
            "http://127.0.0.1:2379",
            "http://127.1:2379",
            "http://2130706433:2379",
            "http://[::ffff:127.0.0.1]:2379",
            "http://127.0.0.1:02379",
            "http://localhost:2379",
        ] {
            let found = checked_addresses(&ok(server), &loopback).await;
            let found = found.unwrap_or_else(|err| panic!("{server}: {err}"));
            assert!(
                found[0]
                    .iter()
                    .all(|a| a.port() == 2379 && a.ip().to_canonical().is_loopback()),
                "{server}: {found:?}"
            );
        }
        for (server, why) in [
            ("http://192.0.2.1:2379", "outside the networks"),
            ("http://[fd00::1]:2379", "outside the networks"),
            ("http://[::ffff:192.0.2.1]:2379", "outside the networks"),
            ("http://user@127.0.0.1:2379", "userinfo"),
            ("http://127.0.0.1:2379/v3", "path"),
            ("http://127.0.0.1:2379?x=1", "query"),
            ("http://127.0.0.1:2379#x", "fragment"),
        ] {
            let err = checked_addresses(&ok(server), &loopback)
                .await
                .expect_err(server);
            assert!(
                err.reason.contains(why) && err.reason.contains("etcdServers") && !err.unanswered,
                "{server}: {err}"
            );
        }
        assert!(
            checked_addresses(&ok("http://127.0.0.1:2379"), &[])
                .await
                .is_err()
        );
    }
}

//! The service range (`serviceClusterIPRange`): configured, or read from the cluster.
//!
//! kube-apiserver's default range (10.0.0.0/24) is not what kubeadm (10.96.0.0/12), k3s
//! (10.43.0.0/16) or managed clusters use, so no range is assumed. When none is configured, it
//! is read from the `kubernetes` ServiceCIDR (networking.k8s.io/v1, Kubernetes 1.33+), which
//! kube-apiserver creates from its own `--service-cluster-ip-range`. Older clusters have nothing
//! that tells the range (the `kubernetes` Service's ClusterIP shows its family, not its size):
//! a loop that needs the range then refuses to work, with an error naming the setting, and the
//! other loops go on. A control plane upgraded in place (1.32 to 1.33) serves ServiceCIDRs from
//! then on, so discovery's "not served" is believed for a loop's interval only
//! ([`NetworkingDiscovery`](crate::discovery::NetworkingDiscovery)).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use ipnet::IpNet;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::{Api, Client};

use crate::alloc::{IpFamily, ServiceRange};
use crate::contract::LoopError;
use crate::discovery::NetworkingDiscovery;
use crate::section::ServiceName;
use crate::watch_cache::Lenient;

/// Name of the ServiceCIDR kube-apiserver creates from its `--service-cluster-ip-range`
/// (upstream's ClusterIP repair waits for it before its first pass).
pub const DEFAULT_SERVICE_CIDR: &str = "kubernetes";

/// Why the service ranges are unusable or unknown.
#[derive(Debug, thiserror::Error)]
pub enum RangeError {
    #[error(
        "lists {0} ranges; at most two are allowed, one IPv4 and one IPv6 (e.g. \
         10.96.0.0/12,fd00:10:96::/108)"
    )]
    TooMany(usize),
    #[error(
        "lists two {family} ranges ({0} and {1}); a dual-stack range needs one IPv4 and one IPv6 \
         CIDR (e.g. 10.96.0.0/12,fd00:10:96::/108)",
        family = IpFamily::of_net(.0)
    )]
    SameFamily(IpNet, IpNet),
    #[error(
        "{0} holds fewer than 8 addresses (use a larger range, e.g. /{longest} or shorter)",
        longest = .0.max_prefix_len() - 3
    )]
    TooSmall(IpNet),
    /// Not configured, and the cluster has no ServiceCIDR to read it from.
    #[error(
        "serviceClusterIPRange is not set and the cluster does not tell it: it serves no \
         networking.k8s.io/v1 ServiceCIDR (Kubernetes 1.33+){hint}; set serviceClusterIPRange \
         (flag --service-cluster-ip-range) to kube-apiserver's --service-cluster-ip-range"
    )]
    Unknown {
        /// What the `kubernetes` Service's ClusterIP shows, starting with `; `, or empty.
        hint: String,
    },
    /// The cluster serves ServiceCIDRs but kube-apiserver has not created `kubernetes` yet.
    #[error(
        "serviceClusterIPRange is not set and the ServiceCIDR \"kubernetes\" it is read from does \
         not exist yet"
    )]
    NotYet,
    /// The `kubernetes` ServiceCIDR holds ranges that are no service range.
    #[error(
        "serviceClusterIPRange is not set and the ServiceCIDR \"kubernetes\" it is read from holds \
         {cidrs:?}: {why}; set serviceClusterIPRange (flag --service-cluster-ip-range)"
    )]
    Unusable { cidrs: Vec<String>, why: String },
    #[error(transparent)]
    Api(#[from] kube::Error),
}

impl From<RangeError> for LoopError {
    fn from(err: RangeError) -> Self {
        match err {
            RangeError::Api(err) => LoopError::Api(err),
            // kube-apiserver creates it at start: normal for a moment, retried.
            RangeError::NotYet => LoopError::NotSynced(err.to_string()),
            RangeError::Unknown { .. }
            | RangeError::Unusable { .. }
            | RangeError::TooMany(_)
            | RangeError::SameFamily(..)
            | RangeError::TooSmall(_) => LoopError::Invalid(err.to_string()),
        }
    }
}

/// What the cluster said.
#[derive(Clone, Debug)]
enum Found {
    Ranges(Vec<IpNet>),
    /// No ServiceCIDR API; the hint for the error.
    NotServed(String),
}

/// The service ranges a loop works with: the configured ones, or the `kubernetes` ServiceCIDR's,
/// read (one request) the first time a pass needs them and kept; where the cluster serves no
/// ServiceCIDR, discovery is asked again once `recheck` has passed.
pub struct RangeLookup {
    configured: Vec<IpNet>,
    client: Client,
    discovery: Arc<NetworkingDiscovery>,
    recheck: Duration,
    /// The `kubernetes` Service, whose ClusterIP names the family in the error.
    service: ServiceName,
    found: Mutex<Option<Found>>,
}

impl RangeLookup {
    /// `configured` empty: read the range from the cluster, and where it serves no ServiceCIDR,
    /// ask discovery again at most once per `recheck` (the loop's interval).
    pub fn new(
        client: Client,
        configured: Vec<IpNet>,
        service: ServiceName,
        discovery: Arc<NetworkingDiscovery>,
        recheck: Duration,
    ) -> Self {
        RangeLookup {
            configured,
            client,
            discovery,
            recheck,
            service,
            found: Mutex::new(None),
        }
    }

    /// The configured ranges, if any.
    pub fn configured(&self) -> Option<&[IpNet]> {
        (!self.configured.is_empty()).then_some(&self.configured[..])
    }

    /// The ranges, primary first: the configured ones, or the `kubernetes` ServiceCIDR's.
    pub async fn resolve(&self) -> Result<Vec<IpNet>, RangeError> {
        if !self.configured.is_empty() {
            return Ok(self.configured.clone());
        }
        let kept = self.kept();
        let found = match kept {
            Some(Found::Ranges(ranges)) => return Ok(ranges),
            // The hint is read once: discovery, asked again, answers from what it keeps
            // within `recheck`.
            Some(Found::NotServed(hint))
                if !self
                    .discovery
                    .serves(&["servicecidrs"], self.recheck)
                    .await? =>
            {
                Found::NotServed(hint)
            }
            _ => self.read().await?,
        };
        if let Found::Ranges(ranges) = &found {
            tracing::info!(
                ranges = %ranges.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
                "serviceClusterIPRange is not set; using the ranges of the ServiceCIDR \"kubernetes\""
            );
        }
        *self.found.lock().unwrap_or_else(PoisonError::into_inner) = Some(found.clone());
        match found {
            Found::Ranges(ranges) => Ok(ranges),
            Found::NotServed(hint) => Err(RangeError::Unknown { hint }),
        }
    }

    fn kept(&self) -> Option<Found> {
        (self.found.lock().unwrap_or_else(PoisonError::into_inner)).clone()
    }

    async fn read(&self) -> Result<Found, RangeError> {
        if !self
            .discovery
            .serves(&["servicecidrs"], self.recheck)
            .await?
        {
            return Ok(Found::NotServed(self.hint().await?));
        }
        // A LIST of the one object: the loops' RBAC lists and watches ServiceCIDRs, never gets.
        // Decoded as a Go client would, so that a null or a newer version's field never hides
        // the range.
        let api: Api<Lenient<ServiceCIDR>> = Api::all_with(self.client.clone(), &());
        let params = kube::api::ListParams::default()
            .fields(&format!("metadata.name={DEFAULT_SERVICE_CIDR}"));
        let Some(Lenient(object)) = api.list(&params).await?.items.into_iter().next() else {
            return Err(RangeError::NotYet);
        };
        let cidrs = object.spec.and_then(|spec| spec.cidrs).unwrap_or_default();
        ranges_of(&cidrs).map(Found::Ranges)
    }

    /// What the `kubernetes` Service's ClusterIP says about the range, for the error.
    async fn hint(&self) -> Result<String, kube::Error> {
        let api: Api<Lenient<Service>> =
            Api::namespaced_with(self.client.clone(), &self.service.namespace, &());
        let ip = api
            .get_opt(&self.service.name)
            .await?
            .and_then(|Lenient(service)| service.spec)
            .and_then(|spec| spec.cluster_ip)
            .and_then(|ip| crate::alloc::parse_ip_sloppy(&ip));
        Ok(match ip {
            Some(ip) => format!(
                "; the {}/{} Service's ClusterIP {ip} shows an {} range, but not its size",
                self.service.namespace,
                self.service.name,
                IpFamily::of(ip)
            ),
            None => String::new(),
        })
    }
}

/// Checks service ranges the way kube-apiserver checks `--service-cluster-ip-range`
/// (`ValidateServiceClusterIPRanges` in `cmd/kube-apiserver/app/options/validation.go`): at most
/// two, of different families, each holding at least 8 addresses. The flag, the file and a
/// ServiceCIDR read from the cluster are all checked here.
pub fn validate_ranges(ranges: &[IpNet]) -> Result<(), RangeError> {
    if ranges.len() > 2 {
        return Err(RangeError::TooMany(ranges.len()));
    }
    if let [first, second] = ranges
        && IpFamily::of_net(first) == IpFamily::of_net(second)
    {
        return Err(RangeError::SameFamily(*first, *second));
    }
    match ranges
        .iter()
        .find(|range| ServiceRange::new(**range).total_size() < 8)
    {
        Some(range) => Err(RangeError::TooSmall(*range)),
        None => Ok(()),
    }
}

/// The ranges of a ServiceCIDR's `spec.cidrs`, checked as a configured range would be.
fn ranges_of(cidrs: &[String]) -> Result<Vec<IpNet>, RangeError> {
    let unusable = |why: String| RangeError::Unusable {
        cidrs: cidrs.to_vec(),
        why,
    };
    if cidrs.is_empty() {
        return Err(unusable("no ranges".to_owned()));
    }
    let ranges = cidrs
        .iter()
        .map(|cidr| {
            cidr.parse::<IpNet>()
                .map(|net| net.trunc())
                .map_err(|_| unusable(format!("{cidr:?} is not a CIDR")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    validate_ranges(&ranges).map_err(|err| unusable(err.to_string()))?;
    Ok(ranges)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn two_ranges_of_one_family_or_a_tiny_range_are_refused() {
        let message = validate_ranges(&[
            "10.0.0.0/24".parse().unwrap(),
            "10.1.0.0/24".parse().unwrap(),
        ])
        .unwrap_err()
        .to_string();
        assert!(message.contains("two IPv4 ranges"), "{message}");
        assert!(
            validate_ranges(&["10.0.0.0/30".parse().unwrap()])
                .unwrap_err()
                .to_string()
                .contains("fewer than 8")
        );
    }

    #[test]
    fn a_service_cidrs_ranges_are_checked_as_configured_ones() {
        let ok = ranges_of(&["10.43.0.0/16".to_owned(), "fd00:43::/112".to_owned()]).unwrap();
        assert_eq!(ok.len(), 2);
        for bad in [
            vec![],
            vec!["banana".to_owned()],
            vec!["10.43.0.0/16".to_owned(), "10.44.0.0/16".to_owned()],
        ] {
            let err = ranges_of(&bad).unwrap_err().to_string();
            assert!(err.contains("serviceClusterIPRange"), "{err}");
        }
    }

    #[test]
    fn the_refusal_names_the_setting_and_the_flag() {
        let err = LoopError::from(RangeError::Unknown {
            hint: "; the default/kubernetes Service's ClusterIP 10.43.0.1 shows an IPv4 range, \
                   but not its size"
                .to_owned(),
        });
        let text = err.to_string();
        assert!(matches!(err, LoopError::Invalid(_)));
        for part in [
            "serviceClusterIPRange is not set",
            "--service-cluster-ip-range",
            "10.43.0.1 shows an IPv4 range",
        ] {
            assert!(text.contains(part), "{text}");
        }
        assert!(LoopError::from(RangeError::NotYet).not_yet().is_some());
    }
}

//! Which changes of the membership Leases wake the endpoints loop: the Lease watch as a
//! trigger, minus plain renewals.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::watcher;

use super::lease::MemberLease;
use crate::budget::{CacheError, CacheEvent};
use crate::contract::Trigger;
use crate::watch_cache::Lenient;

/// The Lease watch as a trigger, minus plain renewals: with N members a renewal arrives every
/// interval/N, and each would cost the leader a pass that finds nothing. A Lease fires when it
/// appears, goes, changes address, or is renewed after it had expired (a member coming back).
pub(super) fn lease_trigger<S>(stream: S, fallback_ttl: Duration) -> Trigger
where
    S: futures::Stream<Item = CacheEvent<Lenient<MemberLease>>> + Send + 'static,
{
    let mut seen: BTreeMap<String, (IpAddr, Timestamp)> = BTreeMap::new();
    stream
        .filter_map(move |event| {
            let fire = match event {
                Ok(watcher::Event::Init) => {
                    seen.clear();
                    false
                }
                Ok(watcher::Event::InitApply(Lenient(lease))) => {
                    if let (Some(name), Ok(member)) = (
                        lease.metadata.name.clone(),
                        super::lease::observe(&lease, fallback_ttl),
                    ) {
                        seen.insert(name, (member.address, member.expires));
                    }
                    false
                }
                Ok(watcher::Event::InitDone) => true,
                Ok(watcher::Event::Apply(Lenient(lease))) => {
                    let name = lease.metadata.name.clone().unwrap_or_default();
                    match super::lease::observe(&lease, fallback_ttl) {
                        Ok(member) => {
                            let before = seen.insert(name, (member.address, member.expires));
                            match before {
                                Some((address, expires)) => {
                                    address != member.address || expires <= Timestamp::now()
                                }
                                None => true,
                            }
                        }
                        Err(_) => seen.remove(&name).is_some(),
                    }
                }
                Ok(watcher::Event::Delete(Lenient(lease))) => {
                    seen.remove(&lease.metadata.name.clone().unwrap_or_default());
                    true
                }
                // The cache emptied or lost an event: the pass reads the API instead.
                Err(CacheError::OverBudget(_) | CacheError::Lost { .. }) => {
                    seen.clear();
                    true
                }
                Err(err) => {
                    tracing::debug!(error = %err, "Lease watch failed; retrying with backoff");
                    false
                }
            };
            futures::future::ready(fire.then_some(()))
        })
        .boxed()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::apiserver_endpoints::lease::OwnLease;

    fn lease(ip: &str, renewed: Timestamp) -> Lenient<MemberLease> {
        Lenient(MemberLease(
            OwnLease {
                namespace: "kube-system".into(),
                service_name: "kubernetes".into(),
                address: ip.parse().unwrap(),
                port: 6443,
                holder: "t".into(),
                ttl: Duration::from_secs(15),
            }
            .renewed(None, renewed),
        ))
    }

    #[tokio::test]
    async fn lease_trigger_ignores_plain_renewals() {
        let now = Timestamp::now();
        let long_ago = Timestamp::from_second(1_600_000_000).unwrap();
        let events = vec![
            watcher::Event::Init,
            watcher::Event::InitApply(lease("192.0.2.1", now)),
            watcher::Event::InitApply(lease("192.0.2.2", long_ago)),
            watcher::Event::InitDone,
            // 1: plain renewal -> nothing.
            watcher::Event::Apply(lease("192.0.2.1", now)),
            // 2: renewal of an expired member (it comes back) -> fires.
            watcher::Event::Apply(lease("192.0.2.2", now)),
            // 3: a new member -> fires.
            watcher::Event::Apply(lease("192.0.2.3", now)),
            // 4: a member goes -> fires.
            watcher::Event::Delete(lease("192.0.2.1", now)),
        ];
        let events = events.into_iter().map(Ok::<_, CacheError>);
        let fired: Vec<()> = lease_trigger(futures::stream::iter(events), Duration::from_secs(15))
            .collect()
            .await;
        // InitDone + expired-renewed + new + deleted.
        assert_eq!(fired.len(), 4);
    }
}

//! The live read that confirms a cached record before the repairs act on it: a watch may be
//! behind (or may have lost an event), so a Service the cache still holds can be gone. Upstream's
//! `repairip.go` (`syncService`) and the legacy repairs in `ipallocator/controller/repair.go` and
//! `portallocator/controller/repair.go` walk what the API holds; from outside, the cache stands in
//! for that walk, and one GET of the Service checks it before a write or a report rests on it.

use kube::{Api, Client};

use super::record::{ServiceObject, ServiceRecord, Token};

/// What a live read says of a cached Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Liveness {
    /// The Service exists as the same object (uid) and still holds what the cache says.
    Holds,
    /// The cache is behind: the Service is gone, is another object of the same name, or no
    /// longer holds it. The sentence says which.
    Disproved(String),
}

/// The Service `namespace/name` read live, decoded as the cache decodes it; `None` if it does
/// not exist.
pub async fn read(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<ServiceRecord>, kube::Error> {
    let service = Api::<ServiceObject>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await?;
    Ok(service.as_ref().map(ServiceRecord::from))
}

/// Whether the Service `namespace/name` of uid `uid` (empty: any) still exists and `holds`
/// (lists the IP, holds the port) when read live.
pub async fn confirm(
    client: &Client,
    namespace: &str,
    name: &str,
    uid: &Token,
    holds: impl Fn(&ServiceRecord) -> bool,
) -> Result<Liveness, kube::Error> {
    let service = read(client, namespace, name).await?;
    Ok(judge(namespace, name, uid, service.as_ref(), holds))
}

/// The verdict of [`confirm`] on what the live read returned.
pub fn judge(
    namespace: &str,
    name: &str,
    uid: &Token,
    live: Option<&ServiceRecord>,
    holds: impl Fn(&ServiceRecord) -> bool,
) -> Liveness {
    let Some(live) = live else {
        return Liveness::Disproved(format!("Service {namespace}/{name} no longer exists"));
    };
    let any_uid = uid.to_string().is_empty();
    if !any_uid && live.uid != *uid {
        return Liveness::Disproved(format!(
            "Service {namespace}/{name} was replaced (uid {} instead of {uid})",
            live.uid
        ));
    }
    if holds(live) {
        Liveness::Holds
    } else {
        Liveness::Disproved(format!("Service {namespace}/{name} no longer holds it"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn record(uid: &str, ip: &str) -> ServiceRecord {
        ServiceRecord::from(
            &serde_json::from_value::<ServiceObject>(serde_json::json!({
                "metadata": {"name": "s", "namespace": "d", "uid": uid},
                "spec": {"clusterIP": ip, "clusterIPs": [ip]},
            }))
            .unwrap(),
        )
    }

    #[test]
    fn only_the_same_service_still_holding_it_confirms() {
        let ip = "192.0.2.5".parse().unwrap();
        let lists = |svc: &ServiceRecord| svc.lists_ip(ip);
        let cached = Token::new("uid-1");
        let same = record("uid-1", "192.0.2.5");
        assert_eq!(
            judge("d", "s", &cached, Some(&same), lists),
            Liveness::Holds
        );
        assert_eq!(
            judge("d", "s", &Token::new(""), Some(&same), lists),
            Liveness::Holds
        );
        for live in [
            None,
            Some(record("uid-2", "192.0.2.5")),
            Some(record("uid-1", "192.0.2.6")),
        ] {
            assert!(
                matches!(
                    judge("d", "s", &cached, live.as_ref(), lists),
                    Liveness::Disproved(_)
                ),
                "{live:?}"
            );
        }
    }
}

//! The loop's writes and the live reads that guard them: IPAddresses created and deleted by
//! compare-and-swap, each write and each report confirmed against the Service read live;
//! events' references and the drift each finding is reported as.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::networking::v1::{IPAddress, IPAddressSpec, ParentReference};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{DeleteParams, ListParams, PostParams, Preconditions};
use kube::{Api, Client};

use super::model::{self, IPALLOCATOR_MANAGER, LABEL_IP_FAMILY, LABEL_MANAGED_BY};
use super::plan::{Finding, Regarding, Repair};
use crate::alloc::IpFamily;
use crate::contract::{Action, Drift, LoopError};
use crate::service_cache::live::{self, Liveness};
use crate::service_cache::record::ServiceRecord;
use crate::service_cache::record::ServiceRef;

pub(super) enum Outcome {
    Done,
    DryRun,
    /// Nothing to do after all (the cache was behind); not reported.
    Skip,
    Failed,
}

/// What a live read says of the ground a finding stands on.
pub(super) enum Verdict {
    Confirmed,
    /// The cache was behind: the finding is false, and neither reported nor acted on.
    Contradicted(String),
    /// The live read failed: nothing is known.
    Unknown(String),
}

fn unknown(namespace: &str, name: &str, err: &kube::Error) -> Verdict {
    Verdict::Unknown(format!("cannot read Service {namespace}/{name}: {err}"))
}

/// Reads the Service a finding is about live: the finding stands only if it exists as the same
/// object (`uid`) and `holds` still holds of it.
async fn confirm(
    client: &Client,
    service: &ServiceRef,
    holds: impl Fn(&ServiceRecord) -> bool,
) -> Verdict {
    let ServiceRef {
        namespace,
        name,
        uid,
    } = service;
    match live::confirm(client, namespace, name, uid, holds).await {
        Ok(Liveness::Holds) => Verdict::Confirmed,
        Ok(Liveness::Disproved(why)) => Verdict::Contradicted(why),
        Err(err) => unknown(namespace, name, &err),
    }
}

/// Checks a finding against the API before it is reported or acted on, as upstream's
/// `repairip.go` does with its informer and a live read: every write for a Service (a create,
/// the create of a recreate) and every report about one needs the Service to exist as the
/// object the cache saw and still list the IP; every delete needs the Service the IPAddress
/// names to be gone or not to list it.
pub(super) async fn verify(client: &Client, finding: &Finding) -> Verdict {
    match &finding.repair {
        Repair::None => match &finding.regarding {
            // A report rests on the Service as the cache held it; one that is gone (or another
            // object now) has nothing to report.
            Regarding::Service(service) => {
                let Some(other) = &finding.shared_with else {
                    return confirm(client, service, |_| true).await;
                };
                // A duplicate needs both Services still holding the IP.
                let ip = other.ip;
                let verdict = confirm(client, service, |svc| svc.lists_ip(ip)).await;
                if !matches!(verdict, Verdict::Confirmed) {
                    return verdict;
                }
                confirm(client, &other.service, |svc| svc.lists_ip(ip)).await
            }
            Regarding::IpAddress { .. } => Verdict::Confirmed,
        },
        Repair::Create { ip, owner } => {
            let ip = *ip;
            let verdict = confirm(client, owner, |svc| svc.lists_ip(ip)).await;
            if !matches!(verdict, Verdict::Confirmed) {
                return verdict;
            }
            unallocated(client, ip).await
        }
        Repair::Recreate {
            ip,
            owner,
            dangling_parent,
            ..
        } => {
            let verdict = confirm(client, owner, |svc| svc.lists_ip(*ip)).await;
            match dangling_parent {
                Some(parent) if matches!(verdict, Verdict::Confirmed) => {
                    does_not_list(client, parent, *ip).await
                }
                _ => verdict,
            }
        }
        Repair::Delete { name, parent, .. } => match (parent, name.parse::<IpAddr>()) {
            (Some(parent), Ok(ip)) => does_not_list(client, parent, ip).await,
            // A parent that is no Service is one whatever the Services are, and no Service can
            // list a name that is no IP.
            _ => Verdict::Confirmed,
        },
    }
}

/// Whether `ip` has no IPAddress, read live: kube-apiserver writes the IPAddress just before
/// the Service, and the two arrive on different watches, so the Service's may come first.
/// Listed by name (the IPAddress cache's grant), not read with a GET.
async fn unallocated(client: &Client, ip: IpAddr) -> Verdict {
    let api: Api<IPAddress> = Api::all(client.clone());
    let by_name = ListParams::default().fields(&format!("metadata.name={ip}"));
    match api.list(&by_name).await {
        Ok(list) if list.items.is_empty() => Verdict::Confirmed,
        Ok(_) => Verdict::Contradicted(format!("IPAddress {ip} exists")),
        Err(err) => Verdict::Unknown(format!("cannot list IPAddress {ip}: {err}")),
    }
}

/// Whether `parent`, read live, is gone or does not list `ip`.
async fn does_not_list(client: &Client, parent: &ServiceRef, ip: IpAddr) -> Verdict {
    match live::read(client, &parent.namespace, &parent.name).await {
        Ok(Some(service)) if service.lists_ip(ip) => Verdict::Contradicted(format!(
            "Service {}/{} exists and lists {ip}, but the Service cache did not show it",
            parent.namespace, parent.name
        )),
        Ok(_) => Verdict::Confirmed,
        Err(err) => unknown(&parent.namespace, &parent.name, &err),
    }
}

/// Deletes the IPAddress if it is still the object the decision saw. `Ok(false)` when it is
/// gone or changed since (the next pass decides again).
/// Creates the IPAddress for `owner`. A 409 means the IPAddress cache was behind and it exists
/// already: skip, and let the next pass look again.
pub(super) async fn create_ip_address(
    ip_api: &Api<IPAddress>,
    ip: IpAddr,
    owner: &ServiceRef,
) -> Result<Outcome, LoopError> {
    match ip_api
        .create(&PostParams::default(), &new_ip_address(ip, owner))
        .await
    {
        Ok(_) => Ok(Outcome::Done),
        Err(kube::Error::Api(status)) if status.code == 409 => Ok(Outcome::Skip),
        Err(err) => Err(err.into()),
    }
}

pub(super) async fn delete_ip_address(
    api: &Api<IPAddress>,
    name: &str,
    existing: &model::ObjectVersion,
) -> Result<bool, LoopError> {
    let params = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some(existing.uid.to_string()),
            resource_version: Some(existing.resource_version.to_string()),
        }),
        ..DeleteParams::default()
    };
    match api.delete(name, &params).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(false),
        Err(err) => Err(err.into()),
    }
}

/// The IPAddress upstream's allocator writes for `ip` of `owner` (`newIPAddress`).
pub fn new_ip_address(ip: IpAddr, owner: &ServiceRef) -> IPAddress {
    IPAddress {
        metadata: ObjectMeta {
            name: Some(ip.to_string()),
            labels: Some(BTreeMap::from([
                (
                    LABEL_IP_FAMILY.to_owned(),
                    IpFamily::of(ip).as_str().to_owned(),
                ),
                (LABEL_MANAGED_BY.to_owned(), IPALLOCATOR_MANAGER.to_owned()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(IPAddressSpec {
            parent_ref: ParentReference {
                group: Some(String::new()),
                resource: "services".to_owned(),
                namespace: Some(owner.namespace.to_string()),
                name: owner.name.to_string(),
            },
        }),
    }
}

pub(super) fn object_reference(regarding: &Regarding) -> ObjectReference {
    match regarding {
        Regarding::Service(service) => crate::events::service_reference(service),
        Regarding::IpAddress { name, uid } => ObjectReference {
            api_version: Some("networking.k8s.io/v1".to_owned()),
            kind: Some("IPAddress".to_owned()),
            name: Some(name.to_string()),
            uid: Some(uid.to_string()).filter(|uid| !uid.is_empty()),
            ..ObjectReference::default()
        },
    }
}

/// The drift a finding is reported as, its action the write its repair makes.
pub(super) fn drift_of(finding: &Finding, applied: bool, note: Option<String>) -> Drift {
    let action = match finding.repair {
        Repair::None => Action::Report,
        Repair::Create { .. } => Action::Create,
        Repair::Recreate { .. } => Action::Update,
        Repair::Delete { .. } => Action::Delete,
    };
    let mut message = finding.summary();
    if let Some(note) = note {
        message.push_str(" (");
        message.push_str(&note);
        message.push(')');
    }
    let drift = crate::contract::drift(
        finding.problem.drift_kind(),
        finding.regarding.object(),
        action,
        message,
        applied,
    );
    match finding.change() {
        Some(change) => drift.changed(change.was, change.became),
        None => drift,
    }
}

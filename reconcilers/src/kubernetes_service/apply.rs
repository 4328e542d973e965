//! The writes of a [`Plan`]: each made unless the pass is a dry run, with its event, metric and
//! log, and every drift put in the pass's report with what was done about it. A write the API
//! refuses as invalid (422: a cluster IP or node port another Service holds, say) cannot succeed
//! by retrying it, so it is not an error of the pass: it is returned, and the loop reports it
//! once while it lasts.

use std::ops::ControlFlow;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::networking::v1::IPAddress;
use kube::api::{Api, DeleteParams, ListParams, PostParams, Preconditions};
use kube::runtime::events::EventType;

use super::metrics::KubernetesServiceMetrics;
use super::plan::{Plan, ServiceDrift, desired_service};
use super::{KubernetesServiceLoop, Refusal};
use crate::contract::{
    Action, Drift, LoopError, PassContext, PassReport, drift, ignore_already_exists,
};
use crate::section::Settings;
use crate::service_cache::FreshList;

impl KubernetesServiceLoop {
    /// What a pass did: its report, and the writes the API refused in it.
    pub(super) async fn apply(
        &self,
        ctx: &PassContext,
        settings: &Settings,
        plan: Plan,
    ) -> Result<(PassReport, Vec<Refusal>), LoopError> {
        let section = &self.section;
        let api: Api<Service> = Api::namespaced(ctx.client.clone(), &section.namespace);
        let mut report = PassReport::default();
        let object = section.object_ref();
        let refused = match plan {
            Plan::MissingUnknownRange(why) => {
                report.push(drift(
                    "service_missing",
                    object,
                    Action::Create,
                    format!("the Service does not exist; not created: {why}"),
                    false,
                ));
                Vec::new()
            }
            Plan::Create(want) => {
                Vec::from_iter(self.create(ctx, &api, &object, &want, &mut report).await?)
            }
            Plan::Existing {
                existing,
                drift,
                repaired,
                mismatch,
                recreate,
            } => {
                let refused = self
                    .repair(ctx, &api, &object, &existing, drift, repaired, &mut report)
                    .await?;
                let recreate_refused = self
                    .cluster_ip(
                        ctx,
                        &api,
                        settings,
                        &existing,
                        mismatch,
                        recreate,
                        &mut report,
                    )
                    .await?;
                refused.into_iter().chain(recreate_refused).collect()
            }
        };
        Ok((report, refused))
    }

    async fn create(
        &self,
        ctx: &PassContext,
        api: &Api<Service>,
        object: &str,
        want: &Service,
        report: &mut PassReport,
    ) -> Result<Option<Refusal>, LoopError> {
        let mut refused = None;
        let mut applied = false;
        if !ctx.dry_run {
            let created = match ignore_already_exists(
                api.create(&PostParams::default(), want).await,
            ) {
                // Its cluster IP taken or outside the range the apiserver serves: nothing this
                // loop can change, so reported rather than failed.
                Err(kube::Error::Api(status)) if status.code == 422 => {
                    refused = Some(Refusal {
                        kinds: vec!["service_missing"],
                        message: status.message.clone(),
                    });
                    None
                }
                // Another writer (kube-apiserver starting, say) created it after the cache
                // looked: it was not missing, and the next pass judges it as it is.
                Ok(None) => {
                    tracing::info!(service = %object, "the kubernetes Service was created by another writer meanwhile; judged next pass");
                    return Ok(None);
                }
                other => other?,
            };
            applied = created.is_some();
            if let Some(created) = &created {
                self.service.written(created.clone());
                KubernetesServiceMetrics::count(&self.metrics.repairs, &["service_missing"]);
                self.publish(
                    created,
                    EventType::Normal,
                    "KubernetesServiceCreated",
                    format!("created {object}"),
                )
                .await;
            }
        }
        report.push(
            drift(
                "service_missing",
                object.to_owned(),
                Action::Create,
                match (&refused, applied) {
                    (Some(refusal), _) => format!(
                        "the Service does not exist; the API refused to create it: {}",
                        refusal.message
                    ),
                    (None, true) => "the Service does not exist; created it".to_owned(),
                    (None, false) => "the Service does not exist; would create it".to_owned(),
                },
                applied,
            )
            .changed("absent", "created as kube-apiserver creates it"),
        );
        Ok(refused)
    }

    /// The repairable drift: one update when the policy repairs, a report line per drift.
    #[allow(clippy::too_many_arguments)]
    async fn repair(
        &self,
        ctx: &PassContext,
        api: &Api<Service>,
        object: &str,
        existing: &Service,
        found: Vec<ServiceDrift>,
        repaired: Option<Box<Service>>,
        report: &mut PassReport,
    ) -> Result<Option<Refusal>, LoopError> {
        if found.is_empty() {
            return Ok(None);
        }
        let repair = repaired.is_some();
        let mut refused = None;
        let mut applied = false;
        if let Some(repaired) = repaired.filter(|_| !ctx.dry_run) {
            let name = existing.metadata.name.clone().unwrap_or_default();
            match api.replace(&name, &PostParams::default(), &repaired).await {
                Ok(replaced) => {
                    self.service.written(replaced);
                    applied = true;
                }
                // Refused as invalid (a node port another Service holds, say): retrying the
                // same write cannot help, so it is reported, not failed, and not a repair.
                Err(kube::Error::Api(status)) if status.code == 422 => {
                    refused = Some(Refusal {
                        kinds: found.iter().map(ServiceDrift::kind).collect(),
                        message: status.message.clone(),
                    });
                }
                Err(err) => return Err(err.into()),
            }
        }
        if applied {
            let kinds: Vec<&str> = found.iter().map(ServiceDrift::kind).collect();
            KubernetesServiceMetrics::count(&self.metrics.repairs, &kinds);
            let note = found
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; ");
            tracing::warn!(service = %object, drift = %note, "repaired the kubernetes Service");
            self.publish(
                existing,
                EventType::Normal,
                "KubernetesServiceRepaired",
                format!("repaired: {note}"),
            )
            .await;
        }
        for d in found {
            let message = match (repair, applied, &refused) {
                (true, _, Some(refusal)) => {
                    format!("{d}; the API refused the repair: {}", refusal.message)
                }
                (true, true, None) => format!("{d}; repaired"),
                (true, false, None) => format!("{d}; would repair"),
                (false, _, _) => format!("{d}; not repaired (repair policy is off)"),
            };
            report.push(
                drift(
                    d.kind(),
                    object.to_owned(),
                    if repair {
                        Action::Update
                    } else {
                        Action::Report
                    },
                    message,
                    applied,
                )
                .changed(d.to_string(), "as kube-apiserver creates it"),
            );
        }
        Ok(refused)
    }

    /// The clusterIP: immutable, so reported once per Service (uid) and mismatch, or (opted in) the
    /// Service deleted, by its uid and resourceVersion, and created anew.
    #[allow(clippy::too_many_arguments)]
    async fn cluster_ip(
        &self,
        ctx: &PassContext,
        api: &Api<Service>,
        settings: &Settings,
        existing: &Service,
        mismatch: Option<ServiceDrift>,
        recreate: bool,
        report: &mut PassReport,
    ) -> Result<Option<Refusal>, LoopError> {
        let object = self.section.object_ref();
        self.metrics
            .cluster_ip_mismatch
            .set(i64::from(mismatch.is_some()));
        let Some(mismatch) = mismatch else {
            self.mismatches.update(None);
            return Ok(None);
        };

        if recreate {
            let (drift, refused) = self
                .recreate(ctx, api, settings, existing, &mismatch)
                .await?;
            report.push(drift);
            return Ok(refused);
        }

        // Keyed by the Service's uid and the text, which names the IPs found and wanted: a
        // Service deleted and created again with the same wrong IP is a new finding.
        let uid = existing.metadata.uid.as_deref().unwrap_or_default();
        if !self
            .mismatches
            .update([format!("{uid} {mismatch}")])
            .is_empty()
        {
            tracing::warn!(service = %object, drift = %mismatch, "the kubernetes Service has the wrong clusterIP");
            if !ctx.dry_run {
                self.publish(
                    existing,
                    EventType::Warning,
                    "ClusterIPMismatch",
                    format!(
                        "{mismatch}: delete the Service to have it recreated, or set recreateOnClusterIPMismatch"
                    ),
                )
                .await;
            }
        }
        report.push(drift(
            mismatch.kind(),
            object,
            Action::Report,
            format!(
                "{mismatch}; reported only (delete the Service, or enable recreateOnClusterIPMismatch)"
            ),
            false,
        ));
        Ok(None)
    }

    /// The Service deleted, by its uid and resourceVersion, and created anew to get the desired
    /// clusterIP (`recreateOnClusterIPMismatch`); the drift it is reported as, and the write the
    /// API refused, if any. It is deleted only once the API shows it would take the new one
    /// ([`Self::refusal_of_copy`]): deleted on a guess, it could stay missing for good.
    async fn recreate(
        &self,
        ctx: &PassContext,
        api: &Api<Service>,
        settings: &Settings,
        existing: &Service,
        mismatch: &ServiceDrift,
    ) -> Result<(Drift, Option<Refusal>), LoopError> {
        let want = desired_service(&self.section, settings, Some(existing));
        let refusal = |message: String| Refusal {
            kinds: vec![mismatch.kind()],
            message,
        };
        // What kept it from being recreated (none once it is), and the refusal among those.
        let (kept, refused) = if ctx.dry_run {
            (
                Some("would delete and recreate the Service".to_owned()),
                None,
            )
        } else if let Some(why) = self.refusal_of_copy(api, existing, &want).await? {
            let why = format!(
                "not deleted, as the API would refuse to create it at that clusterIP: {why}"
            );
            (Some(why.clone()), Some(refusal(why)))
        } else {
            api.delete(
                &self.section.name,
                &DeleteParams::default().preconditions(Preconditions {
                    uid: existing.metadata.uid.clone(),
                    resource_version: existing.metadata.resource_version.clone(),
                }),
            )
            .await?;
            match ignore_already_exists(api.create(&PostParams::default(), &want).await) {
                Ok(Some(created)) => {
                    self.service.written(created);
                    (None, None)
                }
                // A finalizer holds the deleted Service: a later pass creates it once it is gone.
                Ok(None) => (
                    Some("deleted the Service, which is still being removed".to_owned()),
                    None,
                ),
                // Taken since the dry run: the next passes report the Service missing.
                Err(kube::Error::Api(status)) if status.code == 422 => {
                    let why = format!(
                        "deleted the Service, but the API refused to create it: {}",
                        causes(&status)
                    );
                    (Some(why.clone()), Some(refusal(why)))
                }
                Err(err) => return Err(err.into()),
            }
        };
        let applied = kept.is_none();
        if applied {
            KubernetesServiceMetrics::count(&self.metrics.repairs, &[mismatch.kind()]);
            self.publish(
                existing,
                EventType::Warning,
                "KubernetesServiceRecreated",
                format!(
                    "{mismatch}; deleted and recreated the Service (recreateOnClusterIPMismatch)"
                ),
            )
            .await;
        }
        let (was, became) = match mismatch {
            ServiceDrift::ClusterIp { found, want } => (
                format!("clusterIPs [{}]", found.join(", ")),
                format!("recreated to get clusterIPs [{}]", want.join(", ")),
            ),
            other => (other.to_string(), "recreated".to_owned()),
        };
        let done = kept.unwrap_or_else(|| "deleted and recreated the Service".to_owned());
        Ok((
            drift(
                mismatch.kind(),
                self.section.object_ref(),
                Action::Delete,
                format!("{mismatch}; {done} (recreateOnClusterIPMismatch)"),
                applied,
            )
            .changed(was, became),
            refused,
        ))
    }

    /// Why the API would refuse `want`: its clusterIP held by another Service or IPAddress
    /// ([`Self::holder_of`]), or outside the range kube-apiserver serves (422 to a dry-run create
    /// of a copy under a generated name, without the node ports `existing` holds, free once it is
    /// deleted).
    async fn refusal_of_copy(
        &self,
        api: &Api<Service>,
        existing: &Service,
        want: &Service,
    ) -> Result<Option<String>, LoopError> {
        if let Some(holder) = self.holder_of(want).await? {
            return Ok(Some(holder));
        }
        let held: Vec<i32> = (existing.spec.iter())
            .flat_map(|spec| spec.ports.iter().flatten())
            .filter_map(|port| port.node_port)
            .collect();
        let mut copy = want.clone();
        copy.metadata.generate_name = copy.metadata.name.take().map(|name| format!("{name}-"));
        for port in (copy.spec.iter_mut()).flat_map(|spec| spec.ports.iter_mut().flatten()) {
            port.node_port = port.node_port.filter(|node_port| !held.contains(node_port));
        }
        let dry_run = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        match api.create(&dry_run, &copy).await {
            Ok(_) => Ok(None),
            Err(kube::Error::Api(status)) if status.code == 422 => Ok(Some(causes(&status))),
            Err(err) => Err(err.into()),
        }
    }
}

impl KubernetesServiceLoop {
    /// Who else holds one of `want`'s clusterIPs, read live: kube-apiserver's dry-run create
    /// checks only that an IP lies in its range (its dry-run allocators look at nothing
    /// allocated), so the Services and, where they are served, the IPAddresses are looked at
    /// here. Every Service is listed, as a cache may lag; a holder found is believed for the
    /// loop's interval, so passes woken meanwhile list nothing.
    async fn holder_of(&self, want: &Service) -> Result<Option<String>, LoopError> {
        let now = tokio::time::Instant::now();
        {
            let known = self.holder.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, holder)) = known.as_ref()
                && now.duration_since(*at) < self.section.interval
            {
                return Ok(Some(holder.clone()));
            }
        }
        let holder = self.holder_listed(want).await?;
        *self.holder.lock().unwrap_or_else(|p| p.into_inner()) =
            holder.clone().map(|holder| (now, holder));
        Ok(holder)
    }

    /// [`Self::holder_of`], read now.
    async fn holder_listed(&self, want: &Service) -> Result<Option<String>, LoopError> {
        let mut wanted: Vec<std::net::IpAddr> = (want.spec.iter())
            .flat_map(|spec| spec.cluster_ips.iter().flatten().chain(&spec.cluster_ip))
            .filter_map(|ip| ip.parse().ok())
            .collect();
        wanted.dedup();
        let fresh_list = FreshList {
            page_size: HOLDER_PAGE,
            budget: self.services.budget().clone(),
        };
        let (namespace, name) = (&self.section.namespace, &self.section.name);
        let mut holder = None;
        (fresh_list.each(&self.client, |svc| {
            if (&*svc.namespace, &*svc.name) == (namespace.as_str(), name.as_str()) {
                return ControlFlow::Continue(());
            }
            let Some(ip) = wanted.iter().find(|ip| svc.lists_ip(**ip)) else {
                return ControlFlow::Continue(());
            };
            holder = Some(format!(
                "{ip} is held by Service {}/{}",
                svc.namespace, svc.name
            ));
            ControlFlow::Break(())
        }))
        .await?;
        if holder.is_some() {
            return Ok(holder);
        }
        let addresses: Api<IPAddress> = Api::all(self.client.clone());
        for ip in &wanted {
            let by_name = ListParams::default().fields(&format!("metadata.name={ip}"));
            match addresses.list(&by_name).await {
                // The Service's own IPAddress (a dual-stack Service's secondary IP, wanted as
                // the primary) is released with it: no other holder.
                Ok(list) if list.items.iter().all(|a| self.is_own(a)) => {}
                Ok(_) => return Ok(Some(format!("{ip} has an IPAddress object"))),
                // A cluster before 1.33 serves no IPAddress API.
                Err(kube::Error::Api(status)) if status.code == 404 => {}
                Err(err) => return Err(err.into()),
            }
        }
        Ok(None)
    }
}

impl KubernetesServiceLoop {
    /// Whether `address` is allocated to this loop's Service (its `parentRef`).
    fn is_own(&self, address: &IPAddress) -> bool {
        address.spec.as_ref().is_some_and(|spec| {
            let parent = &spec.parent_ref;
            parent.group.as_deref().unwrap_or_default().is_empty()
                && parent.resource == "services"
                && parent.namespace.as_deref() == Some(self.section.namespace.as_str())
                && parent.name == self.section.name
        })
    }
}

/// Services per page of [`KubernetesServiceLoop::holder_of`]'s list.
const HOLDER_PAGE: u32 = 500;

/// A refusal's causes (`field: message`, which never name the object, so a copy under a
/// generated name is refused in the same words each pass), else its message.
fn causes(status: &kube::core::Status) -> String {
    let causes: Vec<String> = (status.details.iter())
        .flat_map(|details| &details.causes)
        .map(|cause| format!("{}: {}", cause.field, cause.message))
        .collect();
    if causes.is_empty() {
        status.message.clone()
    } else {
        causes.join("; ")
    }
}

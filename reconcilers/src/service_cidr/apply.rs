//! The writes of a plan: the ServiceCIDR created or upgraded to dual-stack, its `Ready`
//! condition set, each unless the pass is a dry run, with upstream's events and the drift each
//! is reported as.

use std::sync::PoisonError;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use tracing::warn;

use super::plan::{Plan, go_list, is_event_reason, plan, ready_words};
use super::{CONTROLLER_NAME, ServiceCidrLoop};
use crate::contract::{
    Action, Drift, LoopError, PassContext, PassReport, drift, ignore_already_exists,
};
use crate::service_range::DEFAULT_SERVICE_CIDR;

const READY_MESSAGE: &str = "Kubernetes default Service CIDR is ready";
/// Upstream's reason for a write that failed.
const ERROR_REASON: &str = "KubernetesDefaultServiceCIDRError";
/// The reason of the `Ready=False` event when the condition's own is none an event can have.
const NOT_READY_REASON: &str = "KubernetesDefaultServiceCIDRNotReady";
/// events.k8s.io/v1 needs an action; upstream's core/v1 events have none.
const EVENT_ACTION: &str = "DefaultServiceCIDRSync";

/// The drift `kind` of the default ServiceCIDR, not (yet) repaired.
fn found(kind: &'static str, action: Action, message: String) -> Drift {
    let object = format!("ServiceCIDR/{DEFAULT_SERVICE_CIDR}");
    drift(kind, object, action, message, false)
}

/// What a write leaves for the status step.
enum Written {
    /// Nothing more this pass: a dry run, or no object to upgrade.
    Stop,
    /// The object as the write left it.
    Now(Box<Option<ServiceCIDR>>),
    /// No write was needed.
    Unchanged,
}

impl ServiceCidrLoop {
    /// Upstream's event for a failed `write`, published when the failure appears (which write,
    /// and the code and reason of the API's answer), not again while the retries fail alike.
    async fn failed(&self, write: &str, err: &kube::Error, note: String) {
        let how = match err {
            kube::Error::Api(status) => format!("{write}: {} {}", status.code, status.reason),
            _ => format!("{write}: no API status"),
        };
        let new = (self.failure.lock())
            .unwrap_or_else(PoisonError::into_inner)
            .is_new(&how);
        if new {
            self.event(EventType::Warning, ERROR_REASON, note).await;
        }
    }

    /// A repair made: `found` applied, with what it `was` and `became`, and its event (upstream's
    /// controller only logs these).
    async fn repaired(
        &self,
        reason: &str,
        found: Drift,
        was: String,
        became: String,
        report: &mut PassReport,
    ) {
        self.event(EventType::Normal, reason, found.message.clone())
            .await;
        let applied = Drift {
            applied: true,
            ..found
        };
        report.push(applied.changed(was, became));
    }

    async fn event(&self, type_: EventType, reason: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("networking.k8s.io/v1".to_owned()),
            kind: Some("ServiceCIDR".to_owned()),
            name: Some(DEFAULT_SERVICE_CIDR.to_owned()),
            ..ObjectReference::default()
        };
        // Logged there; the repair stands without its event.
        let _ = crate::events::emit_in(
            &self.recorder,
            &reference,
            type_,
            reason,
            EVENT_ACTION,
            &note,
        )
        .await;
    }

    pub(super) async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let mut report = PassReport::default();
        if !self.served().await? {
            return Ok(report);
        }
        let api: Api<ServiceCIDR> = Api::all(ctx.client.clone());
        let mut current = self.current(&api).await?;
        let written = match plan(current.as_ref(), &self.ranges) {
            Plan::Create => self.create(ctx, &api, &mut report).await?,
            Plan::UpgradeToDualStack => {
                (self.upgrade(ctx, &api, current.as_ref(), &mut report)).await?
            }
            _ => Written::Unchanged,
        };
        match written {
            Written::Stop => return Ok(report),
            Written::Now(now) => current = *now,
            Written::Unchanged => {}
        }
        self.sync_status(ctx, &api, current.as_ref(), &mut report)
            .await?;
        if !ctx.dry_run {
            (self.failure.lock())
                .unwrap_or_else(PoisonError::into_inner)
                .succeeded();
        }
        Ok(report)
    }

    /// Creates the default ServiceCIDR with the configured ranges.
    async fn create(
        &self,
        ctx: &PassContext,
        api: &Api<ServiceCIDR>,
        report: &mut PassReport,
    ) -> Result<Written, LoopError> {
        let desired = self.desired();
        let message = format!(
            "default ServiceCIDR is missing; creating it with CIDRs {}",
            go_list(&desired)
        );
        let missing = found("servicecidr_missing", Action::Create, message);
        if ctx.dry_run {
            report.push(missing);
            return Ok(Written::Stop);
        }
        let new = ServiceCIDR {
            metadata: ObjectMeta {
                name: Some(DEFAULT_SERVICE_CIDR.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceCIDRSpec {
                cidrs: Some(desired.clone()),
            }),
            status: None,
        };
        let created = match ignore_already_exists(api.create(&PostParams::default(), &new).await) {
            Ok(Some(created)) => {
                self.cidr.written(created.clone());
                created
            }
            // kube-apiserver 1.33+ creates it too, and the watch had not shown it yet: nothing
            // was repaired, and the status step takes the object as the watch has it.
            Ok(None) => return Ok(Written::Now(Box::new(self.current(api).await?))),
            Err(err) => {
                let note = "The default ServiceCIDR can not be created".to_owned();
                self.failed("create", &err, note).await;
                return Err(err.into());
            }
        };
        let became = format!("CIDRs {}", go_list(&desired));
        self.repaired(
            "DefaultServiceCIDRCreated",
            missing,
            "absent".to_owned(),
            became,
            report,
        )
        .await;
        Ok(Written::Now(Box::new(Some(created))))
    }

    /// Upgrades a single-stack default ServiceCIDR to the configured dual-stack ranges.
    async fn upgrade(
        &self,
        ctx: &PassContext,
        api: &Api<ServiceCIDR>,
        current: Option<&ServiceCIDR>,
        report: &mut PassReport,
    ) -> Result<Written, LoopError> {
        let desired = self.desired();
        let message = format!(
            "default ServiceCIDR is single-stack; upgrading it to dual-stack {}",
            go_list(&desired)
        );
        let single = found("servicecidr_single_stack", Action::Update, message);
        if ctx.dry_run {
            report.push(single);
            return Ok(Written::Stop);
        }
        let Some(mut upgraded) = current.cloned() else {
            return Ok(Written::Stop);
        };
        let was = upgraded
            .spec
            .as_ref()
            .and_then(|spec| spec.cidrs.clone())
            .unwrap_or_default();
        upgraded.spec = Some(ServiceCIDRSpec {
            cidrs: Some(desired.clone()),
        });
        match api
            .replace(DEFAULT_SERVICE_CIDR, &PostParams::default(), &upgraded)
            .await
        {
            Ok(updated) => {
                let (was, became) = (go_list(&was), go_list(&desired));
                let (was, became) = (format!("CIDRs {was}"), format!("CIDRs {became}"));
                self.repaired("DefaultServiceCIDRUpgraded", single, was, became, report)
                    .await;
                Ok(Written::Now(Box::new(Some(updated))))
            }
            Err(err) => {
                let note = format!(
                    "The default ServiceCIDR can not be upgraded from {} to dual stack {} : {err}",
                    desired.first().map_or("", String::as_str),
                    go_list(&desired)
                );
                self.failed("upgrade", &err, note).await;
                Err(err.into())
            }
        }
    }

    async fn sync_status(
        &self,
        ctx: &PassContext,
        api: &Api<ServiceCIDR>,
        current: Option<&ServiceCIDR>,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let plan = plan(current, &self.ranges);
        let note = match &plan {
            Plan::Inconsistent { actual } => format!(
                "The default ServiceCIDR {} does not match the controller flag configurations {}",
                go_list(actual),
                go_list(&self.desired())
            ),
            Plan::NotReady { message, .. } => format!("Configuration matches, but {message}"),
            _ => String::new(),
        };
        let condition = match &plan {
            Plan::Inconsistent { .. } => Some(note.clone()),
            Plan::NotReady { reason, .. } => Some(format!("{reason}: {note}")),
            _ => None,
        };
        // A dry run (`check`) reports without touching what the running loop has reported.
        let appeared = !ctx.dry_run && !self.reported.update(condition).is_empty();
        match plan {
            Plan::Inconsistent { .. } => {
                if appeared {
                    warn!(%note, "Inconsistent ServiceCIDR status");
                    let reason = "KubernetesDefaultServiceCIDRInconsistent";
                    self.event(EventType::Warning, reason, note.clone()).await;
                }
                report.push(found(
                    "servicecidr_inconsistent",
                    Action::Report,
                    format!("KubernetesDefaultServiceCIDRInconsistent: {note}"),
                ));
            }
            Plan::NotReady { reason, .. } => {
                if appeared {
                    warn!(%reason, %note, "The default ServiceCIDR is not ready");
                    if is_event_reason(&reason) {
                        self.event(EventType::Warning, &reason, note.clone()).await;
                    } else {
                        let reason = crate::sanitize::Sanitized::within(&reason, 128);
                        let quoted = format!("Ready=False (reason \"{reason}\"): {note}");
                        (self.event(EventType::Warning, NOT_READY_REASON, quoted)).await;
                    }
                }
                report.push(found("servicecidr_not_ready", Action::Report, note));
            }
            Plan::SetReady => self.set_ready(ctx, api, current, report).await?,
            Plan::Create | Plan::UpgradeToDualStack | Plan::Terminating | Plan::InSync => {}
        }
        Ok(())
    }

    /// Sets the `Ready=True` condition, as upstream applies it (server-side apply, no reason:
    /// ServiceCIDR status conditions are not validated for one).
    async fn set_ready(
        &self,
        ctx: &PassContext,
        api: &Api<ServiceCIDR>,
        current: Option<&ServiceCIDR>,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let message =
            "default ServiceCIDR matches the configuration; setting Ready=True".to_owned();
        let not_ready = found("servicecidr_not_ready", Action::Update, message);
        if ctx.dry_run {
            report.push(not_ready);
            return Ok(());
        }
        let now = jiff::Timestamp::now()
            .round(jiff::Unit::Second)
            .map_err(|e| LoopError::Other(e.to_string()))?;
        let status = serde_json::json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "ServiceCIDR",
            "metadata": {"name": DEFAULT_SERVICE_CIDR},
            "status": {"conditions": [{
                "type": "Ready",
                "status": "True",
                "message": READY_MESSAGE,
                "lastTransitionTime": now.to_string(),
            }]},
        });
        let params = PatchParams::apply(CONTROLLER_NAME).force();
        match api
            .patch_status(DEFAULT_SERVICE_CIDR, &params, &Patch::Apply(&status))
            .await
        {
            Ok(patched) => self.cidr.written(patched),
            Err(err) => {
                let note = "The default ServiceCIDR Status can not be set to Ready=True".to_owned();
                self.failed("status", &err, note).await;
                return Err(err.into());
            }
        }
        let became = "condition Ready=True".to_owned();
        self.repaired(
            "DefaultServiceCIDRReady",
            not_ready,
            ready_words(current),
            became,
            report,
        )
        .await;
        Ok(())
    }
}

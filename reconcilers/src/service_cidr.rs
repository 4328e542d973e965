//! Loop: the default ServiceCIDR `kubernetes`.
//!
//! Upstream (`pkg/controlplane/controller/defaultservicecidr`) makes sure the ServiceCIDR
//! `kubernetes` exists with `spec.cidrs` = the API server's service range(s) in family order,
//! upgrades it from single- to dual-stack when a secondary range is added and the primary
//! matches, and sets `Ready=True` when it matches. A mismatch is reported once and never
//! "fixed": reverting a range could strand allocated IPs, so it is never deleted or shrunk
//! either. We keep all of that; the ClusterIP repair waits for this object.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::Retryable;
use futures::StreamExt;
use futures::future::BoxFuture;
use ipnet::IpNet;
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::networking::v1::{ServiceCIDR, ServiceCIDRSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::Trigger;
use crate::contract::{Action, LoopError, PassContext, PassReport, Reconciler, drift};
use crate::findings::ReportOnce;
use crate::section::{
    BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
    validate_interval,
};
use crate::service_range::{DEFAULT_SERVICE_CIDR, validate_ranges};
use crate::watch_cache::{WatchCache, watch_trigger};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "service-cidr";

/// Upstream's controller name: field manager of the status and reporting controller of events.
pub const CONTROLLER_NAME: &str = "kubernetes-service-cidr-controller";
const READY_MESSAGE: &str = "Kubernetes default Service CIDR is ready";
/// events.k8s.io/v1 needs an action; upstream's core/v1 events have none.
const EVENT_ACTION: &str = "DefaultServiceCIDRSync";

/// Configuration of the default ServiceCIDR loop (`loops.serviceCIDR`).
#[derive(Clone, Debug)]
pub struct ServiceCidrConfig {
    /// The API server's `--service-cluster-ip-range` value(s), primary first.
    pub cidrs: Vec<IpNet>,
    /// Upstream: 10 s.
    pub interval: Duration,
    /// `reportingInstance` of the events; `None` uses the host name.
    pub reporting_instance: Option<String>,
}

impl Default for ServiceCidrConfig {
    fn default() -> Self {
        Self {
            cidrs: Vec::new(),
            interval: Duration::from_secs(10),
            reporting_instance: None,
        }
    }
}

/// `loops.serviceCIDR`: the default ServiceCIDR `kubernetes`, from `serviceClusterIPRange`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct Section {
    pub enabled: bool,
    #[serde(with = "duration_format")]
    pub interval: Duration,
}

impl Default for Section {
    fn default() -> Self {
        Section {
            enabled: true,
            interval: ServiceCidrConfig::default().interval,
        }
    }
}

impl LoopSection for Section {
    fn enabled(&self) -> bool {
        self.enabled
    }

    fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<ConfigError>) {
        validate_interval(path, self.interval, errors);
    }

    /// Without `serviceClusterIPRange` there is nothing to create or check the default
    /// ServiceCIDR against (the other loops read the range from it): no loop, and a log line
    /// saying so. Inventing a range would create a ServiceCIDR the apiserver does not serve.
    fn build(
        &self,
        context: &mut BuildContext<'_>,
    ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
        if context.settings.service_ranges.is_empty() {
            info!(
                "loops.serviceCIDR not started: serviceClusterIPRange is not set, so there is no \
                 range to create or check the ServiceCIDR \"kubernetes\" with (kube-apiserver \
                 1.33+ creates it from its own --service-cluster-ip-range)"
            );
            return Ok(Vec::new());
        }
        let config = ServiceCidrConfig {
            cidrs: context.settings.service_ranges.clone(),
            interval: self.interval,
            reporting_instance: Some(context.settings.identity.clone()),
        };
        Ok(vec![Arc::new(DefaultServiceCidr::new(
            context.client.clone(),
            config,
        )?)])
    }
}

impl ServiceCidrConfig {
    /// Errors name the field's YAML path.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const RANGE: &str = "serviceClusterIPRange";
        if self.cidrs.is_empty() {
            return Err(ConfigError::new(
                RANGE,
                "set the API server's --service-cluster-ip-range value(s), primary first (e.g. \
                 [10.96.0.0/12])",
            ));
        }
        validate_ranges(&self.cidrs).map_err(|err| ConfigError::new(RANGE, err))?;
        if let Some(net) = self.cidrs.iter().find(|net| net.trunc() != **net) {
            return Err(ConfigError::new(
                RANGE,
                format!("{net} has host bits set; write it as {}", net.trunc()),
            ));
        }
        if self.interval.is_zero() {
            return Err(ConfigError::new(
                "loops.serviceCIDR.interval",
                "must be greater than zero (upstream uses 10s)",
            ));
        }
        Ok(())
    }

    fn desired(&self) -> Vec<String> {
        self.cidrs.iter().map(ToString::to_string).collect()
    }
}

/// What the existing object needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    Create,
    /// Single-stack object whose range is our primary: add the secondary.
    UpgradeToDualStack,
    /// Terminating: leave it to its finalizer.
    Terminating,
    /// `spec.cidrs` differ from the configuration in a way we must not change.
    Inconsistent {
        actual: Vec<String>,
    },
    /// Matches; `Ready` is missing or Unknown.
    SetReady,
    /// Matches but `Ready=False` (set by someone else): report it.
    NotReady {
        reason: String,
        message: String,
    },
    InSync,
}

fn same_cidrs(actual: &[String], desired: &[IpNet]) -> bool {
    actual.len() == desired.len()
        && actual
            .iter()
            .zip(desired)
            .all(|(a, d)| a.parse::<IpNet>().is_ok_and(|a| a == *d))
}

/// Decides what to do with the current object (pure).
pub fn plan(current: Option<&ServiceCIDR>, desired: &[IpNet]) -> Plan {
    let Some(current) = current else {
        return Plan::Create;
    };
    let actual: Vec<String> = current
        .spec
        .as_ref()
        .and_then(|spec| spec.cidrs.clone())
        .unwrap_or_default();
    if desired.len() == 2 && actual.len() == 1 && same_cidrs(&actual, &desired[..1]) {
        return Plan::UpgradeToDualStack;
    }
    if current.metadata.deletion_timestamp.is_some() {
        return Plan::Terminating;
    }
    if !same_cidrs(&actual, desired) {
        return Plan::Inconsistent { actual };
    }
    let ready = current
        .status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .and_then(|conditions| conditions.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => Plan::InSync,
        Some(c) if c.status == "False" => Plan::NotReady {
            reason: c.reason.clone(),
            message: c.message.clone(),
        },
        _ => Plan::SetReady,
    }
}

/// Go's `%v` of a `[]string`.
fn go_list(items: &[String]) -> String {
    format!("[{}]", items.join(" "))
}

/// Whether the API serves networking.k8s.io/v1 ServiceCIDRs; the answer is kept in `slot`.
async fn served(client: &Client, slot: &Mutex<Option<bool>>) -> Result<bool, kube::Error> {
    if let Some(served) = *slot.lock().unwrap_or_else(|p| p.into_inner()) {
        return Ok(served);
    }
    let served = match client
        .list_api_group_resources("networking.k8s.io/v1")
        .await
    {
        Ok(list) => list.resources.iter().any(|r| r.name == "servicecidrs"),
        Err(kube::Error::Api(status)) if status.code == 404 => false,
        Err(err) => return Err(err),
    };
    let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
    if slot.is_none() && !served {
        info!(
            "the API serves no networking.k8s.io/v1 ServiceCIDR; the service-cidr loop has nothing to do"
        );
    }
    *slot = Some(served);
    Ok(served)
}

/// The default ServiceCIDR loop (`service-cidr`).
pub struct DefaultServiceCidr {
    config: ServiceCidrConfig,
    recorder: Recorder,
    /// The reported condition (inconsistent or not ready), so each gets its event and log line
    /// once when it appears, and again only if it clears and comes back.
    reported: ReportOnce<String>,
    /// Whether the API serves ServiceCIDRs, once discovery has answered.
    served: Arc<Mutex<Option<bool>>>,
    client: Client,
    /// The default ServiceCIDR, kept by the watch that is also this loop's trigger.
    cache: WatchCache<ServiceCIDR>,
}

impl DefaultServiceCidr {
    pub fn new(client: Client, config: ServiceCidrConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let reporter = match &config.reporting_instance {
            Some(instance) => Reporter {
                controller: CONTROLLER_NAME.to_owned(),
                instance: Some(instance.clone()),
            },
            None => Reporter::from(CONTROLLER_NAME),
        };
        Ok(Self {
            recorder: Recorder::new(client.clone(), reporter),
            config,
            reported: ReportOnce::new(),
            served: Arc::new(Mutex::new(None)),
            cache: WatchCache::new(
                Api::all(client.clone()),
                watcher::Config::default().fields(&format!("metadata.name={DEFAULT_SERVICE_CIDR}")),
            ),
            client,
        })
    }

    async fn served(&self, client: &Client) -> Result<bool, LoopError> {
        Ok(served(client, &self.served).await?)
    }

    async fn warn_event(&self, reason: &str, note: String) {
        let reference = ObjectReference {
            api_version: Some("networking.k8s.io/v1".to_owned()),
            kind: Some("ServiceCIDR".to_owned()),
            name: Some(DEFAULT_SERVICE_CIDR.to_owned()),
            ..ObjectReference::default()
        };
        let event = Event {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note),
            action: EVENT_ACTION.to_owned(),
            secondary: None,
        };
        if let Err(err) = self.recorder.publish(&event, &reference).await {
            warn!(reason, error = %err, "cannot publish event");
        }
    }

    async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
        let mut report = PassReport::default();
        if !self.served(&ctx.client).await? {
            return Ok(report);
        }
        let api: Api<ServiceCIDR> = Api::all(ctx.client.clone());
        let object = format!("ServiceCIDR/{DEFAULT_SERVICE_CIDR}");
        let desired = self.config.desired();
        let mut current = self.cache.get(&api, DEFAULT_SERVICE_CIDR).await?;
        match plan(current.as_ref(), &self.config.cidrs) {
            Plan::Create => {
                let message = format!(
                    "default ServiceCIDR is missing; creating it with CIDRs {}",
                    go_list(&desired)
                );
                if ctx.dry_run {
                    report.push(drift(
                        "servicecidr_missing",
                        object,
                        Action::Create,
                        message,
                        false,
                    ));
                    return Ok(report);
                }
                info!(cidrs = ?desired, "Creating default ServiceCIDR");
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
                match api.create(&PostParams::default(), &new).await {
                    Ok(created) => current = Some(created),
                    Err(kube::Error::Api(status)) if status.code == 409 => {
                        current = self.cache.get(&api, DEFAULT_SERVICE_CIDR).await?;
                    }
                    Err(err) => {
                        self.warn_event(
                            "KubernetesDefaultServiceCIDRError",
                            "The default ServiceCIDR can not be created".to_owned(),
                        )
                        .await;
                        return Err(err.into());
                    }
                }
                report.push(drift(
                    "servicecidr_missing",
                    object.clone(),
                    Action::Create,
                    message,
                    true,
                ));
            }
            Plan::UpgradeToDualStack => {
                let message = format!(
                    "default ServiceCIDR is single-stack; upgrading it to dual-stack {}",
                    go_list(&desired)
                );
                if ctx.dry_run {
                    report.push(drift(
                        "servicecidr_single_stack",
                        object,
                        Action::Update,
                        message,
                        false,
                    ));
                    return Ok(report);
                }
                let Some(mut upgraded) = current.clone() else {
                    return Ok(report);
                };
                upgraded.spec = Some(ServiceCIDRSpec {
                    cidrs: Some(desired.clone()),
                });
                match api
                    .replace(DEFAULT_SERVICE_CIDR, &PostParams::default(), &upgraded)
                    .await
                {
                    Ok(updated) => {
                        current = Some(updated);
                        report.push(drift(
                            "servicecidr_single_stack",
                            object.clone(),
                            Action::Update,
                            message,
                            true,
                        ));
                    }
                    Err(err) => {
                        self.warn_event(
                            "KubernetesDefaultServiceCIDRError",
                            format!(
                                "The default ServiceCIDR can not be upgraded from {} to dual stack {} : {err}",
                                desired[0],
                                go_list(&desired)
                            ),
                        )
                        .await;
                        return Err(err.into());
                    }
                }
            }
            _ => {}
        }
        self.sync_status(ctx, &api, current.as_ref(), &object, &mut report)
            .await?;
        Ok(report)
    }

    async fn sync_status(
        &self,
        ctx: &PassContext,
        api: &Api<ServiceCIDR>,
        current: Option<&ServiceCIDR>,
        object: &str,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let plan = plan(current, &self.config.cidrs);
        let note = match &plan {
            Plan::Inconsistent { actual } => format!(
                "The default ServiceCIDR {} does not match the controller flag configurations {}",
                go_list(actual),
                go_list(&self.config.desired())
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
                    self.warn_event("KubernetesDefaultServiceCIDRInconsistent", note.clone())
                        .await;
                }
                report.push(drift(
                    "servicecidr_inconsistent",
                    object,
                    Action::Report,
                    format!("KubernetesDefaultServiceCIDRInconsistent: {note}"),
                    false,
                ));
            }
            Plan::NotReady { reason, .. } => {
                if appeared {
                    self.warn_event(&reason, note.clone()).await;
                }
                report.push(drift(
                    "servicecidr_not_ready",
                    object,
                    Action::Report,
                    note,
                    false,
                ));
            }
            Plan::SetReady => {
                let message =
                    "default ServiceCIDR matches the configuration; setting Ready=True".to_owned();
                if ctx.dry_run {
                    report.push(drift(
                        "servicecidr_not_ready",
                        object,
                        Action::Update,
                        message,
                        false,
                    ));
                    return Ok(());
                }
                // Upstream applies the condition without a reason; ServiceCIDR status conditions
                // are not validated for one.
                let status = serde_json::json!({
                    "apiVersion": "networking.k8s.io/v1",
                    "kind": "ServiceCIDR",
                    "metadata": {"name": DEFAULT_SERVICE_CIDR},
                    "status": {"conditions": [{
                        "type": "Ready",
                        "status": "True",
                        "message": READY_MESSAGE,
                        "lastTransitionTime": jiff::Timestamp::now().round(jiff::Unit::Second).map_err(|e| LoopError::Other(e.to_string()))?.to_string(),
                    }]},
                });
                let params = PatchParams::apply(CONTROLLER_NAME).force();
                if let Err(err) = api
                    .patch_status(DEFAULT_SERVICE_CIDR, &params, &Patch::Apply(&status))
                    .await
                {
                    self.warn_event(
                        "KubernetesDefaultServiceCIDRError",
                        "The default ServiceCIDR Status can not be set to Ready=True".to_owned(),
                    )
                    .await;
                    return Err(err.into());
                }
                report.push(drift(
                    "servicecidr_not_ready",
                    object,
                    Action::Update,
                    message,
                    true,
                ));
            }
            Plan::Create | Plan::UpgradeToDualStack | Plan::Terminating | Plan::InSync => {}
        }
        Ok(())
    }
}

impl Reconciler for DefaultServiceCidr {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.config.interval
    }

    /// The watch of the default ServiceCIDR, once discovery says the API serves them (retried
    /// with backoff until it answers); none where it does not.
    fn triggers(&self) -> Vec<Trigger> {
        let Some(events) = self.cache.take_events() else {
            return Vec::new();
        };
        let (client, slot) = (self.client.clone(), self.served.clone());
        let trigger = async move {
            let discover = || served(&client, &slot);
            match discover
                .retry(crate::retry::backoff(
                    Duration::from_millis(200),
                    Duration::from_secs(30),
                ))
                .await
            {
                Ok(true) => watch_trigger(events),
                Ok(false) | Err(_) => futures::stream::pending().boxed(),
            }
        };
        vec![futures::stream::once(trigger).flatten().boxed()]
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        Box::pin(self.pass(ctx))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::ServiceCIDRStatus;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|n| n.parse().unwrap()).collect()
    }

    fn object(cidrs: &[&str], ready: Option<&str>) -> ServiceCIDR {
        ServiceCIDR {
            metadata: ObjectMeta {
                name: Some("kubernetes".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceCIDRSpec {
                cidrs: Some(cidrs.iter().map(|c| (*c).to_owned()).collect()),
            }),
            status: ready.map(|status| ServiceCIDRStatus {
                conditions: Some(vec![Condition {
                    type_: "Ready".into(),
                    status: status.into(),
                    reason: "Because".into(),
                    message: "it is so".into(),
                    last_transition_time: Time(jiff::Timestamp::UNIX_EPOCH),
                    observed_generation: None,
                }]),
            }),
        }
    }

    #[test]
    fn plans_follow_upstream() {
        let dual = nets(&["10.96.0.0/12", "fd00::/108"]);
        assert_eq!(plan(None, &dual), Plan::Create);
        assert_eq!(
            plan(Some(&object(&["10.96.0.0/12"], None)), &dual),
            Plan::UpgradeToDualStack
        );
        assert_eq!(
            plan(Some(&object(&["10.0.0.0/24"], None)), &dual),
            Plan::Inconsistent {
                actual: vec!["10.0.0.0/24".into()]
            }
        );
        assert_eq!(
            plan(
                Some(&object(&["10.96.0.0/12", "fd00::/108"], None)),
                &nets(&["10.96.0.0/12"])
            ),
            Plan::Inconsistent {
                actual: vec!["10.96.0.0/12".into(), "fd00::/108".into()]
            },
            "never shrinks dual-stack back to single-stack"
        );
        let matching = ["10.96.0.0/12", "fd00::/108"];
        assert_eq!(plan(Some(&object(&matching, None)), &dual), Plan::SetReady);
        assert_eq!(
            plan(Some(&object(&matching, Some("Unknown"))), &dual),
            Plan::SetReady
        );
        assert_eq!(
            plan(Some(&object(&matching, Some("True"))), &dual),
            Plan::InSync
        );
        assert_eq!(
            plan(Some(&object(&matching, Some("False"))), &dual),
            Plan::NotReady {
                reason: "Because".into(),
                message: "it is so".into()
            }
        );
        let mut terminating = object(&matching, None);
        terminating.metadata.deletion_timestamp = Some(Time(jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(plan(Some(&terminating), &dual), Plan::Terminating);
    }

    #[test]
    fn config_errors_name_the_field() {
        let err = ServiceCidrConfig::default().validate().unwrap_err();
        assert_eq!(err.field, "serviceClusterIPRange");
        assert!(err.to_string().starts_with("serviceClusterIPRange:"));
        let host_bits = ServiceCidrConfig {
            cidrs: nets(&["10.96.0.1/12"]),
            ..ServiceCidrConfig::default()
        };
        assert!(
            host_bits
                .validate()
                .unwrap_err()
                .message
                .contains("10.96.0.0/12")
        );
        let ok = ServiceCidrConfig {
            cidrs: nets(&["10.96.0.0/12", "fd00::/108"]),
            ..ServiceCidrConfig::default()
        };
        assert!(ok.validate().is_ok());
    }

    #[test]
    fn go_formatting_of_lists() {
        assert_eq!(go_list(&["a".into(), "b".into()]), "[a b]");
    }
}

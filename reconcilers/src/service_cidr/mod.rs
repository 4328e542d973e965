//! Loop: the default ServiceCIDR `kubernetes`.
//!
//! Upstream (`pkg/controlplane/controller/defaultservicecidr`) makes sure the ServiceCIDR
//! `kubernetes` exists with `spec.cidrs` = the API server's service range(s) in family order,
//! upgrades it from single- to dual-stack when a secondary range is added and the primary
//! matches, and sets `Ready=True` when it matches. A mismatch is reported once and never
//! "fixed": reverting a range could strand allocated IPs, so it is never deleted or shrunk
//! either. We keep all of that; the ClusterIP repair waits for this object.
//!
//! The files: `section.rs` (the configuration), `plan.rs` (what the object needs, pure, with the
//! table of its cases), `apply.rs` (a pass: the writes of its plan); here the loop.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use backon::Retryable;
use futures::StreamExt;
use futures::future::BoxFuture;
use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::Client;
use tracing::info;

use crate::Trigger;
use crate::budget::CacheBudget;
use crate::clusterip_repair::model::ServiceCidrRecord;
use crate::contract::{LoopError, PassContext, PassReport, Reconciler};
use crate::discovery::{LastAnswer, NetworkingDiscovery};
use crate::events::SeriesRecorder;
use crate::findings::{RepeatedFailure, ReportOnce};
use crate::section::Settings;
use crate::service_range::DEFAULT_SERVICE_CIDR;
use crate::watch_cache::{WatchCache, Whole};

mod apply;
mod plan;
mod section;

pub use plan::{Plan, plan};
pub use section::{DEFAULT_INTERVAL, Section};

/// The loop's name: in logs, `/readyz`, metrics and events.
pub const NAME: &str = "service-cidr";

/// Upstream's controller name: field manager of the status it writes, as upstream's controller
/// does (events name this controller, `bootstrap-controller`).
pub const CONTROLLER_NAME: &str = "kubernetes-service-cidr-controller";

/// What discovery says of ServiceCIDRs, and the answer before, so that it is logged when it is
/// the first or a change.
struct Served {
    discovery: Arc<NetworkingDiscovery>,
    recheck: Duration,
    last: LastAnswer<bool>,
}

impl Served {
    /// Whether the API serves networking.k8s.io/v1 ServiceCIDRs.
    async fn ask(&self) -> Result<bool, kube::Error> {
        let served = (self.discovery)
            .serves(&["servicecidrs"], self.recheck)
            .await?;
        match (self.last.replace(served), served) {
            (None, false) => info!(
                "the API serves no networking.k8s.io/v1 ServiceCIDR; the service-cidr loop has \
                 nothing to do, and asks again each interval"
            ),
            (Some(false), true) => {
                info!(
                    "the API serves networking.k8s.io/v1 ServiceCIDRs now; the service-cidr loop starts"
                )
            }
            _ => {}
        }
        Ok(served)
    }
}

/// The default ServiceCIDR loop (`service-cidr`).
pub struct ServiceCidrLoop {
    section: Section,
    /// `serviceClusterIPRange`, primary first: what `spec.cidrs` must be.
    ranges: Vec<IpNet>,
    /// Kept for the loop's life, so a condition that clears and comes back is counted into its
    /// first event's series ([`crate::events::emit_in`]).
    recorder: SeriesRecorder,
    /// The reported condition (inconsistent or not ready), so each gets its event and log line
    /// once when it appears, and again only if it clears and comes back.
    reported: ReportOnce<String>,
    /// How the last write failed, so its `KubernetesDefaultServiceCIDRError` event is published
    /// when the failure appears, not at every retry that fails alike.
    failure: Mutex<RepeatedFailure>,
    /// Whether the API serves ServiceCIDRs, once discovery has answered; "no" is asked again
    /// after an interval (a control plane upgraded in place serves them from then on).
    served: Arc<Served>,
    /// Every ServiceCIDR as a record, kept by the watch of ServiceCIDRs the cluster's loops
    /// share (its changes trigger this loop), and the default one whole, read again when its
    /// record's resourceVersion changes.
    cidrs: WatchCache<ServiceCidrRecord>,
    cidr: Whole<ServiceCIDR>,
}

impl ServiceCidrLoop {
    /// The loop of a validated `section`, with `settings.service_ranges` as the ServiceCIDR's
    /// ranges; `None` when no range is configured (there is nothing to create or check then).
    /// Its caches are its own and unlimited; its section builds it with the cluster's shared
    /// ones ([`Self::with_shared`]).
    pub fn new(client: Client, section: Section, settings: &Settings) -> Option<Self> {
        let cidrs = WatchCache::shared(client.clone(), &CacheBudget::default());
        let discovery = NetworkingDiscovery::new(client.clone());
        Self::with_shared(client, section, settings, (cidrs, discovery))
    }

    /// [`Self::new`] with the ServiceCIDR cache the cluster's loops share (whichever subscribes
    /// first feeds it) and its discovery.
    pub fn with_shared(
        client: Client,
        section: Section,
        settings: &Settings,
        (cidrs, discovery): (WatchCache<ServiceCidrRecord>, Arc<NetworkingDiscovery>),
    ) -> Option<Self> {
        if settings.service_ranges.is_empty() {
            return None;
        }
        cidrs.read_one(kube::Api::all(client.clone()), DEFAULT_SERVICE_CIDR);
        let served = Arc::new(Served {
            discovery,
            recheck: section.interval,
            last: LastAnswer::default(),
        });
        Some(Self {
            recorder: SeriesRecorder::new(client.clone(), settings.reporter()),
            section,
            ranges: settings.service_ranges.clone(),
            reported: ReportOnce::new(),
            failure: Mutex::default(),
            served,
            cidrs,
            cidr: Whole::default(),
        })
    }

    /// The ranges as `spec.cidrs` writes them.
    fn desired(&self) -> Vec<String> {
        self.ranges.iter().map(ToString::to_string).collect()
    }

    /// The default ServiceCIDR: the kept one while the cache holds its resourceVersion.
    async fn current(
        &self,
        api: &kube::Api<ServiceCIDR>,
    ) -> Result<Option<ServiceCIDR>, LoopError> {
        let key: Box<str> = DEFAULT_SERVICE_CIDR.into();
        Ok(self
            .cidr
            .get(&self.cidrs, &key, api, DEFAULT_SERVICE_CIDR)
            .await?)
    }

    async fn served(&self) -> Result<bool, LoopError> {
        Ok(self.served.ask().await?)
    }
}

impl Reconciler for ServiceCidrLoop {
    fn name(&self) -> &'static str {
        NAME
    }

    fn interval(&self) -> Duration {
        self.section.interval
    }

    /// The watch of ServiceCIDRs, once discovery says the API serves them (retried with backoff
    /// until it answers, and asked again each interval while it says no).
    fn triggers(&self) -> Vec<Trigger> {
        let changes = self.cidrs.subscribe();
        let served = self.served.clone();
        let interval = self.section.interval;
        let trigger = async move {
            let discover = || served.ask();
            let backoff =
                || crate::retry::backoff(Duration::from_millis(200), Duration::from_secs(30));
            while !discover.retry(backoff()).await.unwrap_or(false) {
                tokio::time::sleep(interval).await;
            }
            changes
        };
        vec![futures::stream::once(trigger).flatten().boxed()]
    }

    fn reconcile<'a>(
        &'a self,
        ctx: &'a PassContext,
    ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
        self.recorder.forget_idle();
        Box::pin(self.pass(ctx))
    }
}

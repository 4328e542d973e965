//! The `kubernetes` Service's endpoints: who the apiservers are, and the Endpoints and
//! EndpointSlices that list them.
//!
//! Two loops share one configuration, the section with the top-level settings:
//! * [`ApiserverLeaseLoop`] (`apiserver-lease`, every instance, `lease` mode only): keeps this
//!   instance's membership Lease while its apiserver's `/readyz` answers 200, deletes it when the
//!   apiserver is not ready, and on shutdown when [`shutdown`] decides its apiserver is stopping
//!   too.
//! * [`ApiserverEndpointsLoop`] (`apiserver-endpoints`, leader only; on every instance in
//!   `master-count` mode, as upstream): computes the member set and writes the Endpoints and
//!   EndpointSlices from it.
//!
//! The configuration is `section.rs`. A pass of the endpoints loop reads its objects and the
//! members' sources into a [`plan::Snapshot`], decides in [`plan`] (pure: the members, the writes
//! and the findings) and writes in `apply.rs`, whose outcome the report, metrics and events are
//! built from. Pure logic also lives in [`members`] and [`lease`]; [`probe`] holds the
//! readiness and DNS traits.
//!
//! Objects, as a user sees them:
//! * Membership Leases `<leaseNamespace>/apiserver-<address>` (IPv6 colons as dashes), label
//!   `bootstrap-controller.io/apiserver-endpoint=<service>`, annotations
//!   `bootstrap-controller.io/advertise-address` and `bootstrap-controller.io/secure-port`,
//!   `leaseDurationSeconds` = TTL, `renewTime` renewed every interval. `kubectl delete` of one
//!   removes that member at once (its sidecar re-creates it on its next renewal if its apiserver
//!   is ready).
//! * Endpoints `<ns>/<service>` (label `endpointslice.kubernetes.io/skip-mirror: "true"`, one
//!   subset, addresses sorted by string as upstream, port `https`/TCP/`securePort`); EndpointSlice
//!   `<ns>/<service>` for the primary family and `<ns>/<service>-ipv6` (or `-ipv4`) for the other
//!   family while it has members; both labelled `kubernetes.io/service-name=<service>`.
//! * Events (events.k8s.io/v1) on the Endpoints: `MemberJoined`, `MemberLeft`, `MemberExpired`,
//!   `EndpointsRepaired`, `StaticAddressResolutionFailed` and `InvalidMemberAddress` (Warning);
//!   on this instance's membership Lease, one for each write the `apiserver-lease` loop makes:
//!   `MemberLeaseCreated`, `MemberLeaseRenewed` (after it had expired) and `MemberLeaseWithdrawn`
//!   (Warning: its apiserver is not ready).
//!
//! RBAC the loops need: `coordination.k8s.io` `leases` get/list/watch/create/update/delete in the
//! Lease namespace; `endpoints` get/list/watch/create/update and `discovery.k8s.io`
//! `endpointslices` get/list/watch/create/update/delete in the Service namespace;
//! `events.k8s.io` `events` create/patch there and in the Lease namespace; the non-resource URL `/readyz` get (when probed
//! through the kubeconfig's server). Whether this instance leads comes from the runner
//! ([`crate::contract::PassContext::leader`]), not from the leader-election Lease.

mod apply;
pub mod endpoints_loop;
pub mod lease;
pub mod lease_loop;
pub mod members;
mod metrics;
pub mod objects;
pub mod plan;
pub mod probe;
mod section;
pub mod shutdown;

use std::sync::Arc;
use std::time::Duration;

use kube::runtime::events::Reporter;

use crate::budget::CacheBudget;
use crate::contract::LoopError;
use crate::section::ServiceName;

pub use endpoints_loop::{ApiserverEndpointsLoop, EndpointsMetrics};
pub use lease_loop::{ApiserverLeaseLoop, LeaseMetrics};
pub use members::MemberSet;
pub use objects::EndpointsTarget;
pub use probe::{
    ApiserverReadyz, LazyUrlReadyz, NotReady, ProbedServer, ReadinessProbe, Resolver,
    SystemResolver, default_route_address,
};
pub use section::{
    DEFAULT_INTERVAL, DEFAULT_LEASE_TTL, ENDPOINTS_UNNAMED, EndpointsMode, Section, StaticAddress,
    StaticAddressError,
};
pub use shutdown::{OnShutdown, ShutdownDecision, ShutdownGate};

pub use crate::section::ConfigLoader;

/// The endpoints loop's name: in logs, `/readyz`, metrics and events (the Lease loop's is
/// [`lease_loop::NAME`]).
pub const NAME: &str = "apiserver-endpoints";
/// Everything the loops need from outside.
#[derive(Clone)]
pub struct EndpointsDeps {
    pub client: kube::Client,
    /// Whether the local apiserver is ready (`lease` and `master-count` modes).
    pub readiness: Arc<dyn ReadinessProbe>,
    /// Whether a graceful stop withdraws this instance: one decision shared by both loops.
    pub shutdown: Arc<ShutdownGate>,
    /// Name resolution (`static` mode).
    pub resolver: Arc<dyn Resolver>,
    pub reporter: Reporter,
    /// The `kubernetes` Service whose endpoints these are.
    pub service: ServiceName,
    /// The server the readiness probe asks, checked once to be this instance's own (`None`:
    /// not checked).
    pub probed: Option<ProbedServer>,
    /// What the cluster's caches may hold together.
    pub budget: CacheBudget,
}

/// `work` within `bound`: a withdrawal at stop gets as long as upstream's `RemoveEndpoints`
/// (twice the interval); running out is an error saying what timed out.
async fn within<T>(
    bound: Duration,
    what: String,
    work: impl Future<Output = Result<T, LoopError>>,
) -> Result<T, LoopError> {
    let timed_out = || {
        Err(LoopError::Other(format!(
            "{what} timed out after {bound:?}"
        )))
    };
    tokio::time::timeout(bound, work)
        .await
        .unwrap_or_else(|_| timed_out())
}

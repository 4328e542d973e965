//! The repair's writes: the etcd bitmap repaired by compare-and-swap (ports in use set, leaks
//! released once confirmed), and upstream's events about the findings. Services are never
//! changed.

use kube::runtime::events::EventType;

use super::plan::{self, Finding, Problem};
use super::{EVENT_ACTION, NodePortRepairLoop};
use crate::alloc::PortRange;
use crate::contract::{LoopError, PassContext, PassReport};
use crate::legacy_alloc::{LegacyBitmap, Outlet};
use crate::service_cache::live::{self, Liveness};
use crate::service_cache::record::ServiceRecord;

impl NodePortRepairLoop {
    /// etcd mode: repairs the bitmap against the ports in use; `PortNotAllocated` on the
    /// Service of each port found missing. The pass's scan holds the bits and first holders
    /// [`LegacyBitmap::in_use`] would give for the same Services, so the cache is scanned once.
    pub(super) async fn repair_bitmap(
        &self,
        ctx: &PassContext,
        etcd: &LegacyBitmap<PortRange>,
        scan: &plan::Scan,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let outlet = Outlet {
            recorder: &self.recorder,
            kubernetes_service: (
                &self.kubernetes_service.namespace,
                &self.kubernetes_service.name,
            ),
            errors: &self.metrics.port_errors,
        };
        let in_use = (&scan.in_use, &scan.owners);
        (etcd.repair(ctx, in_use, &outlet, report)).await
    }

    /// Reads the Services a new finding rests on live, as the cache may be behind: the
    /// Service it is about must exist as the object the cache saw and hold the port; for a port
    /// held twice, so must the Service holding it first (a Service deleted without the cache
    /// hearing of it would make its successor on the port a duplicate).
    pub(super) async fn verify(
        &self,
        ctx: &PassContext,
        finding: &Finding,
        scan: &plan::Scan,
    ) -> Result<Liveness, kube::Error> {
        let port = finding.port;
        let held = |service: &ServiceRecord| {
            plan::collect_service_node_ports(service)
                .iter()
                .filter(|held| **held == port)
                .count()
        };
        let first = match finding.problem {
            Problem::OutOfRange => None,
            Problem::AlreadyAllocated => self
                .range
                .offset(port)
                .and_then(|offset| scan.owners.get(&offset)),
        };
        let itself = first.is_some_and(|first| {
            (&first.namespace, &first.name) == (&finding.service.namespace, &finding.service.name)
        });
        // A Service holding the port twice is its own duplicate: both holds must be there.
        let needed = if itself { 2 } else { 1 };
        let liveness = live::confirm(
            &ctx.client,
            &finding.service.namespace,
            &finding.service.name,
            &finding.service.uid,
            |service| held(service) >= needed,
        )
        .await?;
        match first {
            Some(first) if liveness == Liveness::Holds && !itself => {
                live::confirm(
                    &ctx.client,
                    &first.namespace,
                    &first.name,
                    &first.uid,
                    |service| held(service) >= 1,
                )
                .await
            }
            _ => Ok(liveness),
        }
    }

    /// The finding's event, on the Service it is about.
    pub(super) async fn publish(&self, finding: &Finding) -> Result<(), kube::Error> {
        let reference = crate::events::service_reference(&finding.service);
        crate::events::emit_in(
            &self.recorder,
            &reference,
            EventType::Warning,
            finding.problem.reason(),
            EVENT_ACTION,
            &finding.note(self.range),
        )
        .await
    }
}

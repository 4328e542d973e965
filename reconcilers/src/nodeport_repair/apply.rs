//! The repair's writes: the etcd bitmap repaired by compare-and-swap (ports in use set, leaks
//! released once confirmed), and upstream's events about the findings. Services are never
//! changed.

use futures::future::BoxFuture;
use kube::runtime::events::EventType;

use super::plan::{self, Finding, Problem};
use super::{EVENT_ACTION, NodePortRepairLoop, RANGE_MISMATCH_REASON};
use crate::contract::{LoopError, PassContext, PassReport};
use crate::legacy_alloc::{BitmapFinding, LegacyBitmap};
use crate::service_cache::fresh_services;
use crate::service_cache::live::{self, Liveness};
use crate::service_cache::record::ServiceRecord;

impl NodePortRepairLoop {
    pub(super) fn count(&self, error_type: &'static str) {
        self.metrics
            .port_errors
            .get_or_create(&[("type", error_type)])
            .inc();
    }

    /// etcd mode: repairs the bitmap against the ports in use; `PortNotAllocated` on the
    /// Service of each port found missing.
    pub(super) async fn repair_bitmap(
        &self,
        ctx: &PassContext,
        etcd: &LegacyBitmap,
        scan: &plan::Scan,
        report: &mut PassReport,
    ) -> Result<(), LoopError> {
        let owner = |offset: usize| {
            scan.owners
                .get(&offset)
                .map(|holder| format!("Service/{}/{}", holder.namespace, holder.name))
        };
        let fresh_in_use = || -> BoxFuture<'static, Option<fixedbitset::FixedBitSet>> {
            let (client, page_size, range) =
                (ctx.client.clone(), self.section.page_size, self.range);
            Box::pin(async move {
                let services = fresh_services(&client, page_size).await?;
                Some(plan::scan(&services, range).in_use)
            })
        };
        let owner_of = |offset: usize| {
            scan.owners.get(&offset).map(|holder| {
                (
                    holder.namespace.clone(),
                    holder.name.clone(),
                    holder.uid.clone(),
                )
            })
        };
        let base = i32::from(self.range.base());
        let holds = |service: &ServiceRecord, offset: usize| {
            i32::try_from(offset).is_ok_and(|offset| {
                plan::collect_service_node_ports(service).contains(&(base + offset))
            })
        };
        let confirm = |offsets| {
            crate::legacy_alloc::confirm_live(&ctx.client, offsets, &owner_of, &holds, fresh_in_use)
        };
        let pass = etcd
            .pass(&scan.in_use, &owner, ctx.dry_run, fresh_in_use, confirm)
            .await
            .map_err(|err| LoopError::Other(format!("NodePort bitmap in etcd: {err}")))?;
        report.drift.extend(pass.drift);
        self.report_findings(ctx, etcd, scan, pass.new).await
    }

    /// The new findings of a bitmap pass: counted, and each repair's event published (a range
    /// mismatch is reported with its event or not at all: the next pass tries again).
    async fn report_findings(
        &self,
        ctx: &PassContext,
        etcd: &LegacyBitmap,
        scan: &plan::Scan,
        new: Vec<BitmapFinding>,
    ) -> Result<(), LoopError> {
        let mut unpublished = None;
        for finding in new {
            match finding {
                BitmapFinding::NotAllocated(offset) => {
                    self.count("repair");
                    if !ctx.dry_run
                        && let Some(holder) = scan.owners.get(&offset)
                    {
                        let note =
                            format!("Port {} is not allocated; repairing", etcd.item(offset));
                        // The bitmap is repaired either way; the event is best effort here.
                        let _ = self.publish_about(holder, "PortNotAllocated", note).await;
                    }
                }
                BitmapFinding::Released(offset) => {
                    self.count("leak");
                    if !ctx.dry_run {
                        let note = format!(
                            "Port {} appeared to have leaked (no Service holds it); released it \
                             from the allocation bitmap",
                            etcd.item(offset)
                        );
                        // Released either way; the event is best effort here.
                        let _ = self
                            .publish_about(&self.kubernetes_service_holder(), "PortReleased", note)
                            .await;
                    }
                }
                BitmapFinding::RangeMismatch(ref stored) => {
                    if !ctx.dry_run {
                        let holder = self.kubernetes_service_holder();
                        let note = etcd.range_mismatch_note(stored);
                        if let Err(err) = self
                            .publish_about(&holder, RANGE_MISMATCH_REASON, note)
                            .await
                        {
                            // Reported with its event or not at all: the next pass tries again.
                            etcd.forget(&finding);
                            unpublished.get_or_insert(err);
                            continue;
                        }
                    }
                    self.count("rangeMismatch");
                }
                // The bitmap rebuilt under the configured range (or its range filled in).
                BitmapFinding::RangeRebuilt(ref stored) => {
                    self.count("repair");
                    if !ctx.dry_run {
                        let note = format!(
                            "rebuilt the NodePort allocation bitmap under {} (stored under {:?})",
                            self.range, stored
                        );
                        let _ = self
                            .publish_about(
                                &self.kubernetes_service_holder(),
                                "NodePortBitmapRebuilt",
                                note,
                            )
                            .await;
                    }
                }
                BitmapFinding::Unusable(_) => self.count("invalid"),
                BitmapFinding::MayHaveLeaked(_) | BitmapFinding::ReleaseHeld(_) => {}
            }
        }
        match unpublished {
            Some(err) => Err(LoopError::Api(err)),
            None => Ok(()),
        }
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
            (&first.namespace, &first.name) == (&finding.namespace, &finding.name)
        });
        // A Service holding the port twice is its own duplicate: both holds must be there.
        let needed = if itself { 2 } else { 1 };
        let liveness = live::confirm(
            &ctx.client,
            &finding.namespace,
            &finding.name,
            &finding.uid,
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

    pub(super) async fn publish(&self, finding: &Finding) -> Result<(), kube::Error> {
        let holder = plan::Holder {
            namespace: finding.namespace.clone(),
            name: finding.name.clone(),
            uid: finding.uid.clone(),
        };
        self.publish_about(&holder, finding.problem.reason(), finding.note(self.range))
            .await
    }

    /// The `kubernetes` Service: what the bitmap's own events are about.
    fn kubernetes_service_holder(&self) -> plan::Holder {
        let service = &self.kubernetes_service;
        plan::Holder {
            namespace: service.namespace.as_str().into(),
            name: service.name.as_str().into(),
            uid: "".into(),
        }
    }

    pub(super) async fn publish_about(
        &self,
        holder: &plan::Holder,
        reason: &str,
        note: String,
    ) -> Result<(), kube::Error> {
        let uid = holder.uid.to_string();
        let reference = crate::events::service_reference(&holder.namespace, &holder.name, &uid);
        crate::events::emit(
            &self.recorder,
            &reference,
            EventType::Warning,
            reason,
            EVENT_ACTION,
            &note,
        )
        .await
    }
}

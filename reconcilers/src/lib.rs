//! The bootstrap reconcile loops of bootstrap-controller.
//!
//! Each loop lives in one module and implements [`Reconciler`]; the runtime in the
//! `bootstrap-controller` crate drives them. Pure logic (ranges, bitmaps, desired objects) lives in
//! modules with no I/O so it can be tested without a cluster.

pub mod alloc;
pub mod apiserver_endpoints;
pub mod budget;
pub mod clusterip_repair;
pub mod contract;
pub mod discovery;
pub mod events;
pub mod findings;
pub mod kubernetes_service;
pub mod lease;
pub mod legacy_alloc;
pub mod list_watch;
pub mod metrics;
pub mod names;
pub mod nodeport_repair;
pub mod retry;
pub mod sanitize;
pub mod section;
pub mod service_cache;
pub mod service_cidr;
pub mod service_range;
pub mod system_namespaces;
pub mod watch_cache;

pub use contract::{
    Action, Change, Drift, LoopError, PassContext, PassReport, Reconciler, Trigger,
    ignore_already_exists,
};

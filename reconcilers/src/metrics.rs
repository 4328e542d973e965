//! How a loop registers its metrics: in a sub-registry named after the loop, so every loop's
//! metrics read `bootstrap_<loop>_<metric>` (`clusterip-repair` → `bootstrap_clusterip_repair_*`)
//! without each loop spelling its prefix.

use prometheus_client::registry::{Metric, Registry};

/// The part of `registry` that belongs to the loop called `loop_name`.
pub fn loop_registry<'a>(registry: &'a mut Registry, loop_name: &str) -> &'a mut Registry {
    registry.sub_registry_with_prefix(loop_name.replace('-', "_"))
}

/// Registers `metric` under `name` with `help` and hands it back, so a loop's metric handles are
/// built in one expression each.
pub fn registered<M: Metric + Clone>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

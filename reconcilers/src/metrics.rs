//! How a loop registers its metrics: in a sub-registry named after the loop, so every loop's
//! metrics read `bootstrap_<loop>_<metric>` (`clusterip-repair` → `bootstrap_clusterip_repair_*`)
//! without each loop spelling its prefix.
//!
//! A cluster's metrics go to a [`MetricRegistry`]: the process's [`Registry`] in the
//! single-cluster mode, or a [`TenantRegistry`] in management mode. A `Registry` keeps a name,
//! a help text and the registry's labels for every metric it holds; with thousands of tenants
//! registering the same few dozen metrics that is most of what a tenant's metrics cost, so a
//! tenant's registry keeps only its metric handles beside descriptors every tenant shares, and
//! its `tenant` label once (in the [`Registry`] its [`TenantCollector`] is registered in).

use std::collections::HashSet;
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, OnceLock};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry, Unit};

/// Where a cluster's metrics are registered.
pub trait MetricRegistry {
    /// Registers `metric` as `name` (after the registry's prefix) with `help`.
    fn register_boxed(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        metric: Box<dyn Metric>,
    );

    /// The part of this registry whose names all start with `prefix`.
    fn sub_registry(&mut self, prefix: &str) -> &mut dyn MetricRegistry;
}

impl dyn MetricRegistry + '_ {
    /// Like [`Registry::register`].
    pub fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.register_boxed(name, help, None, Box::new(metric));
    }

    /// Like [`Registry::register_with_unit`].
    pub fn register_with_unit(&mut self, name: &str, help: &str, unit: Unit, metric: impl Metric) {
        self.register_boxed(name, help, Some(unit), Box::new(metric));
    }
}

impl MetricRegistry for Registry {
    fn register_boxed(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        metric: Box<dyn Metric>,
    ) {
        match unit {
            Some(unit) => self.register_with_unit(name, help, unit, Boxed(metric)),
            None => self.register(name, help, Boxed(metric)),
        }
    }

    fn sub_registry(&mut self, prefix: &str) -> &mut dyn MetricRegistry {
        self.sub_registry_with_prefix(prefix)
    }
}

/// A boxed metric, registered as itself (the crate encodes `Box<dyn EncodeMetric>` only).
#[derive(Debug)]
struct Boxed(Box<dyn Metric>);

impl EncodeMetric for Boxed {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The part of `registry` that belongs to the loop called `loop_name`.
pub fn loop_registry<'a>(
    registry: &'a mut dyn MetricRegistry,
    loop_name: &str,
) -> &'a mut dyn MetricRegistry {
    registry.sub_registry(&loop_name.replace('-', "_"))
}

/// Registers `metric` under `name` with `help` and hands it back, so a loop's metric handles are
/// built in one expression each.
pub fn registered<M: Metric + Clone>(
    registry: &mut dyn MetricRegistry,
    name: &str,
    help: &str,
    metric: M,
) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// What a metric is called and says: one for the whole process per name, help and unit, shared
/// by every tenant that registers that metric.
#[derive(Debug)]
struct SharedDescriptor {
    /// The name after the registry's prefix, with the sub-registries' prefixes.
    name: Box<str>,
    /// As a [`Registry`] says it: ending in a full stop.
    help: Box<str>,
    unit: Option<Unit>,
}

impl SharedDescriptor {
    fn unit(&self) -> Option<&str> {
        self.unit.as_ref().map(Unit::as_str)
    }

    /// The one descriptor of the process for `name`, `help` and `unit`.
    fn shared(name: String, help: &str, unit: Option<Unit>) -> Arc<SharedDescriptor> {
        static DESCRIPTORS: OnceLock<Mutex<HashSet<Arc<SharedDescriptor>>>> = OnceLock::new();
        let wanted = SharedDescriptor {
            name: name.into_boxed_str(),
            help: format!("{help}.").into_boxed_str(),
            unit,
        };
        let mut descriptors = DESCRIPTORS
            .get_or_init(Mutex::default)
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        if let Some(known) = descriptors.get(&wanted) {
            return known.clone();
        }
        let wanted = Arc::new(wanted);
        descriptors.insert(wanted.clone());
        wanted
    }
}

impl PartialEq for SharedDescriptor {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.help == other.help && self.unit() == other.unit()
    }
}

impl Eq for SharedDescriptor {}

impl Hash for SharedDescriptor {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.name.hash(state);
        self.help.hash(state);
        self.unit().hash(state);
    }
}

/// A metric handle and what it is called.
type Registered = (Arc<SharedDescriptor>, Box<dyn Metric>);

/// A tenant's metrics while its runtime is built: each a handle beside a shared descriptor.
/// [`TenantRegistry::into_collector`] makes what its `/metrics` registry serves.
#[derive(Debug, Default)]
pub struct TenantRegistry {
    /// Prepended to every name registered here: empty, or the sub-registry's prefix and `_`.
    prefix: String,
    metrics: Vec<Registered>,
    subs: Vec<TenantRegistry>,
}

impl TenantRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Every metric registered, in the order a [`Registry`] encodes them (its own, then each
    /// sub-registry's), so the exposed text is the one a `Registry` would give.
    pub fn into_collector(self) -> TenantCollector {
        let mut metrics = Vec::new();
        self.flatten_into(&mut metrics);
        TenantCollector(metrics.into_boxed_slice())
    }

    fn flatten_into(self, out: &mut Vec<Registered>) {
        out.extend(self.metrics);
        for sub in self.subs {
            sub.flatten_into(out);
        }
    }
}

impl MetricRegistry for TenantRegistry {
    fn register_boxed(
        &mut self,
        name: &str,
        help: &str,
        unit: Option<Unit>,
        metric: Box<dyn Metric>,
    ) {
        let descriptor = SharedDescriptor::shared(format!("{}{name}", self.prefix), help, unit);
        self.metrics.push((descriptor, metric));
    }

    fn sub_registry(&mut self, prefix: &str) -> &mut dyn MetricRegistry {
        let at = self.subs.len();
        self.subs.push(TenantRegistry {
            prefix: format!("{}{prefix}_", self.prefix),
            ..TenantRegistry::default()
        });
        &mut self.subs[at]
    }
}

/// A tenant's metrics, for the [`Registry`] that carries its prefix and `tenant` label.
#[derive(Debug)]
pub struct TenantCollector(Box<[Registered]>);

impl Collector for TenantCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // Like a `Registry`: a metric with nothing to say (a family without series) says
        // nothing, not even its descriptor.
        for (descriptor, metric) in self.0.iter().filter(|(_, metric)| !metric.is_empty()) {
            let metric_encoder = encoder.encode_descriptor(
                &descriptor.name,
                &descriptor.help,
                descriptor.unit.as_ref(),
                metric.metric_type(),
            )?;
            metric.encode(metric_encoder)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::metrics::counter::Counter;

    use super::*;

    /// Every tenant's registry names a metric with the one descriptor of the process, prefixes
    /// of sub-registries included.
    #[test]
    fn tenants_share_descriptors_and_keep_their_own_metrics() {
        let register = |count: u64| {
            let mut registry = TenantRegistry::new();
            let top: &mut dyn MetricRegistry = &mut registry;
            let counter = registered(top, "passes", "Passes", Counter::<u64>::default());
            let sub = loop_registry(top, "node-port");
            sub.register_with_unit(
                "took",
                "Time taken",
                Unit::Seconds,
                Counter::<u64>::default(),
            );
            counter.inc_by(count);
            registry.into_collector().0
        };
        let (a, b) = (register(1), register(2));
        let names: Vec<&str> = a.iter().map(|(d, _)| &*d.name).collect();
        assert_eq!(names, ["passes", "node_port_took"]);
        assert_eq!(&*a[0].0.help, "Passes.");
        assert_eq!(a.len(), b.len());
        for ((of_a, _), (of_b, _)) in a.iter().zip(b.iter()) {
            assert!(Arc::ptr_eq(of_a, of_b), "{of_a:?} vs {of_b:?}");
        }
    }
}

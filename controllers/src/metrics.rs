//! Metrics the runtime keeps about every loop (prometheus-client, one registry, OpenMetrics).
//!
//! Loops register their own metrics in the same registry when they are built; everything is
//! served by the admin server's `/metrics`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use reconcilers::metrics::{MetricRegistry, TenantRegistry};

/// Prefix of every metric this binary exposes.
pub const METRICS_PREFIX: &str = "bootstrap";

/// The registry every metric of the process lives in.
pub fn new_registry() -> Registry {
    Registry::with_prefix(METRICS_PREFIX)
}

/// A family's labels in their order: `loop` first, then the family's own (`result`, `kind`,
/// `category`).
type Labels<const N: usize> = [(&'static str, &'static str); N];

type HistogramFamily = Family<Labels<1>, Histogram, fn() -> Histogram>;
type FloatGauge = Gauge<f64, std::sync::atomic::AtomicU64>;

fn pass_duration_histogram() -> Histogram {
    // 1 ms .. ~33 s: a pass against a healthy API takes milliseconds, a stuck one seconds.
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

fn heal_duration_histogram() -> Histogram {
    // 5 ms .. ~11 min: a watch-woken repair takes milliseconds; one that needed retries through
    // an outage takes as long as the backoff, which is capped at the loop's interval.
    Histogram::new(exponential_buckets(0.005, 2.0, 18))
}

/// What `/metrics` serves of one tenant: `metrics` (its runtime's, registered while it was
/// built) under the prefix and, first on each sample, the label `tenant="<namespace>/<name>"`.
/// The tenant's label is kept once here, the metrics' names and help texts once for the
/// process (see [`TenantRegistry`]); the single-cluster mode registers in the main registry.
pub fn tenant_registry(tenant: String, metrics: TenantRegistry) -> Registry {
    let mut registry = Registry::with_prefix_and_labels(
        METRICS_PREFIX,
        [(
            std::borrow::Cow::Borrowed("tenant"),
            std::borrow::Cow::Owned(tenant),
        )]
        .into_iter(),
    );
    registry.register_collector(Box::new(metrics.into_collector()));
    registry
}

/// Handles to the runtime's per-loop metrics. Cheap to clone.
#[derive(Clone)]
pub struct RunnerMetrics {
    passes: Family<Labels<2>, Counter>,
    pass_duration: HistogramFamily,
    last_success: Family<Labels<1>, FloatGauge>,
    drift_found: Family<Labels<2>, Counter>,
    drift_repaired: Family<Labels<2>, Counter>,
    errors: Family<Labels<2>, Counter>,
    panics: Family<Labels<1>, Counter>,
    ready: Family<Labels<1>, Gauge>,
    drift_unrepaired: Family<Labels<2>, Gauge>,
    /// The kinds each loop's `drift_unrepaired` was last set for, so a kind that cleared is set
    /// back to zero (a family cannot be listed).
    unrepaired_kinds: Arc<Mutex<BTreeMap<&'static str, BTreeSet<&'static str>>>>,
    heal_duration: HistogramFamily,
    interval: Family<Labels<1>, FloatGauge>,
    active: Family<Labels<1>, Gauge>,
}

impl RunnerMetrics {
    pub fn register(registry: &mut dyn MetricRegistry) -> Self {
        let metrics = RunnerMetrics {
            passes: Family::default(),
            pass_duration: Family::new_with_constructor(pass_duration_histogram),
            last_success: Family::default(),
            drift_found: Family::default(),
            drift_repaired: Family::default(),
            errors: Family::default(),
            panics: Family::default(),
            ready: Family::default(),
            drift_unrepaired: Family::default(),
            unrepaired_kinds: Arc::default(),
            heal_duration: Family::new_with_constructor(heal_duration_histogram),
            interval: Family::default(),
            active: Family::default(),
        };
        registry.register(
            "loop_passes",
            "Reconcile passes per loop, by result (success, failure, panic)",
            metrics.passes.clone(),
        );
        registry.register_with_unit(
            "loop_pass_duration",
            "Duration of reconcile passes per loop",
            prometheus_client::registry::Unit::Seconds,
            metrics.pass_duration.clone(),
        );
        registry.register(
            "loop_last_success_timestamp_seconds",
            "Unix time of the last successful pass per loop",
            metrics.last_success.clone(),
        );
        registry.register(
            "loop_drift_found",
            "Drift found per loop and kind (repaired or not, e.g. in dry-run)",
            metrics.drift_found.clone(),
        );
        registry.register(
            "loop_drift_repaired",
            "Drift repaired per loop and kind",
            metrics.drift_repaired.clone(),
        );
        registry.register(
            "loop_errors",
            "Failed passes per loop, by error category",
            metrics.errors.clone(),
        );
        registry.register(
            "loop_panics",
            "Passes that panicked, per loop (caught; the loop retries)",
            metrics.panics.clone(),
        );
        registry.register(
            "loop_ready",
            "1 once a loop had its first successful pass",
            metrics.ready.clone(),
        );
        registry.register(
            "loop_drift_unrepaired",
            "Drift left undone (report-only, dry run) at the end of the last pass, per loop and kind",
            metrics.drift_unrepaired.clone(),
        );
        registry.register_with_unit(
            "loop_heal_duration",
            "Time from the watch event that woke a loop to the end of the pass that repaired drift",
            prometheus_client::registry::Unit::Seconds,
            metrics.heal_duration.clone(),
        );
        registry.register_with_unit(
            "loop_interval",
            "Configured interval between passes per loop",
            prometheus_client::registry::Unit::Seconds,
            metrics.interval.clone(),
        );
        registry.register(
            "loop_active",
            "1 while this replica runs the loop (0 while a standby waits for leadership)",
            metrics.active.clone(),
        );
        metrics
    }

    pub fn pass(&self, name: &'static str, result: &'static str, duration: Duration) {
        self.passes
            .get_or_create(&[("loop", name), ("result", result)])
            .inc();
        self.pass_duration
            .get_or_create(&loop_labels(name))
            .observe(duration.as_secs_f64());
    }

    pub fn success(&self, name: &'static str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        self.last_success.get_or_create(&loop_labels(name)).set(now);
    }

    pub fn drift(&self, name: &'static str, kind: &'static str, applied: bool) {
        let labels = [("loop", name), ("kind", kind)];
        self.drift_found.get_or_create(&labels).inc();
        if applied {
            self.drift_repaired.get_or_create(&labels).inc();
        }
    }

    pub fn error(&self, name: &'static str, category: &'static str) {
        self.errors
            .get_or_create(&[("loop", name), ("category", category)])
            .inc();
    }

    pub fn panic(&self, name: &'static str) {
        self.panics.get_or_create(&loop_labels(name)).inc();
    }

    pub fn set_ready(&self, name: &'static str, ready: bool) {
        self.ready
            .get_or_create(&loop_labels(name))
            .set(i64::from(ready));
    }

    /// Sets the drift a pass left undone, by kind; kinds of earlier passes that are gone go to 0.
    pub fn set_unrepaired(&self, name: &'static str, counts: &BTreeMap<&'static str, i64>) {
        let mut kinds = self
            .unrepaired_kinds
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        let known = kinds.entry(name).or_default();
        known.extend(counts.keys().copied());
        for kind in known.iter() {
            let count = counts.get(kind).copied().unwrap_or(0);
            self.drift_unrepaired
                .get_or_create(&[("loop", name), ("kind", kind)])
                .set(count);
        }
    }

    /// A replica that stops running a loop (lost leadership) no longer vouches for its drift.
    pub fn clear_unrepaired(&self, name: &'static str) {
        self.set_unrepaired(name, &BTreeMap::new());
    }

    pub fn heal(&self, name: &'static str, took: Duration) {
        self.heal_duration
            .get_or_create(&loop_labels(name))
            .observe(took.as_secs_f64());
    }

    pub fn set_active(&self, name: &'static str, active: bool) {
        self.active
            .get_or_create(&loop_labels(name))
            .set(i64::from(active));
    }

    /// Makes every series of a loop visible at zero before its first pass, so dashboards and
    /// alerts see the loop exists.
    pub fn init_loop(&self, name: &'static str, interval: Duration, active: bool) {
        self.interval
            .get_or_create(&loop_labels(name))
            .set(interval.as_secs_f64());
        self.set_active(name, active);
        for result in ["success", "failure", "panic"] {
            drop(
                self.passes
                    .get_or_create(&[("loop", name), ("result", result)]),
            );
        }
        drop(self.panics.get_or_create(&loop_labels(name)));
        self.set_ready(name, false);
    }
}

fn loop_labels(name: &'static str) -> Labels<1> {
    [("loop", name)]
}

/// `bootstrap_etcd_mode`: whether the allocation bitmaps in etcd are repaired too.
pub fn register_etcd_mode(registry: &mut dyn MetricRegistry, on: bool) {
    let gauge: Gauge = Gauge::default();
    gauge.set(i64::from(on));
    registry.register(
        "etcd_mode",
        "1 when --etcd-servers is set: the repairs also keep the allocation bitmaps in etcd",
        gauge,
    );
}

/// Encodes the registry in the OpenMetrics text format.
pub fn encode(registry: &Registry) -> Result<String, std::fmt::Error> {
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, registry)?;
    Ok(out)
}

/// Encodes `main` and `more` (one registry per tenant, each with its `tenant` label) as one
/// OpenMetrics text. Each registry registers the same families, and a family must appear once
/// with its samples together, so the texts are merged family by family.
pub fn encode_merged(main: &Registry, more: &[Arc<Registry>]) -> Result<String, std::fmt::Error> {
    use prometheus_client::encoding::text::encode_registry;
    // Family name -> its descriptor lines and samples, in the order families first appear.
    let mut families: Vec<(String, String, String)> = Vec::new();
    let mut index: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut text = String::new();
    for registry in std::iter::once(main).chain(more.iter().map(|r| &**r)) {
        text.clear();
        encode_registry(&mut text, registry)?;
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                let name = rest.split(' ').nth(1).unwrap_or_default();
                let at = *index.entry(name.to_owned()).or_insert_with(|| {
                    families.push((name.to_owned(), String::new(), String::new()));
                    families.len() - 1
                });
                let descriptors = &mut families[at].1;
                if !descriptors.contains(line) {
                    descriptors.push_str(line);
                    descriptors.push('\n');
                }
                current = Some(at);
            } else if let Some(at) = current {
                families[at].2.push_str(line);
                families[at].2.push('\n');
            }
        }
    }
    let mut out = String::with_capacity(families.iter().map(|f| f.1.len() + f.2.len()).sum());
    for (_, descriptors, samples) in &families {
        out.push_str(descriptors);
        out.push_str(samples);
    }
    prometheus_client::encoding::text::encode_eof(&mut out)?;
    Ok(out)
}

/// The process's own metrics, outside the `bootstrap_` prefix where Prometheus' conventions
/// name them (`process_*`), and `bootstrap_build_info`: one registry for the whole process (not
/// a tenant's), which `/metrics` serves beside the main one.
pub fn process_registry() -> Arc<Registry> {
    static REGISTRY: std::sync::OnceLock<Arc<Registry>> = std::sync::OnceLock::new();
    REGISTRY
        .get_or_init(|| {
            let mut registry = Registry::default();
            let build_info = Family::<Labels<2>, Gauge>::default();
            build_info
                .get_or_create(&[
                    ("version", crate::build_info::VERSION),
                    ("commit", crate::build_info::COMMIT),
                ])
                .set(1);
            registry.register(
                "bootstrap_build_info",
                "Always 1; its labels name the version and the commit of this build",
                build_info,
            );
            registry.register_collector(Box::new(ProcessCollector));
            Arc::new(registry)
        })
        .clone()
}

/// The kernel's clock tick for the times in `/proc/<pid>/stat`: `USER_HZ`, 100 on every
/// architecture this runs on (Prometheus' own procfs reader assumes the same), so no `sysconf`.
const USER_HZ: f64 = 100.0;

/// Reads `/proc/self` at every scrape: resident memory, CPU time, descriptors, start time.
#[derive(Debug)]
struct ProcessCollector;

impl prometheus_client::collector::Collector for ProcessCollector {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let read = |path: &str| std::fs::read_to_string(path).ok();
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .ok()
            .map(|entries| entries.count());
        let sample = ProcessSample::parse(
            read("/proc/self/stat").as_deref(),
            read("/proc/self/status").as_deref(),
            read("/proc/self/limits").as_deref(),
            read("/proc/stat").as_deref(),
            open_fds,
        );
        if let Some(seconds) = sample.cpu_seconds {
            let metric = ConstCounter::new(seconds);
            metric.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                metric.metric_type(),
            )?)?;
        }
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                sample.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                sample.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                sample.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                sample.max_fds,
            ),
        ];
        for (name, help, value) in gauges {
            if let Some(value) = value {
                let metric = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
                metric.encode(encoder.encode_descriptor(
                    name,
                    help,
                    None,
                    metric.metric_type(),
                )?)?;
            }
        }
        if let Some(start) = sample.start_time_seconds {
            let metric = ConstGauge::new(start);
            metric.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                None,
                metric.metric_type(),
            )?)?;
        }
        Ok(())
    }
}

/// What `/proc` says of the process; a value the kernel did not give is left out of the
/// scrape rather than reported as 0.
#[derive(Debug, Default, PartialEq)]
struct ProcessSample {
    cpu_seconds: Option<f64>,
    resident_bytes: Option<u64>,
    virtual_bytes: Option<u64>,
    open_fds: Option<u64>,
    max_fds: Option<u64>,
    start_time_seconds: Option<f64>,
}

impl ProcessSample {
    /// From the texts of `/proc/self/stat`, `/proc/self/status`, `/proc/self/limits` and
    /// `/proc/stat`, and the number of entries of `/proc/self/fd`.
    fn parse(
        stat: Option<&str>,
        status: Option<&str>,
        limits: Option<&str>,
        system_stat: Option<&str>,
        open_fds: Option<usize>,
    ) -> ProcessSample {
        // The fields after the command name, which is in parentheses and may hold anything:
        // field 3 (state) is the first.
        let fields: Vec<&str> = stat
            .and_then(|stat| stat.rsplit_once(')'))
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let field = |number: usize| -> Option<u64> { fields.get(number - 3)?.parse().ok() };
        let cpu_seconds = match (field(14), field(15)) {
            (Some(user), Some(system)) => Some((user + system) as f64 / USER_HZ),
            _ => None,
        };
        let boot_time = system_stat.and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("btime "))
                .and_then(|value| value.trim().parse::<u64>().ok())
        });
        let start_time_seconds = match (boot_time, field(22)) {
            (Some(boot), Some(ticks)) => Some(boot as f64 + ticks as f64 / USER_HZ),
            _ => None,
        };
        let status_kib = |key: &str| {
            status.and_then(|text| {
                text.lines()
                    .find_map(|line| line.strip_prefix(key))
                    .and_then(|rest| rest.trim().strip_suffix("kB"))
                    .and_then(|kib| kib.trim().parse::<u64>().ok())
                    .map(|kib| kib.saturating_mul(1024))
            })
        };
        // `Max open files  <soft>  <hard>  files`: the soft limit is the one enforced.
        let max_fds = limits.and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("Max open files"))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|soft| soft.parse::<u64>().ok())
        });
        ProcessSample {
            cpu_seconds,
            resident_bytes: status_kib("VmRSS:"),
            virtual_bytes: status_kib("VmSize:"),
            open_fds: open_fds.and_then(|count| u64::try_from(count).ok()),
            max_fds,
            start_time_seconds,
        }
    }
}

/// The content type of [`encode`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn process_metrics_parse_procs_texts() {
        let stat = "4242 (a (strange) name) S 1 4242 4242 0 -1 4194560 1000 0 0 0 \
                    250 50 0 0 20 0 9 0 12345 104857600 2560 18446744073709551615";
        let status = "Name:\tbootstrap\nVmSize:\t  102400 kB\nVmRSS:\t    10240 kB\n";
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max cpu time              unlimited            unlimited            seconds\n\
                      Max open files            1024                 524288               files\n";
        let system = "cpu  1 2 3\nbtime 1700000000\nprocesses 5\n";
        let sample = ProcessSample::parse(
            Some(stat),
            Some(status),
            Some(limits),
            Some(system),
            Some(7),
        );
        assert_eq!(
            sample,
            ProcessSample {
                cpu_seconds: Some(3.0),
                resident_bytes: Some(10240 * 1024),
                virtual_bytes: Some(102_400 * 1024),
                open_fds: Some(7),
                max_fds: Some(1024),
                start_time_seconds: Some(1_700_000_123.45),
            }
        );
        // Nothing readable: nothing reported, rather than zeros.
        assert_eq!(
            ProcessSample::parse(None, None, None, None, None),
            ProcessSample::default()
        );
    }

    /// The scrape of this very process: every conventional name, with values it can have.
    #[test]
    fn process_metrics_are_this_processs() {
        let text = encode_merged(&new_registry(), &[process_registry()]).unwrap();
        let value = |name: &str| -> f64 {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .unwrap_or_else(|| panic!("{name} missing in\n{text}"))
                .parse()
                .unwrap()
        };
        let resident = value("process_resident_memory_bytes");
        assert!(resident > 1024.0 * 1024.0, "{resident}");
        assert!(value("process_virtual_memory_bytes") >= resident);
        assert!(value("process_cpu_seconds_total") >= 0.0);
        let open = value("process_open_fds");
        let max = value("process_max_fds");
        assert!(open >= 3.0 && open <= max, "{open} of {max}");
        let start = value("process_start_time_seconds");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(start > 1.6e9 && start <= now + 1.0, "{start} vs {now}");
        let build = format!(
            "bootstrap_build_info{{version=\"{}\",commit=\"{}\"}} 1",
            crate::build_info::VERSION,
            crate::build_info::COMMIT
        );
        assert!(text.contains(&build), "{build} missing in\n{text}");
        assert!(
            text.contains("# TYPE process_cpu_seconds counter"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn merged_registries_give_each_family_once_with_every_tenants_samples() {
        let mut main = new_registry();
        RunnerMetrics::register(&mut main);
        let tenants: Vec<Arc<Registry>> = ["tenants/a", "tenants/b"]
            .into_iter()
            .map(|tenant| {
                let mut registry = TenantRegistry::new();
                let metrics = RunnerMetrics::register(&mut registry);
                metrics.pass("system-namespaces", "success", Duration::from_millis(3));
                Arc::new(tenant_registry(tenant.to_owned(), registry))
            })
            .collect();
        let text = encode_merged(&main, &tenants).unwrap();
        let type_lines = text
            .lines()
            .filter(|line| *line == "# TYPE bootstrap_loop_passes counter")
            .count();
        assert_eq!(type_lines, 1, "{text}");
        for tenant in ["tenants/a", "tenants/b"] {
            let sample = format!(
                "bootstrap_loop_passes_total{{tenant=\"{tenant}\",loop=\"system-namespaces\",result=\"success\"}} 1"
            );
            assert!(text.contains(&sample), "missing {sample} in\n{text}");
        }
        // Samples of a family directly follow its descriptors: no other family in between.
        let lines: Vec<&str> = text.lines().collect();
        let first = lines
            .iter()
            .position(|l| l.starts_with("bootstrap_loop_passes_total"))
            .unwrap();
        let last = lines
            .iter()
            .rposition(|l| l.starts_with("bootstrap_loop_passes_total"))
            .unwrap();
        assert!(
            lines[first..=last]
                .iter()
                .all(|l| l.starts_with("bootstrap_loop_passes_total")),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    /// A tenant's runtime registered the way management mode registers it: the runner's
    /// metrics, a limited cache budget's and a loop's (in its sub-registry), with samples.
    fn tenant_metrics(registry: &mut dyn MetricRegistry, passes: u32) {
        use reconcilers::budget::{BudgetLimits, CacheBudget};
        let limits = BudgetLimits {
            max_objects: 10,
            max_bytes: 1000,
        };
        drop(CacheBudget::new(limits, "", None, registry));
        let metrics = RunnerMetrics::register(registry);
        register_etcd_mode(registry, false);
        let loop_metrics = reconcilers::nodeport_repair::NodePortMetrics::register(registry);
        metrics.init_loop("nodeport-repair", Duration::from_secs(60), true);
        for _ in 0..passes {
            metrics.pass("nodeport-repair", "success", Duration::from_millis(3));
            metrics.heal("nodeport-repair", Duration::from_millis(20));
            metrics.drift("nodeport-repair", "leak", true);
        }
        loop_metrics
            .port_errors
            .get_or_create(&[("type", "leak")])
            .inc_by(u64::from(passes));
    }

    /// What a tenant's shared descriptors expose is what a registry of its own labelled `tenant`
    /// exposes: names, HELP/TYPE/UNIT lines, samples with the tenant label first.
    #[test]
    fn a_tenants_registry_exposes_what_a_labelled_registry_of_its_own_does() {
        let mut own = Registry::with_prefix_and_labels(
            METRICS_PREFIX,
            [(
                std::borrow::Cow::Borrowed("tenant"),
                std::borrow::Cow::Borrowed("tenants/a"),
            )]
            .into_iter(),
        );
        tenant_metrics(&mut own, 2);
        let mut shared = TenantRegistry::new();
        tenant_metrics(&mut shared, 2);
        let shared = tenant_registry("tenants/a".to_owned(), shared);
        let expected = encode(&own).unwrap();
        assert!(
            expected.contains(
                "bootstrap_nodeport_repair_port_errors_total{tenant=\"tenants/a\",type=\"leak\"} 2"
            ),
            "{expected}"
        );
        assert!(
            expected.contains("# UNIT bootstrap_loop_heal_duration_seconds seconds"),
            "{expected}"
        );
        let shared = encode(&shared).unwrap();
        // The families in the same order with the same descriptors; the series of a family come
        // in its hash map's order, which differs from one map to the next.
        let descriptors = |text: &str| -> Vec<String> {
            text.lines()
                .filter(|line| line.starts_with('#'))
                .map(str::to_owned)
                .collect()
        };
        assert_eq!(descriptors(&shared), descriptors(&expected));
        let sorted = |text: &str| -> Vec<String> {
            let mut lines: Vec<String> = text.lines().map(str::to_owned).collect();
            lines.sort();
            lines
        };
        assert_eq!(sorted(&shared), sorted(&expected));
    }

    /// Two tenants' samples stay apart under one HELP/TYPE, and a stopped tenant (its registry
    /// dropped from what `/metrics` merges) leaves no sample behind.
    #[test]
    fn tenants_samples_stay_apart_and_a_removed_tenants_are_gone() {
        let mut main = new_registry();
        drop(RunnerMetrics::register(&mut main));
        let tenant = |name: &str, passes: u32| {
            let mut registry = TenantRegistry::new();
            tenant_metrics(&mut registry, passes);
            Arc::new(tenant_registry(name.to_owned(), registry))
        };
        let a = tenant("tenants/a", 1);
        let b = tenant("tenants/b", 3);
        let text = encode_merged(&main, &[a.clone(), b.clone()]).unwrap();
        for (tenant, passes) in [("tenants/a", 1), ("tenants/b", 3)] {
            for sample in [
                format!(
                    "bootstrap_loop_passes_total{{tenant=\"{tenant}\",loop=\"nodeport-repair\",result=\"success\"}} {passes}"
                ),
                format!(
                    "bootstrap_nodeport_repair_port_errors_total{{tenant=\"{tenant}\",type=\"leak\"}} {passes}"
                ),
                format!(
                    "bootstrap_loop_heal_duration_seconds_count{{tenant=\"{tenant}\",loop=\"nodeport-repair\"}} {passes}"
                ),
            ] {
                assert!(text.contains(&sample), "missing {sample} in\n{text}");
            }
        }
        for family in [
            "# TYPE bootstrap_loop_passes counter",
            "# HELP bootstrap_nodeport_repair_port_errors Number of node port problems found by the repair loop, counted when each appears, by type.",
            "# TYPE bootstrap_cache_bytes gauge",
        ] {
            assert_eq!(
                text.lines().filter(|l| *l == family).count(),
                1,
                "{family} in\n{text}"
            );
        }

        drop(a);
        let text = encode_merged(&main, &[b]).unwrap();
        assert!(!text.contains("tenants/a"), "{text}");
        assert!(
            text.contains(
                "bootstrap_nodeport_repair_port_errors_total{tenant=\"tenants/b\",type=\"leak\"} 3"
            ),
            "{text}"
        );
    }

    #[test]
    fn encodes_loop_metrics_with_loop_label() {
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        metrics.init_loop("system-namespaces", Duration::from_secs(60), true);
        metrics.pass("system-namespaces", "success", Duration::from_millis(3));
        metrics.success("system-namespaces");
        metrics.drift("system-namespaces", "namespace_missing", true);
        metrics.drift("system-namespaces", "namespace_missing", false);
        metrics.error("system-namespaces", "connection");
        let text = encode(&registry).unwrap();
        for expected in [
            "bootstrap_loop_passes_total{loop=\"system-namespaces\",result=\"success\"} 1",
            "bootstrap_loop_passes_total{loop=\"system-namespaces\",result=\"panic\"} 0",
            "bootstrap_loop_drift_found_total{loop=\"system-namespaces\",kind=\"namespace_missing\"} 2",
            "bootstrap_loop_drift_repaired_total{loop=\"system-namespaces\",kind=\"namespace_missing\"} 1",
            "bootstrap_loop_errors_total{loop=\"system-namespaces\",category=\"connection\"} 1",
            "bootstrap_loop_pass_duration_seconds_count{loop=\"system-namespaces\"} 1",
            "bootstrap_loop_last_success_timestamp_seconds{loop=\"system-namespaces\"}",
            "# EOF",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
    }
}

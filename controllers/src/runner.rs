//! The runner: drives independent loops ([`Reconciler`]s).
//!
//! Each loop gets one task. It runs a pass at start, then again when its interval (plus a little
//! jitter, so replicas and loops do not synchronise) elapses or a trigger fires (debounced),
//! whichever comes first. Passes of one loop never overlap. A failed pass is retried with jittered
//! exponential backoff capped at the loop's interval; a panicking pass is caught, counted and
//! retried the same way. Loops that need leadership run only while the leader channel says so, and
//! run at once on gaining it; losing it abandons a running pass.
//!
//! Trigger streams are polled in their own tasks from start to shutdown, also in `--timer-only`
//! mode and while the loop waits for leadership, so reflectors inside them stay fresh.
//!
//! A cluster's runner (the process's own cluster, or one tenant's) is built from the effective
//! configuration by [`build_runner`]: each enabled section in [`Loops`] builds its own loop (see
//! [`reconcilers::section`]). A loop that is disabled is not built at all (no watches, no
//! metrics, not part of `/readyz`).
//!
//! [`Loops`]: crate::config::Loops

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backon::BackoffBuilder;
use futures::{FutureExt, StreamExt};
use rand::Rng;
use reconcilers::sanitize::Sanitized;
use reconcilers::{LoopError, PassContext, PassReport, Reconciler, Trigger};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, error, info, info_span, warn};

use prometheus_client::registry::Registry;
use reconcilers::apiserver_endpoints::ConfigLoader;
use reconcilers::budget::{BudgetLimits, CacheBudget};
use reconcilers::metrics::MetricRegistry;
use reconcilers::section::BuildContext;

use crate::config::Config;
use crate::health::Health;
use crate::metrics::RunnerMetrics;

/// How the runner schedules passes.
#[derive(Clone, Debug)]
pub struct RunnerOptions {
    /// Passed to every pass: compute and report writes without making them.
    pub dry_run: bool,
    /// Ignore trigger items (streams are still polled).
    pub timer_only: bool,
    /// Quiet time after a trigger before the pass starts, so a burst of events makes one pass.
    pub debounce: Duration,
    /// Up to this fraction of the interval is added at random to each wait.
    pub jitter: f64,
    /// First retry delay after a failed pass; doubles up to the loop's interval.
    pub min_backoff: Duration,
    /// Bound for graceful shutdown: finishing running passes plus every loop's shutdown hook.
    pub shutdown_timeout: Duration,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        RunnerOptions {
            dry_run: false,
            timer_only: false,
            debounce: reconcilers::contract::DEFAULT_DEBOUNCE,
            jitter: 0.1,
            min_backoff: Duration::from_millis(200),
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

/// Every enabled loop of the one cluster of `--kubeconfig`, ready for the runner.
pub fn build_loops(
    config: &Config,
    client: &kube::Client,
    registry: &mut Registry,
) -> Vec<Arc<dyn Reconciler>> {
    let budget = CacheBudget::new(BudgetLimits::UNLIMITED, "", None, registry);
    build_cluster_loops(config, client, kubeconfig_loader(config), &budget, registry)
}

/// Reads `--kubeconfig` again when a loop needs the configuration (the apiserver probe).
pub fn kubeconfig_loader(config: &Config) -> ConfigLoader {
    let kubeconfig = config.kubeconfig.clone();
    Arc::new(move || {
        let kubeconfig = kubeconfig.clone();
        Box::pin(async move {
            crate::kubeconfig::load(kubeconfig.as_deref())
                .await
                .map_err(Into::into)
        })
    })
}

/// The runtime of one cluster: its loops, their runner and the runner's metrics in `registry`.
/// The single-cluster mode makes one (with an unlimited cache budget); management mode one per
/// tenant, each within its own budget.
pub fn build_runner(
    config: &Config,
    client: &kube::Client,
    load_kubeconfig: ConfigLoader,
    budget: &CacheBudget,
    registry: &mut dyn MetricRegistry,
) -> Runner {
    let metrics = RunnerMetrics::register(registry);
    crate::metrics::register_etcd_mode(registry, !config.settings.etcd.servers.is_empty());
    let loops = build_cluster_loops(config, client, load_kubeconfig, budget, registry);
    let options = RunnerOptions {
        dry_run: config.dry_run,
        timer_only: config.timer_only,
        shutdown_timeout: config.shutdown_timeout,
        ..RunnerOptions::default()
    };
    Runner::new(loops, client.clone(), options, metrics)
}

/// Every enabled loop of one cluster: the one of `--kubeconfig`, or one tenant in management
/// mode (whose kubeconfig comes from its Secret, hence `load_kubeconfig`).
fn build_cluster_loops(
    config: &Config,
    client: &kube::Client,
    load_kubeconfig: ConfigLoader,
    budget: &CacheBudget,
    registry: &mut dyn MetricRegistry,
) -> Vec<Arc<dyn Reconciler>> {
    let mut context = BuildContext::new(
        client.clone(),
        registry,
        &config.settings,
        config.loops.kubernetes_service.service(),
        budget.clone(),
        load_kubeconfig,
    );
    let mut loops = Vec::new();
    for (key, section) in config.loops.sections() {
        if !section.enabled() {
            info!("loops.{key} disabled by configuration");
            continue;
        }
        match section.build(&mut context) {
            Ok(built) => loops.extend(built),
            // Configuration validation checks the same; never panic on it.
            Err(err) => warn!("loops.{key} not built: {err}"),
        }
    }
    loops
}

// ------------------------------------------------------------------------------------------------
// Runner
// ------------------------------------------------------------------------------------------------

/// Drives a set of loops until cancelled.
pub struct Runner {
    loops: Vec<Arc<dyn Reconciler>>,
    client: kube::Client,
    options: RunnerOptions,
    metrics: RunnerMetrics,
    health: Health,
}

impl Runner {
    pub fn new(
        loops: Vec<Arc<dyn Reconciler>>,
        client: kube::Client,
        options: RunnerOptions,
        metrics: RunnerMetrics,
    ) -> Self {
        let health = Health::default();
        for reconciler in &loops {
            let name = reconciler.name();
            let needs_leadership = reconciler.needs_leadership();
            health.update(name, |status| status.needs_leadership = needs_leadership);
            metrics.init_loop(name, reconciler.interval(), !needs_leadership);
        }
        Runner {
            loops,
            client,
            options,
            metrics,
            health,
        }
    }

    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// The loops' names, in build order (for the start-up log).
    pub fn loop_names(&self) -> Vec<&'static str> {
        self.loops.iter().map(|l| l.name()).collect()
    }

    /// Runs every loop until `cancel` fires, then shuts down gracefully within
    /// [`RunnerOptions::shutdown_timeout`]: running passes finish, each loop's shutdown hook runs,
    /// and then the triggers stop.
    pub async fn run(self, leader: watch::Receiver<bool>, cancel: CancellationToken) {
        let Runner {
            loops,
            client,
            options,
            metrics,
            health,
        } = self;
        let options = Arc::new(options);
        let ctx = PassContext {
            client,
            dry_run: options.dry_run,
            leader: leader.clone(),
        };
        // Not a child of `cancel`: the triggers keep the caches fed until the shutdown hooks,
        // which may read them, have run.
        let trigger_cancel = CancellationToken::new();
        let mut trigger_tasks = JoinSet::new();
        let mut loop_tasks = JoinSet::new();
        for reconciler in loops {
            let span = info_span!("loop", r#loop = reconciler.name());
            let (triggers, triggered_at) = spawn_triggers(
                &mut trigger_tasks,
                span.clone(),
                reconciler.triggers(),
                options.timer_only,
                trigger_cancel.clone(),
            );
            let task = LoopTask {
                reconciler,
                ctx: ctx.clone(),
                options: options.clone(),
                metrics: metrics.clone(),
                health: health.clone(),
                leader: leader.clone(),
                triggers,
                triggered_at,
                cancel: cancel.clone(),
            };
            loop_tasks.spawn(task.run().instrument(span));
        }

        cancel.cancelled().await;
        info!(
            timeout = ?options.shutdown_timeout,
            "shutting down: letting running passes finish, running shutdown hooks"
        );
        let drain = async {
            while let Some(joined) = loop_tasks.join_next().await {
                if let Err(err) = joined
                    && err.is_panic()
                {
                    error!("a loop task panicked during shutdown: {err}");
                }
            }
        };
        if tokio::time::timeout(options.shutdown_timeout, drain)
            .await
            .is_err()
        {
            warn!(
                timeout = ?options.shutdown_timeout,
                "graceful shutdown timed out; abandoning the remaining passes and shutdown hooks"
            );
            loop_tasks.abort_all();
        }
        trigger_cancel.cancel();
        trigger_tasks.abort_all();
        info!("all loops stopped");
    }
}

/// When the first trigger item not yet covered by a pass arrived (the start of a heal).
type TriggeredAt = Arc<Mutex<Option<Instant>>>;

/// What one of a loop's trigger streams did.
enum Fired {
    Item,
    Ended(usize),
    Panicked(usize, String),
}

/// Spawns one task that polls every trigger stream of a loop, inside the loop's `span`; returns
/// the receiver that counts trigger items, and when the first item since the loop last took it
/// arrived. One task a loop rather than one a stream: a tenant keeps a task and its state for
/// each, at rest.
fn spawn_triggers(
    tasks: &mut JoinSet<()>,
    span: tracing::Span,
    triggers: Vec<Trigger>,
    timer_only: bool,
    cancel: CancellationToken,
) -> (watch::Receiver<u64>, TriggeredAt) {
    let (sender, receiver) = watch::channel(0u64);
    let triggered_at = TriggeredAt::default();
    if triggers.is_empty() {
        return (receiver, triggered_at);
    }
    let count = triggers.len();
    let streams = triggers.into_iter().enumerate().map(|(index, stream)| {
        AssertUnwindSafe(stream)
            .catch_unwind()
            .map(move |item| match item {
                Ok(()) => Fired::Item,
                Err(panic) => Fired::Panicked(index, panic_message(&*panic)),
            })
            .chain(futures::stream::iter([Fired::Ended(index)]))
    });
    let mut fired = futures::stream::select_all(streams);
    let taken = triggered_at.clone();
    let poll = async move {
        // A stream that panicked ends right after; its end is not reported a second time.
        let mut panicked = vec![false; count];
        loop {
            let item = tokio::select! {
                biased;
                _ = cancel.cancelled() => return,
                item = fired.next() => item,
            };
            match item {
                Some(Fired::Item) => {
                    if !timer_only {
                        taken
                            .lock()
                            .unwrap_or_else(|poison| poison.into_inner())
                            .get_or_insert_with(Instant::now);
                        sender.send_modify(|generation| *generation = generation.wrapping_add(1));
                    }
                }
                Some(Fired::Ended(index)) => {
                    if !panicked.get(index).copied().unwrap_or(false) {
                        warn!(
                            trigger = index,
                            "trigger stream ended; the loop keeps running on its interval"
                        );
                    }
                }
                Some(Fired::Panicked(index, panic)) => {
                    if let Some(flag) = panicked.get_mut(index) {
                        *flag = true;
                    }
                    error!(
                        trigger = index,
                        panic, "trigger stream panicked; the loop keeps running on its interval"
                    );
                }
                None => return,
            }
        }
    };
    tasks.spawn(poll.instrument(span));
    (receiver, triggered_at)
}

struct LoopTask {
    reconciler: Arc<dyn Reconciler>,
    ctx: PassContext,
    options: Arc<RunnerOptions>,
    metrics: RunnerMetrics,
    health: Health,
    leader: watch::Receiver<bool>,
    triggers: watch::Receiver<u64>,
    triggered_at: TriggeredAt,
    cancel: CancellationToken,
}

/// Why the wait between passes ended.
enum Wake {
    Timer,
    Trigger,
    LostLeadership,
    Cancelled,
}

/// The fight streak after a successful pass: one more when a triggered pass repaired drift
/// again, else none; warned about once, when it reaches [`FIGHT_STREAK_THRESHOLD`].
fn fight_streak_after(streak: u32, triggered_repair: bool) -> u32 {
    if !triggered_repair {
        return 0;
    }
    let streak = streak.saturating_add(1);
    if streak == FIGHT_STREAK_THRESHOLD {
        warn!(
            passes = streak,
            "every triggered pass repairs drift again; another controller may be undoing these writes; slowing down triggered passes"
        );
    }
    streak
}

impl LoopTask {
    async fn run(mut self) {
        let name = self.reconciler.name();
        let interval = self.reconciler.interval();
        let gated = self.reconciler.needs_leadership();
        debug!(?interval, needs_leadership = gated, "loop started");
        let mut backoff: Option<backon::ExponentialBackoff> = None;
        let mut triggers_open = true;
        // Trigger-woken passes in a row that repaired again, or nothing (`streaks_after`).
        let mut streaks = (0, 0);
        let mut woken_by_trigger = false;
        // Drift left as it is (report-only, dry run) is logged and counted when it appears, not
        // again on every pass while it lasts.
        let unapplied = reconcilers::findings::ReportOnce::new();
        // The trigger a heal is timed from: kept through failed passes until one succeeds.
        let mut heal_since: Option<Instant> = None;

        'passes: loop {
            if gated && !self.wait_for_leadership().await {
                break 'passes;
            }
            // Triggers seen before the pass starts are covered by it.
            self.triggers.borrow_and_update();
            let triggered_at = self
                .triggered_at
                .lock()
                .unwrap_or_else(|poison| poison.into_inner())
                .take();
            heal_since = heal_since.or(triggered_at);

            // Boxed, as the shutdown below: a loop spends its life waiting, and its task keeps
            // the size of its largest state, a pass's (about 1.5 KiB a loop, six loops a tenant).
            let reported = unapplied.reported();
            let wait = match Box::pin(self.pass(interval, gated, &unapplied)).await {
                None => {
                    warn!("lost leadership during a pass; abandoned it");
                    heal_since = None;
                    continue 'passes;
                }
                Some(Ok(report)) => {
                    backoff = None;
                    let repaired = report.drift.iter().any(|drift| drift.applied);
                    if let Some(since) = heal_since.take()
                        && repaired
                    {
                        self.metrics.heal(name, since.elapsed());
                    }
                    let found = repaired || unapplied.reported() > reported;
                    streaks = streaks_after(streaks, woken_by_trigger, repaired, found);
                    self.succeeded();
                    with_jitter(interval, self.options.jitter)
                }
                Some(Err(reason)) => {
                    let delay = backoff
                        .get_or_insert_with(|| new_backoff(self.options.min_backoff, interval))
                        .next()
                        .unwrap_or(interval)
                        .min(interval);
                    self.failed(&reason, delay);
                    delay
                }
            };
            if self.cancel.is_cancelled() {
                break 'passes;
            }

            // After a failure a trigger (someone fixed what the pass tripped over) still wakes
            // the loop, but no sooner than a second later, so a burst of events cannot turn a
            // failing API into a retry storm.
            let listen_to_triggers = !self.options.timer_only;
            let mut debounce = trigger_delay(streaks, self.options.debounce, interval);
            if backoff.is_some() {
                debounce = debounce.max(wait.min(FAILING_TRIGGER_DELAY));
            }
            woken_by_trigger = false;
            match self
                .wait(
                    wait,
                    debounce,
                    gated,
                    listen_to_triggers,
                    &mut triggers_open,
                )
                .await
            {
                Wake::Timer => {}
                Wake::LostLeadership => heal_since = None,
                Wake::Trigger => {
                    woken_by_trigger = true;
                    debug!("triggered");
                }
                Wake::Cancelled => break 'passes,
            }
        }

        Box::pin(self.shutdown()).await;
    }

    /// One pass within its timeout; `None` when leadership was lost during it (a loop that
    /// needs it).
    async fn pass(
        &mut self,
        interval: Duration,
        gated: bool,
        unapplied: &reconcilers::findings::ReportOnce<(&'static str, String, String)>,
    ) -> Option<Result<PassReport, PassError>> {
        let name = self.reconciler.name();
        let pass_timeout = pass_timeout(interval);
        let metrics = self.metrics.clone();
        let pass = async {
            match tokio::time::timeout(
                pass_timeout,
                run_pass(&*self.reconciler, &self.ctx, &self.metrics, unapplied),
            )
            .await
            {
                Ok(outcome) => outcome,
                Err(_) => {
                    metrics.pass(name, "failure", pass_timeout);
                    metrics.error(name, "timeout");
                    Err(PassError::TimedOut(pass_timeout))
                }
            }
        };
        if gated {
            tokio::select! {
                outcome = pass => Some(outcome),
                _ = lost_leadership(&mut self.leader) => None,
            }
        } else {
            Some(pass.await)
        }
    }

    /// A pass succeeded: `/readyz` and the metrics say so, and a loop that was failing says it
    /// works again.
    fn succeeded(&self) {
        let name = self.reconciler.name();
        let failures_before = self
            .health
            .status(name)
            .map_or(0, |status| status.consecutive_failures);
        if failures_before > 0 {
            info!(failed_passes = failures_before, "pass succeeded again");
        }
        self.health.update(name, |status| {
            status.succeeded = true;
            status.passes += 1;
            status.consecutive_failures = 0;
            status.last_error = None;
        });
        self.metrics.set_ready(name, true);
    }

    /// A pass failed and the next is in `delay`: said once when the failure is new (or at info
    /// while it is normal for a moment after start), and recorded for `/readyz`.
    fn failed(&self, reason: &PassError, delay: Duration) {
        let name = self.reconciler.name();
        // What an API says in its errors is outside text: in management mode, a tenant's API
        // server writes it.
        let message = Sanitized::of(reason).into_string();
        let before = self.health.status(name).unwrap_or_default();
        match failure_log(
            reason,
            &message,
            before.last_error.as_deref(),
            before.consecutive_failures,
        ) {
            FailureLog::Warn if matches!(reason, PassError::Panicked(_)) => {
                error!(error = %message, retry_in = ?delay, "pass panicked; retrying with backoff (the same panic again is logged at debug level)")
            }
            FailureLog::Warn => {
                warn!(error = %message, retry_in = ?delay, "pass failed; retrying with backoff (the same failure again is logged at debug level)")
            }
            FailureLog::NotYet(why) => {
                info!(retry_in = ?delay, "pass deferred: {why}")
            }
            FailureLog::Again => {
                debug!(error = %message, retry_in = ?delay, "pass failed again")
            }
        }
        self.health.update(name, |status| {
            status.passes += 1;
            status.consecutive_failures += 1;
            status.last_error = Some(message);
        });
    }

    /// Returns false if cancelled while waiting.
    async fn wait_for_leadership(&mut self) -> bool {
        let name = self.reconciler.name();
        let mut announced = false;
        loop {
            let is_leader = *self.leader.borrow_and_update();
            self.health
                .update(name, |status| status.standby = !is_leader);
            self.metrics.set_active(name, is_leader);
            if !is_leader {
                self.metrics.clear_unrepaired(name);
            }
            if is_leader {
                if announced {
                    info!("became leader; running a pass now");
                    // Events seen as a standby did not wake this pass: the election did.
                    self.triggered_at
                        .lock()
                        .unwrap_or_else(|poison| poison.into_inner())
                        .take();
                }
                return true;
            }
            if !announced {
                info!("not the leader; waiting for leadership");
                announced = true;
            }
            tokio::select! {
                _ = self.cancel.cancelled() => return false,
                changed = self.leader.changed() => {
                    if changed.is_err() {
                        // Nobody can make us leader any more: wait for shutdown.
                        self.cancel.cancelled().await;
                        return false;
                    }
                }
            }
        }
    }

    async fn wait(
        &mut self,
        delay: Duration,
        debounce: Duration,
        gated: bool,
        listen_to_triggers: bool,
        triggers_open: &mut bool,
    ) -> Wake {
        let sleep = tokio::time::sleep(delay);
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                _ = self.cancel.cancelled() => return Wake::Cancelled,
                _ = &mut sleep => return Wake::Timer,
                _ = lost_leadership(&mut self.leader), if gated => return Wake::LostLeadership,
                changed = self.triggers.changed(), if listen_to_triggers && *triggers_open => {
                    if changed.is_err() {
                        *triggers_open = false;
                        continue;
                    }
                    tokio::select! {
                        _ = self.cancel.cancelled() => return Wake::Cancelled,
                        _ = tokio::time::sleep(debounce) => return Wake::Trigger,
                    }
                }
            }
        }
    }

    async fn shutdown(&self) {
        let started = Instant::now();
        match invoke(|| self.reconciler.shutdown(&self.ctx)).await {
            Ok(Ok(())) => info!(took = ?started.elapsed(), "loop stopped"),
            Ok(Err(err)) => warn!(error = %Sanitized::of(&err), "shutdown hook failed"),
            Err(panic) => error!(panic = panic_message(&*panic), "shutdown hook panicked"),
        }
    }
}

/// Resolves once the leader channel says "not leader". Never resolves if the channel closed while
/// leader (nobody can take leadership away any more).
async fn lost_leadership(leader: &mut watch::Receiver<bool>) {
    if leader.wait_for(|is_leader| !*is_leader).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// Quiet time before a triggered retry of a failed pass.
const FAILING_TRIGGER_DELAY: Duration = Duration::from_secs(1);

/// Triggered passes that keep repairing drift before the runner slows them down.
const FIGHT_STREAK_THRESHOLD: u32 = 5;

/// The streaks `(fight, idle)` after a successful pass: trigger-woken passes in a row that still
/// had to repair something (a sign that another actor undoes our writes), or that found nothing,
/// neither a repair nor drift new since the last pass (events that change nothing the loop
/// keeps: a busy allocator, or a tenant's etcd or API writing for the sake of it, each a whole
/// pass, a bitmap of megabytes decoded). Either would otherwise become a hot loop. A pass the
/// timer woke ends the idle streak: triggers had left the loop alone for its interval.
fn streaks_after(
    (fight, idle): (u32, u32),
    woken_by_trigger: bool,
    repaired: bool,
    found: bool,
) -> (u32, u32) {
    let fight = fight_streak_after(fight, woken_by_trigger && repaired);
    let idle = match (woken_by_trigger, found) {
        (true, false) => idle.saturating_add(1),
        _ => 0,
    };
    (fight, idle)
}

/// Triggered passes in a row that repair nothing before the runner slows them down.
const IDLE_STREAK_THRESHOLD: u32 = 20;

/// The longest quiet time before a triggered pass while triggers keep changing nothing: a
/// repair that events bring stays within a second.
const IDLE_TRIGGER_DELAY: Duration = Duration::from_secs(1);

/// Quiet time before a triggered pass, by the streaks of triggered passes (repairing again,
/// repairing nothing): the debounce, then doubling from 100 ms once the loop seems to fight
/// another actor, up to the loop's interval (where the timer takes over anyway), or once
/// triggers keep changing nothing, up to [`IDLE_TRIGGER_DELAY`].
fn trigger_delay(
    (fight_streak, idle_streak): (u32, u32),
    debounce: Duration,
    interval: Duration,
) -> Duration {
    let (streak, threshold, most) = if fight_streak >= FIGHT_STREAK_THRESHOLD {
        (fight_streak, FIGHT_STREAK_THRESHOLD, interval)
    } else if idle_streak >= IDLE_STREAK_THRESHOLD {
        (
            idle_streak,
            IDLE_STREAK_THRESHOLD,
            IDLE_TRIGGER_DELAY.min(interval),
        )
    } else {
        return debounce;
    };
    let doublings = (streak - threshold).min(20);
    (Duration::from_millis(100) * 2u32.pow(doublings))
        .min(most)
        .max(debounce)
}

/// How a failed pass is logged.
#[derive(Debug, PartialEq, Eq)]
enum FailureLog {
    Warn,
    /// At info: the pass cannot run yet, as is normal for a moment after start-up.
    NotYet(String),
    /// At debug: the failure logged last time, again.
    Again,
}

/// Retries a pass may spend deferred ([`LoopError::not_yet`]) before that is warned about: with
/// the default backoff (200 ms doubling, capped at the interval) at least 32.6 s for a 10 s loop,
/// where a new cluster's namespaces and default ServiceCIDR take milliseconds to appear.
const NOT_YET_PATIENCE: u32 = 8;

/// Each kind of failure is warned about once: an outage that lasts fails every retry the same way,
/// and the first line says all there is. A pass that cannot run yet (a namespace or a cache another
/// loop provides, on a new cluster) is expected for a moment, so it is a warning only once it
/// has lasted.
fn failure_log(
    reason: &PassError,
    message: &str,
    last_error: Option<&str>,
    failures_before: u32,
) -> FailureLog {
    let repeated = last_error == Some(message);
    let not_yet = match reason {
        PassError::Failed(error) => error.not_yet(),
        PassError::Panicked(_) | PassError::TimedOut(_) => None,
    };
    match not_yet {
        Some(_) if failures_before == NOT_YET_PATIENCE => FailureLog::Warn,
        Some(why) if failures_before < NOT_YET_PATIENCE && !repeated => FailureLog::NotYet(why),
        _ if repeated => FailureLog::Again,
        _ => FailureLog::Warn,
    }
}

/// A hung request must not stall a loop forever: a pass gets twice its interval, at least 30 s
/// (slow APIs) and at most 10 min.
fn pass_timeout(interval: Duration) -> Duration {
    (interval * 2).clamp(Duration::from_secs(30), Duration::from_secs(600))
}

fn new_backoff(min: Duration, interval: Duration) -> backon::ExponentialBackoff {
    reconcilers::retry::backoff(min, interval).build()
}

fn with_jitter(interval: Duration, fraction: f64) -> Duration {
    if fraction <= 0.0 {
        return interval;
    }
    let extra = rand::rng().random_range(0.0..=fraction);
    interval.mul_f64(1.0 + extra)
}

fn panic_message(panic: &(dyn Any + Send)) -> String {
    if let Some(message) = panic.downcast_ref::<&str>() {
        (*message).to_owned()
    } else if let Some(message) = panic.downcast_ref::<String>() {
        message.clone()
    } else {
        "(non-string panic payload)".to_owned()
    }
}

/// A panic while building or polling a pass, as caught by [`invoke`].
type Panic = Box<dyn Any + Send>;

/// Calls a loop's hook (its pass, its shutdown) with panics caught, whether they happen while
/// the future is built or polled.
async fn invoke<F: Future>(call: impl FnOnce() -> F) -> Result<F::Output, Panic> {
    match std::panic::catch_unwind(AssertUnwindSafe(call)) {
        Ok(future) => AssertUnwindSafe(future).catch_unwind().await,
        Err(panic) => Err(panic),
    }
}

/// Drift left undone, as [`run_pass`] remembers it between passes.
type UnappliedDrift = reconcilers::findings::ReportOnce<(&'static str, String, String)>;

/// Why a pass gave no report; its message is the sentence for logs, `/readyz` and `check`.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    #[error(transparent)]
    Failed(#[from] LoopError),
    #[error("pass panicked: {0}")]
    Panicked(String),
    #[error("pass did not finish within {0:?}; abandoned it")]
    TimedOut(Duration),
}

/// Runs one pass, catching panics, recording metrics and logging drift. Drift left undone is
/// logged and counted when it first appears (`unapplied` remembers it across passes).
async fn run_pass(
    reconciler: &dyn Reconciler,
    ctx: &PassContext,
    metrics: &RunnerMetrics,
    unapplied: &UnappliedDrift,
) -> Result<PassReport, PassError> {
    let name = reconciler.name();
    let started = Instant::now();
    let result = invoke(|| reconciler.reconcile(ctx)).await;
    let took = started.elapsed();
    match result {
        Ok(Ok(report)) => {
            metrics.pass(name, "success", took);
            metrics.success(name);
            // One line per repair, in one shape whatever the loop.
            for drift in report.drift.iter().filter(|drift| drift.applied) {
                metrics.drift(name, drift.kind, true);
                let change = drift.change();
                info!(
                    "loop" = name,
                    object = %Sanitized::new(&drift.object),
                    kind = drift.kind,
                    action = %drift.action,
                    was = %Sanitized::new(&change.was),
                    became = %Sanitized::new(&change.became),
                    "repaired"
                );
            }
            let mut unrepaired = BTreeMap::<&'static str, i64>::new();
            for drift in report.drift.iter().filter(|drift| !drift.applied) {
                *unrepaired.entry(drift.kind).or_default() += 1;
            }
            metrics.set_unrepaired(name, &unrepaired);
            let undone = report
                .drift
                .iter()
                .filter(|drift| !drift.applied)
                .map(|drift| (drift.kind, drift.object.clone(), drift.message.clone()));
            for (kind, object, message) in unapplied.update(undone) {
                metrics.drift(name, kind, false);
                info!(object = %Sanitized::new(&object), kind, dry_run = ctx.dry_run, "drift: {}", Sanitized::new(&message));
            }
            debug!(?took, drift = report.drift.len(), "pass succeeded");
            Ok(report)
        }
        Ok(Err(err)) => {
            metrics.pass(name, "failure", took);
            metrics.error(name, err.category());
            Err(PassError::Failed(err))
        }
        Err(panic) => {
            metrics.pass(name, "panic", took);
            metrics.panic(name);
            metrics.error(name, "panic");
            let message = Sanitized::new(&panic_message(&*panic)).into_string();
            // Reported by what follows, once: `run` logs it as it retries (at error level when it
            // is new), `check` prints it in its result.
            debug!(panic = %message, "pass panicked");
            Err(PassError::Panicked(message))
        }
    }
}

// ------------------------------------------------------------------------------------------------
// One-shot (check)
// ------------------------------------------------------------------------------------------------

/// What one loop's dry-run pass found.
#[derive(Debug)]
pub struct CheckResult {
    pub name: &'static str,
    pub result: Result<PassReport, PassError>,
}

/// One dry-run pass of every loop, concurrently. Each loop's triggers are polled (and ignored)
/// so its caches fill; a pass that fails because a cache has not synced yet, or because the API
/// failed, is retried with backoff until `timeout`. A loop that reports invalid state fails at
/// once.
pub async fn check_once(
    loops: &[Arc<dyn Reconciler>],
    client: kube::Client,
    metrics: &RunnerMetrics,
    timeout: Duration,
) -> Vec<CheckResult> {
    let ctx = PassContext::leading(client, true);
    let cancel = CancellationToken::new();
    let mut trigger_tasks = JoinSet::new();
    let deadline = tokio::time::Instant::now() + timeout;
    let checks = loops.iter().map(|reconciler| {
        let span = info_span!("check", r#loop = reconciler.name());
        let _triggers = spawn_triggers(
            &mut trigger_tasks,
            span.clone(),
            reconciler.triggers(),
            true,
            cancel.clone(),
        );
        let ctx = ctx.clone();
        let reconciler = reconciler.clone();
        let metrics = metrics.clone();
        let name = reconciler.name();
        async move {
            let mut backoff = new_backoff(Duration::from_millis(100), Duration::from_secs(2));
            let unapplied = UnappliedDrift::default();
            loop {
                // A read the API stalls must not outlast the check's own timeout.
                let pass = run_pass(&*reconciler, &ctx, &metrics, &unapplied);
                let result = tokio::time::timeout_at(deadline, pass)
                    .await
                    .unwrap_or(Err(PassError::TimedOut(timeout)));
                // Waiting will not fix missing permissions, objects the loop cannot work with,
                // or a panic.
                let retry = matches!(&result, Err(PassError::Failed(err))
                    if !matches!(err.category(), "invalid" | "forbidden"));
                let delay = backoff.next().unwrap_or(Duration::from_secs(2));
                if !retry || tokio::time::Instant::now() + delay >= deadline {
                    return CheckResult { name, result };
                }
                if let Err(err) = &result {
                    debug!(error = %err, "check pass failed; retrying");
                }
                tokio::time::sleep(delay).await;
            }
        }
        .instrument(span)
    });
    let results = futures::future::join_all(checks).await;
    cancel.cancel();
    trigger_tasks.abort_all();
    results
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use futures::future::BoxFuture;
    use reconcilers::{Action, Drift, LoopError};
    use tokio::sync::{Notify, mpsc};

    use super::*;
    use crate::metrics::{encode, new_registry};
    use crate::test_log::Captured;

    /// A client whose every request fails: the fake loops never use it.
    fn offline_client() -> kube::Client {
        let service =
            tower::service_fn(|_request: axum::http::Request<kube::client::Body>| async {
                Err::<axum::http::Response<kube::client::Body>, _>(std::io::Error::other(
                    "unit tests have no cluster",
                ))
            });
        kube::Client::new(service, "default")
    }

    #[derive(Clone, Copy, Debug)]
    enum Step {
        Succeed,
        SucceedWithDrift,
        /// Succeeds with drift it only reports.
        ReportDrift,
        Fail,
        /// Fails with an error a hostile API server wrote: a forged line, an ESC sequence, a
        /// URL's password, a megabyte.
        FailHostile,
        /// Fails in a way retrying cannot fix.
        Invalid,
        Panic,
        /// Wait until `release` is notified, then succeed.
        Block,
    }

    struct Fake {
        name: &'static str,
        interval: Duration,
        needs_leadership: bool,
        /// Steps consumed one per pass; when empty, passes succeed.
        script: Mutex<VecDeque<Step>>,
        pass_delay: Duration,
        started: AtomicUsize,
        finished: AtomicUsize,
        running: AtomicUsize,
        max_running: AtomicUsize,
        shutdown_called: AtomicBool,
        finished_before_shutdown: AtomicUsize,
        release: Notify,
        triggers: Mutex<Vec<Trigger>>,
    }

    impl Fake {
        fn new(name: &'static str) -> Self {
            Fake {
                name,
                interval: Duration::from_secs(3600),
                needs_leadership: false,
                script: Mutex::new(VecDeque::new()),
                pass_delay: Duration::ZERO,
                started: AtomicUsize::new(0),
                finished: AtomicUsize::new(0),
                running: AtomicUsize::new(0),
                max_running: AtomicUsize::new(0),
                shutdown_called: AtomicBool::new(false),
                finished_before_shutdown: AtomicUsize::new(0),
                release: Notify::new(),
                triggers: Mutex::new(Vec::new()),
            }
        }

        fn script(self, steps: &[Step]) -> Self {
            *self.script.lock().unwrap() = steps.iter().copied().collect();
            self
        }

        /// A trigger the test fires by sending on the returned channel. `polled` counts items
        /// taken from the stream.
        fn with_trigger(self) -> (Self, mpsc::UnboundedSender<()>, Arc<AtomicUsize>) {
            let (sender, receiver) = mpsc::unbounded_channel::<()>();
            let polled = Arc::new(AtomicUsize::new(0));
            let counter = polled.clone();
            let stream = futures::stream::unfold(receiver, |mut receiver| async move {
                receiver.recv().await.map(|item| (item, receiver))
            })
            .inspect(move |_| {
                counter.fetch_add(1, Ordering::SeqCst);
            })
            .boxed();
            self.triggers.lock().unwrap().push(stream);
            (self, sender, polled)
        }
    }

    impl Reconciler for Fake {
        fn name(&self) -> &'static str {
            self.name
        }
        fn interval(&self) -> Duration {
            self.interval
        }
        fn needs_leadership(&self) -> bool {
            self.needs_leadership
        }
        fn triggers(&self) -> Vec<Trigger> {
            std::mem::take(&mut *self.triggers.lock().unwrap())
        }
        fn reconcile<'a>(
            &'a self,
            _ctx: &'a PassContext,
        ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
            Box::pin(async move {
                self.started.fetch_add(1, Ordering::SeqCst);
                let running = self.running.fetch_add(1, Ordering::SeqCst) + 1;
                self.max_running.fetch_max(running, Ordering::SeqCst);
                struct Leave<'a>(&'a AtomicUsize);
                impl Drop for Leave<'_> {
                    fn drop(&mut self) {
                        self.0.fetch_sub(1, Ordering::SeqCst);
                    }
                }
                let _leave = Leave(&self.running);
                tokio::time::sleep(self.pass_delay).await;
                let step = self
                    .script
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or(Step::Succeed);
                let result = match step {
                    Step::Succeed => Ok(PassReport::default()),
                    Step::SucceedWithDrift => Ok(PassReport {
                        drift: vec![Drift {
                            kind: "namespace_missing",
                            object: "Namespace/kube-public".to_owned(),
                            action: Action::Create,
                            message: "created".to_owned(),
                            applied: true,
                            change: None,
                        }],
                    }),
                    Step::ReportDrift => Ok(PassReport {
                        drift: vec![Drift {
                            kind: "service_cluster_ip",
                            object: "Service/default/kubernetes".to_owned(),
                            action: Action::Report,
                            message: "clusterIP is not the first IP of the range".to_owned(),
                            applied: false,
                            change: None,
                        }],
                    }),
                    Step::Fail => Err(LoopError::Other("scripted failure".to_owned())),
                    Step::FailHostile => Err(LoopError::Other(format!(
                        "ApiError: boom\nFORGED level=ERROR all good\x1b[31m https://u:topsecret@h/ {}",
                        "x".repeat(1024 * 1024)
                    ))),
                    Step::Invalid => Err(LoopError::Invalid("scripted invalid state".to_owned())),
                    Step::Panic => panic!("scripted panic"),
                    Step::Block => {
                        self.release.notified().await;
                        Ok(PassReport::default())
                    }
                };
                self.finished.fetch_add(1, Ordering::SeqCst);
                result
            })
        }
        fn shutdown<'a>(&'a self, _ctx: &'a PassContext) -> BoxFuture<'a, Result<(), LoopError>> {
            Box::pin(async move {
                self.finished_before_shutdown
                    .store(self.finished.load(Ordering::SeqCst), Ordering::SeqCst);
                self.shutdown_called.store(true, Ordering::SeqCst);
                Ok(())
            })
        }
    }

    struct Harness {
        health: Health,
        registry: prometheus_client::registry::Registry,
        cancel: CancellationToken,
        leader: watch::Sender<bool>,
        handle: tokio::task::JoinHandle<()>,
    }

    fn start(loops: Vec<Arc<dyn Reconciler>>, options: RunnerOptions, leader: bool) -> Harness {
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        let runner = Runner::new(loops, offline_client(), options, metrics);
        let health = runner.health();
        let cancel = CancellationToken::new();
        let (leader_tx, leader_rx) = watch::channel(leader);
        let handle = tokio::spawn(runner.run(leader_rx, cancel.clone()));
        Harness {
            health,
            registry,
            cancel,
            leader: leader_tx,
            handle,
        }
    }

    fn options() -> RunnerOptions {
        RunnerOptions {
            min_backoff: Duration::from_millis(10),
            shutdown_timeout: Duration::from_secs(20),
            ..RunnerOptions::default()
        }
    }

    /// Polls until `condition` holds; fails after a generous timeout (slow CI machines).
    async fn eventually(what: &str, condition: impl Fn() -> bool) {
        let holds = || std::future::ready(condition());
        if let Err(err) = test_support::eventually(what, Duration::from_secs(20), holds).await {
            panic!("{err}");
        }
    }

    async fn stop(harness: Harness) {
        harness.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(30), harness.handle)
            .await
            .expect("runner stops within its shutdown timeout")
            .unwrap();
    }

    #[tokio::test]
    async fn runs_once_at_start_and_becomes_ready() {
        let fake = Arc::new(Fake::new("a").script(&[Step::SucceedWithDrift]));
        let harness = start(vec![fake.clone()], options(), true);
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        eventually("ready", || harness.health.readiness().ready).await;
        assert_eq!(harness.health.readiness().lines, ["[+]a ok"]);
        let text = encode(&harness.registry).unwrap();
        assert!(
            text.contains(
                "bootstrap_loop_drift_repaired_total{loop=\"a\",kind=\"namespace_missing\"} 1"
            ),
            "{text}"
        );
        stop(harness).await;
    }

    #[tokio::test]
    async fn a_hostile_error_reaches_readyz_escaped_capped_and_without_its_password() {
        let fake = Arc::new(Fake::new("a").script(&[Step::FailHostile, Step::Block]));
        let harness = start(vec![fake.clone()], options(), true);
        eventually("a failed pass", || {
            harness
                .health
                .status("a")
                .is_some_and(|status| status.consecutive_failures == 1)
        })
        .await;
        let lines = harness.health.readiness().lines;
        let [line] = lines.as_slice() else {
            panic!("{lines:?}")
        };
        assert!(
            line.starts_with("[-]a failed: no successful pass yet: ApiError: boom\\nFORGED"),
            "{line:.200}"
        );
        assert!(line.contains("\\u{1b}[31m https://***@h/"), "{line:.200}");
        assert!(!line.chars().any(char::is_control), "{line:.200}");
        assert!(!line.contains("topsecret"), "{line:.200}");
        assert!(line.ends_with("more bytes cut]"), "{line:.200}");
        assert!(line.len() < 1100, "{}", line.len());
        fake.release.notify_one();
        stop(harness).await;
    }

    /// Drift a loop only reports, found again on every pass: counted (and logged) once.
    #[tokio::test]
    async fn drift_left_undone_is_reported_once_while_it_lasts() {
        let mut fake = Fake::new("a").script(&[Step::ReportDrift; 6]);
        fake.interval = Duration::from_millis(10);
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        eventually("six passes", || fake.finished.load(Ordering::SeqCst) >= 6).await;
        let text = encode(&harness.registry).unwrap();
        assert!(
            text.contains(
                "bootstrap_loop_drift_found_total{loop=\"a\",kind=\"service_cluster_ip\"} 1\n"
            ),
            "{text}"
        );
        stop(harness).await;
    }

    /// The unrepaired-drift gauge follows the last pass: set while the drift lasts, 0 once it
    /// clears, and 0 on a replica that lost leadership (it no longer runs the loop).
    #[tokio::test]
    async fn unrepaired_drift_gauge_follows_the_last_pass_and_leadership() {
        let (mut fake, trigger, _polled) = Fake::new("a")
            .script(&[
                Step::ReportDrift,
                Step::ReportDrift,
                Step::Succeed,
                Step::ReportDrift,
            ])
            .with_trigger();
        fake.needs_leadership = true;
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        let gauge = |value: u8| {
            format!(
                "bootstrap_loop_drift_unrepaired{{loop=\"a\",kind=\"service_cluster_ip\"}} {value}\n"
            )
        };
        let text = || encode(&harness.registry).unwrap();
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        assert!(text().contains(&gauge(1)), "{}", text());
        assert!(
            text().contains("bootstrap_loop_active{loop=\"a\"} 1\n"),
            "{}",
            text()
        );
        assert!(
            text().contains("bootstrap_loop_interval_seconds{loop=\"a\"} 3600.0\n"),
            "{}",
            text()
        );
        for passes in [2, 3] {
            trigger.send(()).unwrap();
            eventually("triggered pass", || {
                fake.finished.load(Ordering::SeqCst) == passes
            })
            .await;
        }
        assert!(text().contains(&gauge(0)), "cleared drift is 0: {}", text());
        trigger.send(()).unwrap();
        eventually("drift again", || text().contains(&gauge(1))).await;
        harness.leader.send(false).unwrap();
        eventually("a standby vouches for no drift", || {
            text().contains(&gauge(0)) && text().contains("bootstrap_loop_active{loop=\"a\"} 0\n")
        })
        .await;
        stop(harness).await;
    }

    /// A repair after a trigger is timed from the trigger (through a failed pass in between); a
    /// repair found by the timer, and a triggered pass with nothing to repair, are not.
    #[tokio::test]
    async fn heal_duration_is_timed_from_the_trigger_to_the_repairing_pass() {
        let (mut fake, trigger, _polled) = Fake::new("a")
            .script(&[
                Step::SucceedWithDrift,
                Step::Succeed,
                Step::Fail,
                Step::SucceedWithDrift,
            ])
            .with_trigger();
        fake.pass_delay = Duration::from_millis(30);
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        let count =
            |n: u8| format!("bootstrap_loop_heal_duration_seconds_count{{loop=\"a\"}} {n}\n");
        let text = || encode(&harness.registry).unwrap();
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        // The first pass repaired drift, but no trigger woke it.
        assert!(
            !text().contains("bootstrap_loop_heal_duration_seconds_count"),
            "{}",
            text()
        );
        trigger.send(()).unwrap();
        eventually("triggered pass", || {
            fake.finished.load(Ordering::SeqCst) == 2
        })
        .await;
        assert!(
            !text().contains("bootstrap_loop_heal_duration_seconds_count"),
            "{}",
            text()
        );
        trigger.send(()).unwrap();
        eventually("failed pass, then its retry", || {
            fake.finished.load(Ordering::SeqCst) == 4
        })
        .await;
        eventually("one heal", || text().contains(&count(1))).await;
        // Two passes of 30 ms each lie between the trigger and the end of the repair.
        let sum: f64 = text()
            .lines()
            .find_map(|line| {
                line.strip_prefix("bootstrap_loop_heal_duration_seconds_sum{loop=\"a\"} ")
            })
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            sum >= 0.06,
            "heal timed from the trigger, through the retry: {sum}"
        );
        stop(harness).await;
    }

    #[tokio::test]
    async fn interval_runs_passes_again() {
        let mut fake = Fake::new("a");
        fake.interval = Duration::from_millis(20);
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        eventually("three passes on the timer", || {
            fake.finished.load(Ordering::SeqCst) >= 3
        })
        .await;
        stop(harness).await;
    }

    #[tokio::test]
    async fn trigger_wakes_the_loop() {
        let (fake, trigger, _polled) = Fake::new("a").with_trigger();
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        trigger.send(()).unwrap();
        eventually("triggered pass", || {
            fake.finished.load(Ordering::SeqCst) == 2
        })
        .await;
        stop(harness).await;
    }

    #[tokio::test]
    async fn a_trigger_that_panics_or_ends_leaves_the_loops_other_triggers_working() {
        let (fake, trigger, _polled) = Fake::new("a").with_trigger();
        // Set in the same poll that panics: once it is seen, the panic has been caught.
        let panicked = Arc::new(AtomicBool::new(false));
        let flag = panicked.clone();
        let panicking = futures::stream::once(async move {
            flag.store(true, Ordering::SeqCst);
            panic!("a trigger stream's own bug");
        })
        .boxed();
        let ended = futures::stream::empty().boxed();
        fake.triggers.lock().unwrap().extend([panicking, ended]);
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        eventually("the panicking trigger polled", || {
            panicked.load(Ordering::SeqCst)
        })
        .await;
        trigger.send(()).unwrap();
        eventually("triggered pass after the others failed", || {
            fake.finished.load(Ordering::SeqCst) == 2
        })
        .await;
        stop(harness).await;
    }

    /// A shutdown hook may read a loop's caches: their triggers are polled until it has run.
    #[tokio::test]
    async fn triggers_are_polled_until_the_shutdown_hooks_have_run() {
        let (fake, trigger, polled) = Fake::new("a").script(&[Step::Block]).with_trigger();
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        eventually("a pass running", || {
            fake.started.load(Ordering::SeqCst) == 1
        })
        .await;
        harness.cancel.cancel();
        trigger.send(()).unwrap();
        eventually("the trigger polled while the pass finishes", || {
            polled.load(Ordering::SeqCst) == 1
        })
        .await;
        assert!(!fake.shutdown_called.load(Ordering::SeqCst));
        fake.release.notify_one();
        harness.handle.await.unwrap();
        assert!(fake.shutdown_called.load(Ordering::SeqCst));
    }

    #[tokio::test]
    async fn timer_only_polls_triggers_but_ignores_them() {
        let (fake, trigger, polled) = Fake::new("a").with_trigger();
        let fake = Arc::new(fake);
        let options = RunnerOptions {
            timer_only: true,
            ..options()
        };
        let harness = start(vec![fake.clone()], options, true);
        eventually("first pass", || fake.finished.load(Ordering::SeqCst) == 1).await;
        trigger.send(()).unwrap();
        trigger.send(()).unwrap();
        eventually("trigger items consumed", || {
            polled.load(Ordering::SeqCst) == 2
        })
        .await;
        // Give a wrongly woken loop time to start a pass (the debounce is 10 ms).
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(fake.started.load(Ordering::SeqCst), 1);
        stop(harness).await;
    }

    #[tokio::test]
    async fn passes_never_overlap() {
        let (mut fake, trigger, _polled) = Fake::new("a").with_trigger();
        fake.pass_delay = Duration::from_millis(30);
        fake.interval = Duration::from_millis(5);
        let fake = Arc::new(fake);
        let harness = start(vec![fake.clone()], options(), true);
        for _ in 0..50 {
            trigger.send(()).unwrap();
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        eventually("several passes", || {
            fake.finished.load(Ordering::SeqCst) >= 4
        })
        .await;
        assert_eq!(fake.max_running.load(Ordering::SeqCst), 1);
        stop(harness).await;
    }

    #[tokio::test]
    async fn failed_pass_is_retried_with_backoff_before_the_interval() {
        let fake = Arc::new(Fake::new("a").script(&[Step::Fail, Step::Fail, Step::Succeed]));
        let harness = start(vec![fake.clone()], options(), true);
        eventually("not ready while failing", || {
            let status = harness.health.status("a").unwrap();
            status.consecutive_failures >= 1 && !harness.health.readiness().ready
        })
        .await;
        let readiness = harness.health.readiness();
        assert!(
            readiness.lines[0].starts_with("[-]a failed"),
            "{readiness:?}"
        );
        assert!(
            readiness.lines[0].contains("scripted failure"),
            "{readiness:?}"
        );
        // The interval is an hour: only the backoff can bring the third pass.
        eventually("retried until success", || {
            fake.finished.load(Ordering::SeqCst) == 3
        })
        .await;
        eventually("ready", || harness.health.readiness().ready).await;
        let text = encode(&harness.registry).unwrap();
        assert!(
            text.contains("bootstrap_loop_errors_total{loop=\"a\",category=\"other\"} 2"),
            "{text}"
        );
        stop(harness).await;
    }

    #[test]
    fn triggered_passes_slow_down_when_fighting_another_actor_or_changing_nothing() {
        let debounce = Duration::from_millis(10);
        let interval = Duration::from_secs(60);
        let fight = |streak| trigger_delay((streak, 0), debounce, interval);
        assert_eq!(fight(0), debounce);
        assert_eq!(fight(4), debounce);
        assert_eq!(fight(5), Duration::from_millis(100));
        assert_eq!(fight(6), Duration::from_millis(200));
        assert_eq!(fight(50), interval);
        let idle = |streak| trigger_delay((0, streak), debounce, interval);
        assert_eq!(idle(19), debounce);
        assert_eq!(idle(20), Duration::from_millis(100));
        assert_eq!(idle(23), Duration::from_millis(800));
        assert_eq!(idle(24), IDLE_TRIGGER_DELAY);
        assert_eq!(idle(u32::MAX), IDLE_TRIGGER_DELAY);
        // Never past the interval, where the timer takes over.
        let short = Duration::from_millis(300);
        assert_eq!(trigger_delay((0, 30), debounce, short), short);
        // A triggered pass that repairs or reports something new ends the idle streak, and so
        // does a pass the timer woke.
        assert_eq!(streaks_after((0, 25), true, true, true), (1, 0));
        assert_eq!(streaks_after((0, 25), true, false, true), (0, 0));
        assert_eq!(streaks_after((0, 25), true, false, false), (0, 26));
        assert_eq!(streaks_after((0, 25), false, false, false), (0, 0));
    }

    /// The passes of a loop whose trigger fires every millisecond and whose every pass is
    /// `step`, made in `window` once more than `warm` passes have run.
    async fn passes_under_a_trigger_flood(step: Step, warm: usize, window: Duration) -> usize {
        let (fake, trigger, _polled) = Fake::new("a").with_trigger();
        let fake = Arc::new(fake.script(&vec![step; 2000]));
        let harness = start(vec![fake.clone()], options(), true);
        let feeder = tokio::spawn(async move {
            while trigger.send(()).is_ok() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        });
        eventually("the streak reached", || {
            fake.finished.load(Ordering::SeqCst) > warm
        })
        .await;
        let before = fake.finished.load(Ordering::SeqCst);
        tokio::time::sleep(window).await;
        let during = fake.finished.load(Ordering::SeqCst) - before;
        feeder.abort();
        stop(harness).await;
        during
    }

    #[tokio::test]
    async fn triggers_that_change_nothing_do_not_become_a_hot_loop() {
        // Past the threshold, delays double from 100 ms up to a second: 3 s allow a few passes
        // (unthrottled, the 10 ms debounce would allow ~300).
        let warm = IDLE_STREAK_THRESHOLD as usize + 6;
        let during =
            passes_under_a_trigger_flood(Step::Succeed, warm, Duration::from_secs(3)).await;
        assert!((1..=6).contains(&during), "{during} passes in 3 s");
    }

    #[tokio::test]
    async fn a_fight_over_drift_does_not_become_a_hot_loop() {
        // Every pass repairs drift. Past the threshold, delays double from 100 ms: 2 s of
        // fighting allow only a handful of passes (unthrottled, the 10 ms debounce would allow
        // ~200).
        let warm = FIGHT_STREAK_THRESHOLD as usize + 3;
        let during =
            passes_under_a_trigger_flood(Step::SucceedWithDrift, warm, Duration::from_secs(2))
                .await;
        assert!(during <= 6, "{during} passes in 2 s while fighting");
    }

    #[tokio::test]
    async fn a_trigger_retries_a_failed_pass_before_its_backoff_ends() {
        let (fake, trigger, _polled) = Fake::new("a").with_trigger();
        let fake = Arc::new(fake.script(&[Step::Invalid, Step::Succeed]));
        let options = RunnerOptions {
            // Without the trigger the retry would come in ten minutes.
            min_backoff: Duration::from_secs(600),
            ..options()
        };
        let harness = start(vec![fake.clone()], options, true);
        eventually("first pass failed", || {
            harness
                .health
                .status("a")
                .is_some_and(|status| status.consecutive_failures == 1)
        })
        .await;
        trigger.send(()).unwrap();
        eventually("retried on the trigger", || {
            fake.finished.load(Ordering::SeqCst) == 2
        })
        .await;
        eventually("ready", || harness.health.readiness().ready).await;
        stop(harness).await;
    }

    #[test]
    fn a_failure_is_warned_once_and_a_pass_deferred_at_start_only_once_it_lasts() {
        let log = |reason: &PassError, last: Option<&str>, failures: u32| {
            failure_log(reason, &reason.to_string(), last, failures)
        };

        let outage = PassError::Failed(LoopError::Other("connection refused".into()));
        assert_eq!(log(&outage, None, 0), FailureLog::Warn);
        let said = outage.to_string();
        for failures in 1..20 {
            assert_eq!(log(&outage, Some(&said), failures), FailureLog::Again);
        }

        // Which errors are "not yet" is LoopError::not_yet's to say (tested with it).
        let syncing = PassError::Failed(LoopError::NotSynced(
            "Service cache has not synced yet".into(),
        ));
        let deferred =
            FailureLog::NotYet("cache not ready: Service cache has not synced yet".into());
        let said = syncing.to_string();
        assert_eq!(log(&syncing, None, 0), deferred);
        assert_eq!(log(&syncing, Some("connection refused"), 3), deferred);
        for failures in 1..NOT_YET_PATIENCE {
            assert_eq!(log(&syncing, Some(&said), failures), FailureLog::Again);
        }
        assert_eq!(
            log(&syncing, Some(&said), NOT_YET_PATIENCE),
            FailureLog::Warn
        );
        assert_eq!(
            log(&syncing, Some(&said), NOT_YET_PATIENCE + 1),
            FailureLog::Again
        );

        let timed_out = PassError::TimedOut(Duration::from_secs(30));
        assert_eq!(log(&timed_out, None, 0), FailureLog::Warn);
    }

    #[test]
    fn backoff_grows_and_is_capped_at_the_interval() {
        let interval = Duration::from_millis(500);
        let delays: Vec<_> = new_backoff(Duration::from_millis(10), interval)
            .take(20)
            .collect();
        assert!(
            delays.iter().all(|delay| *delay <= interval * 2),
            "{delays:?}"
        );
        assert!(delays[0] < Duration::from_millis(50), "{delays:?}");
        assert!(delays[19] >= Duration::from_millis(250), "{delays:?}");
    }

    #[tokio::test]
    async fn panicking_pass_is_caught_counted_and_retried() {
        let panicky = Arc::new(Fake::new("panicky").script(&[Step::Panic, Step::Succeed]));
        let mut steady = Fake::new("steady");
        steady.interval = Duration::from_millis(20);
        let steady = Arc::new(steady);
        let harness = start(vec![panicky.clone(), steady.clone()], options(), true);
        eventually("panicky loop recovered", || {
            panicky.finished.load(Ordering::SeqCst) == 1
                && panicky.started.load(Ordering::SeqCst) == 2
        })
        .await;
        eventually("other loop unaffected", || {
            steady.finished.load(Ordering::SeqCst) >= 3
        })
        .await;
        eventually("both ready", || harness.health.readiness().ready).await;
        let text = encode(&harness.registry).unwrap();
        assert!(
            text.contains("bootstrap_loop_panics_total{loop=\"panicky\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("bootstrap_loop_passes_total{loop=\"panicky\",result=\"panic\"} 1"),
            "{text}"
        );
        stop(harness).await;
    }

    #[tokio::test]
    async fn leader_only_loops_wait_for_leadership_and_run_at_once_on_gaining_it() {
        let mut gated = Fake::new("gated");
        gated.needs_leadership = true;
        let gated = Arc::new(gated);
        let free = Arc::new(Fake::new("free"));
        let harness = start(vec![gated.clone(), free.clone()], options(), false);
        eventually("ungated loop runs", || {
            free.finished.load(Ordering::SeqCst) == 1
        })
        .await;
        eventually("standby counts as ready", || {
            harness.health.readiness().ready
        })
        .await;
        assert!(
            harness
                .health
                .readiness()
                .lines
                .contains(&"[+]gated ok (standby: not the leader)".to_owned())
        );
        assert_eq!(gated.started.load(Ordering::SeqCst), 0);
        harness.leader.send(true).unwrap();
        // The interval is an hour: only gaining leadership can start this pass.
        eventually("pass on gaining leadership", || {
            gated.finished.load(Ordering::SeqCst) == 1
        })
        .await;
        stop(harness).await;
    }

    #[tokio::test]
    async fn losing_leadership_abandons_the_running_pass() {
        let mut gated = Fake::new("gated").script(&[Step::Block, Step::Succeed]);
        gated.needs_leadership = true;
        let gated = Arc::new(gated);
        let harness = start(vec![gated.clone()], options(), true);
        eventually("blocked pass started", || {
            gated.started.load(Ordering::SeqCst) == 1
        })
        .await;
        harness.leader.send(false).unwrap();
        eventually("pass abandoned", || {
            gated.running.load(Ordering::SeqCst) == 0
        })
        .await;
        assert_eq!(gated.finished.load(Ordering::SeqCst), 0);
        harness.leader.send(true).unwrap();
        eventually("runs again as leader", || {
            gated.finished.load(Ordering::SeqCst) == 1
        })
        .await;
        stop(harness).await;
    }

    #[tokio::test]
    async fn shutdown_lets_the_running_pass_finish_then_calls_the_hook() {
        let fake = Arc::new(Fake::new("a").script(&[Step::Block]));
        let harness = start(vec![fake.clone()], options(), true);
        eventually("blocked pass started", || {
            fake.started.load(Ordering::SeqCst) == 1
        })
        .await;
        harness.cancel.cancel();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            !fake.shutdown_called.load(Ordering::SeqCst),
            "hook ran before the pass finished"
        );
        fake.release.notify_one();
        tokio::time::timeout(Duration::from_secs(30), harness.handle)
            .await
            .unwrap()
            .unwrap();
        assert!(fake.shutdown_called.load(Ordering::SeqCst));
        assert_eq!(fake.finished_before_shutdown.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn shutdown_is_bounded_by_the_timeout() {
        let fake = Arc::new(Fake::new("a").script(&[Step::Block]));
        let options = RunnerOptions {
            shutdown_timeout: Duration::from_millis(200),
            ..options()
        };
        let harness = start(vec![fake.clone()], options, true);
        eventually("blocked pass started", || {
            fake.started.load(Ordering::SeqCst) == 1
        })
        .await;
        harness.cancel.cancel();
        tokio::time::timeout(Duration::from_secs(30), harness.handle)
            .await
            .expect("runner gives up after its shutdown timeout")
            .unwrap();
        assert_eq!(fake.finished.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn check_once_retries_transient_failures_and_reports_drift() {
        let flaky = Arc::new(Fake::new("flaky").script(&[Step::Fail, Step::SucceedWithDrift]));
        let broken: Arc<Fake> = Arc::new(Fake::new("broken").script(&[Step::Panic]));
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        let loops: Vec<Arc<dyn Reconciler>> = vec![flaky.clone(), broken.clone()];
        let results = check_once(&loops, offline_client(), &metrics, Duration::from_secs(20)).await;
        assert_eq!(results.len(), 2);
        let report = results[0].result.as_ref().unwrap();
        assert_eq!(report.drift.len(), 1);
        assert!(
            results[1]
                .result
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("scripted panic")
        );
    }

    #[tokio::test]
    async fn check_once_does_not_wait_out_permanent_failures() {
        let invalid = Arc::new(Fake::new("invalid").script(&[Step::Invalid, Step::Succeed]));
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        let loops: Vec<Arc<dyn Reconciler>> = vec![invalid.clone()];
        let started = Instant::now();
        let results =
            check_once(&loops, offline_client(), &metrics, Duration::from_secs(120)).await;
        assert!(
            results[0]
                .result
                .as_ref()
                .unwrap_err()
                .to_string()
                .contains("scripted invalid state")
        );
        assert_eq!(invalid.started.load(Ordering::SeqCst), 1, "not retried");
        assert!(started.elapsed() < Duration::from_secs(60));
    }

    #[tokio::test]
    async fn check_once_gives_up_on_a_pass_that_outlasts_its_timeout() {
        let stalled = Arc::new(Fake::new("stalled").script(&[Step::Block]));
        let mut registry = new_registry();
        let metrics = RunnerMetrics::register(&mut registry);
        let loops: Vec<Arc<dyn Reconciler>> = vec![stalled.clone()];
        let timeout = Duration::from_millis(300);
        let check = check_once(&loops, offline_client(), &metrics, timeout);
        let results = tokio::time::timeout(Duration::from_secs(60), check)
            .await
            .expect("the check ends at its timeout, not when the pass does");
        assert!(
            matches!(results[0].result, Err(PassError::TimedOut(t)) if t == timeout),
            "{:?}",
            results[0].result.as_ref().err()
        );
    }

    /// A pass that panics on every retry is logged once, at error level, with its message.
    #[tokio::test]
    async fn a_pass_that_keeps_panicking_is_logged_once() {
        let captured = Captured::default();
        let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::INFO));
        let panicky = Arc::new(Fake::new("panicky").script(&[
            Step::Panic,
            Step::Panic,
            Step::Panic,
            Step::Succeed,
        ]));
        let harness = start(vec![panicky.clone()], options(), true);
        eventually("recovered after three panics", || {
            panicky.finished.load(Ordering::SeqCst) == 1
        })
        .await;
        drop(harness);
        let log = captured.text();
        let panics: Vec<&str> = log.lines().filter(|l| l.contains("panicked")).collect();
        assert_eq!(panics.len(), 1, "{log}");
        assert!(
            panics[0].contains(" ERROR ") && panics[0].contains("scripted panic"),
            "{log}"
        );
    }

    /// Every repair is one info line of one shape: the loop, the object, what it was and what it
    /// became; drift left undone is no repair line.
    #[tokio::test]
    async fn each_repair_is_one_info_line_naming_loop_object_was_and_became() {
        let captured = Captured::default();
        let _guard = tracing::subscriber::set_default(captured.subscriber(tracing::Level::INFO));
        let fake = Fake::new("a").script(&[Step::SucceedWithDrift, Step::ReportDrift]);
        let metrics = RunnerMetrics::register(&mut new_registry());
        let ctx = PassContext::leading(offline_client(), false);
        let unapplied = reconcilers::findings::ReportOnce::new();
        for _ in 0..2 {
            run_pass(&fake, &ctx, &metrics, &unapplied).await.unwrap();
        }
        let log = captured.text();
        let repairs: Vec<&str> = log
            .lines()
            .filter(|line| line.contains("repaired"))
            .collect();
        assert_eq!(repairs.len(), 1, "{log}");
        for field in [
            " INFO ",
            "loop=\"a\"",
            "object=Namespace/kube-public",
            "kind=\"namespace_missing\"",
            "was=created",
            "became=created",
        ] {
            assert!(repairs[0].contains(field), "{field} in {}", repairs[0]);
        }
    }

    /// The names of the loops `args` builds, and what building them logged at info.
    fn built(args: crate::config::ConfigArgs) -> (Vec<&'static str>, String) {
        let config = Config::load(&args).unwrap();
        let kube_config = kube::Config::new("https://127.0.0.1:1".parse().unwrap());
        let client = kube::Client::try_from(kube_config).unwrap();
        let captured = Captured::default();
        let loops =
            tracing::subscriber::with_default(captured.subscriber(tracing::Level::INFO), || {
                build_loops(&config, &client, &mut Registry::default())
            });
        let names = loops.iter().map(|built| built.name()).collect();
        (names, captured.text())
    }

    #[tokio::test]
    async fn with_no_endpoints_mode_named_the_endpoints_are_left_alone_and_that_is_said_once() {
        let (names, logged) = built(crate::config::ConfigArgs::default());
        assert!(names.contains(&"system-namespaces"), "{names:?}");
        assert!(
            !names.iter().any(|name| name.starts_with("apiserver-")),
            "no endpoints loop without a mode named: {names:?}"
        );
        assert_eq!(
            logged
                .matches(reconcilers::apiserver_endpoints::ENDPOINTS_UNNAMED)
                .count(),
            1,
            "one line naming the flag: {logged}"
        );
        assert!(logged.contains(" INFO "), "{logged}");
        assert!(
            reconcilers::apiserver_endpoints::ENDPOINTS_UNNAMED
                .contains("--endpoint-reconciler-type")
        );

        let (names, logged) = built(crate::config::ConfigArgs {
            endpoint_reconciler_type: Some(crate::config::EndpointsMode::Lease),
            advertise_address: Some("192.0.2.10".to_owned()),
            ..crate::config::ConfigArgs::default()
        });
        assert!(names.contains(&"apiserver-lease"), "{names:?}");
        assert!(names.contains(&"apiserver-endpoints"), "{names:?}");
        assert!(
            !logged.contains(reconcilers::apiserver_endpoints::ENDPOINTS_UNNAMED),
            "{logged}"
        );

        let (names, logged) = built(crate::config::ConfigArgs {
            endpoint_reconciler_type: Some(crate::config::EndpointsMode::None),
            ..crate::config::ConfigArgs::default()
        });
        assert!(!names.iter().any(|name| name.starts_with("apiserver-")));
        assert!(
            !logged.contains(reconcilers::apiserver_endpoints::ENDPOINTS_UNNAMED),
            "named none: {logged}"
        );
    }
}

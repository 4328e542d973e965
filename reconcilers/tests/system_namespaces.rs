//! The system-namespaces loop against the simulator: every namespace it creates gets its
//! event, even on a cluster that lacks `default`, where those events are written; a pass reads
//! only the declared names, never every namespace.

#![allow(clippy::unwrap_used)]

mod common;

use anyhow::Result;
use apiserver_sim::{FaultKind, FaultRule, Sim, SimConfig, Verb};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::PostParams;
use prometheus_client::registry::Registry;
use reconcilers::Reconciler;
use reconcilers::budget::CacheBudget;
use reconcilers::system_namespaces::{Section, SystemNamespacesLoop};

fn namespaces_loop(sim: &Sim) -> SystemNamespacesLoop {
    SystemNamespacesLoop::new(
        sim.client(),
        Section::default(),
        &CacheBudget::default(),
        common::reporter(),
        &mut Registry::default(),
    )
}

/// The reads of namespaces sent since the requests were last cleared, as `verb name`.
fn namespace_reads(sim: &Sim) -> Vec<String> {
    let mut reads: Vec<String> = sim
        .requests()
        .iter()
        .filter(|r| r.resource == "namespaces" && matches!(r.verb.as_str(), "get" | "list"))
        .map(|r| format!("{} {}", r.verb, r.name))
        .collect();
    reads.sort();
    reads
}

/// Polls the loop's triggers (which drive its namespace watch) in the background.
fn drive(repair: &SystemNamespacesLoop) {
    let mut triggers = futures::stream::select_all(repair.triggers());
    tokio::spawn(async move { while triggers.next().await.is_some() {} });
}

/// A pass reads the declared names only: one GET each while the cache is not current (before it
/// lists, and after a watch failure on a quiet cluster, where no event proves it current again),
/// nothing while it is; never a LIST of every namespace.
#[tokio::test]
async fn a_pass_reads_only_the_declared_names_and_never_lists_every_namespace() -> Result<()> {
    let mut seed: Vec<String> = (0..20).map(|i| format!("tenant-{i}")).collect();
    seed.extend(["default".into(), "kube-system".into()]);
    let sim = Sim::start(SimConfig {
        seed_namespaces: seed,
        ..SimConfig::default()
    })
    .await?;
    let repair = namespaces_loop(&sim);
    let ctx = common::ctx(&sim, false);
    let declared_gets = [
        "get default",
        "get kube-node-lease",
        "get kube-public",
        "get kube-system",
    ];

    sim.clear_requests();
    repair.reconcile(&ctx).await?;
    assert_eq!(
        namespace_reads(&sim),
        declared_gets,
        "before the cache lists"
    );

    drive(&repair);
    common::eventually("a pass reads the listed cache", || async {
        sim.clear_requests();
        repair.reconcile(&ctx).await.is_ok() && namespace_reads(&sim).is_empty()
    })
    .await;

    sim.faults().inject(FaultRule::next(
        Some(Verb::Watch),
        Some("namespaces"),
        1_000_000,
        FaultKind::Error {
            code: 500,
            retry_after_seconds: None,
        },
    ));
    sim.close_watches();
    common::eventually("the watch failure makes passes read the API", || async {
        sim.clear_requests();
        repair.reconcile(&ctx).await.is_ok() && !namespace_reads(&sim).is_empty()
    })
    .await;
    sim.faults().clear();
    common::eventually("the watch is back", || async {
        sim.open_watches("namespaces") == 1
    })
    .await;

    // Nothing changes a namespace: the cache is not proven current, and each pass reads the
    // declared names again.
    sim.clear_requests();
    for _ in 0..3 {
        repair.reconcile(&ctx).await?;
    }
    let expected: Vec<&str> = declared_gets.iter().flat_map(|get| [*get; 3]).collect();
    assert_eq!(namespace_reads(&sim), expected);
    Ok(())
}

/// Changes to namespaces nobody declared do not wake the loop; a change to a declared one does.
/// (The test's runtime has one thread: once a pass sees a change in the cache, the trigger has
/// counted it, and every change before it.)
#[tokio::test]
async fn only_changes_to_declared_namespaces_wake_the_loop() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: Section::default()
            .namespaces
            .into_iter()
            .map(|spec| spec.name)
            .collect(),
        ..SimConfig::default()
    })
    .await?;
    let repair = namespaces_loop(&sim);
    let woken = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut triggers = futures::stream::select_all(repair.triggers());
    let count = woken.clone();
    tokio::spawn(async move {
        while triggers.next().await.is_some() {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let woken = move || woken.load(std::sync::atomic::Ordering::SeqCst);
    common::eventually("the cache lists", || async { woken() == 1 }).await;

    let api: Api<Namespace> = Api::all(sim.client());
    for name in ["tenant-a", "tenant-b", "tenant-c"] {
        let namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &namespace).await?;
    }
    sim.backdoor().delete("namespaces", "", "kube-public")?;
    let dry_run = common::ctx(&sim, true);
    common::eventually("a pass sees kube-public gone", || async {
        let report = repair.reconcile(&dry_run).await.unwrap();
        common::drift_of_kind(&report, "namespace_missing")
            .iter()
            .any(|drift| drift.object == "Namespace/kube-public")
    })
    .await;
    assert_eq!(woken(), 2, "the list, then kube-public's deletion");
    Ok(())
}

/// A namespace read as absent but created meanwhile (here every read answers 404) is no repair:
/// its create meets AlreadyExists, and nothing is reported, counted or published.
#[tokio::test]
async fn a_create_that_finds_the_namespace_exists_reports_nothing() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: Section::default()
            .namespaces
            .into_iter()
            .map(|spec| spec.name)
            .collect(),
        ..SimConfig::default()
    })
    .await?;
    let repair = namespaces_loop(&sim);
    sim.faults().inject(FaultRule::next(
        Some(Verb::Get),
        Some("namespaces"),
        4,
        FaultKind::Error {
            code: 404,
            retry_after_seconds: None,
        },
    ));

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    assert_eq!(sim.request_count("create", "namespaces"), 4);
    assert!(report.drift.is_empty(), "{:?}", report.drift);
    assert!(common::events_of(&sim, "SystemNamespaceCreated").is_empty());
    Ok(())
}

/// Namespaces that cannot be created fail every pass alike: the loop itself warns about nothing
/// (the runner warns about the pass's error once, and at debug level while it repeats), and the
/// error, the same every pass, names each namespace that failed and stays a 403.
#[tokio::test]
async fn a_failing_create_is_one_error_naming_each_namespace_and_no_warning_of_the_loop()
-> Result<()> {
    let sim = common::sim().await;
    let repair = namespaces_loop(&sim);
    sim.faults().inject(FaultRule::next(
        Some(Verb::Create),
        Some("namespaces"),
        1_000,
        FaultKind::Error {
            code: 403,
            retry_after_seconds: None,
        },
    ));
    let (captured, _guard) = common::Captured::warnings();

    let ctx = common::ctx(&sim, false);
    let mut errors = Vec::new();
    for _ in 0..3 {
        let err = repair.reconcile(&ctx).await.unwrap_err();
        assert_eq!(err.category(), "forbidden");
        errors.push(err.to_string());
    }
    assert_eq!(sim.request_count("create", "namespaces"), 6);
    assert!(
        errors[0].contains("namespaces kube-public, kube-node-lease: "),
        "{}",
        errors[0]
    );
    assert!(errors.iter().all(|err| *err == errors[0]), "{errors:?}");
    let log = captured.text();
    let warned: Vec<&str> = log
        .lines()
        .filter(|line| line.contains(" reconcilers::"))
        .collect();
    assert_eq!(warned, Vec::<&str>::new());
    Ok(())
}

#[tokio::test]
async fn each_created_namespace_has_its_event_even_when_default_was_missing() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    let repair = namespaces_loop(&sim);

    let report = repair.reconcile(&common::ctx(&sim, false)).await?;
    let created: Vec<(&str, bool)> = report
        .drift
        .iter()
        .map(|d| (d.object.as_str(), d.applied))
        .collect();
    // Reported in the configured order, though `default` was written first.
    assert_eq!(
        created,
        [
            ("Namespace/kube-public", true),
            ("Namespace/kube-node-lease", true),
            ("Namespace/default", true),
        ]
    );
    let mut regarding: Vec<String> = common::events_of(&sim, "SystemNamespaceCreated")
        .iter()
        .map(|event| {
            assert_eq!(
                event["reportingController"],
                common::reporter().controller.as_str()
            );
            event["regarding"]["name"].as_str().unwrap().to_owned()
        })
        .collect();
    regarding.sort();
    assert_eq!(regarding, ["default", "kube-node-lease", "kube-public"]);
    Ok(())
}

/// A namespace this process creates for its own Lease is a repair like any other: it gets an
/// event from this controller; one that exists is only read.
#[tokio::test]
async fn a_namespace_created_for_a_lease_has_its_event() -> Result<()> {
    let sim = Sim::start(SimConfig {
        seed_namespaces: vec!["default".into(), "kube-system".into()],
        ..SimConfig::default()
    })
    .await?;
    let namespaces = reconcilers::lease::LeaseNamespaces::new(
        sim.client(),
        reconcilers::events::reporter("replica-a"),
        "leader-election",
    );

    assert!(namespaces.ensure("bootstrap").await?);
    assert!(!namespaces.ensure("bootstrap").await?);
    assert!(!namespaces.ensure("kube-system").await?);

    let events = common::events_of(&sim, "LeaseNamespaceCreated");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0]["regarding"]["name"], "bootstrap");
    assert_eq!(events[0]["reportingController"], "bootstrap-controller");
    assert_eq!(events[0]["reportingInstance"], "replica-a");
    Ok(())
}

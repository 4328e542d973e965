//! ARCHITECTURE.md's "Adding a loop", done in a test: a tiny loop laid out as every loop is
//! (`section`, `plan`, `apply`, `metrics`, the loop itself), validated and built through
//! `LoopSection`, and run by the runtime's `Runner` against the in-process simulator. If adding
//! a loop ever needs more than its module, the section's one line and its docs, this file stops
//! compiling or passing.
//!
//! The loop keeps one Lease, `kube-system/tiny`, in existence (a stand-in for a real loop's
//! object: the simulator serves Leases).

use std::sync::Arc;
use std::time::Duration;

use apiserver_sim::{Sim, SimConfig};
use bootstrap_controller::config::{Config, ConfigArgs, FileConfig};
use bootstrap_controller::metrics::{RunnerMetrics, new_registry};
use bootstrap_controller::runner::{Runner, RunnerOptions};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use reconcilers::section::{BuildContext, LoopSection};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

mod tiny {
    //! The loop's module: in the product, `reconcilers/src/tiny/mod.rs` with the files below.

    pub const NAME: &str = "tiny";

    pub mod section {
        //! `loops.tiny`, the loop's one configuration type: serde shape with defaults, validation
        //! naming each field, the build (the loop keeps the section and reads it as it is).
        use std::sync::Arc;
        use std::time::Duration;

        use reconcilers::section::{
            BuildContext, BuildError, ConfigError, LoopSection, Settings, duration_format,
            validate_interval,
        };
        use reconcilers::{Reconciler, names::validate_dns1123_label};
        use serde::{Deserialize, Serialize};

        use super::TinyLoop;

        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields, rename_all = "camelCase")]
        pub struct Section {
            pub enabled: bool,
            #[serde(with = "duration_format")]
            pub interval: Duration,
            pub name: String,
        }

        impl Default for Section {
            fn default() -> Self {
                Section {
                    enabled: true,
                    interval: Duration::from_millis(200),
                    name: "tiny".to_owned(),
                }
            }
        }

        impl LoopSection for Section {
            fn enabled(&self) -> bool {
                self.enabled
            }

            fn validate(&self, path: &str, _settings: &Settings, errors: &mut Vec<ConfigError>) {
                validate_interval(path, self.interval, errors);
                if let Err(why) = validate_dns1123_label(&self.name) {
                    errors.push(ConfigError::new(format!("{path}.name"), why));
                }
            }

            fn build(
                &self,
                context: &mut BuildContext<'_>,
            ) -> Result<Vec<Arc<dyn Reconciler>>, BuildError> {
                Ok(vec![Arc::new(TinyLoop::new(
                    self.clone(),
                    context.client.clone(),
                    context.registry,
                ))])
            }
        }
    }

    pub mod plan {
        //! | the Lease | the plan |
        //! | --- | --- |
        //! | missing | create it |
        //! | present | nothing |
        use k8s_openapi::api::coordination::v1::Lease;

        #[derive(Debug, PartialEq)]
        pub enum Plan {
            Create,
            Nothing,
        }

        pub fn plan(existing: Option<&Lease>) -> Plan {
            match existing {
                None => Plan::Create,
                Some(_) => Plan::Nothing,
            }
        }
    }

    pub mod apply {
        //! The write of a plan, its metric, and the drift it is reported as.
        use k8s_openapi::api::coordination::v1::Lease;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
        use kube::Api;
        use kube::api::PostParams;
        use reconcilers::contract::{Action, LoopError, PassContext, PassReport, drift};
        use reconcilers::ignore_already_exists;

        use super::TinyLoop;
        use super::plan::Plan;

        impl TinyLoop {
            pub(super) async fn apply(
                &self,
                ctx: &PassContext,
                api: &Api<Lease>,
                plan: Plan,
            ) -> Result<PassReport, LoopError> {
                let mut report = PassReport::default();
                if plan == Plan::Create {
                    if !ctx.dry_run {
                        let lease = Lease {
                            metadata: ObjectMeta {
                                name: Some(self.section.name.clone()),
                                ..ObjectMeta::default()
                            },
                            spec: None,
                        };
                        ignore_already_exists(api.create(&PostParams::default(), &lease).await)?;
                        self.metrics.creations.inc();
                    }
                    report.push(drift(
                        "lease_missing",
                        format!("Lease/kube-system/{}", self.section.name),
                        Action::Create,
                        "the Lease does not exist".to_owned(),
                        !ctx.dry_run,
                    ));
                }
                Ok(report)
            }
        }
    }

    pub mod metrics {
        use prometheus_client::metrics::counter::Counter;
        use reconcilers::metrics::{MetricRegistry, loop_registry, registered};

        #[derive(Clone, Default)]
        pub struct TinyMetrics {
            pub creations: Counter,
        }

        impl TinyMetrics {
            pub fn register(registry: &mut dyn MetricRegistry) -> Self {
                TinyMetrics {
                    creations: registered(
                        loop_registry(registry, super::NAME),
                        "creations",
                        "Leases created",
                        Counter::default(),
                    ),
                }
            }
        }
    }

    use std::time::Duration;

    use futures::future::BoxFuture;
    use k8s_openapi::api::coordination::v1::Lease;
    use kube::Api;
    use reconcilers::contract::{LoopError, PassContext, PassReport, Reconciler};
    use reconcilers::metrics::MetricRegistry;

    use metrics::TinyMetrics;
    use section::Section;

    pub struct TinyLoop {
        section: Section,
        metrics: TinyMetrics,
    }

    impl TinyLoop {
        fn new(section: Section, _client: kube::Client, registry: &mut dyn MetricRegistry) -> Self {
            TinyLoop {
                section,
                metrics: TinyMetrics::register(registry),
            }
        }

        async fn pass(&self, ctx: &PassContext) -> Result<PassReport, LoopError> {
            let api: Api<Lease> = Api::namespaced(ctx.client.clone(), "kube-system");
            let existing = api.get_opt(&self.section.name).await?;
            self.apply(ctx, &api, plan::plan(existing.as_ref())).await
        }
    }

    impl Reconciler for TinyLoop {
        fn name(&self) -> &'static str {
            NAME
        }

        fn interval(&self) -> Duration {
            self.section.interval
        }

        fn reconcile<'a>(
            &'a self,
            ctx: &'a PassContext,
        ) -> BoxFuture<'a, Result<PassReport, LoopError>> {
            Box::pin(self.pass(ctx))
        }
    }
}

#[tokio::test]
async fn a_loop_added_as_the_architecture_says_is_validated_built_and_run() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let config = Config::merge(&ConfigArgs::default(), FileConfig::default())?;
    let settings = config.settings;

    // Validation names the field under the section's path.
    let bad = tiny::section::Section {
        name: "Not A Name".to_owned(),
        ..tiny::section::Section::default()
    };
    let mut errors = Vec::new();
    bad.validate("loops.tiny", &settings, &mut errors);
    anyhow::ensure!(
        errors.len() == 1 && errors[0].field == "loops.tiny.name",
        "{errors:?}"
    );

    // Built through LoopSection, run by the runtime's Runner. The simulator starts empty: the
    // Lease's namespace is made here (in a cluster, the system-namespaces loop keeps it).
    let client = sim.client();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let mut namespace = Namespace::default();
    namespace.metadata.name = Some("kube-system".to_owned());
    namespaces
        .create(&PostParams::default(), &namespace)
        .await?;
    let mut registry = new_registry();
    let section = tiny::section::Section::default();
    let loops = section
        .build(&mut BuildContext::new(
            client.clone(),
            &mut registry,
            &settings,
            reconcilers::kubernetes_service::Section::default().service(),
            reconcilers::budget::CacheBudget::default(),
            Arc::new(|| Box::pin(async { Err("not used by this loop".into()) })),
        ))
        .map_err(|err| anyhow::anyhow!("{err}"))?;
    let metrics = RunnerMetrics::register(&mut registry);
    let runner = Runner::new(loops, client.clone(), RunnerOptions::default(), metrics);
    let health = runner.health();
    let (_leader, leading) = watch::channel(true);
    let cancel = CancellationToken::new();
    let task = tokio::spawn(runner.run(leading, cancel.clone()));

    let leases: Api<Lease> = Api::namespaced(client, "kube-system");
    let wait = |what: &'static str| {
        let (leases, health) = (leases.clone(), health.clone());
        async move {
            test_support::eventually(what, Duration::from_secs(20), || {
                let (leases, health) = (leases.clone(), health.clone());
                async move {
                    leases.get_opt("tiny").await.is_ok_and(|l| l.is_some())
                        && health.readiness().lines.contains(&"[+]tiny ok".to_owned())
                }
            })
            .await
        }
    };
    wait("the tiny loop's Lease, and its /readyz line")
        .await
        .map_err(|err| anyhow::anyhow!("{err}: {:?}", health.readiness().lines))?;
    leases.delete("tiny", &DeleteParams::default()).await?;
    wait("the deleted Lease back").await?;

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry)?;
    anyhow::ensure!(
        text.lines()
            .any(|l| l.starts_with("bootstrap_tiny_creations_total ") && !l.ends_with(" 0")),
        "{text}"
    );
    anyhow::ensure!(
        text.contains("loop=\"tiny\""),
        "the runner's metrics name the loop:\n{text}"
    );
    cancel.cancel();
    task.await?;
    Ok(())
}

//! The process assembly that `run` and the demo (`bootstrap-demo`) share, once a client exists:
//! the admin server, then either one cluster's runner gated by leader election, or the tenant
//! manager with its replica group. The command line (`crate::cli`) only parses, loads the
//! configuration and the kubeconfig, and waits.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::admin::{self, AdminState};
use crate::config::{Config, TenantBase};
use crate::health::Health;
use crate::leader::{self, LeaderMetrics};
use crate::metrics::new_registry;
use crate::runner::{Runner, build_runner, kubeconfig_loader};
use crate::shards::Shards;
use crate::tenant_kubeconfig::CredentialPolicy;
use crate::tenants::{self, Directory, Ownership, TenantMetrics, TenantSettings};
use reconcilers::budget::{BudgetLimits, CacheBudget};

/// What `run` and the demo (`bootstrap-demo`) share: everything after the client exists.
pub struct Controller {
    pub cancel: CancellationToken,
    pub admin_addr: std::net::SocketAddr,
    pub health: crate::health::Health,
    task: tokio::task::JoinHandle<()>,
}

/// The admin server's listener, bound before anything else starts.
async fn bind_admin(config: &Config) -> Result<tokio::net::TcpListener, StartError> {
    tokio::net::TcpListener::bind(config.admin_addr)
        .await
        .map_err(|source| StartError::AdminAddress {
            addr: config.admin_addr,
            source,
        })
}

/// Why the controller could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "--admin-addr: cannot listen on {addr}: {source} (pick a free address, e.g. 127.0.0.1:8081)"
    )]
    AdminAddress {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot build the leader-election client: {0}")]
    ElectionClient(kube::Error),
}

impl Controller {
    /// One cluster, the process's own: its loops gated by leader election, and the admin server.
    pub async fn start(
        config: &Config,
        kube_config: &kube::Config,
        client: kube::Client,
    ) -> Result<Controller, StartError> {
        let cancel = CancellationToken::new();
        let mut registry = new_registry();
        // The cluster of --kubeconfig is the operator's own: its caches are not limited.
        let budget = CacheBudget::new(BudgetLimits::UNLIMITED, "", None, &mut registry);
        let runner = build_runner(
            config,
            &client,
            kubeconfig_loader(config),
            &budget,
            &mut registry,
        );
        info!(
            loops = ?runner.loop_names(),
            dry_run = config.dry_run,
            timer_only = config.timer_only,
            leader_election = config.leader_election.enabled,
            server = %kube_config.cluster_url,
            "starting"
        );
        if config.settings.service_ranges.is_empty() {
            info!(
                "--service-cluster-ip-range is not set: the loops read the range from the \
                 cluster's ServiceCIDR \"kubernetes\" (Kubernetes 1.33+), and the \
                 service-cidr loop, which would create that object from it, does not run"
            );
        }
        // Bind before joining the election: failing here must not leave a Lease behind.
        let listener = bind_admin(config).await?;
        let health = runner.health();
        let leader_metrics = LeaderMetrics::register(&mut registry);
        let work = Controller::spawn_single(
            config,
            kube_config,
            &client,
            runner,
            leader_metrics,
            health.clone(),
            cancel.clone(),
        )?;
        Ok(Controller::serve(
            config, listener, registry, health, None, work, cancel,
        ))
    }

    /// Management mode: one runtime per tenant Secret, shared between replicas (see
    /// [`crate::tenants`]); `base` says where the tenants are and what every tenant's
    /// configuration is made from.
    pub async fn start_management(
        config: &Config,
        kube_config: &kube::Config,
        client: kube::Client,
        base: TenantBase,
    ) -> Result<Controller, StartError> {
        let tenants = &base.tenants;
        info!(
            selector = %tenants.secret_selector,
            namespace = tenants.namespace.as_deref().unwrap_or("(all)"),
            kubeconfig_key = %tenants.kubeconfig_key,
            sharing = config.leader_election.enabled,
            server = %kube_config.cluster_url,
            "starting in management mode: one runtime per tenant Secret"
        );
        let cancel = CancellationToken::new();
        let mut registry = new_registry();
        let listener = bind_admin(config).await?;
        let health = Health::default();
        let (work, directory) = Controller::spawn_management(
            config,
            &client,
            base,
            &mut registry,
            health.clone(),
            cancel.clone(),
        );
        Ok(Controller::serve(
            config,
            listener,
            registry,
            health,
            Some(directory),
            work,
            cancel,
        ))
    }

    /// The admin server on `listener` beside `work`, stopped once `work` has ended.
    fn serve(
        config: &Config,
        listener: tokio::net::TcpListener,
        registry: prometheus_client::registry::Registry,
        health: Health,
        tenants: Option<Directory>,
        work: tokio::task::JoinHandle<()>,
        cancel: CancellationToken,
    ) -> Controller {
        let admin_addr = listener.local_addr().unwrap_or(config.admin_addr);
        info!(%admin_addr, "admin server listening (/livez, /readyz, /metrics)");
        let admin_state = AdminState {
            health: health.clone(),
            registry: Arc::new(registry),
            tenants,
            shutting_down: cancel.clone(),
        };
        let admin_stop = CancellationToken::new();
        let admin_task = tokio::spawn(admin::serve(listener, admin_state, admin_stop.clone()));
        let task = tokio::spawn(async move {
            if let Err(err) = work.await {
                error!(error = %err, "controller task failed");
            }
            admin_stop.cancel();
            match tokio::time::timeout(Duration::from_secs(5), admin_task).await {
                Ok(Ok(Err(err))) => warn!(error = %err, "admin server failed"),
                Ok(Err(err)) => warn!(error = %err, "admin server task failed"),
                Ok(Ok(Ok(()))) | Err(_) => {}
            }
        });
        Controller {
            cancel,
            admin_addr,
            health,
            task,
        }
    }

    /// Management mode's work: the replicas' shards (when leader election is on) and the tenant
    /// manager, with the pools every tenant's caches and responses share.
    fn spawn_management(
        config: &Config,
        client: &kube::Client,
        base: TenantBase,
        registry: &mut prometheus_client::registry::Registry,
        health: Health,
        cancel: CancellationToken,
    ) -> (tokio::task::JoinHandle<()>, Directory) {
        let directory = Directory::default();
        let metrics = TenantMetrics::register(registry, base.tenants.secrets_total_bytes());
        let pools = tenants::Pools::new(base.tenants.cache_total_bytes(), registry);
        let election = config.election();
        let shards_cancel = CancellationToken::new();
        // A dry run holds no replica Lease: it would count as a replica the real ones
        // hand tenants to, which it would then only observe.
        let (ownership, shards) = if config.leader_election.enabled && !config.dry_run {
            let shards = Shards::spawn(client.clone(), election.clone(), shards_cancel.clone());
            let views = shards.views.clone();
            let leadership = shards.leadership();
            let shards = Arc::new(shards);
            let acks = shards.clone();
            (
                Ownership {
                    views,
                    ack: Box::new(move |id| acks.ack(id)),
                    leadership,
                },
                Some(shards),
            )
        } else {
            (Ownership::single(&election.identity), None)
        };
        let plugins = &base.tenants.credential_plugins;
        let credentials = CredentialPolicy {
            plugins: plugins.clone(),
            // Allowed plugins run under this program's credential-plugin subcommand; without
            // its path none can run.
            runner: (!plugins.is_empty())
                .then(|| std::env::current_exe().ok())
                .flatten(),
        };
        let settings = TenantSettings {
            base,
            election,
            credentials,
            pools,
            dry_run: config.dry_run,
        };
        let manager = tenants::spawn(
            client.clone(),
            settings,
            ownership,
            health,
            metrics,
            directory.clone(),
            cancel,
        );
        let work = tokio::spawn(async move {
            if let Err(err) = manager.await {
                error!(error = %err, "the tenant manager failed");
            }
            // Every tenant has stopped: withdraw from the replicas so the others
            // take the tenants at once (the manager, gone now, held the other
            // handle).
            shards_cancel.cancel();
            if let Some(shards) = shards.and_then(Arc::into_inner) {
                shards.stopped().await;
            }
        });
        (work, directory)
    }

    /// The single-cluster mode's work: leader election (if on) and the runner.
    fn spawn_single(
        config: &Config,
        kube_config: &kube::Config,
        client: &kube::Client,
        runner: Runner,
        leader_metrics: LeaderMetrics,
        health: Health,
        cancel: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, StartError> {
        // Leadership outlives the runner, so passes running at shutdown may finish as leader.
        let leader_cancel = CancellationToken::new();
        let (leader, leader_task) = if config.dry_run {
            if config.leader_election.enabled {
                info!(
                    "dry run: not joining the leader election (a dry run holds no Lease and \
                     never keeps a real replica from leading); every loop runs its dry passes"
                );
            }
            (leader::without_election(&leader_metrics, false), None)
        } else if config.leader_election.enabled {
            let election_client = leader::election_client(
                kube_config,
                config.kubeconfig.as_deref(),
                config.leader_election.renew_grace,
            )
            .map_err(StartError::ElectionClient)?;
            let clients = leader::ElectionClients {
                watch: client.clone(),
                write: election_client,
            };
            let (receiver, task) = leader::spawn(
                clients,
                config.election(),
                leader_metrics,
                health,
                leader_cancel.clone(),
            );
            (receiver, Some(task))
        } else {
            (leader::without_election(&leader_metrics, true), None)
        };
        Ok(tokio::spawn(async move {
            runner.run(leader, cancel).await;
            leader_cancel.cancel();
            if let Some(task) = leader_task {
                // Releasing the Lease is bounded by the renew grace inside the task.
                let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
            }
        }))
    }

    /// Whether the controller stopped (it only stops after `cancel`).
    pub fn task_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits until the controller stopped (after `cancel`).
    pub async fn wait(self) {
        if let Err(err) = self.task.await {
            error!(error = %err, "controller task failed");
        }
    }
}

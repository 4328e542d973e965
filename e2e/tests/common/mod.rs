//! Process harness for the end-to-end tests: the simulator and the controller run as real
//! processes, driven and observed through the Kubernetes API, their admin ports and their exit codes.
//!
//! Set `BOOTSTRAP_E2E_KUBECONFIG` to run the same tests against a real cluster (one at a time:
//! they share it); the parts that need the simulator's backdoor, fault injection or request log
//! are skipped there (`Target::sim`), each through [`skip`], which says so where a passing test's
//! output is not hidden and appends it to the file `BOOTSTRAP_E2E_SKIP_LOG` names
//! (`e2e/control-plane/test.sh` compares that list with the one it expects).

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod chaos;
pub mod control_plane;
pub mod node_port_bitmap;

use anyhow::{Context, Result, bail, ensure};
use apiserver_sim::RequestRecord;
use ipnet::IpNet;
use k8s_openapi::api::networking::v1::ServiceCIDR;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};

/// The real binaries, from the same target directory as the running test: `cargo test
/// --workspace` builds them because their own packages have integration tests.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (`cargo build --workspace --bins`, or run the \
         whole suite with `cargo test --workspace`)",
        path.display()
    );
    path
}

pub fn controller_bin() -> PathBuf {
    binary("bootstrap-controller")
}

pub fn sim_bin() -> PathBuf {
    binary("apiserver-sim")
}

/// The environment variable naming the file every skip (and every test run against a given
/// cluster, see [`Target::start_with`]) is appended to, one line each.
pub const SKIP_LOG: &str = "BOOTSTRAP_E2E_SKIP_LOG";

/// `<test file>::<test>` of the running test: the file from the test binary's name
/// (`<file>-<hash>`), the test from its thread's name (libtest runs each test on a thread named
/// after it, and `#[tokio::test]` polls the test's body on that thread).
pub fn test_id() -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_default();
    let binary = binary
        .rsplit_once('-')
        .map_or(binary.as_str(), |(name, _)| name)
        .to_owned();
    let thread = std::thread::current();
    format!("{binary}::{}", thread.name().unwrap_or("unnamed"))
}

/// One line (`kind test: text`) of the run's record, appended to the file `BOOTSTRAP_E2E_SKIP_LOG`
/// names, if any. A record that cannot be written fails the test: a skip nobody counts is what
/// the record is there to prevent.
fn record(kind: &str, text: &str) -> String {
    use std::io::Write;
    let line = format!("{kind} {}: {}", test_id(), text.replace('\n', " "));
    if let Some(path) = std::env::var_os(SKIP_LOG) {
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| writeln!(file, "{line}"));
        if let Err(err) = written {
            panic!(
                "appending to {SKIP_LOG} ({}): {err}",
                Path::new(&path).display()
            );
        }
    }
    line
}

/// Says that the running test (or the part of it named in `reason`) is skipped: on stdout
/// through its handle (libtest captures `println!` of a passing test, not the handle), and in
/// the file `BOOTSTRAP_E2E_SKIP_LOG` names.
pub fn skip(reason: &str) {
    use std::io::Write;
    let line = record("SKIPPED", reason);
    let _ = writeln!(std::io::stdout().lock(), "{line}");
}

/// Generous: these machines have two cores and run several test binaries at once.
pub const CONVERGE: Duration = Duration::from_secs(30);

/// Where the tests run: a simulator process of their own, or a real cluster.
pub enum Target {
    Sim(SimProcess),
    Cluster { kubeconfig: PathBuf },
}

impl Target {
    pub async fn start() -> Result<Self> {
        Self::start_with(&[]).await
    }

    /// `sim_args` are extra `apiserver-sim` flags; ignored against a real cluster.
    pub async fn start_with(sim_args: &[&str]) -> Result<Self> {
        match std::env::var_os("BOOTSTRAP_E2E_KUBECONFIG") {
            Some(path) => {
                // Counted by e2e/control-plane/test.sh: a test file none of whose tests ran
                // against the cluster it was given is listed.
                record("CLUSTER", "runs against the given cluster");
                Ok(Target::Cluster {
                    kubeconfig: PathBuf::from(path),
                })
            }
            None => Ok(Target::Sim(SimProcess::start(sim_args).await?)),
        }
    }

    pub fn kubeconfig(&self) -> &Path {
        match self {
            Target::Sim(sim) => &sim.kubeconfig,
            Target::Cluster { kubeconfig } => kubeconfig,
        }
    }

    pub async fn client(&self) -> Result<Client> {
        client_from(self.kubeconfig()).await
    }

    /// An address the target apiserver's serving certificate holds, for tests that advertise
    /// one the probe's check must accept: 192.0.2.1 is a SAN of the simulator's certificate (and
    /// of the real control plane's); a real cluster's is named by
    /// `BOOTSTRAP_E2E_CERTIFICATE_ADDRESS` (on kind and kubeadm, the node's address).
    pub fn certificate_address(&self) -> Result<String> {
        match self {
            Target::Sim(_) => Ok("192.0.2.1".to_owned()),
            Target::Cluster { .. } => std::env::var("BOOTSTRAP_E2E_CERTIFICATE_ADDRESS").context(
                "BOOTSTRAP_E2E_CERTIFICATE_ADDRESS is not set: against a real cluster, set it to \
                 an IP address the apiserver's serving certificate holds (kubeadm and kind: the \
                 control-plane node's InternalIP)",
            ),
        }
    }

    /// The target's service range as `--service-cluster-ip-range` takes it: the simulator's (see
    /// [`SimProcess::service_range`]), or a real cluster's ServiceCIDR `kubernetes`.
    pub async fn service_range(&self) -> Result<String> {
        match self {
            Target::Sim(sim) => Ok(sim.service_range.clone()),
            Target::Cluster { .. } => service_range_of(&self.client().await?).await,
        }
    }

    /// Whether the target serves `resource` in `group_version` (the simulator serves every API
    /// the tests use); where it does not, [`skip`]s `what`, naming the API and the Kubernetes
    /// minor that serves it by default (`since`).
    pub async fn serves(
        &self,
        what: &str,
        group_version: &str,
        resource: &str,
        since: &str,
    ) -> Result<bool> {
        let served = match self {
            Target::Sim(_) => true,
            Target::Cluster { .. } => {
                serves(&self.client().await?, group_version, resource).await?
            }
        };
        if !served {
            skip(&format!(
                "{what}: needs {group_version} {resource}, served from Kubernetes {since} (not \
                 served by this cluster)"
            ));
        }
        Ok(served)
    }

    /// The simulator, or `None` (after a [`skip`] naming `what` is skipped) when the test runs
    /// against a real cluster: for the parts of a test that need its backdoor, fault injection
    /// or request log.
    pub fn sim(&self, what: &str) -> Option<&SimProcess> {
        let sim = self.as_sim();
        if sim.is_none() {
            skip(&format!(
                "{what}: needs the simulator's backdoor, faults or request log (real cluster)"
            ));
        }
        sim
    }

    /// The simulator, or `None` against a real cluster, where the caller does the same by other
    /// means (nothing is skipped).
    pub fn as_sim(&self) -> Option<&SimProcess> {
        match self {
            Target::Sim(sim) => Some(sim),
            Target::Cluster { .. } => None,
        }
    }
}

/// The label of the apiserver membership Leases (kube-system) the controllers write.
pub const MEMBERSHIP_LEASES: &str = "bootstrap-controller.io/apiserver-endpoint=kubernetes";

/// What controllers of earlier tests leave behind in kube-system on a shared real cluster: their
/// membership Leases (a long TTL keeps an address listed for minutes) and the leader-election
/// Lease (a killed holder keeps it for a lease duration, and its holder's name is not the test's).
/// Deleted when a test that counts members or reads the leader starts (see [`forget_controllers`])
/// and, through this guard's drop, when it ends; declare it before the controllers, so that they
/// are gone first. Nothing to do on a fresh simulator.
pub struct ControllerLeftovers(Option<PathBuf>);

impl ControllerLeftovers {
    pub fn forget(target: &Target) -> Result<Self> {
        match target {
            Target::Sim(_) => Ok(Self(None)),
            Target::Cluster { kubeconfig } => {
                forget_controllers(kubeconfig)?;
                Ok(Self(Some(kubeconfig.clone())))
            }
        }
    }
}

impl Drop for ControllerLeftovers {
    fn drop(&mut self) {
        if let Some(kubeconfig) = &self.0
            && let Err(err) = forget_controllers(kubeconfig)
        {
            eprintln!("cleaning up the controllers' Leases: {err:#}");
        }
    }
}

/// Deletes the membership Leases and the leader-election Lease (kubectl: also from a drop).
pub fn forget_controllers(kubeconfig: &Path) -> Result<()> {
    for args in [
        &["delete", "leases", "-l", MEMBERSHIP_LEASES][..],
        &["delete", "lease", "bootstrap-controller"][..],
    ] {
        let out = kubectl(
            kubeconfig,
            &[args, &["-n", "kube-system", "--ignore-not-found"]].concat(),
        )?;
        if !out.status.success() {
            bail!("kubectl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    Ok(())
}

pub async fn client_from(kubeconfig: &Path) -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(kubeconfig)
        .with_context(|| format!("reading {}", kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .context("building client config")?;
    Ok(Client::try_from(config)?)
}

/// The environment variable naming a real cluster's service range where it has no ServiceCIDR
/// `kubernetes` (kube-apiserver before 1.33 serves none; with `MultiCIDRServiceAllocator` off it
/// serves the API but makes none): nothing in the API tells it there. `e2e/control-plane/test.sh` sets it from up.sh's `--service-cluster-ip-range`.
pub const SERVICE_RANGE: &str = "BOOTSTRAP_E2E_SERVICE_RANGE";

/// The service range of a cluster, from its ServiceCIDR `kubernetes` (which kube-apiserver 1.33+
/// creates from its `--service-cluster-ip-range`): its CIDRs, comma-joined; from
/// `BOOTSTRAP_E2E_SERVICE_RANGE` where the cluster has none.
pub async fn service_range_of(client: &Client) -> Result<String> {
    let cidr = if serves(client, "networking.k8s.io/v1", "servicecidrs").await? {
        Api::<ServiceCIDR>::all(client.clone())
            .get_opt("kubernetes")
            .await
            .context("reading the ServiceCIDR kubernetes (networking.k8s.io/v1)")?
    } else {
        None
    };
    let Some(cidr) = cidr else {
        return std::env::var(SERVICE_RANGE).with_context(|| {
            format!(
                "the cluster has no ServiceCIDR kubernetes (networking.k8s.io/v1), which \
                 kube-apiserver 1.33+ creates from its --service-cluster-ip-range unless \
                 MultiCIDRServiceAllocator is off: set {SERVICE_RANGE} to that range"
            )
        });
    };
    let cidrs = cidr.spec.and_then(|spec| spec.cidrs).unwrap_or_default();
    ensure!(
        !cidrs.is_empty(),
        "the ServiceCIDR kubernetes lists no CIDRs"
    );
    Ok(cidrs.join(","))
}

/// Whether the cluster serves `resource` (plural) in `group_version`, from its discovery: what
/// a cluster serves depends on its version, its emulated version and its feature gates, so
/// nothing but discovery says it.
pub async fn serves(client: &Client, group_version: &str, resource: &str) -> Result<bool> {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => Ok(list.resources.iter().any(|r| r.name == resource)),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
        Err(err) => Err(err).with_context(|| format!("discovery of {group_version}")),
    }
}

/// Address `n` of a service range (of its first CIDR if it has two, the primary family's): what
/// the tests plant and ask for in whatever range the target has. In a range of /20 or larger,
/// offsets up to 255 are in the band kube-apiserver keeps for static addresses (the lowest 256),
/// which it hands out dynamically only once the rest is full: there a test's address does not
/// meet a Service's allocated one.
pub fn service_ip(range: &str, n: u32) -> Result<String> {
    let first = range.split(',').next().unwrap_or_default().trim();
    let net: IpNet = first
        .parse()
        .with_context(|| format!("service range {range:?}"))?;
    let ip = match net {
        IpNet::V4(v4) => u32::from(v4.network())
            .checked_add(n)
            .map(|ip| IpAddr::from(std::net::Ipv4Addr::from(ip))),
        IpNet::V6(v6) => u128::from(v6.network())
            .checked_add(u128::from(n))
            .map(|ip| IpAddr::from(std::net::Ipv6Addr::from(ip))),
    };
    match ip {
        Some(ip) if net.contains(&ip) => Ok(ip.to_string()),
        _ => bail!("the service range {range} has no address {n}"),
    }
}

/// apiserver-sim's service range unless a test starts it with `--service-cluster-ip-range`
/// (kubeadm's default).
pub const SIM_SERVICE_RANGE: &str = "10.96.0.0/12";

/// A running `apiserver-sim` process; killed on drop.
pub struct SimProcess {
    child: Child,
    pub kubeconfig: PathBuf,
    /// Its `--service-cluster-ip-range`: [`SIM_SERVICE_RANGE`] unless started with another.
    pub service_range: String,
    dir: tempfile::TempDir,
}

impl SimProcess {
    pub async fn start(extra: &[&str]) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let kubeconfig = dir.path().join("kubeconfig");
        let log = std::fs::File::create(dir.path().join("sim.log"))?;
        let mut command = Command::new(sim_bin());
        if !extra.contains(&"--listen") {
            command.args(["--listen", "127.0.0.1:0"]);
        }
        let child = command
            .arg("--kubeconfig-out")
            .arg(&kubeconfig)
            .args(extra)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting apiserver-sim")?;
        let service_range = extra
            .iter()
            .position(|arg| *arg == "--service-cluster-ip-range")
            .and_then(|i| extra.get(i + 1))
            .map_or(SIM_SERVICE_RANGE, |range| *range)
            .to_owned();
        let mut sim = SimProcess {
            child,
            kubeconfig,
            service_range,
            dir,
        };
        let deadline = Instant::now() + CONVERGE;
        loop {
            if let Some(status) = sim.child.try_wait()? {
                bail!("apiserver-sim exited early ({status}):\n{}", sim.log());
            }
            if sim.kubeconfig.exists()
                && let Ok(client) = client_from(&sim.kubeconfig).await
                && client.apiserver_version().await.is_ok()
            {
                return Ok(sim);
            }
            if Instant::now() > deadline {
                bail!("apiserver-sim did not start serving:\n{}", sim.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("sim.log")).unwrap_or_default()
    }

    /// Every request fails with a 500 or 503, or is dropped, with probability `p`.
    pub async fn inject_random_failures(&self, p: f64) -> Result<()> {
        let third = p / 3.0;
        for fault in [
            serde_json::json!({"type": "error", "code": 500}),
            serde_json::json!({"type": "error", "code": 503, "retryAfterSeconds": 1}),
            serde_json::json!({"type": "dropConnection"}),
        ] {
            self.admin(
                "POST",
                "/sim/faults",
                Some(serde_json::json!({"fault": fault, "trigger": {"probability": third}})),
            )
            .await?;
        }
        Ok(())
    }

    pub async fn clear_faults(&self) -> Result<()> {
        self.admin("DELETE", "/sim/faults", None).await.map(drop)
    }

    pub async fn requests(&self) -> Result<Vec<RequestRecord>> {
        Ok(serde_json::from_str(
            &self.admin("GET", "/sim/requests", None).await?,
        )?)
    }

    pub async fn clear_requests(&self) -> Result<()> {
        self.admin("DELETE", "/sim/requests", None).await.map(drop)
    }

    /// Makes the simulator's own `/readyz` pass or fail, as its apiserver starting or stopping.
    pub async fn set_ready(&self, ready: bool) -> Result<()> {
        self.admin(
            "PUT",
            "/sim/ready",
            Some(serde_json::json!({ "ready": ready })),
        )
        .await
        .map(drop)
    }

    /// Calls the simulator's `/sim/...` admin API with the kubeconfig's credentials.
    pub async fn admin(
        &self,
        method: &str,
        path: &str,
        body: Option<serde_json::Value>,
    ) -> Result<String> {
        let client = client_from(&self.kubeconfig).await?;
        let body = body.map(|b| b.to_string().into_bytes()).unwrap_or_default();
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(body)?;
        Ok(client.request_text(request).await?)
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `bootstrap-controller run`; killed on drop. Its log is printed if a test fails
/// while holding it (see [`ControllerProcess::log`]).
pub struct ControllerProcess {
    child: Option<Child>,
    pub admin: SocketAddr,
    dir: tempfile::TempDir,
}

pub fn free_port() -> Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

impl ControllerProcess {
    pub fn start(kubeconfig: &Path, extra: &[&str]) -> Result<Self> {
        Self::spawn(Command::new(controller_bin()), kubeconfig, extra)
    }

    /// [`Self::start`] on a given admin address: the same instance started again.
    pub fn start_at(admin: SocketAddr, kubeconfig: &Path, extra: &[&str]) -> Result<Self> {
        Self::spawn_at(Command::new(controller_bin()), admin, kubeconfig, extra)
    }

    /// [`Self::start`] with another build of the controller (a benchmark comparing two).
    pub fn start_binary(binary: &Path, kubeconfig: &Path, extra: &[&str]) -> Result<Self> {
        Self::spawn(Command::new(binary), kubeconfig, extra)
    }

    /// Starts the controller in a private mount namespace whose `/etc/hosts` is `hosts`, so a
    /// test controls what names resolve to for this process alone by rewriting that file in
    /// place. Needs root (`unshare -m`): without it, `None` after a [`skip`]; as root under CI
    /// (`CI=true`), where the test must run, an error.
    pub fn start_with_hosts(
        kubeconfig: &Path,
        hosts: &Path,
        extra: &[&str],
    ) -> Result<Option<Self>> {
        let probe = Command::new("unshare")
            .args(["-m", "sh", "-c", "mount --bind \"$0\" /etc/hosts"])
            .arg(hosts)
            .output();
        if !matches!(&probe, Ok(out) if out.status.success()) {
            let detail = match &probe {
                Ok(out) => String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                Err(err) => err.to_string(),
            };
            if is_root() && std::env::var("CI").is_ok_and(|ci| ci == "true") {
                bail!(
                    "as root under CI, `unshare -m` must bind-mount a private /etc/hosts: {detail}"
                );
            }
            eprintln!("unshare -m: {detail}");
            skip("cannot bind-mount a private /etc/hosts (`unshare -m` needs root)");
            return Ok(None);
        }
        let mut command = Command::new("unshare");
        command
            .args([
                "-m",
                "sh",
                "-c",
                "mount --bind \"$0\" /etc/hosts && exec \"$@\"",
            ])
            .arg(hosts)
            .arg(controller_bin());
        Self::spawn(command, kubeconfig, extra).map(Some)
    }

    fn spawn(command: Command, kubeconfig: &Path, extra: &[&str]) -> Result<Self> {
        Self::spawn_at(command, free_port()?, kubeconfig, extra)
    }

    fn spawn_at(
        mut command: Command,
        admin: SocketAddr,
        kubeconfig: &Path,
        extra: &[&str],
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let log = std::fs::File::create(dir.path().join("controller.log"))?;
        // The suite's own settings (BOOTSTRAP_E2E_*, BOOTSTRAP_CHAOS_*) are not the
        // controller's: passed on, it would warn that they name no setting.
        for (name, _) in std::env::vars_os() {
            let text = name.to_string_lossy();
            if text.starts_with("BOOTSTRAP_E2E_") || text.starts_with("BOOTSTRAP_CHAOS_") {
                command.env_remove(&name);
            }
        }
        let child = command
            .arg("run")
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .args(["--admin-addr", &admin.to_string()])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting bootstrap-controller")?;
        Ok(ControllerProcess {
            child: Some(child),
            admin,
            dir,
        })
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.as_mut().map(Child::try_wait), Some(Ok(None)))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// GET on the admin port; returns the status code and body.
    pub async fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        admin_get(self.admin, path).await
    }

    pub async fn wait_ready(&mut self) -> Result<()> {
        let admin = self.admin;
        let deadline = Instant::now() + CONVERGE;
        loop {
            if !self.is_running() {
                bail!("controller exited before ready:\n{}", self.log());
            }
            if let Ok((200, _)) = admin_get(admin, "/readyz").await {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("controller not ready in time:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// What this controller's `bootstrap_loop_drift_repaired_total` says `loop_name` repaired of
    /// `kind` (every series of that loop and kind summed: one per tenant in management mode).
    /// The repair counter, not `drift_found`: a dry run or a refused write moves only the latter.
    pub async fn repaired(&self, loop_name: &str, kind: &str) -> Result<u64> {
        let (code, text) = self.admin_get("/metrics").await?;
        ensure!(code == 200, "/metrics answered {code}");
        Ok(drift_repaired(&text, loop_name, kind))
    }

    /// SIGKILL: no shutdown hook runs, as when a node dies.
    pub fn kill(&mut self) -> Result<()> {
        let mut child = self.child.take().context("already stopped")?;
        child.kill()?;
        child.wait()?;
        Ok(())
    }

    /// SIGTERM, then wait for the exit status.
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        let mut child = self.child.take().context("already stopped")?;
        let status = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM failed");
        }
        let deadline = Instant::now() + CONVERGE;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("controller did not exit after SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            eprintln!("---- controller log ----\n{}", self.log());
        }
    }
}

/// The sum of the `bootstrap_loop_drift_repaired_total` series of `loop_name` and `kind` in an
/// OpenMetrics text.
pub fn drift_repaired(metrics: &str, loop_name: &str, kind: &str) -> u64 {
    let (want_loop, want_kind) = (format!("loop=\"{loop_name}\""), format!("kind=\"{kind}\""));
    metrics
        .lines()
        .filter_map(|line| line.strip_prefix("bootstrap_loop_drift_repaired_total{"))
        .filter_map(|rest| rest.split_once("} "))
        .filter(|(labels, _)| {
            let labels: Vec<&str> = labels.split(',').collect();
            labels.contains(&want_loop.as_str()) && labels.contains(&want_kind.as_str())
        })
        .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
        .map(|value| value as u64)
        .sum()
}

/// The field managers of an object's `managedFields`: who wrote it, as the apiserver recorded it
/// (`bootstrap-controller` for this controller; `kube-apiserver` for the apiserver's own loops).
pub fn managers(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Vec<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter_map(|entry| entry.manager.clone())
        .collect()
}

/// Whether this process runs as root (effective uid 0), from `/proc/self/status`.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            == Some("0")
    })
}

/// Minimal GET over a plain TCP connection (the admin port and Prometheus are plain HTTP), as
/// HTTP/1.0 so that the body is never chunked.
pub async fn admin_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    let response = String::from_utf8_lossy(&response);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .context("no status line")?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    Ok((status, body))
}

/// Runs the controller binary to completion (for `check` and `config` subcommands).
pub fn run_controller(args: &[&str]) -> Result<Output> {
    Ok(Command::new(controller_bin())
        .args(args)
        .stdin(Stdio::null())
        .output()?)
}

pub fn kubectl(kubeconfig: &Path, args: &[&str]) -> Result<Output> {
    Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running kubectl")
}

/// Polls `check` until it returns `Ok(Some)`, failing after `timeout` with `what` (and the last
/// error) in the message. The error type is fixed here so that closures can write `Ok(...)`.
pub async fn eventually<T, F, Fut>(what: &str, timeout: Duration, check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    Ok(test_support::eventually(what, timeout, check).await?)
}

/// A configuration file in a temporary directory that lives as long as this value.
pub struct ConfigFile {
    _dir: tempfile::TempDir,
    pub path: String,
}

impl ConfigFile {
    pub fn new(yaml: &str) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, yaml)?;
        Ok(Self {
            path: path.to_string_lossy().into_owned(),
            _dir: dir,
        })
    }
}

/// Nearest-rank percentile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Prints `label: n=.. p50=.. ms p99=.. ms max=.. ms` for a benchmark.
pub fn summary(label: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{label}: n={} p50={:.1} ms p99={:.1} ms max={:.1} ms",
        samples.len(),
        ms(percentile(&samples, 50.0)),
        ms(percentile(&samples, 99.0)),
        ms(samples.last().copied().unwrap_or_default()),
    );
}

/// The requests replicas sent in a window, from the simulator's log: per replica (its user agent
/// carries its pid) and per kind (`verb resource`, or `verb path` for non-resource requests).
pub struct RequestsAtRest {
    pub window: Duration,
    pub per_replica: std::collections::BTreeMap<(usize, String), usize>,
}

impl RequestsAtRest {
    /// Clears the log, waits `window`, and sorts what `replicas` sent.
    pub async fn measure(
        sim: &SimProcess,
        replicas: &[ControllerProcess],
        window: Duration,
    ) -> Result<Self> {
        sim.clear_requests().await?;
        tokio::time::sleep(window).await;
        let pids: Vec<String> = replicas
            .iter()
            .map(|r| format!("pid {})", r.pid().unwrap_or_default()))
            .collect();
        let mut per_replica = std::collections::BTreeMap::new();
        for request in sim.requests().await? {
            let Some(replica) = pids.iter().position(|pid| request.user_agent.contains(pid)) else {
                continue;
            };
            let what = if request.resource.is_empty() {
                format!("{} {}", request.verb, request.path)
            } else if request.subresource.is_empty() {
                format!("{} {}", request.verb, request.resource)
            } else {
                format!(
                    "{} {}/{}",
                    request.verb, request.resource, request.subresource
                )
            };
            *per_replica.entry((replica + 1, what)).or_default() += 1;
        }
        Ok(Self {
            window,
            per_replica,
        })
    }

    pub fn per_minute(&self, count: usize) -> f64 {
        count as f64 * 60.0 / self.window.as_secs_f64()
    }

    /// One line per replica and kind, with requests per minute.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for ((replica, what), count) in &self.per_replica {
            out += &format!(
                "  replica {replica}  {:>6.1}/min  {what}\n",
                self.per_minute(*count)
            );
        }
        out
    }

    /// Reads of API objects (GET or LIST of a resource): watches and health probes aside.
    pub fn reads(&self) -> Vec<String> {
        self.per_replica
            .iter()
            .filter(|((_, what), _)| what.starts_with("get ") || what.starts_with("list "))
            .filter(|((_, what), _)| !what.contains(" /"))
            .map(|((replica, what), count)| format!("replica {replica}: {count} x {what}"))
            .collect()
    }
}

/// The API of an object's kind, from its apiVersion and kind, with the resource (its plural, its
/// scope) found through the API's discovery rather than guessed from the kind.
pub async fn api_of(
    client: &Client,
    object: &serde_json::Value,
) -> Result<kube::Api<kube::api::DynamicObject>> {
    let api_version = object["apiVersion"].as_str().context("apiVersion")?;
    let kind = object["kind"].as_str().context("kind")?;
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
    let (resource, _) = kube::discovery::pinned_kind(client, &gvk)
        .await
        .with_context(|| format!("discovering {api_version} {kind}"))?;
    Ok(match object["metadata"]["namespace"].as_str() {
        Some(namespace) => kube::Api::namespaced_with(client.clone(), namespace, &resource),
        None => kube::Api::all_with(client.clone(), &resource),
    })
}

/// Creates `object` through the API, or replaces the one of its name. The controller may write
/// that object between the read and the replace: a conflict is tried again, a few times.
pub async fn create_or_replace(client: &Client, object: &serde_json::Value) -> Result<()> {
    let api = api_of(client, object).await?;
    let name = object["metadata"]["name"]
        .as_str()
        .context("name")?
        .to_owned();
    let mut typed: kube::api::DynamicObject = serde_json::from_value(object.clone())?;
    let post = kube::api::PostParams::default();
    let mut attempt = 0;
    loop {
        attempt += 1;
        typed.metadata.resource_version = None;
        match api.create(&post, &typed).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 => {}
            Err(err) => return Err(err).with_context(|| format!("creating {name}: {object}")),
        }
        let Some(current) = api.get_opt(&name).await? else {
            ensure!(attempt < 5, "{name} exists and does not, {attempt} times");
            continue;
        };
        typed.metadata.resource_version = current.metadata.resource_version;
        match api.replace(&name, &post, &typed).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(status)) if status.code == 409 && attempt < 5 => {}
            Err(err) => return Err(err).with_context(|| format!("replacing {name}")),
        }
    }
}

/// A NodePort Service in `default` asking for `node_port`, as the NodePort tests plant it.
pub fn node_port_service(name: &str, node_port: i32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": {
            "type": "NodePort",
            "ports": [{"port": 80, "protocol": "TCP", "nodePort": node_port}]
        }
    })
}

/// The resident set size of process `pid` in KiB, from `/proc/<pid>/status`.
pub fn rss_kib(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .context("no VmRSS")
}

/// The addresses and ports an Endpoints object lists, over all its subsets.
pub fn endpoints_addresses_and_ports(
    endpoints: k8s_openapi::api::core::v1::Endpoints,
) -> (Vec<String>, Vec<i32>) {
    let subsets = endpoints.subsets.unwrap_or_default();
    let addresses = subsets
        .iter()
        .flat_map(|s| s.addresses.iter().flatten())
        .map(|a| a.ip.clone())
        .collect();
    let ports = subsets
        .iter()
        .flat_map(|s| s.ports.iter().flatten())
        .map(|p| p.port)
        .collect();
    (addresses, ports)
}

/// The resources the loops watch in a tenant cluster.
pub const LOOP_WATCHED: [&str; 7] = [
    "namespaces",
    "services",
    "endpoints",
    "endpointslices",
    "leases",
    "ipaddresses",
    "servicecidrs",
];

/// The controller's flags for management mode as the tests' fleets set it up: tenants from the
/// labelled Secrets in `tenants`, each with the simulator's default service range.
pub const MANAGEMENT_ARGS: [&str; 6] = [
    "--tenants-secret-selector",
    "bootstrap-controller.io/tenant=true",
    "--tenants-namespace",
    "tenants",
    "--service-cluster-ip-range",
    SIM_SERVICE_RANGE,
];

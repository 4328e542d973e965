//! A real control plane for the tests that only a real kube-apiserver can judge: etcd,
//! kube-apiserver(s) and kube-controller-manager built from the Go modules pinned in
//! `e2e/control-plane/` and started by its `up.sh` (the same script a person uses), stopped by
//! `down.sh` when this value drops.
//!
//! The binaries come from `e2e/control-plane/build.sh` (cached per version under
//! `target/control-plane/`), or from `BOOTSTRAP_CONTROL_PLANE_BIN` when set.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

fn scripts() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("control-plane")
}

fn run_script(script: &str, args: &[&std::ffi::OsStr]) -> Result<String> {
    let output = Command::new(scripts().join(script))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {script}"))?;
    ensure!(
        output.status.success(),
        "{script} failed ({}):\n{}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// The directory holding etcd, kube-apiserver and kube-controller-manager: built once per test
/// process (and cached across runs by build.sh).
pub fn binaries() -> Result<PathBuf> {
    static BIN: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(|| {
        if let Some(dir) = std::env::var_os("BOOTSTRAP_CONTROL_PLANE_BIN")
            && Path::new(&dir).join("kube-apiserver").exists()
        {
            return Ok(PathBuf::from(dir));
        }
        let out = run_script("build.sh", &[]).map_err(|err| format!("{err:#}"))?;
        let dir = out.lines().last().unwrap_or_default();
        Ok(PathBuf::from(dir))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// The directory holding another pinned minor's binaries (`build.sh --kubernetes MINOR`), if
/// they are built there: building one takes minutes, so tests use it only where it already is
/// (`./run-tests.sh` builds the oldest before the workspace's tests).
pub fn built_binaries_of(minor: &str) -> Result<Option<PathBuf>> {
    let out = run_script(
        "build.sh",
        &["--kubernetes".as_ref(), minor.as_ref(), "--dir".as_ref()],
    )?;
    let dir = PathBuf::from(out.lines().last().unwrap_or_default());
    Ok(dir.join("kube-apiserver").exists().then_some(dir))
}

/// One running control plane; `down.sh` stops it on drop (its directory, with the logs and audit
/// logs, is printed when a test fails while holding it).
pub struct ControlPlane {
    dir: Option<tempfile::TempDir>,
    pub env: BTreeMap<String, String>,
}

impl ControlPlane {
    pub fn start(apiservers: usize) -> Result<Self> {
        Self::start_with(apiservers, &[])
    }

    /// `extra`: more `up.sh` arguments.
    pub fn start_with(apiservers: usize, extra: &[&str]) -> Result<Self> {
        let bin = binaries()?;
        let dir = tempfile::Builder::new()
            .prefix("control-plane-")
            .tempdir()?;
        let apiservers = apiservers.to_string();
        let mut args: Vec<&std::ffi::OsStr> = vec![
            dir.path().as_os_str(),
            "--apiservers".as_ref(),
            apiservers.as_ref(),
            "--bin".as_ref(),
            bin.as_os_str(),
        ];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        run_script("up.sh", &args)?;
        let env = std::fs::read_to_string(dir.path().join("env"))?
            .lines()
            .filter_map(|line| line.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Ok(Self {
            dir: Some(dir),
            env,
        })
    }

    /// A control plane whose apiservers store under `etcd_prefix` in an etcd that already runs
    /// (`etcd_url`, e.g. another control plane's [`Self::etcd_url`]): `up.sh --etcd-url`. Its
    /// ports are free ones picked at start, as every control plane's, so several run side by
    /// side; dropping it stops its apiservers and controller-manager and leaves that etcd alone.
    /// `extra`: more `up.sh` arguments.
    pub fn start_on_etcd(
        apiservers: usize,
        etcd_url: &str,
        etcd_prefix: &str,
        extra: &[&str],
    ) -> Result<Self> {
        let mut args = vec!["--etcd-url", etcd_url, "--etcd-prefix", etcd_prefix];
        args.extend_from_slice(extra);
        Self::start_with(apiservers, &args)
    }

    pub fn dir(&self) -> &Path {
        self.dir
            .as_ref()
            .map_or(Path::new("/nonexistent"), |dir| dir.path())
    }

    fn var(&self, key: &str) -> Result<&str> {
        self.env
            .get(key)
            .map(String::as_str)
            .with_context(|| format!("{key} missing from the control plane's env"))
    }

    /// system:masters on apiserver `n` (1-based).
    pub fn admin_kubeconfig(&self, n: usize) -> PathBuf {
        self.dir().join(format!("admin-{n}.kubeconfig"))
    }

    /// `https://127.0.0.1:PORT` of apiserver `n`.
    pub fn apiserver_url(&self, n: usize) -> Result<&str> {
        self.var(&format!("APISERVER_{n}_URL"))
    }

    /// The TEST-NET address apiserver `n` advertises.
    pub fn apiserver_address(&self, n: usize) -> Result<&str> {
        self.var(&format!("APISERVER_{n}_ADDRESS"))
    }

    /// The port apiserver `n` serves on: the controller's `--secure-port` beside it.
    pub fn apiserver_port(&self, n: usize) -> Result<&str> {
        self.var(&format!("APISERVER_{n}_PORT"))
    }

    pub fn etcd_url(&self) -> Result<&str> {
        self.var("ETCD_URL")
    }

    /// The network of the etcd's address, for `--tenants-etcd-allowed-cidrs` (a host name:
    /// loopback, where up.sh's etcd listens).
    pub fn etcd_network(&self) -> Result<String> {
        let uri: http::Uri = self.etcd_url()?.parse()?;
        let host = uri.host().context("the etcd URL names no host")?;
        Ok(
            match host.trim_matches(['[', ']']).parse::<std::net::IpAddr>() {
                Ok(std::net::IpAddr::V4(ip)) => format!("{ip}/32"),
                Ok(std::net::IpAddr::V6(ip)) => format!("{ip}/128"),
                Err(_) => "127.0.0.0/8,::1/128".to_owned(),
            },
        )
    }

    /// The apiservers' `--etcd-prefix` (`/registry` unless given).
    pub fn etcd_prefix(&self) -> Result<&str> {
        self.var("ETCD_PREFIX")
    }

    /// Whether up.sh started the etcd (false: `--etcd-url`, someone else's).
    pub fn etcd_started_here(&self) -> bool {
        self.env.get("ETCD_STARTED").is_none_or(|v| v == "true")
    }

    pub fn service_range(&self) -> Result<&str> {
        self.var("SERVICE_CLUSTER_IP_RANGE")
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir().join("ca.crt")
    }

    /// A kubeconfig for user `name` (client certificate, in `groups`) on apiserver `n`.
    pub fn user_kubeconfig(&self, name: &str, groups: &[&str], n: usize) -> Result<PathBuf> {
        let n = n.to_string();
        let mut args: Vec<&std::ffi::OsStr> = vec![
            self.dir().as_os_str(),
            name.as_ref(),
            "--apiserver".as_ref(),
            n.as_ref(),
        ];
        for group in groups {
            args.push("--group".as_ref());
            args.push(group.as_ref());
        }
        let file = format!("{name}-{n}.kubeconfig").replace(':', "_");
        let out = self.dir().join("users").join(file);
        args.push("--out".as_ref());
        args.push(out.as_os_str());
        run_script("kubeconfig.sh", &args)?;
        Ok(out)
    }

    /// The pid up.sh recorded for `name` (`etcd`, `kube-apiserver-N`, `kube-controller-manager`).
    pub fn pid(&self, name: &str) -> Result<u32> {
        let pids = std::fs::read_to_string(self.dir().join("pids"))?;
        pids.lines()
            .filter_map(|line| line.split_once(' '))
            .find(|(n, _)| *n == name)
            .with_context(|| format!("{name} not in pids"))?
            .1
            .parse()
            .context("pid")
    }

    /// Sends `signal` (`TERM`, `KILL`) to one component.
    pub fn signal(&self, name: &str, signal: &str) -> Result<()> {
        let pid = self.pid(name)?;
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()?;
        ensure!(status.success(), "kill -{signal} {name} ({pid}) failed");
        Ok(())
    }

    /// Whether one component's process still runs.
    pub fn is_running(&self, name: &str) -> Result<bool> {
        Ok(process_alive(self.pid(name)?))
    }

    /// Every audit event apiserver `n` has written so far (one JSON object a line).
    /// The apiserver appends while this reads, so a last line without its newline is
    /// still being written: it is left for the next read.
    pub fn audit_events(&self, n: usize) -> Result<Vec<Value>> {
        let path = self.dir().join(format!("audit-{n}.log"));
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        complete
            .lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| serde_json::from_str(line).context("audit line"))
            .collect()
    }

    /// The audit events of every apiserver, of requests by `user`.
    pub fn audit_events_of(&self, user: &str) -> Result<Vec<Value>> {
        let mut events = Vec::new();
        let apiservers: usize = self.var("APISERVERS")?.parse()?;
        for n in 1..=apiservers {
            events.extend(
                self.audit_events(n)?
                    .into_iter()
                    .filter(|event| event["user"]["username"] == user),
            );
        }
        Ok(events)
    }

    pub fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir().join(format!("{name}.log"))).unwrap_or_default()
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Err(err) = run_script("down.sh", &[self.dir().as_os_str()]) {
            eprintln!("stopping the control plane: {err:#}");
        }
        if std::thread::panicking()
            && let Some(dir) = self.dir.take()
        {
            // The logs and audit logs outlive a failed test, for a look.
            eprintln!("control plane logs kept in {}", dir.keep().display());
        }
    }
}

/// Under `test.sh` (the suite against a shared control plane) the tests that start control planes
/// of their own are not repeated: they run with the workspace's tests (`cargo nextest run
/// --workspace`, or `cargo test --workspace`). `binary` is the
/// test file's name, for the command that runs it.
pub fn skipped_under_shared_control_plane(binary: &str, test: &str) -> bool {
    if std::env::var_os("BOOTSTRAP_E2E_KUBECONFIG").is_some() {
        super::skip(&format!(
            "starts control planes of its own; `cargo test -p e2e --test {binary} {test}` \
             without BOOTSTRAP_E2E_KUBECONFIG runs it"
        ));
        return true;
    }
    false
}

/// The right to start control planes, which one test on the machine holds at a time: each
/// control plane is three processes that want a core, and more of them starting beside the other
/// tests leave those tests' short leader Leases waiting for the CPU. The tests run in processes of
/// their own, side by side (`cargo nextest run`; `.config/nextest.toml` gives them one thread, so
/// none waits here on a thread the other tests could use), so the slot is a file's lock (`flock`)
/// in the build's temporary directory; the kernel releases it when the holder exits, however it
/// exits.
pub struct ControlPlaneSlot {
    _lock: std::fs::File,
}

/// Waits for the [`ControlPlaneSlot`]: until the test holding it stops its control planes (or no
/// longer needs the cores, see [`OwnControlPlane::let_the_next_start`]).
pub async fn control_plane_slot() -> Result<ControlPlaneSlot> {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("control-plane-slot.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    let lock = tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .context("waiting for the control plane slot")?
        .with_context(|| format!("locking {}", path.display()))?;
    Ok(ControlPlaneSlot { _lock: lock })
}

/// A control plane of a test's own, holding the [`ControlPlaneSlot`] (until
/// [`OwnControlPlane::let_the_next_start`]); the control plane stops before the slot is released.
pub struct OwnControlPlane {
    cp: ControlPlane,
    slot: Option<ControlPlaneSlot>,
}

impl OwnControlPlane {
    /// Releases the lock while this control plane keeps running: for a test that from here on
    /// only waits and then counts requests in its own audit log, which a second control plane
    /// beside it neither adds to nor changes.
    pub fn let_the_next_start(&mut self) {
        self.slot = None;
    }
}

impl std::ops::Deref for OwnControlPlane {
    type Target = ControlPlane;
    fn deref(&self) -> &ControlPlane {
        &self.cp
    }
}

/// Starts a control plane of `apiservers` for `test` of the test file `binary` once it holds the
/// [`ControlPlaneSlot`]; `None` under the shared control plane, where the test is
/// skipped (see [`skipped_under_shared_control_plane`]).
pub async fn own_control_plane(
    binary: &str,
    test: &str,
    apiservers: usize,
) -> Result<Option<OwnControlPlane>> {
    own_control_plane_with(binary, test, apiservers, &[]).await
}

/// [`own_control_plane`] with more `up.sh` arguments (`extra`), e.g. another service range.
pub async fn own_control_plane_with(
    binary: &str,
    test: &str,
    apiservers: usize,
    extra: &[&str],
) -> Result<Option<OwnControlPlane>> {
    if skipped_under_shared_control_plane(binary, test) {
        return Ok(None);
    }
    let slot = control_plane_slot().await?;
    Ok(Some(OwnControlPlane {
        cp: ControlPlane::start_with(apiservers, extra)?,
        slot: Some(slot),
    }))
}

/// Whether `pid` runs: a zombie does not (up.sh's processes outlive it, so whoever inherits them
/// may reap them late).
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// `kubeconfig` made self-contained (`kubectl config view --flatten`: the CA, certificate
/// and key it names in files embedded as `-data`), as the text a kubeconfig Secret holds.
pub fn self_contained_kubeconfig(kubeconfig: &Path) -> Result<String> {
    let output = Command::new("kubectl")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["config", "view", "--raw", "--flatten", "--minify"])
        .stdin(Stdio::null())
        .output()
        .context("running kubectl config view")?;
    ensure!(
        output.status.success(),
        "kubectl config view --flatten {}: {}",
        kubeconfig.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).context("kubeconfig text")?;
    ensure!(
        text.contains("certificate-authority-data") && text.contains("client-key-data"),
        "not self-contained:\n{text}"
    );
    Ok(text)
}

/// One audit event in a line: `user verb resource ns/name -> code`.
pub fn describe(event: &Value) -> String {
    let object = &event["objectRef"];
    format!(
        "{} {} {}{} {}/{} -> {}",
        event["user"]["username"].as_str().unwrap_or("?"),
        event["verb"].as_str().unwrap_or("?"),
        object["resource"].as_str().unwrap_or("?"),
        object["subresource"]
            .as_str()
            .map(|s| format!("/{s}"))
            .unwrap_or_default(),
        object["namespace"].as_str().unwrap_or(""),
        object["name"].as_str().unwrap_or(""),
        event["responseStatus"]["code"]
    )
}

/// Who made the request an audit event records.
pub fn user(event: &Value) -> &str {
    event["user"]["username"].as_str().unwrap_or("?")
}

/// The writes (create, update, patch, delete) among `events`.
pub fn writes(events: &[Value]) -> Vec<&Value> {
    events
        .iter()
        .filter(|event| {
            matches!(
                event["verb"].as_str(),
                Some("create" | "update" | "patch" | "delete" | "deletecollection")
            )
        })
        .collect()
}

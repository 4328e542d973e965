//! The binary's exit statuses and messages: invalid configuration exits 2 naming the field,
//! before touching any cluster; `check` exits 1 on drift and 2 when the API is unreachable.

use std::process::Command;

use test_support::process::{clean_command, run};

use apiserver_sim::{Sim, SimConfig};

fn binary() -> Command {
    clean_command(env!("CARGO_BIN_EXE_bootstrap-controller"))
}

fn write_config(dir: &tempfile::TempDir, yaml: &str) -> std::path::PathBuf {
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, yaml).expect("write config");
    path
}

#[test]
fn invalid_configurations_exit_2_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        (
            "serviceClusterIPRange: 10.0.0.0/33\n",
            "serviceClusterIPRange",
            "not a valid CIDR",
        ),
        (
            "serviceClusterIPRange: 10.96.0.0/12,10.200.0.0/16\n",
            "serviceClusterIPRange",
            "two IPv4 ranges",
        ),
        (
            "serviceNodePortRange: 32767-30000\n",
            "serviceNodePortRange",
            "inverted",
        ),
        (
            "loops:\n  systemNamespaces:\n    interval: 0s\n",
            "loops.systemNamespaces.interval",
            "greater than zero",
        ),
        (
            "loops:\n  systemNamespaces:\n    intervall: 1m\n",
            "loops.systemNamespaces.intervall",
            "unknown field",
        ),
        (
            "loops:\n  systemNamespaces:\n    namespaces:\n      - name: Not_Valid\n",
            "loops.systemNamespaces.namespaces[0].name",
            "DNS-1123",
        ),
        // Management mode: one process-wide etcd would be every tenant's.
        (
            "tenants:\n  secretSelector: a=b\netcdServers: https://192.0.2.1:2379\n",
            "etcdServers",
            "is not used in management mode",
        ),
        // Every tenant's configuration starts from the file: `run` refuses one the tenants
        // cannot use, and so do `config validate` and `config print`.
        (
            "tenants:\n  secretSelector: a=b\nendpointReconcilerType: master-count\n",
            "endpointReconcilerType",
            "which it is not",
        ),
    ];
    for (yaml, field, reason) in cases {
        let path = write_config(&dir, yaml);
        // `run` must refuse before touching a cluster: the kubeconfig points nowhere.
        let (code, _, stderr) = run(binary().arg("--config").arg(&path).args([
            "--kubeconfig",
            "/nonexistent/kubeconfig",
            "run",
        ]));
        assert_eq!(code, 2, "{yaml}: {stderr}");
        assert!(
            stderr.contains(field),
            "{yaml}: expected {field:?} in {stderr}"
        );
        assert!(
            stderr.contains(reason),
            "{yaml}: expected {reason:?} in {stderr}"
        );

        for command in ["validate", "print"] {
            let (code, _, stderr) = run(binary().args(["config", command, "--config"]).arg(&path));
            assert_eq!(code, 2, "{command} {yaml}: {stderr}");
            assert!(stderr.contains(field), "{command} {yaml}: {stderr}");
        }
    }
}

/// `config validate` and `run` report every problem of a file in one go, each on the line of
/// the key the user wrote.
#[test]
fn every_problem_of_a_file_is_reported_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        &dir,
        "loops:\n  systemNamespaces:\n    intervall: 1m\ndryrun: true\nsecurePort: 0\n\
         leaderElection:\n  enabled: true\n    leaseName: x\n",
    );
    for command in [&["config", "validate"][..], &["run"][..]] {
        let (code, _, stderr) = run(binary()
            .arg("--config")
            .arg(&path)
            .args(["--kubeconfig", "/nonexistent/kubeconfig"])
            .args(command));
        assert_eq!(code, 2, "{command:?}: {stderr}");
        for said in [
            "4 problems",
            "loops.systemNamespaces.intervall: line 3: unknown field `intervall`: did you mean \
             `interval`?",
            "dryrun: line 4: unknown field `dryrun`: did you mean `dryRun`?",
            "leaderElection.leaseName: line 8: `leaseName` is indented deeper than `enabled`",
            "securePort: line 5: 0 is not a valid port",
        ] {
            assert!(stderr.contains(said), "{command:?}: {said:?} in {stderr}");
        }
    }
}

#[test]
fn invalid_flag_and_env_values_exit_2_naming_the_flag() {
    let (code, _, stderr) =
        run(binary().args(["--service-cluster-ip-range", "banana", "config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--service-cluster-ip-range"), "{stderr}");

    // A value from the environment is blamed on the variable the user set, not on a flag never
    // typed.
    let (code, _, stderr) = run(binary()
        .env("BOOTSTRAP_SERVICE_NODE_PORT_RANGE", "40000-30000")
        .args(["config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("BOOTSTRAP_SERVICE_NODE_PORT_RANGE: \"40000-30000\" is inverted"),
        "{stderr}"
    );
    assert!(!stderr.contains("--service-node-port-range"), "{stderr}");
    let (code, _, stderr) = run(binary()
        .env("BOOTSTRAP_DRY_RUN", "1")
        .args(["config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("BOOTSTRAP_DRY_RUN: \"1\" is not a boolean (expected true or false)"),
        "{stderr}"
    );
    assert!(!stderr.contains("--dry-run"), "{stderr}");
    // Values clap parses itself (a choice of names) too; a typed flag stays the flag.
    let (code, _, stderr) = run(binary()
        .env("BOOTSTRAP_LOG_FORMAT", "xml")
        .args(["config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(
            "invalid value 'xml' for BOOTSTRAP_LOG_FORMAT (the variable of --log-format)"
        ),
        "{stderr}"
    );
    let (code, _, stderr) = run(binary().env("BOOTSTRAP_LOG_FORMAT", "json").args([
        "--log-format",
        "xml",
        "config",
        "print",
    ]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("invalid value 'xml' for '--log-format <FORMAT>'"),
        "{stderr}"
    );
    let (code, _, stderr) = run(binary().args(["--dry-run=1", "config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--dry-run: \"1\" is not a boolean"),
        "{stderr}"
    );

    // A mistyped variable is an error naming the one meant, with the others.
    let (code, _, stderr) = run(binary()
        .env("BOOTSTRAP_ADVERTISE_ADRESS", "192.0.2.10")
        .env("BOOTSTRAP_SECURE_PORT", "0")
        .args(["config", "print"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains(
            "BOOTSTRAP_ADVERTISE_ADRESS: is no setting's variable: did you mean \
             BOOTSTRAP_ADVERTISE_ADDRESS?"
        ),
        "{stderr}"
    );
    assert!(
        stderr.contains("BOOTSTRAP_SECURE_PORT: 0 is not a valid port"),
        "{stderr}"
    );
    assert!(stderr.contains("2 problems"), "{stderr}");

    let (code, _, stderr) = run(binary().args([
        "--tenants-secret-selector",
        "a=b",
        "--etcd-servers",
        "https://192.0.2.1:2379",
        "config",
        "print",
    ]));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--etcd-servers: is not used in management mode"),
        "{stderr}"
    );
}

/// A deadline past any a check needs is refused naming the flag, before a clock is read, with
/// a cluster to check at hand.
#[tokio::test]
async fn check_refuses_a_timeout_longer_than_any_setting_needs() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let kubeconfig = sim.kubeconfig_path().to_owned();
    let (code, _, stderr) = tokio::task::spawn_blocking(move || {
        run(binary().arg("--kubeconfig").arg(&kubeconfig).args([
            "--service-cluster-ip-range",
            "10.96.0.0/12",
            "check",
            "--timeout",
            "2562047788015215h",
        ]))
    })
    .await?;
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--timeout: \"2562047788015215h\" is longer than 8760h"),
        "{stderr}"
    );
    sim.shutdown().await;
    Ok(())
}

#[test]
fn config_print_shows_the_effective_configuration() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write_config(
        &dir,
        "securePort: 7443\nserviceNodePortRange: 20000-20999\n",
    );
    let (code, stdout, stderr) =
        run(binary()
            .arg("--config")
            .arg(&path)
            .args(["--secure-port", "9443", "config", "print"]));
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("securePort: 9443"), "flag wins: {stdout}");
    assert!(
        stdout.contains("serviceNodePortRange: 20000-20999"),
        "file wins: {stdout}"
    );
    assert!(stdout.contains("systemNamespaces:"), "{stdout}");
    assert!(stdout.contains("kube-node-lease"), "{stdout}");

    // What `config print` prints is a valid configuration file.
    let printed = dir.path().join("printed.yaml");
    std::fs::write(&printed, &stdout).expect("write printed config");
    let (code, stdout, stderr) = run(binary()
        .args(["config", "validate", "--config"])
        .arg(&printed));
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("configuration is valid"), "{stdout}");

    // The file is given one way, with --config: a positional file is refused by the parser, and
    // no file at all is an error naming --config, not a silent check of the defaults.
    let (code, _, stderr) = run(binary().args(["config", "validate"]).arg(&printed));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("unexpected argument"), "{stderr}");
    let (code, _, stderr) = run(binary()
        .env_remove("BOOTSTRAP_CONFIG")
        .args(["config", "validate"]));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--config"), "{stderr}");
}

/// `--version` names the version, the commit and the build date (`build.rs`): the commit this
/// checkout is at when git can tell, else `unknown`.
#[test]
fn version_names_the_version_the_commit_and_the_build_date() {
    let (code, stdout, stderr) = run(binary().arg("--version"));
    assert_eq!(code, 0, "{stderr}");
    let rest = stdout
        .strip_prefix(&format!(
            "bootstrap-controller {} (commit ",
            env!("CARGO_PKG_VERSION")
        ))
        .unwrap_or_else(|| panic!("{stdout:?}"));
    let (commit, rest) = rest.split_once(", built ").expect("the build date");
    let date = rest.strip_suffix(")\n").expect("one line");
    assert!(
        commit == "unknown"
            || (commit.len() == 12 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "{commit:?}"
    );
    // RFC 3339 in UTC to the second: 2026-01-02T03:04:05Z.
    let shape = date.len() == 20
        && date.char_indices().all(|(at, c)| match at {
            4 | 7 => c == '-',
            10 => c == 'T',
            13 | 16 => c == ':',
            19 => c == 'Z',
            _ => c.is_ascii_digit(),
        });
    assert!(date == "unknown" || shape, "{date:?}");
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned());
    if let Some(head) = head {
        assert_eq!(commit, head, "built from this checkout");
        assert!(shape, "a commit has a date: {date:?}");
    }
}

#[test]
fn unusable_kubeconfig_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    std::fs::write(&path, "this: is: not a kubeconfig").expect("write");
    let (code, _, stderr) = run(binary().arg("--kubeconfig").arg(&path).arg("check"));
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--kubeconfig"), "{stderr}");
}

#[test]
fn kubeconfig_with_a_ca_that_is_no_certificate_exits_2_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    std::fs::write(
        &path,
        "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {server: \"https://127.0.0.1:1\", \
         certificate-authority-data: bm90IGEgY2VydA==}\nusers:\n- name: u\n  user: {token: x}\n\
         contexts:\n- name: x\n  context: {cluster: c, user: u}\ncurrent-context: x\n",
    )
    .expect("write");
    for command in ["check", "run"] {
        let (code, _, stderr) = run(binary().arg("--kubeconfig").arg(&path).arg(command));
        assert_eq!(code, 2, "{command}: {stderr}");
        assert!(
            stderr.contains("certificate-authority") && stderr.contains("PEM"),
            "{command}: {stderr}"
        );
    }
}

#[tokio::test]
async fn check_reports_drift_with_exit_1_and_unreachable_api_with_exit_2() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    // A copy: the simulator removes its own kubeconfig when it shuts down.
    let dir = tempfile::tempdir()?;
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::copy(sim.kubeconfig_path(), &kubeconfig)?;
    let (code, stdout, stderr) = tokio::task::spawn_blocking({
        let kubeconfig = kubeconfig.clone();
        // The simulator creates no ServiceCIDR `kubernetes` to read the range from (a 1.33
        // kube-apiserver would): its range is given, as on an older cluster.
        move || {
            run(binary().arg("--kubeconfig").arg(&kubeconfig).args([
                "--service-cluster-ip-range",
                "10.96.0.0/12",
                "check",
            ]))
        }
    })
    .await?;
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(
        stdout.contains("Namespace/kube-public [namespace_missing]"),
        "{stdout}"
    );

    // check is a dry run: nothing was created.
    let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(sim.client());
    assert!(namespaces.get_opt("kube-public").await?.is_none());

    sim.shutdown().await;
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run(binary()
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["check", "--timeout", "2s"]))
    })
    .await?;
    assert_eq!(code, 2, "{stdout}{stderr}");
    assert!(stderr.contains("cannot reach the API server"), "{stderr}");
    Ok(())
}

/// A refused connection names the server and the cause, through kube's own client stack (a
/// token) and this project's (a client certificate, see `client.rs`), not hyper's
/// `client error (Connect)`.
#[test]
fn a_refused_connection_names_the_server_and_the_cause() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let server = format!("https://127.0.0.1:{port}");
    let (cert, key) = {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec!["client".to_owned()])
            .expect("params")
            .self_signed(&key)
            .expect("certificate");
        (cert.pem(), key.serialize_pem())
    };
    let b64 = |text: &str| {
        use base64::Engine;
        base64::engine::general_purpose::STANDARD.encode(text)
    };
    let users = [
        "{token: x}".to_owned(),
        format!(
            "{{client-certificate-data: {}, client-key-data: {}}}",
            b64(&cert),
            b64(&key)
        ),
    ];
    for user in users {
        let path = dir.path().join("kubeconfig");
        std::fs::write(
            &path,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster: {{server: \"{server}\", \
                 certificate-authority-data: {}}}\nusers:\n- name: u\n  user: {user}\n\
                 contexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n",
                b64(&cert)
            ),
        )
        .expect("write");
        let (code, _, stderr) =
            run(binary()
                .arg("--kubeconfig")
                .arg(&path)
                .args(["check", "--timeout", "1s"]));
        assert_eq!(code, 2, "{user}: {stderr}");
        assert!(
            stderr.contains(&format!(
                "cannot connect to {server}: Connection refused (os error 111)"
            )),
            "{user}: {stderr}"
        );
        assert!(!stderr.contains("client error (Connect)"), "{stderr}");
    }
}

#[tokio::test]
async fn run_exits_1_naming_the_admin_address_when_it_is_taken() -> anyhow::Result<()> {
    let sim = Sim::start(SimConfig::default()).await?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?.to_string();
    let kubeconfig = sim.kubeconfig_path().to_owned();
    let (code, stdout, stderr) = tokio::task::spawn_blocking(move || {
        run(binary()
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .args(["run", "--admin-addr", &addr]))
    })
    .await?;
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert!(stderr.contains("--admin-addr"), "{stderr}");
    drop(taken);
    sim.shutdown().await;
    Ok(())
}

/// kube-apiserver's manifest as kubeadm v1.37.2 writes it, and the example it gives.
const KUBEADM_APISERVER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../testdata/kubeadm/kube-apiserver.yaml"
);
const SIDECAR_EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/sidecar/bootstrap-controller.yaml"
);

#[test]
fn sidecar_manifest_from_kubeadms_apiserver_is_the_documented_example() {
    let example = std::fs::read_to_string(SIDECAR_EXAMPLE).expect("read the example");
    let (code, stdout, stderr) = run(binary().args([
        "sidecar",
        "manifest",
        "--kube-apiserver-manifest",
        KUBEADM_APISERVER,
    ]));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, example);
    assert!(
        stderr.contains("service range 10.96.0.0/12, node ports 30000-32767 (kube-apiserver's default), secure port 6443, advertise address 192.0.2.1"),
        "{stderr}"
    );
    // kubeadm's default leaves kube-apiserver's reconciler on: stderr says how to turn it off.
    assert!(
        stderr.contains("warning: kube-apiserver runs with --endpoint-reconciler-type=lease"),
        "{stderr}"
    );
    assert!(
        stderr.contains(
            "    extraArgs:\n      - name: endpoint-reconciler-type\n        value: none"
        ),
        "{stderr}"
    );

    // On stdin (as from the image, which cannot read the root-only file), with another image
    // and the reconciler already off.
    let dir = tempfile::tempdir().expect("tempdir");
    let apiserver = std::fs::read_to_string(KUBEADM_APISERVER)
        .expect("read the fixture")
        .replace(
            "--service-cluster-ip-range=10.96.0.0/12",
            "--service-cluster-ip-range=198.19.0.0/16\n    - --endpoint-reconciler-type=none",
        );
    let input = dir.path().join("kube-apiserver.yaml");
    std::fs::write(&input, &apiserver).expect("write");
    let output = dir.path().join("bootstrap-controller.yaml");
    let (code, stdout, stderr) = run(binary()
        .args([
            "sidecar",
            "manifest",
            "--kube-apiserver-manifest",
            "-",
            "--image",
            "localhost/bc:test",
            "--image-pull-policy",
            "never",
            "-o",
        ])
        .arg(&output)
        .stdin(std::fs::File::open(&input).expect("open")));
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(stdout, "");
    assert!(
        stderr.contains("runs with --endpoint-reconciler-type=none") && !stderr.contains("warning"),
        "{stderr}"
    );
    let written = std::fs::read_to_string(&output).expect("the written manifest");
    let expected = example
        .replace("10.96.0.0/12", "198.19.0.0/16")
        .replace(
            "image: ghcr.io/bootstrap-controller/bootstrap-controller:0.1.0",
            "image: localhost/bc:test",
        )
        .replace("imagePullPolicy: IfNotPresent", "imagePullPolicy: Never");
    assert_eq!(written, expected);
}

#[test]
fn sidecar_manifest_refusals_exit_2_naming_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let apiserver = std::fs::read_to_string(KUBEADM_APISERVER).expect("read the fixture");
    let cases = [
        (
            apiserver.replace("10.96.0.0/12", "10.96.0.0/33"),
            "error: --service-cluster-ip-range: kube-apiserver's value \"10.96.0.0/33\"",
        ),
        (
            apiserver.replace("    name: kube-apiserver\n", "    name: apiserver\n"),
            "error: spec.containers: no container named \"kube-apiserver\"",
        ),
        (
            "#".repeat(1024 * 1024 + 1),
            "error: --kube-apiserver-manifest: ",
        ),
    ];
    for (text, message) in cases {
        let input = dir.path().join("kube-apiserver.yaml");
        std::fs::write(&input, &text).expect("write");
        let output = dir.path().join("out.yaml");
        let (code, stdout, stderr) = run(binary()
            .args(["sidecar", "manifest", "--kube-apiserver-manifest"])
            .arg(&input)
            .arg("-o")
            .arg(&output));
        assert_eq!(code, 2, "{stderr}");
        assert_eq!(stdout, "");
        assert!(stderr.starts_with(message), "{stderr}");
        // Nothing is written on a refusal.
        assert!(!output.exists());
    }
    // The controller's own settings would be silently ignored here: refused instead.
    let (code, stdout, stderr) = run(binary().args([
        "sidecar",
        "manifest",
        "--kube-apiserver-manifest",
        KUBEADM_APISERVER,
        "--service-cluster-ip-range=192.0.2.0/24",
    ]));
    assert_eq!(code, 2, "{stderr}");
    assert_eq!(stdout, "");
    assert!(
        stderr.contains("--service-cluster-ip-range: is a setting of the controller, which `sidecar manifest` does not read"),
        "{stderr}"
    );
    let (code, _, stderr) = run(binary()
        .args([
            "sidecar",
            "manifest",
            "--kube-apiserver-manifest",
            KUBEADM_APISERVER,
        ])
        .env("BOOTSTRAP_SECURE_PORT", "8443"));
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("--secure-port: is a setting of the controller"),
        "{stderr}"
    );
}

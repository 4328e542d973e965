use super::*;

/// kube-apiserver's manifest as kubeadm v1.37.2 writes it (testdata/kubeadm/README header).
const KUBEADM: &str = include_str!("../../../testdata/kubeadm/kube-apiserver.yaml");

fn generate_from(text: &str, etcd: bool) -> Result<String, ConfigError> {
    let flags = parse_manifest(text, "kube-apiserver")?;
    generate(
        &values(&flags, etcd)?,
        DEFAULT_IMAGE,
        PullPolicy::IfNotPresent,
    )
}

/// kubeadm's manifest with its `- --NAME=...` line replaced by `lines` (none: removed).
fn kubeadm_with(name: &str, lines: &[&str]) -> String {
    let prefix = format!("    - --{name}=");
    let mut out = String::new();
    let mut found = false;
    for line in KUBEADM.lines() {
        if line.starts_with(&prefix) {
            found = true;
            for new in lines {
                out.push_str(&format!("    - {new}\n"));
            }
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(found, "kubeadm's manifest has no --{name}");
    out
}

fn env_value(manifest: &str, name: &str) -> Option<String> {
    let pod: serde_json::Value = serde_saphyr::from_str(manifest).unwrap();
    pod["spec"]["containers"][0]["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|env| env["name"] == name)
        .map(|env| env["value"].as_str().unwrap().to_owned())
}

fn error(text: &str, etcd: bool) -> ConfigError {
    generate_from(text, etcd).unwrap_err()
}

#[test]
fn kubeadms_defaults_give_the_documented_examples_exactly() {
    assert_eq!(generate_from(KUBEADM, false).unwrap(), TEMPLATE);
    assert_eq!(generate_from(KUBEADM, true).unwrap(), TEMPLATE_ETCD);
    let flags = parse_manifest(KUBEADM, "kube-apiserver").unwrap();
    assert_eq!(flags.get("service-cluster-ip-range"), Some("10.96.0.0/12"));
    assert_eq!(flags.get("secure-port"), Some("6443"));
    assert_eq!(flags.get("advertise-address"), Some("192.0.2.1"));
    assert_eq!(flags.get("service-node-port-range"), None);
    assert_eq!(flags.endpoint_reconciler_type(), "lease");
}

#[test]
fn every_value_comes_from_kube_apiservers_flags() {
    let text = kubeadm_with(
        "service-cluster-ip-range",
        &["--service-cluster-ip-range=192.0.2.0/24,2001:db8::/112"],
    )
    .replace("--secure-port=6443", "--secure-port=8443")
    .replace(
        "--advertise-address=192.0.2.1",
        "--advertise-address=2001:db8::1",
    )
    .replace(
        "    - --allow-privileged=true\n",
        "    - --allow-privileged=true\n    - --service-node-port-range=31000-31999\n",
    );
    let manifest = generate_from(&text, false).unwrap();
    let expect = [
        (
            "BOOTSTRAP_SERVICE_CLUSTER_IP_RANGE",
            "192.0.2.0/24,2001:db8::/112",
        ),
        ("BOOTSTRAP_SERVICE_NODE_PORT_RANGE", "31000-31999"),
        ("BOOTSTRAP_SECURE_PORT", "8443"),
        ("BOOTSTRAP_ADVERTISE_ADDRESS", "2001:db8::1"),
        ("BOOTSTRAP_ENDPOINT_RECONCILER_TYPE", "lease"),
    ];
    for (name, value) in expect {
        assert_eq!(env_value(&manifest, name).as_deref(), Some(value), "{name}");
    }
    // Only those lines changed.
    let changed = manifest
        .lines()
        .zip(TEMPLATE.lines())
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(changed, 4, "{manifest}");
    assert_eq!(manifest.lines().count(), TEMPLATE.lines().count());
}

#[test]
fn flags_in_args_and_as_separate_words_count_too() {
    let text = "kind: Pod\nspec:\n  containers:\n    - name: sidecar\n    - name: kube-apiserver\n      \
                command: [/usr/local/bin/kube-apiserver, --secure-port, \"7443\"]\n      \
                args: [--v=2, --service-cluster-ip-range, 192.0.2.0/24, \
                --service-cluster-ip-range=192.0.2.0/24, --service-node-port-range=30000+99]\n";
    let flags = parse_manifest(text, "kube-apiserver").unwrap();
    let values = values(&flags, false).unwrap();
    assert_eq!(values.secure_port, 7443);
    assert_eq!(values.service_cluster_ip_range, "192.0.2.0/24");
    assert_eq!(values.service_node_port_range, "30000-30099");
    assert_eq!(values.advertise_address, "$(HOST_IP)");
    let manifest = generate(&values, DEFAULT_IMAGE, PullPolicy::IfNotPresent).unwrap();
    assert_eq!(
        env_value(&manifest, "BOOTSTRAP_ADVERTISE_ADDRESS").as_deref(),
        Some("$(HOST_IP)")
    );
}

#[test]
fn node_port_ranges_in_kube_apiservers_forms() {
    assert_eq!(node_port_range("30000-32767").unwrap(), "30000-32767");
    assert_eq!(node_port_range("30000+2767").unwrap(), "30000-32767");
    assert_eq!(node_port_range("30100").unwrap(), "30100-30100");
    for bad in ["32767-30000", "30000+40000", "a-b", "30000+x", "", "0-10"] {
        let err = node_port_range(bad).unwrap_err();
        assert_eq!(err.field, "--service-node-port-range", "{bad}");
        assert!(
            err.message.contains("fix it in kube-apiserver's manifest"),
            "{err}"
        );
    }
}

#[test]
fn refusals_name_the_field_and_the_fix() {
    let cases: Vec<(String, &str, &str)> = vec![
        (
            kubeadm_with("service-cluster-ip-range", &[]),
            "--service-cluster-ip-range",
            "does not set it",
        ),
        (
            kubeadm_with(
                "service-cluster-ip-range",
                &["--service-cluster-ip-range=10.96.0.1/33"],
            ),
            "--service-cluster-ip-range",
            "not a valid CIDR",
        ),
        (
            kubeadm_with(
                "service-cluster-ip-range",
                &["--service-cluster-ip-range=10.96.0.1/12"],
            ),
            "--service-cluster-ip-range",
            "host bits",
        ),
        (
            kubeadm_with(
                "service-cluster-ip-range",
                &[
                    "--service-cluster-ip-range=10.96.0.0/12",
                    "--service-cluster-ip-range=10.97.0.0/16",
                ],
            ),
            "--service-cluster-ip-range",
            "gives it twice, \"10.96.0.0/12\" and \"10.97.0.0/16\"",
        ),
        (
            kubeadm_with("secure-port", &["--secure-port=0"]),
            "--secure-port",
            "not a port of 1-65535",
        ),
        (
            kubeadm_with("secure-port", &["--secure-port=https"]),
            "--secure-port",
            "not a port",
        ),
        (
            kubeadm_with("advertise-address", &["--advertise-address=node-1"]),
            "--advertise-address",
            "not an IP address",
        ),
        (
            kubeadm_with("advertise-address", &["--endpoint-reconciler-type=off"]),
            "--endpoint-reconciler-type",
            "none of lease, master-count, none",
        ),
        (
            kubeadm_with("tls-private-key-file", &["--secure-port"]),
            "--secure-port",
            "last argument, with no value",
        ),
        (
            KUBEADM.replace("    name: kube-apiserver\n", "    name: apiserver\n"),
            "spec.containers",
            "no container named \"kube-apiserver\" (found: apiserver)",
        ),
        (
            KUBEADM.replace("kind: Pod", "kind: Deployment"),
            "kind",
            "is \"Deployment\", not Pod",
        ),
        (
            KUBEADM.replace("    - kube-apiserver\n", "    - {a: b}\n"),
            "spec.containers[0].command[0]",
            "expected kube-apiserver's static pod manifest",
        ),
        (
            "kind: Pod\nspec: {containers: [{name: kube-apiserver}, {name: kube-apiserver}]}\n"
                .to_owned(),
            "spec.containers",
            "two containers",
        ),
        (
            "[1, 2".to_owned(),
            "(manifest)",
            "expected kube-apiserver's",
        ),
        ("".to_owned(), "spec.containers", "(found: none)"),
    ];
    for (text, field, message) in cases {
        let err = error(&text, false);
        assert_eq!(err.field, field, "{err}");
        assert!(err.message.contains(message), "{err}");
    }
}

#[test]
fn etcd_mode_takes_kube_apiservers_etcd_client_settings() {
    let text = KUBEADM
        .replace(
            "--etcd-servers=https://127.0.0.1:2379",
            "--etcd-servers=https://192.0.2.5:2379,https://192.0.2.6:2379",
        )
        .replace(
            "--etcd-cafile=/etc/kubernetes/pki/etcd/ca.crt",
            "--etcd-cafile=/etc/etcd/ca.pem",
        )
        .replace(
            "--etcd-keyfile=/etc/kubernetes/pki/apiserver-etcd-client.key",
            "--etcd-keyfile=/etc/etcd/client-key.pem\n    - --etcd-prefix=/tenant-a",
        );
    let manifest = generate_from(&text, true).unwrap();
    assert_eq!(
        env_value(&manifest, "BOOTSTRAP_ETCD_SERVERS").as_deref(),
        Some("https://192.0.2.5:2379,https://192.0.2.6:2379")
    );
    assert_eq!(
        env_value(&manifest, "BOOTSTRAP_ETCD_CAFILE").as_deref(),
        Some("/etc/etcd/ca.pem")
    );
    assert_eq!(
        env_value(&manifest, "BOOTSTRAP_ETCD_KEYFILE").as_deref(),
        Some("/etc/etcd/client-key.pem")
    );
    assert_eq!(
        env_value(&manifest, "BOOTSTRAP_ETCD_PREFIX").as_deref(),
        Some("/tenant-a")
    );
    // The files are mounted where kube-apiserver reads them, from the same host paths.
    let pod: serde_json::Value = serde_saphyr::from_str(&manifest).unwrap();
    let mounts = pod["spec"]["containers"][0]["volumeMounts"].to_string();
    let volumes = pod["spec"]["volumes"].to_string();
    for path in ["/etc/etcd/ca.pem", "/etc/etcd/client-key.pem"] {
        assert!(mounts.contains(path) && volumes.contains(path), "{path}");
    }
    assert!(!manifest.contains(TEMPLATE_ETCD_CAFILE));
    assert!(!manifest.contains(TEMPLATE_ETCD_KEYFILE));
    assert!(manifest.contains(TEMPLATE_ETCD_CERTFILE));

    let without = kubeadm_with("etcd-certfile", &[]);
    let err = error(&without, true);
    assert_eq!(err.field, "--etcd-certfile");
    assert!(err.message.contains("leave --etcd out"), "{err}");
    // Without --etcd, the etcd flags are not needed.
    assert!(generate_from(&without, false).is_ok());
    let err = error(
        &kubeadm_with("etcd-cafile", &["--etcd-cafile=etc/ca.crt"]),
        true,
    );
    assert_eq!(err.field, "--etcd-cafile");
    let err = error(
        &kubeadm_with("etcd-servers", &["--etcd-servers=unix:///run/etcd"]),
        true,
    );
    assert_eq!(err.field, "--etcd-servers");
    assert!(err.message.contains("not an etcd URL"), "{err}");
}

#[test]
fn the_image_is_checked_and_set_with_its_pull_policy() {
    let flags = parse_manifest(KUBEADM, "kube-apiserver").unwrap();
    let values = values(&flags, false).unwrap();
    let manifest = generate(&values, "localhost/bc:test", PullPolicy::Never).unwrap();
    assert!(manifest.contains("      image: localhost/bc:test\n"));
    assert!(manifest.contains("      imagePullPolicy: Never\n"));
    for bad in ["", "bc:1\"\n  x", "a b"] {
        let err = generate(&values, bad, PullPolicy::Always).unwrap_err();
        assert_eq!(err.field, "--image");
    }
}

#[test]
fn the_reconciler_advice_names_kubeadms_extra_args() {
    let path = Path::new(KUBEADM_MANIFEST);
    let flags = parse_manifest(KUBEADM, "kube-apiserver").unwrap();
    let advice = reconciler_advice(&flags, path);
    assert!(
        advice.starts_with(
            "warning: kube-apiserver runs with --endpoint-reconciler-type=lease (its default)"
        ),
        "{advice}"
    );
    assert!(
        advice.contains(
            "  apiServer:\n    extraArgs:\n      - name: endpoint-reconciler-type\n        value: none\n"
        ),
        "{advice}"
    );
    assert!(advice.contains("v1beta3"), "{advice}");
    assert!(
        advice.contains("add the line `- --endpoint-reconciler-type=none`"),
        "{advice}"
    );
    let master_count = KUBEADM.replace(
        "    - --allow-privileged=true\n",
        "    - --allow-privileged=true\n    - --endpoint-reconciler-type=master-count\n",
    );
    let flags = parse_manifest(&master_count, "kube-apiserver").unwrap();
    let advice = reconciler_advice(&flags, path);
    assert!(
        advice.contains(
            "change `--endpoint-reconciler-type=master-count` to `--endpoint-reconciler-type=none`"
        ),
        "{advice}"
    );
    let none = master_count.replace("=master-count", "=none");
    let flags = parse_manifest(&none, "kube-apiserver").unwrap();
    let advice = reconciler_advice(&flags, path);
    assert!(!advice.contains("warning"), "{advice}");
    assert!(
        advice.contains("runs with --endpoint-reconciler-type=none"),
        "{advice}"
    );
}

#[test]
fn a_manifest_over_a_mebibyte_is_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let big = dir.path().join("big.yaml");
    let mut text = KUBEADM.to_owned();
    text.push_str(&"#".repeat(usize::try_from(MAX_MANIFEST_BYTES).unwrap()));
    std::fs::write(&big, &text).unwrap();
    let err = read_manifest(&big).unwrap_err();
    assert_eq!(err.field, "--kube-apiserver-manifest");
    assert!(err.message.contains("larger than 1 MiB"), "{err}");
    let err = read_manifest(&dir.path().join("missing.yaml")).unwrap_err();
    assert!(err.message.contains("cannot read"), "{err}");
    let binary = dir.path().join("binary");
    std::fs::write(&binary, [0xff, 0xfe, 0x00]).unwrap();
    assert!(
        read_manifest(&binary)
            .unwrap_err()
            .message
            .contains("not UTF-8")
    );
}

#[test]
fn output_replaces_the_file_through_a_hidden_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bootstrap-controller.yaml");
    std::fs::write(&path, "old").unwrap();
    write_atomically(&path, "new\n").unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), "new\n");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name())
        .collect();
    assert_eq!(names, ["bootstrap-controller.yaml"]);
    let err = write_atomically(&dir.path().join("no/such/dir.yaml"), "x").unwrap_err();
    assert_eq!(err.field, "--output");
}

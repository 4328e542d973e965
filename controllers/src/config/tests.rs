#![allow(clippy::unwrap_used)]

use super::*;
use std::net::{IpAddr, SocketAddr};

fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
    Config::load_text(&ConfigArgs::default(), text, None)
}

fn single_error(result: Result<Config, ConfigErrors>) -> ConfigError {
    let errors = result.expect_err("configuration should be rejected").0;
    assert_eq!(
        errors.len(),
        1,
        "expected exactly one error, got {errors:?}"
    );
    errors.into_iter().next().unwrap()
}

/// The one error `yaml` is rejected with, checked to name `field` and to say each of `says`.
fn rejected(yaml: &str, field: &str, says: &[&str]) -> ConfigError {
    let error = single_error(from_yaml(yaml));
    assert_eq!(error.field, field, "{error}");
    for words in says {
        assert!(error.message.contains(words), "{error}");
    }
    error
}

#[test]
fn kubernetes_service_and_endpoints_sections() {
    let config = from_yaml(
        "advertiseAddress: 192.0.2.1\nloops:\n  kubernetesService:\n    port: 8443\n    repair: off\n    recreateOnClusterIPMismatch: true\n  apiserverEndpoints:\n    leaseTTL: 30s\n    readyzURL: https://127.0.0.1:6443/readyz\n",
    )
    .unwrap();
    assert_eq!(config.loops.kubernetes_service.port, 8443);
    assert_eq!(
        config.loops.kubernetes_service.repair,
        reconcilers::kubernetes_service::RepairPolicy::Off
    );
    assert!(
        config
            .loops
            .kubernetes_service
            .recreate_on_cluster_ip_mismatch
    );
    assert_eq!(
        config.loops.apiserver_endpoints.lease_ttl,
        Duration::from_secs(30)
    );

    rejected(
        "advertiseAddress: 192.0.2.1\nendpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    leaseTTL: 10s\n",
        "loops.apiserverEndpoints.leaseTTL",
        &[],
    );

    rejected(
        "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    staticAddresses: [192.0.2.1, \"https://lb:6443\"]\n",
        "loops.apiserverEndpoints.staticAddresses[1]",
        &[],
    );

    rejected(
        "endpointReconcilerType: static\n",
        "loops.apiserverEndpoints.staticAddresses",
        &[],
    );

    // A valid static list is accepted and reaches the loop's configuration.
    let config = from_yaml(
        "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    staticAddresses: [192.0.2.1, lb.example.com]\n",
    )
    .expect("a valid static configuration");
    assert_eq!(
        config.loops.apiserver_endpoints.static_addresses,
        ["192.0.2.1", "lb.example.com"]
    );

    rejected(
        "advertiseAddress: 192.0.2.1\nendpointReconcilerType: lease\nloops:\n  apiserverEndpoints:\n    readyzURL: localhost:6443\n",
        "loops.apiserverEndpoints.readyzURL",
        &[],
    );

    rejected(
        "loops:\n  kubernetesService:\n    name: Kubernetes\n",
        "loops.kubernetesService.name",
        &[],
    );

    rejected("advertiseAddress: 127.0.0.1\n", "advertiseAddress", &[]);
}

#[test]
fn defaults_match_upstream() {
    let config = Config::merge(&ConfigArgs::default(), FileConfig::default()).unwrap();
    assert_eq!(
        config.settings.node_port_range,
        reconcilers::alloc::PortRange::default()
    );
    assert_eq!(config.settings.secure_port, None);
    assert_eq!(
        config.loops.apiserver_endpoints.mode, None,
        "no mode is assumed: the endpoints are left alone until one is named"
    );
    assert_eq!(
        config.loops.apiserver_endpoints.endpoint_mode(),
        EndpointsMode::None
    );
    assert_eq!(config.admin_addr, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(
        config.loops.system_namespaces.interval,
        Duration::from_secs(60)
    );
    assert_eq!(
        config.loops.kubernetes_service.interval,
        Duration::from_secs(10)
    );
    assert_eq!(
        config.loops.apiserver_endpoints.interval,
        Duration::from_secs(10)
    );
    assert_eq!(config.loops.service_cidr.interval, Duration::from_secs(10));
    assert_eq!(
        config.loops.cluster_ip_repair.interval,
        Duration::from_secs(180)
    );
    let names: Vec<_> = config
        .loops
        .system_namespaces
        .namespaces
        .iter()
        .map(|ns| ns.name.as_str())
        .collect();
    assert_eq!(
        names,
        ["kube-system", "kube-public", "kube-node-lease", "default"]
    );
    assert!(config.leader_election.enabled);
    assert!(!config.dry_run);
    assert_eq!(
        config.settings.service_ranges,
        [],
        "no range is assumed: it is read from the cluster"
    );
    // The loops' own defaults agree: only what belongs to a replica differs.
    assert_eq!(
        config.settings,
        reconcilers::section::Settings {
            identity: config.settings.identity.clone(),
            ..Default::default()
        }
    );
    let printed = config.to_yaml().unwrap();
    assert!(!printed.contains("serviceClusterIPRange"), "{printed}");
    let set = from_yaml("serviceClusterIPRange: 10.96.0.0/12\n").unwrap();
    assert_eq!(
        set.settings.service_ranges,
        ["10.96.0.0/12".parse().unwrap()]
    );
}

#[test]
fn bad_cidr_names_field_and_fix() {
    let error = rejected(
        "serviceClusterIPRange: 10.0.0.0/33\n",
        "serviceClusterIPRange",
        &[],
    );
    assert_eq!(
        error.to_string(),
        "serviceClusterIPRange: line 1: \"10.0.0.0/33\" is not a valid CIDR (expected e.g. \
         10.96.0.0/12 or fd00:10:96::/108)"
    );
}

#[test]
fn bad_cidr_from_flag_names_flag() {
    let args = ConfigArgs {
        service_cluster_ip_range: Some("banana".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--service-cluster-ip-range");
    assert!(error.message.contains("not a valid CIDR"), "{error}");
}

#[test]
fn two_cidrs_of_one_family_rejected() {
    rejected(
        "serviceClusterIPRange: 10.96.0.0/12,10.200.0.0/16\n",
        "serviceClusterIPRange",
        &["two IPv4 ranges"],
    );
    rejected(
        "serviceClusterIPRange: [fd00::/108, fd01::/108]\n",
        "serviceClusterIPRange",
        &["two IPv6 ranges"],
    );
}

#[test]
fn dual_stack_and_small_ranges() {
    let config = from_yaml("serviceClusterIPRange: [10.96.0.0/12, fd00:10:96::/108]\n").unwrap();
    assert_eq!(config.settings.service_ranges.len(), 2);
    rejected(
        "serviceClusterIPRange: 10.0.0.0/30\n",
        "serviceClusterIPRange",
        &["fewer than 8"],
    );
    assert!(parse_service_cidrs("10.0.0.0/29").is_ok());
    assert!(
        parse_service_cidrs("10.0.0.1/24")
            .unwrap_err()
            .to_string()
            .contains("host bits")
    );
    assert!(parse_service_cidrs("10.0.0.0/24,fd00::/64,10.1.0.0/24").is_err());
}

#[test]
fn inverted_port_range_rejected() {
    rejected(
        "serviceNodePortRange: 32767-30000\n",
        "serviceNodePortRange",
        &["inverted", "e.g. 30000-32767"],
    );
    let args = ConfigArgs {
        service_node_port_range: Some("40000-30000".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--service-node-port-range");
}

#[test]
fn zero_interval_rejected() {
    rejected(
        "loops:\n  systemNamespaces:\n    interval: 0s\n",
        "loops.systemNamespaces.interval",
        &["greater than zero"],
    );
    rejected(
        "loops:\n  clusterIPRepair:\n    interval: 0ms\n",
        "loops.clusterIPRepair.interval",
        &[],
    );
}

#[test]
fn cluster_ip_repair_mode_and_grace_period() {
    let config =
        from_yaml("loops:\n  clusterIPRepair:\n    mode: audit\n    orphanGracePeriod: 2m\n")
            .expect("valid");
    assert_eq!(
        config.loops.cluster_ip_repair.mode,
        reconcilers::clusterip_repair::RepairMode::Audit
    );
    assert_eq!(
        config.loops.cluster_ip_repair.orphan_grace_period,
        Duration::from_secs(120)
    );
    assert_eq!(
        reconcilers::clusterip_repair::Section::default().mode,
        reconcilers::clusterip_repair::RepairMode::Auto
    );
    rejected(
        "loops:\n  clusterIPRepair:\n    orphanGracePeriod: 1s\n",
        "loops.clusterIPRepair.orphanGracePeriod",
        &["60s"],
    );
    let error = single_error(from_yaml(
        "loops:\n  clusterIPRepair:\n    mode: sometimes\n",
    ));
    assert!(error.field.starts_with("loops.clusterIPRepair"), "{error}");
}

#[test]
fn node_port_repair_page_size() {
    let config = from_yaml("loops:\n  nodePortRepair:\n    pageSize: 50\n").expect("valid");
    assert_eq!(config.loops.node_port_repair.page_size, 50);
    assert_eq!(
        config.loops.cluster_ip_repair.page_size, 500,
        "each repair has its own page size"
    );
    rejected(
        "loops:\n  nodePortRepair:\n    pageSize: 0\n",
        "loops.nodePortRepair.pageSize",
        &[],
    );
}

#[test]
fn cluster_ip_repair_page_size() {
    assert_eq!(
        reconcilers::clusterip_repair::Section::default().page_size,
        500
    );
    let config = from_yaml("loops:\n  clusterIPRepair:\n    pageSize: 500\n").expect("valid");
    assert_eq!(config.loops.cluster_ip_repair.page_size, 500);
    rejected(
        "loops:\n  clusterIPRepair:\n    pageSize: 0\n",
        "loops.clusterIPRepair.pageSize",
        &["at least 1"],
    );
    let error = single_error(from_yaml("loops:\n  clusterIPRepair:\n    pageSize: -1\n"));
    assert!(error.field.starts_with("loops.clusterIPRepair"), "{error}");
}

#[test]
fn unparsable_interval_names_path() {
    rejected(
        "loops:\n  systemNamespaces:\n    interval: soon\n",
        "loops.systemNamespaces.interval",
        &["e.g. 10s"],
    );
}

#[test]
fn unknown_field_names_its_path() {
    // A near miss names the field meant; without one, every field is listed.
    rejected(
        "loops:\n  systemNamespaces:\n    intervall: 1m\n",
        "loops.systemNamespaces.intervall",
        &[
            "line 3: ",
            "unknown field `intervall`",
            "did you mean `interval`?",
        ],
    );
    rejected(
        "loops:\n  systemNamespaces:\n    cadence: 1m\n",
        "loops.systemNamespaces.cadence",
        &["unknown field `cadence`", "expected one of"],
    );
    let error = single_error(from_yaml("servicClusterIPRange: 10.0.0.0/24\n"));
    assert!(
        error
            .message
            .contains("unknown field `servicClusterIPRange`"),
        "{error}"
    );
    rejected(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labls: {}\n",
        "loops.systemNamespaces.namespaces[0].labls",
        &[],
    );
}

#[test]
fn invalid_namespace_name_rejected() {
    rejected(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: kube-system\n      - name: Kube_Public\n",
        "loops.systemNamespaces.namespaces[1].name",
        &["DNS-1123"],
    );
    rejected(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n      - name: a\n",
        "loops.systemNamespaces.namespaces[1].name",
        &["listed twice"],
    );
}

#[test]
fn invalid_labels_rejected() {
    rejected(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labels:\n          \"bad key!\": x\n",
        "loops.systemNamespaces.namespaces[0].labels",
        &[],
    );
    let ok = from_yaml(
        "loops:\n  systemNamespaces:\n    namespaces:\n      - name: a\n        labels:\n          example.com/team: core\n        annotations:\n          example.com/owner: \"Jane Doe <jane@example.com>\"\n",
    )
    .unwrap();
    assert_eq!(
        ok.loops.system_namespaces.namespaces[0].labels["example.com/team"],
        "core"
    );
}

#[test]
fn etcd_settings_are_validated_and_name_the_field() {
    assert!(from_yaml("{}").unwrap().settings.etcd().is_none());

    let config = from_yaml("etcdServers: https://192.0.2.1:2379,http://192.0.2.2:2379\n").unwrap();
    let etcd = config.settings.etcd().unwrap();
    assert_eq!(etcd.servers.len(), 2);
    assert_eq!(etcd.prefix, "/registry");

    let args = ConfigArgs {
        etcd_servers: Some("192.0.2.1:2379".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--etcd-servers");
    // The message names an example URL.
    assert!(error.message.contains("https://192.0.2.1:2379"), "{error}");

    rejected(
        "etcdCAFile: /etc/kubernetes/pki/etcd/ca.crt\n",
        "etcdCAFile",
        &["--etcd-servers"],
    );

    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("client.crt");
    std::fs::write(&cert, "pem").unwrap();
    let args = ConfigArgs {
        etcd_servers: Some("https://127.0.0.1:2379".to_owned()),
        etcd_certfile: Some(cert.clone()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--etcd-certfile");
    assert!(error.message.contains("--etcd-keyfile"), "{error}");

    let args = ConfigArgs {
        etcd_servers: Some("https://127.0.0.1:2379".to_owned()),
        etcd_certfile: Some(cert.clone()),
        etcd_keyfile: Some(dir.path().join("missing.key")),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--etcd-keyfile");
    assert!(error.message.contains("missing.key"), "{error}");

    rejected(
        "etcdServers: [\"http://127.0.0.1:2379\"]\netcdPrefix: registry\n",
        "etcdPrefix",
        &[],
    );
}

#[test]
fn node_port_must_be_in_range() {
    rejected(
        "kubernetesServiceNodePort: 80\n",
        "kubernetesServiceNodePort",
        &["30000-32767"],
    );
    let config = from_yaml("kubernetesServiceNodePort: 30443\n").unwrap();
    assert_eq!(config.settings.kubernetes_service_node_port, Some(30443));
    // 0 asks for a ClusterIP Service; left out, the Service's own type is kept.
    let config = from_yaml("kubernetesServiceNodePort: 0\n").unwrap();
    assert_eq!(config.settings.kubernetes_service_node_port, Some(0));
    let config = from_yaml("dryRun: false\n").unwrap();
    assert_eq!(config.settings.kubernetes_service_node_port, None);
}

/// A numeric flag's text that is no number is quoted as given, with the flag and the fix.
#[test]
fn a_numeric_flag_that_is_no_number_is_quoted_plainly() {
    let cases = [
        (
            ConfigArgs {
                secure_port: Some("z".to_owned()),
                ..ConfigArgs::default()
            },
            "--secure-port: \"z\" is not a port number (expected 1-65535, e.g. 6443)",
        ),
        (
            ConfigArgs {
                kubernetes_service_node_port: Some("z".to_owned()),
                ..ConfigArgs::default()
            },
            "--kubernetes-service-node-port: \"z\" is not a port number (use 0 for a ClusterIP \
             Service, or a port inside 30000-32767)",
        ),
        (
            ConfigArgs {
                apiserver_count: Some("z".to_owned()),
                ..ConfigArgs::default()
            },
            "--apiserver-count: \"z\" is not a number (expected a positive count, e.g. 3)",
        ),
    ];
    for (args, message) in cases {
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.to_string(), message);
    }
}

#[test]
fn apiserver_count_and_advertise_address() {
    rejected("apiserverCount: 0\n", "apiserverCount", &[]);
    rejected(
        "serviceClusterIPRange: 10.96.0.0/12\nadvertiseAddress: fd00::1\nendpointReconcilerType: lease\n",
        "advertiseAddress",
        &["IPv6"],
    );
    for mode in [
        "none\n",
        "none\nserviceClusterIPRange: 10.96.0.0/12\n",
        "master-count\n",
    ] {
        let config = from_yaml(&format!(
            "advertiseAddress: fd00::1\nendpointReconcilerType: {mode}"
        ))
        .unwrap();
        assert_eq!(
            config.settings.advertise_address,
            Some("fd00::1".parse().unwrap())
        );
    }
    // Named by no one, no endpoints are written, so the address's family does not matter.
    let unnamed = from_yaml("serviceClusterIPRange: 10.96.0.0/12\nadvertiseAddress: fd00::1\n");
    assert_eq!(unnamed.unwrap().loops.apiserver_endpoints.mode, None);
    rejected(
        "advertiseAddress: not-an-ip\n",
        "advertiseAddress",
        &["not an IP"],
    );
}

#[test]
fn all_errors_reported_at_once() {
    let errors = from_yaml(
        "serviceClusterIPRange: x\nserviceNodePortRange: 2-1\nloops:\n  systemNamespaces:\n    interval: 0s\n",
    )
    .unwrap_err();
    assert_eq!(errors.0.len(), 3, "{errors}");
    assert!(errors.to_string().contains("3 problems"));
}

#[test]
fn tenants_settings_from_flags_and_file_are_validated() {
    let config =
        from_yaml("tenants:\n  secretSelector: cluster.x-k8s.io/cluster-name\n  namespace: capi\n")
            .unwrap();
    assert_eq!(
        config.tenants,
        Some(Tenants {
            secret_selector: "cluster.x-k8s.io/cluster-name".to_owned(),
            namespace: Some("capi".to_owned()),
            kubeconfig_key: "value".to_owned(),
            credential_plugins: Vec::new(),
            cache_max_objects: super::DEFAULT_TENANTS_CACHE_MAX_OBJECTS,
            cache_max_mib: super::DEFAULT_TENANTS_CACHE_MAX_MIB,
            cache_total_mib: super::DEFAULT_TENANTS_CACHE_TOTAL_MIB,
            secrets_total_mib: super::DEFAULT_TENANTS_SECRETS_TOTAL_MIB,
            cache_budgets: Default::default(),
            etcd_allowed_cidrs: Vec::new(),
        })
    );
    assert_eq!(from_yaml("{}\n").unwrap().tenants, None);
    for selector in [
        "a=b,c!=d",
        "!legacy",
        "tier in (a, b),env notin (dev)",
        "example.com/x==y",
    ] {
        let args = ConfigArgs {
            tenants_secret_selector: Some(selector.to_owned()),
            ..ConfigArgs::default()
        };
        assert!(
            Config::merge(&args, FileConfig::default()).is_ok(),
            "{selector}"
        );
    }
    for (selector, field) in [
        ("a=b,,c", "--tenants-secret-selector"),
        ("tier in a,b", "--tenants-secret-selector"),
        ("-bad-=x", "--tenants-secret-selector"),
        ("  ", "--tenants-secret-selector"),
    ] {
        let args = ConfigArgs {
            tenants_secret_selector: Some(selector.to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, field, "{selector}: {error}");
    }
    let args = ConfigArgs {
        tenants_namespace: Some("capi".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--tenants-namespace");
    assert!(
        error.message.contains("--tenants-secret-selector"),
        "{error}"
    );
    rejected(
        "tenants:\n  secretSelector: a=b\n  kubeconfigKey: \"admin conf\"\n",
        "tenants.kubeconfigKey",
        &[],
    );
}

/// The base of the tenants of a process started with `file` and a selector flag, as `run`
/// builds it: from the process's own management mode.
fn tenant_base(file: &str) -> TenantBase {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    std::fs::write(&path, file).unwrap();
    let args = ConfigArgs {
        config: Some(path),
        tenants_secret_selector: Some("a=b".to_owned()),
        ..ConfigArgs::default()
    };
    TenantBase::load(&args, &Config::load(&args).unwrap())
        .unwrap()
        .unwrap()
}

#[test]
fn a_tenant_has_the_processs_configured_identity_and_its_fragment_cannot_change_it() {
    let base = tenant_base("leaderElection:\n  identity: manager-a\n");
    assert_eq!(base.tenant(None).unwrap().settings.identity, "manager-a");
    let refused = base
        .tenant(Some("leaderElection:\n  identity: someone-else\n"))
        .unwrap_err();
    assert!(refused.0[0].field.ends_with("leaderElection"), "{refused}");
}

#[test]
fn a_tenant_fragment_may_turn_dry_run_on_but_never_off() {
    let dry = tenant_base("dryRun: true\ntenants:\n  secretSelector: a=b\n");
    assert!(dry.tenant(None).unwrap().dry_run);
    assert!(dry.tenant(Some("dryRun: false")).unwrap().dry_run);
    let live = tenant_base("tenants:\n  secretSelector: a=b\n");
    assert!(!live.tenant(None).unwrap().dry_run);
    assert!(live.tenant(Some("dryRun: true")).unwrap().dry_run);
}

#[test]
fn a_tenants_static_addresses_are_ip_addresses() {
    let base = tenant_base("tenants:\n  secretSelector: a=b\n");
    let static_mode = |addresses: &str| {
        format!(
            "endpointReconcilerType: static\nloops:\n  apiserverEndpoints:\n    \
             staticAddresses: {addresses}\n"
        )
    };
    let refused = base
        .tenant(Some(&static_mode("[192.0.2.40, kube-dns.kube-system.svc]")))
        .unwrap_err();
    assert_eq!(refused.0.len(), 1, "{refused}");
    assert_eq!(
        refused.0[0].field,
        "bootstrap-controller.io/config: loops.apiserverEndpoints.staticAddresses[1]"
    );
    assert!(refused.0[0].message.contains("is a DNS name"), "{refused}");
    let tenant = base
        .tenant(Some(&static_mode("[192.0.2.40, \"2001:db8::40\"]")))
        .unwrap();
    assert_eq!(tenant.loops.apiserver_endpoints.static_entries().len(), 2);
}

/// What the file sets is named as the file names it, not under the tenant annotation.
#[test]
fn a_tenant_refusal_of_the_files_own_setting_names_the_file_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.yaml");
    let file = "tenants:\n  secretSelector: a=b\nendpointReconcilerType: static\nloops:\n  \
                apiserverEndpoints:\n    staticAddresses: [kube-dns.kube-system.svc]\n";
    std::fs::write(&path, file).unwrap();
    let args = ConfigArgs {
        config: Some(path),
        tenants_secret_selector: Some("a=b".to_owned()),
        ..ConfigArgs::default()
    };
    let refused = TenantBase::load(&args, &Config::load(&args).unwrap()).unwrap_err();
    assert_eq!(refused.0.len(), 1, "{refused}");
    assert_eq!(
        refused.0[0].field,
        "loops.apiserverEndpoints.staticAddresses[0]"
    );
    std::fs::write(
        args.config.as_ref().unwrap(),
        "tenants:\n  secretSelector: a=b\nendpointReconcilerType: lease\n",
    )
    .unwrap();
    let refused = TenantBase::load(&args, &Config::load(&args).unwrap()).unwrap_err();
    assert_eq!(refused.0[0].field, "endpointReconcilerType", "{refused}");
}

#[test]
fn the_cache_budget_flags_are_the_processs_not_a_tenants() {
    let args = ConfigArgs {
        tenants_secret_selector: Some("a=b".to_owned()),
        tenants_cache_max_objects: Some("2000".to_owned()),
        tenants_cache_max_mib: Some("8".to_owned()),
        tenants_cache_total_mib: Some("40".to_owned()),
        tenants_secrets_total_mib: Some("16".to_owned()),
        ..ConfigArgs::default()
    };
    let process = Config::merge(&args, FileConfig::default()).unwrap();
    let tenants = process.tenants.clone().unwrap();
    assert_eq!(
        (
            tenants.cache_max_objects,
            tenants.cache_max_mib,
            tenants.cache_total_mib,
            tenants.secrets_total_mib
        ),
        (2000, 8, 40, 16)
    );
    assert_eq!(tenants.secrets_total_bytes(), 16 * 1024 * 1024);
    // A tenant is one cluster: the flags would otherwise refuse every tenant as if they were
    // given without a selector.
    let base = TenantBase::load(&args, &process).unwrap().unwrap();
    assert_eq!(base.tenants, tenants);
    let tenant = base.tenant(None).unwrap();
    assert_eq!(tenant.tenants, None);
}

#[test]
fn a_tenant_fragment_merges_over_the_file_and_is_validated_as_the_file() {
    let base = tenant_base(
        "serviceClusterIPRange: 10.96.0.0/12\ntenants:\n  secretSelector: a=b\nloops:\n  systemNamespaces:\n    interval: 5s\n",
    );
    let defaults = base.tenant(None).unwrap();
    assert_eq!(
        defaults.loops.apiserver_endpoints.mode,
        Some(EndpointsMode::None)
    );
    assert_eq!(defaults.tenants, None, "a tenant is one cluster");
    assert_eq!(
        defaults.settings.service_ranges,
        vec!["10.96.0.0/12".parse::<IpNet>().unwrap()]
    );
    let tenant = base
        .tenant(Some(
            "serviceClusterIPRange: 10.100.0.0/16\nloops:\n  nodePortRepair:\n    enabled: false\n",
        ))
        .unwrap();
    assert_eq!(
        tenant.settings.service_ranges,
        vec!["10.100.0.0/16".parse::<IpNet>().unwrap()]
    );
    assert!(!tenant.loops.node_port_repair.enabled);
    // What the fragment leaves out comes from the file, key by key.
    assert_eq!(
        tenant.loops.system_namespaces.interval,
        Duration::from_secs(5)
    );

    let error = single_error(base.tenant(Some("serviceClusterIPRange: 10.0.0.0/33\n")));
    assert_eq!(
        error.field,
        "bootstrap-controller.io/config: serviceClusterIPRange"
    );
    let error = single_error(base.tenant(Some("loops:\n  nope: {}\n")));
    assert!(
        error
            .field
            .starts_with("bootstrap-controller.io/config: loops"),
        "{error}"
    );
    let error = single_error(base.tenant(Some("adminAddr: 127.0.0.1:1\n")));
    assert_eq!(error.field, "bootstrap-controller.io/config: adminAddr");
    let error = single_error(base.tenant(Some("endpointReconcilerType: lease\n")));
    assert_eq!(
        error.field,
        "bootstrap-controller.io/config: endpointReconcilerType"
    );
    let error = single_error(base.tenant(Some("- a\n- b\n")));
    assert_eq!(error.field, "bootstrap-controller.io/config: (fragment)");
    let error = single_error(base.tenant(Some("key: [unclosed\n")));
    assert_eq!(error.field, "bootstrap-controller.io/config: (fragment)");
}

#[test]
fn credential_plugins_are_absolute_program_paths() {
    let config = from_yaml(
        "tenants:\n  secretSelector: a=b\n  credentialPlugins: [/usr/bin/aws, \
         /usr/local/bin/gke-gcloud-auth-plugin]\n",
    )
    .unwrap();
    assert_eq!(
        config.tenants.unwrap().credential_plugins,
        [
            PathBuf::from("/usr/bin/aws"),
            PathBuf::from("/usr/local/bin/gke-gcloud-auth-plugin")
        ]
    );
    for bad in ["aws", "./aws", "/usr/bin/../bin/aws", "/usr/bin/"] {
        let args = ConfigArgs {
            tenants_secret_selector: Some("a=b".to_owned()),
            tenants_credential_plugins: Some(bad.to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(
            error.field, "--tenants-credential-plugins",
            "{bad}: {error}"
        );
    }
    let args = ConfigArgs {
        tenants_credential_plugins: Some("/usr/bin/aws".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--tenants-credential-plugins");
}

#[test]
fn management_mode_refuses_the_process_wide_etcd_settings() {
    let args = ConfigArgs {
        tenants_secret_selector: Some("a=b".to_owned()),
        etcd_servers: Some("https://192.0.2.1:2379".to_owned()),
        etcd_prefix: Some("/registry".to_owned()),
        ..ConfigArgs::default()
    };
    let errors = Config::merge(&args, FileConfig::default()).unwrap_err().0;
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(fields, ["--etcd-servers", "--etcd-prefix"], "{errors:?}");
    assert!(
        errors[0].message.contains("etcd-client.crt"),
        "{}",
        errors[0]
    );
    rejected(
        "tenants:\n  secretSelector: a=b\netcdServers: https://192.0.2.1:2379\n",
        "etcdServers",
        &[],
    );
}

#[test]
fn a_fragment_names_no_file_and_stays_above_the_floors() {
    let base = tenant_base("tenants:\n  secretSelector: a=b\n");
    for key in ["etcdCAFile", "etcdCertFile", "etcdKeyFile"] {
        let error = single_error(base.tenant(Some(&format!("{key}: /etc/passwd\n"))));
        assert_eq!(
            error.field,
            format!("bootstrap-controller.io/config: {key}")
        );
        assert!(error.message.contains("etcd-client.key"), "{error}");
    }
    for (fragment, field) in [
        (
            "loops:\n  systemNamespaces:\n    interval: 1ms\n",
            "loops.systemNamespaces.interval",
        ),
        (
            "loops:\n  nodePortRepair:\n    interval: 4s\n",
            "loops.nodePortRepair.interval",
        ),
        (
            "loops:\n  clusterIPRepair:\n    pageSize: 1\n",
            "loops.clusterIPRepair.pageSize",
        ),
        // Quoted, as the configuration's parser takes a count too.
        (
            "loops:\n  nodePortRepair:\n    pageSize: \"1\"\n",
            "loops.nodePortRepair.pageSize",
        ),
        (
            "loops:\n  apiserverEndpoints:\n    leaseTTL: 100ms\n",
            "loops.apiserverEndpoints.leaseTTL",
        ),
    ] {
        let error = single_error(base.tenant(Some(fragment)));
        assert_eq!(
            error.field,
            format!("bootstrap-controller.io/config: {field}"),
            "{error}"
        );
    }
    // At the floor is allowed; the file itself is the operator's and has no floors.
    assert!(
        base.tenant(Some("loops:\n  systemNamespaces:\n    interval: 5s\n"))
            .is_ok()
    );
    let fast = tenant_base(
        "tenants:\n  secretSelector: a=b\nloops:\n  systemNamespaces:\n    interval: 1s\n",
    );
    assert!(fast.tenant(None).is_ok());
}

#[test]
fn a_tenant_etcd_prefix_is_a_plain_key_path() {
    let base = tenant_base("tenants:\n  secretSelector: a=b\n  etcdAllowedCIDRs: [192.0.2.0/24]\n");
    let tenant = base
        .tenant(Some(
            "etcdServers: https://192.0.2.1:2379\netcdPrefix: /tenants/a\n",
        ))
        .unwrap();
    assert_eq!(tenant.settings.etcd.prefix, "/tenants/a");
    for prefix in ["registry", "/a//b", "/a/../b", "/a/", "/a b", "/"] {
        let error = single_error(base.tenant(Some(&format!(
            "etcdServers: https://192.0.2.1:2379\netcdPrefix: \"{prefix}\"\n"
        ))));
        assert_eq!(
            error.field, "bootstrap-controller.io/config: etcdPrefix",
            "{prefix}: {error}"
        );
    }
    // Inside another cluster's keys: refused, naming the resource key.
    for (prefix, named) in [
        ("/registry/services/specs", "services"),
        ("/registry/ranges", "ranges"),
        ("/registry/networking.k8s.io", "networking.k8s.io"),
        ("/tenant-a/secrets", "secrets"),
    ] {
        let error = single_error(base.tenant(Some(&format!(
            "etcdServers: https://192.0.2.1:2379\netcdPrefix: \"{prefix}\"\n"
        ))));
        assert_eq!(error.field, "bootstrap-controller.io/config: etcdPrefix");
        assert!(
            error.message.contains(&format!("names \"{named}\"")),
            "{prefix}: {error}"
        );
    }
    // An apiserver's own prefix of one or more plain segments is fine, whatever its first one.
    for prefix in ["/registry", "/tenant-a/registry", "/services", "/k8s/t-1"] {
        assert!(validate_tenant_etcd_prefix(prefix).is_ok(), "{prefix}");
    }
    assert_eq!(
        fragment_etcd("etcdServers: [HTTPS://192.0.2.1:2379/]\netcdPrefix: /t/a\n"),
        Some((vec!["https://192.0.2.1:2379".to_owned()], "/t/a".to_owned()))
    );
    assert_eq!(
        fragment_etcd("etcdServers: https://192.0.2.1:2379\n").map(|c| c.1),
        Some("/registry".to_owned())
    );
    assert_eq!(fragment_etcd("etcdPrefix: /t/a\n"), None);
    assert_eq!(
        fragment_etcd("etcdServers: https://192.0.2.1:2379\netcdPrefix: /t/../a\n"),
        None
    );
}

#[test]
fn flags_override_file_override_defaults() {
    let file = parse_file(
        "serviceNodePortRange: 20000-20999\nsecurePort: 8443\nadminAddr: 127.0.0.1:9000\ndryRun: true\nloops:\n  systemNamespaces:\n    interval: 5s\n",
    )
    .unwrap();
    let args = ConfigArgs {
        secure_port: Some("9443".to_owned()),
        dry_run: Some("false".to_owned()),
        ..ConfigArgs::default()
    };
    let config = Config::merge(&args, file).unwrap();
    assert_eq!(
        config.settings.secure_port,
        Some(9443),
        "flag wins over file"
    );
    assert!(!config.dry_run, "flag wins over file");
    assert_eq!(
        config.settings.node_port_range,
        reconcilers::alloc::PortRange::new(20000, 20999).unwrap()
    );
    assert_eq!(config.admin_addr, "127.0.0.1:9000".parse().unwrap());
    assert_eq!(
        config.loops.system_namespaces.interval,
        Duration::from_secs(5)
    );
    // Sections the file leaves out keep their defaults, as do fields of a partial section.
    assert_eq!(
        config.loops.kubernetes_service.interval,
        Duration::from_secs(10)
    );
    assert_eq!(config.loops.system_namespaces.namespaces.len(), 4);
    assert_eq!(config.loops.apiserver_endpoints.apiserver_count, 1);
}

#[test]
fn leader_election_flags_override_file() {
    let file = parse_file("leaderElection:\n  enabled: true\n  leaseName: from-file\n").unwrap();
    let args = ConfigArgs {
        leader_elect: Some("false".to_owned()),
        ..ConfigArgs::default()
    };
    let config = Config::merge(&args, file).unwrap();
    assert!(!config.leader_election.enabled);
    assert_eq!(config.leader_election.lease_name, "from-file");
    assert_eq!(config.leader_election.lease_namespace, "kube-system");
    let error = single_error(
        parse_file("leaderElection:\n  leaseDuration: 5s\n  renewGrace: 5s\n")
            .map_err(ConfigErrors::from)
            .and_then(|file| Config::merge(&ConfigArgs::default(), file)),
    );
    assert_eq!(error.field, "leaderElection.renewGrace");
}

/// A leader-election error names the setting that was given, the flag or the section's key,
/// never one left at its default.
#[test]
fn leader_election_errors_name_what_was_given() {
    rejected(
        "leaderElection:\n  leaseName: Not_A_Name\n",
        "leaderElection.leaseName",
        &["not a valid Lease name"],
    );
    rejected(
        "leaderElection:\n  leaseDuration: 3s\n",
        "leaderElection.leaseDuration",
        &["longer than the renew grace (5s, its default)"],
    );
    let args = ConfigArgs {
        leader_elect_lease_duration: Some("3s".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--leader-elect-lease-duration");
    let args = ConfigArgs {
        leader_elect_renew_grace: Some("soon".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--leader-elect-renew-grace");
    // With leader election off its settings are not checked.
    from_yaml("leaderElection:\n  enabled: false\n  leaseName: Not_A_Name\n").unwrap();
}

/// The identity names this replica in every event, whose reportingInstance holds 128 bytes.
#[test]
fn an_identity_longer_than_an_event_holds_is_refused() {
    let long = "r".repeat(129);
    rejected(
        &format!("leaderElection:\n  identity: {long}\n"),
        "leaderElection.identity",
        &["is 129 bytes long", "reportingInstance holds"],
    );
    let args = ConfigArgs {
        leader_elect_identity: Some(long),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--leader-elect-identity");
    let fits = "r".repeat(128);
    let config = from_yaml(&format!("leaderElection:\n  identity: {fits}\n")).unwrap();
    assert_eq!(config.settings.identity, fits);
}

/// The Lease holds whole seconds: a fraction the standbys never wait for is refused, not
/// dropped.
#[test]
fn a_lease_duration_is_whole_seconds() {
    rejected(
        "leaderElection:\n  leaseDuration: 15900ms\n",
        "leaderElection.leaseDuration",
        &["must be whole seconds (e.g. 15s)"],
    );
    let args = ConfigArgs {
        leader_elect_lease_duration: Some("15.5s".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--leader-elect-lease-duration");
    assert!(error.message.contains("must be whole seconds"), "{error}");
    let config = from_yaml("leaderElection:\n  leaseDuration: 16000ms\n").unwrap();
    assert_eq!(
        config.leader_election.lease_duration,
        Duration::from_secs(16)
    );
}

#[test]
fn printed_config_parses_back_to_the_same() {
    let config = from_yaml(
        "serviceClusterIPRange: 10.96.0.0/12,fd00::/108\nadvertiseAddress: 192.0.2.3\nendpointReconcilerType: master-count\napiserverCount: 3\nloops:\n  systemNamespaces:\n    interval: 1m30s\n    namespaces:\n      - name: extra\n        labels:\n          team: core\n",
    )
    .unwrap();
    assert_eq!(config.loops.apiserver_endpoints.apiserver_count, 3);
    let yaml = config.to_yaml().unwrap();
    // The endpoints loop's two kube-apiserver flags print at the top level, as the file has them.
    assert!(
        yaml.contains("\nendpointReconcilerType: master-count\n"),
        "{yaml}"
    );
    assert!(yaml.contains("\napiserverCount: 3\n"), "{yaml}");
    let again = from_yaml(&yaml).unwrap();
    assert_eq!(config, again, "{yaml}");
}

#[test]
fn durations_round_trip() {
    for (text, duration) in [
        ("500ms", Duration::from_millis(500)),
        ("10s", Duration::from_secs(10)),
        ("1m", Duration::from_secs(60)),
        ("1m30s", Duration::from_secs(90)),
        ("2h", Duration::from_secs(7200)),
    ] {
        assert_eq!(parse_duration(text).unwrap(), duration);
        assert_eq!(format_duration(duration), text);
    }
    assert_eq!(format_duration(Duration::ZERO), "0s");
    assert_eq!(format_duration(Duration::from_millis(61_500)), "1m1s500ms");
    assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
    assert_eq!(parse_duration("1 minute").unwrap(), Duration::from_secs(60));
    for bad in ["10", "", "-5s", "ten seconds", "5x"] {
        let err = parse_duration(bad).unwrap_err();
        assert!(err.to_string().contains("e.g. 10s"), "{bad:?}: {err}");
    }
}

/// A duration past any a setting needs is refused where it is read, naming the field, before a
/// deadline or a Lease is made of it.
#[test]
fn a_duration_longer_than_any_setting_needs_is_refused() {
    for (yaml, field) in [
        (
            "loops:\n  systemNamespaces:\n    interval: 2562047788015215h\n",
            "loops.systemNamespaces.interval",
        ),
        (
            "leaderElection:\n  leaseDuration: 8761h\n  renewGrace: 5s\n",
            "leaderElection.leaseDuration",
        ),
        ("shutdownTimeout: 9000h\n", "shutdownTimeout"),
    ] {
        rejected(yaml, field, &["is longer than 8760h (365 days)"]);
    }
    let args = ConfigArgs {
        leader_elect_lease_duration: Some("2562047788015215h".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--leader-elect-lease-duration");
    assert_eq!(
        parse_duration("8760h").unwrap(),
        reconcilers::section::MAX_DURATION
    );
}

#[test]
fn derived_identity_is_stable_within_the_process() {
    let config = Config::merge(&ConfigArgs::default(), FileConfig::default()).unwrap();
    let again = Config::merge(&ConfigArgs::default(), FileConfig::default()).unwrap();
    assert!(!config.settings.identity.is_empty());
    assert_eq!(config.settings.identity, again.settings.identity);
    let named = from_yaml("leaderElection:\n  identity: replica-a\n").unwrap();
    assert_eq!(named.settings.identity, "replica-a");
}

#[test]
fn a_derived_identity_is_the_same_instance_after_a_restart_and_differs_between_instances() {
    let advertise: Option<IpAddr> = Some("192.0.2.10".parse().unwrap());
    let admin: SocketAddr = "0.0.0.0:8080".parse().unwrap();
    let first = derived_identity(Some("node-a"), advertise, admin);
    assert_eq!(first, derived_identity(Some("node-a"), advertise, admin));
    assert!(first.starts_with("node-a_"), "{first}");
    // Another host, another advertised address, another admin address (two processes on one
    // host): each is another instance.
    let others = [
        derived_identity(Some("node-b"), advertise, admin),
        derived_identity(Some("node-a"), Some("192.0.2.11".parse().unwrap()), admin),
        derived_identity(Some("node-a"), advertise, "0.0.0.0:8081".parse().unwrap()),
        derived_identity(Some("node-a"), None, admin),
    ];
    for other in &others {
        assert_ne!(&first, other);
    }
    // The hash is fixed, not the toolchain's: builds agree on one instance's identity.
    assert_eq!(first, "node-a_".to_owned() + &first["node-a_".len()..]);
    assert_eq!(first.len(), "node-a_".len() + 8);
}

#[test]
fn dns1123() {
    assert!(validate_dns1123_label("kube-system").is_ok());
    assert!(validate_dns1123_label("-a").is_err());
    assert!(validate_dns1123_label(&"a".repeat(64)).is_err());
    assert!(validate_dns1123_subdomain("a.b-c").is_ok());
    assert!(validate_dns1123_subdomain("a..b").is_err());
}

#[test]
fn tenant_etcd_servers_need_the_operators_networks_and_plain_urls() {
    let fragment = "etcdServers: https://192.0.2.1:2379\netcdPrefix: /tenants/a\n";
    // Without allowed networks no tenant names an etcd, and the message names the setting.
    let base = tenant_base("tenants:\n  secretSelector: a=b\n");
    let error = single_error(base.tenant(Some(fragment)));
    assert_eq!(error.field, "bootstrap-controller.io/config: etcdServers");
    assert!(
        error.message.contains("--tenants-etcd-allowed-cidrs"),
        "{error}"
    );
    let base = tenant_base("tenants:\n  secretSelector: a=b\n  etcdAllowedCIDRs: [192.0.2.0/24]\n");
    assert!(base.tenant(Some(fragment)).is_ok());
    for (server, named) in [
        ("https://user:pw@192.0.2.1:2379", "userinfo"),
        ("https://192.0.2.1:2379/v3/kv", "path"),
        ("https://192.0.2.1:2379?a=b", "query"),
        ("https://192.0.2.1:2379#x", "fragment"),
    ] {
        let error = single_error(base.tenant(Some(&format!(
            "etcdServers: \"{server}\"\netcdPrefix: /tenants/a\n"
        ))));
        assert_eq!(
            error.field, "bootstrap-controller.io/config: etcdServers",
            "{server}: {error}"
        );
        assert!(error.message.contains(named), "{server}: {error}");
    }
    // The setting itself: flags or the file, networks only, management mode only.
    let config = from_yaml(
        "tenants:\n  secretSelector: a=b\n  etcdAllowedCIDRs: [10.0.16.0/20, fd00:10::/64]\n",
    )
    .unwrap();
    assert_eq!(
        config.tenants.unwrap().etcd_allowed_cidrs,
        vec![
            "10.0.16.0/20".parse::<IpNet>().unwrap(),
            "fd00:10::/64".parse().unwrap()
        ]
    );
    for bad in ["10.0.16.1/20", "10.0.16.0/33", "example.com"] {
        let args = ConfigArgs {
            tenants_secret_selector: Some("a=b".to_owned()),
            tenants_etcd_allowed_cidrs: Some(bad.to_owned()),
            ..ConfigArgs::default()
        };
        let error = single_error(Config::merge(&args, FileConfig::default()));
        assert_eq!(error.field, "--tenants-etcd-allowed-cidrs", "{bad}");
    }
    let args = ConfigArgs {
        tenants_etcd_allowed_cidrs: Some("10.0.0.0/8".to_owned()),
        ..ConfigArgs::default()
    };
    let error = single_error(Config::merge(&args, FileConfig::default()));
    assert_eq!(error.field, "--tenants-etcd-allowed-cidrs");
}

#[test]
fn every_problem_of_a_file_is_reported_at_once_each_on_its_line() {
    let yaml = "\
loops:
  systemNamespaces:
    intervall: 1m
dryrun: true
DryRun: false
securePort: abc
serviceNodePortRange: 2-1
leaderElection:
  enabled: true
    leaseName: x
";
    let errors = from_yaml(yaml).unwrap_err().0;
    let said: Vec<String> = errors.iter().map(ToString::to_string).collect();
    let expect = [
        (
            "loops.systemNamespaces.intervall",
            "line 3: unknown field `intervall`: did you mean `interval`?",
        ),
        (
            "dryrun",
            "line 4: unknown field `dryrun`: did you mean `dryRun`?",
        ),
        (
            "DryRun",
            "line 5: unknown field `DryRun`: did you mean `dryRun`?",
        ),
        ("securePort", "line 6 column 13: invalid u32"),
        // Blamed on the misplaced key's own line, not on the key whose value it continues.
        (
            "leaderElection.leaseName",
            "line 10: `leaseName` is indented deeper than `enabled` (line 9)",
        ),
        // The merged settings' checks follow, on the lines of their keys.
        ("serviceNodePortRange", "line 7: \"2-1\" is inverted"),
    ];
    assert_eq!(errors.len(), expect.len(), "{said:#?}");
    for ((field, message), error) in expect.iter().zip(&errors) {
        assert_eq!(error.field, *field, "{said:#?}");
        assert!(error.message.starts_with(message), "{said:#?}");
    }
    // Taking out the only key of a section leaves the section empty, which is not reported.
    assert!(
        !said.iter().any(|e| e.contains("expected mapping")),
        "{said:#?}"
    );
}

#[test]
fn a_misaligned_key_is_blamed_on_its_own_line() {
    // Between two indentations: no key of YAML's.
    let error = single_error(from_yaml(
        "loops:\n  systemNamespaces:\n    interval: 1m\n   namespaces: []\n",
    ));
    assert!(
        error
            .message
            .starts_with("line 4: `namespaces` is indented 3 spaces"),
        "{error}"
    );
    // Another syntax error on an indented line is not taken for a misalignment.
    let error = single_error(from_yaml(
        "loops:\n  systemNamespaces:\n    interval: 1m: x\n",
    ));
    assert!(!error.message.contains("is indented"), "{error}");
    // At its parent's indentation: the parent is empty, and the key, unknown there, may belong
    // under it.
    let errors = from_yaml("loops:\n  systemNamespaces:\n  interval: 1m\n")
        .unwrap_err()
        .0;
    let said = ConfigErrors(errors.clone()).to_string();
    assert_eq!(errors.len(), 2, "{said}");
    assert_eq!(errors[1].field, "loops.interval", "{said}");
    assert!(
        errors[1].message.starts_with("line 3: ")
            || errors[1].message.starts_with("line 3 column 3: "),
        "{said}"
    );
    assert!(
        errors[1]
            .message
            .contains("if it belongs to `systemNamespaces` on line 2"),
        "{said}"
    );
}

#[test]
fn keys_are_located_by_their_path() {
    let yaml = "\
# comment
loops:
  systemNamespaces:
    namespaces:
      - name: a
        labels: {}
      -   name: b.c
  apiserverEndpoints:
    staticAddresses: [192.0.2.1]
tenants:
  cacheBudgets:
    team/a.b:
      maxMiB: 3
";
    let at = |path: &str| locate(yaml, path);
    assert_eq!(at("loops"), Some(2));
    assert_eq!(at("loops.systemNamespaces.namespaces[0].labels"), Some(6));
    assert_eq!(at("loops.systemNamespaces.namespaces[1].name"), Some(7));
    assert_eq!(at("loops.apiserverEndpoints.staticAddresses[1]"), Some(9));
    assert_eq!(at("tenants.cacheBudgets.team/a.b.maxMiB"), Some(13));
    assert_eq!(at("--secure-port"), None);
}

#[test]
fn a_value_from_the_environment_is_blamed_on_its_variable() {
    let mut args = ConfigArgs {
        dry_run: Some("1".to_owned()),
        secure_port: Some("x".to_owned()),
        ..ConfigArgs::default()
    };
    args.from_env.insert("BOOTSTRAP_DRY_RUN");
    let errors = Config::merge(&args, FileConfig::default()).unwrap_err().0;
    let said: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(
        said.contains(
            &"BOOTSTRAP_DRY_RUN: \"1\" is not a boolean (expected true or false)".to_owned()
        ),
        "{said:?}"
    );
    assert!(
        said.iter().any(|e| e.starts_with("--secure-port: ")),
        "the flag, typed as a flag: {said:?}"
    );
}

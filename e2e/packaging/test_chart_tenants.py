"""The chart in management mode (`tenants.enabled`): the settings reach the container as the
binary's environment variables, the management cluster's RBAC is exactly Secret read and event
writes in the tenants' namespace plus the replicas' Leases in the lease namespace (none of the
loops' rules, which belong in each tenant cluster), contradictory values are refused naming the
value to set, the schema is strict, and every rendered object is a valid Kubernetes object."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from harness import (
    CHART,
    Controller,
    RecordingProxy,
    Sim,
    binary,
    container_args,
    objects,
    render_text,
    workdir,
)
from test_chart import KUBE_VERSIONS, allows, granted

# The label apiserver-sim puts on each tenant kubeconfig Secret (--tenants).
TENANT_LABEL = "bootstrap-controller.io/tenant"

SELECTOR = "cluster.x-k8s.io/cluster-name"

CASES = {
    # Cluster API: the kubeconfig Secrets in one namespace, the default key `value`.
    "capi": {"tenants": {"enabled": True, "secretSelector": SELECTOR,
                         "namespace": "capi-clusters"}},
    # Kamaji across every namespace.
    "kamaji-all-namespaces": {"tenants": {
        "enabled": True, "secretSelector": "kamaji.clastix.io/component=admin-kubeconfig",
        "allNamespaces": True, "kubeconfigKey": "admin.conf"}},
    # One replica running every tenant, leader election off.
    "single": {"replicaCount": 1, "config": {"leaderElection": {"enabled": False}},
               "tenants": {"enabled": True, "secretSelector": "example.com/tenant",
                           "namespace": "tenants", "kubeconfigKey": "config"}},
    # The replicas' Leases in a namespace of the user's choosing, another lease name, and the
    # bindings naming a User (the management cluster reached through targetKubeconfig).
    "lease-namespace": {
        "targetKubeconfig": {"secretName": "management-kubeconfig"},
        "rbac": {"subjects": [{"kind": "User", "name": "system:bootstrap-controller"}]},
        "config": {"leaderElection": {"leaseName": "bc", "leaseNamespace": "bc-leases"}},
        "tenants": {"enabled": True, "secretSelector": SELECTOR, "namespace": "capi-clusters"}},
}

RBAC_KINDS = ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
SECRETS = [("", "secrets", verb) for verb in ("list", "watch")]
EVENTS = [("events.k8s.io", "events", verb) for verb in ("create", "patch")]
LEASES = [("coordination.k8s.io", "leases", verb)
          for verb in ("get", "list", "watch", "create", "update", "delete")]


def rbac(values: dict, namespace: str = "bootstrap") -> list[dict]:
    return [o for o in objects(values, namespace) if o["kind"] in RBAC_KINDS]


def grants(values: dict) -> set[tuple]:
    return set(granted(rbac(values)))


def expected(tenants_ns, lease_ns) -> set[tuple]:
    """(namespace or None, group, resource, verb, resourceNames) as test_chart.granted gives them."""
    out = {(tenants_ns, g, r, v, None) for g, r, v in SECRETS + EVENTS}
    if lease_ns is not None:
        out |= {(lease_ns, g, r, v, None) for g, r, v in LEASES}
    return out


def env_of(values: dict) -> dict:
    return container_args(objects(values))[1]


def config_file(values: dict) -> dict:
    config_map = next(o for o in objects(values) if o["kind"] == "ConfigMap")
    return yaml.safe_load(config_map["data"]["config.yaml"])


@pytest.mark.parametrize("case", CASES)
def test_lint_strict_and_schema_accept_each_case(case):
    helm.Chart.load(CHART).validate_schema(CASES[case])
    report = helm.lint(str(CHART), CASES[case], strict=True, namespace="bootstrap")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_objects_are_valid_kubernetes_objects(case, version):
    rendered = objects(CASES[case])
    assert {"Deployment", "ConfigMap"} <= {o["kind"] for o in rendered}
    for obj in rendered:
        kubernetes_validate.validate(obj, version, strict=True)


def test_rbac_is_exactly_secret_read_and_events_in_the_tenants_namespace_and_the_leases():
    """Namespaced by default: a Role and RoleBinding in the tenants' namespace, a Role and
    RoleBinding for the replicas' Leases in the release's namespace; nothing cluster-wide."""
    rendered = rbac(CASES["capi"])
    assert grants(CASES["capi"]) == expected("capi-clusters", "bootstrap")
    kinds = sorted((o["kind"], o["metadata"]["name"], o["metadata"].get("namespace"))
                   for o in rendered)
    assert kinds == [
        ("Role", "bc-bootstrap-controller-replicas", "bootstrap"),
        ("Role", "bc-bootstrap-controller-tenants", "capi-clusters"),
        ("RoleBinding", "bc-bootstrap-controller-replicas", "bootstrap"),
        ("RoleBinding", "bc-bootstrap-controller-tenants", "capi-clusters"),
    ]
    for binding in (o for o in rendered if o["kind"] == "RoleBinding"):
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": binding["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "bc-bootstrap-controller",
                                        "namespace": "bootstrap"}]


def test_loops_rules_are_not_rendered_in_the_management_cluster():
    """The single-cluster rules (namespaces, Services, ServiceCIDRs, IPAddresses, endpoints,
    the leader Lease by name) are the tenants' RBAC: none of them in the management cluster,
    whatever `config` enables."""
    values = {**CASES["capi"], "config": {
        "serviceClusterIPRange": "10.96.0.0/12", "endpointReconcilerType": "static",
        "loops": {"apiserverEndpoints": {"staticAddresses": ["192.0.2.10"]},
                  "systemNamespaces": {"namespaces": [
                      {"name": "platform", "labels": {"example.com/team": "platform"}}]},
                  "kubernetesService": {"recreateOnClusterIPMismatch": True}}}}
    resources = {g[2] for g in grants(values)}
    assert resources == {"secrets", "events", "leases"}, resources
    assert not render_text(values)["rbac.yaml"].strip()
    # The same values without management mode do render them: the chart's single-cluster RBAC.
    single = {k: v for k, v in values.items() if k != "tenants"}
    assert {"namespaces", "services", "servicecidrs", "ipaddresses", "endpoints",
            "endpointslices"} <= {g[2] for g in grants(single)}


def test_all_namespaces_is_a_cluster_role_and_the_leases_stay_namespaced():
    values = CASES["kamaji-all-namespaces"]
    assert grants(values) == expected(None, "bootstrap")
    kinds = sorted((o["kind"], o["metadata"].get("namespace")) for o in rbac(values))
    assert kinds == [("ClusterRole", None), ("ClusterRoleBinding", None),
                     ("Role", "bootstrap"), ("RoleBinding", "bootstrap")]
    binding = next(o for o in rbac(values) if o["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["kind"] == "ClusterRole"


def test_leader_election_off_grants_the_etcd_claim_records_only():
    """One replica shares nothing, but still records which tenant keeps overlapping etcd keys:
    the Leases' rules without `get`, which only sharing uses."""
    assert grants(CASES["single"]) == (
        expected("tenants", None)
        | {("bootstrap", g, r, v, None) for g, r, v in LEASES if v != "get"})


def test_configured_lease_namespace_and_subjects_are_used():
    values = CASES["lease-namespace"]
    assert grants(values) == expected("capi-clusters", "bc-leases")
    bindings = [o for o in rbac(values) if o["kind"] == "RoleBinding"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["bc-leases", "capi-clusters"]
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "User", "name": "system:bootstrap-controller",
                                        "apiGroup": "rbac.authorization.k8s.io"}]
    assert config_file(values)["leaderElection"] == {
        "enabled": True, "leaseName": "bc", "leaseNamespace": "bc-leases"}


def test_rbac_create_false_renders_none():
    assert not rbac({**CASES["capi"], "rbac": {"create": False}})


def test_lease_namespace_defaults_to_the_releases_and_the_configuration_says_so():
    """The Role that creates and deletes the replicas' Leases reaches no other component's
    Leases (kube-system's kube-controller-manager and kube-scheduler): the chart puts them in
    the release's namespace and writes that into the file the binary reads."""
    assert config_file(CASES["capi"])["leaderElection"] == {
        "enabled": True, "leaseNamespace": "bootstrap"}
    other = objects(CASES["capi"], namespace="platform")
    config = yaml.safe_load(next(o for o in other if o["kind"] == "ConfigMap")
                            ["data"]["config.yaml"])
    assert config["leaderElection"]["leaseNamespace"] == "platform"
    # Without management mode the file is as before: the binary's default, kube-system.
    assert "leaseNamespace" not in config_file({})["leaderElection"]


@pytest.mark.parametrize("case, env", [
    ("capi", {"BOOTSTRAP_TENANTS_SECRET_SELECTOR": SELECTOR,
              "BOOTSTRAP_TENANTS_NAMESPACE": "capi-clusters",
              "BOOTSTRAP_TENANTS_KUBECONFIG_KEY": "value"}),
    ("kamaji-all-namespaces", {
        "BOOTSTRAP_TENANTS_SECRET_SELECTOR": "kamaji.clastix.io/component=admin-kubeconfig",
        "BOOTSTRAP_TENANTS_KUBECONFIG_KEY": "admin.conf"}),
    ("single", {"BOOTSTRAP_TENANTS_SECRET_SELECTOR": "example.com/tenant",
                "BOOTSTRAP_TENANTS_NAMESPACE": "tenants",
                "BOOTSTRAP_TENANTS_KUBECONFIG_KEY": "config"}),
    ("etcd-networks", {"BOOTSTRAP_TENANTS_SECRET_SELECTOR": SELECTOR,
                       "BOOTSTRAP_TENANTS_NAMESPACE": "capi-clusters",
                       "BOOTSTRAP_TENANTS_KUBECONFIG_KEY": "value",
                       "BOOTSTRAP_TENANTS_ETCD_ALLOWED_CIDRS": "10.0.16.0/20,fd00:10::/64"}),
])
def test_settings_reach_the_container_as_the_binarys_environment(case, env):
    values = CASES.get(case) or {"tenants": {
        **CASES["capi"]["tenants"], "etcdAllowedCIDRs": ["10.0.16.0/20", "fd00:10::/64"]}}
    args, rendered = container_args(objects(values))
    assert args == ["run"]
    tenants = {k: v for k, v in rendered.items() if k.startswith("BOOTSTRAP_TENANTS_")}
    # The budgets are always given in management mode, at the chart's defaults here.
    assert tenants == {**env, "BOOTSTRAP_TENANTS_CACHE_MAX_OBJECTS": "50000",
                       "BOOTSTRAP_TENANTS_CACHE_MAX_MIB": "32",
                       "BOOTSTRAP_TENANTS_CACHE_TOTAL_MIB": "96",
                       "BOOTSTRAP_TENANTS_SECRETS_TOTAL_MIB": "8"}


def test_cache_budgets_reach_the_binary_through_the_configuration_file(tmp_path):
    """tenants.cacheBudgets (one tenant's budget, which its own Secret cannot set) goes into the
    file, beside the environment's other tenants settings; the binary reads both, and leaves
    out of a budget what it does not name (the process's)."""
    budgets = {"capi-clusters/big-cluster": {"maxObjects": 400000, "maxMiB": 256},
               "capi-clusters/small": {"maxMiB": 8}}
    values = {"tenants": {**CASES["capi"]["tenants"], "cacheBudgets": budgets}}
    helm.Chart.load(CHART).validate_schema(values)
    assert config_file(values)["tenants"] == {"cacheBudgets": budgets}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config_file(values)))
    env = {**env_of(values), "BOOTSTRAP_CONFIG": str(tmp_path / "config.yaml")}
    done = subprocess.run([str(binary("bootstrap-controller")), "config", "print"],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 0, done.stderr
    tenants = yaml.safe_load(done.stdout)["tenants"]
    assert tenants["secretSelector"] == SELECTOR, tenants
    assert tenants["cacheBudgets"] == {
        "capi-clusters/big-cluster": {"maxObjects": 400000, "maxMiB": 256},
        "capi-clusters/small": {"maxObjects": 50000, "maxMiB": 8}}, tenants
    # Without budgets the file has no tenants section: the environment holds the rest.
    assert "tenants" not in config_file(CASES["capi"])


@pytest.mark.parametrize("budgets, complaint", [
    ({"big-cluster": {"maxObjects": 1}}, "big-cluster"),
    ({"capi-clusters/big": {"maxObjects": 0}}, "maxObjects"),
    ({"capi-clusters/big": {"objects": 1}}, "objects"),
])
def test_schema_rejects_wrong_cache_budgets(budgets, complaint):
    with pytest.raises(helm.HelmValuesError) as err:
        helm.Chart.load(CHART).validate_schema({"tenants": {"cacheBudgets": budgets}})
    assert complaint in str(err.value), str(err.value)


def test_disabled_renders_as_before():
    env = env_of({})
    assert not [k for k in env if k.startswith("BOOTSTRAP_TENANTS_")], env
    assert "rbac-tenants.yaml" not in {k for k, v in render_text({}).items() if v.strip()}
    # tenants.* set but not enabled changes nothing.
    quiet = {"tenants": {"secretSelector": SELECTOR, "namespace": "capi-clusters"}}
    assert objects(quiet) == objects({})
    # Replicas stay at the chart's default in management mode.
    deploy = next(o for o in objects(CASES["capi"]) if o["kind"] == "Deployment")
    assert deploy["spec"]["replicas"] == 2


@pytest.mark.parametrize("tenants, complaint", [
    ({"enabled": True, "namespace": "capi-clusters"}, "tenants.secretSelector"),
    ({"enabled": True, "secretSelector": SELECTOR}, "tenants.namespace"),
    ({"enabled": True, "secretSelector": SELECTOR}, "tenants.allNamespaces=true"),
    ({"enabled": True, "secretSelector": SELECTOR, "namespace": "capi-clusters",
      "allNamespaces": True}, "contradict"),
])
def test_missing_or_contradictory_tenants_values_are_refused_naming_them(tenants, complaint):
    with pytest.raises(helm.HelmError) as err:
        objects({"tenants": tenants})
    assert complaint in str(err.value), str(err.value)


def test_etcd_servers_are_refused_in_management_mode():
    """BOOTSTRAP_ETCD_SERVERS is a flag's variable, and flags win over every tenant's fragment:
    every tenant would be pointed at one etcd."""
    with pytest.raises(helm.HelmError) as err:
        objects({**CASES["capi"], "etcd": {"servers": ["https://etcd-0.etcd:2379"]}})
    assert "etcd.servers" in str(err.value) and "etcdServers" in str(err.value), str(err.value)


@pytest.mark.parametrize("mode, address", [
    ("lease", "192.0.2.1"), ("lease", None), ("master-count", "192.0.2.1")])
def test_apiserver_endpoint_modes_are_refused_in_the_binarys_words(mode, address, tmp_path):
    """In management mode the process is none of a tenant's apiservers: `run` exits at start on
    `lease` and `master-count` (an advertise address or not), so the chart refuses them too,
    before the pods crash-loop, with the binary's reason."""
    config = {"endpointReconcilerType": mode}
    if address:
        config["advertiseAddress"] = address
    with pytest.raises(helm.HelmError) as err:
        objects({**CASES["capi"], "config": config})
    refusal = str(err.value)
    # The binary, given the same settings: the chart's environment and file with that mode.
    file = {**config_file(CASES["capi"]), **config}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(file))
    env = {**env_of(CASES["capi"]), "BOOTSTRAP_CONFIG": str(tmp_path / "config.yaml")}
    done = subprocess.run([str(binary("bootstrap-controller")), "run"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 2, (done.returncode, done.stderr)
    reason = re.search(r"endpointReconcilerType: (.*)", done.stderr).group(1)
    assert f"config.endpointReconcilerType with tenants.enabled=true: {reason}" in refusal, (
        refusal, done.stderr)


@pytest.mark.parametrize("entry, refused", [
    ("lb.example.com", True), ("192.0.2.40", False), ("2001:db8::40", False)])
def test_a_tenants_static_addresses_are_ip_addresses_in_the_binarys_words(entry, refused,
                                                                          tmp_path):
    """Every tenant's static endpoints come from the file: a name in them would be resolved with
    the management cluster's DNS. `run` exits at start on one, so the chart refuses it too, in
    the binary's words."""
    config = {"endpointReconcilerType": "static",
              "loops": {"apiserverEndpoints": {"staticAddresses": [entry]}}}
    if not refused:
        objects({**CASES["capi"], "config": config})
        return
    with pytest.raises(helm.HelmError) as err:
        objects({**CASES["capi"], "config": config})
    file = {**config_file(CASES["capi"]), **config}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(file))
    env = {**env_of(CASES["capi"]), "BOOTSTRAP_CONFIG": str(tmp_path / "config.yaml")}
    done = subprocess.run([str(binary("bootstrap-controller")), "run"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **env})
    assert done.returncode == 2, (done.returncode, done.stderr)
    reason = re.search(r"is a DNS name, (.*)", done.stderr).group(1)
    assert f"is a DNS name, {reason}" in str(err.value), (str(err.value), done.stderr)


@pytest.mark.parametrize("tenants, complaint", [
    ({"selector": SELECTOR}, "selector"),
    ({"enabled": "yes"}, "enabled"),
    ({"allNamespaces": "true"}, "allNamespaces"),
    ({"namespace": "Capi_Clusters"}, "namespace"),
    ({"kubeconfigKey": ""}, "kubeconfigKey"),
    ({"kubeconfigKey": "a/b"}, "kubeconfigKey"),
    ({"secretSelector": ["a", "b"]}, "secretSelector"),
    ({"etcdAllowedCIDRs": "10.0.0.0/8"}, "etcdAllowedCIDRs"),
    ({"etcdAllowedCIDRs": ["etcd.example.com"]}, "etcdAllowedCIDRs"),
])
def test_schema_rejects_unknown_keys_and_wrong_types(tenants, complaint):
    with pytest.raises(helm.HelmValuesError) as err:
        helm.Chart.load(CHART).validate_schema({"tenants": tenants})
    assert complaint in str(err.value), str(err.value)


def test_notes_point_at_the_tenants_and_the_replicas_leases():
    notes = render_text(CASES["capi"])["NOTES.txt"]
    assert f'kubectl get secrets -n capi-clusters -l "{SELECTOR}"' in notes, notes
    assert "get leases -l bootstrap-controller.io/replica-of=bootstrap-controller" in notes
    assert "TenantConfigInvalid" in notes
    # `check` is the single-cluster command: not offered for the tenants.
    assert "-- /bootstrap-controller check" not in notes
    assert "-- /bootstrap-controller check" in render_text({})["NOTES.txt"]


# ---------------------------------------------------------------------------------------------
# The rendered settings against a simulated fleet: a management cluster holding one kubeconfig
# Secret per tenant cluster (apiserver-sim --tenants).


def readme_fragment() -> str:
    """The annotation of the management-mode guide's per-tenant example."""
    section = (CHART.parents[1] / "docs" / "management-mode.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", section, re.S)
                 if "bootstrap-controller.io/config" in b)
    return yaml.safe_load(block)["metadata"]["annotations"]["bootstrap-controller.io/config"]


@pytest.mark.parametrize("scope", [{"namespace": "tenants"}, {"allNamespaces": True}],
                         ids=["namespaced", "all-namespaces"])
def test_rendered_settings_run_the_tenants_within_the_rendered_rbac(scope):
    """The Deployment's environment runs the binary in management mode against the simulator's
    management cluster, through a proxy recording each request as the authorizer sees it: the
    tenants' loops do their work in the tenant clusters, the guide's annotation example takes
    effect on its tenant, a bad annotation is reported on its Secret, and every request made to
    the management cluster is one the rendered RBAC grants (none of the loops' requests reach
    it)."""
    values = {"tenants": {"enabled": True, "secretSelector": f"{TENANT_LABEL}=true", **scope}}
    rendered = objects(values)
    grants_made = granted([o for o in rendered if o["kind"] in RBAC_KINDS])
    args, env = container_args(rendered)
    with workdir() as tmp:
        tmp = Path(tmp)
        tenants_dir = tmp / "tenants"
        sim = Sim(tmp, "--plain-http", "--tenants", "2", "--tenants-namespace", "tenants",
                  "--tenants-kubeconfig-dir", str(tenants_dir))
        proxy = RecordingProxy(yaml.safe_load(sim.kubeconfig.read_text())
                               ["clusters"][0]["cluster"]["server"])
        try:
            config_map = next(o for o in rendered if o["kind"] == "ConfigMap")
            (tmp / "config.yaml").write_text(config_map["data"]["config.yaml"])
            assert env["BOOTSTRAP_CONFIG"] == "/etc/bootstrap-controller/config.yaml"
            env["BOOTSTRAP_CONFIG"] = str(tmp / "config.yaml")
            env["BOOTSTRAP_KUBECONFIG"] = str(proxy.kubeconfig(tmp / "proxy-kubeconfig"))
            sim.kubectl("create", "namespace", "bootstrap", check=False)
            controller = Controller(args, {**env, "POD_NAME": "bc-0"}, tmp, "tenants")

            def wait(check, timeout=30):
                deadline = time.monotonic() + timeout
                while not check():
                    assert time.monotonic() < deadline, controller.output()
                    time.sleep(0.2)

            try:
                controller.wait_ready()
                wait(lambda: "bootstrap_tenants" in controller.get("/metrics")[1])
                # Each tenant's loops work in its own cluster.
                for i in range(2):
                    tenant = ["kubectl", "--kubeconfig", str(tenants_dir / f"tenant-{i}.kubeconfig")]
                    wait(lambda: subprocess.run(
                        [*tenant, "get", "service", "kubernetes", "-n", "default"],
                        capture_output=True).returncode == 0)
                # The management-mode guide's fragment on tenant-1's Secret: its extra system namespace, with
                # its label, appears there (a changed Secret restarts the tenant's loops).
                sim.kubectl("annotate", "secret", "-n", "tenants", "tenant-1-kubeconfig",
                            f"bootstrap-controller.io/config={readme_fragment()}")
                tenant_1 = ["kubectl", "--kubeconfig", str(tenants_dir / "tenant-1.kubeconfig")]
                wait(lambda: "platform" in subprocess.run(
                    [*tenant_1, "get", "namespace", "tenant-platform", "-o",
                     "jsonpath={.metadata.labels.example\\.com/team}"],
                    capture_output=True, text=True).stdout)
                # A tenant whose annotation names a process-wide key starts nothing and says so
                # on its Secret.
                secret = json.loads(sim.kubectl("get", "secret", "-n", "tenants",
                                                "tenant-0-kubeconfig", "-o", "json").stdout)
                sim.apply({
                    "apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "bad-kubeconfig", "namespace": "tenants",
                                 "labels": {TENANT_LABEL: "true"},
                                 "annotations": {"bootstrap-controller.io/config":
                                                 "adminAddr: 0.0.0.0:1\n"}},
                    "data": secret["data"],
                })

                def invalid_event():
                    items = json.loads(sim.kubectl(
                        "get", "events.events.k8s.io", "-n", "tenants", "-o", "json").stdout)
                    return any(e.get("reason") == "TenantConfigInvalid" for e in items["items"])

                wait(invalid_event)
            finally:
                assert controller.stop() == 0, controller.output()
            used = set(proxy.records)
        finally:
            proxy.stop()
            sim.stop()
    ungranted = [u for u in sorted(used, key=str) if not any(allows(g, u) for g in grants_made)]
    assert not ungranted, "\n".join(map(str, ungranted))
    assert {u[2] for u in used} <= {"secrets", "events", "leases"}, used
    # The Secret watch is where the RBAC puts it: the tenants' namespace, or cluster-wide.
    watched = {u[0] for u in used if u[2] == "secrets" and u[3] == "watch"}
    assert watched == {scope.get("namespace")}, watched


def test_readme_examples_are_what_the_chart_and_the_file_accept():
    """The management-mode guide's values example renders, and its annotation fragment is a valid
    piece of the configuration file (the chart's `config` schema mirrors the binary's loops)
    without any of the process-wide keys a fragment may not hold."""
    section = (CHART.parents[1] / "docs" / "management-mode.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    values = yaml.safe_load(next(b for b in blocks if b.startswith("# tenants.yaml")))
    helm.Chart.load(CHART).validate_schema(values)
    env = env_of(values)
    assert env["BOOTSTRAP_TENANTS_SECRET_SELECTOR"] == values["tenants"]["secretSelector"]
    secret = yaml.safe_load(next(b for b in blocks if "bootstrap-controller.io/config" in b))
    fragment = yaml.safe_load(secret["metadata"]["annotations"]["bootstrap-controller.io/config"])
    helm.Chart.load(CHART).validate_schema({"config": fragment})
    process_wide = {"kubeconfig", "adminAddr", "logFormat", "shutdownTimeout", "leaderElection",
                    "tenants"}
    assert not process_wide & set(fragment), fragment
    for name in ("BOOTSTRAP_TENANTS_SECRET_SELECTOR", "BOOTSTRAP_TENANTS_NAMESPACE",
                 "BOOTSTRAP_TENANTS_KUBECONFIG_KEY"):
        assert name in section, name


def test_tenant_cluster_rbac_renders_alone_as_the_chart_readme_says():
    """The chart README's command for a tenant cluster's RBAC: the same values with
    tenants.enabled=false, one replica and leader election off (no Lease rules: the replicas'
    Leases are in the management cluster), bound to the kubeconfig's user."""
    readme = (CHART / "README.md").read_text()
    for flag in ("--set tenants.enabled=false", "--set replicaCount=1",
                 "--set config.leaderElection.enabled=false", "--show-only templates/rbac.yaml"):
        assert flag in readme, flag
    values = {**CASES["capi"], "replicaCount": 1,
              "config": {"leaderElection": {"enabled": False}},
              "rbac": {"subjects": [{"kind": "User", "name": "capi-admin"}]}}
    values["tenants"] = {**values["tenants"], "enabled": False}
    docs = [d for d in yaml.safe_load_all(render_text(values)["rbac.yaml"]) if d]
    resources = {r for d in docs if "rules" in d for rule in d["rules"] for r in rule["resources"]}
    assert {"namespaces", "services", "ipaddresses", "events"} <= resources, resources
    assert "leases" not in resources and "secrets" not in resources, resources
    bindings = [d for d in docs if d["kind"].endswith("Binding")]
    assert bindings, docs
    for binding in bindings:
        assert binding["subjects"] == [{"kind": "User", "name": "capi-admin",
                                        "apiGroup": "rbac.authorization.k8s.io"}]
    for version in KUBE_VERSIONS:
        for doc in docs:
            kubernetes_validate.validate(doc, version, strict=True)


def running_tenants(controller: Controller) -> set[str]:
    """The tenants this replica runs: its /readyz?verbose lines not naming another replica."""
    lines = controller.get("/readyz?verbose")[1].splitlines()
    return {m.group(1) for m in (re.match(r"\[[+-]\]tenant (\S+) ", line) for line in lines)
            if m and "run by replica" not in m.string}


def test_rendered_replicas_share_the_tenants_within_the_rendered_rbac():
    """Two replicas with the chart's settings (leader election on, the replicas' Leases in the
    release's namespace) split the tenants, each tenant on one of them; when one stops, the
    other takes its tenants. Every management-cluster request is granted by the rendered RBAC."""
    values = CASES["capi"] | {"tenants": {"enabled": True, "namespace": "tenants",
                                          "secretSelector": f"{TENANT_LABEL}=true"}}
    rendered = objects(values)
    grants_made = granted([o for o in rendered if o["kind"] in RBAC_KINDS])
    args, env = container_args(rendered)
    tenants = {f"tenants/tenant-{i}-kubeconfig" for i in range(16)}
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp, "--plain-http", "--tenants", "16", "--tenants-namespace", "tenants")
        proxy = RecordingProxy(yaml.safe_load(sim.kubeconfig.read_text())
                               ["clusters"][0]["cluster"]["server"])
        replicas: list[Controller] = []
        try:
            config_map = next(o for o in rendered if o["kind"] == "ConfigMap")
            (tmp / "config.yaml").write_text(config_map["data"]["config.yaml"])
            env["BOOTSTRAP_CONFIG"] = str(tmp / "config.yaml")
            env["BOOTSTRAP_KUBECONFIG"] = str(proxy.kubeconfig(tmp / "proxy-kubeconfig"))
            sim.kubectl("create", "namespace", "bootstrap", check=False)
            for name in ("bc-0", "bc-1"):
                replicas.append(Controller(args, {**env, "POD_NAME": name}, tmp, name))

            def wait(check, timeout=60):
                deadline = time.monotonic() + timeout
                while not check():
                    assert time.monotonic() < deadline, "\n".join(r.output()[-4000:]
                                                                  for r in replicas)
                    time.sleep(0.2)

            try:
                for replica in replicas:
                    replica.wait_ready()
                assert "bootstrap_tenants" in replicas[0].get("/metrics")[1]

                def shared():
                    # Both replicas run tenants, each tenant on exactly one. (Rendezvous hashing
                    # of 16 tenants over two identities, each suffixed with a hash of its random
                    # admin port, leaves one replica without any once in 32,768 runs.)
                    a, b = (running_tenants(r) for r in replicas)
                    return a and b and not a & b and a | b == tenants

                wait(shared)
                leases = json.loads(sim.kubectl("get", "leases", "-n", "bootstrap", "-l",
                                                "bootstrap-controller.io/replica-of="
                                                "bootstrap-controller", "-o", "json").stdout)
                assert len(leases["items"]) == 2, leases
                assert replicas[1].stop() == 0, replicas[1].output()
                wait(lambda: running_tenants(replicas[0]) == tenants)
            finally:
                for replica in replicas:
                    if replica.process.poll() is None:
                        assert replica.stop() == 0, replica.output()
            used = set(proxy.records)
        finally:
            proxy.stop()
            sim.stop()
    ungranted = [u for u in sorted(used, key=str) if not any(allows(g, u) for g in grants_made)]
    assert not ungranted, "\n".join(map(str, ungranted))

"""The Helm chart, with the real Helm v4 engine (helm-python-sdk): lint --strict, schema, every
rendered object against the Kubernetes OpenAPI schemas in strict mode, the rendered container
arguments run against the simulator until /readyz is 200, and the chart's RBAC proven least
privilege both ways from the simulator's request log."""

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
    Sim,
    binary,
    container_args,
    local_args,
    objects,
    render,
    tls_etcd,
    workdir,
)

CASES = {
    "defaults": {},
    "hosted": {
        "targetKubeconfig": {"secretName": "target-cluster-kubeconfig"},
        "rbac": {"create": False},
        "config": {
            "endpointReconcilerType": "static",
            "loops": {"apiserverEndpoints": {"staticAddresses": ["10.0.0.10"]}},
        },
    },
    "etcd": {
        "etcd": {"servers": ["https://etcd-0.etcd:2379"], "certificatesSecret": "etcd-client"},
    },
    "metrics": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    },
    "ha-off": {
        "replicaCount": 1,
        "config": {"leaderElection": {"enabled": False}},
    },
}

# The oldest release the chart supports that the validator knows, and the newest it knows.
KUBE_VERSIONS = ["1.33.0", kubernetes_validate.utils.latest_version()]


@pytest.mark.parametrize("case", CASES)
def test_lint_strict_passes(case):
    report = helm.lint(str(CHART), CASES[case], strict=True, namespace="bootstrap")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("case", CASES)
def test_schema_accepts_each_case(case):
    helm.Chart.load(CHART).validate_schema(CASES[case])


def test_schema_lists_every_loop_section_and_field_the_controller_reads():
    """The schema of `config.loops` holds exactly the sections and fields of `config print`, so a
    loop or a field added to the code cannot be refused (or a removed one accepted) by the chart."""
    printed = subprocess.run(
        [binary("bootstrap-controller"), "config", "print"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    loops = yaml.safe_load(printed)["loops"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    sections = schema["properties"]["config"]["properties"]["loops"]["properties"]
    assert sorted(sections) == sorted(loops)
    for key, fields in loops.items():
        assert sorted(sections[key]["properties"]) == sorted(fields), key


@pytest.mark.parametrize(
    "values, complaint",
    [
        ({"replicaCount": "two"}, "/replicaCount"),
        ({"replicas": 2}, "replicas"),
        ({"config": {"securePort": "6443"}}, "/config/securePort"),
        ({"config": {"endpointReconcilerType": "leases"}}, "/config/endpointReconcilerType"),
        ({"config": {"loops": {"nodePortRepair": {"interval": 180}}}}, "interval"),
        ({"config": {"loops": {"nodeportRepair": {}}}}, "nodeportRepair"),
        ({"config": {"leaderElection": {"leaseDuration": "fifteen"}}}, "leaseDuration"),
        ({"etcd": {"servers": ["etcd:2379"]}}, "/etcd/servers"),
        ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "enabled"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ],
)
def test_schema_rejects_wrong_types_and_unknown_keys(values, complaint):
    with pytest.raises(helm.HelmValuesError) as err:
        helm.Chart.load(CHART).validate_schema(values)
    assert complaint in str(err.value)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_objects_are_valid_kubernetes_objects(case, version):
    rendered = objects(CASES[case])
    kinds = [o["kind"] for o in rendered]
    assert "Deployment" in kinds and "ConfigMap" in kinds
    for obj in rendered:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            # A CRD's kind: not in the Kubernetes schemas; its shape is checked below.
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_optional_objects_follow_their_values():
    def kinds(values):
        return sorted(o["kind"] for o in objects(values))

    assert "ServiceMonitor" not in kinds({})
    assert "ServiceMonitor" in kinds(CASES["metrics"])
    assert "PodDisruptionBudget" in kinds({})
    assert "PodDisruptionBudget" not in kinds(CASES["ha-off"])
    assert "ClusterRole" not in kinds(CASES["hosted"])
    assert "Service" not in kinds({"metrics": {"service": {"enabled": False}}})


def test_pod_is_hardened_and_probed():
    deployment = next(o for o in objects({}) if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    security = container["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert deployment["spec"]["replicas"] == 2
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert pod["priorityClassName"] == "system-cluster-critical"


def materialise(values: dict, directory: Path, sim: Sim, etcd=None) -> tuple[list[str], dict]:
    """The Deployment's args, runnable here: the ConfigMap's file written out, the target
    kubeconfig and etcd certificates replaced by local ones."""
    rendered = objects(values)
    args, env = container_args(rendered)
    config_map = next(o for o in rendered if o["kind"] == "ConfigMap")
    config = directory / "config.yaml"
    config.write_text(config_map["data"]["config.yaml"])
    files = {
        "/etc/bootstrap-controller/config.yaml": config,
        "/etc/bootstrap-controller/target/kubeconfig": sim.kubeconfig,
    }
    if etcd is not None:
        url, ca, cert, key = etcd
        files.update({
            "/etc/bootstrap-controller/etcd/ca.crt": ca,
            "/etc/bootstrap-controller/etcd/tls.crt": cert,
            "/etc/bootstrap-controller/etcd/tls.key": key,
        })
        args = [re.sub(r"^--etcd-servers=.*", f"--etcd-servers={url}", a) for a in args]
    return local_args(args, files, sim.kubeconfig), {**env, "POD_NAME": "bc-0"}


@pytest.mark.parametrize("case", CASES)
def test_rendered_arguments_run_until_ready(case):
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            if case == "etcd":
                # A node port in use that etcd's (absent) bitmap does not hold: set over TLS.
                sim.apply({
                    "apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": "np", "namespace": "default"},
                    "spec": {"type": "NodePort",
                             "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30100}]},
                })
                with tls_etcd(tmp) as etcd:
                    args, env = materialise(CASES[case], tmp, sim, etcd)
                    controller = Controller(args, env, tmp, case)
                    try:
                        readyz = controller.wait_ready()
                        deadline = time.monotonic() + 30
                        repaired = 'bootstrap_nodeport_repair_port_errors_total{type="repair"} 1'
                        while repaired not in controller.get("/metrics")[1]:
                            assert time.monotonic() < deadline, controller.output()
                            time.sleep(0.2)
                    finally:
                        assert controller.stop() == 0, controller.output()
            else:
                args, env = materialise(CASES[case], tmp, sim)
                controller = Controller(args, env, tmp, case)
                try:
                    readyz = controller.wait_ready()
                finally:
                    assert controller.stop() == 0, controller.output()
            assert "[+]" in readyz
        finally:
            sim.stop()


# ---------------------------------------------------------------------------------------------
# RBAC, both ways


def group_of(path: str) -> str:
    parts = path.split("/")
    return "" if parts[1] == "api" else parts[2]


def granted(rendered: list[dict]) -> list[tuple[str | None, str, str, str]]:
    """(namespace or None for cluster-wide, group, resource, verb) for every rule."""
    out = []
    for obj in rendered:
        if obj["kind"] not in ("ClusterRole", "Role"):
            continue
        namespace = obj["metadata"].get("namespace") if obj["kind"] == "Role" else None
        for rule in obj["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        out.append((namespace, group, resource, verb))
    return out


RBAC_VALUES = {
    "config": {
        "endpointReconcilerType": "lease",
        "loops": {
            "systemNamespaces": {
                "namespaces": [
                    {"name": "kube-system"},
                    {"name": "kube-public"},
                    {"name": "kube-node-lease"},
                    {"name": "default"},
                    {"name": "platform", "labels": {"example.com/team": "platform"}},
                ]
            },
            "clusterIPRepair": {"orphanGracePeriod": "5s"},
        },
    }
}


def exercise_every_loop(sim: Sim, wait) -> None:
    """Breaks what each loop keeps, so every verb it has is used, waiting for each repair."""
    k = sim.kubectl

    def gone_then_back(*get_args):
        wait(lambda: k(*get_args, check=False).returncode == 0)

    # Namespaces: recreate one, restore a declared label.
    k("delete", "namespace", "kube-public", "--wait=false")
    time.sleep(1.0)
    gone_then_back("get", "namespace", "kube-public")
    k("label", "namespace", "platform", "example.com/team-")
    wait(lambda: "example.com/team" in k("get", "namespace", "platform", "-o", "json").stdout)
    # The kubernetes Service: repaired, and recreated.
    k("patch", "service", "kubernetes", "--type=json",
      "-p", '[{"op":"replace","path":"/spec/ports/0/port","value":8443}]')
    wait(lambda: '"port": 443' in k("get", "service", "kubernetes", "-o", "json").stdout)
    k("delete", "service", "kubernetes")
    gone_then_back("get", "service", "kubernetes")
    # The default ServiceCIDR, recreated (and its status set).
    k("delete", "servicecidr", "kubernetes")
    gone_then_back("get", "servicecidr", "kubernetes")
    # The endpoints: recreated, repaired; a stray slice deleted.
    k("delete", "endpoints", "kubernetes")
    gone_then_back("get", "endpoints", "kubernetes")
    k("patch", "endpoints", "kubernetes", "--type=json",
      "-p", '[{"op":"replace","path":"/subsets/0/ports/0/port","value":1}]')
    wait(lambda: '"port": 6443' in k("get", "endpoints", "kubernetes", "-o", "json").stdout)
    k("patch", "endpointslice", "kubernetes", "--type=json",
      "-p", '[{"op":"replace","path":"/ports/0/port","value":1}]')
    wait(lambda: '"port": 6443' in k("get", "endpointslice", "kubernetes", "-o", "json").stdout)
    sim.apply({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "kubernetes-stray", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "kubernetes"}},
        "addressType": "IPv4", "endpoints": [], "ports": [],
    })
    wait(lambda: k("get", "endpointslice", "kubernetes-stray", check=False).returncode != 0)
    # ClusterIP repair: a lost IPAddress recreated, a leaked one deleted.
    sim.apply({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "default"},
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}]},
    })
    ip = k("get", "service", "web", "-o", "jsonpath={.spec.clusterIP}").stdout
    k("delete", "ipaddress", ip)
    gone_then_back("get", "ipaddress", ip)
    # The leak is deleted only once the Service cache is proven current: make the proof (a
    # LIST of Services with limit=1) fail, so the repair reads the parent Service live instead.
    k("create", "--raw", "/sim/faults", "-f", "-", stdin=json.dumps({
        "verb": "list", "resource": "services",
        "fault": {"type": "error", "code": 500}, "trigger": {"next": 50},
    }))
    sim.apply({
        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
        "metadata": {"name": "10.96.200.200",
                     "labels": {"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                                "ipaddress.kubernetes.io/ip-family": "IPv4"}},
        "spec": {"parentRef": {"group": "", "resource": "services",
                               "namespace": "default", "name": "gone"}},
    })
    wait(lambda: k("get", "ipaddress", "10.96.200.200", check=False).returncode != 0, 60)
    k("delete", "--raw", "/sim/faults")
    # NodePort repair: a duplicate node port reported. The API refuses a duplicate, so the
    # second Service goes in through the simulator's backdoor, as a restored etcd would hold it.
    for name in ("np-a", "np-b"):
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {"type": "NodePort",
                     "ports": [{"port": 80, "protocol": "TCP", "nodePort": 30080}]},
        }
        k("replace", "--raw", "/sim/backdoor", "-f", "-", stdin=json.dumps(service))
    wait(lambda: "PortAlreadyAllocated" in k("get", "events", "-A").stdout)
    # The duplicate clears and comes back: reported again, into the first event's series.
    k("delete", "service", "np-b")
    time.sleep(2)
    k("replace", "--raw", "/sim/backdoor", "-f", "-", stdin=json.dumps(service))
    wait(lambda: any(
        e.get("series", {}).get("count", 1) > 1
        for e in json.loads(k("get", "events.events.k8s.io", "-A", "-o", "json").stdout)["items"]
        if e.get("reason") == "PortAlreadyAllocated"
    ))


def test_rbac_grants_exactly_what_the_controller_uses():
    rendered = objects(RBAC_VALUES)
    grants = granted(rendered)
    with workdir() as tmp:
        tmp = Path(tmp)
        # Without allocation of its own the simulator would hide the ClusterIP repair's
        # creates; with NodePort allocation it would refuse the duplicate, so node ports are
        # written through the backdoor-free path of a plain apply of distinct services first.
        sim = Sim(tmp)
        try:
            args, env = materialise(RBAC_VALUES, tmp, sim)
            controller = Controller(args + ["--advertise-address=10.0.0.1"], env, tmp, "rbac")

            def wait(check, timeout=30):
                deadline = time.monotonic() + timeout
                while not check():
                    assert time.monotonic() < deadline, controller.output()
                    time.sleep(0.2)

            try:
                controller.wait_ready()
                exercise_every_loop(sim, wait)
            finally:
                # The apiserver stops with the controller (its /readyz fails), so SIGTERM
                # withdraws the membership Lease (a controller stopping beside a ready apiserver
                # keeps it) and releases the leader Lease.
                sim.kubectl("create", "--raw", "/sim/ready", "-f", "-", stdin='{"ready": false}')
                assert controller.stop() == 0, controller.output()
            used = set()
            for r in sim.requests():
                if "bootstrap-controller/" not in r["userAgent"] or not r["resource"]:
                    continue
                resource = r["resource"] + (f"/{r['subresource']}" if r["subresource"] else "")
                used.add((r["namespace"] or None, group_of(r["path"]), resource, r["verb"]))
        finally:
            sim.stop()

    def allows(grant, request):
        namespace, group, resource, verb = grant
        return grant[1:] == request[1:] and (namespace is None or namespace == request[0])

    ungranted = sorted((u for u in used if not any(allows(g, u) for g in grants)), key=str)
    unused = sorted((g for g in grants if not any(allows(g, u) for u in used)), key=str)
    assert not ungranted, f"the controller used what the chart does not grant: {ungranted}"
    assert not unused, f"the chart grants what the controller never used: {unused}"


def test_sidecar_rbac_has_the_charts_rules():
    chart_rules = {
        (o["kind"], o["metadata"].get("namespace")): o["rules"]
        for o in objects({"config": {"endpointReconcilerType": "lease"}})
        if o["kind"] in ("ClusterRole", "Role")
    }
    sidecar = Path(CHART).parents[1] / "deploy" / "sidecar" / "rbac.yaml"
    sidecar_rules = {
        (o["kind"], o["metadata"].get("namespace")): o["rules"]
        for o in yaml.safe_load_all(sidecar.read_text())
        if o and o["kind"] in ("ClusterRole", "Role")
    }
    assert sidecar_rules == chart_rules


def test_chart_readme_lists_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    table = "\n".join(line for line in readme.splitlines() if line.startswith("| `"))
    documented = set(re.findall(r"`([A-Za-z][\w.]*)`", table))
    expanded = set()
    for name in documented:
        # `a.b`, `.c` in one cell names a.b and a.c.
        expanded.add(name)
    for line in table.splitlines():
        cell = line.split("|")[1]
        names = re.findall(r"`([\w.]+)`", cell)
        if names and "." in names[0]:
            prefix = names[0].rsplit(".", 1)[0]
            expanded.update(f"{prefix}{n}" for n in names[1:] if n.startswith("."))

    def keys(tree, prefix=""):
        for key, value in tree.items():
            path = f"{prefix}{key}"
            # A map of settings is documented key by key; free-form maps and `config` as a whole.
            if isinstance(value, dict) and value and key not in ("config", "resources"):
                yield from keys(value, path + ".")
            else:
                yield path

    missing = [k for k in keys(values) if k not in expanded]
    assert not missing, f"values.yaml keys missing from the chart README: {missing}"

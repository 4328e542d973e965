"""The Helm chart on the real node, with the real helm CLI (build.sh's, named by HELM in the
node's env): run by e2e/node/test.sh after test_node.py, on the same node, whose sidecars keep
the `kubernetes` Service's endpoints that the chart's pods reach the API through.

The tests run in file order and share one release: installed with `--wait` by the step kind's
script uses too (e2e/steps/install-chart.sh: helm, then `check` in a pod), upgraded, and
uninstalled; then a second release in management mode keeps a tenant control plane
(e2e/node/tenant.sh) through a kubeconfig Secret. Who wrote what is judged from the apiservers'
audit logs, where every request of a pod's service account names the pod
(`authentication.kubernetes.io/pod-name`, from its bound token). Nothing waits for a fixed time
and then asserts: each test polls, counts what it saw, and asserts on that, with generous upper
bounds only against hanging.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from test_node import (Node, audit_events, complete_lines, container, open_node, refusals,
                       sidecars_installed, wait_for)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CHART = ROOT / "charts" / "bootstrap-controller"
CHART_README = CHART / "README.md"
INSTALL_CHART = ROOT / "e2e" / "steps" / "install-chart.sh"

RELEASE = "bc"
NAMESPACE = "bc-chart"
FULLNAME = "bc-bootstrap-controller"
SERVICE_ACCOUNT = f"system:serviceaccount:{NAMESPACE}:{FULLNAME}"
# Beside the sidecars, whose leader holds kube-system/bootstrap-controller and runs their
# endpoints loop: the chart's replicas elect their leader on a Lease of their own (chart README,
# "Beside the sidecar").
LEASE = "bootstrap-controller-chart"
LEASE_ARGS = ["--set", f"config.leaderElection.leaseName={LEASE}"]
# A namespace only the chart keeps (the upgrade declares it, with a label): its repairs are the
# chart leader's alone, whatever the sidecars do.
KEPT = "bc-chart-kept"
KEPT_LABEL = "e2e.bootstrap-controller.io/kept"
WRITES = {"create", "update", "patch", "delete", "deletecollection"}
SIDECAR_USER = "system:bootstrap-controller"
# How long a deleted namespace may take to come back, finalization included: a bound on
# correctness, not on speed. kube-apiserver recreates kube-node-lease itself once a minute, so a
# wait of a minute or more could be met by its in-tree loop alone; well under it, with the
# successful create read from the audit log and the repair counter moved, the repair is ours.
BACK_WITHIN = 30

MANAGEMENT_RELEASE = "bc-mgmt"
MANAGEMENT_NAMESPACE = "bc-mgmt"
TENANT_SECRETS = "tenant-secrets"
TENANT_SECRET = "tenant-1-kubeconfig"
TENANT_SELECTOR = "e2e.bootstrap-controller.io/tenant=true"
TENANT_USER = "bootstrap-controller-tenant"


@pytest.fixture(scope="module")
def node() -> Node:
    result = open_node()
    sidecars_installed(result)
    return result


def helm_binary() -> str:
    """build.sh's helm, named in the node's env by up.sh (HELM in the environment wins)."""
    helm = os.environ.get("HELM") or open_node().env.get("HELM")
    if not helm or not Path(helm).is_file():
        pytest.fail(f"no helm binary at {helm!r}: e2e/node/build.sh builds it, up.sh names it in DIR/env")
    return helm


def image(node: Node) -> tuple[str, str]:
    repository, _, tag = node.image.rpartition(":")
    return repository, tag


def install_chart(node: Node, *args: str, drifting: str | None = None) -> subprocess.CompletedProcess:
    """The shared step: helm upgrade --install --wait, then `check` in a pod of the release.
    `drifting`: an object the test keeps breaking meanwhile, whose drift (and only its) `check`
    may report (exit 1)."""
    repository, tag = image(node)
    env = {**os.environ, "KUBECONFIG": str(node.kubeconfig), "HELM": helm_binary()}
    result = subprocess.run([str(INSTALL_CHART), RELEASE, NAMESPACE, repository, tag, *LEASE_ARGS, *args],
                            capture_output=True, text=True, env=env, timeout=600)
    findings = [line for line in result.stdout.splitlines() if line.startswith("  - ")]
    expected_drift = (drifting is not None and result.returncode == 1 and findings
                      and all(line.startswith(f"  - {drifting} ") for line in findings))
    assert result.returncode == 0 or expected_drift, \
        f"install-chart.sh: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def helm(node: Node, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), "--kubeconfig", str(node.kubeconfig), *args],
                          capture_output=True, text=True, check=check, timeout=600)


def get_json(node: Node, *args: str, kubeconfig: Path | None = None) -> dict | None:
    result = subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig or node.kubeconfig), "get", *args,
                             "-o", "json"], capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        if "NotFound" in result.stderr:
            return None
        raise AssertionError(result.stderr)
    return json.loads(result.stdout)


def release_pods(node: Node, release: str = RELEASE, namespace: str = NAMESPACE) -> list[dict]:
    body = get_json(node, "-n", namespace, "pods", "-l", f"app.kubernetes.io/instance={release}")
    return body["items"]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def lease_holder(node: Node, namespace: str = "kube-system", name: str = LEASE) -> str | None:
    lease = get_json(node, "-n", namespace, "lease", name)
    return (lease or {}).get("spec", {}).get("holderIdentity")


def pod_of(event: dict) -> str | None:
    """The pod a request of a service account came from, from its bound token."""
    names = event.get("user", {}).get("extra", {}).get("authentication.kubernetes.io/pod-name") or []
    return names[0] if names else None


def writes(events: list[dict], since: str = "") -> list[dict]:
    """The writes among `events` received at or after `since` (an audit timestamp), Leases
    (leader election, membership) left out."""
    return [e for e in events if e["verb"] in WRITES and e["requestReceivedTimestamp"] >= since
            and e.get("objectRef", {}).get("resource") != "leases"]


def writer_runs(events: list[dict], who) -> list[tuple[str, int]]:
    """`events` (oldest first) as runs of one writer: [(writer, number of writes in a row)]."""
    runs: list[tuple[str, int]] = []
    for event in events:
        writer = who(event)
        if runs and runs[-1][0] == writer:
            runs[-1] = (writer, runs[-1][1] + 1)
        else:
            runs.append((writer, 1))
    return runs


def assert_one_writer_at_a_time(runs: list[tuple[str, int]]) -> None:
    """Each writer's writes are one run: none wrote again once another had written."""
    seen = [writer for writer, _ in runs]
    again = sorted({w for w in seen if seen.count(w) > 1})
    assert not again, f"writes interleaved between writers ({again} wrote, stopped, wrote again): {runs}"


def namespace_creators(node: Node, name: str, since: str, logs: str = "audit*.log") -> list[str]:
    """The users whose create of namespace `name` succeeded (201) at or after `since`, from the
    audit logs matching `logs`, oldest first."""
    audit = node.dir / "var-log-kubernetes" / "audit"
    creates = []
    for path in sorted(audit.glob(logs)):
        for line in complete_lines(path):
            event = json.loads(line)
            if (event.get("stage") == "ResponseComplete" and event["verb"] == "create"
                    and event.get("objectRef", {}).get("resource") == "namespaces"
                    and event.get("objectRef", {}).get("name") == name
                    and event.get("responseStatus", {}).get("code") == 201
                    and event["requestReceivedTimestamp"] >= since):
                creates.append((event["requestReceivedTimestamp"], event["user"]["username"]))
    return [user for _, user in sorted(creates)]


def managers(namespace: dict) -> set[str]:
    """The field managers of an object read with `--show-managed-fields` (kubectl leaves them out
    otherwise): `bootstrap-controller` for ours, `kube-apiserver` for the apiserver's own loops."""
    return {entry.get("manager") for entry in namespace["metadata"].get("managedFields", [])}


def namespace_repairs(node: Node, release: str, namespace: str) -> int:
    """The system-namespaces loop's repairs of missing namespaces, summed over the release's pods
    (and tenants), from their /metrics read on the node (pods are not routed to from the host):
    the repair counter, which a dry run or a refused create leaves alone."""
    total = 0
    for pod in release_pods(node, release, namespace):
        result = node.on_node("curl", "-s", "--max-time", "3", f"http://{pod['status']['podIP']}:8080/metrics")
        for line in result.stdout.splitlines():
            if (line.startswith("bootstrap_loop_drift_repaired_total{") and 'loop="system-namespaces"' in line
                    and 'kind="namespace_missing"' in line):
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def audit_now() -> str:
    """An audit timestamp for now, to the microsecond as the audit log writes them (the node shares
    the host's clock). Not truncated to the second: a create that landed earlier in the same
    second (the last round's repair) would then count as one made after it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


state: dict = {}


@pytest.fixture(scope="module")
def release(node: Node) -> dict:
    """The release, installed once with the chart's defaults apart from the image (the node's,
    never pulled) and the leader Lease's name."""
    state["installed_at"] = audit_now()
    result = install_chart(node)
    state["install_output"] = result.stdout + result.stderr
    return state


def test_helm_install_wait_runs_ready_pods_one_leader_and_a_clean_check(node, release):
    # install-chart.sh exited 0: helm's --wait saw the Deployment available, and `check` run in
    # a pod with the controller's own settings (its environment) found no drift.
    assert "Result: no drift (exit 0)" in release["install_output"], release["install_output"]
    pods = release_pods(node)
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    assert all(ready(p) for p in pods), [(p["metadata"]["name"], p["status"].get("conditions")) for p in pods]
    assert all(p["spec"].get("hostNetwork") is not True and p["status"]["podIP"].startswith("198.18.64.")
               for p in pods), "the chart's pods are ordinary pods, reaching the API through the Service"
    names = [p["metadata"]["name"] for p in pods]

    # One leader: the Lease's holder is one of the pods (identity: pod name, `_`, a suffix).
    holder = wait_for("the chart's leader Lease held", lambda: lease_holder(node), timeout=120)
    leaders = [n for n in names if holder.startswith(f"{n}_")]
    assert len(leaders) == 1, (holder, names)
    leader = leaders[0]
    # The sidecars keep leading theirs (and with it the endpoints loop the chart does not run).
    sidecar_holder = lease_holder(node, name="bootstrap-controller")
    assert sidecar_holder and sidecar_holder.startswith(node.name), sidecar_holder

    # A deleted system namespace comes back. The sidecars' leader repairs it too: both send a
    # create at once and one gets 409. Each round counts whether the chart's leader sent one, and
    # checks that the create that succeeded was ours (the chart's or the sidecars'), not
    # kube-apiserver's own loop's.
    chart_creates = []
    for round_ in range(5):
        before = get_json(node, "namespace", "kube-node-lease")["metadata"]["uid"]
        since = audit_now()
        node.kubectl("delete", "namespace", "kube-node-lease", "--wait=false")

        def back():
            ns = get_json(node, "namespace", "kube-node-lease", "--show-managed-fields")
            return ns and ns["metadata"]["uid"] != before and ns["status"]["phase"] == "Active" and ns
        recreated = wait_for("kube-node-lease back", back, timeout=BACK_WITHIN)
        creators = namespace_creators(node, "kube-node-lease", since)
        assert len(creators) == 1 and creators[0] in (SERVICE_ACCOUNT, SIDECAR_USER), \
            f"kube-node-lease should be recreated once, by the chart or the sidecars: created by {creators}"
        assert "bootstrap-controller" in managers(recreated) and "kube-apiserver" not in managers(recreated), \
            managers(recreated)
        created = [e for e in writes(audit_events(node, SERVICE_ACCOUNT), since)
                   if e["verb"] == "create" and e["objectRef"].get("resource") == "namespaces"
                   and e["objectRef"].get("name") == "kube-node-lease"]
        chart_creates.append([(pod_of(e), e["responseStatus"]["code"]) for e in created])
        if created:
            break
    assert any(chart_creates), f"the chart's leader never sent a create of kube-node-lease: {chart_creates}"

    # Only the leader writes: every write of the release's service account since the install.
    events = writes(audit_events(node, SERVICE_ACCOUNT), release["installed_at"])
    writers = {pod_of(e) for e in events}
    assert writers == {leader}, f"writes from {writers}, the leader is {leader}"
    assert lease_holder(node) == holder, "the leadership moved during the test"
    print(f"leader {leader}; its creates of kube-node-lease per round: {chart_creates}; "
          f"{len(events)} writes, all the leader's")


# The chart README's permissions table: rows of | API group | resource | namespace | names | verbs | rendered |.
def documented_grants(lease_name: str) -> list[tuple[str, str, str, str, str]]:
    """What the chart README says the defaults grant: (namespace or `*`, API group, resource,
    name or `*`, verb), from the rows rendered with the defaults."""
    text = CHART_README.read_text()
    section = text.split("## Permissions", 1)[1].split("\n## ", 1)[0]
    grants = []
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]
    assert rows, "the chart README's Permissions section has no table"
    for row in rows:
        group, resource, namespace, names, verbs, rendered = [c.strip() for c in row.strip("|").split("|")]
        if not rendered.startswith(("always", "by default")):
            continue
        group = "" if group == "core" else group.strip("`")
        resource = resource.strip("`")
        namespace = "*" if namespace.startswith("all") else re.match(r"`([^`]+)`", namespace).group(1)
        name = lease_name if "leaseName" in names else "*"
        assert names.startswith("any") or "leaseName" in names, names
        for verb in verbs.split(","):
            grants.append((namespace, group, resource, name, verb.strip()))
    return grants


def rules_review(node: Node, user: str, namespace: str) -> set[tuple[str, str, str, str]]:
    """What `user` may do in `namespace` (cluster-wide rules included), as kube-apiserver's RBAC
    says (a SelfSubjectRulesReview, what `kubectl auth can-i --list` shows): (group, resource,
    name or `*`, verb)."""
    review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectRulesReview",
              "spec": {"namespace": namespace}}
    result = node.kubectl("create", "--validate=false", f"--as={user}", "-f", "-", "-o", "json",
                          input=json.dumps(review))
    status = json.loads(result.stdout)["status"]
    assert not status.get("incomplete"), status
    grants = set()
    for rule in status.get("resourceRules", []):
        for group in rule.get("apiGroups", []):
            for resource in rule.get("resources", []):
                for name in rule.get("resourceNames") or ["*"]:
                    for verb in rule["verbs"]:
                        grants.add((group, resource, name, verb))
    return grants


def test_the_chart_rbac_grants_exactly_the_documented_permissions(node, release):
    documented = documented_grants(LEASE)
    # What every authenticated user may do (self reviews, discovery) is not the chart's grant.
    nobody = f"system:serviceaccount:{NAMESPACE}:nobody"
    mismatches = {}
    for namespace in ("default", "kube-system", NAMESPACE, "kube-public"):
        granted = rules_review(node, SERVICE_ACCOUNT, namespace) - rules_review(node, nobody, namespace)
        expected = {(g, r, n, v) for ns, g, r, n, v in documented if ns in ("*", namespace)}
        undocumented, missing = granted - expected, expected - granted
        if undocumented or missing:
            mismatches[namespace] = {"granted, not documented": sorted(undocumented),
                                     "documented, not granted": sorted(missing)}
    assert not mismatches, json.dumps(mismatches, indent=1)
    print(f"{len(documented)} documented grants, each as RBAC says, nothing more")


def container_process(node: Node, container_id: str) -> int:
    """The host pid of a container's process, as the node's containerd reports it."""
    result = node.on_node("ctr", "--address", "/run/containerd/containerd.sock", "-n", "k8s.io", "tasks", "ls")
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == container_id:
            return int(fields[1])
    raise AssertionError(f"no task {container_id} in containerd: {result.stdout}")


def test_the_chart_pods_run_hardened_as_rendered(node, release):
    rendered = yaml.safe_load((CHART / "values.yaml").read_text())["containerSecurityContext"]
    pods = release_pods(node)
    assert pods
    for pod in pods:
        name = pod["metadata"]["name"]
        assert ready(pod), name
        security = pod["spec"]["containers"][0]["securityContext"]
        assert security["runAsNonRoot"] is True and security["readOnlyRootFilesystem"] is True, security
        assert security["capabilities"]["drop"] == ["ALL"] and security["allowPrivilegeEscalation"] is False
        assert security["runAsUser"] == rendered["runAsUser"] == 65532, security
        # The process itself, read on the host: the kernel's view, not the spec's.
        status = pod["status"]["containerStatuses"][0]
        pid = container_process(node, status["containerID"].removeprefix("containerd://"))
        proc = Path(f"/proc/{pid}")
        assert (proc / "cmdline").read_bytes().split(b"\0")[:2] == [b"/bootstrap-controller", b"run"]
        fields = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines())
        uid = rendered["runAsUser"]
        assert fields["Uid"].split() == [str(uid)] * 4, fields["Uid"]
        assert fields["Gid"].split() == [str(rendered["runAsGroup"])] * 4, fields["Gid"]
        for capabilities in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert int(fields[capabilities], 16) == 0, (capabilities, fields[capabilities])
        assert fields["NoNewPrivs"].strip() == "1", fields["NoNewPrivs"]
        assert fields["Seccomp"].strip() == "2", "not under a seccomp filter (RuntimeDefault)"
        root = [line.split() for line in (proc / "mountinfo").read_text().splitlines() if line.split()[4] == "/"]
        assert root and all("ro" in mount[5].split(",") for mount in root), root
        print(f"{name}: pid {pid} uid {uid}, no capabilities, no new privileges, seccomp, / read-only, Ready")


def rolled(node: Node, old: set[str]) -> set[str]:
    """The release's pods once the rollout replaced every pod of `old` (helm's --wait returns
    when the new ones are available; the old ones may still be stopping), two of them Ready."""
    def new_pods():
        pods = release_pods(node)
        names = {p["metadata"]["name"] for p in pods}
        return not names & old and len(pods) == 2 and all(ready(p) for p in pods) and names
    return wait_for("the old pods replaced by two Ready new ones", new_pods, timeout=180)


KEEP_VALUES = {
    "config": {"loops": {"systemNamespaces": {"namespaces": [
        {"name": "kube-system"}, {"name": "kube-public"}, {"name": "kube-node-lease"}, {"name": "default"},
        {"name": KEPT, "labels": {KEPT_LABEL: "true"}},
    ]}}},
}


def test_helm_upgrade_rolls_the_pods_with_one_writer_at_a_time(node, release, tmp_path):
    values = tmp_path / "keep.yaml"
    values.write_text(yaml.safe_dump(KEEP_VALUES))
    first = {p["metadata"]["name"] for p in release_pods(node)}
    # A changed configuration (one more namespace to keep) rolls the pods; the new leader makes it.
    install_chart(node, "-f", str(values))

    def kept_label():
        ns = get_json(node, "namespace", KEPT)
        return ns and ns["metadata"].get("labels", {}).get(KEPT_LABEL) == "true"
    wait_for(f"{KEPT} made by the chart with its label", kept_label, timeout=120)
    second = rolled(node, first)

    # Drift only the chart repairs, made all through the next rollout: the label stripped as soon
    # as it is back. Each repair is a patch of the leader of the moment.
    stop = threading.Event()
    stripped = []

    def strip():
        while not stop.is_set():
            if kept_label():
                node.kubectl("label", "namespace", KEPT, f"{KEPT_LABEL}-", check=False)
                stripped.append(time.monotonic())
            stop.wait(0.3)
    stripper = threading.Thread(target=strip, daemon=True)
    since = audit_now()
    stripper.start()
    try:
        # The logging filter changes the pods' environment: another rollout.
        # `check` after the rollout may catch the label stripped (and only that).
        install_chart(node, "-f", str(values), "--set", "logLevel=debug", drifting=f"Namespace/{KEPT}")
        third = rolled(node, second)
        holder = wait_for("the chart's leader Lease held by a new pod",
                          lambda: (h := lease_holder(node)) and any(h.startswith(f"{p}_") for p in third) and h,
                          timeout=120)
        leader = holder.rsplit("_", 1)[0]

        def new_leader_repaired():
            patches = [e for e in writes(audit_events(node, SERVICE_ACCOUNT), since)
                       if e["verb"] == "patch" and pod_of(e) == leader]
            return len(patches) >= 3
        wait_for(f"the new leader {leader} repairing the label", new_leader_repaired, timeout=180)
    finally:
        stop.set()
        stripper.join(timeout=30)

    events = writes(audit_events(node, SERVICE_ACCOUNT), release["installed_at"])
    runs = writer_runs(events, pod_of)
    assert_one_writer_at_a_time(runs)
    during = writer_runs(writes(events, since), pod_of)
    assert {w for w, _ in during} & second, f"no old pod repaired the label before the rollout: {during}"
    assert runs[-1][0] == leader, f"the last writer is not the leader {leader}: {runs}"
    assert all(w in first | second | third for w, _ in runs), runs
    print(f"label stripped {len(stripped)} times; writers in order (pod, writes in a row): {runs}")


def test_the_chart_rbac_is_enough_for_what_it_did(node, release):
    # Everything the release did since its install (the deletions, the upgrades, the repairs).
    events = [e for e in audit_events(node, SERVICE_ACCOUNT) if e["requestReceivedTimestamp"] >= release["installed_at"]]
    transient, refused = refusals(events)
    assert len(events) >= 50, f"only {len(events)} requests of {SERVICE_ACCOUNT}"
    assert not refused, refused
    print(f"{len(events)} requests of {SERVICE_ACCOUNT}; refused and allowed later: {transient}")


def everything(node: Node) -> list[dict]:
    """Every object of every resource the API lists, as (resource, namespace, name, labels)."""
    resources = node.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    objects = []
    for resource in resources:
        body = get_json(node, resource, "-A")
        for item in (body or {}).get("items", []):
            meta = item["metadata"]
            objects.append({"resource": resource, "namespace": meta.get("namespace"), "name": meta["name"],
                            "labels": meta.get("labels") or {}})
    return objects


def uninstall_rows() -> str:
    text = CHART_README.read_text()
    return text.split("## Uninstalling", 1)[1].split("\n## ", 1)[0]


def test_helm_uninstall_leaves_only_what_the_chart_readme_lists(node, release):
    ours = lambda o: (o["labels"].get("app.kubernetes.io/instance") == RELEASE  # noqa: E731
                      or FULLNAME in o["name"] or LEASE in o["name"] or o["namespace"] == NAMESPACE
                      or (o["resource"] == "namespaces" and o["name"] == NAMESPACE))
    labelled = [o for o in everything(node) if o["labels"].get("app.kubernetes.io/instance") == RELEASE]
    kinds = {o["resource"] for o in labelled}
    # The label finds what the chart rendered (so that finding none afterwards means something).
    assert {"deployments.apps", "configmaps", "serviceaccounts", "services", "clusterroles.rbac.authorization.k8s.io",
            "roles.rbac.authorization.k8s.io", "poddisruptionbudgets.policy"} <= kinds, kinds
    made = [e for e in audit_events(node, SERVICE_ACCOUNT)
            if e["verb"] == "create" and e.get("responseStatus", {}).get("code") == 201]

    helm(node, "uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout", "300s")
    wait_for("the release's pods gone",
             lambda: not release_pods(node), timeout=180)

    text = uninstall_rows()
    rows = {
        # Helm never deletes a namespace; what Kubernetes puts in every namespace stays with it.
        "namespace": lambda o: (o["resource"] == "namespaces" and o["name"] == NAMESPACE) or (
            o["namespace"] == NAMESPACE and (o["resource"], o["name"]) in
            {("serviceaccounts", "default"), ("configmaps", "kube-root-ca.crt")}),
        "leader-election Lease": lambda o: (o["resource"] == "leases.coordination.k8s.io"
                                            and (o["namespace"], o["name"]) == ("kube-system", LEASE)),
        "events": lambda o: o["resource"] in ("events", "events.events.k8s.io"),
        "what the loops keep": lambda o: o["resource"] in ("namespaces", "services", "ipaddresses.networking.k8s.io",
                                                           "servicecidrs.networking.k8s.io", "endpoints",
                                                           "endpointslices.discovery.k8s.io"),
    }
    for row in rows:
        assert row in text, f"the chart README's Uninstalling section has no row for {row}"
    left = [o for o in everything(node) if ours(o)]
    # And what the controller made (the audit log's 201s) that is still there.
    for event in made:
        ref = event["objectRef"]
        resource = ref["resource"] + (f".{ref['apiGroup']}" if ref.get("apiGroup") else "")
        args = [resource, ref["name"]] + (["-n", ref["namespace"]] if ref.get("namespace") else [])
        if ref.get("name") and get_json(node, *args):
            left.append({"resource": resource, "namespace": ref.get("namespace"), "name": ref["name"], "labels": {}})
    unexplained, explained = [], {}
    unique = {(o["resource"], o["namespace"], o["name"]): o for o in left}
    for o in unique.values():
        if o["labels"].get("app.kubernetes.io/instance") == RELEASE:
            unexplained.append(o)
            continue
        matched = [row for row, covers in rows.items() if covers(o)]
        if not matched:
            unexplained.append(o)
        else:
            explained.setdefault(matched[0], []).append(f"{o['resource']} {o['namespace'] or ''}/{o['name']}")
    assert not unexplained, f"left by the release and not in the chart README: {unexplained}"
    assert "leader-election Lease" in explained and "namespace" in explained, explained
    for row, objects in explained.items():
        print(f"left, {row}: {len(objects)}" + ("" if row == "events" else f" {objects}"))


# Management mode: the tenant's values are its merged configuration (chart README).
TENANT_FRAGMENT = """endpointReconcilerType: static
loops:
  apiserverEndpoints:
    staticAddresses: [{ip}]
"""


def tenant_kubectl(node: Node, *args: str, check: bool = True, input: str | None = None):
    return subprocess.run(["kubectl", "--kubeconfig", str(node.dir / "tenant-admin.kubeconfig"), *args],
                          capture_output=True, text=True, check=check, input=input, timeout=120)


def test_management_mode_from_the_chart_keeps_a_tenant_control_plane(node, tmp_path):
    if not (node.dir / "tenant-admin.kubeconfig").exists():
        subprocess.run([str(HERE / "tenant.sh"), str(node.dir)], check=True, timeout=600)
    env = dict(line.split("=", 1) for line in (node.dir / "env").read_text().splitlines() if "=" in line)
    tenant_ip = env["TENANT_IP"]
    tenant_kubeconfig = node.dir / "tenant-admin.kubeconfig"

    # The loops' RBAC in the tenant, for the Secret's identity, rendered as the chart README says.
    tenant_values = tmp_path / "tenant.yaml"
    tenant_values.write_text(yaml.safe_dump({
        "replicaCount": 1,
        "config": {"leaderElection": {"enabled": False}, **yaml.safe_load(TENANT_FRAGMENT.format(ip=tenant_ip))},
        "rbac": {"subjects": [{"kind": "User", "name": TENANT_USER}]},
    }))
    rbac = helm(node, "template", MANAGEMENT_RELEASE, str(CHART), "-f", str(tenant_values), "--set", "tenants.enabled=false",
                "--show-only", "templates/rbac.yaml").stdout
    tenant_kubectl(node, "apply", "-f", "-", input=rbac)

    # The tenant Secret, as Cluster API writes one (kubeconfig under `value`), with its settings.
    node.kubectl("create", "namespace", TENANT_SECRETS, check=False)
    secret = {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": TENANT_SECRET, "namespace": TENANT_SECRETS,
                     "labels": {TENANT_SELECTOR.split("=")[0]: "true"},
                     "annotations": {"bootstrap-controller.io/config": TENANT_FRAGMENT.format(ip=tenant_ip)}},
        "stringData": {"value": (node.dir / "tenant-controller.kubeconfig").read_text()},
    }
    node.kubectl("apply", "-f", "-", input=json.dumps(secret))
    since = audit_now()
    repository, tag = image(node)
    # Not install-chart.sh: `check` works on one cluster and refuses management mode.
    helm(node, "upgrade", "--install", MANAGEMENT_RELEASE, str(CHART), "--namespace", MANAGEMENT_NAMESPACE,
         "--create-namespace", "--set", f"image.repository={repository}", "--set", f"image.tag={tag}",
         "--set", "image.pullPolicy=Never", "--set", "tenants.enabled=true",
         "--set", f"tenants.secretSelector={TENANT_SELECTOR}", "--set", f"tenants.namespace={TENANT_SECRETS}",
         "--wait", "--timeout", "300s")
    pods = release_pods(node, MANAGEMENT_RELEASE, MANAGEMENT_NAMESPACE)
    assert len(pods) == 2 and all(ready(p) for p in pods), [p["metadata"]["name"] for p in pods]

    # The tenant's `kubernetes` endpoints list its apiserver (static mode, from the annotation).
    def endpoints():
        slice_ = get_json(node, "-n", "default", "endpointslice", "kubernetes", kubeconfig=tenant_kubeconfig)
        legacy = get_json(node, "-n", "default", "endpoints", "kubernetes", kubeconfig=tenant_kubeconfig)
        if not slice_ or not legacy:
            return None
        addresses = sorted(a for e in slice_.get("endpoints") or [] for a in e["addresses"])
        legacy_addresses = sorted(a["ip"] for s in legacy.get("subsets") or [] for a in s.get("addresses", []))
        ports = [p["port"] for p in slice_.get("ports") or []]
        return (addresses, legacy_addresses, ports) if addresses == legacy_addresses == [tenant_ip] else None
    listed = wait_for("the tenant's kubernetes endpoints listing its apiserver", endpoints, timeout=120)
    assert listed[2] == [6443], listed

    # A deleted namespace of the tenant comes back, made by the management release: the tenant's
    # audit log names its identity for the one create that succeeded (not the tenant apiserver's
    # own loop), the new namespace carries its field manager, and its repair counter moved.
    before = json.loads(tenant_kubectl(node, "get", "namespace", "kube-node-lease", "-o", "json").stdout)["metadata"]["uid"]
    repairs = namespace_repairs(node, MANAGEMENT_RELEASE, MANAGEMENT_NAMESPACE)
    deleted_at = audit_now()
    tenant_kubectl(node, "delete", "namespace", "kube-node-lease", "--wait=false")

    def back():
        result = tenant_kubectl(node, "get", "namespace", "kube-node-lease", "-o", "json", "--show-managed-fields",
                                check=False)
        if result.returncode != 0:
            return None
        ns = json.loads(result.stdout)
        return ns["metadata"]["uid"] != before and ns["status"]["phase"] == "Active" and ns
    recreated = wait_for("the tenant's kube-node-lease back", back, timeout=BACK_WITHIN)
    creators = namespace_creators(node, "kube-node-lease", deleted_at, "tenant-audit.log")
    assert creators == [TENANT_USER], f"the tenant's kube-node-lease should be recreated once, by {TENANT_USER}: {creators}"
    assert "bootstrap-controller" in managers(recreated) and "kube-apiserver" not in managers(recreated), \
        managers(recreated)
    wait_for("the tenant's repair counted", lambda: namespace_repairs(node, MANAGEMENT_RELEASE, MANAGEMENT_NAMESPACE) > repairs,
             timeout=BACK_WITHIN)

    # What /readyz?verbose says about the tenant, from inside the node (pods are not routed to
    # from the host).
    def tenant_ok():
        for pod in release_pods(node, MANAGEMENT_RELEASE, MANAGEMENT_NAMESPACE):
            result = node.on_node("curl", "-s", "--max-time", "3", f"http://{pod['status']['podIP']}:8080/readyz?verbose")
            if f"[+]tenant {TENANT_SECRETS}/{TENANT_SECRET}" in result.stdout:
                return result.stdout
        return None
    wait_for("a replica reporting the tenant ok in /readyz?verbose", tenant_ok, timeout=60)

    # The tenant's audit log: its writes came from the management release's pods, one replica
    # at a time, and its RBAC was enough.
    pod_ips = {p["status"]["podIP"]: p["metadata"]["name"] for p in pods}
    events = audit_events(node, TENANT_USER, "tenant-audit.log")
    tenant_writes = writes(events, since)
    assert tenant_writes, "no write of the tenant's identity in its audit log"
    assert all(e["sourceIPs"][0] in pod_ips for e in tenant_writes), {e["sourceIPs"][0] for e in tenant_writes}
    runs = writer_runs(tenant_writes, lambda e: pod_ips[e["sourceIPs"][0]])
    assert_one_writer_at_a_time(runs)
    transient, refused = refusals(events)
    assert not refused, refused
    print(f"tenant endpoints {listed}; tenant writes by replica in order: {runs}; refused and allowed later: {transient}")

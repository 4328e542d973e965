"""The kind script (e2e/kind/up.sh, the functions in lib.sh and the shared sidecar steps of
e2e/steps/sidecar.sh), every step short of kind itself: the whole script run with stand-ins for
kind, kubectl, helm, cargo, the container engine and e2e/steps/install-chart.sh that record each
call (the order of the steps, what each is given), the kind configuration's kubeadm patch judged
by kind's own patch rules for every kind release and node image the script supports, and the
functions alone. kind itself runs in e2e/kind/test.sh, which needs root and podman."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from harness import ROOT, binary, workdir

KIND = ROOT / "e2e" / "kind"

# One program standing in for each command: records its name, arguments (and what it was given
# on stdin or as a file) in $FAKE_DIR/calls.jsonl, and answers as a kind cluster would.
FAKE = r'''#!/usr/bin/env python3
import json, os, shutil, sys
name = os.path.basename(sys.argv[0]); args = sys.argv[1:]
state = os.environ["FAKE_DIR"]
call = {"cmd": name, "args": args}
if name == "cargo":
    call["env"] = {k: v for k, v in os.environ.items() if k.startswith("BOOTSTRAP_E2E_")}
def out(text): sys.stdout.write(text)
if name == "cargo" and args[:1] == ["test"]:
    # The suite as it runs against a cluster: what expected-skips.txt lists, recorded where
    # BOOTSTRAP_E2E_SKIP_LOG says, one test file run against the cluster, and FAKE_EXTRA_SKIP.
    # Only the files named by --test run, as cargo does.
    named = {args[i + 1] for i, a in enumerate(args[:-1]) if a == "--test"}
    with open(os.environ["BOOTSTRAP_E2E_SKIP_LOG"], "a") as record:
        for line in open(os.environ["FAKE_EXPECTED_SKIPS"]).read().splitlines():
            if not line or line.startswith("#"):
                continue
            if line.startswith("unless-root "):
                if os.geteuid() == 0:
                    continue
                line = line[len("unless-root "):]
            if line.startswith("without-ipaddress-api "):
                continue
            # No audit log beside kind's kubeconfig: what needs one skips.
            line = line.removeprefix("without-audit-log ")
            if named and line.split()[1].split("::")[0] not in named:
                continue
            if line.startswith("NOCLUSTER "):
                out("     Running tests/%s.rs (target/debug/deps/x)\n" % line.split()[1])
            else:
                record.write(line + "\n")
        out("     Running tests/system_namespaces.rs (target/debug/deps/x)\n")
        record.write("CLUSTER system_namespaces::t: runs against the given cluster\n")
        record.write(os.environ.get("FAKE_EXTRA_SKIP", ""))
if name == "kind" and args[:2] == ["create", "cluster"]:
    shutil.copy(args[args.index("--config") + 1], os.path.join(state, "kind.yaml"))
    open(args[args.index("--kubeconfig") + 1], "w").write("apiVersion: v1\nkind: Config\n")
elif name in ("docker", "podman") and args[:1] == ["exec"]:
    call["stdin"] = sys.stdin.read()
    if "-c" in args:  # the manifest, written into /etc/kubernetes/manifests
        open(os.path.join(state, "sidecar.yaml"), "w").write(call["stdin"])
    elif args[-2:] == ["cat", "/etc/kubernetes/manifests/kube-apiserver.yaml"]:
        out(open(os.environ["FAKE_APISERVER_MANIFEST"]).read())
elif name == "kubectl" and "component=kube-apiserver" in args:
    out(os.environ["FAKE_APISERVER_COMMAND"])
elif name == "kubectl" and args[2:4] == ["get", "pod"]:
    # The mirror pod appears only after FAKE_MIRROR_DELAY lookups.
    counter = os.path.join(state, "mirror-lookups")
    seen = int(open(counter).read()) if os.path.exists(counter) else 0
    open(counter, "w").write(str(seen + 1))
    if seen < int(os.environ.get("FAKE_MIRROR_DELAY", "0")):
        with open(os.path.join(state, "calls.jsonl"), "a") as log:
            log.write(json.dumps({**call, "failed": True}) + "\n")
        sys.stderr.write('Error from server (NotFound): pods "%s" not found\n' % args[4])
        sys.exit(1)
elif name == "kubectl" and (args[:2] == ["get", "node"] or args[2:4] == ["get", "endpointslice"]):
    out(os.environ["FAKE_NODE_IP"])
elif name == "kubectl" and "--show-managed-fields" in args:
    out(os.environ.get("FAKE_NAMESPACE_MANAGERS", "kube-apiserver bootstrap-controller"))
with open(os.path.join(state, "calls.jsonl"), "a") as log:
    log.write(json.dumps(call) + "\n")
'''

# kube-apiserver's command as kind starts it with lib.sh's configuration.
APISERVER_WITH_FLAG = (
    '["kube-apiserver","--advertise-address=192.0.2.10","--endpoint-reconciler-type=none",'
    '"--secure-port=6443","--service-cluster-ip-range=198.18.160.0/20"]\n'
)
APISERVER_WITHOUT_FLAG = (
    '["kube-apiserver","--advertise-address=192.0.2.10","--secure-port=6443",'
    '"--service-cluster-ip-range=198.18.160.0/20"]\n'
)
SIDECAR_EXAMPLE = (ROOT / "deploy" / "sidecar" / "bootstrap-controller.yaml").read_text()
# kubeadm's kube-apiserver manifest (advertise address 192.0.2.1, services 10.96.0.0/12).
KUBEADM_APISERVER = (ROOT / "testdata" / "kubeadm" / "kube-apiserver.yaml").read_text()


def node_apiserver(service_range: str = "198.18.160.0/20") -> str:
    """kube-apiserver's manifest on kind's node: kubeadm's, with the node's address, the
    cluster's service range and kind_config's patch applied."""
    return KUBEADM_APISERVER.replace("192.0.2.1", "192.0.2.10").replace(
        "    - --service-cluster-ip-range=10.96.0.0/12\n",
        f"    - --service-cluster-ip-range={service_range}\n"
        "    - --endpoint-reconciler-type=none\n")


def run_up(tmp: Path, engine: str, apiserver_command: str, mirror_delay: int = 2,
           extra_env: dict | None = None):
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "fake"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    for name in ("kind", "kubectl", "helm", "cargo", "install-chart", engine):
        (bin_dir / name).symlink_to(fake)
    state = tmp / "state"
    state.mkdir()
    (tmp / "kube-apiserver.yaml").write_text(node_apiserver())
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SIDECAR_BINARY": str(binary("bootstrap-controller")),
        "FAKE_APISERVER_MANIFEST": str(tmp / "kube-apiserver.yaml"),
        "HOME": str(tmp),
        "ENGINE": engine,
        "FAKE_DIR": str(state),
        "FAKE_APISERVER_COMMAND": apiserver_command,
        "FAKE_MIRROR_DELAY": str(mirror_delay),
        "FAKE_NODE_IP": "192.0.2.10",
        # e2e/steps/install-chart.sh (its own tests are its own): the call is what is checked.
        "INSTALL_CHART": str(bin_dir / "install-chart"),
        "FAKE_EXPECTED_SKIPS": str(ROOT / "e2e" / "control-plane" / "expected-skips.txt"),
        **(extra_env or {}),
    }
    done = subprocess.run(["bash", str(KIND / "up.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    calls_file = state / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] \
        if calls_file.exists() else []
    return done, calls, state


def index(calls: list[dict], cmd: str, *words: str) -> int:
    """The position of the first successful call of cmd whose arguments contain every word."""
    for i, call in enumerate(calls):
        if call["cmd"] == cmd and not call.get("failed") and all(
                any(w in a for a in call["args"]) for w in words):
            return i
    raise AssertionError(f"no call of {cmd} with {words}: {calls}")


def test_up_runs_each_step_in_an_order_that_can_pass():
    with workdir() as tmp:
        done, calls, state = run_up(Path(tmp), "docker", APISERVER_WITH_FLAG)
        assert done.returncode == 0, done.stdout + done.stderr
        kind_config = yaml.safe_load((state / "kind.yaml").read_text())
        sidecar_text = (state / "sidecar.yaml").read_text()
        sidecar = yaml.safe_load(sidecar_text)
    order = [
        index(calls, "kind", "create", "cluster"),
        index(calls, "kubectl", "component=kube-apiserver"),  # the flag checked
        index(calls, "cargo", "build", "x86_64-unknown-linux-musl"),  # the static binary
        index(calls, "docker", "build"),
        index(calls, "kind", "load", "docker-image"),
        index(calls, "cargo", "test"),  # outside the cluster: needs no endpoints
        index(calls, "kubectl", "apply", "deploy/sidecar/rbac.yaml"),
        index(calls, "docker", "exec", "bash"),  # setup-node.sh in the node
        index(calls, "docker", "exec", "manifests/kube-apiserver.yaml"),  # read, for the binary
        index(calls, "docker", "exec", "manifests/$1.yaml"),  # the static pod
        index(calls, "kubectl", "wait", "condition=Ready"),
        index(calls, "kubectl", "get", "endpointslice"),  # the sidecar lists the node
        index(calls, "install-chart"),  # only now can its pods reach the API
        index(calls, "kubectl", "delete", "namespace", "kube-node-lease"),
        index(calls, "helm", "uninstall"),
    ]
    assert order == sorted(order), [calls[i] for i in order]
    # The mirror pod was looked up until it existed, then waited for.
    lookups = [c for c in calls if c["cmd"] == "kubectl" and c["args"][2:4] == ["get", "pod"]]
    assert [c.get("failed", False) for c in lookups] == [True, True, False], lookups
    # What each step was given.
    image = "ghcr.io/bootstrap-controller/bootstrap-controller:kind"
    build = calls[index(calls, "docker", "build")]["args"]
    assert build[-2:] == [image, "."] and "BINARY_STAGE=prebuilt" in build, build
    assert calls[index(calls, "kind", "load")]["args"][2] == image
    # The tests run against the cluster, advertising an address its certificate holds.
    tests_env = calls[index(calls, "cargo", "test")]["env"]
    assert tests_env["BOOTSTRAP_E2E_CERTIFICATE_ADDRESS"] == "192.0.2.10", tests_env
    assert tests_env["BOOTSTRAP_E2E_KUBECONFIG"].endswith("kubeconfig"), tests_env
    container = sidecar["spec"]["containers"][0]
    assert container["image"] == image and container["imagePullPolicy"] == "Never"
    # Generated from the node's kube-apiserver manifest: its range and address; nothing else
    # differs from the example but the image.
    assert sidecar_text == SIDECAR_EXAMPLE.replace(
        'value: "10.96.0.0/12"', 'value: "198.18.160.0/20"').replace(
        'value: "192.0.2.1"', 'value: "192.0.2.10"').replace(
        "image: ghcr.io/bootstrap-controller/bootstrap-controller:0.1.0", f"image: {image}").replace(
        "imagePullPolicy: IfNotPresent", "imagePullPolicy: Never")
    assert "runs with --endpoint-reconciler-type=none" in done.stderr, done.stderr
    setup = calls[index(calls, "docker", "exec", "bash")]
    assert setup["stdin"] == (ROOT / "deploy" / "sidecar" / "setup-node.sh").read_text()
    for word in ("KUBEADM_CONFIG=/kind/kubeadm.conf", "DIR=/etc/kubernetes/bootstrap-controller",
                 "SERVER=https://192.0.2.10:6443"):
        assert word in setup["args"], setup["args"]
    manifest = calls[index(calls, "docker", "exec", "manifests/$1.yaml")]["args"]
    assert manifest[-1] == "bootstrap-controller", manifest  # /etc/kubernetes/manifests/$1.yaml
    chart = calls[index(calls, "install-chart")]["args"]
    assert chart == ["bc", "bootstrap-controller", image.rsplit(":", 1)[0], "kind", "--set",
                     "config.leaderElection.leaseName=bootstrap-controller-chart"], chart
    patch = yaml.safe_load(kind_config["kubeadmConfigPatches"][0])
    assert patch["apiServer"]["extraArgs"] == {"endpoint-reconciler-type": "none"}
    kubelet = yaml.safe_load(kind_config["kubeadmConfigPatches"][1])
    assert kubelet == {"kind": "KubeletConfiguration", "failCgroupV1": False}
    assert kind_config["networking"] == {"podSubnet": "198.18.192.0/18",
                                         "serviceSubnet": "198.18.160.0/20"}


def test_up_lists_what_the_suite_skipped_and_fails_on_a_skip_not_expected():
    """The suite's skips against kind are printed and compared with the real control plane's
    list; one more fails the script before the sidecar, and SKIP_E2E=1 says that it skips."""
    with workdir() as tmp:
        done, calls, _ = run_up(Path(tmp), "docker", APISERVER_WITH_FLAG)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "  SKIPPED nodeport_repair::" in done.stdout, done.stdout
    assert "expected-skips.txt expects" in done.stdout, done.stdout
    tests_env = calls[index(calls, "cargo", "test")]["env"]
    assert "BOOTSTRAP_E2E_SKIP_LOG" in tests_env, tests_env
    # Only the files that run against a given cluster: the others start simulators of their own
    # and run with the workspace's tests (`cargo nextest run --workspace`), not a second time here.
    args = calls[index(calls, "cargo", "test")]["args"]
    named = sorted(args[i + 1] for i, a in enumerate(args[:-1]) if a == "--test")
    expected = (ROOT / "e2e" / "control-plane" / "expected-skips.txt").read_text()
    nocluster = set(re.findall(r"^(?:unless-root )?NOCLUSTER (\w+)$", expected, re.M))
    files = {p.stem for p in (ROOT / "e2e" / "tests").glob("*.rs")}
    assert named == sorted(files - nocluster), args
    assert "system_namespaces" in named and "chaos" not in named, named
    with workdir() as tmp:
        done, calls, _ = run_up(Path(tmp), "docker", APISERVER_WITH_FLAG, extra_env={
            "FAKE_EXTRA_SKIP": "SKIPPED system_namespaces::t: a skip nobody expects\n"})
    assert done.returncode != 0, done.stdout
    assert "  + SKIPPED system_namespaces::t: a skip nobody expects" in done.stdout, done.stdout
    assert not [c for c in calls if c["cmd"] in ("helm", "install-chart")], calls
    with workdir() as tmp:
        done, calls, _ = run_up(Path(tmp), "docker", APISERVER_WITH_FLAG,
                                extra_env={"SKIP_E2E": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SKIP_E2E=1: the end-to-end tests (cargo test -p e2e) do not run" in done.stdout
    assert not [c for c in calls if c["cmd"] == "cargo" and c["args"][:1] == ["test"]], calls


def test_up_fails_when_kube_apiserver_lacks_the_flag():
    """A patch kind skipped leaves kube-apiserver listing itself: the script stops there instead
    of passing its final check without the controller."""
    with workdir() as tmp:
        done, calls, _ = run_up(Path(tmp), "docker", APISERVER_WITHOUT_FLAG)
    assert done.returncode != 0
    assert "without --endpoint-reconciler-type=none" in done.stderr, done.stderr
    assert not [c for c in calls if c["cmd"] in ("docker", "helm", "install-chart")], calls


def test_up_fails_when_someone_else_recreated_kube_node_lease():
    """kube-apiserver recreates the namespace itself within a minute: a namespace back that
    this controller did not make fails the run."""
    with workdir() as tmp:
        done, calls, _ = run_up(Path(tmp), "docker", APISERVER_WITH_FLAG,
                                extra_env={"FAKE_NAMESPACE_MANAGERS": "kube-apiserver"})
    assert done.returncode != 0
    assert "not by bootstrap-controller (managers: kube-apiserver)" in done.stderr, done.stderr
    assert not [c for c in calls if c["cmd"] == "helm" and "uninstall" in c["args"]], calls


def test_up_with_podman_loads_the_same_fully_qualified_name():
    """podman would store a short name as localhost/...; the fully qualified name is the one
    containerd is asked for either way."""
    with workdir() as tmp:
        done, calls, state = run_up(Path(tmp), "podman", APISERVER_WITH_FLAG, mirror_delay=0)
        assert done.returncode == 0, done.stdout + done.stderr
        sidecar = yaml.safe_load((state / "sidecar.yaml").read_text())
    image = "ghcr.io/bootstrap-controller/bootstrap-controller:kind"
    save = calls[index(calls, "podman", "save")]["args"]
    assert save[1] == image, save
    index(calls, "kind", "load", "image-archive")
    assert sidecar["spec"]["containers"][0]["image"] == image


# ---------------------------------------------------------------------------------------------
# The kubeadm patch, by kind's rules (sigs.k8s.io/kind, read at fed2688 of 2026-08-21):
# pkg/cluster/internal/kubeadm/config.go picks the kubeadm API: v1beta3 from Kubernetes 1.23
# (kind <= v0.31 for every later version too), v1beta4 from 1.36 (kind >= v0.32, the release
# that also added pkg/internal/patch/kubeadm_merge.go). pkg/internal/patch/resource.go applies a
# merge patch to a document when the kinds match and the patch names no apiVersion or the same.


def kind_kubeadm_api(kind_release: tuple[int, int], node_minor: int) -> str:
    if kind_release >= (0, 32) and node_minor >= 36:
        return "kubeadm.k8s.io/v1beta4"
    return "kubeadm.k8s.io/v1beta3"


def kind_generated(api: str) -> dict:
    """The ClusterConfiguration kind generates, reduced to the apiServer.extraArgs it holds."""
    if api.endswith("v1beta4"):
        extra = [{"name": "runtime-config", "value": ""}]
    else:
        extra = {"runtime-config": ""}
    return {"apiVersion": api, "kind": "ClusterConfiguration", "apiServer": {"extraArgs": extra}}


def json_merge_patch(target, patch):
    """RFC 7386, as jsonpatch.MergePatch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = json_merge_patch(out.get(key), value)
    return out


def kind_apply(document: dict, patch: dict, kind_release: tuple[int, int]) -> dict:
    """resource.matches, then (kind >= v0.32) mergeAndStrip's extraArgs handling for a v1beta4
    target, then the JSON merge patch."""
    if patch.get("kind") != document["kind"]:
        return document
    if patch.get("apiVersion") not in (None, "", document["apiVersion"]):
        return document  # skipped without a word
    patch = json.loads(json.dumps(patch))
    document = json.loads(json.dumps(document))
    if kind_release >= (0, 32) and document["apiVersion"].endswith("v1beta4"):
        def walk(target, p):
            for key in list(p):
                if key == "extraArgs":
                    items = p[key]
                    if isinstance(items, dict) and not patch.get("apiVersion"):
                        items = [{"name": k, "value": v} for k, v in items.items()]
                    if isinstance(items, list):
                        merged = list(target.get(key) or [])
                        for item in items:
                            merged = [m for m in merged if m["name"] != item["name"]] + [item]
                        target[key] = merged
                    del p[key]
                elif isinstance(p[key], dict):
                    walk(target.setdefault(key, {}), p[key])
        walk(document, patch)
    return json_merge_patch(document, patch)


def flag_set(document: dict) -> bool:
    extra = document["apiServer"]["extraArgs"]
    if isinstance(extra, dict):
        return extra.get("endpoint-reconciler-type") == "none"
    return {"name": "endpoint-reconciler-type", "value": "none"} in extra


KIND_RELEASES = [(0, 27), (0, 29), (0, 31), (0, 32)]
NODE_MINORS = [29, 30, 31, 32, 33, 34, 35, 36]


def kind_config(node_image: str) -> dict:
    out = subprocess.run(
        ["bash", "-c", f'. "{KIND}/lib.sh"; kind_config "$1"', "-", node_image],
        capture_output=True, text=True, check=True).stdout
    return yaml.safe_load(out)


@pytest.mark.parametrize("kind_release", KIND_RELEASES)
@pytest.mark.parametrize("minor", NODE_MINORS)
def test_kind_applies_the_patch_for_every_node_image(kind_release, minor):
    config = kind_config(f"kindest/node:v1.{minor}.0")
    assert config["nodes"][0]["image"] == f"kindest/node:v1.{minor}.0"
    patch = yaml.safe_load(config["kubeadmConfigPatches"][0])
    document = kind_generated(kind_kubeadm_api(kind_release, minor))
    assert flag_set(kind_apply(document, patch, kind_release))


def test_the_model_of_kinds_rules_catches_a_patch_naming_the_wrong_api():
    """The patch up.sh used to write (v1beta4 from node 1.31) is skipped by kind v0.31, which
    generates v1beta3 there: the model must say so, or the test above proves nothing."""
    v1beta4_patch = {"kind": "ClusterConfiguration", "apiVersion": "kubeadm.k8s.io/v1beta4",
                     "apiServer": {"extraArgs": [{"name": "endpoint-reconciler-type",
                                                  "value": "none"}]}}
    document = kind_generated(kind_kubeadm_api((0, 31), 33))
    assert not flag_set(kind_apply(document, v1beta4_patch, (0, 31)))
    assert flag_set(kind_apply(kind_generated("kubeadm.k8s.io/v1beta4"), v1beta4_patch, (0, 32)))


# ---------------------------------------------------------------------------------------------
# The functions alone


def lib(function_call: str, path_dir: Path | None = None, stdin: str = "", timeout: int = 60):
    env = {**os.environ}
    if path_dir is not None:
        env["PATH"] = f"{path_dir}:{env['PATH']}"
    return subprocess.run(["bash", "-c", f'set -euo pipefail; . "{KIND}/lib.sh"; {function_call}'],
                          input=stdin, capture_output=True, text=True, env=env, timeout=timeout)


def test_require_reconciler_off():
    assert lib("require_reconciler_off", stdin=APISERVER_WITH_FLAG).returncode == 0
    done = lib("require_reconciler_off", stdin=APISERVER_WITHOUT_FLAG)
    assert done.returncode == 1 and "kind did not apply the kubeadm patch" in done.stderr
    done = lib("require_reconciler_off", stdin="")
    assert done.returncode == 1 and "no kube-apiserver pod found" in done.stderr


def steps(function_call: str, path_dir: Path | None = None, env: dict | None = None):
    """A function of e2e/steps/sidecar.sh, sourced as its callers do."""
    full = {**os.environ, **(env or {})}
    if path_dir is not None:
        full["PATH"] = f"{path_dir}:{full['PATH']}"
    return subprocess.run(
        ["bash", "-c", f'set -euo pipefail; . "{ROOT}/e2e/steps/sidecar.sh"; {function_call}'],
        capture_output=True, text=True, env=full, timeout=60)


def test_sidecar_wait_ready_gives_up_on_a_pod_that_never_appears():
    with workdir() as tmp:
        bin_dir = Path(tmp)
        (bin_dir / "kubectl").write_text(
            "#!/bin/sh\ncase \"$*\" in *wait*) echo 'pods not found' >&2; exit 1;; esac\n"
            "echo 'pods not found' >&2\nexit 1\n")
        (bin_dir / "kubectl").chmod(0o755)
        done = steps("sidecar_wait_ready bootstrap-controller-cp", bin_dir,
                     {"SIDECAR_TIMEOUT": "2"})
    assert done.returncode == 1 and "pods not found" in done.stderr, done.stderr


def test_sidecar_wait_listed_names_the_missing_address():
    with workdir() as tmp:
        bin_dir = Path(tmp)
        (bin_dir / "kubectl").write_text("#!/bin/sh\nprintf '198.18.0.2'\n")
        (bin_dir / "kubectl").chmod(0o755)
        done = steps("sidecar_wait_listed 198.18.0.2", bin_dir, {"SIDECAR_TIMEOUT": "2"})
        assert done.returncode == 0, done.stderr
        done = steps("sidecar_wait_listed 198.18.0.2 198.18.0.3", bin_dir, {"SIDECAR_TIMEOUT": "2"})
    assert done.returncode == 1
    assert "lists '198.18.0.2', not all of 198.18.0.2 198.18.0.3" in done.stderr, done.stderr


def manifest_step(apiserver: str, env: dict) -> subprocess.CompletedProcess:
    """sidecar_manifest with the node's kube-apiserver manifest `apiserver`, read through a
    sidecar_on_node that cats a local copy."""
    with workdir() as tmp:
        path = Path(tmp) / "kube-apiserver.yaml"
        path.write_text(apiserver)
        on_node = ('sidecar_on_node() { [ "$1 $2" = '
                   '"cat /etc/kubernetes/manifests/kube-apiserver.yaml" ] && '
                   f'cat "{path}"; }}')
        return steps(f"{on_node}; sidecar_manifest /etc/kubernetes/manifests/kube-apiserver.yaml",
                     env={"SIDECAR_BINARY": str(binary("bootstrap-controller")), **env})


def test_sidecar_manifest_runs_the_local_image_without_pulling():
    out = manifest_step(node_apiserver("10.96.0.0/16,fd00:10:96::/112"),
                        {"SIDECAR_IMAGE": "example.org/bc:kind"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == SIDECAR_EXAMPLE.replace(
        'value: "10.96.0.0/12"', 'value: "10.96.0.0/16,fd00:10:96::/112"').replace(
        'value: "192.0.2.1"', 'value: "192.0.2.10"').replace(
        "image: ghcr.io/bootstrap-controller/bootstrap-controller:0.1.0",
        "image: example.org/bc:kind").replace(
        "imagePullPolicy: IfNotPresent", "imagePullPolicy: Never")


def test_sidecar_manifest_without_an_image_changes_only_what_kube_apiserver_sets():
    """The real node runs the manifest's own image (imported into its containerd)."""
    out = manifest_step(node_apiserver(), {})
    assert out.returncode == 0, out.stderr
    assert out.stdout == SIDECAR_EXAMPLE.replace(
        'value: "10.96.0.0/12"', 'value: "198.18.160.0/20"').replace(
        'value: "192.0.2.1"', 'value: "192.0.2.10"')


def test_sidecar_manifest_fails_on_a_manifest_the_binary_refuses_or_no_binary():
    out = manifest_step(KUBEADM_APISERVER.replace("name: kube-apiserver\n", "name: other\n"), {})
    assert out.returncode == 1 and out.stdout == "", out.stdout
    assert "error: spec.containers: no container named \"kube-apiserver\"" in out.stderr, out.stderr
    assert "no manifest generated from the node's" in out.stderr, out.stderr
    out = manifest_step(node_apiserver(), {"SIDECAR_BINARY": "/nonexistent/bootstrap-controller"})
    assert out.returncode == 1 and "/nonexistent/bootstrap-controller is missing" in out.stderr


def test_kind_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not on PATH (Debian: apt-get install shellcheck)"
    scripts = sorted(str(p.relative_to(ROOT)) for p in KIND.glob("*.sh"))
    scripts += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "e2e" / "steps").glob("*.sh"))
    scripts += ["deploy/sidecar/setup-node.sh", "e2e/node/install-sidecar.sh"]
    assert "e2e/kind/lib.sh" in scripts and "e2e/kind/up.sh" in scripts
    done = subprocess.run([shellcheck, "-x", *scripts], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_test_sh_refuses_bad_usage_with_exit_2():
    # Checked before anything is installed or built; --build-only is what ./run-tests.sh runs.
    result = subprocess.run([str(KIND / "test.sh"), "--no-such-flag"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2, result
    assert "usage: e2e/kind/test.sh [--build-only]" in result.stderr, result.stderr


# The Debian package of each tool e2e/node/build.sh copies into the conformance tests' images.
# A tool build.sh starts to take that is not here fails the test below until it is added.
IMAGE_TOOL_PACKAGES = {
    "/bin/busybox": "busybox-static",
    "/bin/bash": None,  # essential: on every Debian
    "/usr/bin/curl": "curl",
    "/bin/nc.openbsd": "netcat-openbsd",
    "/usr/sbin/ip": "iproute2",
    "/usr/bin/ss": "iproute2",
}


def test_build_only_installs_what_the_node_build_takes_from_this_machine():
    """`test.sh --build-only` runs beside the tests on a fresh machine, before e2e/node/up.sh has
    installed the node's packages: e2e/node/build.sh's image tools and buildah must come from
    its own installs or from run-tests.sh's, which run before it."""
    build = (ROOT / "e2e" / "node" / "build.sh").read_text()
    listed = re.search(r'for tool in "\$busybox" ([^;]*); do', build)
    assert listed, "build.sh's check of the image tools"
    tools = ["/bin/busybox", *listed.group(1).split()]
    assert re.search(r"for tool in go buildah; do", build), "build.sh's check of its builders"
    installs = ""
    for script in (KIND / "test.sh", ROOT / "run-tests.sh"):
        installs += "\n".join(
            line for line in script.read_text().splitlines() if "missing+=" in line or "for tool in" in line
        )
    installed = set(re.findall(r"missing\+=\(([^)]*)\)", installs))
    installed |= {word for line in re.findall(r"for tool in ([^;]*); do", installs) for word in line.split()}
    for tool in tools:
        assert tool in IMAGE_TOOL_PACKAGES, f"{tool}: add its Debian package to IMAGE_TOOL_PACKAGES"
        package = IMAGE_TOOL_PACKAGES[tool]
        assert package is None or package in installed, f"{tool} ({package}) is not installed first"
    assert "buildah" in installed

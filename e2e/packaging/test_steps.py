"""The install steps the real node and kind share (e2e/steps/sidecar.sh), as the real node's
e2e/node/install-sidecar.sh runs them, with stand-ins for nsenter and kubectl that record each
call: what runs on the node (setup-node.sh, the manifests written beside kube-apiserver's) for one
apiserver and for two, and the waits. The node itself runs in e2e/node/test_node.py; kind's
script is tested in test_kind.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from harness import ROOT, workdir

FAKE = r'''#!/usr/bin/env python3
import json, os, sys
name = os.path.basename(sys.argv[0]); args = sys.argv[1:]
state = os.environ["FAKE_DIR"]
call = {"cmd": name, "args": args}
if name == "nsenter":
    call["stdin"] = sys.stdin.read()
elif name == "kubectl" and args[2:4] == ["get", "endpointslice"]:
    sys.stdout.write(os.environ["FAKE_LISTED"])
with open(os.path.join(state, "calls.jsonl"), "a") as log:
    log.write(json.dumps(call) + "\n")
'''

MANIFEST = (ROOT / "deploy" / "sidecar" / "bootstrap-controller.yaml").read_text()
PATH_ON_NODE = "PATH=/opt/node/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run_install(tmp: Path, apiservers: int, listed: str, timeout: str = "120"):
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "fake").write_text(FAKE)
    (bin_dir / "fake").chmod(0o755)
    for name in ("nsenter", "kubectl"):
        (bin_dir / name).symlink_to(bin_dir / "fake")
    node = tmp / "node"
    node.mkdir()
    (node / "env").write_text(
        "NODE_IP=198.18.0.2\n"
        f"APISERVERS={apiservers}\n"
        "APISERVER_2_IP=198.18.0.3\n"
        "NODE_NAME=bcnode\n"
        "HOLDER_PID=4242\n"
        "NODE_BIN=/opt/node/bin\n"
        "SERVICE_CIDR=198.19.0.0/16\n"
        f"MANIFESTS={node}/etc-kubernetes/manifests\n"
        f"KUBECONFIG={node}/admin.conf\n")
    state = tmp / "state"
    state.mkdir()
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "FAKE_DIR": str(state), "FAKE_LISTED": listed,
           "SIDECAR_TIMEOUT": timeout}
    done = subprocess.run([str(ROOT / "e2e" / "node" / "install-sidecar.sh"), str(node)], env=env,
                          capture_output=True, text=True, timeout=120)
    calls_file = state / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] \
        if calls_file.exists() else []
    return done, calls


def on_node(calls: list[dict]) -> list[dict]:
    """The nsenter calls, each checked to run in the node's namespaces with its PATH."""
    out = [c for c in calls if c["cmd"] == "nsenter"]
    for call in out:
        assert call["args"][:6] == ["-t", "4242", "--mount", "--net", "env", PATH_ON_NODE], call
    return out


def first_manifest() -> str:
    """What install-sidecar.sh wrote before the steps were shared: the range alone changed."""
    return MANIFEST.replace('value: "10.96.0.0/12"', 'value: "198.19.0.0/16"')


def second_manifest() -> str:
    """The second sidecar's manifest, by the expressions install-sidecar.sh has always used."""
    text = first_manifest()
    for pattern, replacement in [
            (r"(?m)^  name: bootstrap-controller$", "  name: bootstrap-controller-2"),
            (r"(?m)path: /etc/kubernetes/bootstrap-controller$",
             "path: /etc/kubernetes/bootstrap-controller-2"),
            (r'value: "\$\(HOST_IP\)"', 'value: "198.18.0.3"'),
            (r'value: "\$\(NODE_NAME\)"', 'value: "$(NODE_NAME)-2"'),
            (r"10290", "10291")]:
        text = re.sub(pattern, lambda _m, r=replacement: r, text)
    return text


def test_one_apiserver():
    with workdir() as tmp:
        done, calls = run_install(Path(tmp), 1, "198.18.0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    setup, manifest = on_node(calls)
    assert setup["args"][6:] == ["env", "DIR=/etc/kubernetes/bootstrap-controller",
                                 "KUBEADM_CONFIG=/etc/kubernetes/kubeadm.yaml",
                                 "SERVER=https://198.18.0.2:6443", "bash", "-s"], setup
    assert setup["stdin"] == (ROOT / "deploy" / "sidecar" / "setup-node.sh").read_text()
    # Written beside the manifests directory, then renamed in (one file system on the node).
    script = manifest["args"][8]
    assert manifest["args"][6:8] == ["sh", "-c"] and manifest["args"][9:] == ["-", "bootstrap-controller"]
    assert 'cat >"/etc/kubernetes/.$1.yaml" && mv "/etc/kubernetes/.$1.yaml" "/etc/kubernetes/manifests/$1.yaml"' == script
    assert manifest["stdin"] == first_manifest()
    kubectl = [c["args"] for c in calls if c["cmd"] == "kubectl"]
    assert kubectl[0][:2] == ["apply", "-f"] and kubectl[0][2].endswith("deploy/sidecar/rbac.yaml")
    assert ["-n", "kube-system", "wait", "--for=condition=Ready", "pod/bootstrap-controller-bcnode",
            "--timeout=120s"] in kubectl
    assert "1 sidecar(s) run" in done.stderr


def test_two_apiservers():
    with workdir() as tmp:
        done, calls = run_install(Path(tmp), 2, "198.18.0.3 198.18.0.2")
    assert done.returncode == 0, done.stdout + done.stderr
    setup_1, manifest_1, setup_2, manifest_2 = on_node(calls)
    assert "SERVER=https://198.18.0.2:6443" in setup_1["args"]
    assert "DIR=/etc/kubernetes/bootstrap-controller-2" in setup_2["args"]
    assert "SERVER=https://198.18.0.3:6443" in setup_2["args"]
    assert manifest_1["stdin"] == first_manifest() and manifest_1["args"][-1] == "bootstrap-controller"
    assert manifest_2["stdin"] == second_manifest() and manifest_2["args"][-1] == "bootstrap-controller-2"
    waited = [c["args"][4] for c in calls if c["cmd"] == "kubectl" and c["args"][2:3] == ["wait"]]
    assert waited == ["pod/bootstrap-controller-bcnode", "pod/bootstrap-controller-2-bcnode"]
    assert "2 sidecar(s) run" in done.stderr


def test_fails_until_every_apiserver_is_listed():
    with workdir() as tmp:
        done, _ = run_install(Path(tmp), 2, "198.18.0.2", timeout="2")
    assert done.returncode == 1
    assert "lists '198.18.0.2', not all of 198.18.0.2 198.18.0.3" in done.stderr, done.stderr

"""The static-pod sidecar manifests (deploy/sidecar) and the kind scripts (e2e/kind): the
manifests valid against the Kubernetes OpenAPI schemas in strict mode, their container arguments
run against the simulator (and a real etcd with TLS) until /readyz is 200 and the sidecar has
put its apiserver in the `kubernetes` endpoints; the scripts shellcheck-clean."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from harness import ROOT, Controller, Sim, container_args, local_args, tls_etcd, workdir

SIDECAR = ROOT / "deploy" / "sidecar"
MANIFESTS = ["bootstrap-controller.yaml", "bootstrap-controller-etcd.yaml", "rbac.yaml"]
KUBE_VERSIONS = ["1.33.0", kubernetes_validate.utils.latest_version()]


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((SIDECAR / name).read_text()) if d]


@pytest.mark.parametrize("name", MANIFESTS)
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_manifests_are_valid(name, version):
    for obj in load(name):
        kubernetes_validate.validate(obj, version, strict=True)


def test_sidecar_is_modelled_on_kubeadms_static_pods():
    pod = load("bootstrap-controller.yaml")[0]
    spec = pod["spec"]
    assert pod["metadata"]["namespace"] == "kube-system"
    assert spec["hostNetwork"] is True
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    args = spec["containers"][0]["args"]
    assert "--endpoint-reconciler-type=lease" in args
    assert "--leader-elect=true" in args


def sidecar_env(args: list[str]) -> list[str]:
    """The kubelet's expansion of $(HOST_IP) and $(NODE_NAME)."""
    return [a.replace("$(HOST_IP)", "10.0.0.1").replace("$(NODE_NAME)", "cp-1") for a in args]


def wait_for_own_endpoint(sim: Sim, controller: Controller) -> None:
    deadline = time.monotonic() + 30
    while True:
        done = sim.kubectl("get", "endpoints", "kubernetes", "-o", "json", check=False)
        if done.returncode == 0 and "10.0.0.1" in json.dumps(json.loads(done.stdout)):
            return
        assert time.monotonic() < deadline, controller.output()
        time.sleep(0.2)


def test_sidecar_arguments_run_and_keep_the_endpoints():
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            args, env = container_args(load("bootstrap-controller.yaml"), kind="Pod")
            args = local_args(
                sidecar_env(args),
                {"/etc/kubernetes/bootstrap-controller.conf": sim.kubeconfig},
                sim.kubeconfig,
            )
            controller = Controller(args, env, tmp, "sidecar")
            try:
                readyz = controller.wait_ready()
                assert "[+]apiserver-lease ok" in readyz, readyz
                wait_for_own_endpoint(sim, controller)
            finally:
                assert controller.stop() == 0, controller.output()
        finally:
            sim.stop()


def test_sidecar_etcd_arguments_run_against_a_tls_etcd():
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            with tls_etcd(tmp) as (url, ca, cert, key):
                args, env = container_args(load("bootstrap-controller-etcd.yaml"), kind="Pod")
                args = [a.replace("https://127.0.0.1:2379", url) for a in sidecar_env(args)]
                args = local_args(
                    args,
                    {
                        "/etc/kubernetes/bootstrap-controller.conf": sim.kubeconfig,
                        "/etc/kubernetes/pki/etcd/ca.crt": ca,
                        "/etc/kubernetes/pki/apiserver-etcd-client.crt": cert,
                        "/etc/kubernetes/pki/apiserver-etcd-client.key": key,
                    },
                    sim.kubeconfig,
                )
                controller = Controller(args, env, tmp, "sidecar-etcd")
                try:
                    controller.wait_ready()
                    wait_for_own_endpoint(sim, controller)
                finally:
                    assert controller.stop() == 0, controller.output()
        finally:
            sim.stop()


def test_kind_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is not on PATH (Debian: apt-get install shellcheck)"
    scripts = sorted(str(p) for p in (ROOT / "e2e" / "kind").glob("*.sh"))
    assert scripts, "no kind scripts found"
    done = subprocess.run([shellcheck, *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_kind_script_picks_the_kubeadm_api_by_node_version():
    script = (ROOT / "e2e" / "kind" / "up.sh").read_text()
    # The function, run alone for two node images.
    start = script.index("node_minor() {")
    end = script.index('log "cluster')
    functions = script[start:end]
    for image, api, arg_shape in [
        ("kindest/node:v1.33.1", "kubeadm.k8s.io/v1beta4", "- name: endpoint-reconciler-type"),
        ("kindest/node:v1.30.13", "kubeadm.k8s.io/v1beta3", 'endpoint-reconciler-type: "none"'),
    ]:
        out = subprocess.run(
            ["bash", "-c", f"set -euo pipefail\nNODE_IMAGE={image}\n{functions}\nkubeadm_patch"],
            capture_output=True, text=True, check=True,
        ).stdout
        assert api in out and arg_shape in out, out

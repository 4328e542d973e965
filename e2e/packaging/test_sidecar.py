"""The static-pod sidecar (deploy/sidecar): the manifests valid against the Kubernetes OpenAPI
schemas in strict mode; setup-node.sh writing the node's kubeconfig and configuration privately;
the manifests' settings, with those files, run against the simulator (and a real etcd with TLS)
until /readyz is 200 and the sidecar has put its apiserver in the `kubernetes` endpoints. The
kind scripts are tested in test_kind.py."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from harness import ROOT, Controller, Sim, binary, container_args, tls_etcd, workdir

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
    _, env = container_args(load("bootstrap-controller.yaml"), kind="Pod")
    assert env["BOOTSTRAP_ENDPOINT_RECONCILER_TYPE"] == "lease"
    assert env["BOOTSTRAP_LEADER_ELECT"] == "true"
    # $(HOST_IP) and $(NODE_NAME) expand only from variables defined before them.
    names = [e["name"] for e in spec["containers"][0]["env"]]
    assert names.index("HOST_IP") < names.index("BOOTSTRAP_ADVERTISE_ADDRESS")
    assert names.index("NODE_NAME") < names.index("BOOTSTRAP_LEADER_ELECT_IDENTITY")


def node_files(tmp: Path, sim: Sim) -> Path:
    """/etc/kubernetes/bootstrap-controller as deploy/sidecar/setup-node.sh writes it, with a
    stand-in for kubeadm that prints the simulator's kubeconfig holding a client certificate for
    system:bootstrap-controller (made with openssl; the simulator accepts any credentials)."""
    pki = tmp / "node-pki"
    pki.mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "365",
                    "-subj", "/CN=system:bootstrap-controller", "-keyout", str(pki / "key.pem"),
                    "-out", str(pki / "cert.pem")], check=True, capture_output=True)
    kubeconfig = yaml.safe_load(sim.kubeconfig.read_text())
    kubeconfig["users"][0]["user"] = {
        "client-certificate-data": base64.b64encode((pki / "cert.pem").read_bytes()).decode(),
        "client-key-data": base64.b64encode((pki / "key.pem").read_bytes()).decode(),
    }
    (pki / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    bin_dir = tmp / "node-bin"
    bin_dir.mkdir()
    (bin_dir / "kubeadm").write_text(
        "#!/bin/sh\n"
        '[ "$1 $2 $3" = "kubeconfig user --client-name=system:bootstrap-controller" ] || exit 3\n'
        f'exec cat "{pki / "kubeconfig"}"\n')
    (bin_dir / "kubeadm").chmod(0o755)
    directory = tmp / "etc-kubernetes-bootstrap-controller"
    done = setup_node(directory, bin_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "expires" in done.stdout, done.stdout
    return directory


def owner() -> str:
    """setup-node.sh's default owner, the pod's uid; where the tests do not run as root, chown
    can only give the files to the current user."""
    return "65532:65532" if os.geteuid() == 0 else f"{os.geteuid()}:{os.getegid()}"


def setup_node(directory: Path, bin_dir: Path, *args: str, **env: str):
    run_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DIR": str(directory),
               **env}
    if os.geteuid() != 0:
        run_env["OWNER"] = owner()
    return subprocess.run(["bash", str(SIDECAR / "setup-node.sh"), *args], env=run_env,
                          capture_output=True, text=True)


def sidecar_settings(name: str, directory: Path, files: dict[str, Path]) -> tuple[list, dict]:
    """The manifest's args and environment, with the kubelet's expansion of $(HOST_IP) and
    $(NODE_NAME) and the hostPath directory replaced by the one setup-node.sh wrote."""
    args, env = container_args(load(name), kind="Pod")
    expanded = {}
    for key, value in env.items():
        value = value.replace("$(HOST_IP)", "192.0.2.1").replace("$(NODE_NAME)", "cp-1")
        value = value.replace("/etc/kubernetes/bootstrap-controller", str(directory))
        for container_path, local in files.items():
            value = value.replace(container_path, str(local))
        expanded[key] = value
    unmapped = [v for v in expanded.values() if v.startswith("/etc/kubernetes")]
    assert not unmapped, unmapped
    return args, expanded


def wait_for_own_endpoint(sim: Sim, controller: Controller) -> None:
    deadline = time.monotonic() + 30
    while True:
        done = sim.kubectl("get", "endpoints", "kubernetes", "-o", "json", check=False)
        if done.returncode == 0 and "192.0.2.1" in json.dumps(json.loads(done.stdout)):
            return
        assert time.monotonic() < deadline, controller.output()
        time.sleep(0.2)


def test_setup_node_writes_private_files_and_checks_the_expiry():
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            directory = node_files(tmp, sim)
        finally:
            sim.stop()
        uid, gid = (int(x) for x in owner().split(":"))
        for path, mode in [(directory, 0o700), (directory / "kubeconfig", 0o600),
                           (directory / "config.yaml", 0o600)]:
            info = path.stat()
            assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (mode, uid, gid), path
        assert yaml.safe_load((directory / "config.yaml").read_text()) == {
            "loops": {"apiserverEndpoints": {"leaseNamespace": "bootstrap-controller"}}}
        bin_dir = tmp / "node-bin"
        # A year's certificate: fine for 30 days, not for 400.
        assert setup_node(directory, bin_dir, "--check").returncode == 0
        done = setup_node(directory, bin_dir, "--check", RENEW_DAYS="400")
        assert done.returncode == 1 and "run " in done.stderr and "again" in done.stderr, done
        # The server can be pinned to this node's apiserver; the file is replaced, not edited.
        before = (directory / "kubeconfig").stat().st_ino
        done = setup_node(directory, bin_dir, SERVER="https://192.0.2.10:6443")
        assert done.returncode == 0, done.stderr
        written = yaml.safe_load((directory / "kubeconfig").read_text())
        assert written["clusters"][0]["cluster"]["server"] == "https://192.0.2.10:6443"
        assert (directory / "kubeconfig").stat().st_ino != before
        assert sorted(p.name for p in directory.iterdir()) == ["config.yaml", "kubeconfig"]


def test_sidecar_keeps_its_secrets_in_a_mounted_directory():
    """The kubeconfig is replaced by rename when renewed: a file mount would keep showing the
    old inode, a directory mount shows the new file."""
    for name in ("bootstrap-controller.yaml", "bootstrap-controller-etcd.yaml"):
        pod = load(name)[0]
        mounts = pod["spec"]["containers"][0]["volumeMounts"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        own = next(m for m in mounts if m["mountPath"] == "/etc/kubernetes/bootstrap-controller")
        assert volumes[own["name"]]["hostPath"]["type"] == "Directory"
        assert all("subPath" not in m for m in mounts)


def test_sidecar_arguments_run_and_keep_the_endpoints():
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            directory = node_files(tmp, sim)
            sim.kubectl("create", "namespace", "bootstrap-controller")  # rbac.yaml makes it
            args, env = sidecar_settings("bootstrap-controller.yaml", directory, {})
            assert args == ["run"]
            controller = Controller(args, env, tmp, "sidecar")
            try:
                readyz = controller.wait_ready()
                assert "[+]apiserver-lease ok" in readyz, readyz
                wait_for_own_endpoint(sim, controller)
                leases = sim.kubectl("get", "leases", "-n", "bootstrap-controller", "-o",
                                     "name").stdout
                assert "lease.coordination.k8s.io/apiserver-192.0.2.1" in leases, leases
                # `kubectl exec ... check` in the pod: the same environment, nothing else.
                done = subprocess.run([str(binary("bootstrap-controller")), "check"],
                                      env={"PATH": "/usr/bin:/bin", **env},
                                      capture_output=True, text=True, timeout=120)
                assert done.returncode in (0, 1), done.stdout + done.stderr
            finally:
                assert controller.stop() == 0, controller.output()
        finally:
            sim.stop()


def test_sidecar_etcd_arguments_run_against_a_tls_etcd():
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        try:
            directory = node_files(tmp, sim)
            sim.kubectl("create", "namespace", "bootstrap-controller")
            with tls_etcd(tmp) as (url, ca, cert, key):
                args, env = sidecar_settings("bootstrap-controller-etcd.yaml", directory, {
                    "/etc/kubernetes/pki/etcd/ca.crt": ca,
                    "/etc/kubernetes/pki/apiserver-etcd-client.crt": cert,
                    "/etc/kubernetes/pki/apiserver-etcd-client.key": key,
                })
                env["BOOTSTRAP_ETCD_SERVERS"] = url
                controller = Controller(args, env, tmp, "sidecar-etcd")
                try:
                    controller.wait_ready()
                    wait_for_own_endpoint(sim, controller)
                finally:
                    assert controller.stop() == 0, controller.output()
        finally:
            sim.stop()

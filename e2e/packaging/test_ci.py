"""What CI runs is what the README says, and the real control plane's scripts are sound: CI runs
the README's test command verbatim, and the harness scripts are shellcheck-clean and refuse bad
usage with a usage message."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from harness import ROOT

CONTROL_PLANE = ROOT / "e2e" / "control-plane"
SCRIPTS = sorted(CONTROL_PLANE.glob("*.sh")) + sorted((ROOT / "e2e" / "node").glob("*.sh"))


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1]
    match = re.search(r"```sh\n(.+?)\n```", section, re.S)
    assert match, "README's 'Run the tests' section has no sh block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim():
    command = readme_test_command()
    assert "e2e/control-plane/test.sh" in command, command
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line.strip() for line in ci.splitlines()]
    assert command in lines, f"{command!r} is not a line of .ci/run"
    # set -e does not stop inside an && list: only as the last command does its failure fail CI.
    commands = [line for line in lines if line and not line.startswith("#")]
    assert commands[-1] == command, f".ci/run must end with the test command, not {commands[-1]!r}"


def test_ci_builds_without_protoc():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "export PROTOC=/bin/false" in ci
    for text in (ci, (ROOT / "README.md").read_text()):
        assert "protobuf-compiler" not in text


@pytest.mark.parametrize("script", SCRIPTS + [ROOT / ".ci" / "run"], ids=lambda p: p.name)
def test_scripts_are_shellcheck_clean(script):
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck is needed (apt-get install shellcheck)"
    result = subprocess.run([shellcheck, "-x", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "script,args",
    [
        ("up.sh", []),
        ("up.sh", ["/tmp/unused", "--apiservers", "12"]),
        ("up.sh", ["/tmp/unused", "--no-such-flag"]),
        ("down.sh", []),
        ("kubeconfig.sh", []),
    ],
)
def test_control_plane_scripts_refuse_bad_usage_with_exit_2(script, args):
    result = subprocess.run(
        [str(CONTROL_PLANE / script), *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "usage" in result.stderr.lower() or "must be" in result.stderr, result.stderr


def test_go_modules_pin_what_build_sh_reads():
    k8s = (CONTROL_PLANE / "k8s" / "go.mod").read_text()
    version = re.search(r"^require k8s.io/kubernetes (v1\.\d+\.\d+)$", k8s, re.M)
    assert version, "k8s/go.mod requires k8s.io/kubernetes at a release"
    staging = version.group(1).replace("v1.", "v0.", 1)
    replaced = re.findall(r"^\s*(k8s\.io/[\w-]+) => (k8s\.io/[\w-]+) (v[\d.]+)$", k8s, re.M)
    assert replaced, "no replace lines for the staging modules"
    for module, target, pinned in replaced:
        assert module == target, module
        assert pinned == staging, f"{module} replaced at {pinned}, not {staging}"
    etcd = (CONTROL_PLANE / "etcd" / "go.mod").read_text()
    assert re.search(r"^require go.etcd.io/etcd/server/v3 v3\.6\.\d+$", etcd, re.M), etcd

"""What CI runs is what the README says, and the real control plane's scripts are sound: CI ends
with the README's one command (run-tests.sh), which runs the README's test command verbatim,
and the scripts are shellcheck-clean and refuse bad usage with a usage message."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from harness import ROOT

CONTROL_PLANE = ROOT / "e2e" / "control-plane"
STEPS = ROOT / "e2e" / "steps"
SCRIPTS = (sorted(CONTROL_PLANE.glob("*.sh")) + sorted(CONTROL_PLANE.glob("k8s/*.sh"))
           + sorted((ROOT / "e2e" / "node").glob("*.sh")) + sorted(STEPS.glob("*.sh")))


def readme_commands() -> list[str]:
    """The sh blocks of README's 'Run the tests' section, in order."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    blocks = [block.strip() for block in re.findall(r"```sh\n(.+?)\n```", section, re.S)]
    assert blocks, "README's 'Run the tests' section has no sh block"
    return blocks


def last_command(script) -> str:
    lines = [line.strip() for line in script.read_text().splitlines()]
    return [line for line in lines if line and not line.startswith("#")][-1]


def test_ci_ends_with_the_readme_one_command():
    one_command = readme_commands()[0]
    assert one_command == "./run-tests.sh", one_command
    # The last command: a failure anywhere before it fails CI through set -e, its own through
    # the script's status.
    assert last_command(ROOT / ".ci" / "run") == one_command


def test_the_one_command_runs_the_readme_test_command_and_fails_with_it():
    command = readme_commands()[1]
    assert "e2e/control-plane/test.sh" in command, command
    script = (ROOT / "run-tests.sh").read_text()
    lines = [line.strip() for line in script.splitlines()]
    # Verbatim, as the body of a function whose status is checked: set -e does not stop inside an
    # && list, so a failure of its first parts would pass unseen.
    body = re.search(r"^readme_test_command\(\) \{\n(.*)\n\}$", script, re.M)
    assert body and body.group(1).strip() == command, body
    assert "if ! readme_test_command; then" in lines, lines
    failed = lines.index("if ! readme_test_command; then")
    assert lines[failed + 2] == "exit 1", lines[failed:failed + 4]
    # Then the real node's stage and kind's, whose builds ran beside it.
    assert "\ne2e/node/test.sh\n" in script and "\ne2e/kind/test.sh\n" in script, script
    assert script.index("if ! readme_test_command") < script.index("\ne2e/node/test.sh\n")
    assert 'in_background "building for the real node and kind" 19 \\\n' \
        """  sh -c 'e2e/kind/test.sh --build-only && touch "$1"' sh "$node_built"\n""" in script
    assert script.index("e2e/kind/test.sh --build-only") < script.index("if ! readme_test_command")
    assert script.index('finish "building for the real node and kind"') \
        < script.index("\ne2e/node/test.sh\n")


def test_background_builds_lower_their_autogroup_too():
    # A session of its own (setsid) is an autogroup of its own, and the scheduler shares the CPU
    # between autogroups before niceness counts: without the group's niceness, a build "at nice
    # 19" takes as much CPU as the whole foreground.
    for path in (ROOT / "run-tests.sh", ROOT / "e2e" / "node" / "test.sh", ROOT / ".ci" / "run"):
        starts = [line for line in path.read_text().splitlines() if "setsid --wait" in line]
        assert starts, path
        for line in starts:
            assert re.search(r'setsid --wait "?\S*steps/at-priority\.sh"? ', line), (path, line)


def test_at_priority_sets_the_niceness_of_the_command_and_of_its_autogroup():
    script = ROOT / "e2e" / "steps" / "at-priority.sh"
    run = subprocess.run(
        ["setsid", "--wait", str(script), "7", "sh", "-c", "nice; cat /proc/self/autogroup 2>/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert lines[0] == "7", run.stdout
    if os.path.exists("/proc/self/autogroup"):
        # `/autogroup-N nice 7`: the session's own group, lowered too.
        assert re.fullmatch(r"/autogroup-\d+ nice 7", lines[1]), run.stdout
    refused = subprocess.run([str(script), "7"], capture_output=True, text=True)
    assert refused.returncode == 2 and "usage" in refused.stderr


def test_the_test_runner_the_readme_names_is_the_one_run_tests_installs():
    command = readme_commands()[1]
    assert command.startswith("cargo nextest run --workspace && cargo test --workspace --doc"), command
    script = (ROOT / "run-tests.sh").read_text()
    version = re.search(r"^nextest_version=(\S+)$", script, re.M)
    assert version, "run-tests.sh pins no cargo-nextest version"
    assert 'cargo install cargo-nextest --version "$nextest_version" --locked' in script
    testing = " ".join((ROOT / "TESTING.md").read_text().split())
    assert f"cargo install cargo-nextest --version {version.group(1)} --locked" in testing
    # The config nextest reads from the workspace's root.
    config = (ROOT / ".config" / "nextest.toml").read_text()
    assert re.search(r"^test-threads = \d+$", config, re.M), config
    assert f'recommended = "{version.group(1)}"' in config, config
    # The control planes' test group: one thread, as the harness's slot is one lock.
    harness = (ROOT / "e2e" / "tests" / "common" / "control_plane.rs").read_text()
    assert "pub async fn control_plane_slot()" in harness
    assert re.search(r"^control-planes = \{ max-threads = 1 \}$", config, re.M), config
    # The filters name binaries and tests that exist (a filter that matches nothing is no error).
    for binary in re.findall(r"binary\((\w+)\)", config):
        assert (ROOT / "e2e" / "tests" / f"{binary}.rs").exists(), binary
    for binary, test in re.findall(r"binary\((\w+)\) & test\((\w+)\)", config):
        assert f"fn {test}(" in (ROOT / "e2e" / "tests" / f"{binary}.rs").read_text(), test


def test_the_one_command_refuses_bad_usage_with_exit_2():
    result = subprocess.run(
        [str(ROOT / "run-tests.sh"), "--no-such-flag"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "usage: ./run-tests.sh" in result.stderr, result.stderr


def test_ci_builds_without_protoc():
    for script in (ROOT / ".ci" / "run", ROOT / "run-tests.sh"):
        assert "export PROTOC=/bin/false" in script.read_text(), script
    for text in ((ROOT / ".ci" / "run").read_text(), (ROOT / "README.md").read_text()):
        assert "protobuf-compiler" not in text


@pytest.mark.parametrize(
    "script", SCRIPTS + [ROOT / ".ci" / "run", ROOT / "run-tests.sh"], ids=lambda p: p.name
)
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
        ("build.sh", ["--no-such-flag"]),
        ("all-versions.sh", ["--help"]),
        ("k8s/pin.sh", []),
    ],
)
def test_control_plane_scripts_refuse_bad_usage_with_exit_2(script, args):
    result = subprocess.run(
        [str(CONTROL_PLANE / script), *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "usage" in result.stderr.lower() or "must be" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "script,args,says",
    [
        ("build.sh", ["--kubernetes", "2.0"], "--kubernetes takes a minor such as 1.30, not '2.0'"),
        ("build.sh", ["--kubernetes", "1.29"], "Kubernetes 1.29 is not pinned here (pinned: 1.30"),
        ("test.sh", ["--kubernetes", "1.29"], "Kubernetes 1.29 is not pinned here"),
        ("up.sh", ["/tmp/unused", "--apiserver-flag", "emulated-version=1.34"],
         "take a flag such as --emulated-version=1.34, not 'emulated-version=1.34'"),
        ("k8s/pin.sh", ["1.30"], "VERSION must look like v1.30.14, not 1.30"),
        ("k8s/pin.sh", ["v1.30.14", "k8s.io/api=v0.31.0"],
         "k8s.io/api=v0.31.0 is not MODULE=v0.30.PATCH"),
    ],
)
def test_a_version_or_flag_of_the_wrong_form_is_refused_with_exit_2(script, args, says):
    result = subprocess.run(
        [str(CONTROL_PLANE / script), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert says in result.stderr, result.stderr


@pytest.mark.parametrize("args", [[], ["release"], ["release", "namespace", "repository"],
                                  ["release", "", "repository", "tag"]])
def test_the_install_chart_step_refuses_bad_usage_with_exit_2(args):
    # Refused before helm runs: HELM names a command that would fail differently.
    result = subprocess.run([str(STEPS / "install-chart.sh"), *args], capture_output=True,
                            text=True, timeout=30, env={"PATH": "/usr/bin:/bin", "HELM": "/bin/false"})
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "install-chart.sh RELEASE NAMESPACE IMAGE_REPOSITORY IMAGE_TAG" in result.stderr, result.stderr


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
    helm = (ROOT / "e2e" / "node" / "helm" / "go.mod").read_text()
    assert re.search(r"^require helm.sh/helm/v4 v4\.\d+\.\d+$", helm, re.M), helm

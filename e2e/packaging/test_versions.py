"""The supported range of Kubernetes minors is one range everywhere it is stated: the README's
compatibility table, the chart's kubeVersion, the minors e2e/control-plane pins (build.sh --list),
the oldest and newest ./run-tests.sh runs the suite on, and k8s-openapi's feature (the minor the
README says full function starts from)."""

from __future__ import annotations

import re
import subprocess

import yaml

from harness import ROOT

CONTROL_PLANE = ROOT / "e2e" / "control-plane"


def minor(text: str) -> int:
    match = re.fullmatch(r"1\.(\d+)", text.strip())
    assert match, f"{text!r} is not a Kubernetes minor such as 1.30"
    return int(match.group(1))


def readme_section() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"^## Kubernetes versions\n(.*?)^## ", readme, re.M | re.S)
    assert match, "README has no 'Kubernetes versions' section"
    return match.group(1)


def readme_table_minors() -> list[int]:
    minors: list[int] = []
    for row in re.findall(r"^\| (1\.\d+(?: - 1\.\d+)?) \|", readme_section(), re.M):
        low, _, high = row.partition(" - ")
        minors.extend(range(minor(low), minor(high or low) + 1))
    assert minors, "the README's compatibility table has no rows"
    return sorted(minors)


def supported() -> tuple[int, int]:
    match = re.search(r"Supported: Kubernetes \*\*1\.(\d+) to 1\.(\d+)\*\*", readme_section())
    assert match, "the README's 'Kubernetes versions' section names no supported range"
    return int(match.group(1)), int(match.group(2))


def test_the_readme_table_covers_the_supported_range_once():
    oldest, newest = supported()
    assert readme_table_minors() == list(range(oldest, newest + 1))


def test_the_charts_kube_version_starts_at_the_oldest_supported_minor():
    chart = yaml.safe_load((ROOT / "charts" / "bootstrap-controller" / "Chart.yaml").read_text())
    oldest, _ = supported()
    assert chart["kubeVersion"] == f">=1.{oldest}.0-0", chart["kubeVersion"]
    assert f"`kubeVersion` is `>=1.{oldest}.0-0`" in readme_section()


def test_every_supported_minor_is_pinned_and_the_newest_is_the_default():
    listed = subprocess.run([str(CONTROL_PLANE / "build.sh"), "--list"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    oldest, newest = supported()
    assert [minor(m) for m in listed] == list(range(oldest, newest + 1)), listed
    default = (CONTROL_PLANE / "k8s" / "go.mod").read_text()
    assert re.search(rf"^require k8s.io/kubernetes v1\.{newest}\.\d+$", default, re.M)


def test_k8s_openapi_builds_against_the_minor_full_function_starts_from():
    cargo = (ROOT / "Cargo.toml").read_text()
    match = re.search(r'^k8s-openapi = \{.*features = \["v1_(\d+)"\]', cargo, re.M)
    assert match, "Cargo.toml's k8s-openapi names no single v1_NN feature"
    full = re.search(r"Full function\s+from 1\.(\d+)", readme_section())
    assert full, "the README does not say from which minor function is full"
    assert match.group(1) == full.group(1), (match.group(1), full.group(1))
    assert f"| 1.{full.group(1)} - 1.{supported()[1]} | every loop" in readme_section()


def test_run_tests_runs_the_suite_on_the_oldest_and_all_versions_on_every_minor():
    script = (ROOT / "run-tests.sh").read_text()
    oldest, newest = supported()
    assert f"e2e/control-plane/test.sh --kubernetes 1.{oldest}" in script
    # Its build, started early beside the real node's and kind's stages, is the same minor's.
    builds = re.findall(r"e2e/control-plane/build\.sh --kubernetes (1\.\d+)\b", script)
    assert builds == [f"1.{oldest}"] * len(builds) and builds, builds
    # Its stage waits for it, and fails the run with its output when it failed.
    started = re.search(rf'^in_background "building Kubernetes 1\.{oldest}" 19 \\\n(.*\\\n)*?'
                        rf'\s*e2e/control-plane/build\.sh --kubernetes 1\.{oldest}$', script, re.M)
    assert started, "run-tests.sh starts no background build of the oldest minor"
    assert f'finish "building Kubernetes 1.{oldest}"' in script
    assert "--all-versions" in script
    assert "`./run-tests.sh --all-versions`" in readme_section()
    assert f"newest (1.{newest}) and the oldest (1.{oldest})" in readme_section()


def test_the_oldest_minors_run_covers_every_test_file_that_runs_against_the_cluster():
    # test.sh with no test named runs every file but the NOCLUSTER ones (the stand-in run in
    # test_control_plane_skips.py checks that); naming files here would let a new one go unrun.
    script = (ROOT / "run-tests.sh").read_text()
    oldest, _ = supported()
    # Beside kind's stage, at the usual priority, and waited for.
    runs = re.findall(
        rf'^in_background "([^"]+)" 0 e2e/control-plane/test\.sh --kubernetes 1\.{oldest}(.*)$',
        script, re.M)
    assert [args for _, args in runs] == [""], \
        f"run-tests.sh runs the oldest minor as {runs!r}, not with test.sh's default"
    assert f'\nfinish "{runs[0][0]}"\n' in script


def test_each_pinned_minor_replaces_its_staging_modules_within_that_minor():
    for mod in sorted((CONTROL_PLANE / "k8s").glob("1.*/go.mod")):
        n = minor(mod.parent.name)
        text = mod.read_text()
        assert re.search(rf"^require k8s.io/kubernetes v1\.{n}\.\d+$", text, re.M), mod
        replaced = re.findall(r"^\s*(k8s\.io/[\w-]+) => (k8s\.io/[\w-]+) v0\.(\d+)\.\d+$", text, re.M)
        assert replaced, f"{mod}: no replace lines for the staging modules"
        for module, target, staged in replaced:
            assert module == target and int(staged) == n, (mod, module, staged)

"""The release workflow (.github/workflows/release.yml), which cannot run here: actionlint-clean
(with shellcheck on its scripts), valid against the GitHub workflow schema (check-jsonschema's
copy), and doing what the chart's defaults rely on: on a version tag, the image for amd64 and
arm64 and the chart as an OCI artifact, pushed where values.yaml and the sidecar point."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import yaml

from harness import CHART, ROOT

WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"


def tool(name: str, install: str) -> str:
    found = shutil.which(name) or next(
        (str(p) for p in [Path.home() / "go" / "bin" / name] if p.exists()), None)
    assert found, f"{name} is not installed: {install}"
    return found


def test_workflows_are_actionlint_clean():
    actionlint = tool("actionlint",
                      "go install github.com/rhysd/actionlint/cmd/actionlint@latest "
                      "(then ~/go/bin/actionlint or put it on PATH)")
    tool("shellcheck", "apt-get install shellcheck (actionlint checks run: scripts with it)")
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    assert str(RELEASE) in files
    env = {**os.environ, "PATH": f"{Path(shutil.which('shellcheck')).parent}:{os.environ['PATH']}"}
    done = subprocess.run([actionlint, *files], capture_output=True, text=True, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_workflows_match_githubs_schema():
    check = tool("check-jsonschema", "pip install check-jsonschema")
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    done = subprocess.run([check, "--builtin-schema", "vendor.github-workflows", *files],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_release_publishes_what_the_chart_defaults_name():
    workflow = yaml.safe_load(RELEASE.read_text())
    # PyYAML reads the key `on` as True.
    trigger = workflow.get("on", workflow.get(True))
    assert trigger == {"push": {"tags": ["v*.*.*"]}}, trigger
    steps = {s.get("uses", "").split("@")[0]: s for job in workflow["jobs"].values()
             for s in job["steps"]}
    build = steps["docker/build-push-action"]["with"]
    assert build["platforms"] == "linux/amd64,linux/arm64"
    assert build["push"] is True and build["file"] == "Containerfile"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert build["tags"].startswith("${{ env.IMAGE }}:")
    assert workflow["env"]["IMAGE"] == values["image"]["repository"]
    chart_job = workflow["jobs"]["chart"]
    assert "image" in chart_job["needs"]  # the chart only once its image exists
    script = "\n".join(s.get("run", "") for s in chart_job["steps"])
    assert "helm package charts/bootstrap-controller" in script
    assert 'helm push "dist/bootstrap-controller-$VERSION.tgz" "$CHART_REPOSITORY"' in script
    # Pushing needs the package scope.
    for name in ("image", "chart"):
        assert workflow["jobs"][name]["permissions"]["packages"] == "write"
    # The tag must be the version the chart's default image tag (appVersion) names.
    versions = "\n".join(s.get("run", "") for s in workflow["jobs"]["versions"]["steps"])
    for source in ("Cargo.toml", "Chart.yaml", "appVersion"):
        assert source in versions

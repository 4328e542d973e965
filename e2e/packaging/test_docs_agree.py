"""The README, the runbooks, the chart and the sidecar manifest agree on what a user types: the
namespace and release the README installs into, the admin port and the probe paths."""

from __future__ import annotations

import re

import yaml

from harness import CHART, ROOT

README = (ROOT / "README.md").read_text()
RUNBOOKS = (ROOT / "docs" / "runbooks.md").read_text()


def test_the_readme_is_a_landing_page():
    lines = README.count("\n")
    assert lines <= 300, f"README.md has {lines} lines; the manual parts belong in TESTING.md or docs/"
    headings = re.findall(r"^## (.+)$", README, re.M)
    for wanted in ("Install", "Run it against a cluster", "Run the tests"):
        assert wanted in headings, headings


def test_runbooks_use_the_readme_release_and_namespace():
    install = re.search(r"helm install (\S+) .*?-n (\S+)", README, re.S)
    assert install, "the README's helm install command"
    release, namespace = install.group(1), install.group(2)
    # The controller's own objects: every command that reaches its Deployment.
    namespaces = set(re.findall(r"kubectl -n (\S+) (?:exec|port-forward|logs) deploy/", RUNBOOKS))
    namespaces |= set(re.findall(r"kubectl -n (\S+) get pods -l app.kubernetes.io/instance=", RUNBOOKS))
    assert namespaces == {namespace}, namespaces
    assert f"deploy/{release}-bootstrap-controller" in RUNBOOKS
    assert f"release `{release}` in\nnamespace `{namespace}`" in RUNBOOKS


def test_ports_and_probe_paths_agree():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    sidecar = yaml.safe_load((ROOT / "deploy" / "sidecar" / "bootstrap-controller.yaml").read_text())
    container = sidecar["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    sidecar_port = int(env["BOOTSTRAP_ADMIN_ADDR"].rsplit(":", 1)[1])
    paths = {values["livenessProbe"]["httpGet"]["path"], values["readinessProbe"]["httpGet"]["path"]}
    for probe in ("livenessProbe", "readinessProbe"):
        paths.add(container[probe]["httpGet"]["path"])
        assert container[probe]["httpGet"]["port"] == sidecar_port, probe
    for path in paths:
        assert f"`{path}`" in README, f"the README does not name the probe path {path}"
    # The runbooks' port-forward targets the chart's admin port, and name the sidecar's.
    assert f"port-forward deploy/bc-bootstrap-controller {values['adminPort']}" in RUNBOOKS
    assert f"127.0.0.1:{sidecar_port}" in RUNBOOKS
    assert f"default `0.0.0.0:{values['adminPort']}`" in README


def test_config_md_and_the_chart_notes_agree_with_the_readme():
    """CONFIG.md's admin address default is the README's and the chart's admin port; the notes
    printed after `helm install` name the release's namespace and port, never a literal one."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    config_md = (ROOT / "controllers" / "CONFIG.md").read_text()
    row = re.search(r"^\| `--admin-addr ADDR:PORT` \|.*$", config_md, re.M)
    assert row, "CONFIG.md's --admin-addr row"
    default = f"`0.0.0.0:{values['adminPort']}`"
    assert default in row.group(0), row.group(0)
    assert f"default {default}" in README
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    literal_namespaces = re.findall(r"kubectl (?:[^\n]*? )?-n (?!\{\{)(\S+)", notes)
    assert literal_namespaces == [], literal_namespaces
    assert re.findall(r"localhost:(?!\{\{)\S*", notes) == []
    assert "port-forward deploy/{{ include \"bootstrap-controller.fullname\" . }} {{ .Values.adminPort }}" in notes

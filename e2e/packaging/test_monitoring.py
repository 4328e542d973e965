"""The alerts and the dashboard the chart ships: the rules file passes `promtool check rules`
and its unit tests (`promtool test rules`, each alert fires and resolves), every alert carries
what an operator needs (summary, description, a runbook that exists, a severity), the chart's
PrometheusRule and dashboard ConfigMap follow their values, and every dashboard query parses.
(That the queries and rules name only metrics the binary exports, against a real scrape, and
that an alert fires and resolves in a real Prometheus: e2e/tests/alerts.rs.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from harness import CHART, ROOT, render

RULES = CHART / "files" / "prometheus-rules.yaml"
DASHBOARD = CHART / "files" / "dashboard.json"
UNIT_TESTS = Path(__file__).parent / "monitoring" / "alerts_test.yaml"
RUNBOOKS = ROOT / "docs" / "runbooks.md"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: these tests need it (Debian: `apt-get install prometheus`, "
            "which also brings the prometheus binary e2e/tests/alerts.rs runs)"
        )
    return subprocess.run([path, *args], capture_output=True, text=True, cwd=cwd)


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"]
            for rule in group["rules"]]


def test_rules_file_passes_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_fires_and_resolves_in_promtool_unit_tests():
    result = promtool("test", "rules", UNIT_TESTS.name, cwd=UNIT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    # Each alert has a case where it fires and a later one, in the same test, where it does not.
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    for alert in alerts():
        name = alert["alert"]
        covered = False
        for test in tests:
            cases = [c for c in test.get("alert_rule_test", []) if c["alertname"] == name]
            fired = [parse_duration(c["eval_time"]) for c in cases if c.get("exp_alerts")]
            quiet = [parse_duration(c["eval_time"]) for c in cases if not c.get("exp_alerts")]
            if fired and any(t > min(fired) for t in quiet):
                covered = True
        assert covered, f"{name}: no unit test sees it fire and then resolve"


def parse_duration(text: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smh])", text))


def runbook_anchors() -> set[str]:
    anchors = set()
    for line in RUNBOOKS.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_has_summary_description_severity_and_an_existing_runbook():
    repository = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]["package"][
        "repository"]
    base = f"{repository}/blob/main/docs/runbooks.md#"
    anchors = runbook_anchors()
    for alert in alerts():
        name = alert["alert"]
        annotations = alert["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        assert alert["labels"].get("severity") in ("critical", "warning", "info"), name
        url = annotations.get("runbook_url", "")
        assert url == base + name.lower(), f"{name}: runbook_url {url!r}"
        assert name.lower() in anchors, f"{name}: docs/runbooks.md has no section {name}"


def test_schema_names_exactly_the_alerts_of_the_rules_file():
    schema = json.loads((CHART / "values.schema.json").read_text())
    alerts_schema = schema["properties"]["metrics"]["properties"]["prometheusRule"]["properties"][
        "alerts"]
    assert alerts_schema["propertyNames"]["enum"] == [a["alert"] for a in alerts()]


def test_no_monitoring_objects_by_default():
    kinds = [doc["kind"] for docs in render({}).values() for doc in docs]
    assert "PrometheusRule" not in kinds
    assert not any(doc["kind"] == "ConfigMap" and "grafana_dashboard" in
                   doc["metadata"].get("labels", {})
                   for docs in render({}).values() for doc in docs)


def rendered_rule(values: dict, namespace: str = "bootstrap") -> dict:
    docs = render({"metrics": {"prometheusRule": values}}, namespace)["prometheusrule.yaml"]
    assert len(docs) == 1
    return docs[0]


def test_prometheusrule_carries_the_file_with_this_releases_selector(tmp_path):
    rule = rendered_rule({"enabled": True}, namespace="monitoring-test")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "monitoring-test"
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert list(by_name) == [a["alert"] for a in alerts()]
    for alert in alerts():
        got = by_name[alert["alert"]]
        assert got["for"] == alert["for"] and got["labels"] == alert["labels"]
        assert got["annotations"] == alert["annotations"]
        assert got["expr"] == alert["expr"].replace(
            'job="bootstrap-controller"',
            'job="bc-bootstrap-controller-metrics",namespace="monitoring-test"')
    # The ServiceMonitor's targets are the metrics Service's: its name is their job.
    services = [d for d in render({})["service.yaml"] if d["kind"] == "Service"]
    assert any(s["metadata"]["name"] == "bc-bootstrap-controller-metrics" for s in services)
    # What Prometheus Operator hands Prometheus is a valid rules file.
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_dry_run_release_has_no_leader_alert():
    """A dry run joins no leader election (bootstrap_leader is 0 on every replica), so
    BootstrapNoLeader, critical, would fire for as long as it runs."""
    docs = render({"config": {"dryRun": True},
                   "metrics": {"prometheusRule": {"enabled": True}}})["prometheusrule.yaml"]
    names = [r["alert"] for g in docs[0]["spec"]["groups"] for r in g["rules"]]
    assert names == [a["alert"] for a in alerts() if a["alert"] != "BootstrapNoLeader"]
    live = rendered_rule({"enabled": True})
    assert "BootstrapNoLeader" in [r["alert"] for g in live["spec"]["groups"] for r in g["rules"]]


def test_prometheusrule_overrides_follow_values():
    rule = rendered_rule({
        "enabled": True,
        "namespace": "monitoring",
        "labels": {"release": "prometheus"},
        "selector": 'job="custom"',
        "alerts": {
            "BootstrapNoLeader": {"for": "1m", "severity": "page"},
            "BootstrapLoopPanicking": {"enabled": False},
            "BootstrapDriftPersists": {"enabled": True, "for": "2h"},
        },
    })
    assert rule["metadata"]["namespace"] == "monitoring"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert "BootstrapLoopPanicking" not in by_name
    assert by_name["BootstrapNoLeader"]["for"] == "1m"
    assert by_name["BootstrapNoLeader"]["labels"]["severity"] == "page"
    assert by_name["BootstrapDriftPersists"]["for"] == "2h"
    assert by_name["BootstrapDriftPersists"]["labels"]["severity"] == "warning"
    assert 'up{job="custom"}' in by_name["BootstrapControllerDown"]["expr"]


@pytest.mark.parametrize("values", [
    {"alerts": {"BootstrapNoSuchAlert": {"for": "1m"}}},
    {"alerts": {"BootstrapNoLeader": {"for": "soon"}}},
    {"alerts": {"BootstrapNoLeader": {"severityy": "page"}}},
    {"enabledd": True},
])
def test_schema_rejects_unknown_alerts_and_bad_overrides(values):
    import helm_python as helm
    with pytest.raises(Exception):
        helm.Chart.load(CHART).validate_schema({"metrics": {"prometheusRule": values}})


def test_dashboard_configmap_is_labelled_for_the_grafana_sidecar():
    docs = render({"metrics": {"dashboard": {
        "enabled": True, "namespace": "grafana", "labels": {"team": "platform"},
        "annotations": {"grafana_folder": "Kubernetes"},
    }}})["dashboard.yaml"]
    (config_map,) = docs
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["namespace"] == "grafana"
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["labels"]["team"] == "platform"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Kubernetes"}
    (text,) = config_map["data"].values()
    assert json.loads(text) == json.loads(DASHBOARD.read_text())
    relabelled = render({"metrics": {"dashboard": {
        "enabled": True, "labels": {"grafana_dashboard": "bootstrap"}}}})["dashboard.yaml"][0]
    assert relabelled["metadata"]["labels"]["grafana_dashboard"] == "bootstrap"


def dashboard_queries() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


def dashboard_panels() -> list[dict]:
    panels = []
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables replaced by values of the same syntactic kind."""
    return (expr.replace("$__rate_interval", "5m").replace("$__range", "1h")
            .replace("$__interval", "1m").replace('"$job"', '"bootstrap-controller"')
            .replace('"$tenant"', '".*"'))


def test_every_dashboard_query_parses(tmp_path):
    queries = dashboard_queries()
    assert len(queries) >= 20, queries
    leftovers = [q for q in queries if "$" in grafana_to_promql(q)]
    assert not leftovers, f"queries with variables the test does not know: {leftovers}"
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": grafana_to_promql(q)}
        for i, q in enumerate(queries)]}]}))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


# The process's own metrics: never labelled with a tenant (up is Prometheus's; bootstrap_leader*
# exist in single-cluster mode only; bootstrap_tenant* in management mode only). Every other
# bootstrap_ metric is a loop's or a runtime's, labelled tenant="<namespace>/<name>" in
# management mode.
PROCESS_METRICS = re.compile(
    r"^(up|bootstrap_leader\w*|bootstrap_tenant\w*|bootstrap_build_info|process_\w+)$")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric, matchers) of every `metric{...}` in `expr`."""
    return re.findall(r"\b(up|bootstrap_\w+|process_\w+)\{([^}]*)\}", expr)


def label_lists(expr: str) -> list[list[str]]:
    """The labels of every `by (...)` and `on (...)` in `expr`."""
    return [[label.strip() for label in labels.split(",")]
            for labels in re.findall(r"\b(?:by|on) \(([^)]*)\)", expr)]


def test_dashboard_has_a_row_per_loop_and_one_for_management_mode():
    loops = ["system-namespaces", "kubernetes-service", "apiserver-endpoints", "apiserver-lease",
             "service-cidr", "clusterip-repair", "nodeport-repair"]
    rows = [p for p in dashboard_panels() if p["type"] == "row"]
    for loop in loops:
        assert any(loop in row["title"] for row in rows), f"no row for {loop}"
    assert any("Management mode" in row["title"] for row in rows)
    queries = " ".join(dashboard_queries())
    for metric in ["bootstrap_tenants", "bootstrap_tenant_config_errors_total"]:
        assert metric + "{" in queries, metric


def test_dashboard_has_a_tenant_variable_that_every_tenant_query_uses():
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    tenant = variables["tenant"]
    assert tenant["type"] == "query"
    assert tenant["query"]["query"] == tenant["definition"]
    assert re.fullmatch(r"label_values\(bootstrap_loop_passes_total(\{[^}]*\})?, tenant\)",
                        tenant["definition"]), tenant["definition"]
    assert tenant["multi"] and tenant["includeAll"]
    # `.*`, not Grafana's default (the values joined) nor `.+`: a single cluster's series, which
    # have no tenant label, must match All.
    assert tenant["allValue"] == ".*"
    # The job variable must find the jobs in both modes.
    assert "bootstrap_tenants" in variables["job"]["definition"]
    checked = 0
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            found = selectors(expr)
            assert found, expr
            process = [m for m, _ in found if PROCESS_METRICS.match(m)]
            for metric, matchers in found:
                if PROCESS_METRICS.match(metric):
                    assert "tenant" not in matchers, f"{metric} has no tenant label: {expr}"
                else:
                    assert 'tenant=~"$tenant"' in matchers, f"{metric} not filtered: {expr}"
            if process:
                assert len(process) == len(found), f"process and tenant metrics mixed: {expr}"
                continue
            checked += 1
            # Matching and aggregation keep tenants apart.
            for labels in label_lists(expr):
                assert "tenant" in labels, f"by/on without tenant: {expr}"
            assert not re.search(r"\b(sum|max|min|avg)\(", expr) or panel["type"] == "stat", \
                f"an aggregation over every tenant: {expr}"
            # Series per tenant are told apart in the legend (empty in single-cluster mode).
            if panel["type"] == "timeseries":
                assert "{{tenant}}" in target["legendFormat"], f"{panel['title']}: {target}"
    assert checked >= 60, checked


def rule_is_per_tenant(alert: dict) -> bool:
    return not all(PROCESS_METRICS.match(m) for m in metric_names(alert["expr"]))


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(?:up|bootstrap_\w+)(?=[{\s)\[]|$)", expr))


def test_every_alert_on_loop_metrics_is_per_tenant_and_names_the_tenant():
    per_tenant = [a for a in alerts() if rule_is_per_tenant(a)]
    assert len(per_tenant) >= 10, [a["alert"] for a in per_tenant]
    for alert in per_tenant:
        for labels in label_lists(alert["expr"]):
            assert "tenant" in labels, f"{alert['alert']}: by/on without tenant"
        # Printed only when the label is set, so single-cluster alerts read as before.
        assert "{{ with $labels.tenant }}" in alert["annotations"]["summary"], alert["alert"]
    process = {a["alert"] for a in alerts() if not rule_is_per_tenant(a)}
    assert process == {"BootstrapControllerDown", "BootstrapNoLeader",
                       "BootstrapTenantConfigInvalid"}, process


def test_lint_strict_passes_with_alerts_and_dashboard_on():
    import helm_python as helm
    values = {"metrics": {
        "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"},
                           "alerts": {"BootstrapNoLeader": {"for": "1m", "severity": "page"}}},
        "dashboard": {"enabled": True, "annotations": {"grafana_folder": "Kubernetes"}},
    }}
    helm.Chart.load(CHART).validate_schema(values)
    report = helm.lint(str(CHART), values, strict=True, namespace="bootstrap")
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems

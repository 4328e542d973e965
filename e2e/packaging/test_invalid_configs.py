"""One table of invalid configurations (invalid_configs.yaml), run through both the binary's
`config validate` and the chart: whatever the binary refuses, `helm install` refuses too, before
any pod crash-loops, and both name the same field."""

from __future__ import annotations

import subprocess
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from harness import CHART, binary, render

HERE = Path(__file__).resolve().parent
ROWS = yaml.safe_load((HERE / "invalid_configs.yaml").read_text())


def names_field(message: str, field: str) -> bool:
    """The schema names a path with slashes (/config/loops/...), the binary and the chart's
    templates with dots: either spelling counts."""
    return field in message or field in message.replace("/", ".")


def chart_refusal(values: dict) -> str | None:
    """What `helm install` prints when it refuses these values, or None when it renders them:
    the schema first, then the templates' own checks."""
    try:
        helm.Chart.load(CHART).validate_schema(values)
        render(values)
    except helm.HelmError as err:
        return str(err)
    return None


def test_the_table_is_well_formed():
    assert len(ROWS) >= 20
    names = [row["name"] for row in ROWS]
    assert len(names) == len(set(names)), "row names repeat"
    for row in ROWS:
        assert set(row) == {"name", "field", "config"}, row
        assert isinstance(row["config"], dict) and row["config"], row


@pytest.mark.parametrize("row", ROWS, ids=[row["name"] for row in ROWS])
def test_the_binary_refuses(row, tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(row["config"]))
    done = subprocess.run(
        [str(binary("bootstrap-controller")), "config", "validate", "--config", str(config)],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert names_field(done.stderr, row["field"]), done.stderr


@pytest.mark.parametrize("row", ROWS, ids=[row["name"] for row in ROWS])
def test_the_chart_refuses(row):
    refusal = chart_refusal({"config": row["config"]})
    assert refusal is not None, f"the chart renders {row['config']}, which the binary refuses"
    assert names_field(refusal, "config." + row["field"]), refusal


def test_valid_neighbours_render():
    """The checks are not blanket refusals: the same fields with valid values render."""
    for config in [
        {"serviceClusterIPRange": "10.96.0.0/12"},
        {"serviceClusterIPRange": "fd00:10:96::/108"},
        {"serviceClusterIPRange": "fd00::/125"},
        {"serviceClusterIPRange": "10.96.0.0/29,fd00:10:96::/108"},
        {"serviceNodePortRange": "1-65535"},
        {"kubernetesServiceNodePort": 30443},
        {"serviceNodePortRange": "20000-22767", "kubernetesServiceNodePort": 20000},
        {"endpointReconcilerType": "static",
         "loops": {"apiserverEndpoints": {"staticAddresses": ["192.0.2.10"]}}},
        {"advertiseAddress": "192.0.2.10", "serviceClusterIPRange": "10.96.0.0/12"},
        {"advertiseAddress": "2001:db8::1", "serviceClusterIPRange": "fd00::/108,10.96.0.0/12"},
        {"leaderElection": {"leaseDuration": "1m", "renewGrace": "59s"}},
        {"leaderElection": {"leaseDuration": "1h", "renewGrace": "1m30s"}},
        {"loops": {"clusterIPRepair": {"orphanGracePeriod": "5s"}}},
        {"loops": {"clusterIPRepair": {"interval": "8760h"}}, "shutdownTimeout": "8760h"},
        {"loops": {"nodePortRepair": {"leakSightingSpacing": "8760h"}}},
        {"leaderElection": {"identity": "\u00e9" * 64}},
        {"loops": {"systemNamespaces": {"interval": "500ms"}}},
        {"adminAddr": "[::]:8080"},
    ]:
        assert chart_refusal({"config": config}) is None, config


def schema_properties(node: dict, path: str = ""):
    for key, sub in node.get("properties", {}).items():
        here = f"{path}.{key}" if path else key
        yield here, sub
        yield from schema_properties(sub, here)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from schema_properties(node[key], path + "[]")


def test_every_value_in_the_schema_is_described():
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    undescribed = [path for path, sub in schema_properties(schema)
                   if not str(sub.get("description", "")).strip()]
    assert undescribed == [], f"values without a description in values.schema.json: {undescribed}"


MISPLACED = yaml.safe_load("""
serviceMonitor: {value: {enabled: true}, lives: metrics.serviceMonitor}
prometheusRule: {value: {enabled: true}, lives: metrics.prometheusRule}
securePort: {value: 443, lives: config.securePort}
serviceClusterIPRange: {value: 10.96.0.0/12, lives: config.serviceClusterIPRange}
endpointReconcilerType: {value: static, lives: config.endpointReconcilerType}
dryRun: {value: true, lives: config.dryRun}
""")


@pytest.mark.parametrize("key", sorted(MISPLACED))
def test_keys_of_other_charts_are_refused_saying_where_they_live(key):
    refusal = chart_refusal({key: MISPLACED[key]["value"]})
    assert refusal is not None, key
    assert f"it lives at {MISPLACED[key]['lives']}" in refusal, refusal


def test_conventional_keys_are_where_users_look():
    """What users of well-known charts set first is at the place they look for it."""
    schema = yaml.safe_load((CHART / "values.schema.json").read_text())
    top = schema["properties"]
    for key in ("podAnnotations", "podLabels", "resources", "nodeSelector", "tolerations",
                "affinity", "imagePullSecrets", "serviceAccount", "priorityClassName"):
        assert "type" in top[key], f"{key} is not a value at the top"
    assert "enabled" in top["metrics"]["properties"]["serviceMonitor"]["properties"]
    assert "securePort" in top["config"]["properties"]
    # The setting that decides the `kubernetes` Service's targetPort is shown in values.yaml,
    # left out by default so that a managed cluster's 443 is kept.
    values = (CHART / "values.yaml").read_text()
    config = values.split("\nconfig:\n", 1)[1].split("\n\n", 1)[0]
    assert "securePort" in config, "values.yaml does not show config.securePort"
    assert "securePort" not in yaml.safe_load(values)["config"]


@pytest.mark.parametrize("mode", ["lease", "master-count"])
def test_own_address_modes_in_the_deployment_need_an_address_every_replica_stands_for(mode):
    """`lease` (the sidecar's mode) and `master-count` list the advertise address: in the chart's
    Deployment each pod would advertise its own (the binary accepts it: a pod has a default
    route), so the chart refuses them unless the address is given."""
    refusal = chart_refusal({"config": {"endpointReconcilerType": mode}})
    assert refusal is not None and f"config.endpointReconcilerType: {mode}" in refusal, refusal
    assert "static" in refusal and "sidecar" in refusal, refusal
    assert chart_refusal({"config": {"endpointReconcilerType": mode,
                                     "advertiseAddress": "192.0.2.1"}}) is None

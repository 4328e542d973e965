"""The check e2e/node/conformance.sh runs after upstream's tests (conformance_audit.py) fails on
a write of the controller to an object the tests made and passes on events alone, fed audit
lines as kube-apiserver writes them at the Metadata level; and the focus file it runs is sound."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from harness import ROOT

NODE = ROOT / "e2e" / "node"
sys.path.insert(0, str(NODE))
import conformance_audit  # noqa: E402

CONTROLLER = "system:bootstrap-controller"
TESTS = "kubernetes-admin"
BEFORE = {
    "since": "2026-01-01T10:00:00.000000Z",
    "user": CONTROLLER,
    "namespaces": ["default", "kube-system", "kube-public", "kube-node-lease"],
    "ipaddresses": ["198.19.0.1", "198.19.0.10"],
}


def event(user: str, verb: str, resource: str, name: str = "", namespace: str = "",
          at: str = "2026-01-01T10:00:05.000000Z", code: int = 201, group: str = "") -> dict:
    ref = {"resource": resource, "apiVersion": "v1"}
    if group:
        ref["apiGroup"] = group
    if namespace:
        ref["namespace"] = namespace
    if name:
        ref["name"] = name
    return {"kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
            "stage": "ResponseComplete", "verb": verb, "user": {"username": user},
            "objectRef": ref, "responseStatus": {"code": code},
            "requestReceivedTimestamp": at, "stageTimestamp": at}


def a_test_run() -> list[dict]:
    """A test's requests: its namespace, a Service in it, the Service's deletion."""
    return [
        event(TESTS, "create", "namespaces", "services-4821"),
        event(TESTS, "create", "services", "nodeport-test", "services-4821"),
        event(TESTS, "delete", "services", "nodeport-test", "services-4821",
              at="2026-01-01T10:00:20.000000Z", code=200),
        # The controller at its own objects, which no test made.
        event(CONTROLLER, "update", "endpoints", "kubernetes", "default", code=200),
        event(CONTROLLER, "patch", "servicecidrs", "kubernetes", group="networking.k8s.io", code=200),
    ]


def write_log(tmp_path, events: list[dict]):
    log = tmp_path / "audit.log"
    log.write_text("".join(json.dumps(e) + "\n" for e in events))
    before = tmp_path / "before.json"
    before.write_text(json.dumps(BEFORE))
    return before, log


def run_check(tmp_path, events: list[dict]) -> subprocess.CompletedProcess:
    before, log = write_log(tmp_path, events)
    return subprocess.run([sys.executable, str(NODE / "conformance_audit.py"), str(before), str(log)],
                          capture_output=True, text=True, timeout=60)


def test_the_controller_creating_an_ipaddress_for_a_test_service_fails_the_check(tmp_path):
    # An IPAddress re-created for the test's Service after it was deleted: the repair's mistake.
    ipaddress = event(CONTROLLER, "create", "ipaddresses", "198.19.41.7", group="networking.k8s.io",
                      at="2026-01-01T10:01:20.000000Z")
    result = run_check(tmp_path, a_test_run() + [ipaddress])
    assert result.returncode == 1, result
    assert "create ipaddresses/198.19.41.7 -> 201 (system:bootstrap-controller)" in result.stdout, result.stdout


def test_events_alone_pass_the_check(tmp_path):
    reports = [event(CONTROLLER, "create", "events", "nodeport-test.18a2", "services-4821"),
               event(CONTROLLER, "create", "events", "nodeport-test.18a3", "services-4821",
                     group="events.k8s.io")]
    result = run_check(tmp_path, a_test_run() + reports)
    assert result.returncode == 0, result
    assert "wrote nothing but events" in result.stdout, result.stdout
    assert "the tests' namespaces: 1" in result.stdout, result.stdout


def test_each_kind_of_test_object_is_judged():
    written = [
        # In a test's namespace, whatever the resource.
        event(CONTROLLER, "patch", "services", "nodeport-test", "services-4821", code=200),
        event(CONTROLLER, "delete", "endpointslices", "nodeport-test-abcde", "services-4821", code=200),
        # The namespace itself.
        event(CONTROLLER, "update", "namespaces", "services-4821", code=200),
        # A cluster-scoped object a test created (a second ServiceCIDR).
        event(TESTS, "create", "servicecidrs", "test-svc-cidr", group="networking.k8s.io"),
        event(CONTROLLER, "delete", "servicecidrs", "test-svc-cidr", group="networking.k8s.io", code=200),
    ]
    found = conformance_audit.controller_writes(a_test_run() + written, BEFORE)
    assert [(e["verb"], e["objectRef"]["resource"]) for e in found] == [
        ("patch", "services"), ("delete", "endpointslices"), ("update", "namespaces"),
        ("delete", "servicecidrs")], found
    # Before the run, the same writes are not the tests' business.
    early = [dict(e, requestReceivedTimestamp="2026-01-01T09:59:00.000000Z") for e in written]
    assert conformance_audit.controller_writes(a_test_run() + early, BEFORE) == []


def test_a_run_without_a_test_namespace_fails_the_check(tmp_path):
    result = run_check(tmp_path, [event(CONTROLLER, "update", "endpoints", "kubernetes", "default", code=200)])
    assert result.returncode == 1, result
    assert "nothing to judge" in result.stderr, result.stderr


def test_the_focus_file_names_specs_and_a_count():
    text = (NODE / "conformance.focus").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    expect = [line for line in lines if line.startswith("expect ")]
    focus = [line for line in lines if not line.startswith("expect ")]
    assert len(expect) == 1 and re.fullmatch(r"expect [1-9][0-9]*", expect[0]), expect
    assert len(focus) >= 10, focus
    for line in focus:
        re.compile(line)
        # A line the others repeat would prove nothing of its own.
        assert focus.count(line) == 1, line
    # Every line of upstream's names says what it is there for: a comment block precedes it.
    blocks = text.split("\n\n")
    for block in blocks:
        body = [line for line in block.splitlines() if line and not line.startswith("#")]
        if body and not body[0].startswith("expect "):
            assert block.lstrip().startswith("#"), block

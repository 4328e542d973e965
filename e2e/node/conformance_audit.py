"""Judges the controller after upstream's conformance tests ran against the node
(e2e/node/conformance.sh): the tests pass whatever the controller wrote beside them, so the
node's audit logs are read for what it wrote to the objects the tests made. The controller
keeps the `kubernetes` Service, its endpoints, the system namespaces and the default ServiceCIDR;
to an object a test made it may write events, nothing else (upstream's repair loops only report
on a Service, and never recreate an IPAddress whose Service is gone).

The tests' objects are told by what the run started with (conformance.sh records it):
  - every namespace that did not exist then (upstream's framework names its namespaces after
    the test, with a random suffix), the namespace itself and everything in it;
  - every IPAddress that did not exist then (a test Service's ClusterIP, or the IPAddress API
    test's own);
  - every cluster-scoped object another user created during the run (ServiceCIDRs of the
    ServiceCIDR tests, for instance).

Usage: python3 conformance_audit.py BEFORE.json AUDIT.log [AUDIT.log ...]
BEFORE.json: {"since": audit timestamp, "user": the controller's user name, "namespaces": [...],
"ipaddresses": [...]}. Prints each offending write and exits 1 when there is one.
"""

import json
import sys

WRITES = {"create", "update", "patch", "delete", "deletecollection"}
# Events are how the controller reports on objects that are not its own.
ALLOWED_RESOURCES = {"events"}


def read_events(paths: list[str]) -> list[dict]:
    """Every completed request in the audit logs `paths`, oldest first."""
    events = []
    for path in paths:
        with open(path) as log:
            for line in log:
                if line.strip():
                    event = json.loads(line)
                    if event.get("stage") == "ResponseComplete":
                        events.append(event)
    events.sort(key=lambda e: e["requestReceivedTimestamp"])
    return events


def test_objects(events: list[dict], before: dict) -> tuple[set, set]:
    """(the namespaces the tests made, the cluster-scoped (resource, name) others created)
    among the requests received since `before["since"]`."""
    existing = set(before["namespaces"])
    namespaces, cluster_scoped = set(), set()
    for event in events:
        if event["requestReceivedTimestamp"] < before["since"]:
            continue
        ref = event.get("objectRef", {})
        namespace = ref.get("namespace")
        if namespace and namespace not in existing:
            namespaces.add(namespace)
        if ref.get("resource") == "namespaces" and ref.get("name") and ref["name"] not in existing:
            namespaces.add(ref["name"])
        if (not namespace and event["verb"] == "create" and ref.get("name")
                and event.get("user", {}).get("username") != before["user"]
                and ref.get("resource") != "namespaces"
                and event.get("responseStatus", {}).get("code", 0) < 300):
            cluster_scoped.add((ref.get("resource"), ref["name"]))
    return namespaces, cluster_scoped


def controller_writes(events: list[dict], before: dict) -> list[dict]:
    """The controller's writes, since `before["since"]`, to the tests' objects, events left
    out."""
    namespaces, cluster_scoped = test_objects(events, before)
    existing_ips = set(before["ipaddresses"])
    found = []
    for event in events:
        if (event["requestReceivedTimestamp"] < before["since"]
                or event.get("user", {}).get("username") != before["user"]
                or event["verb"] not in WRITES):
            continue
        ref = event.get("objectRef", {})
        resource, name = ref.get("resource"), ref.get("name")
        if resource in ALLOWED_RESOURCES:
            continue
        if (ref.get("namespace") in namespaces
                or (resource == "namespaces" and name in namespaces)
                or (resource == "ipaddresses" and name not in existing_ips)
                or (resource, name) in cluster_scoped):
            found.append(event)
    return found


def describe(event: dict) -> str:
    ref = event.get("objectRef", {})
    where = "/".join(p for p in (ref.get("namespace"), ref.get("resource"), ref.get("name"),
                                 ref.get("subresource")) if p)
    code = event.get("responseStatus", {}).get("code")
    return f"{event['requestReceivedTimestamp']} {event['verb']} {where} -> {code} ({event['user']['username']})"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.split("Usage: ", 1)[1], file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        before = json.load(f)
    events = read_events(argv[2:])
    namespaces, cluster_scoped = test_objects(events, before)
    found = controller_writes(events, before)
    print(f"conformance_audit: {len(events)} requests read; the tests' namespaces: {len(namespaces)}, "
          f"their cluster-scoped objects: {len(cluster_scoped)}")
    if not namespaces:
        # A run that made no namespace ran no test: nothing was judged.
        print("conformance_audit: no namespace made by the tests in the audit logs: nothing to judge",
              file=sys.stderr)
        return 1
    for event in found:
        print(f"conformance_audit: the controller wrote to a test's object: {describe(event)}")
    if found:
        print(f"conformance_audit: {len(found)} write(s) of {before['user']} to the tests' objects",
              file=sys.stderr)
        return 1
    print(f"conformance_audit: {before['user']} wrote nothing but events to the tests' objects")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

"""The chart's RBAC and deploy/sidecar/rbac.yaml judged by the real RBAC authorizer: a real
control plane (e2e/control-plane/up.sh: etcd, kube-apiservers with --authorization-mode=RBAC and
an audit log, kube-controller-manager) and the controller running as a user of its own (a client
certificate, no system:masters) bound only to the RBAC objects rendered for one values case (their
ServiceAccount subject re-pointed to that user). Drift is made for every loop; then the audit log
is read: no request of that user was refused (403), and every granted verb is used in some case.

This is the primary RBAC proof. test_chart.py's request-log proof on the simulator is the fast
one (and the one that can inject the faults that make the rarer requests).

One control plane serves every case, with three apiservers: 1 for the cases that stop nothing, 2
and 3 each for one `lease`-mode case, which ends by stopping its apiserver (SIGTERM), so that the
controller withdraws its membership Lease through it (the `delete` a Lease grant is for)."""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from harness import ROOT, Controller, complete_lines, container_args, objects
from test_chart import CASES, RACE_ONLY, RBAC_VALUES, allows, granted

UP = ROOT / "e2e" / "control-plane" / "up.sh"
DOWN = ROOT / "e2e" / "control-plane" / "down.sh"
KUBECONFIG_SH = ROOT / "e2e" / "control-plane" / "kubeconfig.sh"
SIDECAR_RBAC = ROOT / "deploy" / "sidecar" / "rbac.yaml"
SIDECAR_POD = ROOT / "deploy" / "sidecar" / "bootstrap-controller.yaml"
RBAC_KINDS = ("ClusterRole", "Role", "ClusterRoleBinding", "RoleBinding")
# Short intervals so a case takes seconds; they change no grant.
FAST = {"apiserverEndpoints": {"interval": "1s", "leaseTTL": "3s"},
        "clusterIPRepair": {"orphanGracePeriod": "5s"}}


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def with_fast_loops(values: dict) -> dict:
    return merge(values, {"config": {"loops": FAST}})


# The values cases of test_chart.py that render RBAC, each run against apiserver `n`. Addresses
# that end up in the cluster's objects are TEST-NET ones.
STATIC = {"endpointReconcilerType": "static",
          "loops": {"apiserverEndpoints": {"staticAddresses": ["192.0.2.10"]}}}
CHART_CASES = {
    "defaults": (CASES["defaults"], 1),
    "static": (merge(CASES["defaults"], {"config": STATIC}), 1),
    "etcd": (CASES["etcd"], 1),
    # The hosted release's RBAC, rendered for the target cluster (rbac.create=true there, bound
    # to the kubeconfig's identity).
    "hosted": (merge(CASES["hosted"], {"rbac": {"create": True, "subjects": [
        {"kind": "User", "name": "system:bootstrap-controller"}]}, "config": STATIC}), 1),
    "lease": (RBAC_VALUES, 2),
}


class ControlPlane:
    def __init__(self, directory: Path, apiservers: int):
        self.dir = directory
        # A stopping apiserver serves 10 s before it closes (up.sh's is 3 s), so that the
        # withdrawal of a lease-mode case, whose grant on deleting Leases is what it shows, goes
        # through it however loaded the machine: the grant is the question, not the timing.
        done = subprocess.run([str(UP), str(directory), "--apiservers", str(apiservers),
                               "--apiserver-flag", "--shutdown-delay-duration=10s"],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"up.sh failed:\n{done.stdout}\n{done.stderr}")
        self.env = dict(line.split("=", 1) for line in (directory / "env").read_text().split("\n")
                        if "=" in line)
        self.admin = directory / "admin.kubeconfig"

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None):
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.admin), *args],
                              input=stdin, capture_output=True, text=True)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}{done.stdout}")
        return done

    def apply(self, docs: list[dict]) -> None:
        self.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
                                                          "items": docs}))

    def get(self, *args: str) -> dict | None:
        done = self.kubectl("get", *args, "-o", "json", check=False)
        return json.loads(done.stdout) if done.returncode == 0 else None

    def user(self, name: str, apiserver: int) -> Path:
        out = subprocess.run([str(KUBECONFIG_SH), str(self.dir), name, "--apiserver",
                              str(apiserver)], capture_output=True, text=True, check=True)
        return Path(out.stdout.strip().splitlines()[-1])

    def audit(self, user: str) -> list[dict]:
        events = []
        for n in range(1, int(self.env["APISERVERS"]) + 1):
            path = self.dir / f"audit-{n}.log"
            for line in complete_lines(path) if path.exists() else []:
                event = json.loads(line)
                if event.get("user", {}).get("username") == user:
                    events.append(event)
        return events

    def signal(self, name: str, signal: str) -> None:
        pids = dict(line.split() for line in (self.dir / "pids").read_text().splitlines())
        subprocess.run(["kill", f"-{signal}", pids[name]], check=True)

    def stop(self) -> None:
        subprocess.run([str(DOWN), str(self.dir)], capture_output=True)


class Bitmap:
    """kube-apiserver's node port bitmap in etcd (`/registry/ranges/servicenodeports`: `k8s\\0`
    and a runtime.Unknown around a RangeAllocation), changed by compare-and-swap through etcd's
    JSON gateway, as a lost write would leave it."""

    KEY = base64.b64encode(b"/registry/ranges/servicenodeports").decode()

    def __init__(self, url: str):
        self.url = url

    def call(self, path: str, body: dict) -> dict:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    @staticmethod
    def fields(buf: bytes) -> list[tuple[int, int, bytes | int]]:
        out, i = [], 0

        def varint():
            nonlocal i
            value = shift = 0
            while True:
                byte = buf[i]
                i += 1
                value |= (byte & 0x7F) << shift
                shift += 7
                if byte < 0x80:
                    return value

        while i < len(buf):
            key = varint()
            number, wire = key >> 3, key & 7
            if wire == 0:
                out.append((number, wire, varint()))
            elif wire == 2:
                length = varint()
                out.append((number, wire, buf[i:i + length]))
                i += length
            else:
                raise ValueError(f"unexpected wire type {wire}")
        return out

    @staticmethod
    def encode(fields: list[tuple[int, int, bytes | int]]) -> bytes:
        def varint(value: int) -> bytes:
            out = bytearray()
            while True:
                byte = value & 0x7F
                value >>= 7
                if value:
                    out.append(byte | 0x80)
                else:
                    out.append(byte)
                    return bytes(out)

        out = bytearray()
        for number, wire, value in fields:
            out += varint(number << 3 | wire)
            out += varint(value) if wire == 0 else varint(len(value)) + value
        return bytes(out)

    def set(self, port: int, allocated: bool) -> None:
        offset = port - 30000
        for _ in range(10):
            kv = self.call("/v3/kv/range", {"key": self.KEY})["kvs"][0]
            value = base64.b64decode(kv["value"])
            assert value.startswith(b"k8s\0"), value[:16]
            unknown = self.fields(value[4:])
            raw = next(v for n, _, v in unknown if n == 2)
            allocation = self.fields(raw)
            data = next((v for n, _, v in allocation if n == 3), b"")
            bits = int.from_bytes(data, "big")
            bits = bits | (1 << offset) if allocated else bits & ~(1 << offset)
            data = bits.to_bytes((bits.bit_length() + 7) // 8, "big")
            allocation = [f for f in allocation if f[0] != 3] + [(3, 2, data)]
            unknown = [(n, w, self.encode(allocation) if n == 2 else v) for n, w, v in unknown]
            new = b"k8s\0" + self.encode(unknown)
            answer = self.call("/v3/kv/txn", {
                "compare": [{"key": self.KEY, "target": "MOD", "result": "EQUAL",
                             "mod_revision": kv["mod_revision"]}],
                "success": [{"request_put": {"key": self.KEY,
                                             "value": base64.b64encode(new).decode()}}],
            })
            if answer.get("succeeded"):
                return
        raise AssertionError("the node port bitmap changed under ten compare-and-swaps")

    def holds(self, port: int) -> bool:
        kv = self.call("/v3/kv/range", {"key": self.KEY})["kvs"][0]
        raw = next(v for n, _, v in self.fields(base64.b64decode(kv["value"])[4:]) if n == 2)
        data = next((v for n, _, v in self.fields(raw) if n == 3), b"")
        return bool(int.from_bytes(data, "big") >> (port - 30000) & 1)


def for_user(docs: list[dict], user: str) -> list[dict]:
    """The RBAC objects, their bindings' subjects replaced by `user`."""
    out = []
    for doc in docs:
        if doc["kind"] not in RBAC_KINDS:
            continue
        doc = copy.deepcopy(doc)
        if doc["kind"].endswith("Binding"):
            doc["subjects"] = [{"kind": "User", "name": user,
                                "apiGroup": "rbac.authorization.k8s.io"}]
        out.append(doc)
    return out


def used(events: list[dict]) -> set[tuple]:
    """Each request as the authorizer saw it: (namespace, group, resource[/sub], verb, name)."""
    out = set()
    for event in events:
        ref = event.get("objectRef")
        if not ref or "resource" not in ref:
            continue  # non-resource URLs (discovery, /readyz)
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        out.add((ref.get("namespace"), ref.get("apiGroup", ""), resource, event["verb"],
                 ref.get("name")))
    return out


def wait(what: str, check, timeout: float = 60) -> float:
    started = time.monotonic()
    while True:
        try:
            if check():
                return time.monotonic() - started
        except (AssertionError, KeyError, TypeError, IndexError):
            pass
        if time.monotonic() - started > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def exercise(cp: ControlPlane, config: dict, etcd_mode: bool, log, mode: str) -> None:
    """Breaks what each enabled loop keeps, waiting for each repair."""
    k = cp.kubectl
    loops = config.get("loops") or {}

    def uid(*args):
        obj = cp.get(*args)
        return obj and obj["metadata"]["uid"]

    def recreated(what, *args, timeout=60):
        """Deletes the object and waits for one with another uid."""
        before = uid(*args)
        k("delete", *args, "--wait=false")
        log(what, wait(f"{what}: back", lambda: uid(*args) not in (None, before), timeout))

    # System namespaces: a deleted one recreated once the real namespace controller finalized it;
    # a declared label restored.
    recreated("kube-node-lease", "namespace", "kube-node-lease")
    for ns in (loops.get("systemNamespaces") or {}).get("namespaces", []):
        for label in ns.get("labels") or {}:
            wait(f"{ns['name']} created", lambda: cp.get("namespace", ns["name"]))
            k("label", "namespace", ns["name"], f"{label}-")
            wait(f"label {label} restored", lambda: label in (
                cp.get("namespace", ns["name"])["metadata"].get("labels") or {}))

    # The kubernetes Service: a port repaired, the Service recreated.
    k("patch", "service", "kubernetes", "--type=json",
      "-p", '[{"op":"replace","path":"/spec/ports/0/port","value":8443}]')
    wait("port 443 back", lambda: cp.get("service", "kubernetes")["spec"]["ports"][0]["port"]
         == 443)
    recreated("kubernetes Service", "service", "kubernetes")

    # The default ServiceCIDR: deleted (its finalizer taken off, as kube-controller-manager's
    # servicecidrs controller, not running here, would) and recreated.
    before = uid("servicecidr", "kubernetes")
    k("delete", "servicecidr", "kubernetes", "--wait=false")
    k("patch", "servicecidr", "kubernetes", "--type=merge", "-p",
      '{"metadata":{"finalizers":null}}', check=False)
    log("servicecidr", wait("servicecidr back", lambda: uid("servicecidr", "kubernetes")
                            not in (None, before)))
    wait("servicecidr ready", lambda: any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in cp.get("servicecidr", "kubernetes")["status"]["conditions"]))

    # The endpoints: recreated, repaired; a stray slice deleted.
    if mode != "none":
        recreated("endpoints", "endpoints", "kubernetes")
        k("patch", "endpoints", "kubernetes", "--type=json",
          "-p", '[{"op":"replace","path":"/subsets/0/ports/0/port","value":1}]')
        wait("endpoints port back", lambda: cp.get("endpoints", "kubernetes")
             ["subsets"][0]["ports"][0]["port"] != 1)
        k("patch", "endpointslice", "kubernetes", "--type=json",
          "-p", '[{"op":"replace","path":"/ports/0/port","value":1}]')
        wait("slice port back", lambda: cp.get("endpointslice", "kubernetes")
             ["ports"][0]["port"] != 1)
        cp.apply([{
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "kubernetes-stray", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "kubernetes"}},
            "addressType": "IPv4", "endpoints": [], "ports": [],
        }])
        wait("stray slice deleted", lambda: cp.get("endpointslice", "kubernetes-stray") is None)

    # ClusterIP repair: a Service's lost IPAddress recreated (kube-apiserver's own repair races
    # for it), a leaked one deleted (after a live read of its parent Service).
    k("create", "service", "clusterip", "web", "--tcp=80:80")
    ip = cp.get("service", "web")["spec"]["clusterIP"]
    recreated("web's IPAddress", "ipaddress", ip)
    cp.apply([{
        "apiVersion": "networking.k8s.io/v1", "kind": "IPAddress",
        "metadata": {"name": "10.96.200.200",
                     "labels": {"ipaddress.kubernetes.io/managed-by": "ipallocator.k8s.io",
                                "ipaddress.kubernetes.io/ip-family": "IPv4"}},
        "spec": {"parentRef": {"group": "", "resource": "services", "namespace": "default",
                               "name": "gone"}},
    }])
    wait("leaked IPAddress deleted", lambda: cp.get("ipaddress", "10.96.200.200") is None, 90)

    # NodePort repair. The real apiserver refuses a duplicate node port unless its bit is lost.
    bitmap = Bitmap(cp.env["ETCD_URL"])
    k("create", "service", "nodeport", "np-a", "--tcp=80:80", "--node-port=30080")

    def events(reason):
        items = cp.get("events.events.k8s.io", "-A")["items"]
        return [e for e in items if e.get("reason") == reason]

    if etcd_mode:
        # The lost bit set again, and the Service told (an event).
        bitmap.set(30080, False)
        wait("30080 set again", lambda: bitmap.holds(30080))
        wait("PortNotAllocated event", lambda: events("PortNotAllocated"))
    else:
        # A duplicate reported, then, after it cleared and came back on the same Service (a
        # Service recreated is another object, with an event of its own), reported again into
        # the first event's series.
        bitmap.set(30080, False)
        k("create", "service", "nodeport", "np-b", "--tcp=80:80", "--node-port=30080")
        wait("PortAlreadyAllocated event", lambda: events("PortAlreadyAllocated"))
        for port in (30081, 30080):  # moving away releases 30080, still np-a's
            k("patch", "service", "np-b", "--type=json", "-p",
              f'[{{"op":"replace","path":"/spec/ports/0/nodePort","value":{port}}}]')
            time.sleep(2)
        wait("the duplicate's event series", lambda: any(
            (e.get("series") or {}).get("count", 1) > 1 for e in events("PortAlreadyAllocated")))


def clean(cp: ControlPlane) -> None:
    """What one case leaves that the next must not find: its test Services and events, the
    leader Lease (so the next case's controller creates it)."""
    for name in ("web", "np-a", "np-b"):
        cp.kubectl("delete", "service", name, "--ignore-not-found")
    cp.kubectl("delete", "events.events.k8s.io", "--all", "-A")
    cp.kubectl("delete", "lease", "-n", "kube-system", "bootstrap-controller",
               "--ignore-not-found")


@pytest.fixture(scope="module")
def control_plane():
    with tempfile.TemporaryDirectory(prefix="bc-rbac-real-") as tmp:
        cp = ControlPlane(Path(tmp) / "cp", 3)
        try:
            yield cp
        finally:
            cp.stop()


def run_case(cp: ControlPlane, name: str, rbac: list[dict], config: dict, args: list[str],
             env: dict, apiserver: int, tmp: Path, timings: dict) -> tuple[set, list]:
    """One case: `rbac` bound to a fresh user, the controller as that user with the case's
    `config`, drift for every loop; returns the requests the audit log shows and the refused
    ones."""
    user = f"rbac-{name}"
    previous = [d for d in cp.kubectl("get", ",".join(
        ["clusterroles", "clusterrolebindings", "roles", "rolebindings"]), "-A",
        "-l", "bootstrap-controller.io/rbac-real-test", "-o", "name").stdout.split()]
    for obj in previous:
        cp.kubectl("delete", "--all-namespaces", obj, check=False)
    docs = for_user(rbac, user)
    for doc in docs:
        doc["metadata"].setdefault("labels", {})["bootstrap-controller.io/rbac-real-test"] = name
    cp.apply(docs)
    kubeconfig = cp.user(user, apiserver)
    config_file = tmp / f"{name}-config.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {**env, "BOOTSTRAP_CONFIG": str(config_file), "BOOTSTRAP_KUBECONFIG": str(kubeconfig),
           "BOOTSTRAP_SHUTDOWN_TIMEOUT": "10s"}
    controller = Controller(args, env, tmp, name)
    # The flag's variable wins over the file, as in the binary; named by neither, the endpoints
    # loop is off.
    mode = env.get("BOOTSTRAP_ENDPOINT_RECONCILER_TYPE") or config.get("endpointReconcilerType",
                                                                        "none")
    lease_mode = mode == "lease"

    def log(what, seconds):
        timings.setdefault(name, []).append(f"{what} {seconds:.1f} s")

    try:
        started = time.monotonic()
        controller.wait_ready()
        log("ready", time.monotonic() - started)
        etcd_mode = "BOOTSTRAP_ETCD_SERVERS" in env
        try:
            exercise(cp, config, etcd_mode, log, mode)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}\n{controller.output()[-6000:]}") from err
        if lease_mode:
            # Its apiserver stopping: the controller withdraws its membership Lease through it
            # (while the apiserver serves its shutdown delay).
            members = (config.get("loops") or {}).get("apiserverEndpoints", {}).get(
                "leaseNamespace", "kube-system")
            cp.signal(f"kube-apiserver-{apiserver}", "TERM")
            log("withdrawn", wait("the membership Lease deleted", lambda: any(
                e["verb"] == "delete" and e["objectRef"].get("resource") == "leases"
                and e["objectRef"].get("namespace") == members
                for e in cp.audit(user)), 30))
    finally:
        status = controller.stop()
    if not lease_mode:
        assert status == 0, controller.output()
    events = cp.audit(user)
    refused = sorted({f"{e['verb']} {json.dumps(e.get('objectRef'))}" for e in events
                      if e.get("responseStatus", {}).get("code") == 403})
    clean(cp)
    return used(events), refused


def chart_case(values: dict, cp: ControlPlane) -> tuple[list[dict], dict, list[str], dict]:
    rendered = objects(with_fast_loops(values))
    args, env = container_args(rendered)
    config = yaml.safe_load(next(o for o in rendered if o["kind"] == "ConfigMap")
                            ["data"]["config.yaml"])
    # The chart's etcd client files and URL are the pod's; the control plane's etcd is plain
    # http on loopback.
    for key in ("BOOTSTRAP_ETCD_CAFILE", "BOOTSTRAP_ETCD_CERTFILE", "BOOTSTRAP_ETCD_KEYFILE",
                "BOOTSTRAP_ADMIN_ADDR"):
        env.pop(key, None)
    if "BOOTSTRAP_ETCD_SERVERS" in env:
        env["BOOTSTRAP_ETCD_SERVERS"] = cp.env["ETCD_URL"]
    env["POD_NAME"] = "bc-0"
    env["BOOTSTRAP_ADVERTISE_ADDRESS"] = "192.0.2.2"
    # The release namespace exists, as `helm install --create-namespace` makes it.
    cp.kubectl("create", "namespace", "bootstrap", check=False)
    return [o for o in rendered if o["kind"] in RBAC_KINDS], config, args, env


def sidecar_case(cp: ControlPlane) -> tuple[list[dict], dict, list[str], dict]:
    docs = [d for d in yaml.safe_load_all(SIDECAR_RBAC.read_text()) if d]
    cp.apply([d for d in docs if d["kind"] == "Namespace"])
    pod = [d for d in yaml.safe_load_all(SIDECAR_POD.read_text()) if d]
    args, env = container_args(pod, kind="Pod")
    env = {k: v.replace("$(HOST_IP)", "192.0.2.3").replace("$(NODE_NAME)", "node-3")
           for k, v in env.items() if k not in ("BOOTSTRAP_ADMIN_ADDR",)}
    # What deploy/sidecar/setup-node.sh writes, with the short intervals.
    config = merge({"loops": {"apiserverEndpoints": {"leaseNamespace": "bootstrap-controller"}}},
                   {"loops": FAST})
    return docs, config, args, env


def test_rbac_from_the_real_authorizer(control_plane):
    """Each rendered case and the sidecar's RBAC: no request refused, every grant used in some
    case."""
    cp = control_plane
    # The judge itself: a user bound to nothing is refused, and the audit log read here says so.
    nobody = cp.user("rbac-nobody", 1)
    denied = subprocess.run(["kubectl", "--kubeconfig", str(nobody), "get", "services"],
                            capture_output=True, text=True)
    assert denied.returncode != 0 and "forbidden" in denied.stderr, denied.stderr
    assert [e for e in cp.audit("rbac-nobody")
            if e.get("responseStatus", {}).get("code") == 403], "no 403 in the audit log"
    cases = {name: (chart_case(values, cp), n) for name, (values, n) in CHART_CASES.items()}
    cases["sidecar"] = (sidecar_case(cp), 3)
    problems: list[str] = []
    grants: dict[tuple, list[str]] = {}
    used_by_case: dict[str, set] = {}
    timings: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="bc-rbac-real-run-") as tmp:
        for name, ((rbac, config, args, env), apiserver) in cases.items():
            started = time.monotonic()
            requests, refused = run_case(cp, name, rbac, config, args, env, apiserver, Path(tmp),
                                         timings)
            timings[name].append(f"case {time.monotonic() - started:.1f} s")
            used_by_case[name] = requests
            problems += [f"{name}: refused (403): {r}" for r in refused]
            for grant in granted(rbac):
                grants.setdefault(grant, []).append(name)
    for name, lines in timings.items():
        print(f"real RBAC {name}: {len(used_by_case[name])} kinds of request; " + ", ".join(lines))
    print(f"real RBAC: {len(grants)} grants judged")
    # Not a failure (another case may need the grant), but worth a look: what a case's own
    # rendering grants that its controller never used.
    for name, requests in used_by_case.items():
        for grant in sorted({g for g, in_cases in grants.items() if name in in_cases}, key=str):
            if not any(allows(grant, request) for request in requests):
                print(f"real RBAC {name}: granted, unused in this case: {grant}")
    assert RACE_ONLY in grants, grants
    for grant, in_cases in sorted(grants.items(), key=str):
        if grant == RACE_ONLY:
            continue
        if not any(allows(grant, request) for case in in_cases for request in used_by_case[case]):
            problems.append(f"granted but never used (granted in {', '.join(in_cases)}): {grant}")
    assert not problems, "\n".join(problems)

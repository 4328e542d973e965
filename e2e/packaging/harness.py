"""Shared pieces of the packaging tests: the repository's binaries, the simulator and the
controller as processes, the chart rendered with the real Helm engine, a local etcd with TLS."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "bootstrap-controller"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug"


def complete_lines(path: Path) -> list[str]:
    """The whole lines of a log kube-apiserver appends to while this reads: a last line without
    its newline is still being written and is left for the next read."""
    text = path.read_text()
    return text[: text.rfind("\n") + 1].splitlines()


def binary(name: str) -> Path:
    path = TARGET / name
    if not path.exists():
        raise RuntimeError(
            f"{path} is missing: build the binaries first (`cargo build --workspace --bins`, "
            "or run `cargo test --workspace`, which builds them)"
        )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def render(values: dict, namespace: str = "bootstrap") -> dict[str, list[dict]]:
    """The chart's objects per template, as `helm template` would write them."""
    chart = helm.Chart.load(CHART)
    rendered = chart.render(values, name="bc", namespace=namespace, is_install=True)
    out: dict[str, list[dict]] = {}
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        docs = [d for d in yaml.safe_load_all(text) if d]
        if docs:
            out[path.rsplit("/", 1)[-1]] = docs
    return out


def objects(values: dict, namespace: str = "bootstrap") -> list[dict]:
    return [doc for docs in render(values, namespace).values() for doc in docs]


def render_text(values: dict, namespace: str = "bootstrap") -> dict[str, str]:
    """Each template's rendered text by file name, NOTES.txt included (`helm template
    --show-only templates/<name>` prints one of them)."""
    chart = helm.Chart.load(CHART)
    rendered = chart.render(values, name="bc", namespace=namespace, is_install=True)
    return {path.rsplit("/", 1)[-1]: text for path, text in rendered.items()}


class Sim:
    """A running `apiserver-sim`; its requests are read through its admin API with kubectl."""

    def __init__(self, directory: Path, *extra: str):
        self.kubeconfig = directory / "sim-kubeconfig"
        self.log = open(directory / "sim.log", "w")
        self.process = subprocess.Popen(
            [str(binary("apiserver-sim")), "--kubeconfig-out", str(self.kubeconfig),
             "--seed-namespace", "default", *extra],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while not (self.kubeconfig.exists() and self.kubectl_ok("get", "--raw", "/readyz")):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("apiserver-sim did not start")
            time.sleep(0.1)

    def kubectl_ok(self, *args: str) -> bool:
        return self.kubectl(*args, check=False).returncode == 0

    def kubectl(self, *args: str, check: bool = True, stdin: str | None = None):
        done = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.kubeconfig), *args],
            input=stdin,
            capture_output=True,
            text=True,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {done.stderr}{done.stdout}")
        return done

    def apply(self, manifest: dict) -> None:
        # The simulator serves no OpenAPI document for kubectl to validate against.
        self.kubectl("apply", "--validate=false", "-f", "-", stdin=json.dumps(manifest))

    def requests(self) -> list[dict]:
        return json.loads(self.kubectl("get", "--raw", "/sim/requests").stdout)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.log.close()


class Controller:
    """`bootstrap-controller` started with a container's args, rewritten to run here."""

    def __init__(self, args: list[str], env: dict[str, str], directory: Path, name: str):
        self.admin = free_port()
        self.log_path = directory / f"{name}.log"
        self.log = open(self.log_path, "w")
        args = [a for a in args if not a.startswith("--admin-addr")]
        self.process = subprocess.Popen(
            [str(binary("bootstrap-controller")), *args, f"--admin-addr=127.0.0.1:{self.admin}"],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "info", **env},
        )

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}{path}", timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError as err:
            return 0, str(err)

    def wait_ready(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        status, body = 0, ""
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"exited {self.process.returncode}:\n{self.output()}")
            status, body = self.get("/readyz?verbose")
            if status == 200:
                return body
            time.sleep(0.2)
        raise AssertionError(f"/readyz never 200 (last {status}: {body})\n{self.output()}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        self.process.terminate()
        try:
            return self.process.wait(timeout=30)
        finally:
            self.log.close()


def container_args(manifests: list[dict], kind: str = "Deployment") -> tuple[list[str], dict]:
    """The first container's args and plain env values of the first object of `kind`."""
    obj = next(o for o in manifests if o["kind"] == kind)
    spec = obj["spec"]["template"]["spec"] if kind == "Deployment" else obj["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return list(container.get("args", [])), env


@contextlib.contextmanager
def tls_etcd(directory: Path) -> Iterator[tuple[str, Path, Path, Path]]:
    """A real etcd on free loopback ports with TLS and client certificates (made with openssl).
    Yields (client URL, CA, client certificate, client key)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise RuntimeError("etcd is not on PATH (Debian: apt-get install etcd-server)")
    pki = directory / "pki"
    pki.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=pki, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=etcd-ca",
            "-keyout", "ca.key", "-out", "ca.crt")
    ext = pki / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", "ext.cnf", "-out", f"{name}.crt")
    client_port, peer_port = free_port(), free_port()
    url = f"https://127.0.0.1:{client_port}"
    log = open(directory / "etcd.log", "w")
    process = subprocess.Popen(
        [etcd, "--data-dir", str(directory / "etcd-data"), "--name", "packaging",
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
         "--initial-cluster", f"packaging=http://127.0.0.1:{peer_port}",
         "--cert-file", str(pki / "server.crt"), "--key-file", str(pki / "server.key"),
         "--client-cert-auth", "--trusted-ca-file", str(pki / "ca.crt")],
        stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", client_port)) == 0:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start: {(directory / 'etcd.log').read_text()}")
            time.sleep(0.1)
        yield url, pki / "ca.crt", pki / "client.crt", pki / "client.key"
    finally:
        process.kill()
        process.wait()
        log.close()


def workdir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="bc-packaging-")


class RecordingProxy:
    """A plain-HTTP proxy in front of a `--plain-http` simulator that records each API request
    as kube-apiserver's authorizer sees it: (namespace, group, resource[/subresource], verb,
    name), where a list or watch selecting `metadata.name=X` by field selector has the name X
    (k8s.io/apiserver's RequestInfoFactory), so `resourceNames` rules can be judged."""

    def __init__(self, upstream: str):
        import http.client
        import http.server
        import threading
        import urllib.parse

        target = urllib.parse.urlsplit(upstream)
        self.records: list[tuple[str | None, str, str, str, str | None]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                proxy.record(self.command, self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=600)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection")}
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    response = upstream.getresponse()
                except (OSError, http.client.HTTPException):
                    self.send_error(502, "the simulator did not answer")
                    return
                self.send_response(response.status)
                chunked = response.getheader("Content-Length") is None
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection"):
                        self.send_header(key, value)
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while True:
                        data = response.read1(65536)
                        if not data:
                            break
                        if chunked:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        else:
                            self.wfile.write(data)
                        self.wfile.flush()
                    if chunked:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                except (OSError, http.client.HTTPException):
                    # A watch cut by either side (the simulator or the controller stopping).
                    self.close_connection = True
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def record(self, method: str, raw_path: str) -> None:
        import urllib.parse

        parts = urllib.parse.urlsplit(raw_path)
        query = urllib.parse.parse_qs(parts.query)
        segments = [s for s in parts.path.split("/") if s]
        if segments[:1] == ["api"] and len(segments) >= 3:
            group, rest = "", segments[2:]
        elif segments[:1] == ["apis"] and len(segments) >= 4:
            group, rest = segments[1], segments[3:]
        else:
            return  # discovery, health: not resources
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        resource, name, sub = rest[0], (rest[1] if len(rest) > 1 else None), (
            rest[2] if len(rest) > 2 else None)
        if method == "GET" and name is None:
            verb = "watch" if query.get("watch", ["false"])[0] in ("true", "1") else "list"
            for selector in query.get("fieldSelector", []):
                for term in selector.split(","):
                    key, _, value = term.partition("=")
                    if key == "metadata.name" and value and not value.startswith("="):
                        name = value
        else:
            verb = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch",
                    "DELETE": "delete" if name else "deletecollection"}[method]
        self.records.append(
            (namespace, group, resource + (f"/{sub}" if sub else ""), verb, name))

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: proxy\n  cluster:\n"
            f"    server: {self.url}\nusers:\n- name: proxy\n  user: {{}}\ncontexts:\n"
            "- name: proxy\n  context: {cluster: proxy, user: proxy}\ncurrent-context: proxy\n"
        )
        return path

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

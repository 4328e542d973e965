"""The container image, built from the Containerfile with buildah (no daemon, no registry: the
`prebuilt` stage takes the static binary built on the host) and run with `buildah run`: the
binary answers --version, and `check` works against a simulator started outside the container.
Builds the static binary first (a release build for x86_64-unknown-linux-musl)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import uuid
from pathlib import Path

import pytest

from harness import ROOT, Sim, workdir

def static_target() -> tuple[str, dict]:
    """The musl target when rustup has it, else the gnu target linked statically (both give a
    static-pie binary)."""
    installed = subprocess.run(["rustup", "target", "list", "--installed"],
                               capture_output=True, text=True).stdout.split()
    if "x86_64-unknown-linux-musl" in installed:
        return "x86_64-unknown-linux-musl", {}
    return "x86_64-unknown-linux-gnu", {"RUSTFLAGS": "-C target-feature=+crt-static"}


def has_interpreter(path: Path) -> bool:
    """Whether the ELF file asks for a dynamic loader (a PT_INTERP program header)."""
    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not a 64-bit ELF file"
    phoff = struct.unpack_from("<Q", data, 0x20)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return any(
        struct.unpack_from("<I", data, phoff + i * phentsize)[0] == 3 for i in range(phnum)
    )


def run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done


@pytest.fixture(scope="module")
def image():
    buildah = shutil.which("buildah")
    assert buildah, "buildah is not on PATH (Debian: apt-get install buildah)"
    target, env = static_target()
    run("cargo", "build", "--release", "--locked", "--target", target, "-p",
        "bootstrap-controller", cwd=ROOT, env={**os.environ, **env})
    binary = Path("target") / target / "release" / "bootstrap-controller"
    # Static: no loader to find, so it runs in an empty image.
    assert not has_interpreter(ROOT / binary)
    tag = f"localhost/bootstrap-controller:test-{uuid.uuid4().hex[:8]}"
    run(buildah, "--storage-driver", "vfs", "bud", "--build-arg", "BINARY_STAGE=prebuilt",
        "--build-arg", f"STATIC_BINARY={binary}", "-f", "Containerfile", "-t", tag, ".",
        cwd=ROOT)
    container = run(buildah, "--storage-driver", "vfs", "from", tag).stdout.strip()
    try:
        yield buildah, tag, container
    finally:
        subprocess.run([buildah, "--storage-driver", "vfs", "rm", container], capture_output=True)
        subprocess.run([buildah, "--storage-driver", "vfs", "rmi", tag], capture_output=True)


def test_the_static_musl_build_allocates_with_jemalloc(image):
    """The image's sizing (controllers/CONFIG.md, "Tenant cache budgets"; BENCHMARKS.md, "The
    shipped build") was measured with jemalloc in the musl build: a build without it keeps
    about 45 KiB a tenant more."""
    target, _ = static_target()
    if target != "x86_64-unknown-linux-musl":
        # CI ships what it tests: there the musl target is required, not skipped.
        assert not os.environ.get("CI"), "CI has no musl target: `rustup target add` failed"
        pytest.skip("no musl target here: the gnu fallback keeps glibc's allocator")
    binary = (ROOT / "target" / target / "release" / "bootstrap-controller").read_bytes()
    assert b"<jemalloc>" in binary, "the musl build does not carry jemalloc"


def test_image_is_scratch_non_root_with_labels(image):
    buildah, tag, _ = image
    info = json.loads(run(buildah, "--storage-driver", "vfs", "inspect", "--type", "image",
                          tag).stdout)
    config = info["OCIv1"]["config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["/bootstrap-controller"]
    labels = config["Labels"]
    for key in ("source", "version", "licenses"):
        assert labels.get(f"org.opencontainers.image.{key}"), labels
    # One layer: the binary, nothing else (no shell, no libc).
    assert len(info["OCIv1"]["rootfs"]["diff_ids"]) == 1


def test_binary_in_the_image_runs(image):
    buildah, _, container = image
    out = run(buildah, "--storage-driver", "vfs", "run", "--isolation", "chroot", container,
              "--", "/bootstrap-controller", "--version").stdout
    assert out.startswith("bootstrap-controller "), out


def test_check_in_the_image_against_a_simulator_outside(image):
    buildah, _, container = image
    with workdir() as tmp:
        tmp = Path(tmp)
        sim = Sim(tmp)
        # The image runs as uid 65532: let it read the (throwaway) kubeconfig.
        tmp.chmod(0o755)
        sim.kubeconfig.chmod(0o644)
        try:
            done = subprocess.run(
                [buildah, "--storage-driver", "vfs", "run", "--isolation", "chroot",
                 "-v", f"{tmp}:/config:ro", container, "--", "/bootstrap-controller", "check",
                 "--kubeconfig", "/config/sim-kubeconfig",
                 "--service-cluster-ip-range", "10.96.0.0/12",
                 "--advertise-address", "192.0.2.1"],
                capture_output=True, text=True, timeout=120,
            )
        finally:
            sim.stop()
    # A fresh simulator has drift to report (missing namespaces, the Service): exit 1,
    # naming it; 2 would mean it could not reach the API or read its configuration.
    assert done.returncode == 1, done.stdout + done.stderr
    assert "kube-public" in done.stdout, done.stdout

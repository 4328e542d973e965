#!/usr/bin/env bash
# The whole suite on a fresh Debian 12 machine, in one command: installs what is missing (Debian
# packages, Python packages, actionlint, the musl target), builds the real control plane and the
# real node from their Go modules (cached in target/), runs the real node's scenarios and
# upstream's conformance tests on it (e2e/node/test.sh) and kind's (e2e/kind/test.sh), then the
# tests the README lists: cargo test, the packaging tests and the end-to-end suite against a real
# control plane. `.ci/run` runs it after its lints.
#
# Needs: root (apt-get, and the node's namespaces and cgroups), the Rust toolchain (rustup) and
# Go 1.26 or newer. Everything else it installs.
#
# It also runs the end-to-end suite's version-dependent test files on the oldest supported
# Kubernetes (1.30; README: Kubernetes versions) before the newest's whole suite in the README's
# command. --all-versions runs, after installing, the whole end-to-end suite on every supported
# minor instead (e2e/control-plane/all-versions.sh; hours on a fresh machine: one build each).
#
# Usage: ./run-tests.sh [--install-only | --all-versions]
set -euo pipefail
cd "$(dirname "$0")"

usage() {
  echo "usage: ./run-tests.sh [--install-only | --all-versions]   (as root, on Debian 12 with rustup and Go 1.26+)" >&2
  exit 2
}
install_only=0
all_versions=0
case "${1-}" in
  "") ;;
  --install-only) install_only=1 ;;
  --all-versions) all_versions=1 ;;
  *) usage ;;
esac
[ $# -le 1 ] || usage
if [ "$(id -u)" != 0 ]; then
  echo "run-tests.sh: run it as root: it installs Debian packages, and the real node needs network namespaces and cgroups" >&2
  usage
fi

# The workspace builds with the Rust toolchain alone: a build script that needs protoc fails here.
export PROTOC=/bin/false

need() { command -v "$1" >/dev/null 2>&1; }
started=$(date +%s)
stage() { echo "== $1 ($(($(date +%s) - started)) s)"; }

stage "installing what is missing"
if ! need cargo; then
  echo "run-tests.sh: cargo is not on PATH; install the Rust toolchain with rustup (https://rustup.rs)" >&2
  exit 1
fi
if ! need go || ! go version | grep -Eq 'go1\.(2[6-9]|[3-9][0-9])'; then
  echo "run-tests.sh: the Go toolchain 1.26 or newer is needed (it builds the real control plane and node from their Go modules); found: $(go version 2>/dev/null || echo none)" >&2
  exit 1
fi
# kubectl is the independent client in the simulator's tests; etcd (Debian's 3.4) runs in the
# etcd-mode tests, etcdctl sets up its users and roles where etcd's auth is tested; buildah
# builds and runs the image, shellcheck checks the scripts, musl-gcc builds the static binary
# (ring's C code), openssl makes test certificates, curl probes the real control plane,
# promtool and prometheus test the alerts. The real node's own packages (containerd, runc,
# iptables, conntrack, the CNI plugins) are installed by e2e/node/up.sh, which can run alone.
missing=()
need kubectl || missing+=(kubernetes-client)
need etcd || missing+=(etcd-server)
need etcdctl || missing+=(etcd-client)
need buildah || missing+=(buildah)
need shellcheck || missing+=(shellcheck)
need musl-gcc || missing+=(musl-tools)
need make || missing+=(make)  # jemalloc's C build, in the static binary
need openssl || missing+=(openssl)
need curl || missing+=(curl)
need promtool || missing+=(prometheus)
need nsenter || missing+=(util-linux)
need ip || missing+=(iproute2)
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  # etcd-server's and prometheus's packages start services where they can; the tests start
  # their own on free loopback ports.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
# The static binary for the image; without the musl target the tests link the gnu target
# statically instead.
rustup target add x86_64-unknown-linux-musl || echo "musl target unavailable; using the gnu target, linked statically"
python3 -m pip install --quiet --disable-pip-version-check \
  helm-python-sdk kubernetes-validate pytest pyyaml check-jsonschema
# actionlint checks the release workflow (a packaging test runs it from ~/go/bin).
need actionlint || [ -x "$HOME/go/bin/actionlint" ] \
  || go install github.com/rhysd/actionlint/cmd/actionlint@v1.7.12

stage "toolchain"
cargo --version
rustc --version
go version
kubectl version --client 2>/dev/null | sed -n 1p  # sed reads to the end: no SIGPIPE under pipefail
etcd --version | sed -n 1p
buildah --version
shellcheck --version | sed -n 2p
promtool --version 2>&1 | sed -n 1p
python3 -c 'import helm_python, kubernetes_validate; print("helm", helm_python.helm_sdk_version())'

# The real control plane's binaries (kube-apiserver, kube-controller-manager, etcd) from the Go
# modules pinned in e2e/control-plane; cached per version under target/ and in Go's caches.
stage "real control plane binaries"
e2e/control-plane/build.sh
if [ "$install_only" = 1 ]; then
  stage "installed; ./run-tests.sh runs the suite"
  exit 0
fi
if [ "$all_versions" = 1 ]; then
  stage "the end-to-end suite on every supported Kubernetes minor (e2e/control-plane/all-versions.sh)"
  e2e/control-plane/all-versions.sh
  exit
fi

# The oldest supported minor's control plane (its stage below) is a Go build that only needs the
# CPU: it runs beside the real node's and kind's stages, whose clusters mostly wait, at the
# lowest CPU priority so that they keep the CPU they ask for. Its stage waits for it and shows
# its output. A run that stops before then stops it too.
stage "the oldest supported Kubernetes' build (e2e/control-plane/build.sh --kubernetes 1.30), beside the next stages at nice 19"
oldest_build_log=$(mktemp -t oldest-build-XXXXXX)
# setsid: a process group of its own (go and its compilers), which the trap stops as one; --wait:
# should setsid fork, its status is still the build's.
setsid --wait nice -n 19 e2e/control-plane/build.sh --kubernetes 1.30 >"$oldest_build_log" 2>&1 &
oldest_build=$!
trap 'kill -TERM -- "-$oldest_build" 2>/dev/null || true' EXIT

# A one-node cluster (kubeadm's layout, containerd, kubelet, kube-proxy, the sidecar as a static
# pod) in namespaces of its own; installs containerd, runc and the CNI plugins where missing.
# After its scenarios, upstream's conformance tests of Services, Endpoints, EndpointSlices and
# ServiceCIDRs run on it (e2e/node/conformance.sh), judged by the audit log as well.
stage "a real node (e2e/node/test.sh)"
e2e/node/test.sh

# kind as users try it (e2e/kind/up.sh: the end-to-end suite against the cluster, the sidecar,
# the chart) with podman and a kind node image built here from the real node's binaries, nothing
# pulled; installs podman, debootstrap and jq where missing.
stage "kind (e2e/kind/test.sh)"
e2e/kind/test.sh

# The oldest supported minor: its own build (about 4 min of compile on a fresh machine, then
# cached; started before the real node's stage) and, as test.sh runs by default, every test file
# that runs against the cluster it is given (the others start simulators or control planes of
# their own, whatever the version), compared with their lines of expected-skips.txt. Every
# minor: --all-versions.
stage "the oldest supported Kubernetes (e2e/control-plane/test.sh --kubernetes 1.30)"
built=0
wait "$oldest_build" || built=$?
trap - EXIT
cat "$oldest_build_log"
rm -f "$oldest_build_log"
if [ "$built" != 0 ]; then
  echo "run-tests.sh: building Kubernetes 1.30 failed (exit $built; its output above)" >&2
  exit 1
fi
cargo build --workspace --bins
e2e/control-plane/test.sh --kubernetes 1.30

stage "tests (README: cargo test --workspace && python3 -m pytest e2e/packaging && e2e/control-plane/test.sh)"
# The last command: its status is the script's (set -e does not stop inside an && list).
cargo test --workspace && python3 -m pytest e2e/packaging && e2e/control-plane/test.sh

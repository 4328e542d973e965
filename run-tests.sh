#!/usr/bin/env bash
# The whole suite on a fresh Debian 12 machine, in one command: installs what is missing (Debian
# packages, Python packages, actionlint, cargo-nextest, the musl target), builds the real control
# plane from its Go modules (cached in target/), runs the tests the README lists (the workspace's
# tests by cargo-nextest, which it installs, the packaging tests and the end-to-end suite against a
# real control plane) while it builds the real node and kind's node image in the background, then
# runs the real node's scenarios and upstream's conformance tests on it (e2e/node/test.sh) and
# kind's (e2e/kind/test.sh). `.ci/run` runs it after its lints.
#
# Needs: root (apt-get, and the node's namespaces and cgroups), the Rust toolchain (rustup) and
# Go 1.26 or newer. Everything else it installs.
#
# It also runs the end-to-end suite's version-dependent test files on the oldest supported
# Kubernetes (1.30; README: Kubernetes versions), beside kind's stage. --all-versions runs, after
# installing, the whole end-to-end suite on every supported minor instead
# (e2e/control-plane/all-versions.sh; hours on a fresh machine: one build each).
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

# Work that can go on beside a stage runs in the background: builds that only need the CPU at the
# lowest CPU priority, beside stages that mostly wait (the tests, the real node's and kind's
# clusters), which keep the CPU they ask for; a suite that mostly waits too at the usual one.
# `finish NAME` waits for one (if it was started), shows its output and fails the run if it
# failed; a run that stops before then stops the ones still running.
declare -A background_pid=() background_log=()
stop_background() {
  local name
  for name in "${!background_pid[@]}"; do
    kill -TERM -- "-${background_pid[$name]}" 2>/dev/null || true
  done
}
trap stop_background EXIT
# in_background NAME NICENESS COMMAND...: setsid, a process group of its own (go or cargo and
# their compilers, or a suite and its cluster), which stop_background stops as one; --wait:
# should setsid fork, the status is still COMMAND's. A new session is also a new autogroup of
# the scheduler, whose niceness at-priority.sh sets with the command's (see there why).
in_background() {
  local name=$1 niceness=$2
  shift 2
  background_log[$name]=$(mktemp -t run-tests-background-XXXXXX)
  setsid --wait e2e/steps/at-priority.sh "$niceness" "$@" >"${background_log[$name]}" 2>&1 &
  background_pid[$name]=$!
}
finish() {
  local name=$1 status=0
  [ -n "${background_pid[$name]+set}" ] || return 0
  wait "${background_pid[$name]}" || status=$?
  unset "background_pid[$name]"
  cat "${background_log[$name]}"
  rm -f "${background_log[$name]}"
  if [ "$status" != 0 ]; then
    echo "run-tests.sh: $name failed (exit $status; its output above)" >&2
    exit 1
  fi
}

stage "installing what is missing"
if ! need cargo; then
  echo "run-tests.sh: cargo is not on PATH; install the Rust toolchain with rustup (https://rustup.rs)" >&2
  exit 1
fi
if ! need go || ! go version | grep -Eq 'go1\.(2[6-9]|[3-9][0-9])'; then
  echo "run-tests.sh: the Go toolchain 1.26 or newer is needed (it builds the real control plane and node from their Go modules); found: $(go version 2>/dev/null || echo none)" >&2
  exit 1
fi
# cargo-nextest runs the workspace's tests (the README's test command), many at once. Its own
# build (a debug build: it only starts and watches test processes) runs beside the installs and
# builds below and is waited for before its first use.
nextest_version=0.9.151
if ! cargo nextest --version 2>/dev/null | grep -q "^cargo-nextest $nextest_version\b"; then
  in_background "installing cargo-nextest $nextest_version" 19 \
    cargo install cargo-nextest --version "$nextest_version" --locked --debug \
    --no-default-features --features default-no-update
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
  finish "installing cargo-nextest $nextest_version"
  stage "installed; ./run-tests.sh runs the suite"
  exit 0
fi
if [ "$all_versions" = 1 ]; then
  stage "the end-to-end suite on every supported Kubernetes minor (e2e/control-plane/all-versions.sh)"
  e2e/control-plane/all-versions.sh
  exit
fi

# What the later stages build, in the background at the lowest priority beside the tests below,
# which mostly wait on the processes they start: the real node's binaries, images and
# conformance tests, the static binary's image, kind and its node image (e2e/kind/test.sh
# --build-only, which runs e2e/node/build.sh and installs podman, debootstrap, jq, buildah and
# the tools build.sh copies into the conformance tests' images), and the oldest supported
# minor's control plane. On a fresh machine these are most of the run's Go builds; the tests
# leave them the CPU they do not use.
# The 1.30 build starts when the others are done: the real node's stage needs theirs first, the
# 1.30 suite needs its only beside kind's stage, and it goes on through the real node's stage,
# which mostly waits too.
stage "building for the real node, kind and Kubernetes 1.30 at nice 19, beside the tests"
node_built=$(mktemp -u -t run-tests-node-built-XXXXXX)
# shellcheck disable=SC2016 # the inner sh expands them
in_background "building for the real node and kind" 19 \
  sh -c 'e2e/kind/test.sh --build-only && touch "$1"' sh "$node_built"
# shellcheck disable=SC2016 # the inner sh expands them
in_background "building Kubernetes 1.30" 19 \
  sh -c 'built=$1; shift; until [ -e "$built" ]; do sleep 5; done; rm -f "$built"; exec "$@"' sh "$node_built" \
  e2e/control-plane/build.sh --kubernetes 1.30

# The README's test command. set -e does not stop inside an && list: the caller checks its status.
readme_test_command() {
  cargo nextest run --workspace && cargo test --workspace --doc && python3 -m pytest e2e/packaging && e2e/control-plane/test.sh
}
finish "installing cargo-nextest $nextest_version"
stage "tests (README: cargo nextest run --workspace && cargo test --workspace --doc && python3 -m pytest e2e/packaging && e2e/control-plane/test.sh)"
if ! readme_test_command; then
  echo "run-tests.sh: the README's test command failed (its output above)" >&2
  exit 1
fi

# A one-node cluster (kubeadm's layout, containerd, kubelet, kube-proxy, the sidecar as a static
# pod) in namespaces of its own; installs containerd, runc and the CNI plugins where missing.
# After its scenarios, upstream's conformance tests of Services, Endpoints, EndpointSlices and
# ServiceCIDRs run on it (e2e/node/conformance.sh), judged by the audit log as well.
stage "a real node (e2e/node/test.sh)"
finish "building for the real node and kind"
e2e/node/test.sh

# kind as users try it (e2e/kind/up.sh: the end-to-end suite against the cluster, the sidecar,
# the chart) with podman and a kind node image built here from the real node's binaries, nothing
# pulled. Beside it, at the usual priority, the oldest supported minor: as test.sh runs by
# default, every test file that runs against the cluster it is given (the others start
# simulators or control planes of their own, whatever the version), compared with their lines of
# expected-skips.txt; its output follows kind's. Both mostly wait on their clusters. Every
# minor: --all-versions.
stage "kind (e2e/kind/test.sh), and beside it the oldest supported Kubernetes (e2e/control-plane/test.sh --kubernetes 1.30)"
finish "building Kubernetes 1.30"
cargo build --workspace --bins
in_background "the end-to-end suite on Kubernetes 1.30" 0 e2e/control-plane/test.sh --kubernetes 1.30
e2e/kind/test.sh
stage "the oldest supported Kubernetes (e2e/control-plane/test.sh --kubernetes 1.30), run beside kind's stage"
finish "the end-to-end suite on Kubernetes 1.30"

# Two real tenants on one etcd, one of them on the oldest supported minor: the workspace's run
# above came before the oldest was built, so it ran both on the newest and recorded the skip.
stage "real tenants on Kubernetes 1.30 and the newest (e2e/tests/real_tenants.rs)"
BOOTSTRAP_E2E_OLDEST_REQUIRED=1 cargo nextest run -p e2e --test real_tenants \
  -E 'test(=management_mode_keeps_real_tenants_on_one_etcd_apart)'
stage "passed"

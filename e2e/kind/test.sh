#!/usr/bin/env bash
# Runs e2e/kind/up.sh for real on a machine without a registry, then down.sh whatever happened;
# exits non-zero if up.sh failed. Builds first what up.sh needs and nothing can pull, each cached
# by version under target/: kind (its Go module, KIND_VERSION in lib.sh), and the node image with
# kubectl (build-node-image.sh, from e2e/node/build.sh's binaries); helm is the one
# e2e/node/build.sh builds for the real node's chart tests. The engine is podman, rootful.
#
# What this machine needs for kind, set up here for the run only (podman's and the system's
# configuration stay as they are); none of it is needed on a usual docker or podman host:
#   - a containers.conf of the run's own (CONTAINERS_CONF): runc as the OCI runtime, as crun
#     refuses this host's hybrid cgroups ("cgroups in hybrid mode not supported, drop all
#     controllers from cgroupv2": hugetlb is on the v2 hierarchy); and default ulimits this
#     process may set: without CAP_SYS_RESOURCE it cannot raise RLIMIT_NOFILE above its hard
#     limit, podman's processes run with RLIMIT_NPROC 32768, and podman's defaults (1048576)
#     fail with "setrlimit `RLIMIT_NOFILE`: Operation not permitted";
#   - an empty /lib/modules while the cluster exists: kind's podman provider mounts it into the
#     node and this kernel (its modules built in) has none;
#   - a podman network of its own in 198.18.128.0/24 (KIND_EXPERIMENTAL_PODMAN_NETWORK), as
#     kind's would get one of podman's 10.89.x.0/24 ranges.
#
# Usage: e2e/kind/test.sh [--build-only]     (as root). --build-only installs and builds what the
# run needs (the packages above, kind, e2e/node/build.sh's binaries, the node image) and stops:
# ./run-tests.sh runs it so in the background, beside the tests that mostly wait. Environment:
# SKIP_E2E=1 (passed to up.sh, which says that it skips the end-to-end tests; so does this
# script, first and last).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=e2e/kind/lib.sh
. "$here/lib.sh"
NETWORK=bootstrap-controller-kind
NETWORK_SUBNET=198.18.128.0/24
CLUSTER=bootstrap-controller
export CLUSTER
build_only=false
case "$*" in
  "") ;;
  --build-only) build_only=true ;;
  *)
    echo "usage: e2e/kind/test.sh [--build-only]   (as root)" >&2
    exit 2
    ;;
esac

[ "$(id -u)" = 0 ] || die "test.sh must run as root (rootful podman, debootstrap)"
if [ "${SKIP_E2E:-0}" = 1 ] && [ "$build_only" = false ]; then
  log "SKIP_E2E=1: the end-to-end tests will not run against the kind cluster"
fi
for tool in go cargo; do
  command -v "$tool" >/dev/null 2>&1 || die "test.sh needs $tool (Go 1.26, Rust)"
done
# What a fresh Debian lacks, installed as e2e/node/up.sh installs its own: kind's tools, and
# what e2e/node/build.sh (run below, before up.sh has installed anything under --build-only)
# builds the images with.
missing=()
for tool in podman runc debootstrap jq buildah; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
[ -x /bin/busybox ] || missing+=(busybox-static)
[ -x /bin/nc.openbsd ] || missing+=(netcat-openbsd)
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
started=$(date +%s)

go_tool() { # binary, module@version, directory: go install into the directory once
  if [ ! -x "$3/$1" ]; then
    log "building $2"
    mkdir -p "$3"
    (cd "$root/target" && CGO_ENABLED=0 GOBIN="$3" go install "$2")
  fi
}
KIND="$root/target/kind/$KIND_VERSION/kind"
go_tool kind "sigs.k8s.io/kind@$KIND_VERSION" "$(dirname "$KIND")"
node_build=$("$root/e2e/node/build.sh")
NODE_IMAGE=$(NODE_BUILD="$node_build" "$here/build-node-image.sh")
# shellcheck source=/dev/null
. "$node_build/versions.env"
log "built in $(($(date +%s) - started)) s: $NODE_IMAGE"
if [ "$build_only" = true ]; then
  exit 0
fi

work=$(mktemp -d)
made_modules=false
cleanup() {
  local status=$?
  log "tearing down"
  KIND="$KIND" KIND_EXPERIMENTAL_PROVIDER=podman "$here/down.sh" || status=1
  podman network exists "$NETWORK" && podman network rm "$NETWORK" >/dev/null
  podman image exists "$KIND_IMAGE_REPOSITORY:$KIND_IMAGE_TAG" &&
    podman rmi "$KIND_IMAGE_REPOSITORY:$KIND_IMAGE_TAG" >/dev/null
  # The build's intermediate stages, untagged: those this run left.
  comm -13 "$work/dangling" <(podman images --quiet --filter dangling=true | sort) |
    xargs --no-run-if-empty podman rmi >/dev/null
  if [ "$made_modules" = true ]; then rmdir /lib/modules; fi
  rm -rf "$work"
  exit "$status"
}
podman images --quiet --filter dangling=true | sort >"$work/dangling"
trap cleanup EXIT

cat >"$work/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -Hn):$(ulimit -Hn)", "nproc=32768:32768"]
[engine]
runtime = "runc"
EOF
export CONTAINERS_CONF="$work/containers.conf"
if [ ! -e /lib/modules ]; then
  mkdir /lib/modules
  made_modules=true
fi
podman network exists "$NETWORK" || podman network create --subnet "$NETWORK_SUBNET" "$NETWORK" >/dev/null
mkdir -p "$work/bin"
ln -s "$root/target/kind/kubectl-$KUBERNETES_VERSION" "$work/bin/kubectl"

up_started=$(date +%s)
PATH="$work/bin:$PATH" ENGINE=podman KIND="$KIND" HELM="$HELM" NODE_IMAGE="$NODE_IMAGE" \
  KIND_EXPERIMENTAL_PROVIDER=podman KIND_EXPERIMENTAL_PODMAN_NETWORK="$NETWORK" "$here/up.sh"
log "up.sh passed in $(($(date +%s) - up_started)) s; $(($(date +%s) - started)) s in all"
if [ "${SKIP_E2E:-0}" = 1 ]; then
  log "SKIP_E2E=1: the end-to-end tests were skipped; only the sidecar and the chart were tried"
fi

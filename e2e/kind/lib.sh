# shellcheck shell=bash
# The pieces of up.sh, as functions the packaging tests call one by one
# (e2e/packaging/test_kind.py), and the versions and ranges the kind scripts share. Sourced;
# sets the constants below and nothing else.

# The published image's name with the tag `kind`: fully qualified, so that docker and podman
# store it under the same name and containerd in the node finds it as the manifests spell it
# (podman would store a short `bootstrap-controller:kind` as `localhost/bootstrap-controller:kind`,
# which a pod asking for `bootstrap-controller:kind`, i.e. docker.io/library/..., never finds).
# shellcheck disable=SC2034 # used by up.sh and the tests
KIND_IMAGE_REPOSITORY="ghcr.io/bootstrap-controller/bootstrap-controller"
# shellcheck disable=SC2034 # used by up.sh and the tests
KIND_IMAGE_TAG="kind"
# The kind release test.sh builds (from its Go module) and build-node-image.sh reads kind's base
# image from.
# shellcheck disable=SC2034 # used by test.sh and build-node-image.sh
KIND_VERSION="v0.33.0"

log() { printf '\n== %s\n' "$*"; }

die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# The cluster's pod and service ranges, in 198.18.0.0/15 (RFC 2544, benchmarking): kind's
# defaults (10.244.0.0/16, 10.96.0.0/16) are private ranges a machine may route elsewhere.
KIND_POD_SUBNET="${KIND_POD_SUBNET:-198.18.192.0/18}"
KIND_SERVICE_SUBNET="${KIND_SERVICE_SUBNET:-198.18.160.0/20}"

# The kind configuration: one control-plane node of NODE_IMAGE ($1), the ranges above,
# kube-apiserver started with --endpoint-reconciler-type=none, and a kubelet that runs on a
# cgroup v1 host too (from Kubernetes 1.35 it refuses to unless failCgroupV1 is false; the field
# is ignored on cgroup v2).
#
# The patches name no apiVersion: kind applies a patch only to a document of the same kind and,
# when the patch names one, the same apiVersion. Which kubeadm API kind generates depends on
# kind's release as well as the node image (kind up to v0.31 writes v1beta3 for every image from
# 1.23 on; from v0.32, v1beta4 for 1.36 and later), so a patch that names one is silently skipped
# by the other. Without an apiVersion it matches either; extraArgs in the map form (v1beta3's)
# merges into a v1beta3 document as is, and kind converts it to v1beta4's list form when the
# document is v1beta4 (pkg/internal/patch/kubeadm_merge.go).
kind_config() {
  local node_image="$1"
  cat <<EOF
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
networking:
  podSubnet: ${KIND_POD_SUBNET}
  serviceSubnet: ${KIND_SERVICE_SUBNET}
nodes:
  - role: control-plane
    image: ${node_image}
kubeadmConfigPatches:
  - |
    kind: ClusterConfiguration
    apiServer:
      extraArgs:
        endpoint-reconciler-type: "none"
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
EOF
}

# Fails unless every kube-apiserver command line on stdin (as `kubectl get pods -o jsonpath`
# prints the commands) has --endpoint-reconciler-type=none. kube-apiserver lists itself in the
# `kubernetes` endpoints otherwise, and a check of those endpoints would pass without the
# controller.
require_reconciler_off() {
  local commands
  commands="$(cat)"
  if [ -z "${commands}" ]; then
    die "no kube-apiserver pod found (kubectl -n kube-system get pods -l component=kube-apiserver)"
  fi
  if ! printf '%s\n' "${commands}" | grep -q -- '--endpoint-reconciler-type=none'; then
    die "kube-apiserver runs without --endpoint-reconciler-type=none: kind did not apply the kubeadm patch of kind_config (e2e/kind/lib.sh); its command: ${commands}"
  fi
}


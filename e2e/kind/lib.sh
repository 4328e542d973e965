# shellcheck shell=bash
# The pieces of up.sh, as functions the packaging tests call one by one
# (e2e/packaging/test_kind.py). Sourced; sets nothing on its own.

# The published image's name with the tag `kind`: fully qualified, so that docker and podman
# store it under the same name and containerd in the node finds it as the manifests spell it
# (podman would store a short `bootstrap-controller:kind` as `localhost/bootstrap-controller:kind`,
# which a pod asking for `bootstrap-controller:kind`, i.e. docker.io/library/..., never finds).
# shellcheck disable=SC2034 # used by up.sh and the tests
KIND_IMAGE_REPOSITORY="ghcr.io/bootstrap-controller/bootstrap-controller"
# shellcheck disable=SC2034 # used by up.sh and the tests
KIND_IMAGE_TAG="kind"

log() { printf '\n== %s\n' "$*"; }

die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# The kind configuration: one control-plane node of NODE_IMAGE ($1), kube-apiserver started
# with --endpoint-reconciler-type=none.
#
# The patch names no apiVersion: kind applies a patch only to a document of the same kind and,
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
nodes:
  - role: control-plane
    image: ${node_image}
kubeadmConfigPatches:
  - |
    kind: ClusterConfiguration
    apiServer:
      extraArgs:
        endpoint-reconciler-type: "none"
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

# Waits for a pod ($1 namespace, $2 name) to exist, then to be Ready, $3 seconds in all. A static
# pod's mirror pod appears only once the kubelet has seen the manifest, and `kubectl wait` fails
# at once on a pod that does not exist yet.
wait_for_pod() {
  local namespace="$1" name="$2" timeout="$3" waited=0
  until kubectl -n "${namespace}" get pod "${name}" >/dev/null 2>&1; do
    if [ "${waited}" -ge "${timeout}" ]; then
      die "pod ${namespace}/${name} did not appear within ${timeout}s"
    fi
    sleep 1
    waited=$((waited + 1))
  done
  kubectl -n "${namespace}" wait --for=condition=Ready "pod/${name}" \
    --timeout="$((timeout - waited > 1 ? timeout - waited : 1))s"
}

# The value of kube-apiserver's flag --$1 in the first command line on stdin (as
# require_reconciler_off reads them); fails if the flag is absent.
apiserver_flag() {
  local value
  value="$(head -n 1 | sed -e 's/^\[//' -e 's/\]$//' -e 's/","/\n/g' | tr -d '"' |
    sed -n "s#^--$1=##p" | head -n 1)"
  if [ -z "${value}" ]; then
    die "kube-apiserver has no --$1"
  fi
  printf '%s\n' "${value}"
}

# The sidecar manifest on stdin with the image built here ($1), never pulled, and the service
# range of the cluster's kube-apiserver ($2; kind's default is 10.96.0.0/16, the manifest's
# kubeadm's 10.96.0.0/12).
sidecar_manifest() {
  local image="$1" range="$2"
  sed -e "s#^\( *image: \).*#\1${image}#" \
    -e 's#^\( *imagePullPolicy: \).*#\1Never#' \
    -e "/name: BOOTSTRAP_SERVICE_CLUSTER_IP_RANGE\$/{n;s#^\( *value: \).*#\1\"${range}\"#;}"
}

# Waits up to $2 seconds for the `kubernetes` endpoints to list the address $1.
wait_for_endpoint() {
  local address="$1" timeout="$2" waited=0
  until kubectl get endpoints kubernetes -o jsonpath='{.subsets[*].addresses[*].ip}' |
    grep -qw -- "${address}"; do
    if [ "${waited}" -ge "${timeout}" ]; then
      die "the kubernetes endpoints never listed ${address}"
    fi
    sleep 1
    waited=$((waited + 1))
  done
}

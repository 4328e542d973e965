# shellcheck shell=bash
# Installing the bootstrap-controller sidecar on a kubeadm control-plane node as the README and
# deploy/sidecar/ tell users: `kubectl apply -f rbac.yaml`; on the node, as root,
# deploy/sidecar/setup-node.sh; the manifest that `bootstrap-controller sidecar manifest`
# generates from the node's own kube-apiserver manifest, beside it; then the pod Ready and its
# apiserver in the `kubernetes` EndpointSlice. One implementation for every node the tests
# install it on: the real node (e2e/node/install-sidecar.sh) and kind's (e2e/kind/up.sh).
# Sourced; sets nothing on its own.
#
# The caller sets KUBECONFIG and defines how to reach its node:
#   sidecar_on_node COMMAND...   runs COMMAND as root on the node (its mount namespace, where
#                                /etc/kubernetes is kubeadm's), stdin passed through
# and sets:
#   SIDECAR_KUBEADM_CONFIG       the node's kubeadm configuration file (setup-node.sh's KUBEADM_CONFIG)
#   SIDECAR_BINARY               optional: the bootstrap-controller binary run here to generate the
#                                manifest (default: the static build the image is made from,
#                                target/x86_64-unknown-linux-musl/release/bootstrap-controller)
#   SIDECAR_IMAGE                optional: an image to run instead of the manifest's, never pulled
#                                (imagePullPolicy: Never), for an image loaded into the node
#   SIDECAR_TIMEOUT              optional: seconds each wait below lasts at most (default 120)

SIDECAR_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

sidecar_die() {
  printf 'sidecar: %s\n' "$*" >&2
  exit 1
}

# The RBAC the sidecar's user needs (rbac.yaml also creates the membership Leases' namespace).
sidecar_rbac() {
  kubectl apply -f "${SIDECAR_ROOT}/deploy/sidecar/rbac.yaml" >/dev/null
}

SIDECAR_BINARY="${SIDECAR_BINARY:-${CARGO_TARGET_DIR:-${SIDECAR_ROOT}/target}/x86_64-unknown-linux-musl/release/bootstrap-controller}"

# The sidecar's manifest on stdout, as `bootstrap-controller sidecar manifest` generates it from
# the node's kube-apiserver manifest $1 (read on the node, the binary run here), with the image
# SIDECAR_IMAGE if set, then the sed expressions given after $1 (`-e EXPRESSION` pairs). What the
# binary says of kube-apiserver's flags goes to stderr.
sidecar_manifest() {
  local apiserver="$1" manifest image_args=()
  shift
  [ -x "${SIDECAR_BINARY}" ] || sidecar_die "${SIDECAR_BINARY} is missing: cargo build --release --locked --target x86_64-unknown-linux-musl -p bootstrap-controller, or set SIDECAR_BINARY"
  if [ -n "${SIDECAR_IMAGE:-}" ]; then
    image_args=(--image "${SIDECAR_IMAGE}" --image-pull-policy never)
  fi
  manifest="$(sidecar_on_node cat "${apiserver}" </dev/null |
    "${SIDECAR_BINARY}" sidecar manifest --kube-apiserver-manifest - "${image_args[@]}")" ||
    sidecar_die "no manifest generated from the node's ${apiserver}"
  if [ $# -gt 0 ]; then
    manifest="$(printf '%s\n' "${manifest}" | sed "$@")"
  fi
  printf '%s\n' "${manifest}"
}

# One sidecar: setup-node.sh on the node with DIR ($2) and SERVER https://$3:6443 (the
# apiserver this sidecar stands beside), then the manifest generated from that apiserver's
# manifest on the node ($4; sed expressions: the arguments after it) as
# /etc/kubernetes/manifests/$1.yaml, written beside it and renamed in: the kubelet never reads
# half a file.
sidecar_install() {
  local name="$1" dir="$2" address="$3" apiserver="$4" manifest
  shift 4
  sidecar_on_node env DIR="${dir}" KUBEADM_CONFIG="${SIDECAR_KUBEADM_CONFIG}" \
    SERVER="https://${address}:6443" bash -s <"${SIDECAR_ROOT}/deploy/sidecar/setup-node.sh" >/dev/null
  manifest="$(sidecar_manifest "${apiserver}" "$@")"
  # shellcheck disable=SC2016 # expanded by the node's shell, with $1 the name
  printf '%s\n' "${manifest}" | sidecar_on_node sh -c \
    'cat >"/etc/kubernetes/.$1.yaml" && mv "/etc/kubernetes/.$1.yaml" "/etc/kubernetes/manifests/$1.yaml"' \
    - "${name}"
}

# Waits for each pod (kube-system/NAME, the mirror pods of the static pods) to appear (a mirror
# pod exists only once the kubelet has read the manifest, and `kubectl wait` fails at once on a
# pod that does not exist), then to be Ready: SIDECAR_TIMEOUT seconds for each.
sidecar_wait_ready() {
  local pod timeout="${SIDECAR_TIMEOUT:-120}"
  for pod in "$@"; do
    for _ in $(seq 1 "${timeout}"); do
      kubectl -n kube-system get pod "${pod}" >/dev/null 2>&1 && break
      sleep 1
    done
    kubectl -n kube-system wait --for=condition=Ready "pod/${pod}" --timeout="${timeout}s" >/dev/null
  done
}

# Waits up to SIDECAR_TIMEOUT seconds for the `kubernetes` EndpointSlice to list every address
# given.
sidecar_wait_listed() {
  local listed missing address
  for _ in $(seq 1 "${SIDECAR_TIMEOUT:-120}"); do
    listed="$(kubectl -n default get endpointslice kubernetes \
      -o jsonpath='{.endpoints[*].addresses[*]}' 2>/dev/null || true)"
    missing=0
    for address in "$@"; do
      echo " ${listed} " | grep -q " ${address} " || missing=1
    done
    if [ "${missing}" = 0 ]; then
      echo "sidecar: the kubernetes EndpointSlice lists ${listed}" >&2
      return 0
    fi
    sleep 1
  done
  sidecar_die "the kubernetes EndpointSlice lists '${listed}', not all of $*"
}

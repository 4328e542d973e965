#!/usr/bin/env bash
# Installs the bootstrap-controller sidecar on the node up.sh started in DIR, as the README and
# deploy/sidecar/bootstrap-controller.yaml tell users, with the steps kind's script runs too
# (e2e/steps/sidecar.sh): `kubectl apply -f rbac.yaml`, then on the node, as root,
# deploy/sidecar/setup-node.sh (DIR /etc/kubernetes/bootstrap-controller; KUBEADM_CONFIG the
# node's kubeadm configuration; SERVER this node's apiserver) and the manifest that
# `bootstrap-controller sidecar manifest` generates from the node's kube-apiserver manifest (its
# service range 198.19.0.0/16, its advertise address), beside it. The binary is the static one
# build.sh made the node's image from (SIDECAR_BINARY to run another).
# With a second apiserver (up.sh --apiservers 2), a second sidecar beside it, as on a second
# control-plane node: setup-node.sh with DIR=/etc/kubernetes/bootstrap-controller-2 and SERVER the
# second apiserver, and the manifest generated from kube-apiserver-2's (its address), under the
# name bootstrap-controller-2 with that directory, another admin port and its own leader
# identity: what two control-plane nodes would not need, sharing one node here.
# Waits until the sidecars' pods are Ready and the `kubernetes` EndpointSlice lists every
# apiserver.
#
# Usage: e2e/node/install-sidecar.sh DIR
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ $# -eq 1 ] || { echo "usage: install-sidecar.sh DIR" >&2; exit 2; }
dir=$(cd "$1" && pwd)
# shellcheck source=/dev/null
. "$dir/env"
export KUBECONFIG
# shellcheck source=e2e/steps/sidecar.sh
. "$root/e2e/steps/sidecar.sh"

# On the node: its mount and network namespaces, as root, the node's binaries first on PATH.
sidecar_on_node() {
  nsenter -t "$HOLDER_PID" --mount --net env PATH="$NODE_BIN:/usr/sbin:/usr/bin:/sbin:/bin" "$@"
}
SIDECAR_KUBEADM_CONFIG=/etc/kubernetes/kubeadm.yaml

sidecar_rbac
sidecar_install bootstrap-controller /etc/kubernetes/bootstrap-controller "$NODE_IP" \
  /etc/kubernetes/manifests/kube-apiserver.yaml
pods=("bootstrap-controller-$NODE_NAME")
addresses=("$NODE_IP")
if [ "${APISERVERS:-1}" = 2 ]; then
  # shellcheck disable=SC2016 # $(NODE_NAME) is the manifest's own (Kubernetes) reference
  sidecar_install bootstrap-controller-2 /etc/kubernetes/bootstrap-controller-2 "$APISERVER_2_IP" \
    /etc/kubernetes/manifests/kube-apiserver-2.yaml \
    -e 's#^  name: bootstrap-controller$#  name: bootstrap-controller-2#' \
    -e 's#path: /etc/kubernetes/bootstrap-controller$#path: /etc/kubernetes/bootstrap-controller-2#' \
    -e 's#value: "\$(NODE_NAME)"#value: "$(NODE_NAME)-2"#' \
    -e 's#10290#10291#'
  pods+=("bootstrap-controller-2-$NODE_NAME")
  addresses+=("$APISERVER_2_IP")
fi

sidecar_wait_ready "${pods[@]}"
sidecar_wait_listed "${addresses[@]}"
echo "install-sidecar.sh: ${#pods[@]} sidecar(s) run" >&2

#!/usr/bin/env bash
# Installs the bootstrap-controller sidecar on the node up.sh started in DIR, as the README and
# deploy/sidecar/bootstrap-controller.yaml tell users: `kubectl apply -f rbac.yaml`, then on the
# node, as root, deploy/sidecar/setup-node.sh (its default DIR, /etc/kubernetes/bootstrap-controller;
# KUBEADM_CONFIG the node's kubeadm configuration; SERVER this node's apiserver) and the manifest
# copied beside kube-apiserver's. One change to the manifest, which its comment asks for: the
# service range is this node's kube-apiserver's (198.19.0.0/16), not the manifest's 10.96.0.0/12.
# With a second apiserver (up.sh --apiservers 2), a second sidecar beside it, as on a second
# control-plane node: setup-node.sh with DIR=/etc/kubernetes/bootstrap-controller-2 and SERVER the
# second apiserver, and the manifest under the name bootstrap-controller-2 with that directory,
# the second address (HOST_IP is the first's), another admin port and its own leader identity.
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

kubectl apply -f "$root/deploy/sidecar/rbac.yaml" >/dev/null
# setup-node.sh on the node (its mount namespace, where /etc/kubernetes is kubeadm's), as root.
setup_node() { # DIR for setup-node.sh, the apiserver's address
  nsenter -t "$HOLDER_PID" --mount --net env PATH="$NODE_BIN:/usr/sbin:/usr/bin:/sbin:/bin" \
    DIR="$1" KUBEADM_CONFIG=/etc/kubernetes/kubeadm.yaml SERVER="https://$2:6443" \
    "$root/deploy/sidecar/setup-node.sh" >/dev/null
}
# Writes the manifest beside the others and renames it in: the kubelet never reads half a file.
install_manifest() { # name, sed expressions...
  local name=$1 tmp=$dir/etc-kubernetes/.$1.yaml
  shift
  sed -e "s#value: \"10.96.0.0/12\"#value: \"$SERVICE_CIDR\"#" "$@" \
    "$root/deploy/sidecar/bootstrap-controller.yaml" >"$tmp"
  if ! grep -q "value: \"$SERVICE_CIDR\"" "$tmp"; then
    echo "install-sidecar.sh: the manifest's service range was not found to set it to $SERVICE_CIDR" >&2
    exit 1
  fi
  mv "$tmp" "$MANIFESTS/$name.yaml"
}

setup_node /etc/kubernetes/bootstrap-controller "$NODE_IP"
install_manifest bootstrap-controller
pods=("bootstrap-controller-$NODE_NAME")
addresses=("$NODE_IP")
if [ "${APISERVERS:-1}" = 2 ]; then
  setup_node /etc/kubernetes/bootstrap-controller-2 "$APISERVER_2_IP"
  # shellcheck disable=SC2016 # $(NODE_NAME) is the manifest's own (Kubernetes) reference
  install_manifest bootstrap-controller-2 \
    -e 's#^  name: bootstrap-controller$#  name: bootstrap-controller-2#' \
    -e 's#path: /etc/kubernetes/bootstrap-controller$#path: /etc/kubernetes/bootstrap-controller-2#' \
    -e "s#value: \"\$(HOST_IP)\"#value: \"$APISERVER_2_IP\"#" \
    -e 's#value: "\$(NODE_NAME)"#value: "$(NODE_NAME)-2"#' \
    -e 's#10290#10291#'
  pods+=("bootstrap-controller-2-$NODE_NAME")
  addresses+=("$APISERVER_2_IP")
fi

for pod in "${pods[@]}"; do
  for _ in $(seq 1 120); do
    kubectl -n kube-system get pod "$pod" >/dev/null 2>&1 && break
    sleep 1
  done
  kubectl -n kube-system wait --for=condition=Ready "pod/$pod" --timeout=120s >/dev/null
done
for _ in $(seq 1 120); do
  listed=$(kubectl -n default get endpointslice kubernetes -o jsonpath='{.endpoints[*].addresses[*]}' 2>/dev/null || true)
  missing=0
  for address in "${addresses[@]}"; do
    echo " $listed " | grep -q " $address " || missing=1
  done
  if [ "$missing" = 0 ]; then
    echo "install-sidecar.sh: ${#pods[@]} sidecar(s) run; the kubernetes EndpointSlice lists $listed" >&2
    exit 0
  fi
  sleep 1
done
echo "install-sidecar.sh: the kubernetes EndpointSlice lists '$listed', not all of ${addresses[*]}" >&2
exit 1

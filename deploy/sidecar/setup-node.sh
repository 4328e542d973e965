#!/usr/bin/env bash
# Prepares a kubeadm control-plane node for the sidecar (bootstrap-controller.yaml): writes
# $DIR/kubeconfig, a kubeconfig for the user system:bootstrap-controller (rbac.yaml grants it its
# rights), and $DIR/config.yaml, the namespace of the membership Leases. Run as root on every
# control-plane node, before copying the manifest to /etc/kubernetes/manifests/, and again to
# renew the certificate before it expires (it is replaced atomically; the controller reads the
# new file without a restart).
#
# The kubeconfig's key has cluster-wide write rights: it is written 0600 and owned by the uid
# the pod runs as (65532), in a 0700 directory, as kubeadm keeps admin.conf and the
# controller-manager's kubeconfig 0600.
#
# Usage: setup-node.sh            write both files, print the certificate's expiry
#        setup-node.sh --check    print the expiry; exit 1 if it is less than RENEW_DAYS away
# Environment:
#   DIR                  default /etc/kubernetes/bootstrap-controller
#   KUBEADM_CONFIG       a kubeadm configuration file for `kubeadm kubeconfig user --config`
#                        (kind keeps one at /kind/kubeadm.conf); default: kubeadm's defaults
#   SERVER               the apiserver URL to write, e.g. https://192.0.2.10:6443. The membership
#                        follows the /readyz of this server, so it must be this node's apiserver;
#                        set it where the cluster's controlPlaneEndpoint is a load balancer.
#   MEMBERSHIP_NAMESPACE default bootstrap-controller (created by rbac.yaml)
#   OWNER                default 65532:65532
#   RENEW_DAYS           default 30
set -euo pipefail

DIR="${DIR:-/etc/kubernetes/bootstrap-controller}"
MEMBERSHIP_NAMESPACE="${MEMBERSHIP_NAMESPACE:-bootstrap-controller}"
OWNER="${OWNER:-65532:65532}"
RENEW_DAYS="${RENEW_DAYS:-30}"

# Writes stdin to $1 through a temporary file in the same directory: 0600, owned by OWNER,
# renamed over the old file so a reader never sees half of it.
install_private() {
  local target="$1" tmp
  tmp="$(mktemp "${target}.XXXXXX")"
  cat >"${tmp}"
  chmod 0600 "${tmp}"
  chown "${OWNER}" "${tmp}"
  mv -f "${tmp}" "${target}"
}

# The client certificate (PEM) of the kubeconfig $1, from its client-certificate-data.
client_certificate() {
  local data
  data="$(sed -n 's/^ *client-certificate-data: *//p' "$1" | head -n 1)"
  if [ -z "${data}" ]; then
    echo "$1 has no client-certificate-data" >&2
    return 2
  fi
  printf '%s' "${data}" | base64 -d
}

check() {
  local pem
  pem="$(client_certificate "${DIR}/kubeconfig")"
  echo "the client certificate in ${DIR}/kubeconfig expires" \
    "$(printf '%s\n' "${pem}" | openssl x509 -noout -enddate | cut -d= -f2)"
  if ! printf '%s\n' "${pem}" | openssl x509 -noout -checkend $((RENEW_DAYS * 86400)) >/dev/null; then
    echo "less than ${RENEW_DAYS} days left: run $0 again to renew it" >&2
    return 1
  fi
}

setup() {
  local kubeconfig
  install -d -m 0700 "${DIR}"
  chown "${OWNER}" "${DIR}"
  kubeconfig="$(kubeadm kubeconfig user --client-name=system:bootstrap-controller \
    ${KUBEADM_CONFIG:+"--config=${KUBEADM_CONFIG}"})"
  if [ -n "${SERVER:-}" ]; then
    kubeconfig="$(printf '%s\n' "${kubeconfig}" | sed -e "s#^\( *server: \).*#\1${SERVER}#")"
  fi
  printf '%s\n' "${kubeconfig}" | install_private "${DIR}/kubeconfig"
  printf 'loops:\n  apiserverEndpoints:\n    leaseNamespace: %s\n' "${MEMBERSHIP_NAMESPACE}" |
    install_private "${DIR}/config.yaml"
  if command -v openssl >/dev/null 2>&1; then
    check
  else
    echo "openssl is not installed here: the certificate's expiry was not read (run $0 --check where it is)" >&2
  fi
}

case "${1:-}" in
  --check) check ;;
  "") setup ;;
  *)
    echo "usage: $0 [--check]" >&2
    exit 2
    ;;
esac

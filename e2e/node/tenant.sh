#!/usr/bin/env bash
# Starts a tenant control plane on the node up.sh started in DIR, as hosted control planes run
# one beside the management cluster's (Kamaji: its own apiserver, its own prefix in a shared
# etcd): kube-apiserver-tenant and kube-controller-manager-tenant as static pods, from the node's
# images. The apiserver is kubeadm's manifest moved to its own address 198.18.0.4 (added to the
# node's eth0), with --endpoint-reconciler-type=none like the node's, its own etcd prefix
# (/tenant) on the node's etcd, its own service range 198.18.160.0/20 (outside the node's
# 198.19.0.0/16 and pod range 198.18.64.0/18), and a CA, serving certificate and service-account
# keys of its own, made here with openssl. The controller manager runs the namespace and
# garbage-collector controllers (a deleted namespace is finalized and goes away, as in any
# cluster), each with its own service account's credentials, as kubeadm runs it. down.sh DIR
# stops them with the node.
#
# Usage: e2e/node/tenant.sh DIR
#
# What it writes into DIR:
#   tenant-admin.kubeconfig   a system:masters user of the tenant, credentials inline
#   tenant-controller.kubeconfig   the user bootstrap-controller-tenant (no group, no rights until
#                             RBAC in the tenant grants them), inline: what a tenant Secret holds
#   etc-kubernetes/pki/tenant/            the tenant's CA (ca.crt, ca.key), serving certificate, keys
#   var-log-kubernetes/audit/tenant-audit.log   the tenant apiserver's audit log (Metadata level)
# and appends TENANT_IP, TENANT_SERVICE_CIDR and TENANT_KUBECONFIG to DIR/env. Waits until the
# tenant's /readyz answers 200 and its default ServiceCIDR exists.
set -euo pipefail

[ $# -eq 1 ] || { sed -n 's/^# Usage: /usage: /p' "$0" >&2; exit 2; }
[ -f "$1/env" ] || { echo "tenant.sh: no node in $1 (no $1/env): start one with up.sh" >&2; exit 2; }
dir=$(cd "$1" && pwd)
# shellcheck source=/dev/null
. "$dir/env"
tenant_ip=198.18.0.4
tenant_cidr=198.18.160.0/20
# The first address of the range: the tenant's `kubernetes` Service, in its serving certificate.
tenant_service_ip=198.18.160.1
pki=$dir/etc-kubernetes/pki/tenant
if [ -e "$pki" ]; then
  echo "tenant.sh: $pki exists: a tenant was started on this node already" >&2
  exit 2
fi
mkdir -p "$pki"

# On the node's eth0, beside the node's two addresses (the same /29).
nsenter --net="/run/netns/$NETNS" ip addr add "$tenant_ip/29" dev eth0

openssl_quiet() { openssl "$@" 2>/dev/null; }
openssl_quiet req -x509 -newkey rsa:2048 -nodes -keyout "$pki/ca.key" -out "$pki/ca.crt" -days 30 \
  -subj "/CN=tenant-ca"
# sign NAME SUBJECT EXTENSIONS: NAME.key and NAME.crt signed by the tenant's CA.
sign() {
  openssl_quiet req -newkey rsa:2048 -nodes -keyout "$pki/$1.key" -out "$pki/$1.csr" -subj "$2"
  openssl_quiet x509 -req -in "$pki/$1.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 30 -out "$pki/$1.crt" -extfile <(printf '%s\n' "$3")
  rm -f "$pki/$1.csr"
}
sign apiserver /CN=kube-apiserver-tenant \
  "subjectAltName=IP:$tenant_ip,IP:$tenant_service_ip,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local
extendedKeyUsage=serverAuth"
sign admin "/CN=tenant-admin/O=system:masters" "extendedKeyUsage=clientAuth"
sign controller-manager /CN=system:kube-controller-manager "extendedKeyUsage=clientAuth"
# The identity a tenant Secret's kubeconfig gives bootstrap-controller: no group, so no rights
# beyond what RBAC applied in the tenant grants it (the chart README's rendered rbac.yaml).
sign bootstrap-controller /CN=bootstrap-controller-tenant "extendedKeyUsage=clientAuth"
openssl_quiet genrsa -out "$pki/sa.key" 2048
openssl_quiet rsa -in "$pki/sa.key" -pubout -out "$pki/sa.pub"

b64() { base64 -w0 "$1"; }
# kubeconfig USER_FILE_PREFIX: a kubeconfig with the tenant's CA and that user's certificate inline.
kubeconfig() {
  cat <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: tenant
    cluster:
      server: https://$tenant_ip:6443
      certificate-authority-data: $(b64 "$pki/ca.crt")
users:
  - name: $1
    user:
      client-certificate-data: $(b64 "$pki/$1.crt")
      client-key-data: $(b64 "$pki/$1.key")
contexts:
  - name: tenant
    context: {cluster: tenant, user: $1}
current-context: tenant
EOF
}
kubeconfig admin >"$dir/tenant-admin.kubeconfig"
kubeconfig bootstrap-controller >"$dir/tenant-controller.kubeconfig"
kubeconfig controller-manager >"$pki/controller-manager.kubeconfig"
chmod 600 "$dir/tenant-admin.kubeconfig" "$dir/tenant-controller.kubeconfig" "$pki"/*.key "$pki/controller-manager.kubeconfig"

# kubeadm's kube-apiserver manifest, moved to the tenant's address, certificates, keys, range and
# etcd prefix, under another name and audit log, without its named container port (a host port
# on every address: the kubelet would refuse it beside the node's apiserver). /etc/kubernetes/pki
# is mounted in it already: the tenant's files are under it. Written beside the manifests and
# renamed in: the kubelet never reads half a file.
manifest=$dir/etc-kubernetes/manifests/kube-apiserver.yaml
tmp=$dir/etc-kubernetes/.kube-apiserver-tenant.yaml
sed -e "s/$NODE_IP/$tenant_ip/g" -e 's/^  name: kube-apiserver$/  name: kube-apiserver-tenant/' \
  -e 's#audit/audit.log#audit/tenant-audit.log#' \
  -e '/^    ports:$/,/^      protocol: TCP$/d' -e 's/port: probe-port$/port: 6443/' \
  -e "s#--service-cluster-ip-range=.*#--service-cluster-ip-range=$tenant_cidr#" \
  -e 's#--client-ca-file=.*#--client-ca-file=/etc/kubernetes/pki/tenant/ca.crt#' \
  -e 's#--tls-cert-file=.*#--tls-cert-file=/etc/kubernetes/pki/tenant/apiserver.crt#' \
  -e 's#--tls-private-key-file=.*#--tls-private-key-file=/etc/kubernetes/pki/tenant/apiserver.key#' \
  -e 's#--service-account-key-file=.*#--service-account-key-file=/etc/kubernetes/pki/tenant/sa.pub#' \
  -e 's#--service-account-signing-key-file=.*#--service-account-signing-key-file=/etc/kubernetes/pki/tenant/sa.key#' \
  -e 's#^\( *\)- --etcd-servers=\(.*\)$#\1- --etcd-servers=\2\n\1- --etcd-prefix=/tenant#' \
  "$manifest" >"$tmp"
# Every replacement took: a manifest that kept the node's range, CA or prefix would be a second
# apiserver of the node, not a tenant.
for expected in "name: kube-apiserver-tenant" "--service-cluster-ip-range=$tenant_cidr" \
  "--client-ca-file=/etc/kubernetes/pki/tenant/ca.crt" "--tls-cert-file=/etc/kubernetes/pki/tenant/apiserver.crt" \
  "--service-account-key-file=/etc/kubernetes/pki/tenant/sa.pub" "--etcd-prefix=/tenant" \
  "--advertise-address=$tenant_ip" "--endpoint-reconciler-type=none" "tenant-audit.log"; do
  grep -q -e "$expected" "$tmp" || { echo "tenant.sh: '$expected' missing from the tenant's manifest" >&2; exit 1; }
done
if grep -q -e "$NODE_IP" -e "containerPort" "$tmp"; then
  echo "tenant.sh: the tenant's manifest still names $NODE_IP or a container port" >&2
  exit 1
fi
mv "$tmp" "$MANIFESTS/kube-apiserver-tenant.yaml"

image=$(sed -n 's/^ *image: *\(.*kube-controller-manager.*\)$/\1/p' "$MANIFESTS/kube-controller-manager.yaml")
[ -n "$image" ] || { echo "tenant.sh: no image in kube-controller-manager.yaml" >&2; exit 1; }
cat >"$dir/etc-kubernetes/.kube-controller-manager-tenant.yaml" <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: kube-controller-manager-tenant
  namespace: kube-system
  labels:
    component: kube-controller-manager-tenant
    tier: control-plane
spec:
  hostNetwork: true
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: kube-controller-manager
      image: $image
      imagePullPolicy: Never
      command:
        - kube-controller-manager
        - --kubeconfig=/etc/kubernetes/pki/tenant/controller-manager.kubeconfig
        - --controllers=namespace,garbagecollector
        - --use-service-account-credentials=true
        - --root-ca-file=/etc/kubernetes/pki/tenant/ca.crt
        # One instance, no port of its own (the node's controller manager serves on 10257).
        - --leader-elect=false
        - --secure-port=0
        - --profiling=false
      volumeMounts:
        - name: tenant-pki
          mountPath: /etc/kubernetes/pki/tenant
          readOnly: true
  volumes:
    - name: tenant-pki
      hostPath:
        path: /etc/kubernetes/pki/tenant
        type: Directory
EOF
mv "$dir/etc-kubernetes/.kube-controller-manager-tenant.yaml" "$MANIFESTS/kube-controller-manager-tenant.yaml"

{
  echo "TENANT_IP=$tenant_ip"
  echo "TENANT_SERVICE_CIDR=$tenant_cidr"
  echo "TENANT_KUBECONFIG=$dir/tenant-admin.kubeconfig"
} >>"$dir/env"

echo "tenant.sh: waiting for the tenant's kube-apiserver on https://$tenant_ip:6443" >&2
for _ in $(seq 1 240); do
  if kubectl --kubeconfig "$dir/tenant-admin.kubeconfig" get servicecidr kubernetes >/dev/null 2>&1 \
    && [ "$(kubectl --kubeconfig "$dir/tenant-admin.kubeconfig" get --raw /readyz 2>/dev/null)" = ok ]; then
    echo "tenant.sh: the tenant control plane answers on https://$tenant_ip:6443" >&2
    exit 0
  fi
  sleep 1
done
echo "tenant.sh: the tenant's kube-apiserver did not become ready in 240 s; see $dir/var-log-pods" >&2
exit 1

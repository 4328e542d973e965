#!/usr/bin/env bash
# Creates a kind cluster and tries bootstrap-controller on it the ways users run it:
#   1. the end-to-end tests (cargo test -p e2e) against the cluster;
#   2. the Helm chart (Deployment mode), checked with the binary's own `check`;
#   3. the sidecar: a static pod beside kube-apiserver, keeping the `kubernetes` endpoints.
# kube-apiserver runs with --endpoint-reconciler-type=none, so the endpoints are ours to keep.
#
# Needs: kind, kubectl, helm, cargo, and docker or podman. Tear down with ./down.sh.
# kind cannot run on the project's CI machines (no container engine there); everything this
# script calls is tested against the API simulator instead (README, "Install").
#
# Environment: CLUSTER (default bootstrap-controller), NODE_IMAGE (default kindest/node:v1.33.1),
# ENGINE (docker or podman; default: whichever is found), SKIP_E2E=1 to skip step 1.
set -euo pipefail

cd "$(dirname "$0")/../.."
CLUSTER="${CLUSTER:-bootstrap-controller}"
NODE_IMAGE="${NODE_IMAGE:-kindest/node:v1.33.1}"
IMAGE="bootstrap-controller:kind"
NAMESPACE="bootstrap-controller"
ENGINE="${ENGINE:-$(command -v docker >/dev/null 2>&1 && echo docker || echo podman)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log() { printf '\n== %s\n' "$*"; }

# kubeadm's config API: v1beta4 from Kubernetes 1.31 on (extraArgs as a list), v1beta3 before.
node_minor() {
  local version="${NODE_IMAGE##*:v}"
  version="${version%%@*}"
  echo "${version}" | cut -d. -f2
}

kubeadm_patch() {
  if [ "$(node_minor)" -ge 31 ]; then
    cat <<'PATCH'
  - |
    kind: ClusterConfiguration
    apiVersion: kubeadm.k8s.io/v1beta4
    apiServer:
      extraArgs:
        - name: endpoint-reconciler-type
          value: "none"
PATCH
  else
    cat <<'PATCH'
  - |
    kind: ClusterConfiguration
    apiVersion: kubeadm.k8s.io/v1beta3
    apiServer:
      extraArgs:
        endpoint-reconciler-type: "none"
PATCH
  fi
}

log "cluster ${CLUSTER} (${NODE_IMAGE})"
cat >"${WORK}/kind.yaml" <<EOF2
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    image: ${NODE_IMAGE}
kubeadmConfigPatches:
$(kubeadm_patch)
EOF2
kind create cluster --name "${CLUSTER}" --config "${WORK}/kind.yaml" --wait 120s
KUBECONFIG_FILE="${WORK}/kubeconfig"
kind get kubeconfig --name "${CLUSTER}" >"${KUBECONFIG_FILE}"
export KUBECONFIG="${KUBECONFIG_FILE}"

log "image ${IMAGE}"
"${ENGINE}" build -f Containerfile -t "${IMAGE}" .
if [ "${ENGINE}" = docker ]; then
  kind load docker-image "${IMAGE}" --name "${CLUSTER}"
else
  "${ENGINE}" save "${IMAGE}" -o "${WORK}/image.tar"
  kind load image-archive "${WORK}/image.tar" --name "${CLUSTER}"
fi

if [ "${SKIP_E2E:-0}" != 1 ]; then
  log "end-to-end tests against the cluster"
  cargo build --workspace --bins
  BOOTSTRAP_E2E_KUBECONFIG="${KUBECONFIG_FILE}" cargo test -p e2e
fi

log "Helm chart (Deployment mode)"
helm install bc charts/bootstrap-controller --namespace "${NAMESPACE}" --create-namespace \
  --set image.repository="${IMAGE%%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=Never --wait --timeout 180s
kubectl -n "${NAMESPACE}" rollout status deployment/bc-bootstrap-controller --timeout=120s
kubectl -n "${NAMESPACE}" exec deployment/bc-bootstrap-controller -- \
  /bootstrap-controller check --config /etc/bootstrap-controller/config.yaml
kubectl delete namespace kube-node-lease --wait=false
kubectl wait --for=jsonpath='{.status.phase}'=Active namespace/kube-node-lease --timeout=60s
helm uninstall bc --namespace "${NAMESPACE}" --wait

log "sidecar (static pod beside kube-apiserver)"
NODE="${CLUSTER}-control-plane"
kubectl apply -f deploy/sidecar/rbac.yaml
"${ENGINE}" exec "${NODE}" sh -c \
  'kubeadm kubeconfig user --client-name=system:bootstrap-controller \
     --config=/kind/kubeadm.conf >/etc/kubernetes/bootstrap-controller.conf \
   && chown 65532 /etc/kubernetes/bootstrap-controller.conf'
sed -e "s#image: bootstrap-controller:0.1.0#image: ${IMAGE}#" \
  -e 's#imagePullPolicy: IfNotPresent#imagePullPolicy: Never#' \
  deploy/sidecar/bootstrap-controller.yaml >"${WORK}/sidecar.yaml"
"${ENGINE}" cp "${WORK}/sidecar.yaml" "${NODE}:/etc/kubernetes/manifests/bootstrap-controller.yaml"
kubectl -n kube-system wait --for=condition=Ready "pod/bootstrap-controller-${NODE}" --timeout=180s
NODE_IP="$(kubectl get node "${NODE}" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')"
for _ in $(seq 60); do
  if kubectl get endpoints kubernetes -o jsonpath='{.subsets[*].addresses[*].ip}' | grep -qw "${NODE_IP}"; then
    log "sidecar keeps the kubernetes endpoints: ${NODE_IP}"
    exit 0
  fi
  sleep 1
done
echo "the kubernetes endpoints never listed ${NODE_IP}" >&2
exit 1

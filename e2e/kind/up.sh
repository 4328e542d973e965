#!/usr/bin/env bash
# Creates a kind cluster and tries bootstrap-controller on it the ways users run it:
#   1. the end-to-end tests (cargo test -p e2e) against the cluster, from outside it;
#   2. the sidecar: a static pod beside kube-apiserver, keeping the `kubernetes` endpoints;
#   3. the Helm chart (Deployment mode), checked with the binary's own `check` in its pod.
# kube-apiserver runs with --endpoint-reconciler-type=none (the script fails if it does not), so
# nothing lists it in the `kubernetes` endpoints until the sidecar does: pods that reach the API
# through that Service, the chart's included, can only start after step 2.
#
# Needs: kind, kubectl, helm, cargo, and docker or podman. Tear down with ./down.sh.
# kind cannot run on the project's CI machines (no container engine there): every step is tested
# with stand-ins for these commands (e2e/packaging/test_kind.py), and everything the steps
# install (chart, manifests, image, binary) against the API simulator (README, "Install").
#
# Environment: CLUSTER (default bootstrap-controller), NODE_IMAGE (default kindest/node:v1.33.1),
# ENGINE (docker or podman; default: whichever is found), SKIP_E2E=1 to skip step 1.
set -euo pipefail

cd "$(dirname "$0")/../.."
# shellcheck source=e2e/kind/lib.sh
. e2e/kind/lib.sh

CLUSTER="${CLUSTER:-bootstrap-controller}"
NODE_IMAGE="${NODE_IMAGE:-kindest/node:v1.33.1}"
IMAGE="${KIND_IMAGE_REPOSITORY}:${KIND_IMAGE_TAG}"
NAMESPACE="bootstrap-controller"
NODE="${CLUSTER}-control-plane"
ENGINE="${ENGINE:-$(command -v docker >/dev/null 2>&1 && echo docker || echo podman)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log "cluster ${CLUSTER} (${NODE_IMAGE})"
kind_config "${NODE_IMAGE}" >"${WORK}/kind.yaml"
kind create cluster --name "${CLUSTER}" --config "${WORK}/kind.yaml" --wait 120s
KUBECONFIG_FILE="${WORK}/kubeconfig"
kind get kubeconfig --name "${CLUSTER}" >"${KUBECONFIG_FILE}"
export KUBECONFIG="${KUBECONFIG_FILE}"
# The mirror pod of kube-apiserver's static pod may be registered a moment after the node is
# Ready: an empty answer is asked again (require_reconciler_off fails on one that stays empty).
for _ in $(seq 30); do
  APISERVER_COMMANDS="$(kubectl -n kube-system get pods -l component=kube-apiserver \
    -o jsonpath='{range .items[*]}{.spec.containers[0].command}{"\n"}{end}')"
  [ -n "${APISERVER_COMMANDS}" ] && break
  sleep 1
done
printf '%s\n' "${APISERVER_COMMANDS}" | require_reconciler_off
SERVICE_RANGE="$(printf '%s\n' "${APISERVER_COMMANDS}" | apiserver_flag service-cluster-ip-range)"

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

log "sidecar (static pod beside kube-apiserver)"
kubectl apply -f deploy/sidecar/rbac.yaml
"${ENGINE}" exec -i -e KUBEADM_CONFIG=/kind/kubeadm.conf "${NODE}" bash -s \
  <deploy/sidecar/setup-node.sh
sidecar_manifest "${IMAGE}" "${SERVICE_RANGE}" <deploy/sidecar/bootstrap-controller.yaml \
  >"${WORK}/sidecar.yaml"
"${ENGINE}" cp "${WORK}/sidecar.yaml" "${NODE}:/etc/kubernetes/manifests/bootstrap-controller.yaml"
wait_for_pod kube-system "bootstrap-controller-${NODE}" 180
NODE_IP="$(kubectl get node "${NODE}" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')"
wait_for_endpoint "${NODE_IP}" 60
log "the sidecar keeps the kubernetes endpoints: ${NODE_IP}"

log "Helm chart (Deployment mode)"
# A leader Lease of its own: the sidecar keeps leading the endpoints it owns.
helm install bc charts/bootstrap-controller --namespace "${NAMESPACE}" --create-namespace \
  --set image.tag="${KIND_IMAGE_TAG}" --set image.pullPolicy=Never \
  --set config.leaderElection.leaseName=bootstrap-controller-chart \
  --wait --timeout 180s
kubectl -n "${NAMESPACE}" exec deployment/bc-bootstrap-controller -- /bootstrap-controller check
kubectl delete namespace kube-node-lease --wait=false
kubectl wait --for=jsonpath='{.status.phase}'=Active namespace/kube-node-lease --timeout=60s
helm uninstall bc --namespace "${NAMESPACE}" --wait
log "done: the sidecar still runs; ./down.sh deletes the cluster"

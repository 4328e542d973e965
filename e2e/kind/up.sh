#!/usr/bin/env bash
# Creates a kind cluster and tries bootstrap-controller on it the ways users run it:
#   1. the end-to-end test files that run against a given cluster (cargo test -p e2e --test ...),
#      from outside it, what they skip there listed and compared with their lines of
#      e2e/control-plane/expected-skips.txt;
#   2. the sidecar: a static pod beside kube-apiserver, keeping the `kubernetes` endpoints,
#      installed by the steps the real node runs too (e2e/steps/sidecar.sh);
#   3. the Helm chart (Deployment mode) by e2e/steps/install-chart.sh, which checks it with the
#      binary's own `check` in its pod; then the namespace repair it does, and its uninstall.
# kube-apiserver runs with --endpoint-reconciler-type=none (the script fails if it does not), so
# nothing lists it in the `kubernetes` endpoints until the sidecar does: pods that reach the API
# through that Service, the chart's included, can only start after step 2.
#
# Needs: kind, kubectl, helm, cargo (with the x86_64-unknown-linux-musl target: the image is the
# Containerfile's `prebuilt` stage around the static binary, so nothing is pulled), and docker or
# podman. Tear down with ./down.sh. e2e/kind/test.sh builds what this needs on a machine
# without a registry and runs it. Every step is also tested with stand-ins for these commands
# (e2e/packaging/test_kind.py).
#
# Environment: CLUSTER (default bootstrap-controller), NODE_IMAGE (default kindest/node:v1.33.1),
# ENGINE (docker or podman; default: whichever is found), KIND and HELM (the binaries; default
# kind and helm on PATH), INSTALL_CHART (default e2e/steps/install-chart.sh), SKIP_E2E=1 to
# skip step 1.
set -euo pipefail

cd "$(dirname "$0")/../.."
# shellcheck source=e2e/kind/lib.sh
. e2e/kind/lib.sh
# shellcheck source=e2e/steps/sidecar.sh
. e2e/steps/sidecar.sh
# shellcheck source=e2e/control-plane/skips.sh
. e2e/control-plane/skips.sh

CLUSTER="${CLUSTER:-bootstrap-controller}"
NODE_IMAGE="${NODE_IMAGE:-kindest/node:v1.33.1}"
KIND="${KIND:-kind}"
HELM="${HELM:-helm}"
export HELM
INSTALL_CHART="${INSTALL_CHART:-e2e/steps/install-chart.sh}"
[ -x "${INSTALL_CHART}" ] ||
  die "${INSTALL_CHART} (the chart's install step, shared with the real node) is missing or not executable; set INSTALL_CHART to it"
IMAGE="${KIND_IMAGE_REPOSITORY}:${KIND_IMAGE_TAG}"
NAMESPACE="bootstrap-controller"
NODE="${CLUSTER}-control-plane"
ENGINE="${ENGINE:-$(command -v docker >/dev/null 2>&1 && echo docker || echo podman)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

log "cluster ${CLUSTER} (${NODE_IMAGE})"
kind_config "${NODE_IMAGE}" >"${WORK}/kind.yaml"
KUBECONFIG_FILE="${WORK}/kubeconfig"
# A kubeconfig of the run's own: the user's ~/.kube/config is left alone.
"${KIND}" create cluster --name "${CLUSTER}" --config "${WORK}/kind.yaml" --wait 120s \
  --kubeconfig "${KUBECONFIG_FILE}"
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

log "image ${IMAGE}"
cargo build --release --locked --target x86_64-unknown-linux-musl -p bootstrap-controller
"${ENGINE}" build --build-arg BINARY_STAGE=prebuilt -f Containerfile -t "${IMAGE}" .
if [ "${ENGINE}" = docker ]; then
  "${KIND}" load docker-image "${IMAGE}" --name "${CLUSTER}"
else
  "${ENGINE}" save "${IMAGE}" -o "${WORK}/image.tar"
  "${KIND}" load image-archive "${WORK}/image.tar" --name "${CLUSTER}"
fi

# kubeadm's advertise address, in kube-apiserver's serving certificate.
NODE_IP="$(kubectl get node "${NODE}" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}')"
[ -n "${NODE_IP}" ] || die "node ${NODE} has no InternalIP"

if [ "${SKIP_E2E:-0}" = 1 ]; then
  log "SKIP_E2E=1: the end-to-end tests (cargo test -p e2e) do not run against the cluster"
else
  log "end-to-end tests against the cluster"
  cargo build --workspace --bins
  # The test files that run against the cluster they are given: the others start simulators or
  # control planes of their own and run with the workspace's tests anyway. One test at a
  # time, as the README says: they share the cluster's `kubernetes` endpoints. What they skip is
  # recorded and compared with those files' lines of the list the real control plane's run keeps
  # (e2e/control-plane/skips.sh): the skips depend on a cluster being given, not on which.
  mapfile -t E2E_FILES < <(cluster_facing_tests e2e/control-plane/expected-skips.txt e2e/tests)
  [ "${#E2E_FILES[@]}" -gt 0 ] || die "no test file in e2e/tests runs against a given cluster"
  E2E_ARGS=()
  for f in "${E2E_FILES[@]}"; do E2E_ARGS+=(--test "$f"); done
  skips_expected_of e2e/control-plane/expected-skips.txt "${E2E_FILES[@]}" >"${WORK}/expected-skips.txt"
  : >"${WORK}/e2e-skips"
  BOOTSTRAP_E2E_KUBECONFIG="${KUBECONFIG_FILE}" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS="${NODE_IP}" \
    BOOTSTRAP_E2E_SKIP_LOG="${WORK}/e2e-skips" \
    cargo test --color never -p e2e "${E2E_ARGS[@]}" -- --test-threads=1 2>&1 | tee "${WORK}/e2e-output"
  IS_ROOT=false
  if [ "$(id -u)" = 0 ]; then IS_ROOT=true; fi
  # No audit log of up.sh's beside kind's kubeconfig: the tests that read one skip.
  skips_report "${WORK}/e2e-skips" "${WORK}/e2e-output" "${WORK}/expected-skips.txt" \
    "${IS_ROOT}" without-audit-log || die "the end-to-end tests did not check against kind what they are expected to"
fi

log "sidecar (static pod beside kube-apiserver)"
sidecar_on_node() { "${ENGINE}" exec -i "${NODE}" "$@"; }
SIDECAR_KUBEADM_CONFIG=/kind/kubeadm.conf
SIDECAR_IMAGE="${IMAGE}"
sidecar_rbac
sidecar_install bootstrap-controller /etc/kubernetes/bootstrap-controller "${NODE_IP}" \
  /etc/kubernetes/manifests/kube-apiserver.yaml
sidecar_wait_ready "bootstrap-controller-${NODE}"
sidecar_wait_listed "${NODE_IP}"
log "the sidecar keeps the kubernetes endpoints: ${NODE_IP}"

log "Helm chart (Deployment mode)"
# A leader Lease of its own: the sidecar keeps leading the endpoints it owns.
"${INSTALL_CHART}" bc "${NAMESPACE}" "${KIND_IMAGE_REPOSITORY}" "${KIND_IMAGE_TAG}" \
  --set config.leaderElection.leaseName=bootstrap-controller-chart
kubectl delete namespace kube-node-lease --wait=false
# Back within 30 s, under kube-apiserver's own one-minute loop, and made by this controller: its
# field manager on the new namespace (a namespace coming back alone proves nothing).
kubectl wait --for=jsonpath='{.status.phase}'=Active namespace/kube-node-lease --timeout=30s
managers=$(kubectl get namespace kube-node-lease --show-managed-fields \
  -o jsonpath='{.metadata.managedFields[*].manager}')
case " ${managers} " in
  *" bootstrap-controller "*) log "kube-node-lease recreated by bootstrap-controller" ;;
  *) die "kube-node-lease came back, but not by bootstrap-controller (managers: ${managers})" ;;
esac
"${HELM}" uninstall bc --namespace "${NAMESPACE}" --wait
log "done: the sidecar still runs; ./down.sh deletes the cluster"

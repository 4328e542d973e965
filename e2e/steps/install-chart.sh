#!/usr/bin/env bash
# Installs (or upgrades) the Helm chart as a release and proves it works the way the README and
# the chart's NOTES.txt tell users to: `helm upgrade --install ... --wait`, then
# `bootstrap-controller check` in a pod of the release (`kubectl exec deployment/<fullname>`),
# which runs with the controller's own settings (they are the container's environment). One
# implementation for every cluster the tests install the chart on: the real node
# (e2e/node/test_node_chart.py) and kind's (e2e/kind/up.sh).
#
# Usage: KUBECONFIG=... e2e/steps/install-chart.sh RELEASE NAMESPACE IMAGE_REPOSITORY IMAGE_TAG [extra helm args...]
#
# The image is never pulled (image.pullPolicy=Never): it must already be on the nodes. The extra
# arguments go to helm after this script's own, so a `--set` or `--timeout` there wins. HELM
# names the helm binary (default: helm on PATH). Exits non-zero when helm fails, when the release
# has not exactly one Deployment, or when `check` does not exit 0 (1: drift, 2: error); check's
# report is printed either way. `check` works on one cluster: a release in management mode
# (tenants.enabled) has no cluster of its own to check and fails here (exit 2 from check).
set -euo pipefail

usage() {
  sed -n 's/^# Usage: //p' "$0" >&2
  exit 2
}
[ $# -ge 4 ] || usage
release=$1 namespace=$2 repository=$3 tag=$4
shift 4
for arg in "$release" "$namespace" "$repository" "$tag"; do
  [ -n "$arg" ] || usage
done
root=$(cd "$(dirname "$0")/../.." && pwd)
helm=${HELM:-helm}

"$helm" upgrade --install "$release" "$root/charts/bootstrap-controller" \
  --namespace "$namespace" --create-namespace \
  --set "image.repository=$repository" --set "image.tag=$tag" --set image.pullPolicy=Never \
  --wait --timeout 300s "$@"

# The release's Deployment by its instance label: its name is the chart's fullname, which
# nameOverride and fullnameOverride (possibly among the extra arguments) change.
deployments=$(kubectl -n "$namespace" get deployments -l "app.kubernetes.io/instance=$release" \
  -o jsonpath='{.items[*].metadata.name}')
read -r -a names <<<"$deployments"
if [ "${#names[@]}" != 1 ]; then
  echo "install-chart.sh: release $release in $namespace has ${#names[@]} Deployments ('$deployments'), not one" >&2
  exit 1
fi
echo "install-chart.sh: release $release installed; check in deployment/${names[0]}" >&2
# The image's binary is /bootstrap-controller (Containerfile); exec's status is check's.
kubectl -n "$namespace" exec "deployment/${names[0]}" -- /bootstrap-controller check

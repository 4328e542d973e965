#!/usr/bin/env bash
# Runs the node's scenario tests: starts a node with up.sh (two apiservers, no sidecar yet: the
# first test shows the API unreachable from a pod until the sidecar lists it, and installs it as
# the README says), runs pytest against it (test_node.py, the sidecar; then test_node_chart.py,
# the Helm chart with build.sh's helm, beside the sidecar and in management mode with a tenant
# control plane), then upstream's conformance tests against the same node and the sidecar
# pytest leaves (conformance.sh: the specs of conformance.focus, then the audit logs read for the
# controller's writes to the tests' objects), and removes it with down.sh whatever happens. DIR is
# kept when a test fails (its logs), removed when all pass. A scenario that skips fails the run:
# nothing is expected to.
#
# Usage: e2e/node/test.sh [pytest options, e.g. -k killed]
# NODE_CONFORMANCE=0 leaves the conformance tests out (and says so), e.g. beside -k.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ]; then
  echo "usage: e2e/node/test.sh [pytest options] (as root: the node needs namespaces and cgroups)" >&2
  exit 2
fi
dir=$(mktemp -d -t node-e2e-XXXXXX)
status=1
finish() {
  "$here/down.sh" "$dir" >/dev/null || true
  if [ "$status" = 0 ]; then
    rm -rf "$dir"
  else
    echo "test.sh: failed; the node's logs are in $dir" >&2
  fi
}
trap finish EXIT

"$here/up.sh" "$dir" --without-sidecar --apiservers 2
# -p no:cacheprovider: nothing written into the repository. -rs: a skipped test is listed with
# its reason.
BOOTSTRAP_NODE_DIR=$dir python3 -m pytest -p no:cacheprovider -v -s -rs "$here/test_node.py" \
  "$here/test_node_chart.py" "$@" 2>&1 | tee "$dir/pytest-output"
# The node is given, so every scenario runs against it: one that skipped checked nothing there,
# and the run says so and fails.
if grep -Eq '^=+ .*[0-9]+ skipped' "$dir/pytest-output"; then
  echo "test.sh: a scenario skipped on the node (listed above with its reason); none is expected to" >&2
  exit 1
fi
if [ "${NODE_CONFORMANCE:-1}" = 0 ]; then
  echo "test.sh: not checked against the node: upstream's conformance tests (NODE_CONFORMANCE=0)"
else
  "$here/conformance.sh" "$dir"
  echo "test.sh: not checked against the node: nothing (no scenario skipped, the conformance tests ran)"
fi
status=0

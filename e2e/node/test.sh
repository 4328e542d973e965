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
# NODE_CONFORMANCE=0 leaves the conformance tests out (and says so), e.g. beside -k, and does not
# build them.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ]; then
  echo "usage: e2e/node/test.sh [pytest options] (as root: the node needs namespaces and cgroups)" >&2
  exit 2
fi
dir=$(mktemp -d -t node-e2e-XXXXXX)
status=1
conformance_build=
conformance_log=$(mktemp -t node-e2e-conformance-build-XXXXXX)
finish() {
  [ -z "$conformance_build" ] || kill -TERM -- "-$conformance_build" 2>/dev/null || true
  rm -f "$conformance_log"
  "$here/down.sh" "$dir" >/dev/null || true
  if [ "$status" = 0 ]; then
    rm -rf "$dir"
  else
    echo "test.sh: failed; the node's logs are in $dir" >&2
  fi
}
trap finish EXIT

# The node (up.sh builds its binaries, installs what the node needs and starts it) without the
# conformance tests' binaries and images: those (e2e.test alone is minutes of compile on a fresh
# machine) build next, in a process group of their own, beside the node's scenarios, which mostly
# wait: at a low priority (nice 10), which still comes before the builds ./run-tests.sh runs at
# the lowest (nice 19) and needs later.
NODE_CONFORMANCE=0 "$here/up.sh" "$dir" --without-sidecar --apiservers 2
if [ "${NODE_CONFORMANCE:-1}" != 0 ]; then
  # A session of its own is an autogroup of its own, whose niceness at-priority.sh sets too.
  setsid --wait "$here/../steps/at-priority.sh" 10 "$here/build.sh" --conformance \
    >"$conformance_log" 2>&1 &
  conformance_build=$!
fi
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
  built=0
  wait "$conformance_build" || built=$?
  conformance_build=
  cat "$conformance_log" >&2
  if [ "$built" != 0 ]; then
    echo "test.sh: building the conformance tests failed (exit $built; its output above)" >&2
    exit 1
  fi
  "$here/conformance.sh" "$dir"
  echo "test.sh: not checked against the node: nothing (no scenario skipped, the conformance tests ran)"
fi
status=0

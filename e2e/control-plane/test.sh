#!/usr/bin/env bash
# Runs the end-to-end suite (e2e/tests) against a real control plane: builds the binaries
# (cached), starts one kube-apiserver with up.sh, runs `cargo test -p e2e` with
# BOOTSTRAP_E2E_KUBECONFIG pointing at it, and stops it with down.sh whatever happens. Cases that
# need the simulator's backdoor or fault injection print SKIPPED there; the tests that start
# control planes of their own (tests/real_control_plane.rs) run in the plain `cargo test`.
#
# Usage: e2e/control-plane/test.sh [cargo test options, e.g. --test system_namespaces]
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=$(mktemp -d -t control-plane-e2e-XXXXXX)
trap '"$here/down.sh" "$dir" >/dev/null || true' EXIT

"$here/up.sh" "$dir"
cd "$root"
# One test at a time: they share the cluster's kubernetes Service, leader Lease and namespaces.
BOOTSTRAP_E2E_KUBECONFIG="$dir/admin.kubeconfig" \
  cargo test -p e2e "$@" -- --test-threads=1

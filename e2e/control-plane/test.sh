#!/usr/bin/env bash
# Runs the end-to-end suite (e2e/tests) against a real control plane: builds the binaries
# (cached), starts one kube-apiserver with up.sh, runs `cargo test -p e2e` with
# BOOTSTRAP_E2E_KUBECONFIG pointing at it, and stops it with down.sh whatever happens. Cases that
# need the simulator's backdoor or fault injection print SKIPPED there; the tests that start
# control planes of their own (tests/real_control_plane.rs) run in the plain `cargo test`.
#
# Usage: e2e/control-plane/test.sh [cargo test options, e.g. --test system_namespaces]
#                                    [-- test binary options, e.g. --nocapture]
set -euo pipefail

# Options after `--` go to the test binaries, after --test-threads=1 (a second `--` would make
# libtest read it as a name filter and run nothing).
cargo_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  cargo_args+=("$1")
  shift
done
if [ $# -gt 0 ]; then shift; fi

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dir=$(mktemp -d -t control-plane-e2e-XXXXXX)
trap '"$here/down.sh" "$dir" >/dev/null || true' EXIT

"$here/up.sh" "$dir"
cd "$root"
# One test at a time: they share the cluster's kubernetes Service, leader Lease and namespaces.
# 192.0.2.1: a SAN of up.sh's serving certificate, which tests may advertise.
BOOTSTRAP_E2E_KUBECONFIG="$dir/admin.kubeconfig" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS=192.0.2.1 \
  cargo test -p e2e ${cargo_args[@]+"${cargo_args[@]}"} -- --test-threads=1 "$@"

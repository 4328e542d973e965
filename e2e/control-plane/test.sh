#!/usr/bin/env bash
# Runs the end-to-end suite (e2e/tests) against a real control plane: builds the binaries
# (cached), starts one kube-apiserver with up.sh, runs `cargo test -p e2e` with
# BOOTSTRAP_E2E_KUBECONFIG pointing at it, and stops it with down.sh whatever happens. Cases that
# need the simulator's backdoor or fault injection are skipped there, and so are the tests that
# start control planes of their own (tests/real_*.rs; they run in the plain `cargo test`). Each
# skip is recorded (BOOTSTRAP_E2E_SKIP_LOG); the run ends with the list of what was skipped and
# why and of the test files that ran nothing against the cluster, and fails when that list is not
# expected-skips.txt (compared only when the whole suite runs, with no option given).
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

whole_suite=false
if [ "${#cargo_args[@]}" -eq 0 ] && [ $# -eq 0 ]; then whole_suite=true; fi

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=e2e/control-plane/skips.sh
. "$here/skips.sh"
dir=$(mktemp -d -t control-plane-e2e-XXXXXX)
record=$(mktemp -t control-plane-e2e-skips-XXXXXX)
output=$(mktemp -t control-plane-e2e-output-XXXXXX)
trap '"$here/down.sh" "$dir" >/dev/null || true; rm -f "$record" "$output"' EXIT

"$here/up.sh" "$dir"
cd "$root"
# One test at a time: they share the cluster's kubernetes Service, leader Lease and namespaces.
# 192.0.2.1: a SAN of up.sh's serving certificate, which tests may advertise. cargo's output is
# kept (without colour) for its `Running tests/<file>.rs` lines.
status=0
BOOTSTRAP_E2E_KUBECONFIG="$dir/admin.kubeconfig" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS=192.0.2.1 \
  BOOTSTRAP_E2E_SKIP_LOG="$record" \
  cargo test --color never -p e2e ${cargo_args[@]+"${cargo_args[@]}"} -- --test-threads=1 "$@" \
  2>&1 | tee "$output" || status=$?
if [ "$whole_suite" = true ]; then
  is_root=false
  if [ "$(id -u)" = 0 ]; then is_root=true; fi
  skips_report "$record" "$output" "$here/expected-skips.txt" "$is_root" || status=1
else
  echo "a part of the suite ran: what it skipped is listed, not compared with expected-skips.txt"
  skips_found "$record" "$output" | sed 's/^/  /'
fi
exit "$status"

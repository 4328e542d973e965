#!/usr/bin/env bash
# Runs the end-to-end suite (e2e/tests) against a real control plane: builds the binaries
# (cached), starts one kube-apiserver with up.sh, runs `cargo test -p e2e` with
# BOOTSTRAP_E2E_KUBECONFIG pointing at it, and stops it with down.sh whatever happens. Cases that
# need the simulator's backdoor or fault injection are skipped there, and so are the tests that
# start control planes of their own (tests/real_*.rs; they run in the plain `cargo test`). Each
# skip is recorded (BOOTSTRAP_E2E_SKIP_LOG); the run ends with the list of what was skipped and
# why and of the test files that ran nothing against the cluster, and fails when that list is not
# expected-skips.txt (compared when the whole suite runs, or whole test files with `--test NAME`
# and no other option: then with their lines of it). Its
# `without-ipaddress-api` lines count when the cluster does not serve networking.k8s.io/v1
# IPAddress (kube-apiserver before 1.33, or with MultiCIDRServiceAllocator off), asked of the
# cluster's discovery, as the tests ask it.
#
# Usage: e2e/control-plane/test.sh [--kubernetes 1.NN] [--apiserver-flag FLAG]...
#                                    [--controller-manager-flag FLAG]...
#                                    [cargo test options, e.g. --test system_namespaces]
#                                    [-- test binary options, e.g. --nocapture]
#   --kubernetes (or BOOTSTRAP_KUBERNETES_VERSION): a minor build.sh pins (build.sh --list);
#   default: the newest. The flags go to up.sh (e.g. --apiserver-flag --emulated-version=1.34).
set -euo pipefail

kubernetes=${BOOTSTRAP_KUBERNETES_VERSION:-}
up_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --kubernetes) kubernetes=${2:?--kubernetes needs a minor, e.g. 1.30}; shift 2 ;;
    --apiserver-flag | --controller-manager-flag) up_args+=("$1" "${2:?$1 needs a flag}"); shift 2 ;;
    *) break ;;
  esac
done

# Options after `--` go to the test binaries, after --test-threads=1 (a second `--` would make
# libtest read it as a name filter and run nothing).
cargo_args=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  cargo_args+=("$1")
  shift
done
if [ $# -gt 0 ]; then shift; fi

# The whole suite, or whole test files (`--test NAME`...): what they skipped is compared with
# the expected list (for named files, its lines of those files).
whole_suite=false
files=()
if [ $# -eq 0 ]; then
  whole_suite=true
  set -- ${cargo_args[@]+"${cargo_args[@]}"}
  while [ $# -gt 0 ]; do
    if [ "$1" = --test ] && [ $# -ge 2 ]; then files+=("$2"); shift 2; else whole_suite=false; break; fi
  done
  set --
fi

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=e2e/control-plane/skips.sh
. "$here/skips.sh"
dir=$(mktemp -d -t control-plane-e2e-XXXXXX)
record=$(mktemp -t control-plane-e2e-skips-XXXXXX)
output=$(mktemp -t control-plane-e2e-output-XXXXXX)
trap '"$here/down.sh" "$dir" >/dev/null || true; rm -f "$record" "$output"' EXIT

bin=$("$here/build.sh" ${kubernetes:+--kubernetes "$kubernetes"})
"$here/up.sh" "$dir" --bin "$bin" ${up_args[@]+"${up_args[@]}"}
# shellcheck source=/dev/null
. "$dir/env"
conditions=
if ! curl -fsS --cacert "$dir/ca.crt" --cert "$dir/users/admin.crt" --key "$dir/users/admin.key" \
  "$APISERVER_1_URL/apis/networking.k8s.io/v1" 2>/dev/null | grep -q '"name": *"ipaddresses"'; then
  conditions=without-ipaddress-api
fi
echo "test.sh: $("$bin/kube-apiserver" --version)${up_args[*]:+ (${up_args[*]})}${conditions:+; $conditions}"
cd "$root"
# Every test file runs, whatever failed before it. One test at a time: they share the cluster's
# kubernetes Service, leader Lease and namespaces.
# 192.0.2.1: a SAN of up.sh's serving certificate, which tests may advertise. cargo's output is
# kept (without colour) for its `Running tests/<file>.rs` lines.
status=0
BOOTSTRAP_E2E_KUBECONFIG="$dir/admin.kubeconfig" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS=192.0.2.1 \
  BOOTSTRAP_E2E_SERVICE_RANGE="$SERVICE_CLUSTER_IP_RANGE" \
  BOOTSTRAP_E2E_SKIP_LOG="$record" \
  cargo test --color never -p e2e ${cargo_args[@]+"${cargo_args[@]}"} --no-fail-fast -- --test-threads=1 "$@" \
  2>&1 | tee "$output" || status=$?
if [ "$whole_suite" = true ]; then
  is_root=false
  if [ "$(id -u)" = 0 ]; then is_root=true; fi
  expected=$here/expected-skips.txt
  if [ "${#files[@]}" -gt 0 ]; then
    expected=$(mktemp -t control-plane-e2e-expected-XXXXXX)
    skips_expected_of "$here/expected-skips.txt" "${files[@]}" >"$expected"
    echo "test files ${files[*]} ran: compared with their lines of expected-skips.txt"
  fi
  skips_report "$record" "$output" "$expected" "$is_root" "$conditions" || status=1
  [ "${#files[@]}" -eq 0 ] || rm -f "$expected"
else
  echo "a part of the suite ran: what it skipped is listed, not compared with expected-skips.txt"
  skips_found "$record" "$output" | sed 's/^/  /'
fi
exit "$status"

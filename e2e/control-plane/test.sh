#!/usr/bin/env bash
# Runs the end-to-end suite (e2e/tests) against a real control plane: builds the binaries
# (cached), starts one kube-apiserver with up.sh, runs `cargo test -p e2e` with
# BOOTSTRAP_E2E_KUBECONFIG pointing at it, and stops it with down.sh whatever happens. With no
# test named, it runs the test files that run against a given cluster: every file but those
# expected-skips.txt lists as NOCLUSTER, which start simulators or control planes of their own
# whatever the cluster and run with the workspace's tests (`cargo nextest run --workspace`; a
# packaging test checks that none of them asks for the cluster). Cases that need the simulator's backdoor or fault injection
# are skipped there. Each skip is recorded (BOOTSTRAP_E2E_SKIP_LOG); the run ends with the list of
# what was skipped and why and of the test files that ran nothing against the cluster, and fails
# when that list is not those files' lines of expected-skips.txt (compared when the suite runs
# with no test named, or whole test files with `--test NAME` and no other option). Its
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

# No test named, or whole test files (`--test NAME`...): what they skipped is compared with
# those files' lines of the expected list.
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
if [ "$whole_suite" = true ] && [ "${#files[@]}" -eq 0 ]; then
  mapfile -t files < <(cluster_facing_tests "$here/expected-skips.txt" "$root/e2e/tests")
  if [ "${#files[@]}" -eq 0 ]; then
    echo "test.sh: no test file in e2e/tests runs against a given cluster" >&2
    exit 1
  fi
  for f in "${files[@]}"; do cargo_args+=(--test "$f"); done
fi
# no_fight spends minutes waiting for upstream's 3-minute IPAddress resync, with little to do, and
# judges every write in its cluster's audit log, which the other files' tests would add to: with
# other files it runs beside them, on a control plane of its own.
apart=false
if [ "$whole_suite" = true ] && [ "${#files[@]}" -gt 1 ] && printf '%s\n' "${files[@]}" | grep -qx no_fight; then
  apart=true
  cargo_args=()
  for f in "${files[@]}"; do [ "$f" = no_fight ] || cargo_args+=(--test "$f"); done
fi
dir=$(mktemp -d -t control-plane-e2e-XXXXXX)
record=$(mktemp -t control-plane-e2e-skips-XXXXXX)
output=$(mktemp -t control-plane-e2e-output-XXXXXX)
apart_dir=$dir/apart  # no_fight's control plane, when it has one
apart_record=$(mktemp -t control-plane-e2e-skips-XXXXXX)
apart_output=$(mktemp -t control-plane-e2e-output-XXXXXX)
apart_pid=
trap '[ -z "$apart_pid" ] || kill "$apart_pid" 2>/dev/null; [ ! -d "$apart_dir" ] || "$here/down.sh" "$apart_dir" >/dev/null; "$here/down.sh" "$dir" >/dev/null || true; rm -f "$record" "$output" "$apart_record" "$apart_output"' EXIT

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
# The tests run the built binaries; `cargo test -p e2e` does not build them, so a stale one
# would be what passed.
cargo build --color never -p bootstrap-controller -p apiserver-sim --bins
status=0
if [ "$apart" = true ]; then
  # Built first, so that the two runs below only run.
  cargo test --color never -p e2e "${cargo_args[@]}" --test no_fight --no-run
  (
    mkdir "$apart_dir"
    "$here/up.sh" "$apart_dir" --bin "$bin" ${up_args[@]+"${up_args[@]}"}
    # shellcheck source=/dev/null
    . "$apart_dir/env"
    BOOTSTRAP_E2E_KUBECONFIG="$apart_dir/admin.kubeconfig" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS=192.0.2.1 \
      BOOTSTRAP_E2E_SERVICE_RANGE="$SERVICE_CLUSTER_IP_RANGE" \
      BOOTSTRAP_E2E_SKIP_LOG="$apart_record" \
      cargo test --color never -p e2e --test no_fight --no-fail-fast -- --test-threads=1 "$@"
  ) >"$apart_output" 2>&1 &
  apart_pid=$!
  echo "test.sh: no_fight runs beside the other files on a control plane of its own ($apart_dir); its output follows theirs"
fi
BOOTSTRAP_E2E_KUBECONFIG="$dir/admin.kubeconfig" BOOTSTRAP_E2E_CERTIFICATE_ADDRESS=192.0.2.1 \
  BOOTSTRAP_E2E_SERVICE_RANGE="$SERVICE_CLUSTER_IP_RANGE" \
  BOOTSTRAP_E2E_SKIP_LOG="$record" \
  cargo test --color never -p e2e ${cargo_args[@]+"${cargo_args[@]}"} --no-fail-fast -- --test-threads=1 "$@" \
  2>&1 | tee "$output" || status=$?
if [ "$apart" = true ]; then
  apart_status=0
  wait "$apart_pid" || apart_status=$?
  apart_pid=
  echo "== no_fight, on its own control plane (exit status $apart_status)"
  cat "$apart_output"
  cat "$apart_output" >>"$output"
  cat "$apart_record" >>"$record"
  [ "$apart_status" = 0 ] || status=$apart_status
fi
if [ "$whole_suite" = true ]; then
  is_root=false
  if [ "$(id -u)" = 0 ]; then is_root=true; fi
  expected=$(mktemp -t control-plane-e2e-expected-XXXXXX)
  skips_expected_of "$here/expected-skips.txt" "${files[@]}" >"$expected"
  echo "test files ${files[*]} ran: compared with their lines of expected-skips.txt"
  skips_report "$record" "$output" "$expected" "$is_root" "$conditions" || status=1
  rm -f "$expected"
else
  echo "a part of the suite ran: what it skipped is listed, not compared with expected-skips.txt"
  skips_found "$record" "$output" | sed 's/^/  /'
fi
exit "$status"

#!/usr/bin/env bash
# Runs the end-to-end suite (test.sh) on every Kubernetes minor build.sh pins, one after the
# other (each built first, cached per version), and ends with one markdown table row per minor:
# kube-apiserver's version, the verdict, the tests passed and the skips test.sh listed, and the
# minutes the build and the suite took; then, on the newest, the suite once more with
# kube-controller-manager's Endpoints and EndpointSlice-mirroring controllers off, as upstream's
# deprecation job runs it (the `kubernetes` Endpoints and EndpointSlice must stay right without
# them), and once more emulating the minor three before it (--emulated-version).
# ./run-tests.sh --all-versions runs it; BENCHMARKS.md keeps the last table. Fails when any run
# failed (after running them all).
#
# Usage: e2e/control-plane/all-versions.sh [MINOR...]   default: every pinned minor (build.sh --list)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
case "${1-}" in -h|--help) sed -n '/^# Usage:/p' "$0" | sed 's/^# //' >&2; exit 2 ;; esac
if [ $# -gt 0 ]; then minors=("$@"); else mapfile -t minors < <("$here/build.sh" --list); fi
logs=$(mktemp -d -t all-versions-XXXXXX)
rows=()
verdict=0
for minor in "${minors[@]}"; do
  echo "== Kubernetes $minor ($(date -u +%H:%M:%S))"
  started=$(date +%s)
  if ! bin=$("$here/build.sh" --kubernetes "$minor"); then
    rows+=("| $minor | - | build failed | - | - | - |")
    verdict=1
    continue
  fi
  built=$(date +%s)
  status=0
  "$here/test.sh" --kubernetes "$minor" 2>&1 | tee "$logs/$minor.log" || status=$?
  finished=$(date +%s)
  passed=$(awk '/^test result: / { sum += $4 } END { print sum + 0 }' "$logs/$minor.log")
  skipped=$(sed -n '/^not checked against the cluster/,/^[^ ]/p' "$logs/$minor.log" | grep -c '^  SKIPPED ' || true)
  result=pass
  [ "$status" -eq 0 ] || { result="fail ($status)"; verdict=1; }
  rows+=("| $minor | $("$bin/kube-apiserver" --version | sed 's/^Kubernetes //') | $result | ${passed:-0} | $skipped | $(((built - started + 30) / 60)) + $(((finished - built + 30) / 60)) |")
done
# The newest minor once more, test.sh given the flags after LABEL and LOG: one more table row.
variant() {
  local label=$1 log=$2 started finished status=0 passed skipped result=pass
  shift 2
  echo "== Kubernetes $label ($(date -u +%H:%M:%S))"
  started=$(date +%s)
  "$here/test.sh" --kubernetes "$newest" "$@" 2>&1 | tee "$logs/$log" || status=$?
  finished=$(date +%s)
  passed=$(awk '/^test result: / { sum += $4 } END { print sum + 0 }' "$logs/$log")
  skipped=$(sed -n '/^not checked against the cluster/,/^[^ ]/p' "$logs/$log" | grep -c '^  SKIPPED ' || true)
  [ "$status" -eq 0 ] || { result="fail ($status)"; verdict=1; }
  rows+=("| $label | - | $result | ${passed:-0} | $skipped | 0 + $(((finished - started + 30) / 60)) |")
}
if [ $# -eq 0 ]; then
  newest=${minors[${#minors[@]}-1]}
  variant "$newest, without the Endpoints controllers" "$newest-no-endpoints-controllers.log" \
    --controller-manager-flag '--controllers=*,-endpoints-controller,-endpointslice-mirroring-controller'
  # A binary emulating an older minor serves that minor's APIs: features must come from
  # discovery, not from /version. Three minors back is as far as kube-apiserver emulates.
  emulated="1.$((${newest#1.} - 3))"
  variant "$newest emulating $emulated" "$newest-emulating-$emulated.log" \
    --apiserver-flag "--emulated-version=$emulated"
fi
echo
echo "$(date -u +%Y-%m-%d), commit $(git -C "$here" rev-parse --short HEAD 2>/dev/null || echo unknown); logs in $logs"
echo
echo "| minor | kube-apiserver | suite | tests passed | skipped | minutes (build + suite) |"
echo "| --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit "$verdict"

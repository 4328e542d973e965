#!/bin/bash
# CPU time per fresh ClusterIP repair pass, split between the simulator (the bench's parent
# process) and the pass (its child), from /proc utime+stime. Both share the machine's cores, so
# the simulator's CPU is part of what a fresh pass waits for here (it would not be next to a
# real kube-apiserver on other machines).
#
# usage: reconcilers/benches/cpu-per-pass.sh <bench binary> [passes]
#   the bench binary: cargo bench -p bootstrap-reconcilers --bench clusterip_repair --no-run
#   environment: BENCH_PLAIN_HTTP (default 1), ROLE (default ipaddress-fresh), SIZE (Services,
#   default 100000)
set -euo pipefail
bin=$1
passes=${2:-60}
out=$(mktemp)
BENCH_PASSES=$passes BENCH_PLAIN_HTTP=${BENCH_PLAIN_HTTP:-1} "$bin" --sizes "${SIZE:-100000}" \
    --roles "${ROLE:-ipaddress-fresh}" >"$out" 2>&1 &
parent=$!
ticks=$(getconf CLK_TCK)
child="" parent_start="" parent_end="" child_cpu=0
while kill -0 "$parent" 2>/dev/null; do
    if [ -z "$child" ]; then
        child=$(pgrep -P "$parent" | head -1 || true)
        # The simulator is set up by now; from here the parent only serves the child's passes.
        [ -n "$child" ] && parent_start=$(awk '{print $14 + $15}' "/proc/$parent/stat")
    elif [ -r "/proc/$child/stat" ] && ! grep -q zombie "/proc/$child/status" 2>/dev/null; then
        child_cpu=$(awk '{print $14 + $15}' "/proc/$child/stat" 2>/dev/null || echo "$child_cpu")
    else
        parent_end=$(awk '{print $14 + $15}' "/proc/$parent/stat")
        break
    fi
    sleep 0.02
done
wait "$parent" || true
[ -n "$parent_start" ] && [ -n "$parent_end" ] || { echo "the bench ended early:" >&2; cat "$out" >&2; exit 1; }
pass=$(awk '/^ +[0-9]/{print $5}' "$out")
awk -v a="$parent_start" -v b="$parent_end" -v c="$child_cpu" -v t="$ticks" -v n="$passes" -v p="$pass" \
    'BEGIN {printf "pass %s ms (median); CPU per pass: simulator %.1f ms, repair %.1f ms\n", p, (b - a) * 1000 / t / n, c * 1000 / t / n}'
rm -f "$out"

#!/usr/bin/env bash
# Stops what up.sh started in DIR, and only that: the processes listed in DIR/pids (SIGTERM, then
# SIGKILL after 10 s). Keeps DIR (logs, audit logs, certificates) for a look afterwards.
#
# Usage: e2e/control-plane/down.sh DIR
set -uo pipefail

[ $# -eq 1 ] || { echo "usage: down.sh DIR" >&2; exit 2; }
dir=$1
[ -f "$dir/pids" ] || { echo "down.sh: nothing started in $dir (no $dir/pids)" >&2; exit 0; }

# Running, and not a zombie: up.sh exits after starting them, so whoever inherits them may not
# reap them at once.
alive() {
  kill -0 "$1" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null
}

# Stops the processes of `lines` whose name matches (or, with -v, does not match) the pattern:
# SIGTERM to all, then each gets up to 10 s before SIGKILL.
stop() {
  local invert=$1 pattern=$2 line name pid
  local -a chosen=()
  for line in "${lines[@]}"; do
    read -r name pid <<<"$line"
    if { [ "$invert" = -v ] && [[ ! $name =~ $pattern ]]; } ||
       { [ "$invert" != -v ] && [[ $name =~ $pattern ]]; }; then
      chosen+=("$line")
    fi
  done
  for line in "${chosen[@]}"; do
    read -r name pid <<<"$line"
    # A pid is only ours while its command is still the binary we started (pids are reused).
    if alive "$pid" && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "${name%-[0-9]}"; then
      kill -TERM "$pid" 2>/dev/null
    fi
  done
  for line in "${chosen[@]}"; do
    read -r name pid <<<"$line"
    for _ in $(seq 1 100); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      echo "down.sh: $name ($pid) did not stop on SIGTERM within 10 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null
    fi
  done
}

# kube-controller-manager and the apiservers first, and etcd only once they are gone: an
# apiserver stopping gracefully still talks to etcd, and hangs if etcd went first.
mapfile -t lines < <(tac "$dir/pids")
stop -v '^etcd$'
stop '' '^etcd$'
rm -f "$dir/pids"
echo "down.sh: stopped the control plane in $dir"

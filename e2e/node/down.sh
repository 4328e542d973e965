#!/usr/bin/env bash
# Removes what up.sh made for the node in DIR, and only that, as DIR/state lists it: the kubelet,
# kube-proxy, every pod's processes (those in the node's cgroup), containerd and its shims (the
# processes in the node's mount namespace), that namespace's holder (its mounts go with it), the
# network namespace (its iptables rules, bridge and veths go with it), the host's end of the
# veth, the cgroup, the kernel sysctls the kubelet set (put back), the empty mount points made
# on the host, and containerd's root in DIR. Keeps the rest of DIR (logs, certificates, the
# audit log) for a look afterwards.
#
# Usage: e2e/node/down.sh DIR
set -uo pipefail

[ $# -eq 1 ] || { echo "usage: down.sh DIR" >&2; exit 2; }
dir=$1
state=$dir/state
[ -f "$state" ] || { echo "down.sh: nothing started in $dir (no $state)" >&2; exit 0; }

alive() {
  kill -0 "$1" 2>/dev/null && ! grep -q '^[0-9]* ([^)]*) Z' "/proc/$1/stat" 2>/dev/null
}
# The pid recorded for name $1, if it still runs the command it was started as (pids are reused).
pid_of() {
  local pid
  pid=$(awk -v n="$1" '$1 == "pid" && $2 == n { print $3 }' "$state")
  [ -n "$pid" ] && alive "$pid" && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$2" && echo "$pid"
}
# SIGTERM, then SIGKILL after 10 s.
stop() {
  local pid=$1
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 1 100); do
    alive "$pid" || return 0
    sleep 0.1
  done
  echo "down.sh: $pid did not stop on SIGTERM within 10 s; killing it" >&2
  kill -KILL "$pid" 2>/dev/null
}

cgroup=$(awk '$1 == "cgroup" { print $2 }' "$state")
holder=$(pid_of holder sleep)

# The kubelet first, so that it restarts nothing; then kube-proxy.
for name in kubelet kube-proxy; do
  pid=$(pid_of "$name" "$name") && stop "$pid"
done
# Every pod's processes are in the kubelet's cgroup tree; SIGKILL them until none is left.
if [ -n "$cgroup" ]; then
  for _ in $(seq 1 50); do
    pids=$(find /sys/fs/cgroup/*/"$cgroup" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)
    [ -n "$pids" ] || break
    # shellcheck disable=SC2086 # one pid a word
    kill -KILL $pids 2>/dev/null
    sleep 0.2
  done
fi
pid=$(pid_of containerd containerd) && stop "$pid"
# containerd's shims and anything else still in the node's namespaces (only what up.sh started
# can be there, by the namespaces' inodes), then the mount namespace's holder, then again.
mapfile -t inodes < <(awk '$1 == "nsinode" { print $3 }' "$state")
sweep() { # pids to spare
  local proc pid ns inode
  for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    case " $* " in *" $pid "*) continue ;; esac
    for ns in mnt net; do
      inode=$(readlink "$proc/ns/$ns" 2>/dev/null) || continue
      for wanted in "${inodes[@]}"; do
        if [ "$inode" = "$wanted" ]; then
          kill -KILL "$pid" 2>/dev/null
          continue 3
        fi
      done
    done
  done
}
if [ "${#inodes[@]}" -gt 0 ]; then
  sweep "$holder" $$
  [ -n "$holder" ] && stop "$holder"
  for _ in 1 2 3; do
    sweep $$
    sleep 0.2
  done
elif [ -n "$holder" ]; then
  stop "$holder"
fi
netns=$(awk '$1 == "netns" { print $2 }' "$state")
[ -n "$netns" ] && ip netns del "$netns" 2>/dev/null
if grep -q '^netnsmount ' "$state" && [ -z "$(ip netns list)" ]; then
  umount /run/netns
fi
if grep -q '^netnsdir ' "$state" && [ -z "$(ip netns list)" ]; then
  rmdir /run/netns 2>/dev/null
fi
awk '$1 == "link" { print $2 }' "$state" | while read -r link; do
  # Gone with its peer in the namespace, normally.
  if ip link show "$link" >/dev/null 2>&1; then ip link del "$link"; fi
done
if [ -n "$cgroup" ]; then
  for _ in $(seq 1 50); do
    # containerd, until it stopped, may have started another container (a `runc init` that
    # would keep its cgroup busy): killed here too.
    pids=$(find /sys/fs/cgroup/*/"$cgroup" -name cgroup.procs -exec cat {} + 2>/dev/null | sort -u)
    # shellcheck disable=SC2086 # one pid a word
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null
    find /sys/fs/cgroup/*/"$cgroup" -depth -type d -exec rmdir {} \; 2>/dev/null
    ls -d /sys/fs/cgroup/*/"$cgroup" >/dev/null 2>&1 || break
    sleep 0.2
  done
  if ls -d /sys/fs/cgroup/*/"$cgroup" >/dev/null 2>&1; then
    echo "down.sh: the cgroup $cgroup could not be removed" >&2
  fi
fi
awk '$1 == "sysctl" { print $2, $3 }' "$state" | while read -r key value; do
  sysctl -qw "$key=$value"
done
tac "$state" | awk '$1 == "mountpoint" { print $2 }' | while read -r path; do
  rmdir "$path" 2>/dev/null || echo "down.sh: $path is not empty; left in place" >&2
done
rm -rf "$dir/containerd/root" "$dir/mounted"
rm -f "$state"
echo "down.sh: removed the node in $dir"

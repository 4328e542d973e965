#!/bin/sh
# Runs a command at a lower CPU priority, its scheduler autogroup's included:
#
#   setsid --wait e2e/steps/at-priority.sh NICENESS COMMAND...
#
# One implementation for the background builds and suites of .ci/run, run-tests.sh and
# e2e/node/test.sh. A new session (setsid) is a new autogroup of the scheduler, and where
# /proc/sys/kernel/sched_autogroup_enabled is 1 (as on the machines measured here) the CPU is
# shared between autogroups before a process's niceness counts within its own: a build "at
# nice 19" in a session of its own took two thirds of the CPU beside two foreground processes.
# So the group's niceness (/proc/self/autogroup) is set too, where the kernel has it.
set -eu
if [ $# -lt 2 ]; then
  echo "usage: e2e/steps/at-priority.sh NICENESS COMMAND..." >&2
  exit 2
fi
niceness=$1
shift
echo "$niceness" >/proc/self/autogroup 2>/dev/null || true
exec nice -n "$niceness" "$@"

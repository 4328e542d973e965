# shellcheck shell=bash
# What a run of the end-to-end suite against a given cluster did not check there, sourced by
# test.sh: the tests (or parts of tests) that skipped, each with its reason, from the record the
# tests append to (BOOTSTRAP_E2E_SKIP_LOG; tests/common/mod.rs, `skip` and `Target::start_with`),
# and the test files that ran nothing against the cluster (no `CLUSTER` line in the record), from
# cargo's `Running tests/<file>.rs` lines. Compared with expected-skips.txt, so that a test that
# starts skipping, or stops, changes the list in the repository or fails the run. Tested with
# stand-in records by e2e/packaging/test_control_plane_skips.py.

# skips_found RECORD CARGO_OUTPUT: one line each, sorted: `SKIPPED <file>::<test>: <reason>` and
# `NOCLUSTER <file>`.
skips_found() {
  local record=$1 output=$2
  {
    grep '^SKIPPED ' "$record" || true
    LC_ALL=C comm -23 \
      <(sed -n 's|^ *Running tests/\([A-Za-z0-9_-]*\)\.rs (.*|\1|p' "$output" | LC_ALL=C sort -u) \
      <(sed -n 's|^CLUSTER \([A-Za-z0-9_-]*\)::.*|\1|p' "$record" | LC_ALL=C sort -u) |
      sed 's/^/NOCLUSTER /'
  } | LC_ALL=C sort -u
}

# skips_expected EXPECTED ROOT [CONDITIONS]: the lines of EXPECTED but comments and blank lines,
# sorted; a line `unless-root <line>` counts only when ROOT is not `true` (a skip that only root
# avoids), a line `without-ipaddress-api <line>` only when CONDITIONS (words) has
# `without-ipaddress-api` (the cluster does not serve networking.k8s.io/v1 IPAddress), and a line
# `without-audit-log <line>` only when it has `without-audit-log` (no audit log of up.sh's beside
# the kubeconfig: kind's run).
skips_expected() {
  local file=$1 root=$2 conditions=" ${3:-} " line
  while IFS= read -r line || [ -n "$line" ]; do
    case $line in
      '' | '#'*) ;;
      'unless-root '*) [ "$root" = true ] || printf '%s\n' "${line#unless-root }" ;;
      'without-ipaddress-api '*)
        case $conditions in
          *' without-ipaddress-api '*) printf '%s\n' "${line#without-ipaddress-api }" ;;
        esac ;;
      'without-audit-log '*)
        case $conditions in
          *' without-audit-log '*) printf '%s\n' "${line#without-audit-log }" ;;
        esac ;;
      *) printf '%s\n' "$line" ;;
    esac
  done <"$file" | LC_ALL=C sort -u
}

# skips_expected_of EXPECTED FILE...: the lines of EXPECTED about those test files (their
# conditions kept), for a run of named test files rather than the whole suite.
skips_expected_of() {
  local expected=$1
  shift
  awk -v files=" $* " '{
    line = $0
    sub(/^(unless-root|without-ipaddress-api|without-audit-log) /, "", line)
    split(line, words, /[ :]/)
    if (index(files, " " words[2] " ")) print
  }' "$expected"
}

# cluster_facing_tests EXPECTED TESTS_DIR: the test files (names, one a line) that run something
# against the cluster they are given: every file in TESTS_DIR but those EXPECTED lists as
# `NOCLUSTER` (they start simulators or control planes of their own, whatever the cluster).
cluster_facing_tests() {
  local expected=$1 dir=$2
  LC_ALL=C comm -23 \
    <(for f in "$dir"/*.rs; do basename "$f" .rs; done | LC_ALL=C sort -u) \
    <(sed -n 's/^\(unless-root \)\{0,1\}NOCLUSTER \([A-Za-z0-9_-]*\)$/\2/p' "$expected" | LC_ALL=C sort -u)
}

# skips_report RECORD CARGO_OUTPUT EXPECTED ROOT [CONDITIONS]: prints what the run skipped and why and the test
# files that ran nothing against the cluster; returns 1 (after the difference) when that is not
# the EXPECTED list, and when the record shows no test ran against the cluster at all.
skips_report() {
  local record=$1 output=$2 expected_file=$3 root=$4 conditions=${5:-} found expected
  found=$(skips_found "$record" "$output")
  expected=$(skips_expected "$expected_file" "$root" "$conditions")
  echo "not checked against the cluster (skipped, with why; test files that ran nothing there):"
  if [ -n "$found" ]; then printf '%s\n' "$found" | sed 's/^/  /'; else echo "  nothing"; fi
  local verdict=0
  if [ "$found" != "$expected" ]; then
    echo "this differs from ${expected_file} (- expected but not found, + found but not expected):"
    diff <(printf '%s\n' "$expected") <(printf '%s\n' "$found") | sed -n 's/^</  -/p; s/^>/  +/p'
    verdict=1
  else
    echo "as ${expected_file} expects"
  fi
  if ! grep -q '^CLUSTER ' "$record"; then
    echo "no test ran against the cluster: the suite checked nothing there"
    verdict=1
  fi
  return "$verdict"
}

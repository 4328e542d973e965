#!/usr/bin/env bash
# Runs upstream's conformance tests of what the controller does (the specs listed in
# e2e/node/conformance.focus) against the node up.sh started in DIR, the sidecar installed,
# then reads the node's audit logs: the tests pass whatever the controller writes beside them,
# so the run fails as well when the controller's user (system:bootstrap-controller) wrote
# anything but events to an object the tests made (conformance_audit.py says which).
#
# Before the tests: the conformance images build.sh made (agnhost, busybox, CoreDNS) are
# imported into the node's containerd; the cluster DNS is deployed as kubeadm deploys it
# (`kubeadm init phase addon coredns`, at the kube-dns address the kubelet's clusterDNS names),
# its Corefile without `forward` and `loop` (the node has no route out: names outside the
# cluster get no answer instead of a query that cannot leave); every sidecar's config gains
# repair loops on short intervals (CONFORMANCE_REPAIR_INTERVAL, default 5s: ClusterIP and
# NodePort repair, system namespaces), so that a repair the tests provoke happens while they run,
# and the sidecars are restarted with it (an annotation on their static pods).
#
# e2e.test (build.sh's, with kubectl at the same version) runs in the node's network namespace
# with --provider=skeleton; the JUnit report, the suite's output and what the check read are in
# DIR/conformance/. The run fails when a spec fails, when fewer specs passed than
# conformance.focus expects, or when one of its lines matched no spec that passed (a focus that
# matches nothing never passes).
#
# Usage: e2e/node/conformance.sh DIR
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
if [ $# -ne 1 ] || [ ! -f "$1/env" ]; then
  echo "usage: e2e/node/conformance.sh DIR   (DIR: a node e2e/node/up.sh started, the sidecar installed)" >&2
  exit 2
fi
dir=$(cd "$1" && pwd)
# shellcheck source=/dev/null
. "$dir/env"
export KUBECONFIG
# build.sh's directory: the one holding the node's bin/.
# shellcheck source=/dev/null
. "$(dirname "$NODE_BIN")/versions.env"
if [ ! -x "$E2E_TEST" ] || [ ! -d "$CONFORMANCE_IMAGES" ]; then
  echo "conformance.sh: upstream's conformance tests are not built ($E2E_TEST); e2e/node/build.sh --conformance builds them" >&2
  exit 2
fi
out=$dir/conformance
rm -rf "$out"
mkdir -p "$out"
interval=${CONFORMANCE_REPAIR_INTERVAL:-5s}
started=$(date +%s)
say() { echo "conformance.sh: $* ($(($(date +%s) - started)) s)" >&2; }
on_node() {
  nsenter -t "$HOLDER_PID" --mount --net env PATH="$NODE_BIN:/usr/sbin:/usr/bin:/sbin:/bin" "$@"
}

# --- the focus: conformance.focus's lines, and the least number of specs that must pass ---
focus_lines=()
while IFS= read -r line; do
  focus_lines+=("$line")
done < <(grep -v -e '^#' -e '^expect ' -e '^$' "$here/conformance.focus")
expected=$(sed -n 's/^expect \([0-9][0-9]*\)$/\1/p' "$here/conformance.focus")
if [ "${#focus_lines[@]}" = 0 ] || [ -z "$expected" ]; then
  echo "conformance.sh: $here/conformance.focus names no spec or no 'expect N' line" >&2
  exit 2
fi
focus=$(IFS='|'; echo "${focus_lines[*]}")
skip='\[Serial\]|\[Disruptive\]|\[Slow\]|\[Flaky\]|\[Feature:[^]]*\]|\[sig-network\] DNS '

# --- the images the tests run, under upstream's names ---
for image in "$CONFORMANCE_IMAGES"/*.tar; do
  on_node ctr --address /run/containerd/containerd.sock -n k8s.io images import "$image" >/dev/null
done
say "images imported"

# --- the cluster DNS, at the address the kubelet gives pods ---
cluster_dns=$(sed -n '/^clusterDNS:/{n;s/^- //p}' "$dir/var-lib-kubelet/config.yaml")
on_node kubeadm init phase addon coredns --print-manifest --config /etc/kubernetes/kubeadm.yaml \
  >"$out/coredns.yaml"
# One replica (one node), no forwarding out of the cluster and so no loop to detect.
sed -i -e '/^ *forward \. /,/^ *}$/d' -e '/^ *loop$/d' -e 's/^  replicas: 2$/  replicas: 1/' "$out/coredns.yaml"
if grep -q -e 'forward \.' -e '^ *loop$' "$out/coredns.yaml" || ! grep -q "clusterIP: $cluster_dns$" "$out/coredns.yaml"; then
  echo "conformance.sh: kubeadm's CoreDNS manifest changed: 'forward .' or 'loop' left, or its Service not at the kubelet's clusterDNS $cluster_dns; see $out/coredns.yaml" >&2
  exit 1
fi
kubectl apply -f "$out/coredns.yaml" >/dev/null
kubectl -n kube-system rollout status deployment/coredns --timeout=180s >/dev/null
say "CoreDNS runs behind kube-dns at $cluster_dns"

# --- the sidecars: repair loops on short intervals ---
sidecars=(bootstrap-controller)
[ "${APISERVERS:-1}" = 2 ] && sidecars+=(bootstrap-controller-2)
for sidecar in "${sidecars[@]}"; do
  config=$dir/etc-kubernetes/$sidecar/config.yaml
  manifest=$MANIFESTS/$sidecar.yaml
  # setup-node.sh's file: the loops section only, the last key, so the intervals go under it.
  if [ "$(sed -n 1p "$config")" != "loops:" ] || grep -q -e '^[^ ]' <(sed 1d "$config") \
    || grep -q -e clusterIPRepair -e nodePortRepair -e systemNamespaces "$config"; then
    echo "conformance.sh: $config is not setup-node.sh's (a loops section alone); not changed" >&2
    exit 1
  fi
  {
    cat "$config"
    for loop in clusterIPRepair nodePortRepair systemNamespaces; do
      printf '  %s:\n    interval: %s\n' "$loop" "$interval"
    done
  } >"$config.new"
  chown --reference="$config" "$config.new"
  chmod --reference="$config" "$config.new"
  mv "$config.new" "$config"
  # The config is read at start: a changed annotation makes the kubelet restart the static pod.
  hash=$(sha256sum "$config" | cut -c1-16)
  if grep -q '^  annotations:$' "$manifest"; then
    # The pod's annotations (the scenarios before may have added some): one more under them.
    sed "s/^  annotations:$/&\n    e2e.bootstrap-controller.io\/config: \"$hash\"/" "$manifest" >"$MANIFESTS/.$sidecar.yaml"
  else
    sed "s/^metadata:$/&\n  annotations:\n    e2e.bootstrap-controller.io\/config: \"$hash\"/" "$manifest" >"$MANIFESTS/.$sidecar.yaml"
  fi
  mv "$MANIFESTS/.$sidecar.yaml" "$manifest"
  pod=$sidecar-$NODE_NAME
  for _ in $(seq 1 120); do
    [ "$(kubectl -n kube-system get pod "$pod" -o jsonpath='{.metadata.annotations.e2e\.bootstrap-controller\.io/config}' 2>/dev/null)" = "$hash" ] && break
    sleep 1
  done
  kubectl -n kube-system wait --for=condition=Ready "pod/$pod" --timeout=120s >/dev/null
done
addresses=("$NODE_IP")
[ "${APISERVERS:-1}" = 2 ] && addresses+=("$APISERVER_2_IP")
# shellcheck source=e2e/steps/sidecar.sh
. "$root/e2e/steps/sidecar.sh"
sidecar_wait_listed "${addresses[@]}"
say "${#sidecars[@]} sidecar(s) restarted with repair intervals of $interval"

# --- what the run starts with: the check tells the tests' objects by it ---
since=$(date -u +%Y-%m-%dT%H:%M:%S.%6NZ)
kubectl get namespaces -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' >"$out/namespaces-before"
kubectl get ipaddresses -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' >"$out/ipaddresses-before"
python3 - "$since" "$out/namespaces-before" "$out/ipaddresses-before" >"$out/before.json" <<'EOF'
import json, sys
lines = lambda path: [l for l in open(path).read().split("\n") if l]
print(json.dumps({"since": sys.argv[1], "user": "system:bootstrap-controller",
                  "namespaces": lines(sys.argv[2]), "ipaddresses": lines(sys.argv[3])}))
EOF

# --- the tests ---
say "running e2e.test (${#focus_lines[@]} focus lines, at least $expected specs to pass); its output: $out/e2e.log"
status=0
nsenter --net="/run/netns/$NETNS" "$E2E_TEST" --kubeconfig="$KUBECONFIG" --kubectl-path="$KUBECTL" \
  --provider=skeleton --report-dir="$out" --dump-logs-on-failure=false \
  --ginkgo.focus="$focus" --ginkgo.skip="$skip" --ginkgo.no-color --ginkgo.timeout=1h \
  >"$out/e2e.log" 2>&1 || status=$?
# -a: the suite's progress line holds non-ASCII bullets.
grep -a -E '^(Ran [0-9]+ of|FAIL!|SUCCESS!)' "$out/e2e.log" >&2 || true
say "e2e.test exited with $status"

# --- what passed, against conformance.focus ---
junit=$out/junit_01.xml
if [ ! -s "$junit" ]; then
  echo "conformance.sh: no JUnit report ($junit); see $out/e2e.log" >&2
  exit 1
fi
python3 - "$junit" "$expected" "${focus_lines[@]}" <<'EOF' || status=1
import re, sys
import xml.etree.ElementTree as ET
junit, expected, lines = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
passed, failed = [], []
for case in ET.parse(junit).getroot().iter("testcase"):
    name = case.get("name", "")
    if not name.startswith("[It] "):
        continue  # the suite's own nodes ([BeforeSuite], [ReportAfterSuite], ...)
    if case.find("failure") is not None or case.find("error") is not None:
        failed.append(name)
    elif case.find("skipped") is None:
        passed.append(name[5:])
ok = True
for name in failed:
    print(f"conformance.sh: failed: {name}", file=sys.stderr)
    ok = False
for line in lines:
    if not any(re.search(line, name) for name in passed):
        print(f"conformance.sh: no spec that passed matches conformance.focus's line {line!r}", file=sys.stderr)
        ok = False
if len(passed) < expected:
    print(f"conformance.sh: {len(passed)} specs passed, conformance.focus expects at least {expected}", file=sys.stderr)
    ok = False
print(f"conformance.sh: {len(passed)} specs passed, {len(failed)} failed", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF

# --- the audit logs: the tests' namespaces gone (the last deletions), then a few repair passes ---
for _ in $(seq 1 300); do
  kubectl get namespaces -o jsonpath='{range .items[*]}{.metadata.name}{"\n"}{end}' | sort >"$out/namespaces-after"
  [ -z "$(comm -13 <(sort "$out/namespaces-before") "$out/namespaces-after")" ] && break
  sleep 1
done
seconds=${interval%s}
case "$seconds" in
  *[!0-9]*|"") seconds=60 ;;
esac
sleep $((3 * seconds))
say "reading the audit logs"
python3 "$here/conformance_audit.py" "$out/before.json" "$dir"/var-log-kubernetes/audit/audit*.log \
  | tee "$out/audit-check" >&2 || status=1
if [ "$status" != 0 ]; then
  echo "conformance.sh: failed; the suite's output and report are in $out" >&2
  exit 1
fi
say "passed"

#!/usr/bin/env bash
# Starts a real control plane on loopback for tests and people: etcd, one or more kube-apiservers
# and kube-controller-manager (the namespace and garbage-collector controllers), with client
# certificates made by openssl. Stop it with down.sh DIR, which stops exactly what this started.
#
# Usage: e2e/control-plane/up.sh DIR [--apiservers N] [--bin BINDIR]
#                                    [--service-cluster-ip-range CIDR] [--etcd-prefix PREFIX]
#                                    [--etcd-url URL] [--apiserver-flag FLAG]...
#                                    [--controller-manager-flag FLAG]...
#
# kube-apiserver runs as kubeadm runs it, with envtest-like test settings:
# --endpoint-reconciler-type=none (the controller under test owns the kubernetes endpoints),
# --authorization-mode=RBAC, service-account keys, and an audit log at Metadata level
# (DIR/audit-N.log, one JSON event a line) that tests read to see who did what. Apiserver N binds
# 127.0.0.1 on its own port and advertises 192.0.2.N (TEST-NET-1: Endpoints refuse loopback
# addresses, and nothing needs to reach the advertised one), or 2001:db8::N (the IPv6
# documentation prefix) when the primary service range is IPv6, as a single-stack IPv6 cluster's
# apiserver advertises an address of its services' family; the serving certificate holds both.
# Every port is a free loopback port picked at start, so several control planes run side by side
# on one host. On SIGTERM an apiserver fails /readyz at once and serves on for
# --shutdown-delay-duration=3s, as load-balanced control planes run it, so that its sidecar can
# withdraw it through it.
#
# --apiserver-flag and --controller-manager-flag add one flag each (FLAG=VALUE, one word) after
# the ones above, so a later one wins: e.g. --apiserver-flag --emulated-version=1.34,
# --apiserver-flag --feature-gates=MultiCIDRServiceAllocator=false, or
# --controller-manager-flag '--controllers=*,-endpoints-controller'.
#
# --etcd-url URL (http://HOST:PORT) uses an etcd that is already running, e.g. another control
# plane's (its ETCD_URL in its env), instead of starting one: several control planes then share
# one etcd, each under its own --etcd-prefix (tenant clusters of one etcd, as Kamaji runs them).
# That etcd is not recorded in DIR/pids, so down.sh DIR leaves it running for its owner.
#
# What it writes into DIR:
#   admin.kubeconfig           system:masters, talks to apiserver 1
#   admin-N.kubeconfig         the same for apiserver N
#   ca.crt, ca.key             the cluster CA (kubeconfig.sh DIR NAME makes more users from it)
#   env                        ports, addresses and paths as shell variables (source it);
#                              ETCD_STARTED=false when --etcd-url named someone else's etcd
#   pids                       "name pid" per process started here; down.sh reads it
#   *.log                      each process's output; audit-N.log the audit events
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

usage() {
  sed -n '/^# Usage:/,/^#$/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
dir=$1
shift
apiservers=1
bin=
service_range=${BOOTSTRAP_CONTROL_PLANE_SERVICE_RANGE:-10.96.0.0/12}
etcd_prefix=/registry
etcd_url=
apiserver_flags=()
controller_manager_flags=()
while [ $# -gt 0 ]; do
  case "$1" in
    --apiservers) apiservers=${2:?--apiservers needs a number}; shift 2 ;;
    --bin) bin=${2:?--bin needs a directory}; shift 2 ;;
    --service-cluster-ip-range) service_range=${2:?--service-cluster-ip-range needs a CIDR}; shift 2 ;;
    --etcd-prefix) etcd_prefix=${2:?--etcd-prefix needs a prefix}; shift 2 ;;
    --etcd-url) etcd_url=${2:?--etcd-url needs a URL}; shift 2 ;;
    --apiserver-flag) apiserver_flags+=("${2:?--apiserver-flag needs a flag}"); shift 2 ;;
    --controller-manager-flag) controller_manager_flags+=("${2:?--controller-manager-flag needs a flag}"); shift 2 ;;
    -h|--help) usage ;;
    *) echo "up.sh: unknown argument $1" >&2; usage ;;
  esac
done
case "$apiservers" in
  [1-9]) ;;
  *) echo "up.sh: --apiservers must be 1 to 9, not $apiservers" >&2; exit 2 ;;
esac
for flag in ${apiserver_flags[@]+"${apiserver_flags[@]}"} ${controller_manager_flags[@]+"${controller_manager_flags[@]}"}; do
  case "$flag" in
    --?*) ;;
    *) echo "up.sh: --apiserver-flag and --controller-manager-flag take a flag such as --emulated-version=1.34, not '$flag'" >&2; exit 2 ;;
  esac
done
case "$etcd_url" in
  ''|http://?*) ;;
  *) echo "up.sh: --etcd-url must be http://HOST:PORT (no TLS), not $etcd_url" >&2; exit 2 ;;
esac
for tool in openssl python3 curl; do
  command -v "$tool" >/dev/null 2>&1 || { echo "up.sh: $tool is needed (apt-get install $tool)" >&2; exit 2; }
done
[ -n "$bin" ] || bin=$("$here/build.sh")
bin=$(cd "$bin" && pwd)
if [ -e "$dir/pids" ]; then
  echo "up.sh: $dir/pids exists: a control plane may still run there; stop it with down.sh $dir" >&2
  exit 2
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# Any failure from here on stops what was started, so a failed start leaves nothing running.
cleanup_on_failure() {
  local status=$?
  if [ "$status" -ne 0 ]; then
    echo "up.sh: start failed (exit $status); stopping what was started. Logs in $dir" >&2
    "$here/down.sh" "$dir" >&2 || true
  fi
}
trap cleanup_on_failure EXIT

free_ports() { # N -> N free loopback TCP ports, one a line
  python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    socks.append(s)
for s in socks:
    print(s.getsockname()[1])
EOF
}

# --- certificates -------------------------------------------------------------------------------
cd "$dir"
openssl_quiet() { openssl "$@" 2>/dev/null; }
openssl_quiet req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 \
  -subj "/CN=bootstrap-controller-test-ca"
sans="DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1"
for n in $(seq 1 "$apiservers"); do sans="$sans,IP:192.0.2.$n,IP:2001:db8::$n"; done
case "${service_range%%,*}" in # the primary range's family
  *:*) advertise_prefix=2001:db8:: ;;
  *) advertise_prefix=192.0.2. ;;
esac
openssl_quiet req -newkey rsa:2048 -nodes -keyout apiserver.key -out apiserver.csr -subj "/CN=kube-apiserver"
openssl_quiet x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
  -out apiserver.crt -extfile <(printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$sans")
openssl_quiet genrsa -out sa.key 2048
openssl_quiet rsa -in sa.key -pubout -out sa.pub
cat > audit-policy.yaml <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
EOF

# --- etcd ---------------------------------------------------------------------------------------
mapfile -t ports < <(free_ports $((apiservers + 2)))
etcd_port=${ports[0]}
etcd_peer_port=${ports[1]}
: > pids
start() { # name, command... : runs it in the background, logging to DIR/name.log
  local name=$1
  shift
  "$@" >"$dir/$name.log" 2>&1 </dev/null &
  echo "$name $!" >> "$dir/pids"
}

wait_for() { # name, seconds, command... : retries the command until it succeeds
  local name=$1 seconds=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  local pid
  pid=$(sed -n "s/^$name //p" "$dir/pids")
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
      if kill -0 "$pid" 2>/dev/null; then
        echo "up.sh: $name did not come up within $seconds s; the end of its log:" >&2
      else
        echo "up.sh: $name exited; the end of its log:" >&2
      fi
      tail -n 30 "$dir/$name.log" >&2 || true
      return 1
    fi
    sleep 0.2
  done
}

if [ -n "$etcd_url" ]; then
  # Someone else's etcd: not started, not in pids (down.sh leaves it alone), only waited for.
  etcd_started=false
  etcd_url=${etcd_url%/}
  deadline=$((SECONDS + 30))
  until curl -fsS "$etcd_url/health" >/dev/null 2>&1; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      echo "up.sh: no healthy etcd at --etcd-url $etcd_url within 30 s" >&2
      exit 1
    fi
    sleep 0.2
  done
else
  etcd_started=true
  start etcd "$bin/etcd" --name default --data-dir "$dir/etcd-data" \
    --listen-client-urls "http://127.0.0.1:$etcd_port" --advertise-client-urls "http://127.0.0.1:$etcd_port" \
    --listen-peer-urls "http://127.0.0.1:$etcd_peer_port" --initial-advertise-peer-urls "http://127.0.0.1:$etcd_peer_port" \
    --initial-cluster "default=http://127.0.0.1:$etcd_peer_port" --log-level warn
  etcd_url="http://127.0.0.1:$etcd_port"
  wait_for "etcd" 30 curl -fsS "$etcd_url/health"
fi

# --- kube-apiservers ----------------------------------------------------------------------------
{
  echo "CONTROL_PLANE_DIR=$dir"
  echo "CONTROL_PLANE_BIN=$bin"
  echo "ETCD_URL=$etcd_url"
  echo "ETCD_PREFIX=$etcd_prefix"
  echo "ETCD_STARTED=$etcd_started"
  echo "SERVICE_CLUSTER_IP_RANGE=$service_range"
  echo "APISERVERS=$apiservers"
} > "$dir/env"
for n in $(seq 1 "$apiservers"); do
  port=${ports[$((n + 1))]}
  start "kube-apiserver-$n" "$bin/kube-apiserver" \
    --etcd-servers "$etcd_url" --etcd-prefix "$etcd_prefix" \
    --bind-address 127.0.0.1 --secure-port "$port" --advertise-address "$advertise_prefix$n" \
    --cert-dir "$dir/apiserver-$n" \
    --tls-cert-file "$dir/apiserver.crt" --tls-private-key-file "$dir/apiserver.key" \
    --client-ca-file "$dir/ca.crt" \
    --service-account-issuer https://kubernetes.default.svc.cluster.local \
    --service-account-key-file "$dir/sa.pub" --service-account-signing-key-file "$dir/sa.key" \
    --service-cluster-ip-range "$service_range" \
    --authorization-mode RBAC \
    --endpoint-reconciler-type none \
    --audit-log-path "$dir/audit-$n.log" --audit-policy-file "$dir/audit-policy.yaml" \
    --audit-log-mode blocking \
    --shutdown-delay-duration 3s \
    --profiling=false ${apiserver_flags[@]+"${apiserver_flags[@]}"}
  {
    echo "APISERVER_${n}_URL=https://127.0.0.1:$port"
    echo "APISERVER_${n}_ADDRESS=$advertise_prefix$n"
    echo "APISERVER_${n}_PORT=$port"
  } >> "$dir/env"
done
for n in $(seq 1 "$apiservers"); do
  port=${ports[$((n + 1))]}
  "$here/kubeconfig.sh" "$dir" admin --group system:masters --server "https://127.0.0.1:$port" \
    --out "$dir/admin-$n.kubeconfig" >/dev/null
  wait_for "kube-apiserver-$n" 90 curl -fsS --cacert "$dir/ca.crt" "https://127.0.0.1:$port/readyz"
done
cp "$dir/admin-1.kubeconfig" "$dir/admin.kubeconfig"
"$here/kubeconfig.sh" "$dir" system:kube-controller-manager --server "https://127.0.0.1:${ports[2]}" \
  --out "$dir/kube-controller-manager.kubeconfig" >/dev/null

# --- kube-controller-manager --------------------------------------------------------------------
# Each controller with its own service account's credentials, as kubeadm runs it, so the
# namespace controller has exactly its bootstrap role.
start kube-controller-manager "$bin/kube-controller-manager" \
  --kubeconfig "$dir/kube-controller-manager.kubeconfig" \
  --controllers namespace,garbagecollector \
  --use-service-account-credentials \
  --root-ca-file "$dir/ca.crt" \
  --leader-elect=false --secure-port 0 --profiling=false \
  ${controller_manager_flags[@]+"${controller_manager_flags[@]}"}

trap - EXIT
cat <<EOF
A control plane runs in $dir: etcd $etcd_url$([ "$etcd_started" = true ] || echo ' (shared, not started here)') prefix $etcd_prefix, $apiservers kube-apiserver(s) ($(sed -n 's/^APISERVER_\([0-9]\)_URL=/\1: /p' "$dir/env" | paste -sd' ')), kube-controller-manager.
  export KUBECONFIG=$dir/admin.kubeconfig
  kubectl get namespaces
  bootstrap-controller run --kubeconfig $dir/admin.kubeconfig --endpoint-reconciler-type lease --advertise-address ${advertise_prefix}1 --secure-port ${ports[2]}
  $here/kubeconfig.sh $dir NAME [--group GROUP]   # a kubeconfig for another user (RBAC tests)
Stop it with: $here/down.sh $dir
EOF

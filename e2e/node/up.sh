#!/usr/bin/env bash
# Starts a real one-node cluster laid out as kubeadm lays it out, then installs the
# bootstrap-controller sidecar as the README tells users (install-sidecar.sh). Stop it with
# down.sh DIR, which removes exactly what this made. Runs as root.
#
# Usage: e2e/node/up.sh DIR [--without-sidecar] [--apiservers 2]
#
# --apiservers 2 adds a second kube-apiserver static pod on the node (kube-apiserver-2, kubeadm's
# manifest with the address 198.18.0.3 and its own audit log; both bind their own address), so
# that the `kubernetes` endpoints have two members and one can be withdrawn: with one, the
# sidecar (as upstream's reconciler) never empties the list. install-sidecar.sh then installs one
# sidecar per apiserver, as the README tells users to.
#
# The node lives in a network namespace of its own (`bcnode`, entered with nsenter, which keeps
# /sys/fs/cgroup visible, unlike `ip netns exec`) joined to the host by the veth pair
# bcnode0 (host, 198.18.0.1/29) - eth0 (node, 198.18.0.2/29 and .3), and in a private mount namespace
# held by one `sleep` process, in which DIR's directories are bind-mounted where kubeadm and the
# kubelet expect them (/etc/kubernetes, /var/lib/kubelet, /var/lib/etcd, /var/lib/cni,
# /var/log/pods, /var/log/containers, /var/log/kubernetes) and /run is a tmpfs: kubeadm's paths
# and manifests stay kubeadm's own, the host's files are untouched, and every mount vanishes
# with the namespace. kube-proxy's iptables rules, the CNI bridge and the pods' interfaces are
# the namespace's. Addresses come from 198.18.0.0/15 (RFC 2544, for network tests): node
# 198.18.0.2, pods 198.18.64.0/24 (cluster 198.18.64.0/18), Services 198.19.0.0/16 (the
# `kubernetes` Service 198.19.0.1). There is no default route in the node's namespace and the
# host has no route into the pod range: no packet leaves the machine.
#
# etcd, kube-apiserver (--endpoint-reconciler-type=none, an audit log, and
# --shutdown-delay-duration=15s: on SIGTERM it fails /readyz at once and serves on, so that the
# sidecar can withdraw it through it), kube-controller-manager and kube-scheduler run as static
# pods that `kubeadm init phase ...` writes, from images FROM scratch that build.sh made and
# tagged as kubeadm names them (nothing is pulled). containerd (Debian's, with its own config,
# root, state and socket) and the kubelet run as processes, as systemd would run them;
# kube-proxy (iptables mode) too, instead of kubeadm's DaemonSet, whose image would need the
# iptables tools.
#
# This machine's findings: cgroup v1, so the kubelet has failCgroupV1: false and
# cgroupDriver: cgroupfs (its pods under the cgroup /bcnode, which down.sh removes); the kernel
# refuses to lower oom_score_adj, so containerd's CRI plugin has restrict_oom_score_adj = true.
# The kubelet sets six kernel sysctls (vm.overcommit_memory, kernel.panic, ...) that are not per
# namespace: their values before are kept in DIR/state and down.sh puts them back.
#
# What it writes into DIR:
#   admin.kubeconfig     kubeadm's admin.conf (group kubeadm:cluster-admins), for tests and people
#   admin-2.kubeconfig   the same user through the second apiserver (--apiservers 2)
#   env                  addresses and paths as shell variables (source it; HELM: build.sh's helm)
#   state                what down.sh undoes: processes, netns, links, cgroup, sysctls, mount points
#   etc-kubernetes/ ...  what the node sees at /etc/kubernetes and the other bind-mounted paths
#   *.log                containerd's, the kubelet's and kube-proxy's output
#   var-log-kubernetes/audit/audit.log   kube-apiserver's audit log (Metadata level)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)

usage() {
  sed -n '/^# Usage:/,/^#$/p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

[ $# -ge 1 ] || usage
dir=$1
shift
with_sidecar=true
apiservers=1
while [ $# -gt 0 ]; do
  case "$1" in
    --without-sidecar) with_sidecar=false; shift ;;
    --apiservers) apiservers=${2:?--apiservers needs 1 or 2}; shift 2 ;;
    -h|--help) usage ;;
    *) echo "up.sh: unknown argument $1" >&2; usage ;;
  esac
done
case "$apiservers" in
  1|2) ;;
  *) echo "up.sh: --apiservers must be 1 or 2, not $apiservers" >&2; exit 2 ;;
esac
if [ "$(id -u)" != 0 ]; then
  echo "up.sh: must be run as root (network and mount namespaces, containerd, the kubelet)" >&2
  exit 2
fi
started=$(date +%s)
if [ -e "$dir/state" ]; then
  echo "up.sh: $dir/state exists: a node may still run there; stop it with down.sh $dir" >&2
  exit 2
fi
netns=bcnode
if ip netns list | grep -qw "$netns" || ip link show bcnode0 >/dev/null 2>&1; then
  echo "up.sh: the network namespace $netns or the link bcnode0 exists: another node runs (down.sh its DIR)" >&2
  exit 2
fi

# What a fresh Debian lacks, installed as .ci/run installs its tools.
need() { command -v "$1" >/dev/null 2>&1; }
missing=()
need containerd || missing+=(containerd)
need runc || missing+=(runc)
need iptables || missing+=(iptables)
need conntrack || missing+=(conntrack)
need buildah || missing+=(buildah)
need kubectl || missing+=(kubernetes-client)
need openssl || missing+=(openssl)
need curl || missing+=(curl)
need ip || missing+=(iproute2)
[ -x /usr/lib/cni/bridge ] || missing+=(containernetworking-plugins)
# The conformance tests' images (build.sh) take their shell tools from these.
[ -x /bin/busybox ] || missing+=(busybox-static)
[ -x /bin/nc.openbsd ] || missing+=(netcat-openbsd)
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get update -qq
  # containerd's package would start its service where systemd runs; the node runs its own.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi

build=$("$here/build.sh")
# shellcheck source=/dev/null
. "$build/versions.env"
bin=$build/bin

mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
state=$dir/state
: >"$state"
record() { echo "$*" >>"$state"; }

node_ip=198.18.0.2
# The second apiserver's address (--apiservers 2), on the node's interface too.
node_ip_2=198.18.0.3
host_ip=198.18.0.1
pod_cidr=198.18.64.0/24
cluster_cidr=198.18.64.0/18
service_cidr=198.19.0.0/16
cgroup=bcnode

# --- network: the node's namespace and its link to the host ---
# `ip netns add` makes /run/netns a mount point (and the directory) the first time; down.sh
# undoes that when it made them and no other namespace is left there.
[ -d /run/netns ] || record netnsdir /run/netns
mountpoint -q /run/netns || record netnsmount /run/netns
ip netns add "$netns"
record netns "$netns"
ip link add bcnode0 type veth peer name eth0 netns "$netns"
record link bcnode0
ip addr add "$host_ip/29" dev bcnode0
ip link set bcnode0 up
nsenter --net="/run/netns/$netns" sh -c "
  ip link set lo up
  ip addr add $node_ip/29 dev eth0
  ip addr add $node_ip_2/29 dev eth0
  ip link set eth0 up
  sysctl -qw net.ipv4.ip_forward=1"

# --- mount namespace: kubeadm's paths bound to DIR, a private /run ---
mounts="/etc/kubernetes /var/lib/kubelet /var/lib/etcd /var/lib/cni /var/log/pods /var/log/containers /var/log/kubernetes"
for path in $mounts; do
  local_dir=$dir/$(echo "${path#/}" | tr / -)
  mkdir -p "$local_dir"
  if [ ! -d "$path" ]; then
    # An empty mount point on the host; down.sh removes it.
    mkdir -p "$path"
    record mountpoint "$path"
  fi
done
mkdir -p "$dir/containerd/root" "$dir/cni/net.d" "$dir/etc-kubernetes/audit" "$dir/var-log-kubernetes/audit"
binds=
for path in $mounts; do
  binds="$binds mount --bind $dir/$(echo "${path#/}" | tr / -) $path;"
done
nsenter --net="/run/netns/$netns" unshare --mount --propagation private sh -c "
  set -e
  mount -t tmpfs -o mode=0755 tmpfs /run
  $binds
  touch $dir/mounted
  exec sleep infinity" </dev/null >"$dir/holder.log" 2>&1 &
holder=$!
record pid holder "$holder"
# The namespaces by inode: down.sh finds by them every process left in either (containerd's shims
# among them), whatever became of their parents.
record nsinode net "$(stat -L -c 'net:[%i]' "/run/netns/$netns")"
for _ in $(seq 1 100); do
  [ -e "$dir/mounted" ] && break
  kill -0 "$holder" 2>/dev/null || { echo "up.sh: the mount namespace failed: $(cat "$dir/holder.log")" >&2; exit 1; }
  sleep 0.1
done
record nsinode mnt "$(readlink "/proc/$holder/ns/mnt")"
# Runs a command on the node: its network and mount namespaces, kubeadm and the rest on PATH.
on_node() {
  nsenter -t "$holder" --mount --net env PATH="$bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$@"
}

# --- cgroups: the kubelet's cgroupRoot must exist; cpuset needs its cpus and mems set ---
for hierarchy in /sys/fs/cgroup/*/; do
  [ -e "$hierarchy/cgroup.procs" ] || continue
  mkdir -p "$hierarchy$cgroup"
  if [ -e "$hierarchy/cpuset.cpus" ]; then
    cat "$hierarchy/cpuset.cpus" >"$hierarchy$cgroup/cpuset.cpus"
    cat "$hierarchy/cpuset.mems" >"$hierarchy$cgroup/cpuset.mems"
  fi
done
record cgroup "$cgroup"

# --- containerd ---
cat >"$dir/containerd/config.toml" <<EOF
version = 2
root = "$dir/containerd/root"
state = "/run/containerd"
# The opt plugin would install into /opt/containerd on the host.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  # This machine refuses to lower a process's oom_score_adj; without this, runc fails every
  # sandbox with "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$dir/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
EOF
cat >"$dir/cni/net.d/10-bcnode.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "bcnode",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": false,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{"subnet": "$pod_cidr"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
on_node containerd --config "$dir/containerd/config.toml" </dev/null >"$dir/containerd.log" 2>&1 &
record pid containerd $!
ctr_node() { on_node ctr --address /run/containerd/containerd.sock "$@"; }
for _ in $(seq 1 100); do
  ctr_node version >/dev/null 2>&1 && break
  sleep 0.1
done
ctr_node version >/dev/null
for image in "$build"/images/*.tar; do
  ctr_node -n k8s.io images import "$image" >/dev/null
done

# --- kubeadm, phase by phase (no systemd: the kubelet is started below as its unit would) ---
cat >"$dir/etc-kubernetes/audit/policy.yaml" <<EOF
apiVersion: audit.k8s.io/v1
kind: Policy
rules:
  - level: Metadata
EOF
cat >"$dir/etc-kubernetes/kubeadm.yaml" <<EOF
apiVersion: kubeadm.k8s.io/v1beta4
kind: InitConfiguration
localAPIEndpoint:
  advertiseAddress: $node_ip
  bindPort: 6443
nodeRegistration:
  name: bcnode
  criSocket: unix:///run/containerd/containerd.sock
  imagePullPolicy: Never
  taints: []
  kubeletExtraArgs:
    - name: node-ip
      value: $node_ip
---
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: $KUBERNETES_VERSION
clusterName: bcnode
controlPlaneEndpoint: $node_ip:6443
networking:
  serviceSubnet: $service_cidr
  podSubnet: $cluster_cidr
etcd:
  local:
    # The etcd that build.sh built, under its own version (kubeadm would name another).
    imageTag: $ETCD_IMAGE_TAG
apiServer:
  certSANs: [$node_ip_2]
  extraArgs:
    # Its own address only: a second apiserver may bind the other.
    - name: bind-address
      value: $node_ip
    # bootstrap-controller owns the kubernetes endpoints.
    - name: endpoint-reconciler-type
      value: none
    - name: audit-policy-file
      value: /etc/kubernetes/audit/policy.yaml
    - name: audit-log-path
      value: /var/log/kubernetes/audit/audit.log
    - name: shutdown-delay-duration
      value: 15s
  extraVolumes:
    - name: audit-policy
      hostPath: /etc/kubernetes/audit
      mountPath: /etc/kubernetes/audit
      readOnly: true
      pathType: Directory
    - name: audit-log
      hostPath: /var/log/kubernetes/audit
      mountPath: /var/log/kubernetes/audit
      pathType: Directory
---
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /$cgroup
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
# The machine's disk may be fuller than the kubelet's defaults allow for; a test node must
# not evict its own control plane.
evictionHard:
  memory.available: 100Mi
  nodefs.available: 1%
  imagefs.available: 1%
  nodefs.inodesFree: 1%
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
EOF
{
  for phase in "certs all" "kubeconfig all" "etcd local" "control-plane all" "kubelet-start"; do
    # kubelet-start writes /var/lib/kubelet/config.yaml and kubeadm-flags.env; its attempt to
    # (re)start the kubelet's systemd unit only warns where there is no systemd.
    # shellcheck disable=SC2086 # a phase and its sub-phase
    on_node kubeadm init phase $phase --config /etc/kubernetes/kubeadm.yaml
  done
} >"$dir/kubeadm.log" 2>&1
if [ "$apiservers" = 2 ]; then
  # kubeadm's manifest, moved to the second address, under another name and audit log, without
  # its named container port (for a host-network pod, a host port on every address: the kubelet
  # would refuse the second pod for the first's port). Written beside the manifests and renamed
  # in: the kubelet never reads half a file.
  sed -e "s/$node_ip/$node_ip_2/g" -e 's/^  name: kube-apiserver$/  name: kube-apiserver-2/' \
    -e 's#audit/audit.log#audit/audit-2.log#' \
    -e '/^    ports:$/,/^      protocol: TCP$/d' -e 's/port: probe-port$/port: 6443/' \
    "$dir/etc-kubernetes/manifests/kube-apiserver.yaml" >"$dir/etc-kubernetes/.kube-apiserver-2.yaml"
  grep -q 'name: kube-apiserver-2$' "$dir/etc-kubernetes/.kube-apiserver-2.yaml"
  mv "$dir/etc-kubernetes/.kube-apiserver-2.yaml" "$dir/etc-kubernetes/manifests/kube-apiserver-2.yaml"
fi

# The kubelet's command line as kubeadm's systemd drop-in (10-kubeadm.conf) builds it.
kubelet_sysctls="vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops kernel.keys.root_maxkeys kernel.keys.root_maxbytes"
for key in $kubelet_sysctls; do
  record sysctl "$key" "$(sysctl -n "$key")"
done
kubelet_args=$(sed -n 's/^KUBELET_KUBEADM_ARGS="\(.*\)"$/\1/p' "$dir/var-lib-kubelet/kubeadm-flags.env")
# shellcheck disable=SC2086 # kubeadm's flags, one word each
on_node kubelet --kubeconfig=/etc/kubernetes/kubelet.conf --config=/var/lib/kubelet/config.yaml \
  $kubelet_args </dev/null >"$dir/kubelet.log" 2>&1 &
record pid kubelet $!

kubeconfig=$dir/admin.kubeconfig
super=$dir/etc-kubernetes/super-admin.conf
echo "up.sh: waiting for kube-apiserver on https://$node_ip:6443 (static pods from local images)" >&2
for _ in $(seq 1 300); do
  curl -fsk --max-time 2 "https://$node_ip:6443/readyz" >/dev/null 2>&1 && break
  sleep 1
done
if ! curl -fsk --max-time 2 "https://$node_ip:6443/readyz" >/dev/null; then
  echo "up.sh: kube-apiserver did not become ready in 300 s; see $dir/kubelet.log and $dir/var-log-pods" >&2
  exit 1
fi
# What `kubeadm init` does once the apiserver answers: admin.conf's group gets cluster-admin.
kubectl --kubeconfig "$super" create clusterrolebinding kubeadm:cluster-admins \
  --clusterrole=cluster-admin --group=kubeadm:cluster-admins >/dev/null
cp "$dir/etc-kubernetes/admin.conf" "$kubeconfig"
# And what its bootstrap-token phase does for \`kubectl logs\` and \`exec\`: the apiservers'
# kubelet client may use the kubelet's API.
kubectl --kubeconfig "$kubeconfig" create clusterrolebinding kubeadm:apiserver-kubelet-client \
  --clusterrole=system:kubelet-api-admin --user=kube-apiserver-kubelet-client >/dev/null
# The same user through the second apiserver, for tests that watch while the first restarts.
sed -e "s#server: https://$node_ip:6443#server: https://$node_ip_2:6443#" "$kubeconfig" >"$dir/admin-2.kubeconfig"

# --- kube-proxy, with the user kube-proxy's bootstrap RBAC binds (system:node-proxier) ---
on_node kubeadm kubeconfig user --client-name=system:kube-proxy --config /etc/kubernetes/kubeadm.yaml \
  >"$dir/etc-kubernetes/kube-proxy.conf" 2>>"$dir/kubeadm.log"
cat >"$dir/etc-kubernetes/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection:
  kubeconfig: /etc/kubernetes/kube-proxy.conf
hostnameOverride: bcnode
clusterCIDR: $cluster_cidr
# NodePorts on the node's address only, not on loopback.
nodePortAddresses: ["$node_ip/32"]
metricsBindAddress: 127.0.0.1:10249
healthzBindAddress: 127.0.0.1:10256
# 0: leave the conntrack sysctls alone (nf_conntrack_max is the host's, not the namespace's).
conntrack:
  maxPerCore: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
EOF
on_node kube-proxy --config=/etc/kubernetes/kube-proxy.yaml </dev/null >"$dir/kube-proxy.log" 2>&1 &
record pid kube-proxy $!

cat >"$dir/env" <<EOF
NODE_IP=$node_ip
APISERVERS=$apiservers
APISERVER_2_IP=$node_ip_2
NODE_NAME=bcnode
NETNS=$netns
HOLDER_PID=$holder
NODE_BIN=$bin
SERVICE_CIDR=$service_cidr
POD_CIDR=$pod_cidr
KUBERNETES_SERVICE_IP=198.19.0.1
CONTROLLER_IMAGE=$CONTROLLER_IMAGE
HELM=$HELM
MANIFESTS=$dir/etc-kubernetes/manifests
AUDIT_LOG=$dir/var-log-kubernetes/audit/audit.log
KUBECONFIG=$kubeconfig
EOF

echo "up.sh: waiting for the node to be Ready" >&2
kubectl --kubeconfig "$kubeconfig" wait --for=condition=Ready node/bcnode --timeout=180s >/dev/null
# The static pods' mirror pods appear once the node is registered; wait for each, then Ready.
pods="etcd-bcnode kube-apiserver-bcnode kube-controller-manager-bcnode kube-scheduler-bcnode"
[ "$apiservers" = 2 ] && pods="$pods kube-apiserver-2-bcnode"
for pod in $pods; do
  for _ in $(seq 1 120); do
    kubectl --kubeconfig "$kubeconfig" -n kube-system get pod "$pod" >/dev/null 2>&1 && break
    sleep 1
  done
  kubectl --kubeconfig "$kubeconfig" -n kube-system wait --for=condition=Ready "pod/$pod" --timeout=180s >/dev/null
done

if [ "$with_sidecar" = true ]; then
  "$here/install-sidecar.sh" "$dir"
fi
echo "up.sh: node up in $(($(date +%s) - started)) s (build.sh included); KUBECONFIG=$kubeconfig" >&2

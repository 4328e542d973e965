#!/usr/bin/env bash
# Builds a kind node image without a registry, from the binaries the real node runs
# (e2e/node/build.sh: kubelet, kubeadm and the control plane's images, FROM scratch around the
# static binaries), into podman's storage, and prints its name. kindest/node cannot be pulled
# here; this is what kind's own images/base/Dockerfile and `kind build node-image` make, read
# from kind's module source (KIND_VERSION in lib.sh) and put together by hand:
#   - a Debian bookworm root (debootstrap from the apt mirror this machine is configured with)
#     with systemd, containerd and runc, the CNI plugins, iptables, conntrack and the other
#     tools kind's base image installs, plus openssl for deploy/sidecar/setup-node.sh;
#   - kind's files as its base image copies them (entrypoint, /kind/bin, the kubelet unit and
#     drop-ins, sysctls, crictl.yaml) and its containerd configuration, changed where this
#     image differs: Debian's containerd 1.6 (its unit, no fuse-overlayfs), the sandbox image
#     build.sh tags, restrict_oom_score_adj = true (the kernel refuses to lower oom_score_adj),
#     and a bridge network that containerd writes from the node's pod range (conf_template);
#   - kubelet, kubeadm and kubectl in /usr/bin, /kind/version;
#   - the control plane's images (build.sh's archives, a kube-proxy image made here around
#     the kube-proxy binary and iptables, and CoreDNS as e2e/node/build.sh built it), imported into
#     containerd's k8s.io namespace when the node starts, before the kubelet
#     (kind-preload-images.service).
# kind applies /kind/manifests/default-cni.yaml; here it is a ConfigMap that says where the pod
# network comes from, as kindnet's image cannot be pulled either.
#
# Cached: the Debian root under target/kind/debian-bookworm-<packages hash>/, the image by a hash
# of this script and the versions it packs; a second call prints the name.
#
# Needs: root, podman, debootstrap, go (for crictl), jq.
# Usage: e2e/kind/build-node-image.sh          prints the image name
# Environment: NODE_BUILD, the directory e2e/node/build.sh prints (default: run it).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=e2e/kind/lib.sh
. "$here/lib.sh"

for tool in podman debootstrap go jq; do
  command -v "$tool" >/dev/null 2>&1 ||
    die "build-node-image.sh needs $tool (Debian: apt-get install podman debootstrap jq; Go 1.26)"
done
[ "$(id -u)" = 0 ] || die "build-node-image.sh must run as root (debootstrap, chroot, rootful podman)"

# NODE_BUILD: the directory e2e/node/build.sh printed, when the caller ran it already.
node_build=${NODE_BUILD:-$("$root/e2e/node/build.sh")}
# shellcheck source=/dev/null
. "$node_build/versions.env"
kind_src=$(cd "$root/target" && go mod download -json "sigs.k8s.io/kind@${KIND_VERSION}" | jq -r .Dir)
[ -d "$kind_src/images/base/files" ] || die "kind's module source has no images/base/files: $kind_src"

packages=systemd,systemd-sysv,dbus,containerd,runc,containernetworking-plugins,iptables,nftables,conntrack,ethtool,socat,iproute2,util-linux,mount,kmod,procps,ca-certificates,jq,libseccomp2,bash,e2fsprogs,openssl
tag="${KUBERNETES_VERSION}-$(cat "$0" "$node_build/versions.env" <(echo "$KIND_VERSION $packages") |
  sha256sum | cut -c1-12)"
image="localhost/bootstrap-controller/kind-node:$tag"
if podman image exists "$image"; then
  echo "$image"
  exit 0
fi

started=$(date +%s)
cache="$root/target/kind"
mkdir -p "$cache"
exec 9>"$cache/build-node-image.lock"
flock 9

# --- kubectl and CoreDNS as the real node's build made them (its conformance tests run both:
# e2e/node/build.sh, versions.env), crictl at kind's version from its Go module ---
kubectl_bin="${KUBECTL:-}"
[ -x "$kubectl_bin" ] || die "no kubectl at '$kubectl_bin' (KUBECTL in $node_build/versions.env): run e2e/node/build.sh"
# crictl (kind's tools use it in the node) at the version kind's base image builds.
crictl_version=$(sed -n 's/^ARG CRICTL_VERSION="\(.*\)"$/\1/p' "$kind_src/images/base/Dockerfile")
[ -n "$crictl_version" ] || die "no CRICTL_VERSION in kind $KIND_VERSION's images/base/Dockerfile"
crictl_dir="$cache/crictl-$crictl_version"
if [ ! -x "$crictl_dir/crictl" ]; then
  (cd "$cache" && CGO_ENABLED=0 GOBIN="$crictl_dir" go install "sigs.k8s.io/cri-tools/cmd/crictl@$crictl_version")
fi

# CoreDNS, which kubeadm deploys, at the version kubeadm names.
kubeadm_images=$("$node_build/bin/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION")
coredns_image=$(echo "$kubeadm_images" | grep '/coredns:')
if [ "$coredns_image" != "${COREDNS_IMAGE:-}" ] || [ ! -x "${COREDNS:-}" ]; then
  die "kubeadm names $coredns_image; $node_build/versions.env has '${COREDNS_IMAGE:-}' at '${COREDNS:-}': run e2e/node/build.sh"
fi

# --- the Debian root, once per package list ---
debian="$cache/debian-bookworm-$(echo "$packages" | sha256sum | cut -c1-12)"
if [ ! -d "$debian/rootfs" ]; then
  rm -rf "$debian/rootfs.partial"
  mkdir -p "$debian"
  debootstrap --variant=minbase --include="$packages" bookworm "$debian/rootfs.partial" \
    >"$debian/debootstrap.log" 2>&1 ||
    die "debootstrap failed; its log: $debian/debootstrap.log"
  mv "$debian/rootfs.partial" "$debian/rootfs"
fi

work="$cache/node-image.partial"
rm -rf "$work"
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"
cp -a "$debian/rootfs" "$rootfs"
files="$kind_src/images/base/files"

# --- kind's base image: its files, then its RUN steps (Dockerfile) ---
install -D -m 0755 "$files/usr/local/bin/entrypoint" "$rootfs/usr/local/bin/entrypoint"
install -D -m 0755 -t "$rootfs/kind/bin" "$files"/kind/bin/*.sh
install -D -m 0644 -t "$rootfs/etc" "$files/etc/crictl.yaml"
install -D -m 0644 -t "$rootfs/etc/default" "$files/etc/default/kubelet"
install -D -m 0644 -t "$rootfs/etc/sysctl.d" "$files"/etc/sysctl.d/*
install -D -m 0644 -t "$rootfs/etc/systemd/system" "$files/etc/systemd/system/kubelet.service" \
  "$files/etc/systemd/system/kubelet.slice" "$files/etc/systemd/system/undo-mount-hacks.service"
install -D -m 0644 -t "$rootfs/etc/systemd/system/kubelet.service.d" \
  "$files"/etc/systemd/system/kubelet.service.d/*
# kind's containerd configuration without the fuse-overlayfs snapshotter (rootless only, not
# installed), with build.sh's sandbox image, restrict_oom_score_adj and the CNI template.
mkdir -p "$rootfs/etc/containerd"
sed -e '/^\[proxy_plugins\]/,/^$/d' -e '/^# fuse-overlayfs is used for rootless/d' \
  -e "s#sandbox_image = .*#sandbox_image = \"$PAUSE_IMAGE\"#" \
  -e 's#restrict_oom_score_adj = false#restrict_oom_score_adj = true#' \
  "$files/etc/containerd/config.toml" >"$rootfs/etc/containerd/config.toml"
if ! grep -q "sandbox_image = \"$PAUSE_IMAGE\"" "$rootfs/etc/containerd/config.toml" ||
  ! grep -q 'restrict_oom_score_adj = true' "$rootfs/etc/containerd/config.toml"; then
  die "kind $KIND_VERSION's containerd config.toml changed: sandbox_image or restrict_oom_score_adj not found"
fi
cat >>"$rootfs/etc/containerd/config.toml" <<'EOF'

# This machine's kernel refuses to lower a process's oom_score_adj: without
# restrict_oom_score_adj (above) runc fails every sandbox. The pod network: a bridge that
# containerd writes into /etc/cni/net.d from this template once the kubelet tells it the node's
# pod range (kind's kindnet image cannot be pulled here).
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "/usr/lib/cni"
  conf_dir = "/etc/cni/net.d"
  conf_template = "/etc/containerd/cni-template.json"
EOF
cat >"$rootfs/etc/containerd/cni-template.json" <<'EOF'
{
  "cniVersion": "0.4.0",
  "name": "kind-node-bridge",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "cni0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [{{range $i, $range := .PodCIDRRanges}}{{if $i}}, {{end}}[{"subnet": "{{$range}}"}]{{end}}],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
mkdir -p "$rootfs/opt/cni" "$rootfs/etc/cni/net.d"
ln -s /usr/lib/cni "$rootfs/opt/cni/bin"
chroot "$rootfs" ctr oci spec |
  jq '.hooks.createContainer[.hooks.createContainer| length] |= . + {"path": "/kind/bin/mount-product-files.sh"}' |
  jq 'del(.process.rlimits)' >"$rootfs/etc/containerd/cri-base.json"
find "$rootfs/lib/systemd/system/sysinit.target.wants/" -name systemd-tmpfiles-setup.service -delete
rm -f "$rootfs"/lib/systemd/system/multi-user.target.wants/* "$rootfs"/etc/systemd/system/*.wants/* \
  "$rootfs"/lib/systemd/system/local-fs.target.wants/* "$rootfs"/lib/systemd/system/sockets.target.wants/*udev* \
  "$rootfs"/lib/systemd/system/sockets.target.wants/*initctl* "$rootfs"/lib/systemd/system/basic.target.wants/*
echo "ReadKMsg=no" >>"$rootfs/etc/systemd/journald.conf"
mkdir -p "$rootfs/etc/kubernetes/manifests"

# --- the node image's part (kind build node-image): binaries, version, images ---
install -m 0755 "$node_build/bin/kubelet" "$node_build/bin/kubeadm" "$rootfs/usr/bin/"
install -m 0755 "$kubectl_bin" "$rootfs/usr/bin/kubectl"
install -m 0755 "$crictl_dir/crictl" "$rootfs/usr/local/bin/crictl"
echo "$KUBERNETES_VERSION" >"$rootfs/kind/version"
mkdir -p "$rootfs/kind/images" "$rootfs/kind/manifests"
cp "$node_build"/images/{pause,etcd,kube-apiserver,kube-controller-manager,kube-scheduler}.tar \
  "$rootfs/kind/images/"

# kube-proxy runs as kubeadm's DaemonSet: an image with the static kube-proxy and iptables
# (legacy, the mode kind's entrypoint picks on a node without rules), its libraries and
# extensions from the Debian root.
proxy="$work/kube-proxy"
mkdir -p "$proxy/usr/local/bin" "$proxy/usr/sbin"
install -m 0755 "$node_build/bin/kube-proxy" "$proxy/usr/local/bin/kube-proxy"
cp -a "$rootfs/usr/sbin/xtables-legacy-multi" "$proxy/usr/sbin/"
for name in iptables iptables-save iptables-restore ip6tables ip6tables-save ip6tables-restore; do
  ln -s xtables-legacy-multi "$proxy/usr/sbin/$name"
done
mkdir -p "$proxy/usr/lib/x86_64-linux-gnu"
cp -a "$rootfs/usr/lib/x86_64-linux-gnu/xtables" "$proxy/usr/lib/x86_64-linux-gnu/"
for lib in $( (chroot "$rootfs" ldd /usr/sbin/xtables-legacy-multi
  for ext in "$rootfs"/usr/lib/x86_64-linux-gnu/xtables/*.so; do chroot "$rootfs" ldd "${ext#"$rootfs"}"; done) |
  grep -o '/[^ ]*' | sort -u); do
  mkdir -p "$proxy$(dirname "$lib")"
  cp -L "$rootfs$lib" "$proxy$lib"
done
install -D -m 0644 "$rootfs/etc/ld.so.cache" "$proxy/etc/ld.so.cache"
# The directory $1 as the image $2 (podman import's --change arguments after it), saved as the
# docker archive /kind/images/$3.tar; nothing is left in podman's storage.
archive_image() {
  local dir="$1" name="$2" file="$3" build="localhost/bootstrap-controller/kind-node-build-$3:$tag"
  shift 3
  tar -C "$dir" -c . | podman import --quiet "$@" - "$build" >/dev/null
  podman tag "$build" "$name"
  podman save --quiet --format docker-archive -o "$rootfs/kind/images/$file.tar" "$name"
  podman rmi --force "$name" "$build" >/dev/null
}
archive_image "$proxy" "registry.k8s.io/kube-proxy:$KUBERNETES_VERSION" kube-proxy
# CoreDNS FROM scratch, started as its own image is (kubeadm's Deployment gives only arguments).
mkdir -p "$work/coredns"
install -m 0755 "$COREDNS" "$work/coredns/coredns"
archive_image "$work/coredns" "$coredns_image" coredns --change 'ENTRYPOINT ["/coredns"]'

# kubeadm names etcd by its own default tag for this Kubernetes version; build.sh tags the etcd
# it built by etcd's version (the real node sets etcd.local.imageTag to it). The node tags the
# same image under kubeadm's name too, so a kind configuration needs no etcd patch.
kubeadm_etcd=$(echo "$kubeadm_images" | grep '/etcd:')
cat >"$rootfs/kind/bin/preload-images.sh" <<EOF
#!/bin/sh
# Imports the control plane's images into containerd's k8s.io namespace (no registry to pull
# them from), as kind's node images hold them.
set -eu
for archive in /kind/images/*.tar; do
  ctr --namespace=k8s.io images import --all-platforms --digests --snapshotter=overlayfs "\$archive" >/dev/null
done
if [ "$kubeadm_etcd" != "registry.k8s.io/etcd:$ETCD_IMAGE_TAG" ]; then
  ctr --namespace=k8s.io images tag --force "registry.k8s.io/etcd:$ETCD_IMAGE_TAG" "$kubeadm_etcd" >/dev/null
fi
EOF
chmod 0755 "$rootfs/kind/bin/preload-images.sh"
cat >"$rootfs/etc/systemd/system/kind-preload-images.service" <<'EOF'
[Unit]
Description=Import the control plane's images into containerd
After=containerd.service
Requires=containerd.service
Before=kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/kind/bin/preload-images.sh

[Install]
WantedBy=multi-user.target
EOF
cat >"$rootfs/kind/manifests/default-cni.yaml" <<'EOF'
# kind applies this file as the cluster's CNI. The pod network of this node image is a bridge
# containerd writes from /etc/containerd/cni-template.json with the node's pod range.
apiVersion: v1
kind: ConfigMap
metadata:
  name: kind-node-cni
  namespace: kube-system
data:
  cni: "bridge, from containerd's conf_template (/etc/containerd/cni-template.json)"
EOF

chroot "$rootfs" systemctl enable kubelet.service containerd.service undo-mount-hacks.service \
  kind-preload-images.service >/dev/null 2>&1
chroot "$rootfs" systemctl mask systemd-binfmt.service >/dev/null 2>&1

tar -C "$rootfs" -c . | podman import --quiet \
  --change 'ENV container=docker' --change 'STOPSIGNAL SIGRTMIN+3' \
  --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' - "$image" >/dev/null
# One node image in podman's storage: the ones this script built before are removed.
podman images --format '{{.Repository}}:{{.Tag}}' "${image%:*}" | { grep -vxF "$image" || true; } |
  xargs --no-run-if-empty podman rmi >/dev/null
echo "build-node-image.sh: $image built in $(($(date +%s) - started)) s" >&2
echo "$image"

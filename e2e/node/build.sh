#!/usr/bin/env bash
# Builds what e2e/node/up.sh runs, once per version, into target/node/<versions>/ (or
# $BOOTSTRAP_NODE_BUILD): bin/ holds kubelet, kube-proxy, kubeadm (from the Go module pinned in
# e2e/node/k8s, the same k8s.io/kubernetes as e2e/control-plane/k8s) and the control plane's
# etcd, kube-apiserver and kube-controller-manager (e2e/control-plane/build.sh); images/ holds
# docker archives for `ctr images import`, FROM scratch around those static binaries and tagged
# as kubeadm names them, so that nothing is ever pulled: the sandbox (pause), etcd,
# kube-apiserver, kube-controller-manager, kube-scheduler. A second call with the same pins only
# prints the directory.
#
# The helm CLI the chart's tests run (helm.sh/helm/v4, pinned in e2e/node/helm) is built once per
# version into target/node/helm-<version>/ (beside the directory above), so that a new helm
# rebuilds nothing else; versions.env names it as HELM.
#
# The bootstrap-controller image is built on every call (the binary changes with the tree): the
# Containerfile's `prebuilt` stage around the musl static binary, as the README tells users,
# tagged as deploy/sidecar/bootstrap-controller.yaml names it, into
# $out/images/bootstrap-controller.tar.
#
# Usage: e2e/node/build.sh            prints the directory holding bin/ and images/
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

module_version() { # go.mod file, module path -> the version it requires
  awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}

k8s_version=$(module_version "$here/k8s/go.mod" k8s.io/kubernetes)
cp_k8s_version=$(module_version "$root/e2e/control-plane/k8s/go.mod" k8s.io/kubernetes)
etcd_version=$(module_version "$root/e2e/control-plane/etcd/go.mod" go.etcd.io/etcd/server/v3)
if [ -z "$k8s_version" ] || [ "$k8s_version" != "$cp_k8s_version" ]; then
  # One cluster, one version: the node's kubelet must be the control plane's.
  echo "build.sh: e2e/node/k8s pins k8s.io/kubernetes '$k8s_version', e2e/control-plane/k8s '$cp_k8s_version'; make them equal" >&2
  exit 2
fi

out=${BOOTSTRAP_NODE_BUILD:-$root/target/node/kubernetes-$k8s_version-etcd-$etcd_version}
helm_version=$(module_version "$here/helm/go.mod" helm.sh/helm/v4)
if [ -z "$helm_version" ]; then
  echo "build.sh: cannot read the helm version pinned in $here/helm/go.mod" >&2
  exit 2
fi
helm_out=$(dirname "$out")/helm-$helm_version
# kubeadm's names: the pause tag kubeadm defaults to for this version, etcd with its real
# version (up.sh sets etcd.local.imageTag to it: kubeadm would otherwise name another etcd).
pause_image=registry.k8s.io/pause:3.10.2
etcd_image=registry.k8s.io/etcd:${etcd_version#v}-0
controller_image=$(sed -n 's/^ *image: *//p' "$root/deploy/sidecar/bootstrap-controller.yaml" | head -n 1)

cached() {
  local f
  for f in kubelet kube-proxy kubeadm etcd kube-apiserver kube-controller-manager kube-scheduler; do
    [ -x "$out/bin/$f" ] || return 1
  done
  for f in pause etcd kube-apiserver kube-controller-manager kube-scheduler; do
    [ -s "$out/images/$f.tar" ] || return 1
  done
}

# buildah with a store of its own under $out: the images never mix with other users' storage,
# and vfs needs no overlay mounts (buildah runs as root here, outside any container engine).
bah() {
  buildah --root "$out/buildah/root" --runroot "$out/buildah/run" --storage-driver vfs "$@"
}

# FROM scratch image $2 around the static binary $3 at /usr/local/bin (kubeadm's manifests
# run the command by name), saved as the docker archive $out/images.partial/$1.tar.
scratch_image() {
  local name="$1" tag="$2" binary="$3" ctr
  ctr=$(bah from scratch)
  bah copy "$ctr" "$binary" "/usr/local/bin/$(basename "$binary")" >/dev/null
  bah config --env PATH=/usr/local/bin:/usr/bin:/bin --entrypoint "[\"/usr/local/bin/$(basename "$binary")\"]" "$ctr"
  bah commit --quiet "$ctr" "localhost/node-build-$name" >/dev/null
  bah rm "$ctr" >/dev/null
  rm -f "$out/images.partial/$name.tar"
  bah push --quiet "localhost/node-build-$name" "docker-archive:$out/images.partial/$name.tar:$tag"
  bah rmi "localhost/node-build-$name" >/dev/null
}

controller_image() {
  local target=${CARGO_TARGET_DIR:-$root/target} context=$out/controller-context
  (cd "$root" && cargo build --release --locked --target x86_64-unknown-linux-musl -p bootstrap-controller)
  mkdir -p "$out/images"
  # The binary alone is the build context: buildah reads the context confined to its directory,
  # so a target directory elsewhere (a symlinked `target`, CARGO_TARGET_DIR) is out of its reach.
  rm -rf "$context"
  mkdir -p "$context"
  cp "$target/x86_64-unknown-linux-musl/release/bootstrap-controller" "$context/"
  bah bud --quiet --build-arg BINARY_STAGE=prebuilt --build-arg STATIC_BINARY=bootstrap-controller \
    -f "$root/Containerfile" -t localhost/node-build-bootstrap-controller "$context" >/dev/null
  rm -rf "$context"
  rm -f "$out/images/bootstrap-controller.tar"
  bah push --quiet localhost/node-build-bootstrap-controller \
    "docker-archive:$out/images/bootstrap-controller.tar:$controller_image"
  bah rmi localhost/node-build-bootstrap-controller >/dev/null
}

mkdir -p "$(dirname "$out")"
# Tests may call this at once: one builds, the others wait and find the result.
exec 9>"$out.lock"
flock 9
if ! cached; then
  for tool in go buildah; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "build.sh: $tool is needed (Go 1.26 for the Kubernetes binaries, buildah for the images)" >&2
      exit 2
    fi
  done
  started=$(date +%s)
  echo "build.sh: building kubelet, kube-proxy, kube-scheduler, kubeadm $k8s_version and the node's images (warm Go caches: under 2 minutes; cold: about 6)" >&2
  cp_bin=$("$root/e2e/control-plane/build.sh")
  rm -rf "$out/bin.partial" "$out/images.partial"
  mkdir -p "$out/bin.partial" "$out/images.partial"
  export CGO_ENABLED=0
  # The version the binaries report is stamped at link time, as e2e/control-plane/build.sh does.
  minor=${k8s_version#v1.}
  minor=${minor%%.*}
  version_flags="-X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  (cd "$here/k8s" && go build -ldflags "$version_flags" -o "$out/bin.partial/" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy k8s.io/kubernetes/cmd/kubeadm \
    k8s.io/kubernetes/cmd/kube-scheduler)
  (cd "$here/k8s" && go build -o "$out/bin.partial/pause" ./pause)
  cp "$cp_bin/etcd" "$cp_bin/kube-apiserver" "$cp_bin/kube-controller-manager" "$out/bin.partial/"
  scratch_image pause "$pause_image" "$out/bin.partial/pause"
  scratch_image etcd "$etcd_image" "$out/bin.partial/etcd"
  for component in kube-apiserver kube-controller-manager kube-scheduler; do
    scratch_image "$component" "registry.k8s.io/$component:$k8s_version" "$out/bin.partial/$component"
  done
  rm -rf "${out:?}/bin" "$out/images.cached"
  # The controller's archive (rebuilt below) survives a rebuild of the cached part.
  [ -d "$out/images" ] && mv "$out/images" "$out/images.cached"
  mv "$out/bin.partial" "$out/bin"
  mv "$out/images.partial" "$out/images"
  rm -rf "$out/images.cached"
  echo "build.sh: Kubernetes binaries and images built in $(($(date +%s) - started)) s into $out" >&2
fi
if [ ! -x "$helm_out/helm" ]; then
  command -v go >/dev/null 2>&1 || { echo "build.sh: go is needed to build helm $helm_version" >&2; exit 2; }
  started=$(date +%s)
  echo "build.sh: building helm $helm_version (warm Go caches: seconds; cold: minutes)" >&2
  rm -rf "$helm_out.partial"
  mkdir -p "$helm_out.partial"
  # As helm's own Makefile builds it: static, its version stamped, no symbol tables.
  (cd "$here/helm" && CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$helm_version -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$helm_out.partial/helm" helm.sh/helm/v4/cmd/helm)
  rm -rf "$helm_out"
  mv "$helm_out.partial" "$helm_out"
  echo "build.sh: helm $helm_version built in $(($(date +%s) - started)) s into $helm_out" >&2
fi
started=$(date +%s)
controller_image >&2
echo "build.sh: bootstrap-controller image $controller_image built in $(($(date +%s) - started)) s" >&2
{
  echo "KUBERNETES_VERSION=$k8s_version"
  echo "ETCD_IMAGE_TAG=${etcd_version#v}-0"
  echo "PAUSE_IMAGE=$pause_image"
  echo "CONTROLLER_IMAGE=$controller_image"
  echo "HELM=$helm_out/helm"
} >"$out/versions.env"
echo "$out"

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
# What upstream's conformance tests need (e2e/node/conformance.sh) goes into $out/conformance/:
# bin/ holds e2e.test and kubectl at the same version (from the module e2e/node/conformance),
# images/ the archives of agnhost, busybox and CoreDNS under the names the tests and kubeadm give
# them; CoreDNS itself is built once per version into target/node/coredns-<version>/.
# versions.env names them (E2E_TEST, KUBECTL, CONFORMANCE_IMAGES, COREDNS, COREDNS_IMAGE).
#
# The bootstrap-controller image is built on every call (the binary changes with the tree): the
# Containerfile's `prebuilt` stage around the musl static binary, as the README tells users,
# tagged as deploy/sidecar/bootstrap-controller.yaml names it, into
# $out/images/bootstrap-controller.tar.
#
# NODE_CONFORMANCE=0 leaves the conformance part out; `--conformance` builds only it, once the
# rest is built (e2e/node/test.sh builds it so, at a low priority, while the node's scenarios run).
#
# Usage: e2e/node/build.sh [--conformance]   prints the directory holding bin/ and images/
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
only_conformance=false
case "$*" in
  "") ;;
  --conformance) only_conformance=true ;;
  *)
    echo "usage: e2e/node/build.sh [--conformance]   (NODE_CONFORMANCE=0: without the conformance tests' binaries and images)" >&2
    exit 2
    ;;
esac

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
# The version the binaries report is stamped at link time, as e2e/control-plane/build.sh does.
minor=${k8s_version#v1.}
minor=${minor%%.*}
version_flags="-X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
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
# run the command by name), saved as the docker archive $1.tar in $4 (default
# $out/images.partial).
scratch_image() {
  local name="$1" tag="$2" binary="$3" archives="${4:-$out/images.partial}" ctr
  ctr=$(bah from scratch)
  bah copy "$ctr" "$binary" "/usr/local/bin/$(basename "$binary")" >/dev/null
  bah config --env PATH=/usr/local/bin:/usr/bin:/bin --entrypoint "[\"/usr/local/bin/$(basename "$binary")\"]" "$ctr"
  bah commit --quiet "$ctr" "localhost/node-build-$name" >/dev/null
  bah rm "$ctr" >/dev/null
  rm -f "$archives/$name.tar"
  bah push --quiet "localhost/node-build-$name" "docker-archive:$archives/$name.tar:$tag"
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

# Upstream's conformance tests (e2e/node/conformance.sh): e2e.test and kubectl from the module
# e2e/node/conformance (k8s.io/kubernetes at the same version, with the test-only modules its
# e2e suite needs), and the images those tests run, FROM scratch under the names
# test/utils/image/manifest.go gives them (nothing is pulled): agnhost and busybox, and the
# cluster DNS (CoreDNS at the version kubeadm names, built from its module, which needs no
# replace lines; kind's node image takes the same binary and kubectl from versions.env).
conformance_out=$out/conformance

conformance_cached() {
  local f
  for f in e2e.test kubectl; do
    [ -x "$conformance_out/bin/$f" ] || return 1
  done
  for f in agnhost busybox coredns; do
    [ -s "$conformance_out/images/$f.tar" ] || return 1
  done
}

# The tag manifest.go gives image $1 (configs[$1] = Config{list.PromoterE2eRegistry, "name", "tag"}).
e2e_image() {
  local manifest="$k8s_dir/test/utils/image/manifest.go" tag
  tag=$(sed -n "s/^\tconfigs\[$1\] = Config{list.PromoterE2eRegistry, \"\([a-z0-9-]*\)\", \"\([^\"]*\)\"}\$/\1:\2/p" "$manifest")
  if [ -z "$tag" ]; then
    echo "build.sh: no configs[$1] on the promoter registry in $manifest" >&2
    return 1
  fi
  echo "registry.k8s.io/e2e-test-images/$tag"
}

# Copies the host's executables $2... into the root $1 at the same paths, with the shared
# libraries and loader ldd names for them.
copy_with_libraries() {
  local rootfs="$1" path lib
  shift
  for path in "$@"; do
    install -D -m 0755 "$path" "$rootfs$path"
    for lib in $(ldd "$path" | grep -o '/[^ ]*'); do
      [ -e "$rootfs$lib" ] || install -D -m 0755 "$lib" "$rootfs$lib"
    done
  done
}

# busybox's applets as links in $1/bin, except names the root has already.
busybox_root() {
  local rootfs="$1" applet
  install -D -m 0755 "$busybox" "$rootfs/bin/busybox"
  for applet in $("$busybox" --list); do
    [ -e "$rootfs/bin/$applet" ] || [ -e "$rootfs/usr/bin/$applet" ] || ln -s busybox "$rootfs/bin/$applet"
  done
  mkdir -p "$rootfs/etc" "$rootfs/tmp" "$rootfs/root"
  chmod 1777 "$rootfs/tmp"
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\n' >"$rootfs/etc/group"
  printf 'hosts: files dns\n' >"$rootfs/etc/nsswitch.conf"
}

# The root $2 as image $3 (entrypoint $4, command $5, as JSON), saved as $1.tar in the images.
root_image() {
  local name="$1" rootfs="$2" tag="$3" entrypoint="$4" cmd="$5" ctr
  tar -C "$rootfs" -cf "$rootfs.tar" .
  ctr=$(bah from scratch)
  bah add "$ctr" "$rootfs.tar" / >/dev/null
  bah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --entrypoint "$entrypoint" --cmd "$cmd" "$ctr"
  bah commit --quiet "$ctr" "localhost/node-build-$name" >/dev/null
  bah rm "$ctr" >/dev/null
  rm -f "$rootfs.tar" "$conformance_out/images.partial/$name.tar"
  bah push --quiet "localhost/node-build-$name" "docker-archive:$conformance_out/images.partial/$name.tar:$tag"
  bah rmi "localhost/node-build-$name" >/dev/null
}

conformance() {
  local started agnhost_image busybox_image tool work k8s_dir
  conformance_cached && return 0
  busybox=/bin/busybox
  for tool in "$busybox" /bin/bash /usr/bin/curl /bin/nc.openbsd /usr/sbin/ip /usr/bin/ss; do
    if [ ! -x "$tool" ]; then
      echo "build.sh: the conformance tests' images take $tool from this machine (Debian: apt-get install busybox-static bash curl netcat-openbsd iproute2)" >&2
      return 2
    fi
  done
  started=$(date +%s)
  echo "build.sh: building e2e.test, kubectl, agnhost $k8s_version, CoreDNS ${coredns_image##*:} and the conformance tests' images (warm Go caches: under a minute; cold: see BENCHMARKS.md)" >&2
  work=$conformance_out/work
  rm -rf "$conformance_out/bin.partial" "$conformance_out/images.partial" "$work"
  mkdir -p "$conformance_out/bin.partial" "$conformance_out/images.partial" "$work"
  (cd "$here/conformance" && CGO_ENABLED=0 go test -c -vet=off -ldflags "$version_flags" \
    -o "$conformance_out/bin.partial/e2e.test" k8s.io/kubernetes/test/e2e)
  (cd "$here/conformance" && CGO_ENABLED=0 go build -ldflags "$version_flags" \
    -o "$conformance_out/bin.partial/" k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/test/images/agnhost)
  # k8s.io/kubernetes's source, which the module cache holds once the builds above downloaded it.
  k8s_dir=$(cd "$here/conformance" && go list -m -f '{{.Dir}}' k8s.io/kubernetes)
  agnhost_image=$(e2e_image Agnhost)
  busybox_image=$(e2e_image BusyBox)
  if [ ! -x "$coredns_out/coredns" ]; then
    rm -rf "$coredns_out.partial"
    (cd "$(dirname "$out")" && CGO_ENABLED=0 GOBIN="$coredns_out.partial" \
      go install "github.com/coredns/coredns@${coredns_image##*:}")
    rm -rf "$coredns_out"
    mv "$coredns_out.partial" "$coredns_out"
  fi

  # agnhost as upstream's image has it (test/images/agnhost/Dockerfile: alpine's busybox and the
  # tools the tests run in it: bash, curl, netcat-openbsd's nc, iproute2's ip and ss). Its sh is
  # bash: Debian's busybox ash runs its own applets before PATH's, and the tests need nc -v.
  install -D -m 0755 "$conformance_out/bin.partial/agnhost" "$work/agnhost/agnhost"
  ln -s agnhost "$work/agnhost/agnhost-2"
  # porter's TLS ports serve this pair, at / as the Dockerfile adds it.
  install -m 0644 "$k8s_dir/test/images/agnhost/porter/localhost.crt" \
    "$k8s_dir/test/images/agnhost/porter/localhost.key" "$work/agnhost/"
  mkdir -p "$work/agnhost/uploads"
  copy_with_libraries "$work/agnhost" /bin/bash /usr/bin/curl /usr/sbin/ip /usr/bin/ss
  install -D -m 0755 /bin/nc.openbsd "$work/agnhost/usr/bin/nc"
  copy_with_libraries "$work/agnhost" /bin/nc.openbsd
  rm -f "$work/agnhost/bin/nc.openbsd"
  ln -s bash "$work/agnhost/bin/sh"
  busybox_root "$work/agnhost"
  root_image agnhost "$work/agnhost" "$agnhost_image" '["/agnhost"]' '["pause"]'
  # busybox as upstream's (the busybox image: its applets, sh by default).
  busybox_root "$work/busybox"
  root_image busybox "$work/busybox" "$busybox_image" '[]' '["sh"]'
  scratch_image coredns "$coredns_image" "$coredns_out/coredns" "$conformance_out/images.partial"

  rm -rf "$work" "${conformance_out:?}/bin" "$conformance_out/images"
  mv "$conformance_out/bin.partial" "$conformance_out/bin"
  mv "$conformance_out/images.partial" "$conformance_out/images"
  echo "build.sh: conformance binaries and images built in $(($(date +%s) - started)) s into $conformance_out" >&2
}

mkdir -p "$(dirname "$out")"
# Tests may call this at once: one builds, the others wait and find the result. The conformance
# part has a lock of its own, so that it builds beside a call that only needs the rest.
exec 9>"$out.lock"
flock 9
if [ "$only_conformance" = true ]; then
  if ! cached; then
    echo "build.sh --conformance: the node's binaries are not built yet (e2e/node/build.sh builds them)" >&2
    exit 2
  fi
  exec 9>&-
  coredns_image=$("$out/bin/kubeadm" config images list --kubernetes-version "$k8s_version" | grep '/coredns:')
  coredns_out=$(dirname "$out")/coredns-${coredns_image##*:}
  exec 8>"$conformance_out.lock"
  flock 8
  conformance >&2
  echo "$out"
  exit 0
fi
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
# kubeadm names the CoreDNS it deploys for this version.
coredns_image=$("$out/bin/kubeadm" config images list --kubernetes-version "$k8s_version" | grep '/coredns:')
coredns_out=$(dirname "$out")/coredns-${coredns_image##*:}
if [ "${NODE_CONFORMANCE:-1}" != 0 ]; then
  exec 8>"$conformance_out.lock"
  flock 8
  conformance >&2
  exec 8>&-
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
  echo "E2E_TEST=$conformance_out/bin/e2e.test"
  echo "KUBECTL=$conformance_out/bin/kubectl"
  echo "CONFORMANCE_IMAGES=$conformance_out/images"
  echo "COREDNS=$coredns_out/coredns"
  echo "COREDNS_IMAGE=$coredns_image"
} >"$out/versions.env"
echo "$out"

#!/usr/bin/env bash
# Builds the real control plane's binaries (etcd, kube-apiserver, kube-controller-manager) from
# the Go modules pinned beside this script, once per version: the result lands in
# target/control-plane/<kubernetes version>/ (or $BOOTSTRAP_CONTROL_PLANE_BIN) and a second call
# with the same pins only prints that directory. Go's own module and build caches make a rebuild
# after a fresh clone cost a link, not a compile.
#
# Other minors are pinned one module each under k8s/1.NN/ (written by k8s/pin.sh); they share
# the default's etcd, which kube-apiserver 1.30 and later speak to alike.
#
# Usage: e2e/control-plane/build.sh [--kubernetes 1.NN]
#   prints the directory holding the three binaries; --kubernetes (or BOOTSTRAP_KUBERNETES_VERSION)
#   picks a pinned minor other than the default (k8s/go.mod's); --list prints the pinned minors;
#   --dir prints the directory without building (whether it holds the binaries or not)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

usage() {
  sed -n '/^# Usage:/,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
}

module_version() { # go.mod file, module path -> the version it requires
  awk -v m="$2" '$1 == m && $2 ~ /^v/ { print $2; exit } $1 == "require" && $2 == m { print $3; exit }' "$1"
}

pinned_minors() { # the minors pinned here, oldest first, one a line
  {
    for mod in "$here"/k8s/1.*/go.mod "$here/k8s/go.mod"; do
      [ -e "$mod" ] || continue
      v=$(module_version "$mod" k8s.io/kubernetes)
      v=${v#v}
      echo "${v%.*}"
    done
  } | sort -t. -k1,1n -k2,2n -u
}

wanted=${BOOTSTRAP_KUBERNETES_VERSION:-}
print_dir=false
while [ $# -gt 0 ]; do
  case "$1" in
    --kubernetes) wanted=${2:?--kubernetes needs a minor, e.g. 1.30}; shift 2 ;;
    --list) pinned_minors; exit 0 ;;
    --dir) print_dir=true; shift ;;
    -h|--help) usage ;;
    *) echo "build.sh: unknown argument $1" >&2; usage ;;
  esac
done

k8s_module=$here/k8s
default_version=$(module_version "$here/k8s/go.mod" k8s.io/kubernetes)
if [ -n "$wanted" ]; then
  case "$wanted" in
    1.[0-9]*) ;;
    *) echo "build.sh: --kubernetes takes a minor such as 1.30, not '$wanted'" >&2; exit 2 ;;
  esac
  default_minor=${default_version#v}
  default_minor=${default_minor%.*}
  if [ "$wanted" != "$default_minor" ]; then
    k8s_module=$here/k8s/$wanted
    if [ ! -e "$k8s_module/go.mod" ]; then
      echo "build.sh: Kubernetes $wanted is not pinned here (pinned: $(pinned_minors | paste -sd' ')); pin it with $here/k8s/pin.sh v$wanted.PATCH" >&2
      exit 2
    fi
  fi
fi

k8s_version=$(module_version "$k8s_module/go.mod" k8s.io/kubernetes)
etcd_version=$(module_version "$here/etcd/go.mod" go.etcd.io/etcd/server/v3)
if [ -z "$k8s_version" ] || [ -z "$etcd_version" ]; then
  echo "build.sh: cannot read the pinned versions from $k8s_module/go.mod and $here/etcd/go.mod" >&2
  exit 2
fi

out=${BOOTSTRAP_CONTROL_PLANE_BIN:-$root/target/control-plane/kubernetes-$k8s_version-etcd-$etcd_version}
if [ "$print_dir" = true ] || { [ -x "$out/kube-apiserver" ] && [ -x "$out/kube-controller-manager" ] && [ -x "$out/etcd" ]; }; then
  echo "$out"
  exit 0
fi

if ! command -v go >/dev/null 2>&1; then
  echo "build.sh: the Go toolchain is needed to build kube-apiserver $k8s_version and etcd $etcd_version (https://go.dev/dl, or your distribution's golang package)" >&2
  exit 2
fi

# Tests may call this at once: one builds, the others wait and find the result.
mkdir -p "$(dirname "$out")"
exec 9>"$out.lock"
flock 9
if [ -x "$out/kube-apiserver" ] && [ -x "$out/kube-controller-manager" ] && [ -x "$out/etcd" ]; then
  echo "$out"
  exit 0
fi
rm -rf "$out.partial"
mkdir -p "$out.partial"
export CGO_ENABLED=0
# The version kube-apiserver reports (/version) is stamped at link time, as its own build does.
minor=${k8s_version#v1.}
minor=${minor%%.*}
version_flags="-X k8s.io/component-base/version.gitVersion=$k8s_version -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
started=$(date +%s)
echo "build.sh: building etcd $etcd_version, kube-apiserver and kube-controller-manager $k8s_version (a link from warm Go caches: under a minute; cold: about 7 minutes on 2 idle cores)" >&2
(cd "$here/etcd" && go build -o "$out.partial/etcd" go.etcd.io/etcd/server/v3)
(cd "$k8s_module" && go build -ldflags "$version_flags" -o "$out.partial/" \
  k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager)
rm -rf "$out"
mv "$out.partial" "$out"
echo "build.sh: built in $(($(date +%s) - started)) s into $out" >&2
echo "$out"

#!/usr/bin/env bash
# Writes the module that pins one Kubernetes minor for e2e/control-plane/build.sh --kubernetes:
# e2e/control-plane/k8s/1.NN/{go.mod,go.sum,tools.go}, requiring k8s.io/kubernetes at the given
# patch with one replace line per staging module that release names (its own go.mod's
# `=> ./staging/src/...` lines: the list changes between minors, e.g. k8s.io/legacy-cloud-providers
# up to 1.30), then `go mod tidy`. The newest minor is the default module, e2e/control-plane/k8s
# itself, kept by hand.
#
# Usage: e2e/control-plane/k8s/pin.sh VERSION [MODULE=VERSION ...]
#   VERSION         e.g. v1.30.14 (a patch the Go module proxy serves)
#   MODULE=VERSION  a staging module at another patch of the same minor, for a patch the proxy
#                   does not serve (e.g. k8s.io/kube-scheduler=v0.31.13)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { sed -n '/^# Usage:/,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
version=$1
shift
case "$version" in
  v1.[0-9]*.[0-9]*) ;;
  *) echo "pin.sh: VERSION must look like v1.30.14, not $version" >&2; exit 2 ;;
esac
minor=${version#v1.}
minor=${minor%%.*}
staging_version=v0.$minor.${version##*.}
declare -A override=()
for arg in "$@"; do
  case "$arg" in
    k8s.io/*=v0."$minor".*) override[${arg%%=*}]=${arg#*=} ;;
    *) echo "pin.sh: $arg is not MODULE=v0.$minor.PATCH" >&2; exit 2 ;;
  esac
done

out=$here/1.$minor
mkdir -p "$out"
upstream_mod=$(cd "$out" && GOFLAGS=-mod=mod go mod download -json "k8s.io/kubernetes@$version" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["GoMod"])')
mapfile -t staging < <(awk '$2 == "=>" && $3 ~ /^\.\/staging\// { print $1 }' "$upstream_mod")
if [ "${#staging[@]}" -eq 0 ]; then
  echo "pin.sh: k8s.io/kubernetes $version's go.mod names no staging module" >&2
  exit 1
fi
{
  cat <<HEADER
// Test tooling, not part of the product: pins the real kube-apiserver and
// kube-controller-manager 1.$minor that e2e/control-plane/build.sh --kubernetes 1.$minor builds.
// Written by e2e/control-plane/k8s/pin.sh $version${*:+ $*}.
module bootstrap-controller.test/control-plane/k8s/1.$minor

go 1.26.0

require k8s.io/kubernetes $version

replace (
HEADER
  for module in "${staging[@]}"; do
    printf '\t%s => %s %s\n' "$module" "$module" "${override[$module]:-$staging_version}"
  done
  echo ')'
} > "$out/go.mod"
cp "$here/tools.go" "$out/tools.go"
(cd "$out" && go mod tidy)
echo "$out"

#!/usr/bin/env bash
# Makes a kubeconfig for a user of a control plane that up.sh started: a client certificate
# (CN=NAME, O=each GROUP) signed by the control plane's CA, in files the kubeconfig names, so a
# test can rotate them in place. Prints the kubeconfig's path.
#
# Usage: e2e/control-plane/kubeconfig.sh DIR NAME [--group GROUP]... [--apiserver N | --server URL]
#                                        [--out FILE]
#   default server: apiserver 1; default FILE: DIR/users/NAME.kubeconfig
set -euo pipefail

[ $# -ge 2 ] || { sed -n '/^# Usage:/,/^[^#]/p' "$0" | sed -n 's/^# \{0,1\}//p' >&2; exit 2; }
dir=$(cd "$1" && pwd)
name=$2
shift 2
subject="/CN=$name"
server=
out=
while [ $# -gt 0 ]; do
  case "$1" in
    --group) subject="$subject/O=${2:?--group needs a name}"; shift 2 ;;
    --server) server=${2:?--server needs a URL}; shift 2 ;;
    --apiserver)
      server=$(sed -n "s/^APISERVER_${2:?--apiserver needs a number}_URL=//p" "$dir/env")
      [ -n "$server" ] || { echo "kubeconfig.sh: no apiserver $2 in $dir/env" >&2; exit 2; }
      shift 2 ;;
    --out) out=${2:?--out needs a path}; shift 2 ;;
    *) echo "kubeconfig.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$server" ] || server=$(sed -n 's/^APISERVER_1_URL=//p' "$dir/env")
[ -n "$server" ] || { echo "kubeconfig.sh: no server: pass --server URL" >&2; exit 2; }
mkdir -p "$dir/users"
file=$(printf '%s' "$name" | tr -c 'A-Za-z0-9._-' '_')
[ -n "$out" ] || out="$dir/users/$file.kubeconfig"
key="$dir/users/$file.key"
cert="$dir/users/$file.crt"
openssl req -newkey rsa:2048 -nodes -keyout "$key.new" -out "$key.csr" -subj "$subject" 2>/dev/null
openssl x509 -req -in "$key.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial -days 365 \
  -out "$cert.new" -extfile <(printf 'extendedKeyUsage=clientAuth\n') 2>/dev/null
mv "$key.new" "$key"
mv "$cert.new" "$cert"
rm -f "$key.csr"
cat > "$out" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
  - name: control-plane
    cluster:
      server: $server
      certificate-authority: $dir/ca.crt
users:
  - name: $name
    user:
      client-certificate: $cert
      client-key: $key
contexts:
  - name: $name
    context: {cluster: control-plane, user: $name}
current-context: $name
KUBECONFIG
chmod 600 "$out" "$key"
echo "$out"

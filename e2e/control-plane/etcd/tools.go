//go:build tools

// The binary up.sh builds; listed here so that `go mod tidy` keeps its dependencies.
package tools

import _ "go.etcd.io/etcd/server/v3"

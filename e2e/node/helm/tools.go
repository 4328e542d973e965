//go:build tools

// The helm CLI e2e/node/build.sh builds; listed here so that `go mod tidy` keeps its
// dependencies.
package tools

import _ "helm.sh/helm/v4/cmd/helm"

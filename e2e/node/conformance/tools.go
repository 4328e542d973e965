//go:build tools

// What e2e/node/build.sh builds for e2e/node/conformance.sh: upstream's e2e suite (test/e2e, built
// with `go test -c`), kubectl at the same version (the suite runs it), and agnhost (the image the
// suite's pods run); listed here so that their dependencies stay in go.mod.
package tools

import (
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/test/e2e"
	_ "k8s.io/kubernetes/test/images/agnhost"
)

// The pod sandbox's process (containerd's sandbox_image): it holds the pod's namespaces, reaps
// the orphans a pod's containers leave behind (it is PID 1 when the pod shares its PID
// namespace) and exits on SIGINT or SIGTERM, as registry.k8s.io/pause does. Built statically
// into an image FROM scratch by e2e/node/build.sh, so that nothing is pulled.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}

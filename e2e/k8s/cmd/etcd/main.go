// Command etcd is upstream etcd's server main (go.etcd.io/etcd/server/v3/etcdmain) at the version
// that k8s.io/kubernetes itself requires, so the API server talks to the etcd it was tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }

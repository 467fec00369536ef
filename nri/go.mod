// The csi-pmem NRI plugin: gives a container that mounts a csi-pmem devdax publication
// the volume's device node (README.md in this directory). A Go module of its own because
// the one maintained NRI implementation is containerd's Go stub; the driver stays Python.
module csipmem.local/nri

go 1.26.0

require (
	github.com/containerd/nri v0.12.3
	github.com/moby/sys/mountinfo v0.7.2
)

require (
	github.com/containerd/log v0.1.0 // indirect
	github.com/containerd/ttrpc v1.2.7 // indirect
	github.com/knqyf263/go-plugin v0.9.0 // indirect
	github.com/opencontainers/runtime-spec v1.3.0 // indirect
	github.com/sirupsen/logrus v1.9.4 // indirect
	github.com/tetratelabs/wazero v1.11.0 // indirect
	golang.org/x/mod v0.32.0 // indirect
	golang.org/x/sys v0.39.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20240528184218-531527333157 // indirect
	google.golang.org/grpc v1.65.1 // indirect
	google.golang.org/protobuf v1.34.1 // indirect
)

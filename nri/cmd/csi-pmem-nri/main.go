// Command csi-pmem-nri is the node plugin's NRI plugin: when the runtime creates a
// container that mounts a csi-pmem devdax publication, it adds the volume's device node
// (volume.json's device_node) with a device-cgroup rule, rw or r (package inject says
// what is checked and why).
//
// Why Go: NRI is a ttrpc protocol with one maintained implementation, containerd's own
// stub library (github.com/containerd/nri/pkg/stub); this small program uses it rather
// than re-implementing the protocol in the Python driver.
//
// It runs as its own container in the node DaemonSet (chart value nri.enabled) with the
// runtime's NRI socket and kubelet's directory (HostToContainer, at the host path)
// mounted. It never changes running containers: when it (re)connects, Synchronize only
// reports containers that mount a publication but were created without the node (while
// the plugin was not running); they keep dax.sock and get the node on their next start.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"

	"csipmem.local/nri/internal/inject"
)

type plugin struct {
	cfg  inject.Config
	host inject.Host
	log  *slog.Logger
}

func (p *plugin) CreateContainer(_ context.Context, pod *api.PodSandbox, ctr *api.Container) (
	*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	ins, errs := inject.Decide(p.host, p.cfg, ctr)
	for _, err := range errs {
		p.log.Warn("publication not injected", "pod", podName(pod), "container", ctr.GetName(),
			"error", err)
	}
	if len(ins) == 0 {
		return nil, nil, nil
	}
	adj := &api.ContainerAdjustment{}
	for _, in := range ins {
		adj.AddDevice(in.Device())
		for _, r := range in.CgroupRules() {
			addCgroupRule(adj, r)
		}
		p.log.Info("device injected", "pod", podName(pod), "container", ctr.GetName(),
			"volume", in.VolumeID, "host_device", in.HostPath, "path", in.Node.Path,
			"type", in.Node.Type, "major", in.Node.Major, "minor", in.Node.Minor,
			"access", in.Access(), "uid", in.UID, "gid", in.GID)
	}
	return adj, nil, nil
}

// addCgroupRule appends a device-cgroup rule to the adjustment's resources (the stub has
// no helper for it; the runtime applies these after the devices' own allow rules).
func addCgroupRule(adj *api.ContainerAdjustment, r *api.LinuxDeviceCgroup) {
	if adj.Linux == nil {
		adj.Linux = &api.LinuxContainerAdjustment{}
	}
	if adj.Linux.Resources == nil {
		adj.Linux.Resources = &api.LinuxResources{}
	}
	adj.Linux.Resources.Devices = append(adj.Linux.Resources.Devices, r)
}

func (p *plugin) Synchronize(_ context.Context, pods []*api.PodSandbox, ctrs []*api.Container) (
	[]*api.ContainerUpdate, error) {
	byID := map[string]*api.PodSandbox{}
	for _, pod := range pods {
		byID[pod.GetId()] = pod
	}
	missing := 0
	for _, ctr := range ctrs {
		ins, _ := inject.Decide(p.host, p.cfg, ctr)
		for _, in := range ins {
			if inject.HasDevice(ctr, in.Node.Path) {
				continue
			}
			missing++
			p.log.Warn("container was created without the device node (the plugin was not "+
				"running); it keeps dax.sock and gets the node when it is created again",
				"pod", podName(byID[ctr.GetPodSandboxId()]), "container", ctr.GetName(),
				"volume", in.VolumeID, "path", in.Node.Path)
		}
	}
	p.log.Info("synchronized", "pods", len(pods), "containers", len(ctrs),
		"without_node", missing)
	return nil, nil
}

func podName(pod *api.PodSandbox) string {
	if pod == nil {
		return "?"
	}
	return pod.GetNamespace() + "/" + pod.GetName()
}

func main() {
	var (
		name       = flag.String("name", "csi-pmem", "NRI plugin name")
		idx        = flag.String("idx", "50", "NRI plugin index (two digits: its order among plugins)")
		socket     = flag.String("nri-socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
		kubeletDir = flag.String("kubelet-dir", "/var/lib/kubelet", "kubelet's root directory (mounted at the same path)")
		driver     = flag.String("driver-name", "csi-pmem.io", "the CSI driver name volume.json carries")
	)
	flag.Parse()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if flag.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "csi-pmem-nri: unexpected arguments %q\n", flag.Args())
		os.Exit(2)
	}
	p := &plugin{cfg: inject.Config{KubeletDir: *kubeletDir, DriverName: *driver},
		host: inject.OSHost{}, log: log}
	s, err := stub.New(p, stub.WithPluginName(*name), stub.WithPluginIdx(*idx),
		stub.WithSocketPath(*socket), stub.WithOnClose(func() {
			// The runtime went away (restarted): exit, and kubelet starts us again, which
			// registers the plugin with the new runtime process.
			log.Warn("connection to the runtime closed; exiting")
			os.Exit(1)
		}))
	if err != nil {
		fmt.Fprintf(os.Stderr, "csi-pmem-nri: %v\n", err)
		os.Exit(2)
	}
	log.Info("starting", "socket", *socket, "kubelet_dir", *kubeletDir, "driver", *driver)
	if err := s.Run(context.Background()); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintf(os.Stderr, "csi-pmem-nri: %v\n", err)
		os.Exit(1)
	}
}

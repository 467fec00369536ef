package main

import (
	"context"
	"encoding/json"
	"io"
	"io/fs"
	"log/slog"
	"path/filepath"
	"testing"

	"github.com/containerd/nri/pkg/api"

	"csipmem.local/nri/internal/inject"
)

type host struct {
	mounts map[string]inject.MountInfo
	files  map[string][]byte
}

func (h host) Mount(t string) (inject.MountInfo, bool, error) {
	m, ok := h.mounts[t]
	return m, ok, nil
}

func (h host) ReadFile(n string) ([]byte, error) {
	if b, ok := h.files[n]; ok {
		return b, nil
	}
	return nil, fs.ErrNotExist
}

const tg = "/k/pods/u1/volumes/kubernetes.io~csi/pvc-1/mount"

func newPlugin(t *testing.T, readonly bool) *plugin {
	t.Helper()
	md, _ := json.Marshal(map[string]any{"volume_id": "pvc-1", "driver": "csi-pmem.io",
		"readonly": readonly, "device": "/dev/dax1.0",
		"device_node": map[string]any{"path": "/dev/dax1.0", "type": "c", "major": 250, "minor": 7}})
	h := host{mounts: map[string]inject.MountInfo{tg: {FSType: "tmpfs", Source: "csi-pmem:pvc-1", ReadOnly: true}},
		files: map[string][]byte{filepath.Join(tg, "volume.json"): md}}
	return &plugin{cfg: inject.Config{KubeletDir: "/k", DriverName: "csi-pmem.io"}, host: h,
		log: slog.New(slog.NewTextHandler(io.Discard, nil))}
}

func container(mounts ...*api.Mount) *api.Container {
	return &api.Container{Id: "c1", Name: "app", Mounts: mounts, User: &api.User{Uid: 1000, Gid: 3000}}
}

func TestCreateContainerAdjustment(t *testing.T) {
	for _, ro := range []bool{false, true} {
		p := newPlugin(t, ro)
		adj, upd, err := p.CreateContainer(context.Background(), &api.PodSandbox{Name: "p"},
			container(&api.Mount{Source: tg, Destination: "/pmem"}))
		if err != nil || upd != nil {
			t.Fatalf("err %v upd %v", err, upd)
		}
		devs := adj.GetLinux().GetDevices()
		if len(devs) != 1 || devs[0].Path != "/dev/dax1.0" || devs[0].Major != 250 || devs[0].Minor != 7 ||
			*devs[0].Uid.Get() != 1000 || *devs[0].Gid.Get() != 3000 {
			t.Fatalf("devices %v", devs)
		}
		rules := adj.GetLinux().GetResources().GetDevices()
		if !ro && len(rules) != 0 {
			t.Errorf("writable: extra rules %v", rules)
		}
		if ro && (len(rules) != 1 || rules[0].Allow || rules[0].Access != "w") {
			t.Errorf("read-only: rules %v, want one deny w", rules)
		}
	}
}

func TestCreateContainerWithoutTheMount(t *testing.T) {
	p := newPlugin(t, false)
	adj, upd, err := p.CreateContainer(context.Background(), &api.PodSandbox{},
		container(&api.Mount{Source: "/k/pods/u1/volumes/kubernetes.io~empty-dir/x", Destination: "/x"}))
	if adj != nil || upd != nil || err != nil {
		t.Fatalf("got %v %v %v; want no adjustment", adj, upd, err)
	}
}

func TestSynchronizeChangesNothing(t *testing.T) {
	p := newPlugin(t, false)
	with := container(&api.Mount{Source: tg, Destination: "/pmem"})
	with.Linux = &api.LinuxContainer{Devices: []*api.LinuxDevice{{Path: "/dev/dax1.0"}}}
	without := container(&api.Mount{Source: tg, Destination: "/pmem"})
	upd, err := p.Synchronize(context.Background(), nil, []*api.Container{with, without})
	if err != nil || upd != nil {
		t.Fatalf("Synchronize returned %v, %v; running containers must not be updated", upd, err)
	}
}

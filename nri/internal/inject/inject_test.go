package inject

import (
	"encoding/json"
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/nri/pkg/api"
)

const kubelet = "/var/lib/kubelet"

func target(pod, pv string) string {
	return kubelet + "/pods/" + pod + "/volumes/kubernetes.io~csi/" + pv + "/mount"
}

// fakeHost is a mount table and a file tree in memory.
type fakeHost struct {
	mounts map[string]MountInfo
	files  map[string][]byte
}

func (h *fakeHost) Mount(t string) (MountInfo, bool, error) {
	m, ok := h.mounts[t]
	return m, ok, nil
}

func (h *fakeHost) ReadFile(name string) ([]byte, error) {
	b, ok := h.files[name]
	if !ok {
		return nil, fs.ErrNotExist
	}
	return b, nil
}

// publish adds what the driver leaves at a target: the sealed tmpfs and volume.json.
func (h *fakeHost) publish(t, vid string, readonly bool, node *DeviceNode) {
	h.mounts[t] = MountInfo{FSType: "tmpfs", Source: SourcePrefix + vid, ReadOnly: true}
	md := map[string]any{"volume_id": vid, "device": "/dev/dax0.0", "driver": "csi-pmem.io",
		"readonly": readonly, "socket": "dax.sock"}
	if node != nil {
		md["device_node"] = node
	}
	b, _ := json.Marshal(md)
	h.files[filepath.Join(t, MetadataFile)] = b
}

func newHost() *fakeHost {
	return &fakeHost{mounts: map[string]MountInfo{}, files: map[string][]byte{}}
}

var cfg = Config{KubeletDir: kubelet, DriverName: "csi-pmem.io"}

func dax(minor int64) *DeviceNode {
	return &DeviceNode{Path: "/dev/dax0." + string(rune('0'+minor)), Type: "c", Major: 251, Minor: minor}
}

func ctrWith(uid, gid uint32, mounts ...*api.Mount) *api.Container {
	return &api.Container{Name: "app", Mounts: mounts, User: &api.User{Uid: uid, Gid: gid}}
}

func bind(src, dst string, opts ...string) *api.Mount {
	return &api.Mount{Source: src, Destination: dst, Type: "bind", Options: append([]string{"rbind"}, opts...)}
}

func TestPublicationTarget(t *testing.T) {
	for _, c := range []struct {
		src  string
		want bool
	}{
		{target("uid1", "pvc-1"), true},
		{kubelet + "/pods/uid1/volumes/kubernetes.io~empty-dir/x", false},
		{kubelet + "/pods/uid1/volumes/kubernetes.io~csi/pvc-1/mount/sub", false},
		{kubelet + "/pods/uid1/volumes/kubernetes.io~csi/pvc-1", false},
		{kubelet + "/pods/uid1/volumes/kubernetes.io~csi/../mount", false},
		{kubelet + "/pods/uid1/volumes/kubernetes.io~csi/pvc-1/../pvc-2/mount", false},
		{kubelet + "/pods//volumes/kubernetes.io~csi/pvc-1/mount", false},
		{kubelet + "/plugins/kubernetes.io/csi/csi-pmem.io/x/globalmount", false},
		{"/other/pods/uid1/volumes/kubernetes.io~csi/pvc-1/mount", false},
		{kubelet + "2/pods/uid1/volumes/kubernetes.io~csi/pvc-1/mount", false},
		{"", false},
	} {
		if got := PublicationTarget(kubelet, c.src); got != c.want {
			t.Errorf("PublicationTarget(%q) = %v, want %v", c.src, got, c.want)
		}
	}
	if !PublicationTarget(kubelet+"/", target("u", "p")) {
		t.Error("a kubelet dir with a trailing slash must match")
	}
}

func TestWritablePublicationGetsRWNodeOwnedByTheContainerUser(t *testing.T) {
	h := newHost()
	tg := target("uid1", "pvc-1")
	h.publish(tg, "pvc-1", false, dax(3))
	ins, errs := Decide(h, cfg, ctrWith(1000, 2000, bind(tg, "/pmem"), bind("/etc/hosts", "/etc/hosts")))
	if len(errs) != 0 || len(ins) != 1 {
		t.Fatalf("got %v, %v; want one injection", ins, errs)
	}
	in := ins[0]
	d := in.Device()
	if d.Path != "/dev/dax0.3" || d.Type != "c" || d.Major != 251 || d.Minor != 3 {
		t.Errorf("device %v", d)
	}
	if *d.Uid.Get() != 1000 || *d.Gid.Get() != 2000 || *d.FileMode.Get() != 0o660 {
		t.Errorf("ownership %d:%d mode %o", *d.Uid.Get(), *d.Gid.Get(), *d.FileMode.Get())
	}
	if in.Access() != "rw" || len(in.CgroupRules()) != 0 {
		t.Errorf("access %s, extra rules %v", in.Access(), in.CgroupRules())
	}
}

func TestReadOnlyPublicationDeniesWrite(t *testing.T) {
	for _, c := range []struct {
		name     string
		readonly bool
		opts     []string
	}{
		{"volume.json readonly", true, nil},
		{"read-only bind mount", false, []string{"ro"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHost()
			tg := target("uid1", "pvc-1")
			h.publish(tg, "pvc-1", c.readonly, dax(1))
			ins, errs := Decide(h, cfg, ctrWith(1000, 1000, bind(tg, "/pmem", c.opts...)))
			if len(errs) != 0 || len(ins) != 1 {
				t.Fatalf("got %v, %v", ins, errs)
			}
			rules := ins[0].CgroupRules()
			if ins[0].Access() != "r" || len(rules) != 1 {
				t.Fatalf("access %s rules %v", ins[0].Access(), rules)
			}
			r := rules[0]
			if r.Allow || r.Access != "w" || r.Type != "c" || *r.Major.Get() != 251 || *r.Minor.Get() != 1 {
				t.Errorf("rule %v: want deny c 251:1 w", r)
			}
		})
	}
}

func TestContainerWithoutTheMountGetsNothing(t *testing.T) {
	h := newHost()
	h.publish(target("uid1", "pvc-1"), "pvc-1", false, dax(0))
	// Same pod, another container, no mount of the publication (only the pod's other volumes).
	ins, errs := Decide(h, cfg, ctrWith(1000, 1000,
		bind(kubelet+"/pods/uid1/volumes/kubernetes.io~empty-dir/tmp", "/tmp"),
		bind(kubelet+"/pods/uid1/etc-hosts", "/etc/hosts")))
	if len(ins) != 0 || len(errs) != 0 {
		t.Fatalf("got %v, %v; want nothing", ins, errs)
	}
}

func TestAnnotationsAndLabelsAreIgnored(t *testing.T) {
	h := newHost()
	h.publish(target("uid1", "pvc-1"), "pvc-1", false, dax(0))
	ctr := ctrWith(1000, 1000)
	ctr.Annotations = map[string]string{"csi-pmem.io/device": "/dev/dax0.0",
		"csi-pmem.io/target": target("uid1", "pvc-1")}
	ctr.Labels = map[string]string{"csi-pmem.io/volume": "pvc-1"}
	if ins, errs := Decide(h, cfg, ctr); len(ins) != 0 || len(errs) != 0 {
		t.Fatalf("got %v, %v", ins, errs)
	}
}

func TestNotOurs(t *testing.T) {
	tg := target("uid1", "pvc-1")
	for _, c := range []struct {
		name  string
		setup func(h *fakeHost)
	}{
		{"no mount at the target", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			delete(h.mounts, tg)
		}},
		{"another driver's tmpfs", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			h.mounts[tg] = MountInfo{FSType: "tmpfs", Source: "tmpfs", ReadOnly: true}
		}},
		{"not a tmpfs", func(h *fakeHost) {
			// e.g. another CSI driver's writable volume where a pod wrote a volume.json
			h.publish(tg, "pvc-1", false, dax(0))
			h.mounts[tg] = MountInfo{FSType: "nfs", Source: "csi-pmem:pvc-1", ReadOnly: true}
		}},
		{"feature off in the driver (no device_node)", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, nil)
		}},
		{"another driver name", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			b := h.files[filepath.Join(tg, MetadataFile)]
			h.files[filepath.Join(tg, MetadataFile)] = []byte(strings.Replace(string(b),
				`"csi-pmem.io"`, `"other.io"`, 1))
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHost()
			c.setup(h)
			_, err := Publication(h, cfg, tg)
			if !errors.Is(err, ErrNotOurs) {
				t.Fatalf("err = %v, want ErrNotOurs", err)
			}
			if ins, errs := Decide(h, cfg, ctrWith(1000, 1000, bind(tg, "/pmem"))); len(ins)+len(errs) != 0 {
				t.Fatalf("got %v, %v", ins, errs)
			}
		})
	}
}

func TestRefused(t *testing.T) {
	tg := target("uid1", "pvc-1")
	for _, c := range []struct {
		name, want string
		setup      func(h *fakeHost)
	}{
		{"unsealed tmpfs", "not sealed", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			h.mounts[tg] = MountInfo{FSType: "tmpfs", Source: SourcePrefix + "pvc-1"}
		}},
		{"volume id mismatch", `names volume "pvc-1" but the mount is "pvc-2"`, func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			h.mounts[tg] = MountInfo{FSType: "tmpfs", Source: SourcePrefix + "pvc-2", ReadOnly: true}
		}},
		{"shadowing /dev/null", "refusing device path", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, &DeviceNode{Path: "/dev/null", Type: "c", Major: 1, Minor: 3})
		}},
		{"path escaping /dev", "refusing device path", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, &DeviceNode{Path: "/dev/csi-pmem/../sda", Type: "b", Major: 8})
		}},
		{"bad type", "neither c nor b", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, &DeviceNode{Path: "/dev/dax0.0", Type: "p", Major: 251})
		}},
		{"bad major", "invalid device number", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, &DeviceNode{Path: "/dev/dax0.0", Type: "c"})
		}},
		{"missing volume.json", "reading volume.json", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			delete(h.files, filepath.Join(tg, MetadataFile))
		}},
		{"broken volume.json", "not valid JSON", func(h *fakeHost) {
			h.publish(tg, "pvc-1", false, dax(0))
			h.files[filepath.Join(tg, MetadataFile)] = []byte("{")
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHost()
			c.setup(h)
			ins, errs := Decide(h, cfg, ctrWith(1000, 1000, bind(tg, "/pmem")))
			if len(ins) != 0 || len(errs) != 1 || !strings.Contains(errs[0].Error(), c.want) {
				t.Fatalf("got %v, %v; want one error containing %q", ins, errs, c.want)
			}
		})
	}
}

func TestTwoVolumesAndTheSameOneTwice(t *testing.T) {
	h := newHost()
	t1, t2 := target("uid1", "pvc-1"), target("uid1", "pvc-2")
	h.publish(t1, "pvc-1", false, dax(1))
	h.publish(t2, "pvc-2", false, dax(2))
	ins, errs := Decide(h, cfg, ctrWith(0, 0, bind(t1, "/a"), bind(t2, "/b"), bind(t1, "/c", "ro")))
	if len(errs) != 0 || len(ins) != 2 {
		t.Fatalf("got %v, %v", ins, errs)
	}
	if ins[0].Node.Path != "/dev/dax0.1" || ins[0].Access() != "r" {
		t.Errorf("pvc-1 mounted rw and ro: %s %s, want r (the stricter)", ins[0].Node.Path, ins[0].Access())
	}
	if ins[1].Node.Path != "/dev/dax0.2" || ins[1].Access() != "rw" {
		t.Errorf("pvc-2: %s %s", ins[1].Node.Path, ins[1].Access())
	}
}

func TestEmulatedLoopNode(t *testing.T) {
	h := newHost()
	tg := target("uid1", "pvc-9")
	h.publish(tg, "pvc-9", false, &DeviceNode{Path: "/dev/csi-pmem/pvc-9", Type: "b", Major: 7, Minor: 4})
	ins, errs := Decide(h, cfg, ctrWith(1000, 1000, bind(tg, "/pmem")))
	if len(errs) != 0 || len(ins) != 1 || ins[0].Device().Type != "b" || ins[0].Node.Path != "/dev/csi-pmem/pvc-9" {
		t.Fatalf("got %v, %v", ins, errs)
	}
}

func TestHasDevice(t *testing.T) {
	ctr := &api.Container{Linux: &api.LinuxContainer{Devices: []*api.LinuxDevice{{Path: "/dev/dax0.1"}}}}
	if !HasDevice(ctr, "/dev/dax0.1") || HasDevice(ctr, "/dev/dax0.2") || HasDevice(&api.Container{}, "/dev/dax0.1") {
		t.Error("HasDevice")
	}
}

// Package inject decides which device node a container being created gets.
//
// Why a package of its own: the decision is the security-relevant part of the plugin
// (which container may open which host device, read-write or read-only), so it is pure
// logic over an injected view of the host (Host), tested without a runtime or root.
//
// The rule is keyed on what only the kubelet and the driver control, never on pod
// annotations or labels, which any pod author writes:
//
//  1. the container has a bind mount whose source is a kubelet CSI publication target,
//     <kubelet-dir>/pods/<pod uid>/volumes/kubernetes.io~csi/<pv>/mount;
//  2. that target is, in the host's mount table, a tmpfs whose source is the driver's
//     "csi-pmem:<volume id>" and which is mounted read-only (the driver seals it after
//     writing volume.json, so no pod can have written the file);
//  3. its volume.json names that volume id and this driver, and carries a device_node
//     (the driver writes it only when the feature is on and the volume's device is a
//     device node: a real /dev/daxX.Y, or the emulated back end's loop device).
//
// The container then gets the node at device_node.path, owned by the container's uid
// and gid (mode 0660), with a device-cgroup rule "rw" for a writable publication and
// "r" for a read-only one (volume.json says readonly, or the container's bind mount is
// ro). NRI adds an "rw" allow rule with every device it injects, so a read-only
// publication also gets a "deny w" rule after it: the container's open(O_RDWR) then
// fails with EPERM, exactly like a read-only raw block volume under kubelet.
package inject

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/containerd/nri/pkg/api"
)

// SourcePrefix is the mount source of the driver's publication tmpfs
// (csi_pmem.driver.host.mounts.SOURCE_PREFIX).
const SourcePrefix = "csi-pmem:"

// MetadataFile is the file the driver writes into each publication (csi_pmem.driver.node.devdax).
const MetadataFile = "volume.json"

// DeviceMode is the mode of an injected node. The device cgroup, not the mode, makes a
// read-only publication read-only (see the package comment): with 0440 open(O_RDWR)
// would fail with EACCES before the cgroup is asked, and kubelet's read-only Block
// volumes answer EPERM.
const DeviceMode os.FileMode = 0o660

// Config is what the plugin was started with.
type Config struct {
	// KubeletDir is kubelet's root directory as the plugin sees it (the chart mounts it
	// at the same path as on the host).
	KubeletDir string
	// DriverName is the CSI driver name volume.json must carry.
	DriverName string
}

// MountInfo is what the host's mount table says about a publication target.
type MountInfo struct {
	FSType   string
	Source   string
	ReadOnly bool
}

// Host is the plugin's view of the node: the mount table and the publication files.
type Host interface {
	// Mount returns the mount at exactly target, or ok=false when target is no mount point.
	Mount(target string) (info MountInfo, ok bool, err error)
	// ReadFile reads a file (volume.json of a publication).
	ReadFile(name string) ([]byte, error)
}

// DeviceNode is volume.json's "device_node": the host device and where it goes.
type DeviceNode struct {
	Path  string `json:"path"`  // inside the container
	Type  string `json:"type"`  // "c" (devdax) or "b" (the emulated back end's loop device)
	Major int64  `json:"major"` // of the host device
	Minor int64  `json:"minor"`
}

// Metadata is the part of volume.json the plugin reads.
type Metadata struct {
	VolumeID   string      `json:"volume_id"`
	Device     string      `json:"device"`
	Driver     string      `json:"driver"`
	ReadOnly   bool        `json:"readonly"`
	DeviceNode *DeviceNode `json:"device_node"`
}

// Injection is one device node for one container.
type Injection struct {
	Target   string // the kubelet publication target (the bind mount's source)
	VolumeID string
	HostPath string // the host device, for logs
	Node     DeviceNode
	ReadOnly bool
	UID, GID uint32
}

// Device is the NRI device to add.
func (in Injection) Device() *api.LinuxDevice {
	return &api.LinuxDevice{
		Path: in.Node.Path, Type: in.Node.Type, Major: in.Node.Major, Minor: in.Node.Minor,
		FileMode: api.FileMode(DeviceMode), Uid: api.UInt32(in.UID), Gid: api.UInt32(in.GID),
	}
}

// CgroupRules are the device-cgroup rules beyond the "rw" allow NRI adds with Device():
// none for a writable publication, "deny w" for a read-only one.
func (in Injection) CgroupRules() []*api.LinuxDeviceCgroup {
	if !in.ReadOnly {
		return nil
	}
	return []*api.LinuxDeviceCgroup{{
		Allow: false, Type: in.Node.Type, Major: api.Int64(in.Node.Major),
		Minor: api.Int64(in.Node.Minor), Access: "w",
	}}
}

// Access is the effective device-cgroup access, for logs and tests.
func (in Injection) Access() string {
	if in.ReadOnly {
		return "r"
	}
	return "rw"
}

// Paths a device node may take inside a container: the devdax names, or the emulated
// back end's /dev/csi-pmem/<volume id>. Anything else (/dev/null, /dev/sda, ..) is
// refused, so a node can never shadow a device the runtime sets up.
var containerPath = regexp.MustCompile(`^/dev/(dax[0-9]+\.[0-9]+|csi-pmem/[A-Za-z0-9._-]+)$`)

// PublicationTarget reports whether source is a kubelet CSI publication target below
// kubeletDir: <kubeletDir>/pods/<uid>/volumes/kubernetes.io~csi/<pv>/mount.
func PublicationTarget(kubeletDir, source string) bool {
	if source == "" || path.Clean(source) != source || kubeletDir == "" {
		return false
	}
	rel, ok := strings.CutPrefix(source, path.Clean(kubeletDir)+"/")
	if !ok {
		return false
	}
	parts := strings.Split(rel, "/")
	return len(parts) == 6 && parts[0] == "pods" && parts[1] != "" &&
		parts[2] == "volumes" && parts[3] == "kubernetes.io~csi" && parts[4] != "" &&
		parts[4] != "." && parts[4] != ".." && parts[5] == "mount"
}

// ErrNotOurs marks a mount that is a CSI publication but not one of this driver's
// devdax publications with a device node: nothing to inject, nothing wrong.
var ErrNotOurs = errors.New("not a csi-pmem devdax publication with a device node")

// Publication checks one publication target and reads its device node.
func Publication(h Host, cfg Config, target string) (Metadata, error) {
	mi, ok, err := h.Mount(target)
	if err != nil {
		return Metadata{}, fmt.Errorf("reading the mount table for %s: %w", target, err)
	}
	if !ok || mi.FSType != "tmpfs" || !strings.HasPrefix(mi.Source, SourcePrefix) {
		return Metadata{}, ErrNotOurs
	}
	vid := strings.TrimPrefix(mi.Source, SourcePrefix)
	if !mi.ReadOnly {
		// Being published or repaired by the driver right now, or not sealed: the file
		// could still change. The driver seals before NodePublishVolume returns, and
		// kubelet creates containers only after that.
		return Metadata{}, fmt.Errorf("publication %s of %s is not sealed (read-only)", target, vid)
	}
	raw, err := h.ReadFile(filepath.Join(target, MetadataFile))
	if err != nil {
		return Metadata{}, fmt.Errorf("reading %s of %s: %w", MetadataFile, vid, err)
	}
	var md Metadata
	if err := json.Unmarshal(raw, &md); err != nil {
		return Metadata{}, fmt.Errorf("%s of %s is not valid JSON: %w", MetadataFile, vid, err)
	}
	if md.Driver != cfg.DriverName {
		return Metadata{}, ErrNotOurs
	}
	if md.VolumeID != vid {
		return Metadata{}, fmt.Errorf("%s at %s names volume %q but the mount is %q",
			MetadataFile, target, md.VolumeID, vid)
	}
	if md.DeviceNode == nil {
		return Metadata{}, ErrNotOurs // feature off in the driver, or no device node (file)
	}
	n := md.DeviceNode
	if !containerPath.MatchString(n.Path) {
		return Metadata{}, fmt.Errorf("volume %s: refusing device path %q inside the container "+
			"(only /dev/daxX.Y or /dev/csi-pmem/<name>)", vid, n.Path)
	}
	if n.Type != "c" && n.Type != "b" {
		return Metadata{}, fmt.Errorf("volume %s: device type %q is neither c nor b", vid, n.Type)
	}
	if n.Major <= 0 || n.Minor < 0 {
		return Metadata{}, fmt.Errorf("volume %s: invalid device number %d:%d", vid, n.Major, n.Minor)
	}
	return md, nil
}

// Decide returns the device nodes a container gets, and the problems with mounts that
// looked like this driver's publications but could not be used (logged by the caller;
// the container is still created, without that device, and can use dax.sock).
func Decide(h Host, cfg Config, ctr *api.Container) ([]Injection, []error) {
	var out []Injection
	var errs []error
	seen := map[string]bool{}
	for _, m := range ctr.GetMounts() {
		src := m.GetSource()
		if !PublicationTarget(cfg.KubeletDir, src) {
			continue
		}
		md, err := Publication(h, cfg, src)
		if errors.Is(err, ErrNotOurs) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		ro := md.ReadOnly || mountReadOnly(m)
		if prev, dup := seen[md.DeviceNode.Path]; dup {
			// The same publication mounted twice (two mount paths): one node, read-only
			// if any of the mounts is.
			if ro && !prev {
				for i := range out {
					if out[i].Node.Path == md.DeviceNode.Path {
						out[i].ReadOnly = true
					}
				}
				seen[md.DeviceNode.Path] = true
			}
			continue
		}
		seen[md.DeviceNode.Path] = ro
		in := Injection{Target: src, VolumeID: md.VolumeID, HostPath: md.Device,
			Node: *md.DeviceNode, ReadOnly: ro}
		if u := ctr.GetUser(); u != nil {
			in.UID, in.GID = u.GetUid(), u.GetGid()
		}
		out = append(out, in)
	}
	return out, errs
}

func mountReadOnly(m *api.Mount) bool {
	for _, o := range m.GetOptions() {
		if o == "ro" {
			return true
		}
	}
	return false
}

// HasDevice reports whether a container already has a device node at p.
func HasDevice(ctr *api.Container, p string) bool {
	for _, d := range ctr.GetLinux().GetDevices() {
		if d.GetPath() == p {
			return true
		}
	}
	return false
}

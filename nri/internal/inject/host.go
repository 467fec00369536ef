package inject

import (
	"os"
	"path/filepath"
	"strings"

	"github.com/moby/sys/mountinfo"
)

// OSHost is the real Host: this process's mount table (the plugin sees kubelet's
// directory at its host path with HostToContainer propagation) and files.
type OSHost struct{}

// Mount returns the last (topmost) mount at exactly target.
func (OSHost) Mount(target string) (MountInfo, bool, error) {
	target = filepath.Clean(target)
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(target))
	if err != nil {
		return MountInfo{}, false, err
	}
	if len(ms) == 0 {
		return MountInfo{}, false, nil
	}
	m := ms[len(ms)-1]
	// The driver seals with "mount -o remount,ro", which makes the superblock read-only;
	// this process's copy of the mount (propagated from the driver's namespace while it
	// was still rw) keeps its own per-mount flags, so the super options count too.
	ro := hasOpt(m.Options, "ro") || hasOpt(m.VFSOptions, "ro")
	return MountInfo{FSType: m.FSType, Source: m.Source, ReadOnly: ro}, true, nil
}

// ReadFile reads a file.
func (OSHost) ReadFile(name string) ([]byte, error) { return os.ReadFile(name) }

func hasOpt(opts, want string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == want {
			return true
		}
	}
	return false
}

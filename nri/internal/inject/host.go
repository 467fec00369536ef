package inject

import (
	"os"
	"path/filepath"

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
	ro := false
	for _, o := range splitOpts(m.Options) {
		if o == "ro" {
			ro = true
		}
	}
	return MountInfo{FSType: m.FSType, Source: m.Source, ReadOnly: ro}, true, nil
}

// ReadFile reads a file.
func (OSHost) ReadFile(name string) ([]byte, error) { return os.ReadFile(name) }

func splitOpts(s string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(s); i++ {
		if i == len(s) || s[i] == ',' {
			out = append(out, s[start:i])
			start = i + 1
		}
	}
	return out
}

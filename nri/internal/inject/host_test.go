package inject

import "testing"

func TestOSHostMountTable(t *testing.T) {
	mi, ok, err := OSHost{}.Mount("/proc")
	if err != nil || !ok || mi.FSType != "proc" {
		t.Fatalf("/proc: %+v %v %v", mi, ok, err)
	}
	if _, ok, err := (OSHost{}).Mount("/proc/self"); err != nil || ok {
		t.Fatalf("/proc/self is no mount point: %v %v", ok, err)
	}
	if !hasOpt("rw,nosuid,ro", "ro") || hasOpt("rw,nosuid,relatime", "ro") {
		t.Error("hasOpt")
	}
}

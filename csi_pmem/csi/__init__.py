"""Generated CSI v1 stubs (from proto/csi.proto). Never edit by hand: `make proto`."""

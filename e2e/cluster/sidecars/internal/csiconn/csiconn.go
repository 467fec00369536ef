// Package csiconn dials a CSI driver's unix socket and waits until it answers, the way
// both sidecars need it.
package csiconn

import (
	"context"
	"fmt"
	"log"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// Target turns "/csi/csi.sock" or "unix:///csi/csi.sock" into a gRPC target.
func Target(addr string) string {
	if strings.HasPrefix(addr, "unix://") || strings.HasPrefix(addr, "dns:") {
		return addr
	}
	if strings.HasPrefix(addr, "/") {
		return "unix://" + addr
	}
	return addr
}

// Dial returns a lazily connecting client conn; calls block until the socket exists.
func Dial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(Target(addr), grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// DriverName asks GetPluginInfo until the driver answers (it may start after us).
func DriverName(conn *grpc.ClientConn, timeout time.Duration) string {
	id := csi.NewIdentityClient(conn)
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		resp, err := id.GetPluginInfo(ctx, &csi.GetPluginInfoRequest{}, grpc.WaitForReady(true))
		cancel()
		if err == nil && resp.GetName() != "" {
			return resp.GetName()
		}
		if attempt%10 == 0 {
			log.Printf("waiting for the CSI driver: %v", errOrEmpty(err))
		}
		time.Sleep(time.Second)
	}
}

func errOrEmpty(err error) error {
	if err == nil {
		return fmt.Errorf("GetPluginInfo returned an empty name")
	}
	return err
}

// Command csi-node-driver-registrar: a stand-in for kubernetes-csi/node-driver-registrar
// with the same flags and behaviour that kubelet relies on. It asks the driver for its
// name, serves kubelet's plugin-registration API on
// <plugin-registration-path>/<driver>-reg.sock, and exits when kubelet reports that
// registration failed (so the container restarts, as upstream does).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"csipmem.local/e2e/sidecars/internal/csiconn"
)

type server struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	registered     atomic.Bool
}

func (s *server) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	log.Printf("kubelet asked for plugin info: %s at %s", s.name, s.endpoint)
	return &registerapi.PluginInfo{Type: registerapi.CSIPlugin, Name: s.name,
		Endpoint: s.endpoint, SupportedVersions: []string{"1.0.0"}}, nil
}

func (s *server) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if !st.PluginRegistered {
		log.Printf("kubelet rejected the registration: %s; exiting", st.Error)
		os.Exit(1)
	}
	log.Printf("registered with kubelet")
	s.registered.Store(true)
	return &registerapi.RegistrationStatusResponse{}, nil
}

func main() {
	csiAddress := flag.String("csi-address", "/run/csi/socket", "CSI driver socket inside this container")
	kubeletPath := flag.String("kubelet-registration-path", "", "the driver socket's path on the host (what kubelet dials)")
	regPath := flag.String("plugin-registration-path", "/registration", "kubelet's plugins_registry directory inside this container")
	timeout := flag.Duration("timeout", time.Second, "timeout of each CSI call")
	healthPort := flag.Int("health-port", 0, "serve /healthz on this port (0: off)")
	httpEndpoint := flag.String("http-endpoint", "", "serve /healthz on host:port (overrides --health-port)")
	flag.Int("v", 0, "log verbosity (accepted for compatibility)")
	flag.String("mode", "registration", "accepted for compatibility")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	if *kubeletPath == "" {
		log.Fatal("--kubelet-registration-path is required")
	}

	conn, err := csiconn.Dial(*csiAddress)
	if err != nil {
		log.Fatalf("dial %s: %v", *csiAddress, err)
	}
	name := csiconn.DriverName(conn, *timeout)
	conn.Close()
	sock := filepath.Join(*regPath, name+"-reg.sock")
	if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
		log.Fatalf("remove stale %s: %v", sock, err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listen on %s: %v", sock, err)
	}
	s := &server{name: name, endpoint: *kubeletPath}
	g := grpc.NewServer()
	registerapi.RegisterRegistrationServer(g, s)
	log.Printf("serving plugin registration for %s on %s", name, sock)

	addr := *httpEndpoint
	if addr == "" && *healthPort > 0 {
		addr = fmt.Sprintf(":%d", *healthPort)
	}
	if addr != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
			if _, err := os.Stat(sock); err != nil {
				http.Error(w, "registration socket missing: "+err.Error(), http.StatusInternalServerError)
				return
			}
			if !s.registered.Load() {
				http.Error(w, "not yet registered with kubelet", http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		go func() { log.Fatal(http.ListenAndServe(addr, mux)) }()
	}

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-sig
		os.Remove(sock)
		os.Exit(0)
	}()
	if err := g.Serve(lis); err != nil {
		log.Fatalf("serve: %v", err)
	}
}

// Command livenessprobe: a stand-in for kubernetes-csi/livenessprobe with the same
// flags. GET /healthz calls the driver's CSI Probe and answers 200 only when the driver
// is ready, so kubelet's liveness probe on this port restarts a wedged driver.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net/http"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"csipmem.local/e2e/sidecars/internal/csiconn"
)

func main() {
	csiAddress := flag.String("csi-address", "/run/csi/socket", "CSI driver socket inside this container")
	healthPort := flag.Int("health-port", 9808, "port of /healthz")
	httpEndpoint := flag.String("http-endpoint", "", "host:port of /healthz (overrides --health-port)")
	probeTimeout := flag.Duration("probe-timeout", time.Second, "timeout of one Probe call")
	flag.String("metrics-address", "", "accepted for compatibility")
	flag.String("metrics-path", "/metrics", "accepted for compatibility")
	flag.Int("v", 0, "log verbosity (accepted for compatibility)")
	flag.Parse()
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)

	conn, err := csiconn.Dial(*csiAddress)
	if err != nil {
		log.Fatalf("dial %s: %v", *csiAddress, err)
	}
	id := csi.NewIdentityClient(conn)
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), *probeTimeout)
		defer cancel()
		resp, err := id.Probe(ctx, &csi.ProbeRequest{})
		if err != nil {
			log.Printf("health check failed: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if rd := resp.GetReady(); rd != nil && !rd.GetValue() {
			http.Error(w, "driver responded but is not ready", http.StatusInternalServerError)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	addr := *httpEndpoint
	if addr == "" {
		addr = fmt.Sprintf(":%d", *healthPort)
	}
	log.Printf("serving /healthz on %s for %s", addr, *csiAddress)
	log.Fatal(http.ListenAndServe(addr, mux))
}

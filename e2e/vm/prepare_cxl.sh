#!/usr/bin/env bash
# Prepare the VM tier's CXL boots: QEMU 10, kernel 6.12 and a `cxl` tool of version 77+.
#
# Why newer packages than the rest of the tier: CXL volatile memory needs QEMU 8.0+
# (volatile-memdev=), kernel 6.3+ (DEV_DAX_CXL, create_ram_region) and cxl 77+ (76.1
# fails "unable to determine region size"); bookworm has QEMU 7.2, kernel 6.1 and
# ndctl 76.1. bookworm-backports has QEMU 10.0 (it runs on bookworm's libraries) and
# kernel 6.12. No suite of bookworm has cxl 77+: trixie's cxl 81 is taken as Debian
# built it, with trixie's glibc and the few libraries it links, and run through
# trixie's own loader (ld-linux-x86-64.so.2 --library-path). Rebuilding ndctl from its
# source package would need a compiler, meson and a dozen -dev packages installed on
# the host, and minutes of a 2-core machine, for the same binary. The guest's ndctl and
# daxctl stay the host's 76.1 (what the driver runs in every other boot).
#
# Nothing touches the host's apt: a private apt configuration (its own sources list
# naming bookworm-backports and trixie, its own state and cache directories) runs
# `apt-get update` and `apt-get download`, and `dpkg -x` unpacks the packages under
# ${CSI_PMEM_CACHE:-~/.cache/csi-pmem}/vm-cxl/pkgs-<hash of the package versions>/.
# Versions are each suite's candidates when the cache is cold (the kernel: what
# bookworm-backports' linux-image-amd64 depends on); a warm cache (vm-cxl/current) is
# used as it is, without the network, like prepare.sh's kernel. The 6.12 initramfs is
# built by prepare.sh itself (same init, same busybox, plus the CXL modules), cached
# under vm-cxl/initramfs/.
#
# Usage: e2e/vm/prepare_cxl.sh     prints "pkg=<dir>" and "kernel=<dir>" (last 2 lines)
#   <pkg>/root                     the unpacked packages
#   <pkg>/bin/cxl                  trixie's cxl through trixie's loader
#   <pkg>/bin/qemu-system-x86_64   QEMU 10 with its own firmware and module dirs
#   <pkg>/manifest                 package=version, one a line
# Env:   CSI_PMEM_CACHE            cache root (default ~/.cache/csi-pmem)
#        CSI_PMEM_VM_CXL_REFRESH=1 resolve the suites' candidates again (network)
#        CXL_DEBIAN_MIRROR         (default http://deb.debian.org/debian)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
root_dir="$cache/vm-cxl"
mirror="${CXL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# suite:package
PACKAGES=(
    bookworm-backports:qemu-system-x86 bookworm-backports:qemu-system-common
    bookworm-backports:qemu-system-data bookworm-backports:qemu-system-gui
    bookworm-backports:seabios bookworm-backports:linux-image-amd64
    # trixie: cxl and what it links that bookworm's libraries cannot serve (glibc 2.38+)
    trixie:cxl trixie:libcxl1 trixie:libdaxctl1 trixie:libc6 trixie:libjson-c5
    trixie:libkmod2 trixie:libtraceevent1 trixie:libtracefs1 trixie:libudev1 trixie:libuuid1
)
# The 6.12 guest's CXL stack, in load order (the initramfs has insmod, no modprobe):
# the port driver before cxl_acpi so that the root ports enumerate; kmem so that 6.12
# brings the ram region's dax device up as system-ram, as a real node would.
CXL_MODULES="cxl_core cxl_port cxl_acpi cxl_pci cxl_mem cxl_pmem dax_cxl kmem"

say() { echo "vm-prepare-cxl: $*" >&2; }

start=$(date +%s)
apt_dir="$root_dir/apt"
apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State=$apt_dir/state" -o "Dir::Cache=$apt_dir/cache"
          -o "Dir::State::status=/var/lib/dpkg/status")
pkg=""
if [[ -z "${CSI_PMEM_VM_CXL_REFRESH:-}" && -f "$root_dir/current/ready" ]]; then
    pkg="$(readlink -f "$root_dir/current")"
    say "cached: $pkg"
fi
resolved=()
if [[ -z "$pkg" ]]; then
    mkdir -p "$apt_dir"/{state/lists/partial,cache/archives/partial,debs}
    printf 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] %s %s main\n' \
        "$mirror" bookworm-backports "$mirror" trixie >"$apt_dir/sources.list"
    say "apt-get update (private: bookworm-backports, trixie)"
    apt-get "${apt_opts[@]}" update >&2
    candidate() {  # suite package -> that suite's version
        apt-cache "${apt_opts[@]}" madison "$2" | awk -F'|' -v s=" $1/" \
            'index($3, s) { gsub(/ /, "", $2); print $2; exit }'
    }
    for sp in "${PACKAGES[@]}"; do
        suite="${sp%%:*}" name="${sp#*:}"
        if [[ "$name" == linux-image-amd64 ]]; then  # the versioned image it points at
            v="$(candidate "$suite" "$name")"
            name="$(apt-cache "${apt_opts[@]}" show "$name=$v" \
                | sed -n 's/^Depends: \(linux-image-[0-9][^ ]*\) .*/\1/p' | head -n1)"
        fi
        v="$(candidate "$suite" "$name")"
        [[ -n "$name" && -n "$v" ]] || { say "error: $suite has no ${name:-kernel}"; exit 1; }
        resolved+=("$name=$v")
    done
    key="$(printf '%s\n' "${resolved[@]}" | sha256sum | cut -c1-12)"
    pkg="$root_dir/pkgs-$key"
fi
if [[ ! -f "$pkg/ready" ]]; then
    rm -f "$apt_dir"/debs/*.deb
    say "downloading ${resolved[*]}"
    # As root apt-get download warns that _apt cannot write here: harmless.
    (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download "${resolved[@]}" 2>&1 \
        | grep -v "Download is performed unsandboxed" >&2)
    tmp="$(mktemp -d "$root_dir/build.XXXXXX")"
    # Everything is written below the cache: never a path of the host's own (an empty
    # directory variable once put a wrapper over /usr/bin/qemu-system-x86_64).
    [[ -n "$root_dir" && "$tmp" == "$root_dir"/build.* && "$pkg" == "$root_dir"/pkgs-* ]] \
        || { say "error: refusing to build outside $root_dir ($tmp, $pkg)"; exit 1; }
    trap 'rm -rf "$tmp"' EXIT
    for deb in "$apt_dir"/debs/*.deb; do
        if [[ "$(basename "$deb")" == linux-image-* ]]; then
            mv "$deb" "$tmp/kernel.deb"  # prepare.sh unpacks it for the initramfs
        else
            dpkg -x "$deb" "$tmp/root"
        fi
    done
    rm -f "$apt_dir"/debs/*.deb
    mkdir -p "$tmp/bin"
    r="$pkg/root" lib="$pkg/root/usr/lib/x86_64-linux-gnu"
    cat >"$tmp/bin/cxl" <<EOF
#!/bin/sh
# trixie's cxl (ndctl 81) with trixie's glibc, through trixie's loader
exec "$lib/ld-linux-x86-64.so.2" --library-path "$lib" "$r/usr/bin/cxl" "\$@"
EOF
    cat >"$tmp/bin/qemu-system-x86_64" <<EOF
#!/bin/sh
# bookworm-backports' QEMU 10 with its own firmware (seabios 1.16.3) and modules
QEMU_MODULE_DIR="$lib/qemu" exec "$r/usr/bin/qemu-system-x86_64" \\
    -L "$r/usr/share/qemu" -L "$r/usr/share/seabios" "\$@"
EOF
    chmod 0755 "$tmp/bin/cxl" "$tmp/bin/qemu-system-x86_64"
    printf '%s\n' "${resolved[@]}" >"$tmp/manifest"
    touch "$tmp/ready"
    rm -rf "$pkg"
    mv "$tmp" "$pkg"
    trap - EXIT
    say "unpacked into $pkg in $(( $(date +%s) - start )) s ($(du -sh "$pkg" | cut -f1))"
fi
ln -sfn "$(basename "$pkg")" "$root_dir/current"
find "$root_dir" -mindepth 1 -maxdepth 1 -type d -name 'pkgs-*' ! -name "$(basename "$pkg")" \
    -exec rm -rf {} +  # older keys are superseded
"$pkg/bin/cxl" --version >/dev/null || { say "error: $pkg/bin/cxl does not run"; exit 1; }
"$pkg/bin/qemu-system-x86_64" --version >/dev/null \
    || { say "error: QEMU 10 does not run on this host's libraries"; exit 1; }

kdir="$(CSI_PMEM_VM_CACHE_ROOT="$root_dir/initramfs" CSI_PMEM_VM_KERNEL_DEB="$pkg/kernel.deb" \
    CSI_PMEM_VM_EXTRA_MODULES="$CXL_MODULES" bash "$here/prepare.sh" | tail -n1)"
echo "pkg=$pkg"
echo "kernel=$kdir"

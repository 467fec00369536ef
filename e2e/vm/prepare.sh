#!/usr/bin/env bash
# Prepare the VM tier: host packages, Debian's kernel, and a small initramfs.
#
# Why no image: the guest boots Debian's stock kernel and runs the host's own root
# file system read-only over 9p (e2e/vm/init.sh), so the project, its venv, ndctl and
# csi-sanity are the very files the host has. What has to be built is only the
# initramfs that loads the modules and mounts that share. It and the kernel are cached
# outside the repository under ${CSI_PMEM_CACHE:-~/.cache/csi-pmem}/vm/<key>, where the
# key names the kernel package version, the busybox version and a hash of the init
# script and module list; a cold run differs from a warm one only by that directory.
#
# Usage: e2e/vm/prepare.sh            prints the cache directory (last line of stdout)
# Env:   CSI_PMEM_CACHE                cache root (default ~/.cache/csi-pmem)
#        CSI_PMEM_VM_KERNEL_PKG        kernel package (default: what linux-image-amd64
#                                      depends on in the apt lists)
#        CSI_PMEM_VM_KERNEL_DEB        a kernel .deb already downloaded (prepare_cxl.sh:
#                                      bookworm-backports' 6.12), used instead
#        CSI_PMEM_VM_EXTRA_MODULES     more modules, in load order (the CXL stack)
#        CSI_PMEM_VM_CACHE_ROOT        cache directory (default <cache root>/vm)
# Needs root for apt-get (only when a package is missing) and the network to Debian's
# mirror only on a cold cache.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cache_root="${CSI_PMEM_VM_CACHE_ROOT:-${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}/vm}"
# Host packages: QEMU, the guest-side tools (the guest runs the host's ndctl, and the
# driver runs the host's blkid, mkfs.ext4 and mkfs.xfs for fsdax volumes), busybox for
# the initramfs, kmod for depmod.
HOST_PACKAGES=(qemu-system-x86 ndctl daxctl e2fsprogs xfsprogs util-linux busybox-static kmod)
# What the guest needs as modules on Debian's kernel (the rest is built in); their
# dependencies come from modules.dep. Debian's 6.1 builds ext4 and xfs as modules
# (CONFIG_EXT4_FS=m, CONFIG_XFS_FS=m; FS_DAX is built in). modules.dep brings jbd2,
# mbcache, crc16 and libcrc32c, but not the crc32c implementation that ext4/jbd2
# (metadata_csum) and libcrc32c ask the crypto API for at load or mount time: that is
# only a softdep ("crypto-crc32c"), and the initramfs has no modprobe to resolve it, so
# crc32c_generic is listed before them. (crc32c-intel needs SSE4.2, which the qemu64
# CPU model lacks.) loop (CONFIG_BLK_DEV_LOOP=m): a read-only fsdax Block publication
# is a read-only loop device over the namespace. dax_hmem (CONFIG_DEV_DAX_HMEM=m) makes
# the hmem configuration's soft-reserved range a dax region; elsewhere it finds none and
# does nothing. kmem is not loaded: nothing onlines that region as system RAM.
MODULES=(virtio_pci 9pnet_virtio 9p overlay libnvdimm nfit nd_btt nd_pmem dax_pmem device_dax
         dax_hmem crc32c_generic ext4 xfs loop)
# shellcheck disable=SC2206  # a space-separated list of module names
MODULES+=(${CSI_PMEM_VM_EXTRA_MODULES:-})

say() { echo "vm-prepare: $*" >&2; }

missing=()
for p in "${HOST_PACKAGES[@]}"; do
    dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null | grep -qx installed || missing+=("$p")
done
if ((${#missing[@]})); then
    say "installing ${missing[*]}"
    if [[ $(id -u) != 0 ]]; then
        say "error: need root to install ${missing[*]} (or install them yourself)"; exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends "${missing[@]}" >&2 || {
        apt-get update >&2 && apt-get install -y --no-install-recommends "${missing[@]}" >&2; }
fi

# Which kernel: the package linux-image-amd64 points at (from the local apt lists,
# no network), e.g. linux-image-6.1.0-57-amd64 (= 6.1.192-3).
kpkg="${CSI_PMEM_VM_KERNEL_PKG:-}"
kdeb="${CSI_PMEM_VM_KERNEL_DEB:-}"
[[ -z "$kdeb" ]] || kpkg="$(dpkg-deb -f "$kdeb" Package)"
if [[ -z "$kpkg" ]]; then
    kpkg="$(apt-cache depends linux-image-amd64 2>/dev/null \
        | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)"
fi
[[ -n "$kpkg" ]] || { say "error: cannot resolve linux-image-amd64 (run apt-get update)"; exit 1; }
kver_pkg="$(apt-cache policy "$kpkg" | sed -n 's/^ *Candidate: //p')"
[[ -z "$kdeb" ]] || kver_pkg="$(dpkg-deb -f "$kdeb" Version)"
[[ -n "$kver_pkg" && "$kver_pkg" != "(none)" ]] || { say "error: no candidate for $kpkg"; exit 1; }
kname="${kpkg#linux-image-}"  # the uname -r of that kernel, e.g. 6.1.0-57-amd64
bb_ver="$(dpkg-query -W -f='${Version}' busybox-static)"
recipe_hash="$( (cat "$here/init.sh" "${BASH_SOURCE[0]}"; echo "${MODULES[*]}") | sha256sum | cut -c1-12)"
key="linux-${kver_pkg}_busybox-${bb_ver}_init-${recipe_hash}"
key="${key//[:~]/_}"
dir="${cache_root}/${key}"

if [[ -f "$dir/ready" ]]; then
    say "cached: $dir"
    echo "$dir"
    exit 0
fi

start=$(date +%s)
mkdir -p "$cache_root/debs"
deb="$(ls "$cache_root/debs/${kpkg}_"*"_amd64.deb" 2>/dev/null | grep -F "_${kver_pkg//:/%3a}_" | head -n1 || true)"
[[ -z "$kdeb" ]] || deb="$kdeb"
if [[ -z "$deb" ]]; then
    say "downloading $kpkg $kver_pkg"
    # apt-get download writes into the current directory; as root it warns that the
    # _apt user cannot write there, which is harmless.
    (cd "$cache_root/debs" && apt-get download "${kpkg}=${kver_pkg}" 2>&1 \
        | grep -v "Download is performed unsandboxed" >&2)
    deb="$(ls "$cache_root/debs/${kpkg}_"*"_amd64.deb" | head -n1)"
fi

tmp="$(mktemp -d "${cache_root}/build.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
say "extracting $(basename "$deb")"
dpkg-deb -x "$deb" "$tmp/kernel"
# The package ships no modules.dep (its postinst runs depmod): make one.
depmod -b "$tmp/kernel" "$kname"
mdir="$tmp/kernel/lib/modules/$kname"

# Resolve each module and its dependencies (depth first: dependencies load first).
declare -A seen=()
order=()
path_of() {  # module name -> path relative to $mdir, from modules.dep
    local name="${1//-/_}" alt="${1//_/-}"
    grep -E "/(${name}|${alt})\.ko(\.[a-z]+)?:" "$mdir/modules.dep" | head -n1 | cut -d: -f1
}
add_path() {
    local rel="$1" dep
    [[ -n "${seen[$rel]:-}" ]] && return 0
    seen[$rel]=1
    for dep in $(grep -E "^${rel//./\\.}:" "$mdir/modules.dep" | cut -d: -f2); do
        add_path "$dep"
    done
    order+=("$rel")
}
for m in "${MODULES[@]}"; do
    rel="$(path_of "$m" || true)"  # no match (built in) fails the pipe
    if [[ -z "$rel" ]]; then
        if grep -qE "/${m}\.ko" "$mdir/modules.builtin"; then continue; fi
        say "error: module $m is neither in modules.dep nor built in"; exit 1
    fi
    add_path "$rel"
done

root="$tmp/initramfs"
mkdir -p "$root"/{bin,sbin,modules,proc,sys,dev,out,lower,rw,newroot}
cp /bin/busybox "$root/bin/busybox"
for applet in $("$root/bin/busybox" --list); do
    [[ "$applet" == busybox ]] || ln -sf busybox "$root/bin/$applet"
done
: >"$root/modules/load.order"
for rel in "${order[@]}"; do
    base="$(basename "$rel")"
    case "$rel" in
        *.ko.xz) xz -dc "$mdir/$rel" >"$root/modules/${base%.xz}"; base="${base%.xz}" ;;
        *.ko.zst) zstd -qdc "$mdir/$rel" >"$root/modules/${base%.zst}"; base="${base%.zst}" ;;
        *) cp "$mdir/$rel" "$root/modules/$base" ;;
    esac
    echo "$base" >>"$root/modules/load.order"
done
install -m 0755 "$here/init.sh" "$root/init"

out="$tmp/out"
mkdir -p "$out"
cp "$tmp/kernel/boot/vmlinuz-$kname" "$out/vmlinuz"
(cd "$root" && find . | LC_ALL=C sort | busybox cpio -o -H newc -R 0:0 2>/dev/null) \
    | gzip -1 >"$out/initrd.img"
{
    echo "kernel_package=$kpkg"
    echo "kernel_version=$kver_pkg"
    echo "uname_r=$kname"
    echo "busybox_version=$bb_ver"
    echo "recipe_hash=$recipe_hash"
    echo "modules=$(tr '\n' ' ' <"$root/modules/load.order")"
} >"$out/manifest"
touch "$out/ready"
rm -rf "$dir"
mv "$out" "$dir"
# Older keys of this cache are superseded; keep the downloaded .deb of this kernel only.
find "$cache_root" -mindepth 1 -maxdepth 1 -type d -name 'linux-*' ! -name "$key" \
    -exec rm -rf {} +
find "$cache_root/debs" -name '*.deb' ! -name "$(basename "$deb")" -delete
say "built $dir in $(( $(date +%s) - start )) s ($(du -sh "$dir" | cut -f1))"
echo "$dir"

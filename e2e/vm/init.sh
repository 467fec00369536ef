#!/bin/sh
# /init of the VM tier's initramfs (busybox sh; copied in by e2e/vm/prepare.sh).
#
# Why this shape: the guest runs the host's own root file system (project, venv,
# ndctl, csi-sanity) read-only over 9p instead of a disk image, so nothing has to be
# built or kept in sync. Writes land in a tmpfs overlay that vanishes at power-off;
# results go to a second, writable 9p share of a host directory.
#
# Contract with e2e/vm/run.sh:
#   9p tag "hostroot": the host's /, read-only.
#   9p tag "vmout":    a host directory, writable. It holds cmd.sh (what to run, as
#                      root, inside the chroot, with the share at /run/vm-out) and
#                      receives rc (cmd.sh's exit status), init.log and whatever
#                      cmd.sh writes there.
# Kernel command line: csi_pmem.labels=0 skips the label initialisation.
# Every line the init prints starts with "vm-init:" so the host can grep the console.

PATH=/bin:/sbin
export PATH

log() { echo "vm-init: $*"; [ -d /out ] && echo "$(uptime_s) $*" >>/out/init.log; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
die() {
    log "FATAL: $*"
    [ -d /out ] && echo 255 >/out/rc
    sync
    poweroff -f
    sleep 10
}

mkdir -p /proc /sys /dev /out /lower /rw /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
# Loopback for the driver's metrics endpoint; there is no other network.
ip link set lo up

# Modules in dependency order (prepare.sh resolved modules.dep when it built this).
while read -r ko; do
    [ -n "$ko" ] || continue
    insmod "/modules/$ko" 2>/tmp.insmod || {
        grep -q "File exists" /tmp.insmod || echo "vm-init: insmod $ko: $(cat /tmp.insmod)"
    }
done </modules/load.order

# csi_pmem.msize=N: the CXL boots' QEMU 10 with kernel 6.12 stops its virtio queue
# ("virtio: bogus descriptor or out of resources") on a 512 KiB message, which needs
# more descriptors than the queue's 128; they pass 262144.
msize=524288
for arg in $(cat /proc/cmdline); do
    case "$arg" in csi_pmem.msize=*) msize="${arg#csi_pmem.msize=}" ;; esac
done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=$msize vmout /out \
    || die "cannot mount the vmout share"
: >/out/init.log
log "modules loaded at $(uptime_s) s"

mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=$msize,cache=loose hostroot /lower \
    || die "cannot mount the hostroot share"
mount -t tmpfs -o mode=0755 rw /rw
mkdir -p /rw/upper /rw/work
if mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
        2>/tmp.ovl; then
    log "root: overlay of the host root (9p, ro) and a tmpfs"
else
    log "overlay failed ($(cat /tmp.ovl)); root is the read-only 9p share"
    mount --bind /lower /newroot
fi

# The guest's own kernel interfaces over the host's (which 9p would show otherwise).
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
# The checkout may live below one of the directories that get a fresh tmpfs (a CI clone
# in /tmp): hold it aside and put it back on top, so cmd.sh finds the repository.
repo=""
[ -f /out/repo ] && repo=$(cat /out/repo)
if [ -n "$repo" ]; then
    mkdir -p /keep-repo
    mount --bind "/newroot$repo" /keep-repo || die "cannot find the repository $repo"
fi
for d in /run /tmp /var/tmp; do
    mount -t tmpfs -o mode=1777 tmpfs "/newroot$d" || die "cannot mount tmpfs on $d"
done
if [ -n "$repo" ]; then
    if [ ! -d "/newroot$repo/e2e" ]; then
        mkdir -p "/newroot$repo"
        mount --bind /keep-repo "/newroot$repo" || die "cannot restore $repo"
    fi
    umount /keep-repo
fi
chmod 0755 /newroot/run
# cgroup v2 only: tests/cgroups.py denies devices with an eBPF program there, as runc
# does on v2 hosts. (The host is v1/hybrid: the guest is not.)
mount -t tmpfs -o mode=0755 cgroup-root /newroot/sys/fs/cgroup 2>/dev/null
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup || log "no cgroup2"
mkdir -p /newroot/run/vm-out
mount --bind /out /newroot/run/vm-out

in_root() { chroot /newroot /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root LC_ALL=C.UTF-8 TMPDIR=/tmp "$@"; }

if ! grep -q "csi_pmem.labels=0" /proc/cmdline; then
    # Fresh emulated NVDIMMs are label-less and cannot be sub-divided (docs/design.md §4).
    in_root ndctl disable-region all >>/out/init.log 2>&1
    in_root ndctl init-labels -f all >>/out/init.log 2>&1 || log "init-labels failed"
    in_root ndctl enable-region all >>/out/init.log 2>&1 || log "enable-region failed"
    log "labels initialised at $(uptime_s) s"
fi

[ -f /out/cmd.sh ] || die "no cmd.sh in the vmout share"
log "running cmd.sh at $(uptime_s) s"
in_root /bin/sh /run/vm-out/cmd.sh </dev/console >/dev/console 2>&1
rc=$?
echo "$rc" >/out/rc
log "cmd.sh exited $rc at $(uptime_s) s"
sync
umount /newroot/run/vm-out 2>/dev/null
umount /out 2>/dev/null
poweroff -f
sleep 10

#!/usr/bin/env bash
# `make e2e-vm`: the driver against the real kernel (libnvdimm, device-dax) and the real
# ndctl, in QEMU under TCG, with emulated NVDIMMs on two NUMA nodes.
#
# Boots Debian's kernel once per configuration (e2e/vm/prepare.sh caches it and the
# initramfs), runs e2e/vm/test_guest.py inside the guest with the host's own Python
# environment (the host's / is the guest's read-only root over 9p), collects JUnit XML,
# JSON results, the driver logs and the console under $E2E_VM_OUT, prints a summary and
# exits non-zero when anything failed.
#
# Configurations:
#   main        two NUMA nodes, one 1 GiB NVDIMM each (align=16M backends: 16 MiB-aligned
#               regions of 1008 MiB), label-size=128K. csi-sanity and every scenario.
#   misaligned  the same with align=2M backends: QEMU packs the DIMMs at 2 MiB
#               granularity, so region1 starts at 0x13fe00000, which is not 16 MiB
#               aligned, and ndctl refuses every namespace there.
#   crash       two boots on the same NVDIMM backing files (6 GiB on node 0, 1 GiB on
#               node 1): "crash" runs e2e/vm/crash_prepare.py, which stops weight stages
#               at every step of the commit protocol and asks for the power cut
#               (kill-now in the share), and QEMU is SIGKILLed; "crash-check" boots the
#               same files with their labels and runs e2e/vm/test_guest_weights.py.
#   hmem        soft-reserved memory on today's kernel: the main layout with 3 GiB of RAM
#               and memmap=512M%1G-1+0xefffffff, which makes guest RAM 1G-1.5G (node 0)
#               a soft-reserved range that dax_hmem turns into dax0.0 (devdax on 6.1),
#               beside the NVDIMMs; the driver runs --backend ndctl,daxctl and
#               e2e/vm/test_guest_dax.py (csi-sanity on devdax-volatile, the workflows,
#               create/delete timings on both kinds). Node 0's RAM is a file in /dev/shm
#               so that its bytes outlive the boot, as DRAM may across a warm reboot.
#   hmem-reboot a second boot of the same machine (the NVDIMM files with their labels,
#               node 0's RAM file, the driver's state dir, which the hmem boot kept in
#               the results share): the volatile volume the hmem boot left must come
#               back zeroed under its id, and be staged again.
#   cxl         CXL on QEMU 10, kernel 6.12 and trixie's cxl 81
#               (e2e/vm/prepare_cxl.sh fetches them with a private apt configuration):
#               q35 with cxl=on, one pxb-cxl host bridge and root port per device, a
#               persistent type-3 device (512 MiB file + 256 KiB LSA file) and a
#               volatile one (512 MiB, a file in /dev/shm so that its bytes outlive the
#               boot), a 4 GiB fixed memory window each; e2e/vm/test_guest_cxl.py makes
#               a pmem and a ram region and runs the driver with --backend ndctl,daxctl.
#   cxl-reboot  the same machine again (pmem and LSA files, the ram file, the state dir):
#               the driver (--dax-setup=reconfigure) creates both regions again; the pmem
#               region finds its namespace and data in the LSA; the volatile volume
#               comes back zeroed and is staged again.
#
# Usage: e2e/vm/run.sh [--config main|misaligned|crash|hmem|cxl|all] [--cmd 'shell command'] [-- PYTEST ARGS]
#   --cmd runs that command in the guest instead of the test suite (for debugging;
#         the guest sees the host's files, except /tmp, /run and /var/tmp: tmpfs there).
#   PYTEST ARGS go to pytest in the guest, e.g. -- -k erase -x
# Env:   E2E_VM_OUT      results directory (default: <repo>/build/e2e-vm; each
#                        configuration's subdirectory is replaced by the run)
#        E2E_VM_TIMEOUT  seconds per boot before QEMU is killed (default 1800: the main
#                        configuration takes 15-20 min under TCG on 2 loaded cores)
#        E2E_VM_SMP / E2E_VM_MEM_GIB   guest CPUs (2, split over the two NUMA nodes)
#                        and RAM in GiB (2, half per node)
#        E2E_VM_HMEM_MEM_GIB  the hmem boots' RAM in GiB (3, half per node; 512 MiB
#                        of node 0 is the soft-reserved range, so at least 2)
#        CSI_SANITY_BIN  csi-sanity binary (default: the cached build of
#                        scripts/install-csi-sanity.sh); csi-sanity is skipped, with the
#                        reason in the results, when it is absent, unless
#                        CSI_SANITY_REQUIRED=1
#        E2E_VM_SANITY_FLAVOURS  tests/sanity/*.yaml files csi-sanity runs with in the
#                        guest, comma separated, or "all" (default: all but
#                        devdax-numa0, which repeats devdax-2mi on this machine; those
#                        whose smallest volume does not fit a 1 GiB NVDIMM are skipped)
#        E2E_VM_CPU      QEMU -cpu model (default Nehalem, see below)
#        CSI_PMEM_CACHE  cache root (default ~/.cache/csi-pmem)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${repo}/.venv/bin/python"
all_configs=(main misaligned crash hmem cxl)
configs=("${all_configs[@]}")
known_configs=("${all_configs[@]}")
guest_cmd=""
pytest_args=()
while (($#)); do
    case "$1" in
        --config) shift; [[ "$1" == all ]] && configs=("${all_configs[@]}") || configs=("$1") ;;
        --config=*) v="${1#*=}"; [[ "$v" == all ]] && configs=("${all_configs[@]}") || configs=("$v") ;;
        --cmd) shift; guest_cmd="$1" ;;
        --) shift; pytest_args=("$@"); break ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "e2e-vm: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
for c in "${configs[@]}"; do
    [[ " ${known_configs[*]} " == *" $c "* ]] || { echo "e2e-vm: unknown config $c" >&2; exit 2; }
done

out_root="${E2E_VM_OUT:-${repo}/build/e2e-vm}"
timeout_s="${E2E_VM_TIMEOUT:-1800}"
smp="${E2E_VM_SMP:-2}"
mem_gib="${E2E_VM_MEM_GIB:-2}"
# hmem: 512 MiB of soft-reserved memory at 1 GiB, inside node 0's 1.5 GiB, leaving the
# guest the 2.5 GiB of ordinary RAM the main configuration's 2 GiB are measured against.
hmem_mem_gib="${E2E_VM_HMEM_MEM_GIB:-3}"
hmem_memmap="512M%1G-1+0xefffffff"
# Nehalem (SSE4.2, no AVX, no ERMS) rather than max: glibc then picks SSE2-class string
# functions, which TCG runs about 10x faster than the AVX2/ERMS ones (64 MiB memset
# 0.015 s vs 0.19 s; the erase of every volume is such a memset), and numpy, which the
# weights tests load, finds the x86-64-v2 baseline it needs (qemu64 is SIGILL there).
cpu="${E2E_VM_CPU:-Nehalem}"
cache="${CSI_PMEM_CACHE:-${HOME}/.cache/csi-pmem}"
sanity_bin="${CSI_SANITY_BIN:-${cache}/csi-sanity-v5.4.0/bin/csi-sanity}"

t0=$(date +%s.%N)
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
say() { echo "e2e-vm [$(elapsed) s]: $*"; }

[[ -x "$py" ]] || { echo "e2e-vm: no venv at $repo/.venv (run make setup)" >&2; exit 2; }
[[ $(id -u) == 0 ]] || { echo "e2e-vm: run as root (the guest runs as root on the host's files; QEMU 9p passthrough)" >&2; exit 2; }

kdir="$(bash "${repo}/e2e/vm/prepare.sh" | tail -n1)"
say "kernel and initramfs: $kdir"
cxl_pkg="" cxl_kdir=""
if [[ " ${configs[*]} " == *" cxl "* ]]; then
    cxl_prep="$(bash "${repo}/e2e/vm/prepare_cxl.sh")"
    cxl_pkg="$(sed -n 's/^pkg=//p' <<<"$cxl_prep")"
    cxl_kdir="$(sed -n 's/^kernel=//p' <<<"$cxl_prep")"
    say "CXL: QEMU 10 and cxl 81 in $cxl_pkg, kernel 6.12 and initramfs in $cxl_kdir"
fi
# The guest's root is read-only: give it bytecode for the project so it does not
# recompile on every start (a few seconds each under TCG).
"$py" -m compileall -q -j0 "$repo/csi_pmem" "$repo/tests" "$repo/e2e" >/dev/null || true

mkdir -p "$out_root"
for c in "${configs[@]}"; do rm -rf "${out_root:?}/$c"; done
[[ " ${configs[*]} " == *" crash "* ]] && rm -rf "${out_root:?}/crash-check"
[[ " ${configs[*]} " == *" hmem "* ]] && rm -rf "${out_root:?}/hmem-reboot"
[[ " ${configs[*]} " == *" cxl "* ]] && rm -rf "${out_root:?}/cxl-reboot"
rm -f "$out_root/summary.json"
work="$(mktemp -d "${TMPDIR:-/tmp}/csi-pmem-e2e-vm.XXXXXX")"
shm_work=""  # hmem: node 0's RAM file, kept from the hmem boot to hmem-reboot
qemu_pid=""
cleanup() {
    if [[ -n "$qemu_pid" ]] && kill -0 "$qemu_pid" 2>/dev/null; then kill "$qemu_pid" 2>/dev/null || true; fi
    [[ -n "${watch_pid:-}" ]] && kill "$watch_pid" 2>/dev/null || true
    rm -rf "$work"
    # An if, not `[[ ]] && rm`: under set -e a false test as the trap's last command
    # made every run exit 1 after a passing summary.
    if [[ -n "$shm_work" ]]; then rm -rf "$shm_work"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Writes the guest's command; the guest runs it with /bin/sh as root in the chroot.
write_cmd() {
    local config="$1" dir="$2" suite="e2e/vm/test_guest.py" cmd="$guest_cmd"
    [[ "$config" == crash-check ]] && suite="e2e/vm/test_guest_weights.py"
    [[ "$config" == hmem || "$config" == hmem-reboot ]] && suite="e2e/vm/test_guest_dax.py"
    [[ "$config" == cxl || "$config" == cxl-reboot ]] && suite="e2e/vm/test_guest_cxl.py"
    [[ "$config" == crash && -z "$cmd" ]] && cmd="$(printf '%q ' "$py" e2e/vm/crash_prepare.py)"
    {
        echo "# generated by e2e/vm/run.sh"
        echo "cd '$repo' || exit 99"
        echo "export E2E_VM_CONFIG='$config' E2E_VM_OUT=/run/vm-out PYTHONDONTWRITEBYTECODE=1"
        echo "export CSI_SANITY_BIN='$sanity_bin' CSI_SANITY_REQUIRED='${CSI_SANITY_REQUIRED:-}'"
        echo "export E2E_VM_SANITY_FLAVOURS='${E2E_VM_SANITY_FLAVOURS:-}'"
        [[ -z "$cxl_pkg" ]] || echo "export E2E_VM_CXL='$cxl_pkg/bin/cxl'"
        if [[ -n "$cmd" ]]; then
            printf '%s\n' "$cmd"
        else
            printf '%q ' "$py" -m pytest -p no:cacheprovider -v -rA --tb=short \
                -o "junit_suite_name=e2e-vm-${config}" -o junit_family=xunit1 \
                --junitxml="/run/vm-out/junit.xml" "$suite" \
                ${pytest_args[@]+"${pytest_args[@]}"}
            echo
        fi
        echo 'rc=$?'
        echo 'dmesg >/run/vm-out/dmesg.txt 2>&1'
        echo 'exit $rc'
    } >"$dir/cmd.sh"
    printf '%s\n' "$repo" >"$dir/repo"  # init.sh keeps it visible under the guest's tmpfs
}

boot() {
    local config="$1" dir="$out_root/$1" nvalign=16M nv0=1G nv1=1G images="$1"
    local append="console=ttyS0 panic=-1 quiet mitigations=off csi_pmem.vm=1"
    local mem="$mem_gib" ram0="memory-backend-ram,id=ram0"
    mkdir -p "$dir"
    write_cmd "$config" "$dir"
    case "$config" in
        misaligned) nvalign=2M ;;
        # 6 GiB on node 0 for a 1 GiB-aligned namespace; the stages cut by the power
        # cut live on node 1's 1 GiB.
        crash) nv0=6G ;;
        crash-check)
            nv0=6G images=crash append+=" csi_pmem.labels=0"
            # What the crash boot planned and the models it staged (deterministic,
            # but the check must compare with exactly what was staged).
            for f in crash-plan.json model model-big; do
                [[ -e "$out_root/crash/$f" ]] && cp -a "$out_root/crash/$f" "$dir/"
            done ;;
        hmem|hmem-reboot)
            mem="$hmem_mem_gib" images=hmem append+=" memmap=$hmem_memmap"
            [[ -n "$shm_work" ]] || shm_work="$(mktemp -d /dev/shm/csi-pmem-e2e-vm.XXXXXX)"
            [[ "$config" == hmem ]] && rm -f "$shm_work/ram0"
            ram0="memory-backend-file,id=ram0,share=on,mem-path=$shm_work/ram0"
            if [[ "$config" == hmem-reboot ]]; then
                append+=" csi_pmem.labels=0"
                # The node's disk: the driver's state dir as the hmem boot left it, and
                # what that boot planned and staged.
                for f in state reboot-plan.json model; do
                    [[ -e "$out_root/hmem/$f" ]] && cp -a "$out_root/hmem/$f" "$dir/"
                done
            fi ;;
    esac
    # Sparse backing files: the guest's writes (and erases) fill them in. crash-check
    # boots the crash boot's files as they were at the power cut, hmem-reboot the hmem
    # boot's.
    if [[ "$config" != crash-check && "$config" != hmem-reboot ]]; then
        rm -f "$work/$images-nv0.img" "$work/$images-nv1.img"
        truncate -s "$nv0" "$work/$images-nv0.img"
        truncate -s "$nv1" "$work/$images-nv1.img"
    fi
    local -a qemu=(
        qemu-system-x86_64 -machine pc,nvdimm=on -accel tcg -cpu "$cpu"
        -smp "$smp,sockets=$smp,cores=1,threads=1" -m "${mem}G,slots=4,maxmem=16G"
        -object "$ram0,size=$(( mem * 512 ))M"
        -object "memory-backend-ram,id=ram1,size=$(( mem * 512 ))M"
        -numa node,nodeid=0,cpus=0,memdev=ram0
        -numa node,nodeid=1,cpus=1-$(( smp - 1 )),memdev=ram1
        -object "memory-backend-file,id=nv0,share=on,mem-path=$work/$images-nv0.img,size=$nv0,align=$nvalign"
        -device nvdimm,id=nvdimm0,memdev=nv0,label-size=128K,node=0
        -object "memory-backend-file,id=nv1,share=on,mem-path=$work/$images-nv1.img,size=$nv1,align=$nvalign"
        -device nvdimm,id=nvdimm1,memdev=nv1,label-size=128K,node=1
        -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap
        -virtfs "local,path=$dir,mount_tag=vmout,security_model=none,multidevs=remap"
        -kernel "$kdir/vmlinuz" -initrd "$kdir/initrd.img"
        -append "$append"
        -nodefaults -no-user-config -display none -serial stdio -monitor none -no-reboot
    )
    [[ -f /usr/share/qemu/qboot.rom ]] && qemu+=(-bios /usr/share/qemu/qboot.rom)
    [[ "$config" == cxl || "$config" == cxl-reboot ]] && cxl_qemu "$config" "$dir" "$append"
    printf '%q ' "${qemu[@]}" >"$dir/qemu.cmdline"; echo >>"$dir/qemu.cmdline"
    local what="NVDIMMs $nv0 + $nv1, backends align=$nvalign"
    [[ "$config" == cxl* ]] && what="QEMU 10, kernel 6.12, CXL type-3 pmem 512M + ram 512M"
    say "booting '$config' ($what; console: $dir/console.log)"
    local start; start=$(date +%s.%N)
    # The console streams to the terminal and the log; the guest's exit status comes
    # back through the share (rc), QEMU's own status only says it powered off.
    timeout -k 10 "$timeout_s" "${qemu[@]}" </dev/null >"$dir/console.log" 2>&1 &
    qemu_pid=$!
    watch_pid=""
    if [[ "$config" == crash ]]; then
        # The power cut: SIGKILL QEMU itself (timeout's child) once the guest asks.
        ( while kill -0 "$qemu_pid" 2>/dev/null; do
              if [[ -f "$dir/kill-now" ]]; then
                  pkill -KILL -P "$qemu_pid" qemu-system && date +%s.%N >"$dir/killed"
                  break
              fi
              sleep 0.2
          done ) &
        watch_pid=$!
    fi
    tail -n +1 -F --pid="$qemu_pid" "$dir/console.log" 2>/dev/null | sed -u 's/^/  | /' || true
    local qrc=0
    wait "$qemu_pid" || qrc=$?
    qemu_pid=""
    if [[ -n "$watch_pid" ]]; then wait "$watch_pid" 2>/dev/null || true; watch_pid=""; fi
    awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f\n", b-a}' >"$dir/boot_seconds"
    if [[ "$config" == crash && -f "$dir/killed" ]]; then
        echo 0 >"$dir/rc"  # powered off by the host, as planned
    elif [[ ! -f "$dir/rc" ]]; then
        say "'$config': the guest wrote no exit status (QEMU exit $qrc; timeout ${timeout_s}s?)"
        echo 254 >"$dir/rc"
    fi
    say "'$config' done in $(cat "$dir/boot_seconds") s, guest exit $(cat "$dir/rc")"
    [[ "$config" == crash || "$config" == hmem ]] || rm -f "$work/$images-nv0.img" "$work/$images-nv1.img"
}

# The CXL boots' machine (replaces boot()'s qemu array): QEMU 10's q35 with cxl=on, one
# host bridge (pxb-cxl) and root port per type-3 device (two root ports under one
# bridge fail region commit), a 4 GiB fixed memory window per bridge. -cpu ...,
# hypervisor=off: 6.12 refuses to commit a region ("Failed to synchronize CPU cache
# state") when the CPU says it runs under a hypervisor. No NVDIMMs: the CXL pmem
# region is the ndctl pool. cxl-reboot boots the same pmem, LSA and ram files. sn=: a
# serial number, as real devices have; without one (QEMU's default) the pmem region's
# interleave-set cookie is fletcher64(DPA 0, serial 0) = 0, and after a reboot 6.12
# refuses the namespace labels ("invalid interleave-set-cookie"): nothing comes back.
cxl_qemu() {
    local config="$1" dir="$2" append="$3"
    [[ -n "$shm_work" ]] || shm_work="$(mktemp -d /dev/shm/csi-pmem-e2e-vm.XXXXXX)"
    append+=" csi_pmem.msize=262144"  # see init.sh
    if [[ "$config" == cxl ]]; then
        rm -f "$work/cxl-pmem.img" "$work/cxl-lsa.img" "$shm_work/cxl-ram"
        truncate -s 512M "$work/cxl-pmem.img"
        truncate -s 256K "$work/cxl-lsa.img"
    else
        append+=" csi_pmem.labels=0"
        for f in state reboot-plan.json model; do
            [[ -e "$out_root/cxl/$f" ]] && cp -a "$out_root/cxl/$f" "$dir/"
        done
    fi
    qemu=(
        "$cxl_pkg/bin/qemu-system-x86_64" -M q35,cxl=on -accel tcg
        -cpu "${E2E_VM_CPU:-Nehalem},hypervisor=off"
        -smp "$smp" -m "${mem_gib}G,maxmem=8G,slots=8"
        -object "memory-backend-file,id=cxl-pmem0,share=on,mem-path=$work/cxl-pmem.img,size=512M"
        -object "memory-backend-file,id=cxl-lsa0,share=on,mem-path=$work/cxl-lsa.img,size=256K"
        -object "memory-backend-file,id=cxl-ram1,share=on,mem-path=$shm_work/cxl-ram,size=512M"
        -device pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1
        -device cxl-rp,port=0,bus=cxl.1,id=rp1,chassis=0,slot=2
        -device cxl-type3,bus=rp1,persistent-memdev=cxl-pmem0,lsa=cxl-lsa0,id=cxl-pmem0,sn=0x5ca1ab1e
        -device pxb-cxl,bus_nr=222,bus=pcie.0,id=cxl.2
        -device cxl-rp,port=0,bus=cxl.2,id=rp2,chassis=0,slot=3
        -device cxl-type3,bus=rp2,volatile-memdev=cxl-ram1,id=cxl-vmem0,sn=0x5ca1ab1f
        -M cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G,cxl-fmw.1.targets.0=cxl.2,cxl-fmw.1.size=4G
        # On pcie.0 by name: -virtfs would plug into the last bus, a pxb-cxl.
        -fsdev local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap
        -device virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot,bus=pcie.0
        -fsdev "local,id=vmout,path=$dir,security_model=none,multidevs=remap"
        -device virtio-9p-pci,fsdev=vmout,mount_tag=vmout,bus=pcie.0
        -kernel "$cxl_kdir/vmlinuz" -initrd "$cxl_kdir/initrd.img"
        -append "$append"
        -nodefaults -no-user-config -display none -serial stdio -monitor none -no-reboot
    )
}

# The host's side of the staging benchmark the guest runs on devdax: the same script
# on a file on tmpfs, which is what the emulated back end's volumes are.
if [[ -z "$guest_cmd" && " ${configs[*]} " == *" main "* ]]; then
    bench_vol="$(mktemp -u /dev/shm/csi-pmem-e2e-vm-bench.XXXXXX)"
    "$py" "$repo/benchmarks/bench_staging.py" "$bench_vol" --volume-mib 160 --size-mib 48 \
        --json "$out_root/host-staging-bench.json" >/dev/null \
        || say "host staging benchmark failed (the summary shows no ratio)"
    rm -f "$bench_vol"
fi

boots=()
for c in "${configs[@]}"; do
    boots+=("$c")
    [[ "$c" == crash ]] && boots+=(crash-check)
    [[ "$c" == hmem ]] && boots+=(hmem-reboot)
    [[ "$c" == cxl ]] && boots+=(cxl-reboot)
done
for c in "${boots[@]}"; do
    boot "$c"
done
rm -f "$work"/crash-nv*.img "$work"/hmem-nv*.img "$work"/cxl-*.img
if [[ -n "$shm_work" ]]; then rm -rf "$shm_work"; shm_work=""; fi

status=0
if [[ -z "$guest_cmd" ]]; then
    "$py" "$repo/e2e/vm/summary.py" "$out_root" --configs "$(IFS=,; echo "${boots[*]}")" \
        --total-seconds "$(elapsed)" || status=$?
else
    for c in "${boots[@]}"; do [[ "$(cat "$out_root/$c/rc")" == 0 ]] || status=1; done
fi
say "results in $out_root (total $(elapsed) s)"
exit "$status"

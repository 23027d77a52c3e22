# Shell helpers for guest scenarios: init.sh sources this file, runs e2e_setup, then sources
# the run's scenario.sh, all under `set -eu`: the first failing step fails the run.
#
# Results go to "$E2E_WORK/<name>"; the host test reads and asserts them. Every helper that
# takes a device takes its bare name (nbd0, dm-0, vda), never a path.

# QEMU's user network: each connection to 10.0.2.100:PORT is relayed to the host's
# server-PORT.sock (harness.qemu_argv); 10.0.2.2 is QEMU's own gateway.
E2E_HOST=10.0.2.100

# The initramfs loaded every module (guestkernel.MODULES); only the network is left.
e2e_setup() {
    e2e_network_up
}

e2e_network_up() {
    ip link set lo up
    ip addr add 10.0.2.15/24 dev eth0
    ip link set eth0 up
    ip route add default via 10.0.2.2
}

# nbd_attach DEV PORT [EXPORT]: attach /dev/DEV read-only with 4 KiB blocks, so that one
# 4 KiB direct read is one NBD request.
nbd_attach() {
    if [ -n "${3-}" ]; then
        nbd-client -N "$3" "$E2E_HOST" "$2" "/dev/$1" -b 4096 -readonly
    else
        nbd-client "$E2E_HOST" "$2" "/dev/$1" -b 4096 -readonly
    fi
    [ "$(cat "/sys/block/$1/size")" -gt 0 ] || { echo "$1: size 0 after attach" >&2; return 1; }
}

nbd_detach() {
    nbd-client -d "/dev/$1"
}

# verity_open NAME DATA_DEV HASH_DEV ROOT_HASH: the kernel's own dm-verity on the guest's
# disks; prints the dm-N name of the new device.
verity_open() {
    veritysetup open "/dev/$2" "$1" "/dev/$3" "$4"
    dm_name "$1"
}

# dm_name NAME: the kernel's dm-N name of a device-mapper device (without udev, /dev/mapper
# holds plain nodes, not links to it).
dm_name() {
    for d in /sys/block/dm-*; do
        if [ "$(cat "$d/dm/name")" = "$1" ]; then
            echo "${d##*/}"
            return 0
        fi
    done
    echo "no device-mapper device named $1" >&2
    return 1
}

verity_close() {
    veritysetup close "$1"
}

# dev_sha256 DEV OUT: SHA-256 of the whole device (buffered, large reads) into $E2E_WORK/OUT.
dev_sha256() {
    # No pipe: dash has no pipefail, and a failed read must fail the run.
    sum=$(sha256sum <"/dev/$1")
    echo "${sum%% *}" >"$E2E_WORK/$2"
}

# dev_sha256_direct DEV OUT BS: SHA-256 of the whole device read with direct I/O in BS
# reads (each one request to the device, not served by the page cache).
dev_sha256_direct() {
    rm -f "$TMPDIR/dd.status"
    # dash has no pipefail: dd's own status goes through a file.
    sum=$( { dd if="/dev/$1" bs="$3" iflag=direct status=none; echo $? >"$TMPDIR/dd.status"; } |
        sha256sum)
    [ "$(cat "$TMPDIR/dd.status")" = 0 ] || { echo "$1: direct read failed" >&2; return 1; }
    echo "${sum%% *}" >"$E2E_WORK/$2"
}

# dev_size DEV OUT: the device's size in bytes.
dev_size() {
    blockdev --getsize64 "/dev/$1" >"$E2E_WORK/$2"
}

# block_scan DEV OUT [CHUNK]: read every 4 KiB block with direct I/O (in CHUNK-byte reads
# first, 1 MiB by default; each block of a failed chunk on its own); OUT lists the failing
# blocks as "INDEX ERRNO" lines. CHUNK 4096: every block on its own, in order.
block_scan() {
    python3 "$E2E_GUEST_DIR/blockscan.py" "/dev/$1" "$E2E_WORK/$2" --chunk "${3:-1048576}"
}

# read_block DEV INDEX: one direct 4 KiB read of block INDEX; prints "ok" or "failed".
read_block() {
    if dd if="/dev/$1" of=/dev/null bs=4096 skip="$2" count=1 iflag=direct 2>/dev/null; then
        echo ok
    else
        echo failed
    fi
}

# fio_read DEV RW BS OUT: a short psync direct read job; JSON results in $E2E_WORK/OUT.
fio_read() {
    fio --name="$1-$2-$3" --filename="/dev/$1" --readonly --ioengine=psync --direct=1 \
        --rw="$2" --bs="$3" --numjobs="${E2E_FIO_JOBS:-2}" --group_reporting \
        --runtime="${E2E_FIO_SECONDS:-3}" --time_based --output-format=json \
        --output="$E2E_WORK/$4"
}

# host_signal NAME [TEXT]: tell the host test that a step is done (LiveGuest.wait_for).
host_signal() {
    printf '%s' "${2-}" >"$E2E_WORK/sync/.$1.tmp"
    mv "$E2E_WORK/sync/.$1.tmp" "$E2E_WORK/sync/$1"
}

# host_wait NAME [SECONDS]: wait until the host test signals NAME (LiveGuest.signal).
host_wait() {
    tries=$(( ${2:-60} * 10 ))
    while [ ! -e "$E2E_WORK/sync/$1" ]; do
        tries=$((tries - 1))
        [ "$tries" -gt 0 ] || { echo "host never signalled $1" >&2; return 1; }
        sleep 0.1
    done
}

# verity_open_fec NAME DATA_DEV HASH_DEV FEC_DEV ROOTS ROOT_HASH: the kernel's dm-verity
# with Reed-Solomon parity on FEC_DEV (veritysetup open --fec-device --fec-roots); prints
# the dm-N name of the new device.
verity_open_fec() {
    veritysetup open "/dev/$2" "$1" "/dev/$3" "$6" --fec-device "/dev/$4" --fec-roots "$5"
    dm_name "$1"
}

# block_scan_sha DEV OUT [CHUNK]: what block_scan does (OUT.failing: "INDEX ERRNO" lines,
# same reads in the same order), and the SHA-256 of everything read, each failing block
# counted as 4096 zero bytes (OUT.sha256): the bytes that did read are checked too.
block_scan_sha() {
    python3 - "/dev/$1" "$E2E_WORK/$2" "${3:-1048576}" <<'PY'
import hashlib, mmap, os, sys
device, out, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
bs = 4096
big = mmap.mmap(-1, chunk)  # O_DIRECT wants an aligned buffer
one = memoryview(big)[:bs]
sha, failures = hashlib.sha256(), []
fd = os.open(device, os.O_RDONLY | os.O_DIRECT)
blocks = os.lseek(fd, 0, os.SEEK_END) // bs
for first in range(0, blocks, chunk // bs):
    count = min(chunk // bs, blocks - first)
    if count > 1:
        view = memoryview(big)[:count * bs]
        try:
            if os.preadv(fd, [view], first * bs) == count * bs:
                sha.update(view)
                continue
        except OSError:
            pass
    for index in range(first, first + count):
        try:
            got = os.preadv(fd, [one], index * bs)
        except OSError as e:
            failures.append((index, e.errno))
            sha.update(bytes(bs))
            continue
        if got != bs:
            failures.append((index, 0))
            sha.update(bytes(bs))
        else:
            sha.update(one)
os.close(fd)
with open(out + ".failing", "w") as f:
    f.writelines(f"{index} {errno}\n" for index, errno in failures)
with open(out + ".sha256", "w") as f:
    f.write(sha.hexdigest() + "\n")
print(f"block_scan_sha {device}: {len(failures)} failing blocks")
PY
}

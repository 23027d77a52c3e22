#!/bin/sh
# PID 1 of the QEMU guest after its initramfs (see tests/e2e/harness.py).
#
# The initramfs loaded the modules, mounted the host's / read-only over 9p and moved
# /proc, /sys and /dev onto it, then chrooted here, so this runs the host's own
# nbd-client, veritysetup, dmsetup, fio and python3. The host passes E2E_WORK on the kernel
# command line (the kernel hands unknown key=value words to init as environment
# variables): a host folder shared read-write over 9p, mounted at the same path. It holds
# scenario.sh (the checks of one run), and receives the results and exit-status. PID 1 must
# never exit (the kernel would panic), so nothing here uses `set -e`; the scenario runs in
# a child shell instead.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# Where the helpers live on the host: this script's own folder.
E2E_GUEST_DIR=${0%/*}
export E2E_GUEST_DIR E2E_WORK

read -r uptime _ </proc/uptime
echo "e2e-guest: init up after $uptime s, kernel $(uname -r)"
# /run must be writable: veritysetup keeps its lock files there. No tmpfs on /tmp: the
# host's /tmp holds the work folder.
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/tmp
TMPDIR=/run/tmp
export TMPDIR
# No cache: the host's files in sync/ must be seen as soon as the host writes them.
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none work "$E2E_WORK"

# The scenario's exit status, written last: its absence on the host means the guest died.
/bin/sh -eu -c '. "$E2E_GUEST_DIR/lib.sh"; e2e_setup; . "$E2E_WORK/scenario.sh"'
status=$?
echo "e2e-guest: scenario exit status $status"
echo "$status" >"$E2E_WORK/exit-status"
sync
umount "$E2E_WORK"
# Power off at once: QEMU exits (-no-reboot), and the host's `timeout` is never needed.
busybox poweroff -f
while :; do sleep 60; done

#!/bin/sh
# PID 1 of the user-mode-linux guest (see docs in tests/e2e/harness.py).
#
# The guest's root is the host's / through hostfs, read-only, so it runs the host's own
# nbd-client, veritysetup, fio and python3. The host passes E2E_WORK on the kernel command
# line (the kernel hands unknown key=value words to init as environment variables): a host
# folder that the guest mounts read-write at the same path. It holds scenario.sh (the checks
# of one run), and receives the results and exit-status. PID 1 must never exit (the kernel
# would panic), so nothing here uses `set -e`; the scenario runs in a child shell instead.
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
# Where the helpers live on the host: this script's own folder.
E2E_GUEST_DIR=${0%/*}
export E2E_GUEST_DIR E2E_WORK

mount -t proc proc /proc
mount -t sysfs sysfs /sys
# CONFIG_DEVTMPFS_MOUNT usually mounted it already; the guest needs its own device nodes,
# never the host's /dev seen through hostfs.
grep -q ' /dev devtmpfs ' /proc/mounts || mount -t devtmpfs devtmpfs /dev
# /run must be writable: veritysetup keeps its lock files there. No tmpfs on /tmp: the
# host's /tmp may hold this checkout and the work folder.
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/tmp
TMPDIR=/run/tmp
export TMPDIR
mount -t hostfs none "$E2E_WORK" -o "$E2E_WORK"

echo "e2e-guest: init up, kernel $(uname -r)"
# The scenario's exit status, written last: its absence on the host means the guest died.
/bin/sh -eu -c '. "$E2E_GUEST_DIR/lib.sh"; e2e_setup; . "$E2E_WORK/scenario.sh"'
status=$?
echo "e2e-guest: scenario exit status $status"
echo "$status" >"$E2E_WORK/exit-status"
sync
umount "$E2E_WORK"
# Power off at once; UML then exits and the host's `timeout` is never needed.
echo o >/proc/sysrq-trigger
busybox poweroff -f
while :; do sleep 60; done

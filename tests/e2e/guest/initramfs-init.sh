#!/bin/busybox sh
# /init of the guest's initramfs: load the modules, mount the host's root read-only over
# 9p, and hand over to guest/init.sh there (E2E_INIT on the kernel command line).
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t devtmpfs devtmpfs /dev
/bin/busybox mount -t sysfs sysfs /sys
while read -r module params; do
    # shellcheck disable=SC2086  # params are words
    /bin/busybox insmod "/modules/$module" $params ||
        echo "e2e-initramfs: insmod $module failed"
done </modules/load
# 9p over virtio: the host's / (read-only, tag hostroot). msize: larger messages, fewer
# round trips for every file the guest runs.
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot ||
    { echo "e2e-initramfs: cannot mount the host's root"; /bin/busybox poweroff -f; }
for fs in proc sys dev; do
    /bin/busybox mount --move "/$fs" "/newroot/$fs"
done
exec /bin/busybox chroot /newroot "$E2E_INIT"

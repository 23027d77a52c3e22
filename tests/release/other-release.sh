#!/usr/bin/env bash
# `make test-other-release`: `make test` of a fresh clone of HEAD on the other supported
# Debian release (13 on a Debian 12 host, 12 on a Debian 13 host), in a chroot.
#
# The tree is made once per machine with debootstrap (minbase plus git, make,
# ca-certificates, python3, sudo: what a new user starts from) into
# /var/cache/nbd-verity/release/CODENAME (NBD_VERITY_RELEASE_CACHE to move it), with the
# host's apt sources for that release and the host's apt settings (Acquire::...), so apt
# inside reaches the same registry. Everything `make setup` installs inside stays in the
# tree: later runs find it there, and `make setup` only checks. The e2e kernel cache is the
# tree's own /var/cache/nbd-verity/e2e, so the guests boot the other release's kernel.
#
# Each run: /proc, /sys, /dev (with /dev/pts and /dev/shm) bound in, tmpfs on /tmp and
# /run, a fresh `git clone` of HEAD in /work/nbd-verity, `make test` there. Whatever happens
# (failure, signal), the trap ends every process whose root is the tree, by pid, and
# unmounts what this run mounted. Exit status: that of `make test` inside.
#
# With arguments, they go to pytest instead of `make test` (after `make setup`), for a
# targeted run: tests/release/other-release.sh tests/server/test_hostile.py -x
# With --command CMD, CMD runs there instead (after `make setup`), for a benchmark:
# tests/release/other-release.sh --command '.venv/bin/python bench/storage.py --rounds 3'
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/release/chroot.sh
. "$repo/tests/release/chroot.sh"
chroot_releases other-release
cache=${NBD_VERITY_RELEASE_CACHE:-/var/cache/nbd-verity/release}
root=$cache/$other

log() { echo "other-release ($other): $*"; }

end_inside() {
    local pids
    pids=$(chroot_pids "$root")
    [ -z "$pids" ] && return 0
    log "ending processes left in the tree: $(echo $pids)"
    chroot_end "$root"
}

cleanup() {
    local status=$? point
    trap - EXIT INT TERM HUP
    end_inside
    for point in $(chroot_mounts "$root"); do
        umount "$point" 2>/dev/null || umount -l "$point" || true
    done
    exit "$status"
}

# Base tree: debootstrap into .partial, renamed when complete (a broken download is redone).
build_tree() {
    local partial=$root.partial point
    for point in $(chroot_mounts "$partial"); do umount -l "$point" || true; done
    rm -rf --one-file-system "$partial"
    command -v debootstrap >/dev/null || {
        log "installing debootstrap"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    }
    local mirror
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources 2>/dev/null \
             || true)
    log "debootstrap into $root (once per machine)"
    mkdir -p "$cache"
    debootstrap --variant=minbase --include=git,make,ca-certificates,python3,sudo \
        "$other" "$partial" "${mirror:-http://deb.debian.org/debian}" > "$cache/$other.log" 2>&1 \
        || { tail -20 "$cache/$other.log" >&2; log "debootstrap failed (log: $cache/$other.log)";
             exit 1; }
    for point in $(chroot_mounts "$partial"); do umount -l "$point" || true; done
    mv "$partial" "$root"
}

# The host's apt sources for the other release, its Acquire settings, its resolver.
configure_tree() {
    chroot_apt "$root" "$other"
    # The certificate authorities the host added, and how pip reaches its index: the
    # same registry from inside. Local wheel folders (find-links, file:// indexes) stay out.
    if [ -d /usr/local/share/ca-certificates ]; then
        mkdir -p "$root/usr/local/share/ca-certificates"
        cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
        chroot "$root" /usr/sbin/update-ca-certificates > /dev/null 2>&1 || true
    fi
    if [ -f /etc/pip.conf ]; then
        grep -E '^\[|^[[:space:]]*(index-url|cert|trusted-host|proxy|timeout)[[:space:]]*=' \
            /etc/pip.conf | grep -v 'file://' > "$root/etc/pip.conf" || true
    fi
}

mount_in() {
    mkdir -p "$2"
    mount "${@:3}" "$1" "$2"
}

main() {
    mkdir -p "$cache"
    exec 9> "$cache/$other.lock"
    flock -n 9 || { log "another run holds $cache/$other.lock"; exit 1; }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM HUP
    local point start=$SECONDS
    end_inside
    for point in $(chroot_mounts "$root"); do umount -l "$point" || true; done
    [ -x "$root/usr/bin/make" ] || build_tree
    configure_tree
    mount_in /proc "$root/proc" --bind
    mount_in /sys "$root/sys" --rbind
    mount --make-rslave "$root/sys"
    mount_in /dev "$root/dev" --rbind
    mount --make-rslave "$root/dev"
    mount_in tmpfs "$root/tmp" -t tmpfs -o mode=1777
    mount_in tmpfs "$root/run" -t tmpfs -o mode=755
    rm -rf --one-file-system "$root/work/nbd-verity"
    mkdir -p "$root/work"
    git clone -q --no-hardlinks "$repo" "$root/work/nbd-verity"
    git -C "$root/work/nbd-verity" checkout -q --detach "$(git -C "$repo" rev-parse HEAD)"
    log "make test in a clone of $(git -C "$repo" rev-parse --short HEAD)," \
        "tree ready after $((SECONDS - start)) s"
    local status=0 run="make test"
    if [ "${1:-}" = --command ] && [ $# -eq 2 ]; then
        run="make setup && $2"
    elif [ $# -gt 0 ]; then
        run="make setup && .venv/bin/python -m pytest $(printf '%q ' "$@")"
    fi
    # In the background, waited for: a signal to this script ends the wait at once (bash
    # runs traps only between commands), and the EXIT trap then ends what runs inside.
    chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin CI="${CI:-}" \
        /bin/bash -c "cd /work/nbd-verity && echo \"Debian \$(cat /etc/debian_version)\" && $run" \
        < /dev/null &
    wait $! || status=$?
    log "${run##*&& } exited $status after $((SECONDS - start)) s"
    return "$status"
}

main "$@"; exit $?  # one line: bash has read it whole before running it

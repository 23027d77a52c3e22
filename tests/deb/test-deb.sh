#!/usr/bin/env bash
# `make test-deb`: the Debian package of HEAD on both supported releases, from a fresh clone.
#
# 1. Builds: `make deb` in a fresh clone of HEAD on this machine (its release), and in a
#    tree of the other release (a chroot), each also once more with the version bumped
#    (VERSION+upgrade1: the next build of the same source). `make deb` runs lintian and
#    fails on any error or warning not overridden in debian/.
# 2. Installs: for each release, a copy of a pristine minimal tree (debootstrap
#    --variant=minbase, made once per machine in /var/cache/nbd-verity/deb, or
#    NBD_VERITY_DEB_CACHE) runs tests/deb/in-tree.sh: apt-get install ./nbd-verity_*.deb,
#    the installed command, format, serve read back through libnbd, the units, man pages
#    and completion; an upgrade that keeps an edited /etc/nbd-verity file; a purge that
#    leaves the tree's file list as it was. The copy is deleted afterwards.
#
# The other release's build tree (NAME-build: the pristine tree, git and make, then what
# `make deb` installs) is kept, as the other-release suite keeps its tree. Each chroot has
# /proc, /sys, /dev bound in and tmpfs on /tmp and /run; whatever happens, the trap ends
# every process whose root is one of the trees, by pid, and unmounts what this run mounted.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=tests/release/chroot.sh
. "$repo/tests/release/chroot.sh"
chroot_releases test-deb
cache=${NBD_VERITY_DEB_CACHE:-/var/cache/nbd-verity/deb}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml")
bumped=$version+upgrade1
work=$(mktemp -d)
entered=()  # trees this run mounted things in

log() { echo "test-deb: $*"; }

leave() {
    local point
    chroot_end "$1"
    for point in $(chroot_mounts "$1"); do umount "$point" 2>/dev/null || umount -l "$point"; done
}

cleanup() {
    local status=$? root
    trap - EXIT INT TERM HUP
    for root in "${entered[@]}"; do leave "$root" || true; done
    mkdir -p "$cache/logs" && cp "$work"/*.log "$cache/logs/" 2>/dev/null || true  # the last run's
    rm -rf "$work"
    exit "$status"
}

enter() {
    local root=$1
    entered+=("$root")
    mount --bind /proc "$root/proc"
    mkdir -p "$root/sys" "$root/dev" && mount --rbind /sys "$root/sys" && mount --make-rslave "$root/sys"
    mount --rbind /dev "$root/dev" && mount --make-rslave "$root/dev"
    mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
    mount -t tmpfs -o mode=755 tmpfs "$root/run"
}

# in_tree ROOT COMMAND: a shell command in the chroot, in the background and waited for
# (a signal to this script then ends the wait at once, and the trap what runs inside).
in_tree() {
    chroot "$1" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        /bin/bash -c "$2" < /dev/null &
    wait $!
}


# The pristine tree of release $1 (debootstrap into .partial, renamed when complete); each
# copy gets the host's apt settings (chroot_apt), the tree itself stays as made.
base_tree() {
    local release=$1 base=$cache/$1-base mirror
    [ -x "$base/usr/bin/apt-get" ] && return 0
    command -v debootstrap > /dev/null || {
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap
    }
    mirror=$(awk '/^URIs:/ { print $2; exit }' /etc/apt/sources.list.d/debian.sources \
             2>/dev/null || true)
    rm -rf --one-file-system "$base.partial"
    log "debootstrap --variant=minbase $release into $base (once per machine)"
    debootstrap --variant=minbase "$release" "$base.partial" \
        "${mirror:-http://deb.debian.org/debian}" > "$cache/$release-base.log" 2>&1 \
        || { tail -20 "$cache/$release-base.log" >&2; log "debootstrap $release failed"; return 1; }
    mv "$base.partial" "$base"
}

# bump DIR: the same source as the next version, in debian/changelog and the project.
bump() {
    local dir=$1 stamp
    stamp=$(dpkg-parsechangelog -l "$dir/debian/changelog" -S Timestamp)
    sed -i "s/^version = \"$version\"/version = \"$bumped\"/" "$dir/pyproject.toml"
    sed -i "s/^__version__ = \"$version\"/__version__ = \"$bumped\"/" "$dir/nbd_verity/__init__.py"
    { printf 'nbd-verity (%s) unstable; urgency=medium\n\n  * The next build, for the upgrade test.\n\n' \
          "$bumped"
      printf ' -- nbd-verity developers <nbd-verity@example.org>  %s\n\n' \
          "$(LC_ALL=C date -R -u -d "@$((stamp + 60))")"
      cat "$dir/debian/changelog"; } > "$dir/debian/changelog.new"
    mv "$dir/debian/changelog.new" "$dir/debian/changelog"
}

clone() {
    rm -rf "$2"
    git clone -q --no-hardlinks "$repo" "$2"
    git -C "$2" checkout -q --detach "$(git -C "$repo" rev-parse HEAD)"
}

# build_host and build_other: nbd-verity_{VERSION,BUMPED}_*.deb of each release in $work/REL.
build_host() {
    local src=$work/src-$host
    mkdir -p "$work/$host"
    clone "$repo" "$src"
    log "make deb on $host (this machine)"
    make -C "$src" deb > "$work/$host-build.log" 2>&1 || { tail -30 "$work/$host-build.log"; return 1; }
    cp "$src"/nbd-verity_"$version"_*.deb "$work/$host/"
    bump "$src"
    make -C "$src" deb > "$work/$host-build2.log" 2>&1 || { tail -30 "$work/$host-build2.log"; return 1; }
    cp "$src"/nbd-verity_"$bumped"_*.deb "$work/$host/"
}

build_other() {
    local root=$cache/$other-build
    if [ ! -x "$root/usr/bin/make" ]; then
        rm -rf --one-file-system "$root"
        cp -a "$cache/$other-base" "$root.partial"
        chroot_apt "$root.partial" "$other"
        enter "$root.partial"
        in_tree "$root.partial" "apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends git make ca-certificates > /dev/null"
        leave "$root.partial"
        mv "$root.partial" "$root"
    fi
    chroot_apt "$root" "$other"
    enter "$root"
    mkdir -p "$work/$other"
    clone "$repo" "$root/work/nbd-verity"
    log "make deb on $other (in $root)"
    in_tree "$root" "cd /work/nbd-verity && make deb" > "$work/$other-build.log" 2>&1 \
        || { tail -30 "$work/$other-build.log"; return 1; }
    cp "$root"/work/nbd-verity/nbd-verity_"$version"_*.deb "$work/$other/"
    bump "$root/work/nbd-verity"
    in_tree "$root" "cd /work/nbd-verity && make deb" > "$work/$other-build2.log" 2>&1 \
        || { tail -30 "$work/$other-build2.log"; return 1; }
    cp "$root"/work/nbd-verity/nbd-verity_"$bumped"_*.deb "$work/$other/"
    rm -rf "$root/work/nbd-verity"
    leave "$root"
}

# lintian's report of each build, as make deb printed it.
lintian_report() {
    local release=$1
    log "lintian on $release:"
    sed -n '/^lintian /,/^deb: /p' "$work/$release-build.log" | sed 's/^/    /'
}

# install_test REL: tests/deb/in-tree.sh in a fresh copy of the pristine tree of REL.
install_test() {
    local release=$1 root=$cache/$1-run
    leave "$root" 2>/dev/null || true
    rm -rf --one-file-system "$root"
    cp -a "$cache/$release-base" "$root"
    chroot_apt "$root" "$release"
    enter "$root"
    mkdir -p "$root/tmp/deb"
    cp "$work/$release"/*.deb "$repo/tests/deb/in-tree.sh" "$repo/tests/deb/readback.py" \
        "$root/tmp/deb/"
    cp -r "$repo/systemd" "$root/tmp/deb/systemd"
    log "install, serve, upgrade, purge on $release (in a copy of $cache/$release-base)"
    in_tree "$root" "cd /tmp/deb && bash in-tree.sh $version $bumped" || return 1
    leave "$root"
    rm -rf --one-file-system "$root"
}

main() {
    local start=$SECONDS
    mkdir -p "$cache"
    exec 9> "$cache/lock"
    flock -n 9 || { log "another run holds $cache/lock"; exit 1; }
    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM HUP
    # The pristine trees: both debootstraps at once (mostly waiting on the registry).
    base_tree "$host" > "$work/base-$host.log" 2>&1 & local first=$!
    base_tree "$other" > "$work/base-$other.log" 2>&1 & local second=$!
    local status=0
    wait "$first" || status=1
    wait "$second" || status=1
    cat "$work/base-$host.log" "$work/base-$other.log"
    [ "$status" = 0 ] || exit 1
    build_host
    build_other
    lintian_report "$host"
    lintian_report "$other"
    install_test "$host"
    install_test "$other"
    log "passed: built (lintian clean), installed, served, upgraded and purged on $host" \
        "and $other in $((SECONDS - start)) s"
}

main "$@"; exit $?  # one line: bash has read it whole before running it

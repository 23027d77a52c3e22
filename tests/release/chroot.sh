# Sourced by tests/release/other-release.sh and tests/deb/test-deb.sh: finding and ending
# what runs in a chroot tree, and what is mounted under it, whatever happened to it.

# chroot_pids ROOT: every process whose root directory is ROOT (started inside the chroot),
# this shell left out.
chroot_pids() {
    local proc pid
    for proc in /proc/[0-9]*; do
        pid=${proc#/proc/}
        [ "$pid" = $$ ] && continue
        [ "$(readlink "$proc/root" 2>/dev/null)" = "$1" ] && echo "$pid"
    done
    return 0
}

# chroot_end ROOT: TERM every process of ROOT, by pid; KILL what is left after 5 s.
chroot_end() {
    local pid
    for pid in $(chroot_pids "$1"); do kill -TERM "$pid" 2>/dev/null || true; done
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        [ -z "$(chroot_pids "$1")" ] && return 0
        sleep 0.5
    done
    for pid in $(chroot_pids "$1"); do kill -KILL "$pid" 2>/dev/null || true; done
}

# chroot_mounts ROOT: the mount points under ROOT, deepest first (also those a killed
# earlier run left).
chroot_mounts() {
    awk -v r="$1" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/self/mounts | sort -r
}

# chroot_apt ROOT RELEASE: the host's apt sources renamed for RELEASE, its Acquire settings
# (a package's own file, e.g. appstream's 50appstream, stays out: in the tree it would stop
# that package's installation at a conffile question), its resolver and hosts.
chroot_apt() {
    local root=$1 release=$2 host source file copied=0
    host=$(. /etc/os-release && echo "$VERSION_CODENAME")
    mkdir -p "$root/etc/apt/sources.list.d" "$root/etc/apt/apt.conf.d"
    for source in /etc/apt/sources.list.d/*.sources /etc/apt/sources.list; do
        [ -f "$source" ] && grep -qw "$host" "$source" || continue
        sed "s/\b$host\b/$release/g" "$source" > "$root/etc/apt/sources.list.d/$(basename "$source")"
        copied=1
    done
    # debootstrap's own sources.list (its mirror, main only) stays if the host names no suite
    if [ "$copied" = 1 ] && [ -f "$root/etc/apt/sources.list.d/sources.list" ]; then
        mv "$root/etc/apt/sources.list.d/sources.list" "$root/etc/apt/sources.list"
    elif [ "$copied" = 1 ]; then
        rm -f "$root/etc/apt/sources.list"
    fi
    for file in /etc/apt/apt.conf.d/*; do
        grep -q '^[[:space:]]*Acquire' "$file" 2>/dev/null || continue
        dpkg-query -S "$file" > /dev/null 2>&1 || cp "$file" "$root/etc/apt/apt.conf.d/"
    done
    cp -L /etc/resolv.conf "$root/etc/resolv.conf"
    cp /etc/hosts "$root/etc/hosts"
}

# chroot_releases WHO: sets host (this machine's release) and other (the other supported
# one); on another release it ends the script with one line naming WHO.
chroot_releases() {
    host=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
    case "$host" in
        bookworm) other=trixie ;;
        trixie) other=bookworm ;;
        *) echo "$1: host release '$host' is neither bookworm nor trixie" >&2; exit 2 ;;
    esac
}

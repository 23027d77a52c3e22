#!/usr/bin/env bash
# Run by tests/deb/test-deb.sh inside a fresh minimal tree of one release, from the folder
# holding nbd-verity_OLD_*.deb, nbd-verity_NEW_*.deb (the same source, version bumped),
# readback.py and the checkout's systemd/ units:  bash in-tree.sh OLD NEW
#
# Installs OLD with apt as an administrator would, checks everything from the installed
# files (the command, format, serve read back through libnbd, the units, the man pages,
# the completion), edits an export file in /etc/nbd-verity, upgrades to NEW (the edit
# stays), then purges and compares the tree's file list with the one before the install.
set -euo pipefail
old=$1 new=$2
here=$(pwd)
release=$(. /etc/os-release && echo "$VERSION_CODENAME")
export DEBIAN_FRONTEND=noninteractive
step() { echo "in-tree ($release): $*"; }
fail() { echo "in-tree ($release): FAILED: $*" >&2; exit 1; }

# Every path of the tree but the package manager's own records, caches and logs.
file_list() {
    find / -xdev \( -path /var/lib/dpkg -o -path /var/lib/apt -o -path /var/cache \
        -o -path /var/log -o -path /tmp -o -path /run -o -path /proc -o -path /sys \
        -o -path /dev \) -prune -o -print | sort
}

step "apt-get update; the checks' own tools (systemd-analyze, man)"
apt-get update -qq
apt-get install -y -qq --no-install-recommends systemd man-db > /dev/null
file_list > "$here/before.list"

step "apt-get install ./nbd-verity_${old}_*.deb"
apt-get install -y -qq ./nbd-verity_"${old}"_*.deb > "$here/install.log" 2>&1 \
    || { tail -20 "$here/install.log"; fail "install"; }
[ "$(command -v nbd-verity)" = /usr/bin/nbd-verity ] || fail "nbd-verity is $(command -v nbd-verity)"
nbd-verity --version | tee "$here/version.txt"
grep -qx "nbd-verity $old" "$here/version.txt" || fail "--version does not say $old"
grep -q '^hashing engine: native' "$here/version.txt" || fail "not the native engine"
[ "$(/usr/bin/python3 -c 'import nbd_verity; print(nbd_verity.__file__)')" = \
    /usr/lib/python3/dist-packages/nbd_verity/__init__.py ] || fail "nbd_verity is not Debian's"
[ -z "$(find / -xdev -name .venv -print -quit)" ] || fail "a .venv in the tree"

step "format, then serve from /usr/bin/nbd-verity, read back through libnbd"
mkdir -p /tmp/t
head -c $((1024 * 4096)) /dev/urandom > /tmp/t/data.img
cp /tmp/t/data.img /tmp/t/data.orig
nbd-verity format /tmp/t/data.img /tmp/t/hash.img --root-hash-file /tmp/t/root.txt > /dev/null
printf '\xff\xff\xff\xff' | dd of=/tmp/t/data.img bs=1 seek=$((37 * 4096 + 5)) conv=notrunc \
    status=none  # block 37 no longer matches its tree
nbd-verity serve /tmp/t/data.img /tmp/t/hash.img "$(cat /tmp/t/root.txt)" \
    --unix /tmp/t/nbd.sock > /tmp/t/serve.log 2>&1 &
server=$!
/usr/bin/python3 "$here/readback.py" /tmp/t/nbd.sock /tmp/t/data.orig 37 \
    || { kill "$server"; cat /tmp/t/serve.log; fail "readback"; }
[ "$(cat /proc/$server/comm)" = nbdkit ] || fail "serve did not exec nbdkit"
kill "$server"; wait "$server" || true

step "the servers' account, and /etc/nbd-verity for its group alone"
getent passwd nbd-verity | grep -q ':/usr/sbin/nologin$' || fail "no account nbd-verity: $(getent passwd nbd-verity)"
[ "$(stat -c '%a %U:%G' /etc/nbd-verity)" = "750 root:nbd-verity" ] \
    || fail "/etc/nbd-verity is $(stat -c '%a %U:%G' /etc/nbd-verity)"

step "units: the checkout's with /usr/bin/nbd-verity, systemd-analyze verify"
units=()
for unit in "$here"/systemd/*.service "$here"/systemd/*.socket; do
    name=$(basename "$unit")
    diff <(sed 's|/usr/local/bin/nbd-verity|/usr/bin/nbd-verity|g' "$unit") \
        "/usr/lib/systemd/system/$name" || fail "$name differs from the checkout's"
    units+=("/usr/lib/systemd/system/${name/@./@demo.}")
done
out=$(systemd-analyze verify --man=no "${units[@]}" 2>&1) || fail "verify: $out"
[ -z "$out" ] || fail "verify: $out"
# The servers' exposure as this release's systemd scores it (tests/test_systemd.py: the bound).
for unit in nbd-verity@demo.service nbd-verity-exports.service; do
    systemd-analyze security --offline=yes --threshold=6 --no-pager \
        "/usr/lib/systemd/system/$unit" > "$here/security.txt" 2>&1 \
        || fail "$unit: $(grep 'Overall exposure' "$here/security.txt")"
    step "  $(grep 'Overall exposure' "$here/security.txt")"
done

step "man pages and bash completion"
for page in nbd-verity nbd-verity-format nbd-verity-serve nbd-verity-ctl; do
    man -w "$page" > /dev/null || fail "no man page $page"
done
warnings=$(MANWIDTH=80 man --warnings nbd-verity-serve 2>&1 > /dev/null)
[ -z "$warnings" ] || fail "man nbd-verity-serve: $warnings"
MANWIDTH=80 man nbd-verity-serve 2>/dev/null | grep -q -- '--unix' || fail "serve's page lacks --unix"
bash -c '. /usr/share/bash-completion/completions/nbd-verity && complete -p nbd-verity' \
    > /dev/null || fail "no completion for nbd-verity"
[ "$(COMP_WORDS='nbd-verity se' COMP_CWORD=1 _NBD_VERITY_COMPLETE=bash_complete nbd-verity)" \
    = "plain,serve" ] || fail "completion of 'nbd-verity se'"

step "an edited /etc/nbd-verity/demo.conf survives the upgrade to $new"
cp /usr/share/doc/nbd-verity/examples/nbd-verity.conf.example /etc/nbd-verity/demo.conf
sed -i "s|^DATA=.*|DATA=/tmp/t/data.orig|; s|^HASH=.*|HASH=/tmp/t/hash.img|; \
    s|^ROOT_HASH=.*|ROOT_HASH=$(cat /tmp/t/root.txt)|" /etc/nbd-verity/demo.conf
echo "# edited by the administrator" >> /etc/nbd-verity/demo.conf
sum=$(sha256sum /etc/nbd-verity/demo.conf)
apt-get install -y -qq ./nbd-verity_"${new}"_*.deb > "$here/upgrade.log" 2>&1 \
    || { tail -20 "$here/upgrade.log"; fail "upgrade"; }
[ "$(dpkg-query -W -f='${Version}' nbd-verity)" = "$new" ] || fail "not upgraded to $new"
[ "$(sha256sum /etc/nbd-verity/demo.conf)" = "$sum" ] || fail "demo.conf changed"
[ "$(stat -c '%a %U:%G' /etc/nbd-verity)" = "750 root:nbd-verity" ] || fail "/etc/nbd-verity after the upgrade"
nbd-verity --version | grep -qx "nbd-verity $new" || fail "--version after the upgrade"
# As the units run it: the account, no capability, through the group's read of the folder.
install -d -o nbd-verity -g nbd-verity -m 0700 /tmp/t/run
setpriv --reuid=nbd-verity --regid=nbd-verity --clear-groups --inh-caps=-all \
    --bounding-set=-all --no-new-privs \
    nbd-verity serve --export-file /etc/nbd-verity/demo.conf --unix /tmp/t/run/demo.sock \
    > /tmp/t/serve2.log 2>&1 &
server=$!
/usr/bin/python3 "$here/readback.py" /tmp/t/run/demo.sock /tmp/t/data.orig \
    || { kill "$server"; cat /tmp/t/serve2.log; fail "readback after the upgrade"; }
kill "$server"; wait "$server" || true

step "apt-get purge, autoremove: nothing of the package is left"
dpkg -L nbd-verity > "$here/owned.list"
apt-get purge -y -qq nbd-verity > "$here/purge.log" 2>&1 || { cat "$here/purge.log"; fail purge; }
# Everything installed for it too: a package some other one merely recommends or suggests
# goes as well (apt keeps those by default), so the tree is back to its first file list.
apt-get autoremove --purge -y -qq -o APT::AutoRemove::RecommendsImportant=false \
    -o APT::AutoRemove::SuggestsImportant=false > "$here/autoremove.log" 2>&1 \
    || { cat "$here/autoremove.log"; fail autoremove; }
! dpkg -s nbd-verity > /dev/null 2>&1 || fail "dpkg still knows nbd-verity (not purged)"
file_list > "$here/after.list"
# dpkg keeps a file it did not install: the administrator's export file, and its folder.
left=$(comm -13 "$here/before.list" "$here/after.list")
[ "$left" = $'/etc/nbd-verity\n/etc/nbd-verity/demo.conf' ] || fail "left behind: $(head -40 <<< "$left")"
gone=$(comm -23 "$here/before.list" "$here/after.list")
[ -z "$gone" ] || fail "removed: $(head -40 <<< "$gone")"
while read -r path; do
    [ -d "$path" ] || [ ! -e "$path" ] || fail "$path is left"  # folders: by the lists above
done < "$here/owned.list"
step "passed"

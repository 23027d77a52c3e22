# nbd-verity: `make demo` and `make test` set everything up on first use.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
# Debian packages, one table keyed by release (VERSION_CODENAME of /etc/os-release):
# what every supported release installs, then what one release names on its own.
DEB_PACKAGES_ALL := nbdkit nbdkit-plugin-python python3-libnbd libnbd-bin fio cryptsetup-bin \
	nbd-client python3-venv python3-asn1crypto python3-cryptography nbdfuse fuse3 e2fsprogs \
	util-linux openssl qemu-system-x86 socat busybox-static dmsetup iproute2 systemd fdisk \
	gcc python3-dev libssl-dev lighttpd python3-boto3 strace dpkg-dev groff-base
DEB_PACKAGES_bookworm :=                 # Debian 12: systemd carries systemd-repart
DEB_PACKAGES_trixie := systemd-repart    # Debian 13: its own package, not pulled in by systemd
RELEASE := $(shell . /etc/os-release 2>/dev/null && echo $$VERSION_CODENAME)
SUPPORTED_RELEASES := bookworm trixie
DEB_PACKAGES := $(DEB_PACKAGES_ALL) $(DEB_PACKAGES_$(RELEASE))
# What `make deb` builds with: debian/control's Build-Depends, dpkg-buildpackage's own
# tools and lintian (dpkg-buildpackage refuses the build with one line if one is missing).
DEB_BUILD_PACKAGES_ALL := build-essential fakeroot debhelper dh-python pybuild-plugin-pyproject \
	python3-all-dev python3-setuptools libssl-dev python3-click python3-cryptography \
	python3-asn1crypto python3-libnbd lintian git
DEB_BUILD_PACKAGES_bookworm :=
DEB_BUILD_PACKAGES_trixie :=
DEB_BUILD_PACKAGES := $(DEB_BUILD_PACKAGES_ALL) $(DEB_BUILD_PACKAGES_$(RELEASE))
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
DEB_DIR := $(CURDIR)/build/deb

# $(call check_release,TARGET) and $(call install_missing,PACKAGES): what setup and deb do first.
define check_release
	@case " $(SUPPORTED_RELEASES) " in *" $(RELEASE) "*) ;; *) echo "$(1): Debian release \
		'$(RELEASE)' is not supported (supported: $(SUPPORTED_RELEASES))" >&2; exit 1;; esac
endef
define install_missing
	@missing=$$(for p in $(1); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null \
		| grep -q 'install ok installed' || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:" $$missing; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi
endef

.PHONY: setup demo test test-other-release deb test-deb lint bench bench-format bench-fec bench-latency bench-storage e2e e2e-bench soak clean

setup: $(VENV)/.installed

# Debian packages first (idempotent: apt only runs when one is missing), then the venv
# from Debian's python3, which is the interpreter nbdkit embeds.
$(VENV)/.installed: pyproject.toml setup.py $(wildcard nbd_verity/format/*.[ch]) nbd_verity/fec/_rs.c nbd_verity/_threadstate.c  # C built in place
	$(call check_release,setup)
	$(call install_missing,$(DEB_PACKAGES))
	@[ -x $(PY) ] || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	@touch $@

demo: setup
	$(PY) -m nbd_verity.demo $(CURDIR)/demo

test: setup
	$(PY) -m pytest tests

# `make test` of a fresh clone of HEAD on the other supported release (Debian 13 on a
# Debian 12 host and back), in a debootstrap tree cached in /var/cache/nbd-verity/release.
test-other-release:
	bash tests/release/other-release.sh

# nbd-verity_VERSION_ARCH.deb for this release, with Debian's tools: the checkout's files
# (tracked or not, those git ignores left out) are copied into build/deb and built there by
# dpkg-buildpackage, then checked by lintian (an error or a warning not overridden in
# debian/ fails the build); the package lands in this folder.
deb:
	$(call check_release,deb)
	$(call install_missing,$(DEB_BUILD_PACKAGES))
	@git rev-parse --git-dir > /dev/null 2>&1 || { echo "deb: needs a git checkout" >&2; exit 1; }
	rm -rf $(DEB_DIR) && mkdir -p $(DEB_DIR)/nbd-verity-$(VERSION)
	git ls-files -z -c -o --exclude-standard | tar --null -T - --ignore-failed-read -cf - \
		| tar -C $(DEB_DIR)/nbd-verity-$(VERSION) -xf -
	# PATH of Debian's own programs: pybuild runs `python3.X` from PATH, and the package is
	# for Debian's, whatever other Python this shell finds first.
	cd $(DEB_DIR)/nbd-verity-$(VERSION) && PATH=/usr/sbin:/usr/bin:/sbin:/bin \
		dpkg-buildpackage -us -uc -b
	lintian --fail-on error,warning --display-info $(DEB_DIR)/nbd-verity_$(VERSION)_*.changes
	@deb=$$(cd $(DEB_DIR) && ls nbd-verity_$(VERSION)_*.deb) && \
		cp $(DEB_DIR)/$$deb .$$deb.tmp && mv .$$deb.tmp $$deb && echo "deb: $$deb"

# The package of each supported release, built by `make deb` (here and in a tree of the
# other release) and installed, served from, upgraded and purged in fresh trees of both.
test-deb:
	bash tests/deb/test-deb.sh

lint: setup
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check nbd_verity tests plugin.py bench

bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	@dpkg-query -W -f='$${Status}' linux-perf 2>/dev/null | grep -q 'install ok installed' \
		|| DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf
	$(PY) bench/run.py
	$(PY) bench/side.py 3 5 native   # the read-path targets side by side (docs/benchmarks.md)
	$(PY) bench/threads.py 3 5   # the fast path under each thread model: the three ratios
	$(PY) bench/profile4k.py 3 5   # a 4 KiB request's CPU, part by part (perf)
	$(PY) bench/exports.py 3   # many exports from one server against one per image
	$(PY) bench/qos.py 3 5   # classes as priorities, the dispatch under load

e2e: setup
	$(PY) -m pytest tests/e2e tests/test_systemd.py

e2e-bench: setup
	NBD_VERITY_E2E_RECORD=1 $(PY) -m pytest tests/e2e -k test_fio_figures -s

# Not in CI: 10 minutes of everything at once (bench/soak.py; SOAK_MINUTES=N to change).
soak: setup
	$(PY) bench/soak.py --minutes $(or $(SOAK_MINUTES),10)

bench-format: setup
	$(PY) bench/format.py

bench-fec: setup
	$(PY) bench/fec.py

# Readahead with the hash image behind nbdkit's delay filter (docs/benchmarks.md)
bench-latency: setup
	$(PY) bench/latency.py --write

# verified against unverified reads of delayed NBD upstreams and a delayed HTTP server,
# one connection (and, as root, the uncached disk: `make bench-storage STORAGE=--disk`)
bench-storage: setup
	$(PY) bench/storage.py --delays 0.1ms,1ms,10ms --http 10ms $(STORAGE)

clean:
	rm -rf $(VENV) demo .pytest_cache .hypothesis

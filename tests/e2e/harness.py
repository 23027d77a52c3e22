"""Real-kernel harness: NBD servers on Unix sockets, a QEMU guest running Debian's kernel.

The host's kernel has neither the `nbd` driver nor device-mapper; Debian's own kernel in
a QEMU guest has both, and dm-verity's FEC (tests/e2e/README.md). One run looks like this:

    host
    ├── NBD server(s) on Unix sockets WORK/server-PORT.sock (nbd-verity serve, or nbdkit
    │   file as a baseline)
    └── qemu-system-x86_64 -accel tcg, under `timeout`
        ├── kernel: Debian's linux-image-6.1.0-N-amd64, unpacked into a cache (guestkernel.py)
        ├── initramfs: busybox and the modules; mounts the host's / over 9p, read-only
        ├── user networking with restrict=on: the guest's 10.0.2.100:PORT runs
        │   `socat STDIO UNIX-CONNECT:WORK/server-PORT.sock` for each connection
        ├── virtio disks: host image files, read-only, as /dev/vda, /dev/vdb, ...
        ├── WORK over 9p, read-write, at the same path in the guest
        └── guest/init.sh as PID 1 (after the initramfs): mounts, guest/lib.sh's
            e2e_setup and the run's scenario.sh, writes exit-status, powers off

Nothing listens on the network and nothing leaves the machine (restrict=on; the only way
out of the guest is the guestfwd rules). Every process is started here and stopped by its
own pid, never by name. A guest that does not finish raises GuestFailed with its console
log; nothing here skips. A guest whose init does not come up in INIT_TIMEOUT_S is booted
once more (its console kept as console.no-init.log, the boot named so in BOOTS); an
interrupt during that wait stops the guest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from nbd_verity.launch import Launched

from .guestkernel import (
    GUEST_DIR,
    GuestKernel,
    builtin_parameters,
    ensure_initramfs,
    ensure_kernel,
)

# The venv's own entry point: the one built from this checkout.
NBD_VERITY = Path(sys.executable).parent / "nbd-verity"

# What a run needs on the host (the guest runs the same binaries through 9p).
DEB_PACKAGES = ("qemu-system-x86", "socat", "busybox-static", "nbdkit", "nbd-client",
                "cryptsetup-bin", "dmsetup", "fio", "e2fsprogs", "iproute2", "util-linux",
                "coreutils", "python3")

# The guest reaches server PORT at this address (a guestfwd rule of QEMU's user network).
GUEST_HOST_ADDR = "10.0.2.100"
# Budgets, in seconds. A guest reaches its init about 8 s after QEMU starts under TCG.
SERVER_START_S = 60
GUEST_TIMEOUT_S = 300
# A guest whose init did not come up by then is booted once more: QEMU under TCG, now and
# then, prints nothing at all and never reaches the kernel (no part of ours runs before
# init); a second guest that does not come up fails the test as any other.
INIT_TIMEOUT_S = 150
INIT_LINE = "e2e-guest: init up after"
GUEST_MEM = "1G"
GUEST_CPUS = 2
# QEMU's accelerator: software emulation works on every x86 host (KVM does not work on
# this project's machines); NBD_VERITY_E2E_ACCEL=kvm where /dev/kvm really works.
ACCEL_ENV = "NBD_VERITY_E2E_ACCEL"

# One line per guest boot, printed at the end of the pytest run (conftest.py).
BOOTS: list[str] = []


class GuestFailed(AssertionError):
    """The guest did not boot, did not finish, or its scenario failed; carries its log."""


def ensure_packages(packages: Sequence[str] = DEB_PACKAGES) -> None:
    """Install the Debian packages a run needs, only if one is missing (idempotent)."""
    missing = [p for p in packages if not _installed(p)]
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"e2e: missing Debian packages {missing} and not root to install")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                   check=True, env=env)


def _installed(package: str) -> bool:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package],
                         capture_output=True, text=True)
    return out.returncode == 0 and "install ok installed" in out.stdout


@dataclass(frozen=True)
class Guest:
    """What every boot uses: the kernel and the initramfs built for it."""

    kernel: GuestKernel
    initramfs: Path


_GUEST: Guest | None = None


def guest_system() -> Guest:
    """The kernel (downloaded once per machine) and initramfs (built once per change)."""
    global _GUEST
    if _GUEST is None:
        kernel = ensure_kernel()
        _GUEST = Guest(kernel=kernel, initramfs=ensure_initramfs(kernel))
    return _GUEST


@dataclass(frozen=True)
class Export:
    """A verity export: a data image, its hash image and the trusted root hash (hex);
    hash None: the data image alone (a Discoverable Disk Image holds all three)."""

    data: Path
    hash: Path | None
    root_hash: str


@dataclass(frozen=True)
class Server:
    """How to start one NBD server in the foreground on a Unix socket.

    kind "nbd-verity" is the server under test; "nbd-verity-exports" the same serving a
    directory of export files (export.data is the directory); "nbdkit-file" serves the
    data image unverified through nbdkit's C file plugin, as a baseline. extra_args go to
    the command as they are (e.g. ("--control", path)).
    """

    export: Export
    kind: str = "nbd-verity"
    extra_args: tuple[str, ...] = ()

    def argv(self, socket: Path, pid_file: Path) -> list[str]:
        """The server's command line; it writes pid_file once it accepts connections."""
        if self.kind == "nbd-verity":
            # Without a hash image, DATA alone: a DDI, or an image with its sidecars.
            images = ([str(self.export.data), str(self.export.hash), self.export.root_hash]
                      if self.export.hash is not None else [str(self.export.data)])
            return [str(NBD_VERITY), "serve", *images, "--unix", str(socket),
                    "--pid-file", str(pid_file), "--exit-with-parent", *self.extra_args]
        if self.kind == "nbd-verity-exports":
            return [str(NBD_VERITY), "serve", "--exports", str(self.export.data), "--unix",
                    str(socket), "--pid-file", str(pid_file), "--exit-with-parent",
                    *self.extra_args]
        if self.kind == "nbdkit-file":
            return ["nbdkit", "--exit-with-parent", "-f", "-r", "-U", str(socket),
                    "--pidfile", str(pid_file), *self.extra_args,
                    "file", str(self.export.data)]
        raise ValueError(f"server kind: {self.kind!r} is not nbd-verity, nbd-verity-exports "
                         f"or nbdkit-file")


def server_socket(work: Path, port: int) -> Path:
    return work / f"server-{port}.sock"


class ServerProcess:
    """One server on WORK/server-PORT.sock that a test stops and starts again at will:
    stop() as its unit stops it (`ctl stop`, then SIGTERM if it is still there), kill()
    as a crash (SIGKILL). The socket's file is removed before each start, as a socket unit
    would keep it: between two servers nothing listens."""

    def __init__(self, server: Server, port: int, work: Path, name: str) -> None:
        self.server, self.port, self.work, self.name = server, port, work, name
        self.starts = 0
        self._launched: Launched | None = None

    @property
    def control(self) -> Path:
        return self.work / f"{self.name}.ctl"

    def start(self) -> ServerProcess:
        self.starts += 1
        pid_file = self.work / f"{self.name}.pid"
        socket = server_socket(self.work, self.port)
        for path in (pid_file, socket, self.control):
            path.unlink(missing_ok=True)
        extra = (("--control", str(self.control)) if self.server.kind != "nbdkit-file"
                 else ())
        server = Server(self.server.export, self.server.kind,
                        (*self.server.extra_args, *extra))
        self._launched = Launched(server.argv(socket, pid_file), pid_file=pid_file,
                                  socket=socket, log_path=self.work / f"{self.name}."
                                  f"{self.starts}.log", name=self.name)
        self._launched.start(timeout=SERVER_START_S)
        return self

    def stop(self) -> dict:
        """`nbd-verity ctl stop` (the units' ExecStop), then wait for the exit."""
        out = subprocess.run([str(NBD_VERITY), "ctl", "--control", str(self.control), "stop",
                              "--json"], capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise AssertionError(f"{self.name}: ctl stop failed: {out.stderr}")
        self._launched.wait(timeout=15)
        self._launched.stop()
        return json.loads(out.stdout)

    def kill(self) -> None:
        os.kill(self._launched.pid, signal.SIGKILL)
        self._launched.wait(timeout=15)

    def close(self) -> None:
        if self._launched is not None:
            self._launched.stop()


@contextmanager
def nbd_server(server: Server, port: int, work: Path) -> Iterator[Path]:
    """Run server on WORK/server-PORT.sock until the block ends; yields its log file."""
    pid_file = work / f"server-{port}.pid"
    log = work / f"server-{port}.log"
    socket = server_socket(work, port)
    pid_file.unlink(missing_ok=True)
    socket.unlink(missing_ok=True)
    launched = Launched(server.argv(socket, pid_file), pid_file=pid_file, socket=socket,
                        log_path=log, name="e2e server")
    with launched.start(timeout=SERVER_START_S):
        yield log


@dataclass(frozen=True)
class GuestRun:
    """What a finished guest left: its work folder (results) and its console log."""

    work: Path
    console: str
    seconds: float

    def read(self, name: str) -> str:
        """A result file the scenario wrote, stripped."""
        return (self.work / name).read_text().strip()

    def lines(self, name: str) -> list[str]:
        return [line for line in self.read(name).splitlines() if line]


class LiveGuest:
    """A guest booted in the background, so that the host can act between its steps.

    The scenario calls `host_signal NAME` / `host_wait NAME` (lib.sh); the host calls
    wait_for(NAME) / signal(NAME). Both sides meet at files in WORK/sync, which the guest
    sees through 9p (no cache) as soon as the host writes them.
    """

    def __init__(self, script: str, disks: Sequence[Path], work: Path,
                 ports: Sequence[int] = (), timeout_s: int = GUEST_TIMEOUT_S,
                 name: str = "") -> None:
        self.work = work
        self.sync = work / "sync"
        # The test that booted it ("tests/e2e/test_x.py::test_y (call)"), for BOOTS.
        self.name = name or os.environ.get("PYTEST_CURRENT_TEST", work.name).split(" ")[0]
        work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.sync, ignore_errors=True)
        self.sync.mkdir()
        (work / "scenario.sh").write_text(script)
        (work / "exit-status").unlink(missing_ok=True)
        self._console_path = work / "console.log"
        self._argv = ["timeout", "--kill-after=10", str(timeout_s),
                      *qemu_argv(guest_system(), disks, work, ports)]
        self._recorded = False
        self._launch()
        try:  # an interrupt while waiting stops the guest (not left to its timeout)
            up = self._init_up(INIT_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        if not up:
            self.stop()
            self._console_path.rename(work / "console.no-init.log")
            self._recorded = False
            self.name += " (booted again: no init in the first guest)"
            self._launch()

    def _launch(self) -> None:
        self._started = time.monotonic()
        with open(self._console_path, "wb") as console_f:
            self._proc = subprocess.Popen(self._argv, stdin=subprocess.DEVNULL,
                                          stdout=console_f, stderr=subprocess.STDOUT,
                                          cwd=self.work)

    def _init_up(self, timeout_s: float) -> bool:
        """Whether the guest's init came up within timeout_s (or the guest already ended:
        then finish() tells what it left)."""
        deadline = time.monotonic() + timeout_s
        while INIT_LINE not in self.console():
            if self._proc.poll() is not None:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def console(self) -> str:
        return self._console_path.read_text(errors="replace")

    def wait_for(self, name: str, timeout_s: float = 120) -> str:
        """Wait until the guest ran `host_signal name`; returns what it wrote there."""
        path = self.sync / name
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self._proc.poll() is not None:
                raise GuestFailed(f"guest stopped before signalling {name!r}; console log:\n"
                                  f"{self.console()}")
            if time.monotonic() > deadline:
                raise GuestFailed(f"guest did not signal {name!r} within {timeout_s} s; "
                                  f"console log:\n{self.console()}")
            time.sleep(0.05)
        return path.read_text()

    def signalled(self, name: str) -> bool:
        """Whether the guest ran `host_signal name` yet, without waiting.

        GuestFailed if the guest stopped before it did (as wait_for).
        """
        if (self.sync / name).exists():
            return True
        if self._proc.poll() is not None and not (self.sync / name).exists():
            raise GuestFailed(f"guest stopped before signalling {name!r}; console log:\n"
                              f"{self.console()}")
        return False

    def signal(self, name: str, text: str = "") -> None:
        """Let the guest's `host_wait name` return (written whole, then renamed)."""
        tmp = self.sync / f".{name}.tmp"
        tmp.write_text(text)
        tmp.rename(self.sync / name)

    def finish(self) -> GuestRun:
        """Wait for power-off; GuestFailed with the console log unless the scenario passed."""
        returncode = self._proc.wait()
        seconds = time.monotonic() - self._started
        run = GuestRun(work=self.work, console=self.console(), seconds=seconds)
        self._record(run.console, seconds)
        status_path = self.work / "exit-status"
        if not status_path.exists():
            raise GuestFailed(f"guest did not finish (qemu exit {returncode} after "
                              f"{seconds:.1f} s); console log:\n{run.console}")
        status = status_path.read_text().strip()
        if status != "0":
            raise GuestFailed(f"guest scenario failed with status {status}; console log:\n"
                              f"{run.console}")
        return run

    def _record(self, console: str, seconds: float) -> None:
        """One line for this boot in BOOTS: when init came up, and the whole run."""
        if self._recorded:
            return
        self._recorded = True
        match = re.search(re.escape(INIT_LINE) + r" ([\d.]+) s", console)
        up = f"init at {float(match.group(1)):.1f} s (guest clock)" if match else "no init"
        BOOTS.append(f"{self.name}: {up}, {seconds:.1f} s from start to power-off")

    def stop(self) -> None:
        """Stop a guest that is still running (after a failure on the host side)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._record(self.console(), time.monotonic() - self._started)


def boot_guest(script: str, disks: Sequence[Path], work: Path,
               timeout_s: int = GUEST_TIMEOUT_S) -> GuestRun:
    """Boot the guest, run script (shell, lib.sh's helpers) and wait for power-off.

    disks become read-only /dev/vda, /dev/vdb, ... in order. Raises GuestFailed with the
    console log unless the scenario ran to the end with status 0.
    """
    guest = LiveGuest(script, disks, work, timeout_s=timeout_s)
    try:
        return guest.finish()
    finally:
        guest.stop()


def _check_path(path: Path) -> None:
    # QEMU's option syntax splits on commas; a path with one cannot be passed.
    if "," in str(path):
        raise ValueError(f"e2e: {path}: QEMU's command line cannot carry ',' in a path")


def qemu_argv(guest: Guest, disks: Sequence[Path], work: Path,
              ports: Sequence[int]) -> list[str]:
    """The QEMU command line of one run: kernel, initramfs, shares, disks, network."""
    for path in (GUEST_DIR, work, *disks):
        _check_path(path)
    accel = os.environ.get(ACCEL_ENV) or "tcg"
    if accel == "tcg":
        accel = "tcg,thread=multi"
    cmdline = " ".join([
        "console=ttyS0", "quiet", "panic=-1", "oops=panic",
        f"E2E_INIT={GUEST_DIR / 'init.sh'}", f"E2E_WORK={work}",
        *builtin_parameters(guest.kernel)])
    # One rule per port: each guest connection to 10.0.2.100:PORT runs its own socat to
    # the server's Unix socket. restrict=on: no other traffic in or out. socat's stderr is
    # the guest's connection too (QEMU hands the command the socket as every standard
    # stream): its messages (a refused connect while a server restarts) go to a log file,
    # never into the guest's NBD stream.
    forwards = "".join(
        f",guestfwd=tcp:{GUEST_HOST_ADDR}:{port}-cmd:socat -lf {work}/socat-{port}.log "
        f"STDIO UNIX-CONNECT:{server_socket(work, port)}" for port in ports)
    argv = [shutil.which("qemu-system-x86_64") or "/usr/bin/qemu-system-x86_64",
            "-accel", accel, "-cpu", "max", "-smp", str(GUEST_CPUS), "-m", GUEST_MEM,
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
            "-no-reboot",
            "-kernel", str(guest.kernel.vmlinuz), "-initrd", str(guest.initramfs),
            "-append", cmdline,
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
                       "multidevs=remap",
            "-virtfs", f"local,path={work},mount_tag=work,security_model=none,"
                       "multidevs=remap",
            "-netdev", f"user,id=net0,restrict=on,ipv6=off{forwards}",
            "-device", "virtio-net-pci,netdev=net0"]
    for i, disk in enumerate(disks):
        argv += ["-drive", f"file={disk},format=raw,if=none,id=disk{i},readonly=on",
                 "-device", f"virtio-blk-pci,drive=disk{i}"]
    return argv


@contextmanager
def guest_session(script: str, disks: Sequence[Path], servers: Mapping[int, Server],
                  work: Path, timeout_s: int = GUEST_TIMEOUT_S,
                  ports: Sequence[int] = ()) -> Iterator[LiveGuest]:
    """Servers on their sockets and a guest booted in the background.

    ports: more ports the guest may reach, whose servers the test starts and stops itself
    (on server_socket(work, port), e.g. with ServerProcess). The block talks to the guest
    (wait_for/signal) and ends with guest.finish(); on the way out the guest (if still
    running) and the servers are stopped.
    """
    work.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        for port, server in servers.items():
            stack.enter_context(nbd_server(server, port, work))
        guest = LiveGuest(script, disks, work, ports=[*servers, *ports], timeout_s=timeout_s)
        try:
            yield guest
        finally:
            guest.stop()


@contextmanager
def guest_run(script: str, disks: Sequence[Path], servers: Mapping[int, Server],
              work: Path, timeout_s: int = GUEST_TIMEOUT_S) -> Iterator[GuestRun]:
    """Servers on their sockets, then one guest run; all stopped on exit.

    The block sees the finished run while the servers still run (their logs are in work
    as server-PORT.log).
    """
    with guest_session(script, disks, servers, work, timeout_s) as guest:
        yield guest.finish()

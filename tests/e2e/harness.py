"""Real-kernel harness: NBD servers in a private network namespace, a user-mode-linux guest.

The host's kernel has neither the `nbd` driver nor device-mapper; the UML guest kernel has
both (tests/e2e/README.md). One run looks like this:

    private netns (unshare -n, only lo)
    ├── NBD server(s) on 127.0.0.1:PORT (nbd-verity serve, or nbdkit file as a baseline)
    └── linux.uml, under `timeout`
        ├── eth0=slirp: the guest's 10.0.2.2:PORT is the namespace's 127.0.0.1:PORT
        ├── ubd1r=, ubd2r=, ...: host image files as read-only /dev/ubdb, /dev/ubdc, ...
        ├── root = the host's / over hostfs, read-only (host nbd-client, veritysetup, fio)
        └── guest/init.sh as PID 1: mounts the run's work folder read-write, runs
            guest/lib.sh's e2e_setup and the run's scenario.sh, writes exit-status, powers off

Nothing listens outside the namespace and nothing leaves the machine. Every process is
started here and stopped by its own pid, never by name. A guest that does not finish
raises GuestFailed with its console log; nothing here skips.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from nbd_verity.launch import Launched

GUEST_DIR = Path(__file__).resolve().parent / "guest"
# The venv's own entry point: the one built from this checkout.
NBD_VERITY = Path(sys.executable).parent / "nbd-verity"

# What a run needs on the host (the guest uses the same binaries through hostfs).
DEB_PACKAGES = ("user-mode-linux", "slirp", "socat", "busybox-static", "nbdkit",
                "nbd-client", "cryptsetup-bin", "fio", "e2fsprogs", "iproute2", "util-linux",
                "coreutils", "python3")

# Budgets, in seconds. A guest boots in about 3 s; the longest run (fio) takes about 30 s.
SERVER_START_S = 30
GUEST_TIMEOUT_S = 150
GUEST_MEM = "512M"


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
class Export:
    """A verity export: a data image, its hash image and the trusted root hash (hex)."""

    data: Path
    hash: Path
    root_hash: str


@dataclass(frozen=True)
class Server:
    """How to start one NBD server in the foreground on 127.0.0.1:PORT.

    kind "nbd-verity" is the server under test; "nbdkit-file" serves the data image
    unverified through nbdkit's C file plugin, as a baseline. extra_args go to the command
    as they are (e.g. ("--control", path)).
    """

    export: Export
    kind: str = "nbd-verity"
    extra_args: tuple[str, ...] = ()

    def argv(self, port: int, pid_file: Path) -> list[str]:
        """The server's command line; it writes pid_file once it accepts connections."""
        if self.kind == "nbd-verity":
            return [str(NBD_VERITY), "serve", str(self.export.data), str(self.export.hash),
                    self.export.root_hash, "--port", str(port), "--bind", "127.0.0.1",
                    "--pid-file", str(pid_file), "--exit-with-parent", *self.extra_args]
        if self.kind == "nbdkit-file":
            return ["nbdkit", "--exit-with-parent", "-f", "-r", "-p", str(port),
                    "-i", "127.0.0.1", "--pidfile", str(pid_file), *self.extra_args,
                    "file", str(self.export.data)]
        raise ValueError(f"server kind: {self.kind!r} is not nbd-verity or nbdkit-file")


class Netns:
    """A private network namespace with only `lo` up, held open by one sleeping process.

    Processes join it with nsenter (which execs, so their pid is the Popen's pid).
    """

    def __init__(self) -> None:
        self._holder: subprocess.Popen | None = None

    def __enter__(self) -> Netns:
        # The holder prints "ready" only after lo is up: a barrier, not a sleep.
        self._holder = subprocess.Popen(
            ["unshare", "--net", "--", "sh", "-c",
             "ip link set lo up && echo ready && exec sleep infinity"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        line = self._holder.stdout.readline().strip()
        if line != "ready":
            self._stop()
            raise RuntimeError("e2e: could not create a private network namespace (unshare -n)")
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self._holder is not None:
            self._holder.kill()
            self._holder.wait()
            self._holder.stdout.close()
            self._holder = None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """argv run inside this namespace."""
        return ["nsenter", f"--net=/proc/{self._holder.pid}/ns/net", "--", *argv]


@contextmanager
def nbd_server(netns: Netns, server: Server, port: int, work: Path) -> Iterator[Path]:
    """Run server in netns on 127.0.0.1:port until the block ends; yields its log file.

    Ready means its pid file is written (nbdkit does so once it listens): the host cannot
    connect into the namespace to check the socket itself."""
    pid_file = work / f"server-{port}.pid"
    log = work / f"server-{port}.log"
    pid_file.unlink(missing_ok=True)
    launched = Launched(netns.wrap(server.argv(port, pid_file)), pid_file=pid_file,
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
    sees through hostfs as soon as the host writes them.
    """

    def __init__(self, netns: Netns, script: str, disks: Sequence[Path], work: Path,
                 timeout_s: int = GUEST_TIMEOUT_S) -> None:
        self.work = work
        self.sync = work / "sync"
        work.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.sync, ignore_errors=True)
        self.sync.mkdir()
        (work / "scenario.sh").write_text(script)
        (work / "exit-status").unlink(missing_ok=True)
        self._console_path = work / "console.log"
        argv = ["timeout", "--kill-after=10", str(timeout_s),
                *netns.wrap(_uml_argv(disks, work))]
        self._started = time.monotonic()
        with open(self._console_path, "wb") as console_f:
            # TMPDIR: UML backs the guest's memory with a file there; /dev/shm is RAM.
            self._proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=console_f,
                                          stderr=subprocess.STDOUT, cwd=work,
                                          env=dict(os.environ, TMPDIR="/dev/shm"))

    def console(self) -> str:
        return self._console_path.read_text(errors="replace")

    def wait_for(self, name: str, timeout_s: float = 60) -> str:
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
        status_path = self.work / "exit-status"
        if not status_path.exists():
            raise GuestFailed(f"guest did not finish (linux.uml exit {returncode} after "
                              f"{seconds:.1f} s); console log:\n{run.console}")
        status = status_path.read_text().strip()
        if status != "0":
            raise GuestFailed(f"guest scenario failed with status {status}; console log:\n"
                              f"{run.console}")
        return run

    def stop(self) -> None:
        """Stop a guest that is still running (after a failure on the host side)."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def boot_guest(netns: Netns, script: str, disks: Sequence[Path], work: Path,
               timeout_s: int = GUEST_TIMEOUT_S) -> GuestRun:
    """Boot the guest in netns, run script (shell, lib.sh's helpers) and wait for power-off.

    disks become read-only /dev/ubdb, /dev/ubdc, ... in order. Raises GuestFailed with the
    console log unless the scenario ran to the end with status 0.
    """
    return LiveGuest(netns, script, disks, work, timeout_s).finish()


def _uml_argv(disks: Sequence[Path], work: Path) -> list[str]:
    for path in (GUEST_DIR, work, *disks):
        if any(c in str(path) for c in " ,:="):
            raise ValueError(f"e2e: {path}: UML's command line cannot carry ' ,:=' in a path")
    argv = [shutil.which("linux.uml") or "/usr/bin/linux.uml", f"mem={GUEST_MEM}",
            "rootfstype=hostfs", "rootflags=/", "ro", "quiet",
            f"init={GUEST_DIR / 'init.sh'}", f"E2E_WORK={work}",
            f"eth0=slirp,,{GUEST_DIR / 'slirp.sh'}",
            # The console is UML's stdout; no other terminals.
            "con0=null,fd:1", "con=null", "ssl=null",
            # UML's pid file and mconsole socket: in the run's folder, not in ~/.uml.
            f"uml_dir={work / 'uml'}"]
    # ubd0 stays unused so that the disks are ubdb, ubdc, ...; 'r' opens them read-only.
    argv += [f"ubd{i}r={path}" for i, path in enumerate(disks, start=1)]
    return argv


@contextmanager
def guest_session(script: str, disks: Sequence[Path], servers: Mapping[int, Server],
                  work: Path) -> Iterator[LiveGuest]:
    """Servers on their ports in a fresh netns and a guest booted in the background.

    The block talks to the guest (wait_for/signal) and ends with guest.finish(); on the way
    out the guest (if still running), the servers and the namespace are stopped.
    """
    work.mkdir(parents=True, exist_ok=True)
    with Netns() as netns, ExitStack() as stack:
        for port, server in servers.items():
            stack.enter_context(nbd_server(netns, server, port, work))
        guest = LiveGuest(netns, script, disks, work)
        try:
            yield guest
        finally:
            guest.stop()


@contextmanager
def guest_run(script: str, disks: Sequence[Path], servers: Mapping[int, Server],
              work: Path) -> Iterator[GuestRun]:
    """Servers on their ports in a fresh netns, then one guest run; all stopped on exit.

    The block sees the finished run while the servers still run (their logs are in work
    as server-PORT.log).
    """
    with guest_session(script, disks, servers, work) as guest:
        yield guest.finish()

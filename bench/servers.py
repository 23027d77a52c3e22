"""The servers a benchmark compares, each on its own Unix socket, started and stopped by pid.

Four kinds: nbdkit's C `file` plugin (the transport ceiling), the Python pass-through
plugin (bench/passthrough.py: same nbdkit threads and preadv, no verification),
`nbd-verity serve` (which execs nbdkit, so the child's pid is nbdkit's), and our plugin
under nbdkit directly (to add nbdkit filters, which `serve` does not pass). Ready means a
connect() to the socket succeeds (polled, never slept on); the time from exec to that
moment is kept as the start-up time. Stopping is SIGTERM to the pid we started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from nbd_verity.cli_ctl import control_request  # noqa: E402
from nbd_verity.procs import stop_process  # noqa: E402
from nbd_verity.serve import PLUGIN  # noqa: E402

NBDKIT = shutil.which("nbdkit") or "/usr/sbin/nbdkit"
NBD_VERITY = str(Path(sys.executable).parent / "nbd-verity")
PASSTHROUGH = PROJECT / "bench" / "passthrough.py"
START_TIMEOUT = 60.0
STOP_TIMEOUT = 15.0
POLL_INTERVAL = 0.002  # between connect() attempts while waiting for the socket
ALL_INLINE = 32 << 20  # every class's threshold at the maximum: every request inline


def inline_options() -> list[str]:
    return [f"--threshold={c}={ALL_INLINE}" for c in ("none", "rt", "be", "idle")]


def pool_options() -> list[str]:
    return [f"--threshold={c}=0" for c in ("none", "rt", "be", "idle")]


class Server:
    """One server process listening on a Unix socket in a private directory."""

    def __init__(self, name: str, kind: str, argv_tail: list[str], threads: int | None = None,
                 filters: tuple[str, ...] = ()):
        self.name = name
        self.kind = kind  # "file", "passthrough", "verity" (nbd-verity serve) or "plugin"
        self.filters = [f"--filter={f}" for f in filters]  # nbdkit filters, before the plugin
        self.dir = tempfile.mkdtemp(prefix="nvb-")  # short: sun_path holds 108 bytes
        self.socket = os.path.join(self.dir, "nbd.sock")
        self.pid_file = os.path.join(self.dir, "nbd.pid")
        self.control = os.path.join(self.dir, "ctl.sock") if kind == "verity" else None
        self.argv = self._argv(argv_tail, threads)
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")
        self._log = open(os.path.join(self.dir, "server.log"), "wb")  # noqa: SIM115

    def _argv(self, tail: list[str], threads: int | None) -> list[str]:
        if self.kind == "verity":
            argv = [NBD_VERITY, "serve", *tail, "--unix", self.socket, "--pid-file",
                    self.pid_file, "--control", self.control, "--exit-with-parent"]
            return argv + (["--threads", str(threads)] if threads else [])
        argv = [NBDKIT, "-f", "-r", "--exit-with-parent", "-U", self.socket, "-P",
                self.pid_file, *self.filters]
        argv += ["-t", str(threads)] if threads else []
        if self.kind == "file":
            return [*argv, "file", *tail]
        if self.kind == "plugin":
            return [*argv, "python", str(PLUGIN), *tail]
        return [*argv, "python", str(PASSTHROUGH), *tail]

    def uri(self, export: str = "") -> str:
        return f"nbd+unix:///{export}?socket={self.socket}"

    def start(self) -> Server:
        """Exec the server and poll until its socket accepts a connection."""
        env = dict(os.environ, PYTHONPATH=str(PROJECT))
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, env=env)
        deadline = started + START_TIMEOUT
        while not self._accepts():
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            if time.perf_counter() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name}: not listening after {START_TIMEOUT} s")
            time.sleep(POLL_INTERVAL)  # polling interval; the loop checks the socket
        self.startup_s = time.perf_counter() - started
        if self.control:
            self._wait_control(deadline)
        return self

    def _accepts(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.socket)
            return True
        except OSError:
            return False
        finally:
            probe.close()

    def _wait_control(self, deadline: float) -> None:
        """The control thread starts after nbdkit forks: poll until it answers."""
        while True:
            with contextlib.suppress(Exception):
                if control_request(self.control, {"cmd": "status"}, 2.0).get("ok"):
                    return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{self.name}: control socket does not answer")
            time.sleep(POLL_INTERVAL)

    def ctl(self, request: dict) -> dict:
        reply = control_request(self.control, request)
        if not reply.get("ok"):
            raise RuntimeError(f"{self.name}: control: {reply.get('error')}")
        return reply

    def rss_kib(self) -> int:
        """VmRSS of the server process (nbdkit, which `serve` became)."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError(f"{self.name}: no VmRSS")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        self._log.flush()
        return Path(self.dir, "server.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, STOP_TIMEOUT)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def file_server(data: Path, threads: int | None = None) -> Server:
    return Server("nbdkit file (C)", "file", [f"file={data}"], threads)


def passthrough_server(data: Path, threads: int | None = None, filters: tuple[str, ...] = (),
                       keys: tuple[str, ...] = ()) -> Server:
    return Server("Python pass-through", "passthrough", [f"file={data}", *keys], threads,
                  filters)


def plugin_server(name: str, image, keys: list[str], filters: tuple[str, ...] = ()) -> Server:
    """Our plugin under nbdkit directly (for nbdkit filters, which serve does not pass)."""
    return Server(name, "plugin", [f"data={image.data}", f"hash={image.hash}",
                                   f"root-hash={image.root}", *keys], None, filters)


def verity_server(name: str, image, options: list[str], threads: int | None = None) -> Server:
    return Server(name, "verity", [str(image.data), str(image.hash), image.root, *options],
                  threads)

"""The servers a benchmark compares, each on its own Unix socket, started and stopped by pid.

Six kinds: nbdkit's C `file` plugin (the transport ceiling), its `curl` plugin (an HTTP
image read unverified), the Python pass-through
plugin (bench/passthrough.py: same nbdkit threads and preadv, no verification), the bare
verifying plugin (bench/bareplugin.py: one read_verify per request, the fast path's
ceiling),
`nbd-verity serve` (which execs nbdkit, so the child's pid is nbdkit's), and our plugin
under nbdkit directly (to add nbdkit filters, which `serve` does not pass). Each is started,
awaited and stopped by nbd_verity.launch (ready: the socket accepts, and the control socket
answers where there is one); the time from exec to ready is kept as the start-up time.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from nbd_verity.control.protocol import checked_request  # noqa: E402
from nbd_verity.launch import NBDKIT, PLUGIN, STOP_TIMEOUT, Launched  # noqa: E402

NBD_VERITY = str(Path(sys.executable).parent / "nbd-verity")
PASSTHROUGH = PROJECT / "bench" / "passthrough.py"
BARE = PROJECT / "bench" / "bareplugin.py"
ALL_INLINE = 32 << 20  # every class's threshold at the maximum: every request inline


def inline_options() -> list[str]:
    return [f"--threshold={c}={ALL_INLINE}" for c in ("none", "rt", "be", "idle")]


def pool_options() -> list[str]:
    return [f"--threshold={c}=0" for c in ("none", "rt", "be", "idle")]


class Server(Launched):
    """One server process listening on a Unix socket in a private directory."""

    def __init__(self, name: str, kind: str, argv_tail: list[str], threads: int | None = None,
                 filters: tuple[str, ...] = ()):
        self.kind = kind  # "file", "curl", "nbd", "passthrough", "bare", "verity" (serve),
        # "plugin"
        self.filters = [f"--filter={f}" for f in filters]  # nbdkit filters, before the plugin
        self.dir = tempfile.mkdtemp(prefix="nvb-")  # short: sun_path holds 108 bytes
        sock = os.path.join(self.dir, "nbd.sock")
        self.pid_file = os.path.join(self.dir, "nbd.pid")
        control = os.path.join(self.dir, "ctl.sock") if kind == "verity" else None
        self.socket, self.control = sock, control
        super().__init__(self._argv(argv_tail, threads), socket=sock, control=control,
                         pid_file=self.pid_file,
                         log_path=os.path.join(self.dir, "server.log"),
                         env={**os.environ, "PYTHONPATH": str(PROJECT)}, name=name)

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
        if self.kind == "curl":  # an http(s) image read by nbdkit itself, unverified
            return [*argv, "curl", *tail]
        if self.kind == "nbd":  # another NBD server's export relayed by nbdkit, unverified
            return [*argv, "nbd", *tail]
        if self.kind == "plugin":
            return [*argv, "python", str(PLUGIN), *tail]
        if self.kind == "bare":
            return [*argv, "python", str(BARE), *tail]
        return [*argv, "python", str(PASSTHROUGH), *tail]

    def uri(self, export: str = "") -> str:
        return f"nbd+unix:///{export}?socket={self.socket}"

    def ctl(self, request: dict) -> dict:
        return checked_request(self.control, request)

    def rss_kib(self) -> int:
        """VmRSS of the server process (nbdkit, which `serve` became)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError(f"{self.name}: no VmRSS")

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        died = self.proc is not None and self.proc.poll() is not None
        status = super().stop(timeout)
        if died:  # it ended before it was asked to: say how, with its log's end
            try:
                with open(os.path.join(self.dir, "server.log"), errors="replace") as f:
                    tail = f.read()[-4000:]
            except OSError:
                tail = "(no log)"
            print(f"{self.name}: the server had ended by itself (status {status}); its "
                  f"log ends:\n{tail}", file=sys.stderr)
        shutil.rmtree(self.dir, ignore_errors=True)


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


def checkout_server(name: str, image, checkout: Path, options: list[str] = ()) -> Server:
    """nbd-verity serve of another checkout (its package first on the path; its extensions
    built in place there): a baseline to compare with."""
    server = verity_server(name, image, list(options))
    server.env = {**server.env, "PYTHONPATH": str(checkout)}
    return server


def bare_server(name: str, image, thread_model: str) -> Server:
    """bench/bareplugin.py: one read_verify per request, level 0 in memory."""
    return Server(name, "bare", [f"data={image.data}", f"hash={image.hash}",
                                 f"thread-model={thread_model}"])

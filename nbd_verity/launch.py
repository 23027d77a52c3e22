"""Starting nbdkit: its command line, and servers started, awaited and stopped by pid.

Two ways in. `serve/startup.py` exec_server is `nbd-verity serve`: it builds the Device
once itself, then replaces this process with the command line built here (not a child:
systemd socket activation needs LISTEN_PID to be nbdkit's pid). `Launched` is every other
caller's (tune, the demo, the benchmarks and the
test harnesses): a server process in the foreground, ready when it accepts connections,
ended by its own pid, whatever happened.

Readiness has one rule here: the process still runs, its pid file (if any) is written,
its Unix socket (if any) exists, and its control socket (if any) answers `status`. nbdkit
writes its pid file only once it listens, and our control socket accepts only from
after_fork, so the rule holds for whichever of them a caller can watch (a TCP server in
another network namespace has only its pid file). Without a pid file the socket must
accept a connection instead (nbdkit then logs a broken handshake: give a pid file).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import ConfigError, VerityError

PLUGIN = Path(__file__).resolve().parent / "serve" / "callbacks.py"  # nbdkit's script
PROJECT = PLUGIN.parents[2]  # holds the nbd_verity package (a checkout or site-packages)
NBDKIT = shutil.which("nbdkit") or "/usr/sbin/nbdkit"
START_TIMEOUT = 60.0  # seconds for a server to be ready (the machine may be small and busy)
STOP_TIMEOUT = 15.0  # seconds after SIGTERM before SIGKILL
POLL_INTERVAL = 0.005  # between readiness checks; each check looks at the server itself


class LaunchError(VerityError):
    """A server that exited before it was ready, or was not ready in time."""


# -- the nbdkit command line ----------------------------------------------------------


def nbdkit_command(pairs: Sequence[tuple[str, str]], listen: Mapping) -> list[str]:
    """The nbdkit argv: foreground, read-only, our plugin and its key=value pairs.

    listen holds unix, port, bind, pid_file, threads, exit_with_parent and verbose (each
    optional), as `serve` spells its options."""
    argv = [NBDKIT, "-f", "-r"]
    if listen.get("exit_with_parent"):
        argv.append("--exit-with-parent")
    if listen.get("verbose"):
        argv.append("-v")
    if listen.get("unix"):
        argv += ["-U", os.path.abspath(listen["unix"])]
    elif listen.get("port") is not None:
        argv += ["-p", str(listen["port"]), "-i", listen.get("bind") or "127.0.0.1"]
    if listen.get("pid_file"):
        argv += ["-P", os.path.abspath(listen["pid_file"])]
    if listen.get("threads"):
        argv += ["-t", str(listen["threads"])]
    argv += ["python", str(PLUGIN)]
    argv += [f"{k}={v}" for k, v in pairs]
    return argv


def plugin_environment(base: Mapping | None = None) -> dict:
    """Environment for nbdkit: PYTHONPATH reaches nbd_verity and this install's packages
    (nbdkit runs the plugin as a script, without its folder on sys.path)."""
    env = dict(os.environ if base is None else base)
    paths = [str(PROJECT), sysconfig.get_paths()["purelib"]]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def check_listen(listen: Mapping) -> None:
    """Exactly one place to listen: a Unix socket, a TCP port, or socket activation."""
    if not (listen.get("unix") or listen.get("port") is not None or os.environ.get("LISTEN_FDS")):
        raise ConfigError("listen: give --unix PATH or --port N (or use socket activation)")
    if listen.get("unix") and listen.get("port") is not None:
        raise ConfigError("listen: give --unix or --port, not both")


# -- servers we start and stop --------------------------------------------------------


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT) -> int | None:
    """Stop proc (ours, so its pid is its own) and reap it; return its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def run_to_end(argv: Sequence, timeout: float = 60.0, env: Mapping | None = None,
               **popen) -> subprocess.CompletedProcess:
    """Run a command that must end by itself (a refusal to start, a client), capturing its
    text output; if it is still running after timeout, kill it by pid and raise."""
    argv = [os.fspath(a) for a in argv]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=plugin_environment(env), **popen)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise LaunchError(f"{argv[0]}: still running after {timeout:.0f} s:\n{err}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def accepts(path: str | os.PathLike) -> bool:
    """Whether a Unix socket accepts a connection now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


class Launched:
    """One server process, started in the foreground and stopped by its pid.

    argv is the whole command (`nbd-verity serve ...`, `nbdkit ...`); socket, pid_file
    and control are what readiness watches. Output goes to log_path (or is dropped)."""

    def __init__(self, argv: Sequence, *, socket: str | os.PathLike | None = None,
                 pid_file: str | os.PathLike | None = None,
                 control: str | os.PathLike | None = None,
                 log_path: str | os.PathLike | None = None, env: Mapping | None = None,
                 cwd: str | os.PathLike | None = None, name: str = "server") -> None:
        self.argv = [os.fspath(a) for a in argv]
        self.socket, self.pid_file, self.control = socket, pid_file, control
        self.log_path = log_path
        self.env = plugin_environment(env) if env is not None else plugin_environment()
        self.cwd = cwd
        self.name = name
        self.proc: subprocess.Popen | None = None
        self.startup_s = float("nan")  # from exec to ready

    def start(self, ready: bool = True, timeout: float = START_TIMEOUT) -> Launched:
        """Start the process; with ready (the default), also wait until it is ready, and
        stop it again if it is not."""
        out = (open(self.log_path, "wb") if self.log_path  # noqa: SIM115 - child keeps it
               else subprocess.DEVNULL)
        started = time.perf_counter()
        try:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if ready:
            try:
                self.wait_ready(timeout)
            except BaseException:  # not ready: never leave it running
                self.stop()
                raise
            self.startup_s = time.perf_counter() - started
        return self

    def is_ready(self) -> bool:
        """The readiness rule (see the module docstring), checked once."""
        if self.pid_file is not None:
            try:
                if not Path(self.pid_file).read_text().strip():
                    return False
            except OSError:
                return False
        if self.socket is not None:
            if self.pid_file is not None:  # written after listen: the socket is there
                if not os.path.exists(self.socket):
                    return False
            elif not accepts(self.socket):  # a probe nbdkit logs as a broken handshake
                return False
        if self.control is not None:
            from .control.protocol import request  # the client half only
            try:
                return request(self.control, {"cmd": "status"}, timeout=2.0).get("ok") is True
            except VerityError:
                return False
        return True

    def wait_ready(self, timeout: float = START_TIMEOUT) -> Launched:
        """Poll until ready; LaunchError (with the log's end) if it exits or times out."""
        deadline = time.monotonic() + timeout
        while not self.is_ready():
            try:
                self.proc.wait(timeout=POLL_INTERVAL)  # the polling interval; sees an exit
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise LaunchError(f"{self.name}: not ready after {timeout:.0f} s"
                                      f"{self._tail()}") from None
                continue
            raise LaunchError(f"{self.name}: exited with status {self.proc.returncode} "
                              f"before it was ready{self._tail()}")
        return self

    def _tail(self) -> str:
        text = self.log().strip()
        return f":\n{text[-4000:]}" if text else ""

    def log(self) -> str:
        """Everything the server wrote so far ('' without a log file)."""
        if not self.log_path:
            return ""
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout: float | None = STOP_TIMEOUT) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM by pid, SIGKILL if it hangs; the exit status."""
        return stop_process(self.proc, timeout) if self.proc is not None else None

    def __enter__(self) -> Launched:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

"""Captive upstream servers for `nbd-verity serve https://...` and `s3://...`.

Our Python plugin cannot speak HTTP or S3 itself, and cannot stack nbdkit's C filters on top of
its own sources, so `serve` starts one nbdkit per remote image first, with nbdkit's own `curl`
(or `S3`) plugin, its `retry` filter and, when asked, its `cache` filter, on a private Unix
socket, and gives the verifying server an nbd+unix:// URI instead of the URL. Everything below
our verification is untrusted, the cache included: a cache below the trust boundary is safe (a
wrong byte in it is caught like a wrong byte on the server), one above it would not be.

Lifetime: each upstream runs with `--exit-with-parent` (prctl PR_SET_PDEATHSIG), started by the
`serve` process just before it execs nbdkit. The death signal follows the parent *process*
across execve (exec keeps the pid, and the kernel sends it when the parent thread that forked
the child exits, here the main thread, which is the one that execs), so the upstreams stop when
the verifying nbdkit stops, whatever stops it. The sockets live in a private 0700 directory
(tempfile.mkdtemp) under $RUNTIME_DIRECTORY (systemd's RuntimeDirectory=, removed with the unit)
or $TMPDIR; nbdkit removes its socket and pid file when it exits, the empty directory stays
behind outside systemd.

Secrets never go on a command line (/proc/PID/cmdline is readable by every user): a captive's
argv holds the URL without its user part's password and without its query.
- `http://user:password@host/path`: curl gets `url=http://host/path`, `user=user` (a name, not a
  secret) and `password=+FILE`;
- a URL with a query (a presigned URL's token or signature): nbdkit 1.32 reads no plugin key but
  a password from a file, so such a URL is read by our own small plugin, httpread.py, which
  takes the whole URL as `url-file=FILE`;
- s3:// credentials come from the environment or a credentials file (s3.py).
FILE is 0600 in the private directory; both plugins read it once, at config time, so it is
removed as soon as the upstream is ready (or has failed to start). Every message names URLs
through redact(): no password and no query.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import tempfile
import threading
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from ..launch import NBDKIT, START_TIMEOUT, Launched
from . import s3
from .remote import REMOTE_SCHEMES, redact

HTTPREAD = Path(__file__).resolve().parent / "httpread.py"  # for URLs with a query

# The retry filter's budget: 3 retries after 1, 2 and 4 s (7 s in all) keeps a request
# under the Linux nbd client's 30 s default timeout, yet rides out a server restart.
RETRY_KEYS = ("retries=3", "retry-delay=1")


@dataclass(frozen=True)
class UpstreamOptions:
    """How `serve` builds each captive upstream."""

    cache: bool = False  # nbdkit's cache filter (cache-on-read) below verification
    cache_size: str | None = None  # the cache filter's cache-max-size, e.g. "1G"
    s3: s3.S3Options = field(default_factory=s3.S3Options)  # endpoint and credentials


def is_remote(text: str) -> bool:
    """An image named by a URL that needs a captive upstream (http, https, s3)."""
    return urllib.parse.urlsplit(text).scheme in REMOTE_SCHEMES


def secret_of(url: str) -> str | None:
    """What of an http(s) URL must not go on a command line, to be written in the
    upstream's secret file: the whole URL when it has a query (httpread.py reads it),
    else the password of its user part (curl's password=+FILE), else None."""
    parts = urllib.parse.urlsplit(url)
    if s3.is_s3(url):
        return None
    if parts.query:
        return url
    return None if parts.password is None else urllib.parse.unquote(parts.password)


def plugin_args(url: str, options: UpstreamOptions | None = None,
                secret_file: str | None = None) -> list[str]:
    """nbdkit's plugin and its keys for one URL; what secret_of(url) gives goes only
    in secret_file, named here (see the module docstring)."""
    if s3.is_s3(url):
        return s3.plugin_args(url, (options or UpstreamOptions()).s3)
    parts = urllib.parse.urlsplit(url)
    if secret_of(url) is not None and secret_file is None:
        raise ValueError(f"{redact(url)}: its secret needs a file")
    if parts.query:
        return ["python", str(HTTPREAD), f"url-file={secret_file}"]
    host = parts.netloc.rpartition("@")[2]
    # protocols= keeps a redirect from leaving HTTP(S) (file://, for one)
    args = ["curl", f"url={urllib.parse.urlunsplit((parts.scheme, host, parts.path, '', ''))}",
            "protocols=http,https"]
    if parts.username is not None:
        args.append(f"user={urllib.parse.unquote(parts.username)}")
    if parts.password is not None:
        args.append(f"password=+{secret_file}")
    return args


def write_secret(path: str, text: str) -> None:
    """TEXT in a new file only its owner can read (the private directory is 0700 too)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def upstream_argv(url: str, socket_path: str, pid_file: str,
                  options: UpstreamOptions, secret_file: str | None = None) -> list[str]:
    """The captive nbdkit for one URL: read-only, foreground, dies with its parent."""
    argv = [NBDKIT, "-f", "-r", "--exit-with-parent", "-U", socket_path, "-P", pid_file,
            "--filter=multi-conn"]
    # multi-conn: curl and S3 do not advertise it (they cannot flush), but this export is
    # read-only and what it serves is verified, so parallel connections are safe and let
    # the source read in parallel (remote.NbdSource uses one connection otherwise).
    keys = ["multi-conn-mode=unsafe", *RETRY_KEYS]
    if options.cache:  # filters nearest the client come first: cache above retry
        argv.append("--filter=cache")
        keys.append("cache-on-read=true")
        if options.cache_size:
            keys.append(f"cache-max-size={options.cache_size}")
    argv.append("--filter=retry")
    return [*argv, *plugin_args(url, options, secret_file), *keys]


def private_directory() -> str:
    """A fresh 0700 directory for the upstream sockets (short: sun_path is 108 bytes)."""
    base = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or None
    return tempfile.mkdtemp(prefix="nbd-verity-up-", dir=base)


def start_upstream(url: str, directory: str, name: str,
                   options: UpstreamOptions) -> tuple[str, Launched]:
    """Start one captive upstream and wait until it listens: (its URI, the process).

    Its stderr is ours (the terminal or the journal), so curl's errors are seen; its
    environment is ours too, with the S3 profile and credentials file set (s3.py). Its
    secret file, if any, is removed once it is ready or has failed: it was read at
    config time."""
    path = os.path.join(directory, name)
    sock, pid_file, secret_file = f"{path}.sock", f"{path}.pid", None
    secret = secret_of(url)
    if secret is not None:
        secret_file = f"{path}.secret"
        write_secret(secret_file, secret)
    server = Launched(upstream_argv(url, sock, pid_file, options, secret_file),
                      socket=sock, pid_file=pid_file, env=options.s3.environment(),
                      name=f"upstream for {name} ({redact(url)})")
    try:
        server.proc = _spawn(server.argv, server.env)
        try:
            server.wait_ready(START_TIMEOUT)
        except BaseException:
            stop_upstreams([server])
            raise
    finally:
        if secret_file is not None:
            os.unlink(secret_file)
    return f"nbd+unix:///?socket={sock}", server


def attach(images: dict[str, str], options: UpstreamOptions,
           started_servers: list | None = None, checked=()) -> dict[str, str]:
    """Replace each remote URL in images (role -> location) by the URI of its captive
    upstream; local paths and NBD URIs pass through. One URL used twice (data and tree
    in one object) gets one upstream. Stops what it started if one fails to start; the
    servers started are appended to started_servers (to stop them with the image).
    Each S3 object is read once first, so that a missing key or wrong credentials is one
    line, not a captive nbdkit that fails at its first connection (unless the caller
    has read it already: checked)."""
    remote = {role: text for role, text in images.items() if is_remote(text)}
    if not remote:
        return dict(images)
    for text in remote.values():
        if s3.is_s3(text):
            s3.plugin_args(text, options.s3)  # refuse a bad URL before starting anything
    for text in dict.fromkeys(t for t in remote.values() if s3.is_s3(t)):
        if text not in checked:
            s3.check_object(text, options.s3)
    directory = private_directory()
    started: dict[str, str] = {}
    servers: list[Launched] = []
    try:
        for role, text in remote.items():
            if text not in started:
                uri, server = start_upstream(text, directory, role, options)
                started[text] = uri
                servers.append(server)
    except BaseException:
        stop_upstreams(servers)
        _remove_empty(directory)
        raise
    if started_servers is not None:
        started_servers.extend(servers)
    return {role: started.get(text, text) for role, text in images.items()}


def stop_upstreams(servers: list) -> None:
    """Stop captive upstreams by pid and remove what they leave in their private
    directory (nbdkit 1.32 leaves its socket and pid file), then the directory once
    empty: a refused or closed remote export leaves nothing behind."""
    for server in servers:
        server.stop()
        for path in (server.socket, server.pid_file):
            if path:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if server.socket:
            _remove_empty(os.path.dirname(server.socket))


def _remove_empty(directory: str) -> None:
    with contextlib.suppress(OSError):  # not empty: another upstream of the image lives
        os.rmdir(directory)


class _Spawner:
    """The one thread that starts captive upstreams. nbdkit's --exit-with-parent is
    PR_SET_PDEATHSIG, which fires when the *thread* that forked the child ends: an
    upstream started on a reload's short-lived opener thread would die with it. So every
    Popen of another thread runs here, on a daemon thread that lives as long as the
    process (made anew in a forked child, where the parent's threads are gone); the main
    thread starts its own (it lives on through `serve`'s exec of nbdkit: a thread of
    its own would end at the exec)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _thread and _jobs' creation
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def spawn(self, argv: list[str], env) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread():  # lives on, even
            return self._popen(argv, env)  # through `serve`'s exec of nbdkit
        done: Future = Future()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._jobs = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._loop, args=(self._jobs,),
                                                name="upstream-spawner", daemon=True)
                self._thread.start()
            self._jobs.put((argv, env, done))
        return done.result()

    @staticmethod
    def _popen(argv: list[str], env) -> subprocess.Popen:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                env=env)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            argv, env, done = jobs.get()
            try:
                done.set_result(_Spawner._popen(argv, env))
            except BaseException as e:  # raised in the caller's thread
                done.set_exception(e)


_spawn = _Spawner().spawn

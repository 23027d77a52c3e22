"""The nbdkit callbacks of nbd-verity (loaded by the top-level plugin.py, or directly).

`nbdkit python /abs/path/plugin.py data=... hash=...` runs them; `nbd-verity serve` points
nbdkit at this file itself so that an installed package needs no file outside it. Every
callback is a few lines that delegate to the one server object, a Device (one image,
serve/device.py) or an ExportSet (the exports of a directory, serve/exportset.py: open
picks one by name, list_exports lists them), and translate errors at this edge:
corruption and I/O errors become EIO via nbdkit.set_error, and under
restart-on-corruption a corruption also stops the server (see _restart). pread keeps the
thread's Python thread state for the requests after it (serve/threadstate.py; close gives
it back), waits at the class gate while a better class is busy (schedule/gate.py: open
and close count the connections it ranks), offers the request to its connection's fast
path (serve/fastpath.py: the common request, one frame and one native call), and hands
whatever that declines to the general path, Dispatcher.read (schedule/dispatch.py).

A failed request is raised by nbdkit_compat.FailureRaiser, outside any `except` block, so
that nbdkit 1.32's leak of every failed callback's exception costs nothing (see there);
requests above the advertised maximum fail with EINVAL before any work. The thread model
is configured, or settled by thread_model() (auto: parallel for an image whose reads wait,
read over a network or a local one mostly not in the page cache (sources/resident.py),
where nbdkit has no disconnect race, nbdkit_compat; otherwise serialize-requests, and for
an image that waits a start-up line that says how to get more in flight).
"""

import ctypes
import errno
import os
import sys
import threading
import traceback
from threading import get_ident

import nbdkit

from nbd_verity import logbound
from nbd_verity.errors import ConfigError, CorruptionError, ImageIOError, VerityError
from nbd_verity.ioclass import CLASSES
from nbd_verity.limits import MAX_REQUEST_SIZE
from nbd_verity.log import log
from nbd_verity.prepare.config import (
    AUTO,
    PARALLEL,
    SERIALIZE_ALL_REQUESTS,
    SERIALIZE_REQUESTS,
    ConfigBuilder,
)
from nbd_verity.read.counters import RESTART_ON_CORRUPTION
from nbd_verity.schedule import gate
from nbd_verity.serve import device, nbdkit_compat, threadstate
from nbd_verity.serve.drain import Drain
from nbd_verity.sources import remote, resident

API_VERSION = 2
__all__ = ["API_VERSION", "after_fork", "block_size", "cache", "can_cache", "can_multi_conn",
           "can_write", "cleanup", "close", "config", "config_complete", "default_export",
           "export_description",
           "get_ready", "get_size", "is_rotational", "list_exports", "open", "pread",
           "thread_model"]

RESTART_GRACE_S = 0.5  # time for the failing request's reply before the process exits
EXIT_RESTART = 75  # exit status after restart-on-corruption (EX_TEMPFAIL): supervisor restarts
_builder = ConfigBuilder()
_server = None  # a Device (one image) or an ExportSet (the exports of a directory): the
# same calls (open, closed, list, corruptions, start_threads, close)
_drain = Drain()  # `ctl stop` (serve/drain.py); made again in get_ready with the control path
_restart_requested = threading.Event()
_format_exception = traceback.format_exception
_failed_reads = [0]  # requests answered with an error, for the log summary
_failed_lock = threading.Lock()
_keep = threadstate.keep
_gate = gate.gate


def _one_line(exc, value=None, tb=None, **kwargs):
    """nbdkit prints a callback's exception with traceback.format_exception: show our
    own errors as their one-line message, and anything else in full."""
    error = value if value is not None else exc
    if isinstance(error, VerityError):
        return [str(error)]
    return _format_exception(exc, value, tb, **kwargs)


# The one replacement of traceback.format_exception, from import on (config() errors are
# one line too); whether to give nbdkit's leaked references back is known at
# config_complete for the versions read, and found out at the first failures otherwise.
def _leak_verdict(kept: bool) -> None:
    """What the first failures showed of an nbdkit whose source we have not read."""
    version = nbdkit_compat.version_text(nbdkit_compat.nbdkit_version())
    log(f"nbdkit {version} keeps every failed request's exception: its references are "
        f"given back" if kept else f"nbdkit {version} frees failed requests' exceptions")


_failures = nbdkit_compat.FailureRaiser(nbdkit.set_error, None, _one_line, _leak_verdict)
_failures.install()


def _peer(what: str) -> int:
    """The "pid" or "uid" of the current connection's client (-1 when unknown, as over
    TCP). nbdkit.peer_pid()/peer_uid() where the Python plugin has them (nbdkit 1.42:
    ValueError "Unable to get client pid" over TCP); nbdkit 1.32's lacks them, so there
    the server's own nbdkit_peer_pid()/nbdkit_peer_uid() through ctypes."""
    binding = getattr(nbdkit, f"peer_{what}", None)
    if binding is not None:
        try:
            return binding()
        except (ValueError, RuntimeError):
            return -1
    try:
        return getattr(ctypes.CDLL(None), f"nbdkit_peer_{what}")()
    except (AttributeError, OSError):
        return -1


def _peer_pid() -> int:
    return _peer("pid")


def _peer_uid() -> int:
    return _peer("uid")


def _may_name(io_class: int) -> bool:
    """Whether this connection's client may choose io_class by name although it ranks
    above the default: `--allow-class CLASS` for every client, `CLASS=UID,...` for those
    peers (ioclass.py)."""
    allowed = _config.allow_classes
    name = CLASSES[io_class]
    if name not in allowed:
        return False
    return allowed[name] is None or _peer_uid() in allowed[name]


def _stopping() -> bool:
    """Whether nbdkit is shutting down (SIGTERM) or this thread's client has gone.

    nbdkit has no call that asks it, but nbdkit_nanosleep (1.32 and 1.42 alike) waits on
    nbdkit's quit pipe and on the connection's status and socket: with no time to sleep
    it returns -1 at once (after logging "aborting sleep to shut down") when either has
    ended, 0 otherwise. Asked only after a wait on an NBD source timed out a slice, and
    only on nbdkit's own threads (Python sees them as dummy threads): anywhere else (the
    start-up check of the root, a reload on the control thread, the hash fetches) 1.32
    asserts that the caller serves a connection, and aborts."""
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return False
    try:
        return ctypes.CDLL(None).nbdkit_nanosleep(0, 0) != 0
    except (AttributeError, OSError):
        return False


def _hang_up():
    """A read ended because the server stops: close this connection (where nbdkit's Python
    plugin has nbdkit.disconnect: Debian 13's 1.42, not 1.32).
    In the parallel model another worker of the connection sits in a read of the socket
    for the client's next request, and nbdkit exits only once that ends: the shut socket
    makes the client hang up (a kernel /dev/nbdX too). A serialising model would close it
    after this reply anyway; older nbdkit waits for the client."""
    disconnect = getattr(nbdkit, "disconnect", None)
    if disconnect is not None:
        disconnect(False)


def _restart():
    """restart-on-corruption, as the kernel's panic-free variant: stop serving, and exit
    with the status that asks the supervisor for a restart. nbdkit.shutdown() stops new
    connections; nbdkit.disconnect() (newer nbdkit) also drops this client; and since
    nbdkit otherwise waits for clients that never hang up (a kernel /dev/nbdX), the
    process exits after a short grace that lets the failing request's EIO reply go out."""
    if _restart_requested.is_set():
        return
    _restart_requested.set()
    log("restart-on-corruption: shutting the server down")
    nbdkit.shutdown()
    disconnect = getattr(nbdkit, "disconnect", None)  # nbdkit >= 1.34
    if disconnect is not None:
        disconnect(False)
    timer = threading.Timer(RESTART_GRACE_S, _exit_for_restart)
    timer.daemon = True
    timer.start()


def _exit_for_restart():
    logbound.uninstall()
    sys.stderr.flush()
    os._exit(EXIT_RESTART)


_THREAD_MODELS = {
    SERIALIZE_REQUESTS: nbdkit.THREAD_MODEL_SERIALIZE_REQUESTS,
    SERIALIZE_ALL_REQUESTS: nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS,
    PARALLEL: nbdkit.THREAD_MODEL_PARALLEL,
}


def thread_model():
    name = _config.effective_thread_model
    waits = _config.waits or _cold_local_image(name)
    if name == AUTO:
        name = nbdkit_compat.auto_thread_model(waits, nbdkit_compat.nbdkit_version(),
                                               hasattr(nbdkit, "disconnect"))
        if name == PARALLEL:
            log("thread-model parallel: a connection's requests reach the image together")
    elif name == SERIALIZE_REQUESTS and waits:
        nbdkit_compat.say_one_at_a_time(nbdkit_compat.nbdkit_version())
    if name == PARALLEL:
        version = nbdkit_compat.nbdkit_version()
        if nbdkit_compat.has_send_race(version):
            log(f"thread-model=parallel: nbdkit {nbdkit_compat.version_text(version)} aborts "
                f"when a client disconnects with requests in flight (fixed in nbdkit 1.34.0):"
                f" any client can stop this server")
    return _THREAD_MODELS[name]


def _cold_local_image(name: str) -> bool:
    """Whether a local data image waits on its disk: most of it is not in the page cache
    now (sources/resident.py), said in one line. Asked only where it can change the thread
    model (auto or serialize-requests) and for one image (an export directory's images come
    and go after the model is fixed)."""
    if name not in (AUTO, SERIALIZE_REQUESTS) or _config.exports is not None:
        return False
    cold, share = resident.cold(_config.data)
    if cold:
        log(f"the data image is not in the page cache ({share:.0%} of {resident.SAMPLES} "
            f"pages sampled): its reads wait on the disk")
    return cold


def config(key, value):
    _builder.add(key, value)


def config_complete():
    global _config
    _config = _builder.build()
    _failures.compensate = nbdkit_compat.leaks_failures(nbdkit_compat.nbdkit_version())


def get_ready():
    global _server, _drain
    _drain = Drain(exclude_paths=(_config.control or "",), peer_pid=_peer_pid)
    hooks = device.Hooks(peer_pid=_peer_pid, stopping=_stopping, may_name=_may_name,
                         stop=lambda: _drain.stop(nbdkit.shutdown))
    if _config.exports is not None:
        from nbd_verity.serve.exportset import ExportSet  # many images, one server
        _server = ExportSet(_config, hooks)
        _server.reload()  # a refused file is logged; the others serve
        return
    _server = device.Device(_config, hooks)
    for warning in _server.trust.warnings:  # an expired signer, unreadable trusted certs
        log(f"warning: {warning}")


def after_fork():
    remote.forked()  # nbdkit's fork is not Python's: the NBD sources' reapers start anew
    logbound.install(_config.log_rate, _log_totals)
    _server.start_threads()


def _log_totals():
    """(corruptions, failed reads) so far, for the log summary."""
    return _server.corruptions(), _failed_reads[0]


def cleanup():
    logbound.uninstall()
    if _server is not None:
        _server.close()
        if _restart_requested.is_set():
            _exit_for_restart()


def list_exports(readonly, is_tls):
    """NBD_OPT_LIST: every export with its description (one image: the default one),
    only with list-exports=true; otherwise refused, as nbd-server's allowlist = false
    (connecting by name needs no list)."""
    if not _config.list_exports:
        nbdkit.set_error(errno.EPERM)
        raise ConfigError("listing exports is off (serve --list-exports turns it on)")
    return _server.list()


def default_export(readonly, is_tls):
    return ""


def open(readonly):
    problem = None
    if _drain.draining:  # `ctl stop`: a reconnecting client finds the next server
        _failures.fail(errno.ESHUTDOWN, "the server is stopping")
    try:
        h = _server.open(nbdkit.export_name())
        _gate.opened(h.io_class)  # ranked against the other connections (schedule/gate.py)
        return h
    except ConfigError as e:  # an unknown class in the export name, or export
        problem = str(e)
        errnum = errno.ENOENT if "not served" in problem else errno.EINVAL
    _failures.fail(errnum, problem)  # outside the except block: nothing kept


def close(h):
    _gate.closed(h.io_class)
    threadstate.release()  # this thread's kept state, when requests ran on it (threadstate.py)
    _server.closed(h)


def get_size(h):
    return h.device.size


def export_description(h):
    """NBD_INFO_DESCRIPTION: the image, by its root hash (nbd-verity attach checks it)."""
    return h.device.description()


def block_size(h):
    return (1, h.device.geo.data_block_size, MAX_REQUEST_SIZE)


def can_write(h):
    return False


def can_multi_conn(h):
    return True


def can_cache(h):
    return nbdkit.CACHE_NATIVE


def is_rotational(h):
    return False


def pread(h, buf, offset, flags):
    """Every call here before the fast path is one the fast path's requests pay: the class
    gate is asked only while connections of two ranks are open (one attribute read
    otherwise)."""
    _keep()  # from the second request of a thread on: no new Python thread state
    ahead = h.readahead  # one that reads ahead knows its requests in flight (readahead.py)
    if ahead is not None:
        me = get_ident()
        ahead.in_flight.add(me)
    # with connections of two ranks open, the gate may make it wait while a better class
    # is busy, and counts it while a worse one watches (schedule/gate.py)
    counted = _gate.ranked and _gate.enter(h.io_class)
    try:
        try:
            if h.fast(buf, offset):  # the common request, in one frame more (fastpath.py)
                return
            if len(buf) > MAX_REQUEST_SIZE:  # nbdkit 1.32 does not enforce the maximum
                problem = (errno.EINVAL, f"read of {len(buf)} bytes exceeds the maximum "
                                         f"{MAX_REQUEST_SIZE}")
            else:  # the general path (schedule/dispatch.py)
                h.device.dispatcher.read(memoryview(buf), offset, h)
                return
        except CorruptionError as e:
            if h.device.config.mode == RESTART_ON_CORRUPTION:
                _restart()
            problem = errno.EIO, str(e)
        except ImageIOError as e:  # counted and logged by the dispatcher (or the fast path)
            problem = errno.EIO, str(e)
            if _stopping():
                _hang_up()
    finally:
        if counted:
            _gate.leave(h.io_class)
        if ahead is not None:
            ahead.in_flight.discard(me)
    with _failed_lock:
        _failed_reads[0] += 1
    _failures.fail(*problem)  # outside any except block: see nbdkit_compat


def cache(h, count, offset, flags):
    """NBD_CMD_CACHE in pieces of the largest request: its work stays bounded."""
    problem = None
    try:
        for start in range(offset, offset + count, MAX_REQUEST_SIZE):
            h.cache(min(MAX_REQUEST_SIZE, offset + count - start), start)
    except VerityError as e:
        problem = str(e)
    if problem is not None:
        _failures.fail(errno.EIO, problem)

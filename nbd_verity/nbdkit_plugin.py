"""The nbdkit callbacks of nbd-verity (loaded by the top-level plugin.py, or directly).

`nbdkit python /abs/path/plugin.py data=... hash=...` runs them; `nbd-verity serve` points
nbdkit at this file itself so that an installed package needs no file outside it. Every
callback is a few lines that delegate to nbd_verity.server and translate errors:
corruption and I/O errors become EIO via nbdkit.set_error.
"""

import ctypes
import errno
import os
import sys
import threading
import traceback

import nbdkit

from nbd_verity import server
from nbd_verity.config import ConfigBuilder
from nbd_verity.errors import ConfigError, CorruptionError, ImageIOError, VerityError

API_VERSION = 2
__all__ = ["API_VERSION", "after_fork", "block_size", "cache", "can_cache", "can_multi_conn",
           "can_write", "cleanup", "config", "config_complete", "get_ready", "get_size",
           "is_rotational", "open", "pread", "thread_model"]

RESTART_GRACE_S = 0.5  # time for the failing request's reply before the process exits
_builder = ConfigBuilder()
_device = None
_format_exception = traceback.format_exception


def _one_line(exc, value=None, tb=None, **kwargs):
    """nbdkit prints a callback's exception with traceback.format_exception: show our
    own errors as their one-line message, and anything else in full."""
    error = value if value is not None else exc
    if isinstance(error, VerityError):
        return [str(error)]
    return _format_exception(exc, value, tb, **kwargs)


traceback.format_exception = _one_line


def _peer_pid():
    """nbdkit_peer_pid() of the current connection (-1 when unknown); Python lacks it."""
    try:
        return ctypes.CDLL(None).nbdkit_peer_pid()
    except (AttributeError, OSError):
        return -1


def _shutdown_for_restart():
    """restart-on-corruption: ask nbdkit to stop, and make sure the process ends even
    while clients stay connected (nbdkit waits for them; a kernel /dev/nbdX never hangs
    up): after a short grace for the failing request's EIO reply, exit with the status
    that asks the supervisor for a restart."""
    nbdkit.shutdown()
    timer = threading.Timer(RESTART_GRACE_S, _exit_for_restart)
    timer.daemon = True
    timer.start()


def _exit_for_restart():
    sys.stderr.flush()
    os._exit(server.EXIT_RESTART)


def thread_model():
    if _config.serialize:
        return nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS
    return nbdkit.THREAD_MODEL_PARALLEL


def config(key, value):
    _builder.add(key, value)


def config_complete():
    global _config
    _config = _builder.build()


def get_ready():
    global _device
    hooks = server.Hooks(shutdown=_shutdown_for_restart, export_name=nbdkit.export_name,
                         peer_pid=_peer_pid)
    _device = server.Device(_config, hooks)


def after_fork():
    _device.start_threads()


def cleanup():
    if _device is not None:
        _device.close()
        if _device.restart_requested:
            _exit_for_restart()


def open(readonly):
    try:
        return server.Connection.open(_device)
    except ConfigError:  # an unknown class in the export name
        nbdkit.set_error(errno.EINVAL)
        raise


def get_size(h):
    return _device.size


def block_size(h):
    return (1, _device.geo.data_block_size, 32 * 1024 * 1024)


def can_write(h):
    return False


def can_multi_conn(h):
    return True


def can_cache(h):
    return nbdkit.CACHE_NATIVE


def is_rotational(h):
    return False


def pread(h, buf, offset, flags):
    try:
        h.read(memoryview(buf), offset)
    except (CorruptionError, ImageIOError):
        nbdkit.set_error(errno.EIO)
        raise


def cache(h, count, offset, flags):
    h.cache(count, offset)

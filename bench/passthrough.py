"""A Python pass-through nbdkit plugin: reads the file without verifying anything.

It is the Python ceiling for benchmarks: same nbdkit, same threads, same preadv straight
into nbdkit's buffer as nbd-verity, minus the hashing and bookkeeping.
With uri=NBD-URI instead of file=, it relays an NBD server's reads the same way: one
libnbd connection per nbdkit thread, each read sent into nbdkit's buffer and polled for
on the request's thread (as nbd-verity's fast path for an image read over NBD), nothing
read ahead, nothing verified.
With keep-thread-state=yes it keeps each nbdkit thread's Python thread state between
requests as nbd-verity does (nbd_verity/serve/threadstate.py; needs nbd_verity on
PYTHONPATH and its _threadstate extension built), so the ceiling is measured both ways.
Usage: nbdkit python bench/passthrough.py file=/abs/path.img [keep-thread-state=yes]
       nbdkit python bench/passthrough.py uri=nbd+unix:///?socket=/abs/d.sock [...]
"""

import os
import threading

import nbdkit

API_VERSION = 2
_path = None
_fd = -1
_keep = None  # _threadstate.keep, with keep-thread-state=yes
_uri = None  # uri=: the NBD server relayed
_size = 0
_local = threading.local()  # uri=: each nbdkit thread's own libnbd handle


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def config(key, value):
    global _path, _keep
    if key == "keep-thread-state":
        if value == "yes":
            from nbd_verity._threadstate import keep as _keep
        return
    if key == "uri":
        global _uri
        _uri = value
        return
    if key != "file":
        raise RuntimeError(f"unknown parameter: {key}")
    _path = os.path.abspath(value)


def _handle():
    h = getattr(_local, "h", None)
    if h is None:
        import nbd
        h = _local.h = nbd.NBD()
        h.connect_uri(_uri)
    return h


def get_ready():
    global _fd, _size
    if _uri is not None:
        _size = _handle().get_size()
        return
    _fd = os.open(_path, os.O_RDONLY)


def open(readonly):
    return 1


def get_size(h):
    return _size if _uri is not None else os.fstat(_fd).st_size


def can_write(h):
    return False


def can_multi_conn(h):
    return True


def pread(h, buf, offset, flags):
    if _keep is not None:
        _keep()
    if _uri is not None:
        import nbd
        nh = _handle()
        cookie = nh.aio_pread(nbd.Buffer.from_buffer(buf), offset)
        while not nh.aio_command_completed(cookie):
            nh.poll(-1)
        return
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(_fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError("short read")
        done += n

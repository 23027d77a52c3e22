"""A Python pass-through nbdkit plugin: reads the file without verifying anything.

It is the Python ceiling for benchmarks: same nbdkit, same threads, same preadv straight
into nbdkit's buffer as nbd-verity, minus the hashing and bookkeeping.
Usage: nbdkit python bench/passthrough.py file=/abs/path.img
"""

import os

import nbdkit

API_VERSION = 2
_path = None
_fd = -1


def thread_model():
    return nbdkit.THREAD_MODEL_PARALLEL


def config(key, value):
    global _path
    if key != "file":
        raise RuntimeError(f"unknown parameter: {key}")
    _path = os.path.abspath(value)


def get_ready():
    global _fd
    _fd = os.open(_path, os.O_RDONLY)


def open(readonly):
    return 1


def get_size(h):
    return os.fstat(_fd).st_size


def can_write(h):
    return False


def can_multi_conn(h):
    return True


def pread(h, buf, offset, flags):
    view = memoryview(buf)
    done = 0
    while done < len(view):
        n = os.preadv(_fd, [view[done:]], offset + done)
        if n == 0:
            raise OSError("short read")
        done += n

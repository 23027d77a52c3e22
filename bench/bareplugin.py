"""The ceiling of a verifying Python plugin: one read_verify call per request, nothing else.

An nbdkit Python plugin for measurement only, never for serving: it holds the whole of
level 0 of the tree in memory, read once at start-up and not checked against the root, and
its pread is the least a verifying plugin can do: one native read_verify (preadv into
nbdkit's buffer, SHA-256 of each block, compare with its slot) per level-0 block the
request covers, no counters, no cache, no class; like nbd-verity it keeps each nbdkit
thread's Python thread state between requests (nbd_verity/serve/threadstate.py). nbd-
verity's fast path is measured against it (bench/threads.py): the gap is the fast path's
own bookkeeping.
Usage: nbdkit python bench/bareplugin.py data=D hash=H [thread-model=parallel|
serialize-requests|serialize-all-requests]   (Python 3 with nbd_verity on PYTHONPATH)
"""

import os

import nbdkit

from nbd_verity.format.params import load_params
from nbd_verity.serve.threadstate import keep
from nbd_verity.sources.source import ImageFile

API_VERSION = 2
_MODELS = {"parallel": nbdkit.THREAD_MODEL_PARALLEL,
           "serialize-requests": nbdkit.THREAD_MODEL_SERIALIZE_REQUESTS,
           "serialize-all-requests": nbdkit.THREAD_MODEL_SERIALIZE_ALL_REQUESTS}
_keys = {"thread-model": "serialize-requests"}
_state = {}


def thread_model():
    return _MODELS[_keys["thread-model"]]


def config(key, value):
    if key not in ("data", "hash", "thread-model"):
        raise RuntimeError(f"unknown parameter: {key}")
    if key == "thread-model" and value not in _MODELS:
        raise RuntimeError(f"thread-model: {value!r} is not one of {', '.join(_MODELS)}")
    _keys[key] = os.path.abspath(value) if key != "thread-model" else value


def get_ready():
    data = ImageFile(_keys["data"], "data")
    hashes = ImageFile(_keys["hash"], "hash")
    params = load_params(_keys["hash"], {}, data.size(), source=hashes)
    geo = params.geometry()
    hbs = geo.hash_block_size
    level0 = bytes(hashes.read(geo.level_blocks[0] * hbs, geo.level_start[0] * hbs))
    _state.update(fd=data.fd, geo=geo, level0=level0, size=geo.data_size, keep=(data, hashes),
                  read_verify=params.digester().native.read_verify)


def open(readonly):
    return 1


def get_size(h):
    return _state["size"]


def can_write(h):
    return False


def can_multi_conn(h):
    return True


def pread(h, buf, offset, flags):
    """Aligned requests only (fio's are): each leaf's run in one read_verify call."""
    keep()
    s = _state
    geo, level0, read_verify, fd = s["geo"], s["level0"], s["read_verify"], s["fd"]
    dbs = geo.data_block_size
    view = memoryview(buf)
    first, count = offset // dbs, len(buf) // dbs
    done = 0
    while done < count:
        run = geo.run_under_parent(first + done, count - done)
        leaf, slot = geo.parent_slot(first + done)
        piece = view[done * dbs:(done + run) * dbs]
        if read_verify(fd, piece, (first + done) * dbs, dbs, level0,
                       leaf * geo.hash_block_size + slot) != -1:
            nbdkit.set_error(5)  # EIO
            raise RuntimeError(f"block {first + done}: does not match")
        done += run

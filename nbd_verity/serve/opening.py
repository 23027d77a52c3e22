"""Opening export files off the map's lock: what tells an export changed, and many opened
at once within a deadline.

A reload (serve/exportset.py) opens each new or changed export file on a daemon thread
of its own, at most OPENERS at once, for a deadline in all (open_all); what is still
opening then is refused in one line, and closed unseen when it ends. An export's identity
is its file's (size, times, inode: file_identity) and the state of every local file its
trust rests on (trust_identity); a reload that finds the trust changed opens it anew.
Nothing here holds a lock: the futures carry each result to the reload's thread.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, wait

from ..errors import VerityError
from ..log import log
from ..prepare.config import ServerConfig
from ..trust.certs import DEFAULT_SEARCH_PATH
from ..trust.sidecar import auxiliary_path

OPENERS = 4  # export files one reload opens at once (each may wait on the network)
# what sits beside a local image and may carry its trust (trust/sidecar.py)
SIDECAR_SUFFIXES = (".roothash", ".roothash.p7s", ".usrhash", ".usrhash.p7s", ".verity")


def file_identity(path: str) -> tuple:
    """What tells a file changed: its size, times (ctime: a chmod, an xattr) and inode."""
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def trust_identity(config: ServerConfig, spec) -> tuple:
    """The state of every local file an export's trust rests on: the server's trusted
    certificates (a file, a directory, or verity.d's places), the export's root hash and
    signature files, and the sidecars beside a local image. A reload that finds it
    changed opens the export anew, and drops it if it no longer opens."""
    places = ((config.trusted_certs,) if config.trusted_certs else DEFAULT_SEARCH_PATH)
    files = [*places, spec.options.get("root_hash_file"),
             spec.options.get("root_hash_signature")]
    if "://" not in spec.data:
        files += [auxiliary_path(spec.data, suffix) for suffix in SIDECAR_SUFFIXES]
    return tuple((path, _state(path)) for path in files if path)


def _state(path: str):
    """A file's identity; a directory's, with its entries' (a certificate added or
    removed); None when absent."""
    try:
        identity = file_identity(path)
    except OSError:
        return None
    if not os.path.isdir(path):
        return identity
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return identity
    return identity, tuple((n, _state(os.path.join(path, n))) for n in names)


def open_all(calls: dict, deadline_s: float) -> dict:
    """Run each call (key -> (function, *args)) on a thread of its own, at most OPENERS
    at once, for deadline_s seconds in all: key -> its result, or a one-line reason it
    failed or is still running. What opens after the deadline is closed, never served.
    Daemon threads: one stuck on a silent server never holds up the server's exit."""
    gate = threading.BoundedSemaphore(OPENERS)
    futures = {}
    for key, (function, *args) in calls.items():
        future: Future = Future()
        futures[key] = future
        threading.Thread(target=_run, args=(future, gate, function, args),
                         name="export-open", daemon=True).start()
    wait(futures.values(), timeout=deadline_s)
    results = {}
    for key, future in futures.items():
        if future.done():
            error = future.exception()
            results[key] = why(error) if error is not None else future.result()
            continue
        if not future.cancel():  # running: whatever it opens is closed when it ends
            future.add_done_callback(_close_late)
        results[key] = (f"still opening after {deadline_s:g} s: not served (the next "
                        f"reload tries again)")
    return results


def _run(future: Future, gate, function, args) -> None:
    with gate:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(function(*args))
        except BaseException as e:  # handed to the reload as its reason
            future.set_exception(e)


def _close_late(future: Future) -> None:
    """An export that opened after its reload's deadline: closed, never served."""
    if not future.cancelled() and future.exception() is None:
        export = future.result()
        export.close()
        log(f"export {export.name}: opened after the reload's deadline; closed")


def why(error: BaseException) -> str:
    """One line for a refused export file."""
    if isinstance(error, VerityError):
        return str(error)
    if isinstance(error, OSError):
        return error.strerror or str(error)
    return f"{type(error).__name__}: {error}"


def quiet(line: str) -> None:
    """Warnings of a file only looked at (they are logged when it is opened)."""

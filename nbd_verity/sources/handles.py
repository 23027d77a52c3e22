"""Closing a libnbd handle now, once, on every libnbd this project runs on.

libnbd 1.14's Python class (Debian 12) has no close(): its __del__ closes the handle
whenever it runs, so an early close calls __del__ once and deletes the handle's object
(`_o`), which a second __del__ would otherwise close again. From libnbd 1.16 on (1.22 on
Debian 13) the class has close(), after which __del__ does nothing; there a deleted `_o`
makes the later __del__ raise AttributeError, which Python reports as an unraisable
exception ("Exception ignored in: <function NBD.__del__>"). Both ask `_o`, the one
attribute both versions keep the C handle in, whether the handle is still open.
"""

from __future__ import annotations


def is_open(h) -> bool:
    """Whether the handle was neither closed nor freed (on either libnbd)."""
    return getattr(h, "_o", None) is not None


def close(h, disconnect: bool = True) -> None:
    """Free a handle now; idempotent. With disconnect, a connected handle first sends
    NBD_CMD_DISC (shutdown); without, requests in flight are dropped unanswered."""
    import nbd  # python3-libnbd: imported where a handle exists, as remote.py does

    if not is_open(h):
        return
    if disconnect:
        try:
            if not (h.aio_is_dead() or h.aio_is_closed()):
                h.shutdown()
        except nbd.Error:  # the server went away meanwhile: nothing to say goodbye to
            pass
    if hasattr(h, "close"):  # libnbd >= 1.16
        h.close()
    else:  # libnbd 1.14: __del__ is the close
        h.__del__()
        del h._o

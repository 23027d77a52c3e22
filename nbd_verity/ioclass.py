"""I/O priority classes (linux/ioprio.h) and how a connection gets one.

NBD carries no priority, so a request's class is its connection's class, chosen when the
connection opens, in this order:
  1. the export name `NAME@CLASS` (e.g. `@rt`, or `root@idle`; NAME may be empty). A
     class ranked above the default (rt over be, be over idle) needs the server's
     permission, as the kernel's ioprio_set(IOPRIO_CLASS_RT) needs CAP_SYS_NICE:
     `serve --allow-class CLASS[=UID,...]` (may_name); without it the name's class is
     passed over (one log line) and the connection gets what 2 or 3 give;
  2. on a Unix socket, the I/O priority class of the connecting process, read with the
     ioprio_get(IOPRIO_WHO_PROCESS, pid) syscall (nbdkit knows the peer's pid); a process
     that never set one reports class none and falls through to
  3. the configured default class (`be`).
"""

from __future__ import annotations

import ctypes
import os
import platform

from .errors import ConfigError
from .log import log

IOPRIO_CLASS_SHIFT = 13
IOPRIO_WHO_PROCESS = 1
CLASSES = ("none", "rt", "be", "idle")
# each class's rank, by index: rt first, then be and none (IOPRIO_CLASS_NONE is served as
# be), then idle; the pool's queues, the gate and a promotion by name all rank by it
RANK = (1, 0, 1, 2)


def class_index(name: str, key: str = "class") -> int:
    """0..3 for a class name; ConfigError naming the key otherwise."""
    try:
        return CLASSES.index(name.strip().lower())
    except ValueError:
        raise ConfigError(f"{key}: unknown I/O class {name!r} (one of "
                          f"{', '.join(CLASSES)})") from None


_SYS_IOPRIO_GET = {"x86_64": 252, "aarch64": 31, "i686": 290, "armv7l": 315}


def class_from_export_name(export_name: str) -> int | None:
    """The class named by `NAME@CLASS`, None when the name has no '@'."""
    if "@" not in export_name:
        return None
    _, _, name = export_name.rpartition("@")
    return class_index(name, "export name")


def ioprio_class_of_pid(pid: int) -> int | None:
    """The I/O priority class of a process, or None when it cannot be read."""
    number = _SYS_IOPRIO_GET.get(platform.machine())
    if number is None or pid <= 0:
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(number, IOPRIO_WHO_PROCESS, pid)
    if value < 0:
        return None
    return (value >> IOPRIO_CLASS_SHIFT) & 0x7


def promotes(named: int, default: int) -> bool:
    """Whether a class named ranks above the default (RANK)."""
    return RANK[named] < RANK[default]


def connection_class(export_name: str, peer_pid: int, default: int,
                     may_name=lambda io_class: True) -> int:
    """Pick a connection's class by the rules in this module's docstring; may_name says
    whether this peer may name a class above the default."""
    named = class_from_export_name(export_name)
    if named is not None and promotes(named, default) and not may_name(named):
        log(f"export name {export_name[:64]!r}: class {CLASSES[named]} by name needs the "
            f"server's permission (serve --allow-class {CLASSES[named]}); passed over")
        named = None
    if named is not None:
        return named
    peer = ioprio_class_of_pid(peer_pid) if peer_pid > 0 and peer_pid != os.getpid() else None
    if peer is not None and 0 < peer < len(CLASSES):
        return peer
    return default

"""The threshold table's words and rules: paths, presets, checked changes.

The table holds one byte threshold per I/O class, in the kernel's class order
(IOPRIO_CLASS_NONE, RT, BE, IDLE = 0..3); a request up to its class's threshold is
verified inline, a larger one across the pool (the server's dispatch decides). The server's
dispatch, the control socket and tune share these words; nothing here imports the server.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..ioclass import CLASSES, class_index
from ..limits import MAX_REQUEST_SIZE

INLINE, POOL = "inline", "pool"  # the two paths a request can take
FIXED = (1 << 20,) * 4  # measured once on 2 cores with the native engine (docs/control.md)
# inline up to one pool chunk (schedule/dispatch.POOL_CHUNK_SIZE), which gets nothing from
# the pool but its hand-off; larger requests of a class nobody pinned take the pool when
# it takes them (schedule/dispatch.py)
DEFAULT = (256 << 10,) * 4
ADAPTIVE = "default"  # the preset under which the load decides above it (dispatch.py)
PRESETS = {
    "default": DEFAULT,
    "fixed": FIXED,
    "seed": (4096, 4096, 4096, 4096),  # the seed use_bh_bytes patch
    "kernel": (8192, 8192, 8192, 0),  # Linux 6.15 use_bh_bytes defaults
}


def check_threshold(name: str, value) -> int:
    """A threshold value: an integer from 0 to MAX_REQUEST_SIZE (not a bool or float)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"threshold {name}: {value!r} is not an integer")
    if not 0 <= value <= MAX_REQUEST_SIZE:
        raise ConfigError(f"threshold {name}: {value} is outside 0..{MAX_REQUEST_SIZE}")
    return value


def preset(name: str) -> tuple[int, ...]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"threshold-preset: unknown preset {name!r} (one of "
                          f"{', '.join(PRESETS)})") from None


def updated_table(table: tuple[int, ...], changes: dict) -> tuple[int, ...]:
    """A new table with some classes changed; validates everything before changing any."""
    new = list(table)
    for name, value in changes.items():
        new[class_index(str(name), "threshold")] = check_threshold(str(name), value)
    return tuple(new)


def loaded(name: str, explicit: dict) -> tuple[tuple[int, ...], frozenset]:
    """A preset's table with the explicit thresholds (--threshold) over it, and the classes
    it pins: under `default` only the explicit ones (above their threshold, the others'
    requests take the pool when it takes them: schedule/dispatch.py), under a fixed
    preset every class (the table decides)."""
    table = updated_table(preset(name), explicit)
    if name == ADAPTIVE:
        return table, frozenset(class_index(str(c), "threshold") for c in explicit)
    return table, frozenset(range(len(CLASSES)))


def table_dict(table: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(CLASSES, table, strict=True))

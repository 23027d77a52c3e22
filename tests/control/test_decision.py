"""The pure parts: the inline-or-pool decision as a table, table updates, export names,
and the ioprio class read from real processes started under ionice.

The expected decisions are written out by hand (I = inline, P = pool) for the sizes around
each threshold, not computed with the rule under test.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from nbd_verity import ioclass as ioprio
from nbd_verity.control import table as tables
from nbd_verity.errors import ConfigError
from nbd_verity.schedule import dispatch

from .harness import CLASSES

MAX = 32 << 20  # the largest request the plugin advertises

SIZES = (1, 4095, 4096, 4097, 8191, 8192, 8193, 65536, 65537, MAX)
# table name -> (table, {class: expected path for each of SIZES})
DECISIONS = {
    "seed": ((4096, 4096, 4096, 4096), {
        "none": "IIIPPPPPPP", "rt": "IIIPPPPPPP", "be": "IIIPPPPPPP", "idle": "IIIPPPPPPP"}),
    "default": ((1 << 20,) * 4, {
        "none": "IIIIIIIIIP", "rt": "IIIIIIIIIP", "be": "IIIIIIIIIP", "idle": "IIIIIIIIIP"}),
    "kernel": ((8192, 8192, 8192, 0), {
        # idle 0: no request is 0 bytes, so idle never goes inline (0: all to the pool)
        "none": "IIIIIIPPPP", "rt": "IIIIIIPPPP", "be": "IIIIIIPPPP", "idle": "PPPPPPPPPP"}),
    "mixed": ((0, MAX, 65536, 1), {
        "none": "PPPPPPPPPP", "rt": "IIIIIIIIII", "be": "IIIIIIIIPP", "idle": "IPPPPPPPPP"}),
}
CASES = [
    pytest.param(table, CLASSES.index(name), size, {"I": "inline", "P": "pool"}[mark],
                 id=f"{table_name}-{name}-{size}")
    for table_name, (table, rows) in DECISIONS.items()
    for name, marks in rows.items()
    for size, mark in zip(SIZES, marks, strict=True)
]


@pytest.mark.parametrize(("table", "io_class", "size", "path"), CASES)
def test_decide(table, io_class, size, path):
    assert dispatch.decide(table, io_class, size) == path


def test_presets_are_the_documented_tables():
    assert tables.preset("default") == (dispatch.POOL_CHUNK_SIZE,) * 4  # one pool chunk
    assert tables.preset("fixed") == (1 << 20,) * 4
    assert tables.preset("seed") == (4096, 4096, 4096, 4096)
    assert tables.preset("kernel") == (8192, 8192, 8192, 0)


def test_unknown_preset_is_refused():
    with pytest.raises(ConfigError, match="unknown preset 'turbo'"):
        tables.preset("turbo")


def test_updated_table_changes_only_the_named_classes():
    table = (1, 2, 3, 4)
    assert tables.updated_table(table, {"be": 65536, "idle": 0}) == (1, 2, 65536, 0)
    assert tables.updated_table(table, {"rt": MAX}) == (1, MAX, 3, 4)
    assert tables.updated_table(table, {}) == table
    assert table == (1, 2, 3, 4)


@pytest.mark.parametrize(("value", "message"), [
    pytest.param(-1, "outside 0..", id="negative"),
    pytest.param(MAX + 1, "outside 0..", id="too-large"),
    pytest.param(2**64, "outside 0..", id="huge"),
    pytest.param(4096.0, "not an integer", id="float"),
    pytest.param(True, "not an integer", id="bool-true"),
    pytest.param(False, "not an integer", id="bool-false"),
    pytest.param("4096", "not an integer", id="string"),
    pytest.param(None, "not an integer", id="null"),
    pytest.param([4096], "not an integer", id="list"),
])
def test_check_threshold_rejects(value, message):
    with pytest.raises(ConfigError, match=f"threshold be: .*{message}"):
        tables.check_threshold("be", value)


@pytest.mark.parametrize("value", [0, 1, 4096, MAX])
def test_check_threshold_accepts(value):
    assert tables.check_threshold("be", value) == value


@pytest.mark.parametrize(("changes", "message"), [
    pytest.param({"bogus": 1}, "unknown I/O class 'bogus'", id="unknown-class"),
    pytest.param({"": 1}, "unknown I/O class ''", id="empty-class"),
    pytest.param({"be": -1}, "outside", id="negative"),
    pytest.param({"be": 1.5}, "not an integer", id="float"),
    # one bad value refuses the whole change: nothing half-applied
    pytest.param({"be": 65536, "rt": "x"}, "not an integer", id="one-bad-of-two"),
    pytest.param({"be": 65536, "nope": 1}, "unknown I/O class", id="one-unknown-of-two"),
])
def test_updated_table_rejects(changes, message):
    with pytest.raises(ConfigError, match=message):
        tables.updated_table((4096,) * 4, changes)


@pytest.mark.parametrize(("name", "expected"), [
    ("", None), ("disk", None), ("@rt", 1), ("@idle", 3), ("@be", 2), ("@none", 0),
    ("name@none", 0), ("root@idle", 3), ("a@b@rt", 1),  # the last '@' names the class
])
def test_class_from_export_name(name, expected):
    assert ioprio.class_from_export_name(name) == expected


@pytest.mark.parametrize("name", ["@bogus", "name@", "@", "disk@rtx"])
def test_class_from_export_name_rejects(name):
    with pytest.raises(ConfigError, match="export name: unknown I/O class"):
        ioprio.class_from_export_name(name)


@pytest.fixture
def ioniced():
    """ioniced(class) → pid of a real process running under `ionice -c CLASS`."""
    procs = []

    def start(io_class: int) -> int:
        if io_class == 1 and os.geteuid() != 0:
            pytest.skip("the realtime I/O class needs root (CAP_SYS_ADMIN)")
        # ionice sets the class, then execs sh, which says so and execs cat: one pid
        proc = subprocess.Popen(["ionice", "-c", str(io_class), "sh", "-c",
                                 "echo ready; exec cat"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline() == "ready\n"
        return proc.pid

    yield start
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()


@pytest.mark.parametrize("io_class", [0, 1, 2, 3])
def test_ioprio_class_of_a_real_process(ioniced, io_class):
    assert ioprio.ioprio_class_of_pid(ioniced(io_class)) == io_class


@pytest.mark.parametrize(("export_name", "peer_class", "default", "expected"), [
    ("@rt", 3, 2, 1),      # the export name wins over the peer's class
    ("", 3, 2, 3),         # no name: the peer's class
    ("", 1, 2, 1),
    ("", 0, 3, 3),         # peer class none falls back to the default
    ("plain", 0, 2, 2),
])
def test_connection_class(ioniced, export_name, peer_class, default, expected):
    assert ioprio.connection_class(export_name, ioniced(peer_class), default) == expected


def test_connection_class_without_a_peer_uses_the_default():
    assert ioprio.connection_class("", -1, 3) == 3
    assert ioprio.connection_class("", 0, 1) == 1

"""Through a real server: the table picks the path, and each connection lands in its class.

Which path and class served a read is taken from the server's own `stats` rows after a
reset, and the bytes from libnbd, compared with the data image.
"""

from __future__ import annotations

import hashlib
import os
import sys
import textwrap

import nbd
import pytest

from .harness import CLASSES, nbd_client, run

KIB = 1024
OFFSET = 1 << 20  # a 64 KiB read well inside the device, on a block boundary


@pytest.fixture(scope="module")
def server(module_servers, image):
    """Default class idle, so a peer of class none visibly takes the fallback; rt, be and
    none (served as be) may be named: classes above the default need the permission."""
    return module_servers.start(image, "--default-class", "idle", "--allow-class", "rt",
                                "--allow-class", "be", "--allow-class", "none")


@pytest.fixture
def fresh(server):
    """The module's server with the default table back and its counters zeroed."""
    server.ask({"cmd": "thresholds", "preset": "default"})
    server.reset_stats()
    return server


def only(counts: dict, io_class: str, path: str | None = None) -> int:
    """Requests counted in one class (and path); asserts every other row is zero."""
    rows = {key: n for key, n in counts.items() if n}
    mine = {key: n for key, n in rows.items()
            if key[0] == io_class and (path is None or key[1] == path)}
    assert rows == mine, f"requests outside {io_class}/{path or '*'}: {rows}"
    return sum(mine.values())


def test_threshold_moves_a_64k_read_between_inline_and_pool(fresh, image):
    server = fresh
    expected = image.expected(OFFSET, 64 * KIB)
    with server.client("@be") as h:
        assert server.set_thresholds(be=65536)["be"] == 65536
        inline_bytes = h.pread(64 * KIB, OFFSET)
        assert only(server.counts(), "be", "inline") == 1
        assert server.stats()["classes"]["be"]["inline"]["bytes"] == 64 * KIB

        server.reset_stats()
        assert server.set_thresholds(be=4096)["be"] == 4096
        pool_bytes = h.pread(64 * KIB, OFFSET)
        assert only(server.counts(), "be", "pool") == 1
        assert server.stats()["classes"]["be"]["pool"]["bytes"] == 64 * KIB

        server.reset_stats()
        server.set_thresholds(be=65535)  # one byte short: the boundary is inclusive
        boundary_bytes = h.pread(64 * KIB, OFFSET)
        assert only(server.counts(), "be", "pool") == 1
    assert inline_bytes == pool_bytes == boundary_bytes == expected


def test_change_applies_to_an_open_connection_per_request(fresh, image):
    """One connection, the table changed between its reads: each read follows the table
    in force when it arrived."""
    server = fresh
    with server.client("@rt") as h:
        for threshold, path in [(0, "pool"), (1 << 20, "inline"), (0, "pool")]:
            server.reset_stats()
            server.set_thresholds(rt=threshold)
            assert h.pread(8 * KIB, 4096) == image.expected(4096, 8 * KIB)
            assert only(server.counts(), "rt", path) == 1


@pytest.mark.parametrize(("export_name", "io_class"), [
    ("@rt", "rt"), ("@idle", "idle"), ("name@none", "none"), ("@be", "be"),
    ("disk@IDLE", "idle"),
])
def test_export_name_picks_the_class(fresh, image, export_name, io_class):
    with fresh.client(export_name) as h:
        assert h.pread(4096, 8192) == image.expected(8192, 4096)
        assert h.pread(128 * KIB, 0) == image.expected(0, 128 * KIB)
    assert only(fresh.counts(), io_class) == 2


CLIENT = textwrap.dedent("""
    import hashlib, sys, nbd
    h = nbd.NBD()
    if sys.argv[2]:
        h.set_export_name(sys.argv[2])
    h.connect_unix(sys.argv[1])
    print(hashlib.sha256(h.pread(65536, 0)).hexdigest())
    h.shutdown()
""")


@pytest.mark.parametrize(("ionice", "export_name", "io_class"), [
    (["-c1", "-n0"], "", "rt"),
    (["-c2", "-n7"], "", "be"),
    (["-c3"], "", "idle"),
    (["-c0"], "", "idle"),  # class none: the server's default (idle here)
    (["-c3"], "@rt", "rt"),  # an export name beats the peer's class
])
def test_peer_ioprio_picks_the_class(fresh, image, ionice, export_name, io_class):
    if ionice[0] == "-c1" and os.geteuid() != 0:
        pytest.skip("the realtime I/O class needs root (CAP_SYS_ADMIN)")
    result = run(["ionice", *ionice, sys.executable, "-c", CLIENT, fresh.socket, export_name])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == hashlib.sha256(image.expected(0, 65536)).hexdigest()
    assert only(fresh.counts(), io_class) == 1


@pytest.mark.parametrize("export_name", ["@bogus", "name@", "@rt@"])
def test_unknown_class_in_export_name_is_refused(fresh, image, export_name):
    with pytest.raises(nbd.Error), nbd_client(fresh.socket, export_name):
        pass
    assert fresh.alive()
    with fresh.client("@be") as h:
        assert h.pread(64 * KIB, 0) == image.expected(0, 64 * KIB)
    assert only(fresh.counts(), "be") == 1
    named = export_name.rpartition("@")[2]
    assert f"export name: unknown I/O class {named!r}" in fresh.log()


def test_stats_rows_cover_every_class(fresh):
    classes = fresh.stats()["classes"]
    assert sorted(classes) == sorted(CLASSES)
    for name in CLASSES:
        assert set(classes[name]) == {"inline", "pool"}

